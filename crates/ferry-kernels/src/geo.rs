//! Gaussian-process covariances over GeoNames places, in the style of
//! ExaGeoStat (Abdulah et al. 2018, "ExaGeoStat: A high performance unified
//! software for geostatistics on manycore systems", IEEE TPDS 29).
//!
//! Places are read from a CSV file with header `lat,lon,cc` (WGS84 degrees
//! and an ISO 3166-1 alpha-2 country code), such as the GeoNames
//! `cities1000` extract in `data/cities1000.csv`. The covariance matrix
//! `Σ_ij = k(d(p_i, p_j)) + nugget·δ_ij` is built tile by tile with
//! [`covariance_tile`], factorized with the tile kernels, and the Gaussian
//! log-likelihood of a data vector follows from [`gaussian_loglik`].

use std::path::Path;
use std::str::FromStr;

use crate::error::{check_len, check_range, elems, KernelError};

/// Earth's mean radius in km (IUGG mean radius `R₁ = (2a + b) / 3` of the
/// WGS84/GRS80 ellipsoid; Moritz 2000, "Geodetic Reference System 1980").
pub const EARTH_RADIUS_KM: f64 = 6371.0088;

/// One place: WGS84 latitude and longitude in degrees and a two-letter ISO
/// country code (ASCII bytes, as in the file).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Place {
    /// Latitude in degrees, in `[-90, 90]`.
    pub lat: f64,
    /// Longitude in degrees, in `[-180, 180]`.
    pub lon: f64,
    /// ISO 3166-1 alpha-2 country code, e.g. `*b"FR"`.
    pub cc: [u8; 2],
}

/// Order in which [`load_places`] returns places (before truncation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ordering {
    /// File order.
    File,
    /// A space-filling-curve order: the first M places form a compact region.
    ///
    /// Places are stably sorted by the Z-order (Morton) code obtained by
    /// quantising latitude and longitude to 16 bits each
    /// (`q = floor((x − min) / range · 2¹⁶)`, clamped to `2¹⁶ − 1`) and
    /// interleaving the bits, longitude in the even and latitude in the odd
    /// bit positions (Morton 1966, IBM technical report). Nearby indices are
    /// then mostly nearby places, which also makes off-diagonal covariance
    /// tiles decay with tile distance.
    Morton,
}

impl FromStr for Ordering {
    type Err = KernelError;

    /// Parses `"file"` or `"morton"`.
    ///
    /// # Errors
    /// `InvalidArgument` naming the valid values.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "file" => Ok(Self::File),
            "morton" => Ok(Self::Morton),
            _ => Err(KernelError::InvalidArgument(format!(
                "unknown ordering `{s}`; valid: file, morton"
            ))),
        }
    }
}

/// Spreads the 16 bits of `x` to the even bit positions of a `u32`.
fn spread16(x: u32) -> u32 {
    let mut x = x & 0xFFFF;
    x = (x | (x << 8)) & 0x00FF_00FF;
    x = (x | (x << 4)) & 0x0F0F_0F0F;
    x = (x | (x << 2)) & 0x3333_3333;
    (x | (x << 1)) & 0x5555_5555
}

fn quantise16(x: f64, min: f64, range: f64) -> u32 {
    // `as` saturates on out-of-range floats, and inputs are validated anyway.
    let q = ((x - min) / range * 65536.0).floor() as u32;
    q.min(65535)
}

/// Z-order (Morton) code of a place, see [`Ordering::Morton`].
fn morton_code(p: &Place) -> u32 {
    let lat = quantise16(p.lat, -90.0, 180.0);
    let lon = quantise16(p.lon, -180.0, 360.0);
    (spread16(lat) << 1) | spread16(lon)
}

