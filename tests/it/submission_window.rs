//! The submission window: insertion that blocks again and again on every rank still gives the
//! sequential run's tiles, and a rank whose window is full does not deadlock the send window
//! (the window's stall limit lets it go on).

mod common;

use common::*;
use std::path::PathBuf;

/// A submission window of a few nodes: insertion blocks again and again on every rank, and
/// the random graphs still give the sequential run's tiles and the predicted traffic — on the
/// host, with every send rendezvous through a send window of one, and on emulated devices
/// under memory pressure (where transfers, evictions and stage-outs all have to finish without
/// the inserter running ahead).
#[test]
fn oracle_with_a_tiny_submission_window() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    type Env<'a> = &'a [(&'a str, &'a str)];
    let runs: [(usize, u64, Env); 5] = [
        (2, 60, &[("FERRY_SUBMIT_WINDOW", "1")]),
        (3, 61, &[("FERRY_SUBMIT_WINDOW", "4")]),
        (4, 62, &[("FERRY_SUBMIT_WINDOW", "8"), ("FERRY_WORKERS", "2")]),
        // Every payload rendezvous and one send in flight: a send posted ahead of its receive
        // (whose rank waits in its window) holds the only slot; the window's stall limit must
        // let that rank go on and post it.
        (
            3,
            64,
            &[
                ("FERRY_SUBMIT_WINDOW", "2"),
                ("FERRY_EAGER_BYTES", "0"),
                ("FERRY_MAX_SENDS", "1"),
                ("FERRY_MAX_SENDS_PER_PEER", "1"),
            ],
        ),
        (
            2,
            63,
            &[
                ("FERRY_SUBMIT_WINDOW", "6"),
                ("FERRY_DEVICES", "emu:2"),
                ("FERRY_DEVICE_MEM", "2K"),
                ("FERRY_EMU_DELAY_US", "100"),
            ],
        ),
    ];
    for (np, seed, env) in runs {
        let r = mpirun(
            np,
            &exe,
            &["--seed", &seed.to_string(), "--tasks", "250", "--epochs", "2"],
            env,
        );
        assert!(
            r.ok && r.stdout.contains("oracle ok"),
            "np={np} seed={seed} {env:?}\n{}\n{}",
            r.stdout,
            r.stderr
        );
        let stalls = number_after(&r.stdout, "window_stalls=").expect("the oracle prints window_stalls");
        assert!(
            stalls >= 10,
            "a window of a few nodes must block insertion: {}",
            r.stdout
        );
    }
}

/// A rank whose submission window is full before the receive that its peer's only send slot
/// waits for (`window_escape`): without the window's stall limit this job hangs (checked by
/// hand with the limit raised to a minute); with it, rank 1 goes on and both tiles arrive.
#[test]
fn a_full_window_does_not_deadlock_the_send_window() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_window_escape"));
    let env = [
        ("FERRY_WORKERS", "2"),
        ("FERRY_EAGER_BYTES", "0"),
        ("FERRY_MAX_SENDS", "1"),
        ("FERRY_MAX_SENDS_PER_PEER", "1"),
        ("FERRY_WATCHDOG_S", "20"),
    ];
    let r = mpirun(2, &exe, &[], &env);
    assert!(
        r.ok && r.stdout.contains("window escape ok"),
        "{}\n{}",
        r.stdout,
        r.stderr
    );
    let overruns = number_after(&r.stdout, "overruns ").expect("window_escape prints its overruns");
    assert!(
        overruns >= 1,
        "rank 1 must have gone on past its full window: {}",
        r.stdout
    );
}
