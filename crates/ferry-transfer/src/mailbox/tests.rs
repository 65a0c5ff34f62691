use super::*;
use std::sync::atomic::AtomicUsize;

/// Two ranks of one node (local ranks 0 and 1) whose mailboxes serve each other, in one
/// process: what two processes do, each through its own mapping of the other's rings.
fn pair() -> (Mailbox, Mailbox) {
    let (a, b) = (inbound(0, 2).unwrap(), inbound(1, 2).unwrap());
    let (ca, cb) = (a.caps().unwrap(), b.caps().unwrap());
    let to_b = open_peer(&a, &cb).unwrap();
    let to_a = open_peer(&b, &ca).unwrap();
    let counters = Arc::new(MemoryCounters::new(0));
    (
        Mailbox::new(a, vec![(1, 1, to_b)], counters.clone()),
        Mailbox::new(b, vec![(0, 0, to_a)], counters),
    )
}

/// Outcomes of callbacks, in the order they ran.
type Log = Arc<Mutex<Vec<(&'static str, Result<()>)>>>;

/// A callback that records its outcome.
fn record(log: &Log, name: &'static str) -> Done {
    let log = log.clone();
    Box::new(move |r| log.lock().unwrap().push((name, r)))
}

fn bytes(b: &Small) -> Vec<u8> {
    // SAFETY: no receive into it is in flight once its callback ran.
    unsafe { b.get().to_vec() }
}

/// Messages wanted before and after they come are matched by peer, channel and tag, oldest
/// first for one key; callbacks run in polls only; counts go to `control-ring`.
#[test]
fn messages_match_their_receives_by_channel_and_tag() {
    let (a, b) = pair();
    let log = Arc::new(Mutex::new(Vec::new()));
    // Wanted first: a data receive of tag 7.
    let early_want = Small::zeroed(3);
    b.want(0, Lane::Data, 7, early_want.clone(), record(&log, "want 7"));
    // Sent: an acknowledgement of tag 7 (another channel), then two data messages of tag 9
    // and one of tag 7.
    a.send(1, Lane::Control, 7, &Small::new(&[1; 8]), record(&log, "sent ack 7"));
    a.send(1, Lane::Data, 9, &Small::new(&[2, 2]), record(&log, "sent 9a"));
    a.send(1, Lane::Data, 9, &Small::new(&[3, 3]), record(&log, "sent 9b"));
    a.send(1, Lane::Data, 7, &Small::new(&[4, 4, 4]), record(&log, "sent 7"));
    assert!(log.lock().unwrap().is_empty(), "no callback before a poll");
    let p = b.poll();
    assert!(p.worked && p.expecting);
    assert_eq!(bytes(&early_want), [4, 4, 4]);
    // Wanted after they came: tag 9 twice (in order), the acknowledgement.
    let (x, y, ack) = (Small::zeroed(2), Small::zeroed(2), Small::zeroed(8));
    b.want(0, Lane::Data, 9, x.clone(), record(&log, "want 9a"));
    b.want(0, Lane::Data, 9, y.clone(), record(&log, "want 9b"));
    b.want(0, Lane::Control, 7, ack.clone(), record(&log, "want ack 7"));
    assert_eq!(
        log.lock().unwrap().len(),
        1,
        "matched at `want`, completed by the next poll"
    );
    assert!(b.poll().worked);
    assert!(a.poll().worked, "the sender's callbacks run in its own polls");
    assert_eq!(
        (bytes(&x), bytes(&y), bytes(&ack)),
        (vec![2, 2], vec![3, 3], vec![1; 8])
    );
    let names: Vec<&str> = log
        .lock()
        .unwrap()
        .iter()
        .map(|(n, r)| {
            assert!(r.is_ok(), "{n}: {r:?}");
            *n
        })
        .collect();
    assert_eq!(
        names,
        [
            "want 7",
            "want 9a",
            "want 9b",
            "want ack 7",
            "sent ack 7",
            "sent 9a",
            "sent 9b",
            "sent 7"
        ]
    );
    let p = b.poll();
    assert!(!p.worked && !p.expecting, "nothing left: {p:?}");
    let c = a.counters.path(TrafficPath::ControlRing);
    assert_eq!((c.sends.load(Relaxed), c.recvs.load(Relaxed)), (4, 4));
    assert_eq!(c.bytes_sent.load(Relaxed), 8 + 2 + 2 + 3);
}

/// A message of another length than its receive's buffer fails that receive with a protocol
/// error naming the peer and tag; an over-long message fails its send; a peer not served
/// fails too. Nothing panics.
#[test]
fn bad_lengths_and_peers_are_protocol_errors() {
    let (a, b) = pair();
    let log = Arc::new(Mutex::new(Vec::new()));
    a.send(1, Lane::Data, 3, &Small::new(&[1; 40]), record(&log, "sent"));
    b.want(0, Lane::Data, 3, Small::zeroed(8), record(&log, "want"));
    a.send(
        1,
        Lane::Data,
        4,
        &Small::new(&[0; ring::PAYLOAD + 1]),
        record(&log, "too long"),
    );
    a.send(5, Lane::Data, 4, &Small::new(&[0; 8]), record(&log, "nobody"));
    b.poll();
    a.poll();
    let log = log.lock().unwrap();
    let err = |name: &str| {
        let (_, r) = log.iter().find(|(n, _)| *n == name).unwrap();
        r.as_ref().unwrap_err().to_string()
    };
    assert!(
        err("want").contains("40 bytes where 8 were expected"),
        "{}",
        err("want")
    );
    assert!(
        err("too long").contains(&format!("{} bytes", ring::PAYLOAD + 1)),
        "{}",
        err("too long")
    );
    assert!(err("nobody").contains("no control ring"), "{}", err("nobody"));
    assert!(log.iter().any(|(n, r)| *n == "sent" && r.is_ok()));
}

/// Wants `n` messages of 4 bytes from `a` on `channel`, tags `0..n`, and polls both ends until
/// they have come (at most 10 rounds); returns the numbers they carried, in arrival order.
fn receive_numbered(a: &Mailbox, b: &Mailbox, channel: Lane, n: usize) -> Vec<u32> {
    let got = Arc::new(Mutex::new(Vec::new()));
    for k in 0..n {
        let buf = Small::zeroed(4);
        let (g, b2) = (got.clone(), buf.clone());
        let done: Done = Box::new(move |r| {
            r.unwrap();
            g.lock()
                .unwrap()
                .push(u32::from_le_bytes(bytes(&b2).try_into().unwrap()));
        });
        b.want(0, channel, k as i32, buf, done);
    }
    let mut rounds = 0;
    while got.lock().unwrap().len() < n {
        b.poll();
        a.poll();
        rounds += 1;
        assert!(rounds < 10, "stuck at {} of {n}", got.lock().unwrap().len());
    }
    a.poll();
    let got = got.lock().unwrap().clone();
    got
}

/// More messages than a ring holds: the rest wait in order and go as the receiver makes
/// room, each reported sent only once it is in the ring; the sender's polls say they expect
/// more until then, and every message arrives once, in order.
#[test]
fn a_full_ring_keeps_the_rest_in_order() {
    let (a, b) = pair();
    let n = ring::SLOTS * 2 + 5;
    let sent = Arc::new(AtomicUsize::new(0));
    for k in 0..n {
        let s = sent.clone();
        let done: Done = Box::new(move |r| {
            r.unwrap();
            s.fetch_add(1, Relaxed);
        });
        a.send(1, Lane::Data, k as i32, &Small::new(&(k as u32).to_le_bytes()), done);
    }
    assert_eq!(a.out[0].1.lock().unwrap().overflow.len(), n - ring::SLOTS);
    assert!(a.sending());
    let p = a.poll();
    assert!(p.expecting, "messages wait for room");
    assert_eq!(
        sent.load(Relaxed),
        ring::SLOTS,
        "only what is in the ring counts as sent"
    );
    assert_eq!(
        receive_numbered(&a, &b, Lane::Data, n),
        (0..n as u32).collect::<Vec<_>>()
    );
    assert_eq!(sent.load(Relaxed), n);
    assert!(!a.sending());
}

/// After `n` acknowledgements to `b` (`ring::SLOTS` of them straight into the ring, the rest
/// waiting for room) and one more, numbered `n`, to a peer not served: no callback has run
/// before a poll; the poll runs the refused one with its error; every message arrives, in
/// order, and the callbacks of those that waited run once each, in order.
fn overflowed_then_refused(a: &Mailbox, b: &Mailbox, ran: &Mutex<Vec<(usize, bool)>>, n: usize) {
    assert!(ran.lock().unwrap().is_empty(), "callbacks run in polls only");
    a.poll();
    assert_eq!(*ran.lock().unwrap(), [(n, false)], "only the refused one ran");
    assert_eq!(
        receive_numbered(a, b, Lane::Control, n),
        (0..n as u32).collect::<Vec<_>>()
    );
    let waited: Vec<(usize, bool)> = (ring::SLOTS..n).map(|k| (k, true)).collect();
    assert_eq!(
        ran.lock().unwrap()[1..],
        waited[..],
        "the ones that waited ran once, in order"
    );
}

/// A message sent "here" that goes straight into the ring gives its callback back (the
/// sender's polls have nothing to run); one that must wait for room runs it once in the
/// ring; one to a peer not served runs it with the error. Every message arrives, in order.
#[test]
fn messages_sent_here_leave_their_callback_to_the_sender_when_they_go_at_once() {
    let (a, b) = pair();
    let ran = Arc::new(Mutex::new(Vec::new()));
    let note = |k: usize| -> Done {
        let r2 = ran.clone();
        Box::new(move |r| r2.lock().unwrap().push((k, r.is_ok())))
    };
    let n = ring::SLOTS + 3;
    for k in 0..n {
        let back = a.send_here(1, Lane::Control, k as i32, &(k as u32).to_le_bytes(), note(k));
        // Given back (and dropped here) while the ring has room; kept to run later after.
        assert_eq!(back.is_some(), k < ring::SLOTS, "message {k}");
    }
    assert!(a.send_here(7, Lane::Control, 0, &[0; 4], note(n)).is_none(), "refused");
    overflowed_then_refused(&a, &b, &ran, n);
}

/// An unwatched message makes its callback only when it must wait for room (then it runs
/// once, in the poll that pushes the message) or is refused (then it runs with the error);
/// every message arrives, in order.
#[test]
fn unwatched_messages_make_a_callback_only_when_they_need_one() {
    let (a, b) = pair();
    let made = Arc::new(Mutex::new(Vec::new()));
    let ran = Arc::new(Mutex::new(Vec::new()));
    let maker = |k: usize| {
        let (made, ran) = (made.clone(), ran.clone());
        move || -> Done {
            made.lock().unwrap().push(k);
            Box::new(move |r| ran.lock().unwrap().push((k, r.is_ok())))
        }
    };
    let n = ring::SLOTS + 3;
    for k in 0..n {
        a.send_unwatched(1, Lane::Control, k as i32, &(k as u32).to_le_bytes(), maker(k));
    }
    assert_eq!(
        *made.lock().unwrap(),
        (ring::SLOTS..n).collect::<Vec<_>>(),
        "callbacks made only for the messages that found the ring full"
    );
    a.send_unwatched(7, Lane::Control, 0, &[0; 4], maker(n));
    assert_eq!(made.lock().unwrap().last(), Some(&n), "a refused message makes one");
    overflowed_then_refused(&a, &b, &ran, n);
}

/// Closing fails what still waits — receives wanted, messages without room — so their
/// callbacks (and what they hold) do not outlive the run; what already came is dropped.
#[test]
fn closing_fails_what_still_waits() {
    let (a, b) = pair();
    let log = Arc::new(Mutex::new(Vec::new()));
    b.want(0, Lane::Control, 1, Small::zeroed(8), record(&log, "wanted"));
    for _ in 0..ring::SLOTS {
        a.send(1, Lane::Data, 2, &Small::new(&[0; 8]), Box::new(|r| r.unwrap()));
    }
    a.send(1, Lane::Data, 3, &Small::new(&[0; 8]), record(&log, "no room"));
    b.close();
    a.close();
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 2, "{log:?}");
    for (name, r) in log.iter() {
        let e = r.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("shut down"), "{name}: {e}");
    }
    assert!(!a.sending());
}

