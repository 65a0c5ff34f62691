use super::*;
use ferry_device::emu::{EmuBackend, EmuConfig};

/// A panic on the manager thread (here: a pin released on a device the copy has no state
/// for) reaches `died` at once, so that the run fails instead of waiting for work the dead
/// thread will never finish; the thread then ends.
#[test]
fn a_panicking_manager_reports_its_death() {
    let cfg = EmuConfig {
        devices: 1,
        capacity: 1 << 20,
        exec_streams: 1,
        fail_alloc: Vec::new(),
        fail_copy: Vec::new(),
        delay_us: 0,
        seed: 1,
    };
    let opts = Options {
        depth: 2,
        poll_us: 100,
        low_water: 0.0,
        offer_poll_us: 50,
        peer_copies: true,
        phases: false,
        stream_affinity: true,
        skip_ack_wait: false,
        yield_when_idle: false,
    };
    let (tx, rx) = channel::bounded(1);
    let died = Box::new(move |m: String| {
        let _ = tx.send(m);
    });
    let backend = EmuBackend::new(&cfg).expect("emulated device");
    let (h, join, _) = start(backend, Arc::new(MemoryCounters::new(1)), opts, died).expect("manager thread");
    let copy = TileCopy::host(64, &Default::default());
    h.post(GpuCmd::Unpin { copy, dev: 0 })
        .expect("the manager takes commands");
    let msg = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("`died` is called with the panic's message");
    assert!(msg.contains("index out of bounds"), "{msg}");
    join.join().expect("the thread ends after reporting");
}
