use super::*;
use crate::counters::MemoryCounters;
use crate::manager::GpuCmd;
use crossbeam::channel;
use ferry_device::emu::{EmuBackend, EmuConfig};
use std::sync::Mutex;

/// A manager of one emulated device (1 MiB pool, 2 exec streams) whose stream operations
/// complete up to `delay_us` late; its command channels are closed (the tests drive it).
fn manager(delay_us: u64, counters: Arc<MemoryCounters>) -> Manager<EmuBackend> {
    let cfg = EmuConfig {
        devices: 1,
        capacity: 1 << 20,
        exec_streams: 2,
        fail_alloc: Vec::new(),
        fail_copy: Vec::new(),
        delay_us,
        seed: 7,
    };
    let (_, rx) = channel::unbounded();
    let (_, rel_rx) = channel::unbounded();
    Manager::new(EmuBackend::new(&cfg).unwrap(), rx, rel_rx, counters)
}

/// Ends the pass (enqueues the gathered copies), then polls until `left` reaches zero.
fn settle(m: &mut Manager<EmuBackend>, left: &Arc<Mutex<usize>>) {
    m.flush_copies();
    let t0 = std::time::Instant::now();
    while *left.lock().unwrap() > 0 {
        m.poll();
        assert!(t0.elapsed().as_secs() < 10, "copies did not complete");
    }
}

fn op(dst: Mem, src: Mem, len: usize, stream: Stream, independent: bool) -> CopyOp {
    CopyOp {
        counted: false,
        independent,
        ..CopyOp::plain(0, stream, src, dst, len, TrafficPath::Ipc)
    }
}

/// Independent copies that reach the manager in one pass go as one batch behind one event,
/// each completes with its own callback, and every destination gets its own source's bytes;
/// a dependent copy goes alone; copies waiting for different signal words go apart.
#[test]
fn independent_copies_of_one_pass_go_in_one_batch() {
    const K: usize = 8;
    const LEN: usize = 4096;
    let counters = Arc::new(MemoryCounters::new(1));
    let mut m = manager(50, counters.clone());
    let left = Arc::new(Mutex::new(0usize));
    let then = |left: &Arc<Mutex<usize>>| -> Then {
        *left.lock().unwrap() += 1;
        let l = left.clone();
        Box::new(move |r| {
            r.unwrap();
            *l.lock().unwrap() -= 1;
        })
    };
    // K source blocks of distinct bytes at offsets k·LEN, filled from the host (dependent).
    let mut host: Vec<u8> = (0..K * LEN).map(|i| (i / LEN * 37 + i % 251) as u8).collect();
    let t = then(&left);
    m.start_copy(
        op(
            Mem::Pool(0),
            Mem::Host(host.as_mut_ptr()),
            K * LEN,
            Stream::Comm(0),
            false,
        ),
        t,
    );
    assert!(m.xfer.pending_copies.is_empty(), "a dependent copy is enqueued at once");
    settle(&mut m, &left);
    // K independent copies to offsets (K + k)·LEN, on different streams: one batch.
    for k in 0..K {
        let t = then(&left);
        let stream = Stream::Comm(k % ferry_device::COMM_STREAMS);
        let (dst, src) = (((K + k) * LEN) as u64, (k * LEN) as u64);
        m.start_copy(op(Mem::Pool(dst), Mem::Pool(src), LEN, stream, true), t);
    }
    assert_eq!(m.xfer.pending_copies.len(), K);
    settle(&mut m, &left);
    let c = counters.device(0);
    assert_eq!(c.copy_batches.load(Relaxed), 1);
    assert_eq!(c.batched_copies.load(Relaxed), K as u64);
    // Back to the host: each destination holds its own source's bytes.
    let mut back = vec![0u8; K * LEN];
    let t = then(&left);
    m.start_copy(
        op(
            Mem::Host(back.as_mut_ptr()),
            Mem::Pool((K * LEN) as u64),
            K * LEN,
            Stream::Comm(1),
            false,
        ),
        t,
    );
    settle(&mut m, &left);
    assert!(back == host, "a batched copy moved the wrong bytes");
    assert_eq!(c.copy_batches.load(Relaxed), 1, "lone copies are not batches");
    // Another command ends a run of copies: they go before it, as a batch of their own.
    for k in 0..3 {
        let t = then(&left);
        let (dst, src) = (((K + k) * LEN) as u64, (k * LEN) as u64);
        m.start_copy(op(Mem::Pool(dst), Mem::Pool(src), LEN, Stream::Comm(k), true), t);
    }
    let (tx, _report) = channel::bounded(1);
    m.handle(GpuCmd::Report(tx));
    assert!(
        m.xfer.pending_copies.is_empty(),
        "a command after a run of copies flushes them"
    );
    assert_eq!(c.copy_batches.load(Relaxed), 2);
    assert_eq!(c.batched_copies.load(Relaxed), K as u64 + 3);
    settle(&mut m, &left);
    // Pulls offered at their producer's launch that wait on the device batch only with
    // pulls that wait for the same signal word: two on word 1 go together, the one on word
    // 2 alone (the manager holds none here: `hold_for` is zero).
    let peer = m.b.ipc_attach(0, m.b.addr(0, 0), m.b.pool_bytes(0), None).unwrap();
    let word = |slot: usize| Mem::Remote {
        pool: peer,
        off: ferry_device::signal_offset(1 << 20, slot),
    };
    let pulls = |m: &mut Manager<EmuBackend>| {
        for (k, slot) in [(0, 1), (1, 2), (2, 1)] {
            let t = then(&left);
            let (dst, src) = (((K + k) * LEN) as u64, (k * LEN) as u64);
            let mut o = op(Mem::Pool(dst), Mem::Pool(src), LEN, Stream::Comm(k), true);
            o.after = Some((word(slot), 1));
            m.start_copy(o, t);
        }
        m.flush_copies();
    };
    pulls(&mut m);
    assert_eq!(c.copy_batches.load(Relaxed), 3);
    assert_eq!(c.batched_copies.load(Relaxed), K as u64 + 5);
    m.b.signal(0, Stream::Exec(0), 1, 1).unwrap();
    m.b.signal(0, Stream::Exec(1), 2, 1).unwrap();
    settle(&mut m, &left);
    // Once their signals show on the host, they wait for nothing: one batch.
    pulls(&mut m);
    assert_eq!(c.copy_batches.load(Relaxed), 4);
    assert_eq!(c.batched_copies.load(Relaxed), K as u64 + 8);
    assert_eq!(c.offers_seen.load(Relaxed), 3);
    settle(&mut m, &left);
}