fn parse_line(line_no: usize, line: &str) -> Result<Place, KernelError> {
    let err = |msg: String| KernelError::Parse { line: line_no, msg };
    let fields: Vec<&str> = line.split(',').collect();
    if fields.len() != 3 {
        return Err(err(format!("expected 3 fields, found {}", fields.len())));
    }
    let num = |name: &str, s: &str, lim: f64| -> Result<f64, KernelError> {
        let v: f64 = s.trim().parse().map_err(|e| err(format!("{name} `{s}`: {e}")))?;
        if !(-lim..=lim).contains(&v) {
            return Err(err(format!("{name} {v} outside [-{lim}, {lim}]")));
        }
        Ok(v)
    };
    let lat = num("lat", fields[0], 90.0)?;
    let lon = num("lon", fields[1], 180.0)?;
    let cc = fields[2].trim().as_bytes();
    if cc.len() != 2 || !cc.iter().all(u8::is_ascii_alphabetic) {
        return Err(err(format!("country code `{}` is not two ASCII letters", fields[2])));
    }
    Ok(Place {
        lat,
        lon,
        cc: [cc[0], cc[1]],
    })
}

/// Reads places from a `lat,lon,cc` CSV file, orders them and keeps the first
/// `count`.
///
/// Format: first line exactly `lat,lon,cc`; then one place per line with
/// exactly three comma-separated fields: latitude in `[-90, 90]`, longitude in
/// `[-180, 180]` (decimal degrees; surrounding spaces allowed) and a two-letter
/// country code. `\n` and `\r\n` line endings are accepted; blank lines are
/// not. Lines are numbered from 1 (the header).
///
/// * `count`: `None` keeps every place, `Some(m)` keeps the first `m` after
///   ordering;
/// * `order`: see [`Ordering`]; the whole file is ordered before truncation.
///
/// # Errors
/// * [`KernelError::Io`] if the file cannot be read (or is not UTF-8);
/// * [`KernelError::Parse`] with the line number for a bad header, a wrong
///   number of fields, an unparsable or out-of-range number, or a bad code;
/// * [`KernelError::InvalidArgument`] if `count` is `Some(0)`, if `count`
///   exceeds the number of places in the file (both numbers are given), or
///   if the file holds no places.
pub fn load_places(path: &Path, count: Option<usize>, order: Ordering) -> Result<Vec<Place>, KernelError> {
    if count == Some(0) {
        return Err(KernelError::InvalidArgument("place count must be at least 1".into()));
    }
    let text = std::fs::read_to_string(path)?;
    let mut lines = text.lines();
    let header = lines.next().unwrap_or("");
    if header.trim_start_matches('\u{feff}').trim() != "lat,lon,cc" {
        return Err(KernelError::Parse {
            line: 1,
            msg: format!("expected header `lat,lon,cc`, found `{header}`"),
        });
    }
    let mut places = Vec::new();
    for (k, line) in lines.enumerate() {
        places.push(parse_line(k + 2, line)?);
    }
    if places.is_empty() {
        return Err(KernelError::InvalidArgument(format!(
            "{} contains no places",
            path.display()
        )));
    }
    if let Some(m) = count {
        if m > places.len() {
            return Err(KernelError::InvalidArgument(format!(
                "requested {m} places but {} holds only {}",
                path.display(),
                places.len()
            )));
        }
    }
    if order == Ordering::Morton {
        places.sort_by_key(morton_code);
    }
    if let Some(m) = count {
        places.truncate(m);
    }
    Ok(places)
}

/// Great-circle distance in km between two places on a sphere of radius
/// [`EARTH_RADIUS_KM`], by the haversine formula (Sinnott 1984, "Virtues of
/// the haversine", Sky & Telescope 68(2)):
/// `a = sin²(Δφ/2) + cos φ₁ cos φ₂ sin²(Δλ/2)`, `d = 2 R asin(√a)`.
///
/// Symmetric, zero for identical coordinates, accurate to about 0.5 % against
/// the ellipsoid (spherical model).
pub fn great_circle_km(a: &Place, b: &Place) -> f64 {
    let (p1, p2) = (a.lat.to_radians(), b.lat.to_radians());
    let dphi = p2 - p1;
    let dlam = (b.lon - a.lon).to_radians();
    let s1 = (dphi / 2.0).sin();
    let s2 = (dlam / 2.0).sin();
    let h = s1 * s1 + p1.cos() * p2.cos() * s2 * s2;
    2.0 * EARTH_RADIUS_KM * h.clamp(0.0, 1.0).sqrt().asin()
}

