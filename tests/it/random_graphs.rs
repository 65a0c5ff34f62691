//! The random-graph oracle on the host, on 1–4 ranks: random task graphs (with worker counts,
//! epochs, overrides and access counts varied) give the sequential run's tiles and the predicted
//! traffic, and with every payload over the eager bound and a send window of one, the rendezvous
//! path and the window queue carry everything.

mod common;

use common::*;
use std::path::PathBuf;

#[test]
fn oracle_one_rank() {
    oracle(1, 0..6, &[], &[]);
    oracle(1, 6..10, &[], &[("FERRY_WORKERS", "3")]);
}

#[test]
fn oracle_two_ranks() {
    oracle(2, 10..18, &[], &[]);
    oracle(2, 18..22, &["--epochs", "5"], &[("FERRY_WORKERS", "2")]);
}

#[test]
fn oracle_three_ranks() {
    oracle(3, 30..36, &["--override-pct", "40"], &[]);
}

/// MPI progress driven by idle workers and threads waiting in a collective (the progress thread
/// a backstop, `FERRY_MPI_PROGRESS=shared`), and by the progress thread alone, each give the
/// sequential run's tiles and traffic on three ranks, whatever `auto` would choose on this
/// machine; the epochs' hash agreements are collectives driven the same way.
#[test]
fn oracle_with_shared_and_threaded_progress() {
    for mode in ["shared", "thread"] {
        oracle(
            3,
            50..53,
            &["--epochs", "3"],
            &[("FERRY_WORKERS", "2"), ("FERRY_MPI_PROGRESS", mode)],
        );
    }
}

#[test]
fn oracle_four_ranks() {
    oracle(4, 40..46, &["--max-access", "6"], &[("FERRY_WORKERS", "2")]);
}

/// Every payload over the eager bound, a send window of one: the rendezvous path and the window
/// queue carry everything, and the statistics must show it.
#[test]
fn oracle_rendezvous_path_with_window_of_one() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oracle"));
    let env = [
        ("FERRY_EAGER_BYTES", "0"),
        ("FERRY_MAX_SENDS", "1"),
        ("FERRY_MAX_SENDS_PER_PEER", "1"),
    ];
    for (np, seed) in [(2, 50), (3, 51), (4, 52)] {
        let r = mpirun(np, &exe, &["--seed", &seed.to_string()], &env);
        assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
        assert!(
            r.stdout.contains("host-eager=0 "),
            "eager path must be unused: {}",
            r.stdout
        );
        assert!(
            !r.stdout.contains("host-rendezvous=0\n"),
            "rendezvous path must carry the bytes: {}",
            r.stdout
        );
    }
}