/// comm-in: the copy a reservation's callback returns is started by the manager, and a
/// copy that fills a reserved block lands it before its `then` runs — valid there (and on
/// the host when `host_too`), unpinned, in the LRU. A copy that fails to enqueue, or that
/// shutdown abandons, only releases the pin.
#[test]
fn a_filling_copy_lands_its_block_before_then() {
    const LEN: usize = 4096;
    let counters = Arc::new(MemoryCounters::new(1));
    let mut m = manager(20, counters);
    let env = crate::data::copy::CopyEnv {
        devices: 1,
        ..Default::default()
    };
    // (copy ok, valid on the device, valid on the host, pins) as `then` sees them.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let then = |copy: &Arc<TileCopy>| -> Then {
        let (c, s) = (copy.clone(), seen.clone());
        Box::new(move |r| {
            let st = c.lock();
            s.lock()
                .unwrap()
                .push((r.is_ok(), st.dev[0].valid, st.host_valid, st.dev[0].pins));
        })
    };
    let filling = |copy: &Arc<TileCopy>, p: Placed, src: Mem, host_too: bool| -> CopyOp {
        let mut o = op(Mem::Pool(p.offset), src, LEN, Stream::Comm(0), true);
        o.fills = Some(Fill {
            copy: copy.clone(),
            host_too,
        });
        o
    };
    let mut src = vec![5u8; LEN];
    let host = Mem::Host(src.as_mut_ptr());
    // Through the command: the reservation's callback returns the copy.
    let good = TileCopy::host(LEN, &env);
    let (g, t) = (good.clone(), then(&good));
    m.handle(GpuCmd::Reserve {
        copy: good.clone(),
        then: Box::new(move |p| {
            let p = p.expect("room for the block");
            assert_eq!(g.lock().dev[0].pins, 1, "reserved and pinned");
            Some((filling(&g, p, host, true), t))
        }),
    });
    m.flush_copies();
    let t0 = std::time::Instant::now();
    while seen.lock().unwrap().is_empty() {
        m.poll();
        assert!(t0.elapsed().as_secs() < 10, "the copy did not complete");
    }
    assert_eq!(seen.lock().unwrap()[0], (true, true, true, 0), "landed before `then`");
    let in_lru = |m: &Manager<EmuBackend>, c: &Arc<TileCopy>| {
        m.mem.lru[0]
            .iter()
            .any(|(w, _)| w.upgrade().is_some_and(|x| Arc::ptr_eq(&x, c)))
    };
    assert!(in_lru(&m, &good));
    // A remote pool that is not mapped: the enqueue fails, the pin goes, nothing lands.
    let bad = TileCopy::host(LEN, &env);
    bad.lock().host_valid = false;
    let p = m.reserve(&bad).expect("room for the block");
    m.start_copy(filling(&bad, p, Mem::Remote { pool: 9, off: 0 }, false), then(&bad));
    m.flush_copies();
    assert_eq!(seen.lock().unwrap()[1], (false, false, false, 0));
    assert!(!in_lru(&m, &bad));
    // Abandoned at shutdown while waiting to be batched: the pin goes, nothing lands.
    let left = TileCopy::host(LEN, &env);
    left.lock().host_valid = false;
    let p = m.reserve(&left).expect("room for the block");
    m.start_copy(filling(&left, p, host, false), then(&left));
    assert_eq!(m.xfer.pending_copies.len(), 1);
    m.abandon_copies();
    assert_eq!(seen.lock().unwrap()[2], (false, false, false, 0));
    assert!(!in_lru(&m, &left));
    drop(src);
}