/// A poll that expected nothing leaves its thread free to block: the next `want` or send
/// wakes it (once), so a message that then comes is not left unread.
#[test]
fn a_want_after_an_idle_poll_wakes_the_poller() {
    let (a, b) = pair();
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    b.set_waker(Box::new(move || {
        w.fetch_add(1, Relaxed);
    }));
    assert!(!b.poll().expecting);
    b.want(0, Lane::Control, 1, Small::zeroed(8), Box::new(|r| r.unwrap()));
    assert_eq!(wakes.load(Relaxed), 1);
    b.want(0, Lane::Control, 2, Small::zeroed(8), Box::new(|r| r.unwrap()));
    assert_eq!(
        wakes.load(Relaxed),
        1,
        "no wake while the poller is known to be polling"
    );
    assert!(b.poll().expecting, "two receives wait");
    a.send(1, Lane::Control, 1, &Small::new(&[0; 8]), Box::new(|r| r.unwrap()));
    a.send(1, Lane::Control, 2, &Small::new(&[0; 8]), Box::new(|r| r.unwrap()));
    assert!(b.poll().worked);
    assert!(!b.poll().expecting);
}

/// A peer's rings without one for this rank, or a peer claiming this rank's own ring, are
/// refused at start-up (the pair then stays on MPI).
#[test]
fn rings_that_do_not_fit_are_refused() {
    let a = inbound(2, 3).unwrap();
    let small = inbound(0, 2).unwrap();
    let e = open_peer(&a, &small.caps().unwrap()).err().expect("refused");
    assert!(e.to_string().contains("none for local rank 2"), "{e}");
    let same = inbound(2, 3).unwrap();
    assert!(open_peer(&a, &same.caps().unwrap()).is_err(), "its own ring");
    // Another file than the one published (what a peer in another PID namespace would
    // open by the same pid and descriptor): its nonce differs.
    let other = inbound(0, 3).unwrap();
    let wrong = MailboxCaps {
        nonce: other.caps().unwrap().nonce ^ 1,
        ..other.caps().unwrap()
    };
    let e = open_peer(&a, &wrong).err().expect("refused");
    assert!(e.to_string().contains("not the peer's rings"), "{e}");
    assert!(open_peer(&a, &other.caps().unwrap()).is_ok());
}