/// Stationary isotropic covariance function of distance (Rasmussen &
/// Williams 2006, "Gaussian Processes for Machine Learning", eq. 4.9, 4.14,
/// 4.17).
///
/// With `r = d / ℓ` (distance over length scale) and variance `σ²`:
/// * `Exponential`: `σ² e^{−r}` (Matérn ν = 1/2);
/// * `Matern32`: `σ² (1 + √3 r) e^{−√3 r}` (ν = 3/2);
/// * `Matern52`: `σ² (1 + √5 r + 5r²/3) e^{−√5 r}` (ν = 5/2);
/// * `SquaredExponential`: `σ² e^{−r²/2}`.
///
/// Caveat: with great-circle distance only `Exponential` is guaranteed
/// positive definite on the sphere for every ℓ (Gneiting 2013, "Strictly and
/// non-strictly positive definite functions on spheres", Bernoulli 19);
/// the smoother kernels are in practice fine when ℓ is small compared with
/// Earth's radius, and a positive nugget guards against round-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CovKernel {
    /// `σ² e^{−r}`.
    Exponential,
    /// `σ² (1 + √3 r) e^{−√3 r}`.
    Matern32,
    /// `σ² (1 + √5 r + 5r²/3) e^{−√5 r}`.
    Matern52,
    /// `σ² e^{−r²/2}`.
    SquaredExponential,
}

impl CovKernel {
    /// The name accepted by `FromStr`: `exponential`, `matern32`, `matern52`
    /// or `sqexp`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Exponential => "exponential",
            Self::Matern32 => "matern32",
            Self::Matern52 => "matern52",
            Self::SquaredExponential => "sqexp",
        }
    }
}

impl std::fmt::Display for CovKernel {
    /// Writes [`CovKernel::name`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CovKernel {
    type Err = KernelError;

    /// Parses `exponential`, `matern32`, `matern52` or `sqexp`.
    ///
    /// # Errors
    /// `InvalidArgument` listing the valid names.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "exponential" => Ok(Self::Exponential),
            "matern32" => Ok(Self::Matern32),
            "matern52" => Ok(Self::Matern52),
            "sqexp" => Ok(Self::SquaredExponential),
            _ => Err(KernelError::InvalidArgument(format!(
                "unknown covariance kernel `{s}`; valid: exponential, matern32, matern52, sqexp"
            ))),
        }
    }
}

/// Parameters of the covariance `Σ_ij = k(d_ij) + nugget · δ_ij`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CovParams {
    /// Covariance function.
    pub kernel: CovKernel,
    /// Marginal variance `σ²` (units of the data squared), `> 0`.
    pub variance: f64,
    /// Length scale `ℓ` in km, `> 0`.
    pub length_scale_km: f64,
    /// Nugget added on the global diagonal (measurement-noise variance,
    /// units of the data squared), `≥ 0`.
    pub nugget: f64,
}