/// Copies of one stream that all landed between two polls are completed, in issue order,
/// with one completion query (the newest's), not one each; a copy still in flight stops the
/// stream's completions at it.
#[test]
fn landed_copies_of_a_stream_are_settled_by_one_query() {
    const K: usize = 5;
    const LEN: usize = 4096;
    let mut m = manager(0, Arc::new(MemoryCounters::new(1)));
    let order = Arc::new(Mutex::new(Vec::new()));
    let enqueue = |m: &mut Manager<EmuBackend>, k: usize, after: Option<(Mem, u64)>| {
        let o = order.clone();
        let (dst, src) = (((K + k) * LEN) as u64, (k * LEN) as u64);
        // Comm stream 1: signal-waiting copies never go on stream 0 (acknowledged pulls'),
        // and this test keeps every copy on one stream.
        let mut c = op(Mem::Pool(dst), Mem::Pool(src), LEN, Stream::Comm(1), false);
        c.after = after;
        m.start_copy(
            c,
            Box::new(move |r| {
                r.unwrap();
                o.lock().unwrap().push(k);
            }),
        );
    };
    for k in 0..K {
        enqueue(&mut m, k, None);
    }
    // Let the stream finish them all before the manager looks (the newest's event done
    // means every one before it on the stream is).
    let newest = m.xfer.copies.back().unwrap().event.clone();
    m.b.synchronize(&newest).unwrap();
    m.b.queries = 0;
    assert!(m.poll());
    assert_eq!(*order.lock().unwrap(), (0..K).collect::<Vec<_>>());
    assert_eq!(m.b.queries, 1, "one query settles a stream's landed copies");
    assert!(m.xfer.copies.is_empty());
    // A copy that waits for a signal word nobody has written holds the stream: neither it
    // nor the copy behind it completes, and the poll says nothing happened.
    let peer = m.b.ipc_attach(0, m.b.addr(0, 0), m.b.pool_bytes(0), None).unwrap();
    let word = Mem::Remote {
        pool: peer,
        off: ferry_device::signal_offset(1 << 20, 3),
    };
    enqueue(&mut m, 0, Some((word, 1)));
    enqueue(&mut m, 1, None);
    m.b.queries = 0;
    assert!(!m.poll());
    assert_eq!(order.lock().unwrap().len(), K);
    assert_eq!(m.b.queries, 2, "the newest, then the oldest: both in flight");
    // The word written: both land, in order.
    m.b.signal(0, Stream::Exec(1), 3, 1).unwrap();
    let t0 = std::time::Instant::now();
    while order.lock().unwrap().len() < K + 2 {
        m.poll();
        assert!(t0.elapsed().as_secs() < 10, "the signalled copies did not complete");
    }
    assert_eq!(order.lock().unwrap()[K..], [0, 1]);
}