/// Tiles travel on a channel of their own: a tile and a control message of the same tag each
/// match their own receive, whichever comes first; a tile that went straight into the ring
/// gives its callback back to the sender; tiles count on `host-ring` (both sides), control
/// messages on `control-ring`; a tile of another length than its landing fails that receive
/// with a size mismatch, as over MPI.
#[test]
fn tiles_match_only_tile_receives_and_count_on_the_host_ring() {
    let (a, b) = pair();
    let log = Arc::new(Mutex::new(Vec::new()));
    // A tile of tag 5 wanted before it comes; a control message of tag 5 sent first.
    let tile = Small::zeroed(16);
    b.want_tile(0, 5, tile.clone(), record(&log, "want tile 5"));
    a.send(1, Lane::Data, 5, &Small::new(&[9; 4]), record(&log, "sent data 5"));
    let back = a.send_tile_here(1, 5, &[7; 16], record(&log, "sent tile 5"));
    let back = back.expect("a slot that went straight in gives its callback back");
    back(Ok(()));
    // A tile of tag 6 that comes before its receive, and one of the wrong length.
    assert!(a.send_tile_here(1, 6, &[3; 16], record(&log, "sent tile 6")).is_some());
    assert!(a.send_tile_here(1, 8, &[1; 12], record(&log, "sent tile 8")).is_some());
    b.poll();
    assert_eq!(bytes(&tile), [7; 16], "the tile, not the control message of its tag");
    let (late, data, short) = (Small::zeroed(16), Small::zeroed(4), Small::zeroed(16));
    b.want_tile(0, 6, late.clone(), record(&log, "want tile 6"));
    b.want(0, Lane::Data, 5, data.clone(), record(&log, "want data 5"));
    b.want_tile(0, 8, short, record(&log, "want tile 8"));
    b.poll();
    a.poll();
    assert_eq!((bytes(&late), bytes(&data)), (vec![3; 16], vec![9; 4]));
    let log = log.lock().unwrap();
    for name in [
        "want tile 5",
        "sent data 5",
        "sent tile 5",
        "want tile 6",
        "want data 5",
    ] {
        let (_, r) = log
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("{name} ran"));
        assert!(r.is_ok(), "{name}: {r:?}");
    }
    let (_, r) = log.iter().find(|(n, _)| *n == "want tile 8").unwrap();
    let e = r.as_ref().unwrap_err().to_string();
    assert!(e.contains("has 12 bytes, expected 16: the ranks disagree"), "{e}");
    let tiles = a.counters.path(TrafficPath::HostRing);
    assert_eq!((tiles.sends.load(Relaxed), tiles.recvs.load(Relaxed)), (3, 3));
    assert_eq!(tiles.bytes_sent.load(Relaxed), 16 + 16 + 12);
    let control = a.counters.path(TrafficPath::ControlRing);
    assert_eq!((control.sends.load(Relaxed), control.recvs.load(Relaxed)), (1, 1));
}