impl CovParams {
    /// Checks `variance > 0`, `length_scale_km > 0` and `nugget ≥ 0`, all
    /// finite.
    ///
    /// # Errors
    /// `InvalidArgument` naming the offending field.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |what: &str, v: f64| {
            Err(KernelError::InvalidArgument(format!(
                "{what} must be finite and {}, got {v}",
                if what == "nugget" { ">= 0" } else { "> 0" }
            )))
        };
        if !(self.variance.is_finite() && self.variance > 0.0) {
            return bad("variance", self.variance);
        }
        if !(self.length_scale_km.is_finite() && self.length_scale_km > 0.0) {
            return bad("length_scale_km", self.length_scale_km);
        }
        if !(self.nugget.is_finite() && self.nugget >= 0.0) {
            return bad("nugget", self.nugget);
        }
        Ok(())
    }

    /// The covariance function `k(d)` at distance `d_km` (km), without the
    /// nugget; see [`CovKernel`] for the formulas. Assumes validated
    /// parameters (otherwise the result may be NaN; it never panics).
    pub fn eval(&self, d_km: f64) -> f64 {
        let r = d_km / self.length_scale_km;
        let s2 = self.variance;
        match self.kernel {
            CovKernel::Exponential => s2 * (-r).exp(),
            CovKernel::Matern32 => {
                let t = 3f64.sqrt() * r;
                s2 * (1.0 + t) * (-t).exp()
            }
            CovKernel::Matern52 => {
                let t = 5f64.sqrt() * r;
                s2 * (1.0 + t + 5.0 * r * r / 3.0) * (-t).exp()
            }
            CovKernel::SquaredExponential => s2 * (-0.5 * r * r).exp(),
        }
    }
}

/// Fills a column-major `rows × cols` tile of the covariance matrix over
/// `places` whose top-left entry is the global entry `(i0, j0)`:
/// `out[r + c * rows] = k(d(p_{i0+r}, p_{j0+c})) + nugget · [i0+r == j0+c]`,
/// with `d` = [`great_circle_km`] and `k` = [`CovParams::eval`].
///
/// Entries are bitwise symmetric across tiles: the distance is always
/// evaluated with the lower global index first.
///
/// # Errors
/// * [`KernelError::Shape`] if `out.len() != rows * cols`;
/// * [`KernelError::InvalidArgument`] if `params` fails
///   [`CovParams::validate`] or the tile does not fit inside the
///   `places.len() × places.len()` matrix.
pub fn covariance_tile(
    places: &[Place],
    params: &CovParams,
    i0: usize,
    j0: usize,
    rows: usize,
    cols: usize,
    out: &mut [f64],
) -> Result<(), KernelError> {
    check_len("out", elems(rows, cols)?, out.len())?;
    params.validate()?;
    check_range("row", i0, rows, places.len())?;
    check_range("column", j0, cols, places.len())?;
    if rows == 0 {
        return Ok(());
    }
    for (c, col) in out.chunks_exact_mut(rows).enumerate() {
        let j = j0 + c;
        for (r, v) in col.iter_mut().enumerate() {
            let i = i0 + r;
            let (lo, hi) = if i <= j { (i, j) } else { (j, i) };
            let d = great_circle_km(&places[lo], &places[hi]);
            *v = params.eval(d);
            if i == j {
                *v += params.nugget;
            }
        }
    }
    Ok(())
}

/// The data vector used for the Gaussian log-likelihood: standardized
/// latitude `z_i = (lat_i − mean) / std`, with the population standard
/// deviation (divide by `n`).
///
/// A smooth spatial field available for every place; the example's
/// log-likelihood is that of this field under the GP.
///
/// Returns an empty vector for no places, and all zeros when every latitude
/// is equal (zero standard deviation).
pub fn standardized_latitude(places: &[Place]) -> Vec<f64> {
    if places.is_empty() {
        return Vec::new();
    }
    let n = places.len() as f64;
    let mean = places.iter().map(|p| p.lat).sum::<f64>() / n;
    let var = places.iter().map(|p| (p.lat - mean).powi(2)).sum::<f64>() / n;
    let std = var.sqrt();
    if std == 0.0 {
        return vec![0.0; places.len()];
    }
    places.iter().map(|p| (p.lat - mean) / std).collect()
}