/// Acknowledged pulls go on the acknowledgement stream whatever stream they came with, and
/// write the producer's word behind their copy; a copy that waits for a signal never goes
/// on that stream (it would put the acknowledgements behind another producer's task).
#[test]
fn acknowledged_copies_write_their_word_on_their_own_stream() {
    let counters = Arc::new(MemoryCounters::new(1));
    let mut m = manager(50, counters.clone());
    let peer = m.b.ipc_attach(0, m.b.addr(0, 0), m.b.pool_bytes(0), None).unwrap();
    let word = Mem::Remote {
        pool: peer,
        off: ferry_device::ack_offset(1 << 20, 5),
    };
    let left = Arc::new(Mutex::new(0usize));
    let then = |left: &Arc<Mutex<usize>>| -> Then {
        *left.lock().unwrap() += 1;
        let l = left.clone();
        Box::new(move |r| {
            r.unwrap();
            *l.lock().unwrap() -= 1;
        })
    };
    let mut acked = op(Mem::Pool(8192), Mem::Pool(0), 4096, Stream::Comm(2), true);
    acked.ack = Some((word, 7));
    m.start_copy(acked, then(&left));
    m.flush_copies();
    assert_eq!(m.xfer.copies.back().unwrap().stream, ACK_STREAM);
    // Waiting for the word it writes: moved off the acknowledgement stream, and it
    // completes only because the acknowledgement was written.
    let mut waits = op(Mem::Pool(16384), Mem::Pool(0), 4096, ACK_STREAM, true);
    waits.after = Some((word, 7));
    m.start_copy(waits, then(&left));
    m.flush_copies();
    assert_ne!(m.xfer.copies.back().unwrap().stream, ACK_STREAM);
    settle(&mut m, &left);
    assert_eq!(counters.device(0).acks_written.load(Relaxed), 1);
}

