//! The stencil example is bit-identical to the single-rank run across rank counts and tilings
//! (square and ragged tiles, row slabs, `--overlap`'s interior and ring tasks, CPU workers and
//! emulated devices), and `--anchor` without CUDA is skipped with a message.

mod common;

use common::*;

#[test]
fn stencil_bit_identical_across_ranks_and_tilings() {
    let reference = stencil(1, &["--n", "150", "--nb", "40", "--iters", "25"]);
    let sum = reference["checksum"].as_str().unwrap().to_string();
    assert!(reference["max_rel_error"].as_f64().unwrap() < 1e-12);
    for (np, nb) in [(2, "40"), (3, "40"), (4, "40"), (4, "33"), (2, "150")] {
        let rec = stencil(np, &["--n", "150", "--nb", nb, "--iters", "25"]);
        assert_eq!(
            rec["checksum"].as_str().unwrap(),
            sum,
            "np={np} nb={nb} differs from the single-rank run"
        );
    }
    // The step split into interior and ring tasks (--overlap): the same bits, with tiles thin
    // enough (nb 2 and the ragged last row of nb 33) that rings cover whole tiles, on CPU workers
    // and on emulated devices; the two write parts of the new field (concurrent, the default)
    // or one after the other (ordered). On devices, concurrent rings are placed while other
    // part writers of their tile are in flight (`parts_together`); ordered ones never are.
    for (np, nb, devices, overlap) in [
        (1, "40", "none", "concurrent"),
        (2, "33", "emu:2", "concurrent"),
        (2, "33", "emu:2", "ordered"),
        (3, "2", "none", "concurrent"),
        (2, "40", "emu:1", "concurrent"),
        (1, "40", "emu:1", "ordered"),
    ] {
        let flag = format!("--overlap={overlap}");
        let rec = stencil(
            np,
            &["--n", "150", "--nb", nb, "--iters", "25", &flag, "--devices", devices],
        );
        assert_eq!(
            rec["checksum"].as_str().unwrap(),
            sum,
            "{flag} np={np} nb={nb} {devices} differs from the single-rank run"
        );
        assert_eq!(rec["overlap"].as_str(), Some(overlap), "{rec}");
        let together = rec["parts_together"].as_u64().unwrap();
        match (devices, overlap) {
            ("none", _) | (_, "ordered") => assert_eq!(together, 0, "{flag} {devices}: {rec}"),
            _ => assert!(
                together > 0,
                "{flag} np={np} {devices}: no ring alongside its interior: {rec}"
            ),
        }
    }
    // Tiles that are not square (--mb): row slabs, one per rank (each with one neighbour),
    // three slabs over three ranks, and ragged tall tiles on four; plain and --overlap, on CPU
    // workers and on emulated devices.
    for (np, mb, nb, devices, overlap) in [
        (2, "75", "150", "emu:1", false),
        (2, "75", "150", "emu:1", true),
        (3, "50", "150", "none", true),
        (4, "64", "20", "none", false),
    ] {
        let mut a = vec![
            "--n",
            "150",
            "--mb",
            mb,
            "--nb",
            nb,
            "--iters",
            "25",
            "--devices",
            devices,
        ];
        if overlap {
            a.push("--overlap");
        }
        let rec = stencil(np, &a);
        assert_eq!(
            rec["checksum"].as_str().unwrap(),
            sum,
            "np={np} mb={mb} nb={nb} {devices} overlap={overlap} differs from the single-rank run"
        );
        assert_eq!(rec["mb"].as_u64(), Some(mb.parse().unwrap()), "{rec}");
        // Row slabs are split one per rank (the process grid follows the tile grid): halos
        // cross between the ranks.
        let moved: u64 = rec["paths"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| {
                !matches!(
                    p["path"].as_str(),
                    Some("h2d" | "d2h" | "peer" | "control" | "control-ring")
                )
            })
            .map(|p| p["bytes"].as_u64().unwrap())
            .sum();
        assert!(moved > 0, "np={np} mb={mb}: no halo crossed ranks: {rec}");
    }
}

/// `stencil --anchor` needs CUDA devices: elsewhere it says so, runs as without it (same bits)
/// and records no anchor.
#[test]
fn stencil_anchor_without_cuda_is_skipped_with_a_message() {
    let args = [
        "--n",
        "64",
        "--mb",
        "32",
        "--nb",
        "64",
        "--iters",
        "6",
        "--overlap",
        "--devices",
        "emu:1",
    ];
    let plain = stencil(2, &args);
    let out = tmp("stencil-anchor-emu.json");
    let o = out.to_string_lossy().into_owned();
    let mut a = args.to_vec();
    a.extend_from_slice(&["--anchor", "--json", &o]);
    let r = mpirun(2, &bin("stencil"), &a, &[]);
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("--anchor needs CUDA devices"), "{}", r.stderr);
    assert!(!r.stdout.contains("anchor "), "{}", r.stdout);
    let rec = json(&out);
    assert_eq!(rec["checksum"], plain["checksum"]);
    assert!(
        rec["anchor_seconds"].is_null() && rec["anchor_concurrent_seconds"].is_null(),
        "{rec}"
    );
}