/// Gaussian log-likelihood of an `n`-vector `z ~ N(0, Σ)`:
/// `−½ quad − ½ logdet − (n/2) ln(2π)` (Rasmussen & Williams 2006, eq. 2.30).
///
/// * `quad = zᵀ Σ⁻¹ z = ‖L⁻¹ z‖²` with `Σ = L Lᵀ` (forward substitution, then
///   [`crate::tile::sum_squares`]);
/// * `logdet = log det Σ = 2 Σᵢ ln L_ii` (twice the sum of
///   [`crate::tile::lower_logdet`] over the diagonal tiles).
pub fn gaussian_loglik(n: usize, logdet: f64, quad: f64) -> f64 {
    -0.5 * quad - 0.5 * logdet - 0.5 * n as f64 * (2.0 * std::f64::consts::PI).ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tile::{dense_cholesky, lower_logdet, potrf, sum_squares, trsv_lower};
    use std::path::PathBuf;

    fn data_file() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/cities1000.csv")
    }

    fn temp_file(name: &str, content: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("ferry-kernels-{}-{name}.csv", std::process::id()));
        std::fs::write(&p, content).unwrap();
        p
    }

    #[test]
    fn load_real_file_both_orders() {
        let file = load_places(&data_file(), Some(100), Ordering::File).unwrap();
        assert_eq!(file.len(), 100);
        assert_eq!(
            file[0],
            Place {
                lat: 42.57952,
                lon: 1.65362,
                cc: *b"AD"
            }
        );
        let morton = load_places(&data_file(), Some(100), Ordering::Morton).unwrap();
        assert_eq!(morton.len(), 100);
        let codes: Vec<u32> = morton.iter().map(morton_code).collect();
        assert!(codes.windows(2).all(|w| w[0] <= w[1]));
        // The first Morton places are a compact region: all lie in the lowest
        // quadrant (southern, western hemisphere).
        assert!(morton.iter().all(|p| p.lat < 0.0 && p.lon < 0.0));
        let too_many = load_places(&data_file(), Some(10_000_000), Ordering::File);
        match too_many {
            Err(KernelError::InvalidArgument(msg)) => {
                assert!(msg.contains("10000000") && msg.contains("144563"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            load_places(&data_file(), Some(0), Ordering::File),
            Err(KernelError::InvalidArgument(_))
        ));
    }

    #[test]
    fn morton_code_interleaves() {
        let p = |lat, lon| Place { lat, lon, cc: *b"XX" };
        assert_eq!(morton_code(&p(-90.0, -180.0)), 0);
        assert_eq!(morton_code(&p(90.0, 180.0)), u32::MAX);
        // lon in the even bits, lat in the odd bits.
        assert_eq!(morton_code(&p(-90.0, 0.0)), 1 << 30);
        assert_eq!(morton_code(&p(0.0, -180.0)), 1 << 31);
    }

    #[test]
    fn bad_files() {
        let cases: [(&str, &str, usize); 7] = [
            ("hdr", "lat,lon\n1,2,FR\n", 1),
            ("fields", "lat,lon,cc\n1,2,FR\n3,4\n", 3),
            ("num", "lat,lon,cc\r\n1,2,FR\r\n3,4,FR\r\nx,5,FR\r\n", 4),
            ("latrange", "lat,lon,cc\n91,2,FR\n", 2),
            ("lonrange", "lat,lon,cc\n1,2,FR\n1,-180.5,FR\n", 3),
            ("cc", "lat,lon,cc\n1,2,FRA\n", 2),
            ("blank", "lat,lon,cc\n1,2,FR\n\n3,4,FR\n", 3),
        ];
        for (name, content, want) in cases {
            let path = temp_file(name, content);
            let r = load_places(&path, None, Ordering::File);
            std::fs::remove_file(&path).unwrap();
            match r {
                Err(KernelError::Parse { line, .. }) => assert_eq!(line, want, "{name}"),
                other => panic!("{name}: expected Parse, got {other:?}"),
            }
        }
        let path = temp_file("empty", "lat,lon,cc\n");
        let r = load_places(&path, None, Ordering::Morton);
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(r, Err(KernelError::InvalidArgument(_))));
        assert!(matches!(
            load_places(Path::new("/nonexistent/ferry.csv"), None, Ordering::File),
            Err(KernelError::Io(_))
        ));
    }

    #[test]
    fn distances() {
        let paris = Place {
            lat: 48.8566,
            lon: 2.3522,
            cc: *b"FR",
        };
        let london = Place {
            lat: 51.5074,
            lon: -0.1278,
            cc: *b"GB",
        };
        let d = great_circle_km(&paris, &london);
        assert!((d - 343.5).abs() < 1.0, "{d}");
        assert_eq!(d, great_circle_km(&london, &paris));
        assert_eq!(great_circle_km(&paris, &paris), 0.0);
        let north = Place {
            lat: 90.0,
            lon: 0.0,
            cc: *b"XX",
        };
        let south = Place { lat: -90.0, ..north };
        let half = std::f64::consts::PI * EARTH_RADIUS_KM;
        assert!((great_circle_km(&north, &south) - half).abs() < 1e-9);
    }

    #[test]
    fn kernels_parse_and_evaluate() {
        for k in [
            CovKernel::Exponential,
            CovKernel::Matern32,
            CovKernel::Matern52,
            CovKernel::SquaredExponential,
        ] {
            assert_eq!(k.name().parse::<CovKernel>().unwrap(), k);
            let p = CovParams {
                kernel: k,
                variance: 2.0,
                length_scale_km: 100.0,
                nugget: 0.0,
            };
            assert_eq!(p.eval(0.0), 2.0);
            assert!(p.eval(100.0) < 2.0 && p.eval(100.0) > 0.0);
        }
        match "gauss".parse::<CovKernel>() {
            Err(KernelError::InvalidArgument(m)) => {
                assert!(m.contains("matern52") && m.contains("sqexp"))
            }
            other => panic!("{other:?}"),
        }
        let p = |kernel| CovParams {
            kernel,
            variance: 1.0,
            length_scale_km: 1.0,
            nugget: 0.0,
        };
        let e = 1f64.exp();
        assert!((p(CovKernel::Exponential).eval(1.0) - 1.0 / e).abs() < 1e-15);
        let s3 = 3f64.sqrt();
        assert!((p(CovKernel::Matern32).eval(1.0) - (1.0 + s3) * (-s3).exp()).abs() < 1e-15);
        let s5 = 5f64.sqrt();
        let m52 = (1.0 + s5 + 5.0 / 3.0) * (-s5).exp();
        assert!((p(CovKernel::Matern52).eval(1.0) - m52).abs() < 1e-15);
        assert!((p(CovKernel::SquaredExponential).eval(2.0) - (-2.0f64).exp()).abs() < 1e-15);
        assert_eq!("morton".parse::<Ordering>().unwrap(), Ordering::Morton);
        assert!("z".parse::<Ordering>().is_err());
    }

    #[test]
    fn params_validate() {
        let ok = CovParams {
            kernel: CovKernel::Matern32,
            variance: 1.0,
            length_scale_km: 500.0,
            nugget: 0.0,
        };
        ok.validate().unwrap();
        for bad in [
            CovParams { variance: 0.0, ..ok },
            CovParams {
                variance: f64::NAN,
                ..ok
            },
            CovParams {
                length_scale_km: -1.0,
                ..ok
            },
            CovParams {
                length_scale_km: f64::INFINITY,
                ..ok
            },
            CovParams { nugget: -1e-9, ..ok },
        ] {
            assert!(matches!(bad.validate(), Err(KernelError::InvalidArgument(_))));
        }
    }

    #[test]
    fn covariance_factorizes() {
        let places = load_places(&data_file(), Some(300), Ordering::Morton).unwrap();
        let n = places.len();
        let params = CovParams {
            kernel: CovKernel::Matern32,
            variance: 1.0,
            length_scale_km: 500.0,
            nugget: 1e-4,
        };
        let mut sigma = vec![0.0; n * n];
        covariance_tile(&places, &params, 0, 0, n, n, &mut sigma).unwrap();
        // A tile agrees with the whole matrix, and the matrix is symmetric.
        let (i0, j0, rows, cols) = (40, 170, 30, 20);
        let mut t = vec![0.0; rows * cols];
        covariance_tile(&places, &params, i0, j0, rows, cols, &mut t).unwrap();
        for c in 0..cols {
            for r in 0..rows {
                assert_eq!(t[r + c * rows], sigma[(i0 + r) + (j0 + c) * n]);
            }
        }
        for j in 0..n {
            assert_eq!(sigma[j + j * n], 1.0 + 1e-4);
            for i in 0..j {
                assert_eq!(sigma[i + j * n].to_bits(), sigma[j + i * n].to_bits());
            }
        }
        dense_cholesky(n, &mut sigma, 1).unwrap();
        let z = standardized_latitude(&places);
        let mut w = z.clone();
        trsv_lower(n, &sigma, &mut w).unwrap();
        let quad = sum_squares(n, 1, &w).unwrap();
        let ll = gaussian_loglik(n, 2.0 * lower_logdet(n, &sigma).unwrap(), quad);
        assert!(ll.is_finite());
        // File order (places spread over several countries) works too.
        let places = load_places(&data_file(), Some(300), Ordering::File).unwrap();
        let mut sigma = vec![0.0; n * n];
        covariance_tile(&places, &params, 0, 0, n, n, &mut sigma).unwrap();
        dense_cholesky(n, &mut sigma, 1).unwrap();
    }

    #[test]
    fn covariance_tile_errors() {
        let places = vec![
            Place {
                lat: 0.0,
                lon: 0.0,
                cc: *b"XX"
            };
            4
        ];
        let params = CovParams {
            kernel: CovKernel::Exponential,
            variance: 1.0,
            length_scale_km: 10.0,
            nugget: 0.0,
        };
        let mut out = vec![0.0; 4];
        assert!(matches!(
            covariance_tile(&places, &params, 0, 0, 2, 2, &mut out[..3]),
            Err(KernelError::Shape {
                what: "out",
                expected: 4,
                got: 3
            })
        ));
        assert!(matches!(
            covariance_tile(&places, &params, 3, 0, 2, 2, &mut out),
            Err(KernelError::InvalidArgument(_))
        ));
        let bad = CovParams {
            variance: -1.0,
            ..params
        };
        assert!(matches!(
            covariance_tile(&places, &bad, 0, 0, 2, 2, &mut out),
            Err(KernelError::InvalidArgument(_))
        ));
    }

    #[test]
    fn standardization() {
        let p = |lat| Place {
            lat,
            lon: 0.0,
            cc: *b"XX",
        };
        let z = standardized_latitude(&[p(1.0), p(3.0)]);
        assert_eq!(z, vec![-1.0, 1.0]);
        assert_eq!(standardized_latitude(&[p(5.0), p(5.0)]), vec![0.0, 0.0]);
        assert!(standardized_latitude(&[]).is_empty());
    }

    #[test]
    fn loglik_two_by_two() {
        // Σ = [[2, 0.5], [0.5, 1]], z = (1, −1).
        let sigma = [2.0, 0.5, 0.5, 1.0];
        let z = [1.0, -1.0];
        let det: f64 = 2.0 * 1.0 - 0.5 * 0.5;
        // zᵀ Σ⁻¹ z = zᵀ adj(Σ) z / det, adj = [[1, −0.5], [−0.5, 2]]:
        // z₁² · 1 + 2 · z₁z₂ · (−0.5) + z₂² · 2 = 1 + 1 + 2.
        let quad_hand = 4.0 / det;
        let hand = -0.5 * quad_hand - 0.5 * det.ln() - (2.0 * std::f64::consts::PI).ln();
        let mut l = sigma;
        potrf(2, &mut l).unwrap();
        let mut w = z;
        trsv_lower(2, &l, &mut w).unwrap();
        let quad = sum_squares(2, 1, &w).unwrap();
        let logdet = 2.0 * lower_logdet(2, &l).unwrap();
        let ll = gaussian_loglik(2, logdet, quad);
        assert!((quad - quad_hand).abs() < 1e-14);
        assert!((ll - hand).abs() < 1e-14, "{ll} vs {hand}");
    }
}