/// An offered pull whose producer's signal has not shown in its host mirror is held by the
/// manager (no stream wait), and enqueued with no wait the pass the value shows; one whose
/// signal has shown goes at once; with holding off, or once held past its time, it waits on
/// the device instead. Each way is counted.
#[test]
fn offered_pulls_are_held_until_their_signal_shows_on_the_host() {
    let counters = Arc::new(MemoryCounters::new(1));
    let mut m = manager(0, counters.clone());
    m.tune.hold_for = std::time::Duration::from_secs(60);
    let peer = m.b.ipc_attach(0, m.b.addr(0, 0), m.b.pool_bytes(0), None).unwrap();
    let word = Mem::Remote {
        pool: peer,
        off: ferry_device::signal_offset(1 << 20, 3),
    };
    assert!(
        m.b.signal_mirror(0, word).is_some(),
        "an emulated pool is its own mirror"
    );
    let left = Arc::new(Mutex::new(0usize));
    let pull = |m: &mut Manager<EmuBackend>, dst: u64, value: u64| {
        *left.lock().unwrap() += 1;
        let l = left.clone();
        let mut c = op(Mem::Pool(dst), Mem::Pool(0), 4096, Stream::Comm(1), true);
        c.after = Some((word, value));
        m.start_copy(
            c,
            Box::new(move |r| {
                r.unwrap();
                *l.lock().unwrap() -= 1;
            }),
        );
        m.flush_copies();
    };
    let c = counters.device(0);
    let seen = || c.offers_seen.load(Relaxed);
    let waited = || c.offers_waited.load(Relaxed);
    // Not signalled yet: held, nothing enqueued, and passes keep it.
    pull(&mut m, 8192, 1);
    assert!(m.xfer.copies.is_empty() && !m.xfer.held.is_empty());
    assert!(!m.release_held());
    assert!(m.busy(), "a held pull keeps the manager polling");
    // Signalled (the emulated stream stores the word): enqueued without a wait.
    m.b.signal(0, Stream::Exec(1), 3, 1).unwrap();
    let t0 = std::time::Instant::now();
    while !m.release_held() {
        assert!(t0.elapsed().as_secs() < 10, "the signal never showed");
    }
    assert!(m.xfer.held.is_empty());
    assert_eq!((seen(), waited()), (1, 0));
    settle(&mut m, &left);
    // Already signalled: straight to the device, no wait.
    pull(&mut m, 16384, 1);
    assert!(m.xfer.held.is_empty() && !m.xfer.copies.is_empty());
    assert_eq!((seen(), waited()), (2, 0));
    settle(&mut m, &left);
    // Holding off: a stream wait at once, which the signal then releases.
    m.tune.hold_for = std::time::Duration::ZERO;
    pull(&mut m, 24576, 2);
    assert!(m.xfer.held.is_empty() && !m.xfer.copies.is_empty());
    assert_eq!((seen(), waited()), (2, 1));
    m.b.signal(0, Stream::Exec(1), 3, 2).unwrap();
    settle(&mut m, &left);
    // Held past its time: to the device with its wait.
    m.tune.hold_for = std::time::Duration::from_millis(1);
    pull(&mut m, 32768, 3);
    assert!(!m.xfer.held.is_empty());
    std::thread::sleep(std::time::Duration::from_millis(2));
    assert!(m.release_held());
    assert_eq!((seen(), waited(), c.offers_held_out.load(Relaxed)), (2, 2, 1));
    m.b.signal(0, Stream::Exec(1), 3, 3).unwrap();
    settle(&mut m, &left);
    // Asking for a device acknowledgement, held however short the holding time, then
    // enqueued with no wait on the acknowledgement stream, the word written behind it.
    m.tune.hold_for = std::time::Duration::ZERO;
    let ack_word = Mem::Remote {
        pool: peer,
        off: ferry_device::ack_offset(1 << 20, 9),
    };
    *left.lock().unwrap() += 1;
    let l = left.clone();
    let mut acked = op(Mem::Pool(49152), Mem::Pool(0), 4096, Stream::Comm(1), true);
    acked.after = Some((word, 4));
    acked.ack = Some((ack_word, 1));
    m.start_copy(
        acked,
        Box::new(move |r| {
            r.unwrap();
            *l.lock().unwrap() -= 1;
        }),
    );
    m.flush_copies();
    assert!(
        m.xfer.copies.is_empty() && !m.xfer.held.is_empty(),
        "never waits on the device"
    );
    m.b.signal(0, Stream::Exec(1), 3, 4).unwrap();
    let t0 = std::time::Instant::now();
    while !m.release_held() {
        assert!(t0.elapsed().as_secs() < 10, "the signal never showed");
    }
    m.flush_copies();
    assert_eq!(m.xfer.copies.back().unwrap().stream, ACK_STREAM);
    settle(&mut m, &left);
    assert_eq!(c.acks_written.load(Relaxed), 1);
    assert_eq!((seen(), waited()), (3, 2));
    // Asking for one with no mirror to see its signal in: failed, not waited for.
    let failed = Arc::new(Mutex::new(None));
    let f = failed.clone();
    let mut blind = op(Mem::Pool(49152), Mem::Pool(0), 4096, Stream::Comm(1), true);
    blind.after = Some((Mem::Pool(ferry_device::signal_offset(1 << 20, 3)), 9));
    blind.ack = Some((ack_word, 2));
    m.start_copy(blind, Box::new(move |r| *f.lock().unwrap() = Some(r)));
    m.flush_copies();
    let err = failed.lock().unwrap().take().expect("failed at once").unwrap_err();
    assert!(err.to_string().contains("signal mirror"), "{err}");
    assert!(m.xfer.copies.is_empty() && m.xfer.held.is_empty());
    // Pulls that must wait on their own: an acknowledged one whose signal shows already
    // (straight to the acknowledgement stream); two acknowledged ones on one word, of
    // which the first goes as soon as its own value shows (held for the second's, its
    // acknowledgement could wait for a task that waits for it); one that cannot share a
    // batch, held and then enqueued alone.
    let start = |m: &mut Manager<EmuBackend>, o: CopyOp| {
        *left.lock().unwrap() += 1;
        let l = left.clone();
        m.start_copy(
            o,
            Box::new(move |r| {
                r.unwrap();
                *l.lock().unwrap() -= 1;
            }),
        );
    };
    let go = |m: &mut Manager<EmuBackend>, o: CopyOp| {
        start(m, o);
        m.flush_copies();
    };
    let acked = |dst: u64, value: u64, ack: u64| {
        let mut o = op(Mem::Pool(dst), Mem::Pool(0), 4096, Stream::Comm(1), true);
        o.after = Some((word, value));
        o.ack = Some((ack_word, ack));
        o
    };
    go(&mut m, acked(49152, 4, 3));
    assert!(m.xfer.held.is_empty() && m.xfer.copies.back().unwrap().stream == ACK_STREAM);
    settle(&mut m, &left);
    start(&mut m, acked(57344, 5, 4));
    start(&mut m, acked(65536, 6, 5));
    m.flush_copies();
    assert!(m.xfer.copies.is_empty() && m.xfer.held.len() == 2);
    m.b.signal(0, Stream::Exec(1), 3, 5).unwrap();
    let t0 = std::time::Instant::now();
    while m.xfer.copies.is_empty() {
        m.release_held();
        m.flush_copies();
        assert!(
            t0.elapsed().as_secs() < 10,
            "the first acknowledged pull was not released"
        );
    }
    assert_eq!(m.xfer.held.len(), 1, "the second waits for its own value");
    m.b.signal(0, Stream::Exec(1), 3, 6).unwrap();
    while !m.xfer.held.is_empty() {
        m.release_held();
        assert!(
            t0.elapsed().as_secs() < 10,
            "the second acknowledged pull was not released"
        );
    }
    settle(&mut m, &left);
    let batches = c.copy_batches.load(Relaxed);
    let mut alone = op(Mem::Pool(73728), Mem::Pool(0), 4096, Stream::Comm(1), false);
    alone.after = Some((word, 7));
    m.tune.hold_for = std::time::Duration::from_secs(60);
    go(&mut m, alone);
    assert!(m.xfer.copies.is_empty() && !m.xfer.held.is_empty());
    m.b.signal(0, Stream::Exec(1), 3, 7).unwrap();
    while !m.release_held() {
        assert!(t0.elapsed().as_secs() < 10, "the lone pull was not released");
    }
    assert!(
        m.xfer.pending_copies.is_empty() && m.xfer.copies.len() == 1,
        "enqueued alone, at once"
    );
    settle(&mut m, &left);
    assert_eq!(c.copy_batches.load(Relaxed), batches);
    // One that cannot share a batch, acknowledged, its signal shown: enqueued at once with
    // no wait, on the acknowledgement stream.
    let mut o = acked(81920, 7, 6);
    o.independent = false;
    go(&mut m, o);
    assert!(m.xfer.held.is_empty() && m.xfer.copies.back().unwrap().stream == ACK_STREAM);
    settle(&mut m, &left);
    // A shutdown fails what is still held.
    m.tune.hold_for = std::time::Duration::from_secs(60);
    let failed = Arc::new(Mutex::new(false));
    let f = failed.clone();
    let mut c4 = op(Mem::Pool(40960), Mem::Pool(0), 4096, Stream::Comm(1), true);
    c4.after = Some((word, 9));
    m.start_copy(c4, Box::new(move |r| *f.lock().unwrap() = r.is_err()));
    m.flush_copies();
    assert!(!m.xfer.held.is_empty());
    m.abandon_copies();
    assert!(m.xfer.held.is_empty() && *failed.lock().unwrap());
}

