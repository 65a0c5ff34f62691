//! The tiled Cholesky example on the host: the generated matrix (ragged last tiles) on 1–4 ranks
//! has a residual within n·ε and the same log-determinant on every rank count, and the GeoNames
//! covariance matrix gives the same log-likelihood on 1 and 3 ranks.

mod common;

use common::*;

#[test]
fn cholesky_generated_on_one_to_four_ranks() {
    let mut logdets = Vec::new();
    // n = 300 with nb = 64: a ragged last tile row and column.
    for np in 1..=4 {
        let rec = cholesky(np, &["--n", "300", "--nb", "64", "--check", "exact"]);
        let res = rec["residual"].as_f64().expect("residual");
        // ‖A − LLᵀ‖_F / (‖A‖_F · n · ε) < 1, i.e. relative residual below n·ε ≈ 6.7e-14.
        assert!(res < 1.0, "np={np}: scaled residual {res}");
        assert!(res * 300.0 * f64::EPSILON < 1e-13, "np={np}: relative residual");
        logdets.push(rec["logdet"].as_f64().expect("logdet"));
        if np > 1 {
            let sent: u64 = rec["paths"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["bytes"].as_u64().unwrap())
                .sum();
            assert!(sent > 0, "np={np}: a distributed factorization moves tiles");
        }
    }
    for l in &logdets {
        assert!(
            (l - logdets[0]).abs() <= 1e-9 * logdets[0].abs(),
            "log det differs across rank counts: {logdets:?}"
        );
    }
}

#[test]
fn cholesky_geonames_covariance() {
    let points = repo_root().join("data/cities1000.csv");
    let p = points.to_string_lossy().into_owned();
    let args = [
        "--points",
        p.as_str(),
        "--count",
        "500",
        "--nb",
        "96",
        "--kernel",
        "matern32",
        "--order",
        "morton",
    ];
    let one = cholesky(1, &args);
    let two = cholesky(3, &args);
    for rec in [&one, &two] {
        assert!(rec["residual"].as_f64().unwrap() < 1.0, "{rec}");
        assert!(rec["loglik"].as_f64().unwrap().is_finite(), "{rec}");
    }
    let (a, b) = (one["loglik"].as_f64().unwrap(), two["loglik"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-8 * a.abs(), "log-likelihood differs: {a} vs {b}");
}