/// A batch whose copies were enqueued but whose next step failed (here an acknowledgement
/// word that is not mapped) is failed only once those copies have run: its reserved blocks
/// are given back then, and nothing may still be writing into them.
#[test]
fn a_batch_failed_after_its_copies_is_failed_once_they_have_run() {
    const LEN: usize = 4096;
    let mut m = manager(20_000, Arc::new(MemoryCounters::new(1)));
    let pattern: Vec<u8> = (0..LEN).map(|k| (k * 7 + 1) as u8).collect();
    // SAFETY: pool offset 0 holds LEN bytes; `pattern` outlives the copy (the stream is
    // synchronised below).
    unsafe { m.b.h2d(0, Stream::In, 0, pattern.as_ptr(), LEN) }.unwrap();
    m.b.sync_stream(0, Stream::In).unwrap();
    let mut o = op(Mem::Pool(8192), Mem::Pool(0), LEN, Stream::Comm(2), true);
    o.ack = Some((Mem::Remote { pool: 99, off: 0 }, 1));
    let failed = Arc::new(Mutex::new(None));
    let f = failed.clone();
    m.start_copy(o, Box::new(move |r| *f.lock().unwrap() = Some(r.is_err())));
    m.flush_copies();
    assert_eq!(*failed.lock().unwrap(), Some(true), "failed at once");
    assert!(m.xfer.copies.is_empty());
    assert_eq!(
        m.b.debug_hash(0, 8192, LEN),
        m.b.debug_hash(0, 0, LEN),
        "the copy had run when the batch was failed"
    );
}
