//! Task Bench's dependence patterns: which points exist at each timestep and which points of the
//! previous timestep each one depends on (Slaughter et al., "Task Bench", SC20; the rules follow
//! the reference `core.cc`).

use super::random;
use smallvec::{smallvec, SmallVec};

/// A dependence pattern (`-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// No dependencies.
    Trivial,
    /// Each point depends on itself.
    NoComm,
    /// Neighbours p−1, p, p+1.
    Stencil1d,
    /// The same, wrapping around.
    Stencil1dPeriodic,
    /// A diagonal wavefront: p−1 and p, with a growing then shrinking width.
    Dom,
    /// A binary tree that widens by 2× per step.
    Tree,
    /// Butterfly: p and p ± 2^k.
    Fft,
    /// Everything.
    AllToAll,
    /// The `radix` nearest points.
    Nearest,
    /// `radix` points spread across the width, rotating with the period.
    Spread,
    /// A random subset (`fraction`) of the `radix` nearest points.
    RandomNearest,
}

impl Pattern {
    /// Every pattern, with its `-type` name.
    pub const ALL: [(Pattern, &'static str); 11] = [
        (Pattern::Trivial, "trivial"),
        (Pattern::NoComm, "no_comm"),
        (Pattern::Stencil1d, "stencil_1d"),
        (Pattern::Stencil1dPeriodic, "stencil_1d_periodic"),
        (Pattern::Dom, "dom"),
        (Pattern::Tree, "tree"),
        (Pattern::Fft, "fft"),
        (Pattern::AllToAll, "all_to_all"),
        (Pattern::Nearest, "nearest"),
        (Pattern::Spread, "spread"),
        (Pattern::RandomNearest, "random_nearest"),
    ];

    /// The `-type` name.
    pub fn name(self) -> &'static str {
        Pattern::ALL.iter().find(|(p, _)| *p == self).map_or("?", |(_, n)| n)
    }

    /// Parses a `-type` name.
    pub fn parse(s: &str) -> Option<Pattern> {
        Pattern::ALL.iter().find(|(_, n)| *n == s).map(|(p, _)| *p)
    }

    /// Whether the pattern takes a period (`spread`, `random_nearest`).
    pub fn needs_period(self) -> bool {
        matches!(self, Pattern::Spread | Pattern::RandomNearest)
    }
}

/// One task graph's shape (the `-steps -width -type -radix -period -fraction` of one graph).
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub graph_index: i64,
    pub pattern: Pattern,
    pub steps: i64,
    pub width: i64,
    pub radix: i64,
    pub period: i64,
    pub fraction: f64,
}

/// An inclusive interval of points.
pub type Interval = (i64, i64);

/// A task's dependency intervals, inline up to 4 (no allocation for the common patterns: the
/// driver asks for them per task, and an allocation there costs as much as a third of ferry's
/// own per-task work).
pub type Intervals = SmallVec<[Interval; 4]>;

/// A task's input (or consumer) points, inline up to 8.
pub type Points = SmallVec<[i64; 8]>;

impl Shape {
    /// First point at timestep `t` (0 before the first step).
    pub fn offset(&self, t: i64) -> i64 {
        if t < 0 {
            return 0;
        }
        match self.pattern {
            Pattern::Dom => (t + self.width - self.steps).max(0),
            _ => 0,
        }
    }

    /// Number of points at timestep `t` (0 before the first step).
    pub fn width_at(&self, t: i64) -> i64 {
        if t < 0 {
            return 0;
        }
        let w = self.width;
        match self.pattern {
            Pattern::Dom => w.min(t + 1).min(self.steps - t),
            Pattern::Tree => w.min(1i64 << t.min(62)),
            _ => w,
        }
    }

    /// Whether task `(t, p)` exists.
    pub fn exists(&self, t: i64, p: i64) -> bool {
        let o = self.offset(t);
        t >= 0 && t < self.steps && p >= o && p < o + self.width_at(t)
    }

    /// Number of dependence sets the pattern cycles through.
    pub fn dependence_sets(&self) -> i64 {
        match self.pattern {
            Pattern::Fft => {
                let mut k = 0;
                while (1i64 << k) < self.width {
                    k += 1;
                }
                k.max(1)
            }
            Pattern::Spread | Pattern::RandomNearest => self.period.max(1),
            _ => 1,
        }
    }

    /// The dependence set of timestep `t`.
    pub fn dset(&self, t: i64) -> i64 {
        let k = self.dependence_sets();
        match self.pattern {
            Pattern::Fft => (t + k - 1).rem_euclid(k),
            Pattern::Spread | Pattern::RandomNearest => t.rem_euclid(k),
            _ => 0,
        }
    }

    fn nearest_window(&self, p: i64, reverse: bool) -> Option<Interval> {
        let r = self.radix;
        if r <= 0 {
            return None;
        }
        let (below, above) = if reverse {
            ((r - 1) / 2, r / 2)
        } else {
            (r / 2, (r - 1) / 2)
        };
        Some(((p - below).max(0), (p + above).min(self.width - 1)))
    }

    /// The points of the previous timestep that `p` depends on in set `dset`, as intervals in
    /// the order inputs are numbered (not yet restricted to the points that exist).
    pub fn dependencies(&self, dset: i64, p: i64) -> Intervals {
        let w = self.width;
        match self.pattern {
            Pattern::Trivial => smallvec![],
            Pattern::NoComm => smallvec![(p, p)],
            Pattern::Stencil1d => smallvec![((p - 1).max(0), (p + 1).min(w - 1))],
            Pattern::Stencil1dPeriodic => {
                let mut v = smallvec![((p - 1).max(0), (p + 1).min(w - 1))];
                if p == 0 {
                    v.push((w - 1, w - 1));
                }
                if p == w - 1 {
                    v.push((0, 0));
                }
                v
            }
            Pattern::Dom => smallvec![((p - 1).max(0), p)],
            Pattern::Tree => smallvec![(p / 2, p / 2)],
            Pattern::Fft => {
                let d = 1i64 << dset;
                let mut v = Intervals::new();
                if p - d >= 0 {
                    v.push((p - d, p - d));
                }
                v.push((p, p));
                if p + d < w {
                    v.push((p + d, p + d));
                }
                v
            }
            Pattern::AllToAll => smallvec![(0, w - 1)],
            Pattern::Nearest => self.nearest_window(p, false).into_iter().collect(),
            Pattern::Spread => (0..self.radix)
                .map(|i| {
                    let q = (p + i * w / self.radix + if i > 0 { dset } else { 0 }).rem_euclid(w);
                    (q, q)
                })
                .collect(),
            Pattern::RandomNearest => {
                let Some((a, b)) = self.nearest_window(p, false) else {
                    return smallvec![];
                };
                let included = |i: i64| {
                    random::uniform(&[self.graph_index, self.radix, dset, i, p]) < self.fraction
                        || (self.radix > 0 && i == p)
                };
                runs((a..=b).filter(|&i| included(i)))
            }
        }
    }

    /// The points of the next timestep that depend on `p` in set `dset` (the mirror of
    /// [`Shape::dependencies`]).
    pub fn reverse_dependencies(&self, dset: i64, p: i64) -> Intervals {
        let w = self.width;
        match self.pattern {
            Pattern::Dom => smallvec![(p, (p + 1).min(w - 1))],
            Pattern::Tree => {
                let v: Points = [2 * p, 2 * p + 1].into_iter().filter(|&q| q < w).collect();
                runs(v.into_iter())
            }
            Pattern::Nearest => self.nearest_window(p, true).into_iter().collect(),
            Pattern::Spread => (0..self.radix)
                .map(|i| {
                    let q = (p - i * w / self.radix - if i > 0 { dset } else { 0 }).rem_euclid(w);
                    (q, q)
                })
                .collect(),
            Pattern::RandomNearest => {
                let Some((a, b)) = self.nearest_window(p, true) else {
                    return smallvec![];
                };
                let included = |i: i64| {
                    random::uniform(&[self.graph_index, self.radix, dset, p, i]) < self.fraction
                        || (self.radix > 0 && i == p)
                };
                runs((a..=b).filter(|&i| included(i)))
            }
            _ => self.dependencies(dset, p),
        }
    }

    /// The inputs of task `(t, p)`: its dependencies that exist at `t − 1`, in input order.
    pub fn inputs(&self, t: i64, p: i64) -> Points {
        let (o, wd) = (self.offset(t - 1), self.width_at(t - 1));
        clipped(&self.dependencies(self.dset(t), p), o, o + wd - 1)
    }

    /// The consumers of `(t, p)`'s output: tasks of `t + 1` that depend on it.
    pub fn consumers(&self, t: i64, p: i64) -> Points {
        if t + 1 >= self.steps {
            return smallvec![];
        }
        let (o, wd) = (self.offset(t + 1), self.width_at(t + 1));
        clipped(&self.reverse_dependencies(self.dset(t + 1), p), o, o + wd - 1)
    }

    /// Checks the combination of settings (Task Bench's `check`).
    ///
    /// # Errors
    /// The reference's message for the first violated rule.
    pub fn check(&self) -> Result<(), String> {
        if self.pattern.needs_period() && self.period == 0 {
            return Err(format!(
                "error: Graph type \"{}\" requires a non-zero period",
                self.pattern.name()
            ));
        }
        if !self.pattern.needs_period() && self.period != 0 {
            return Err(format!(
                "error: Graph type \"{}\" does not support user-configurable period",
                self.pattern.name()
            ));
        }
        if self.radix == 0 && self.pattern == Pattern::Spread {
            return Err("error: Graph type \"spread\" requires a non-zero radix".into());
        }
        // More dependencies than points repeat one (refused below), and listing them first
        // would allocate `radix` entries, however large.
        if self.pattern == Pattern::Spread && self.radix > self.width {
            return Err(format!(
                "error: Graph type \"spread\" requires a radix that is at most the width ({})",
                self.width
            ));
        }
        if self.pattern == Pattern::Spread && self.radix > 0 && self.period > (self.width + self.radix - 1) / self.radix
        {
            return Err(format!(
                "error: Graph type \"spread\" requires a period that is at most {}",
                (self.width + self.radix - 1) / self.radix
            ));
        }
        if self.pattern == Pattern::Stencil1dPeriodic && self.width < 3 {
            return Err("error: Graph type \"stencil_1d_periodic\" requires a width of at least 3".into());
        }
        // Every dependence set lists each point once, and forward and reverse edges mirror.
        // Only the sets the graph's timesteps use (a period longer than the run cycles through
        // no more of them).
        for dset in 0..self.dependence_sets().min(self.steps) {
            for p in 0..self.width {
                let deps: Vec<i64> = self
                    .dependencies(dset, p)
                    .into_iter()
                    .flat_map(|(a, b)| a..=b)
                    .collect();
                let mut sorted = deps.clone();
                sorted.sort_unstable();
                sorted.dedup();
                if sorted.len() != deps.len() {
                    return Err(format!(
                        "error: point {p} lists a dependency twice in set {dset} ({})",
                        self.pattern.name()
                    ));
                }
                for q in deps {
                    let back = self.reverse_dependencies(dset, q);
                    if !back.iter().any(|&(a, b)| a <= p && p <= b) {
                        return Err(format!(
                            "error: dependency {q} → {p} has no reverse edge ({})",
                            self.pattern.name()
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Maximal runs of consecutive values as intervals.
/// The points of `intervals` within `lo..=hi`, in order.
///
/// A plain loop rather than `flat_map` over inclusive ranges collected into a `SmallVec`: both
/// drivers call this twice per task, and the iterator form cost about 500 instructions a call
/// (a fifth of ferry's own insertion work per task).
fn clipped(intervals: &[Interval], lo: i64, hi: i64) -> Points {
    let mut out = Points::new();
    for &(a, b) in intervals {
        let (a, b) = (a.max(lo), b.min(hi));
        if a <= b {
            out.reserve((b - a + 1) as usize);
            let mut x = a;
            while x <= b {
                out.push(x);
                x += 1;
            }
        }
    }
    out
}

fn runs(it: impl Iterator<Item = i64>) -> Intervals {
    let mut out = Intervals::new();
    for i in it {
        match out.last_mut() {
            Some((_, b)) if *b + 1 == i => *b = i,
            _ => out.push((i, i)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(pattern: Pattern, steps: i64, width: i64) -> Shape {
        Shape {
            graph_index: 0,
            pattern,
            steps,
            width,
            radix: 3,
            // spread allows a period of at most ⌈width / radix⌉.
            period: if pattern.needs_period() {
                3.min((width + 2) / 3)
            } else {
                0
            },
            fraction: 0.25,
        }
    }

    #[test]
    fn every_pattern_passes_its_own_check() {
        for (p, _) in Pattern::ALL {
            for w in [3, 4, 7, 16] {
                shape(p, 9, w)
                    .check()
                    .unwrap_or_else(|e| panic!("{p:?} width {w}: {e}"));
            }
        }
    }

    /// A spread radix above the width is refused before its dependencies are listed (a huge
    /// one used to overflow the list's capacity).
    #[test]
    fn spread_radix_above_the_width_is_refused() {
        let mut s = shape(Pattern::Spread, 4, 4);
        s.period = 1;
        s.radix = 4;
        s.check().expect("radix = width is fine");
        for radix in [5, 1 << 40, i64::MAX] {
            s.radix = radix;
            let e = s.check().expect_err("radix above the width");
            assert!(e.contains("at most the width (4)"), "{e}");
        }
    }

    #[test]
    fn shapes_of_dom_and_tree() {
        let d = shape(Pattern::Dom, 4, 4);
        assert_eq!(
            (0..4).map(|t| (d.offset(t), d.width_at(t))).collect::<Vec<_>>(),
            vec![(0, 1), (1, 2), (2, 2), (3, 1)]
        );
        let t = shape(Pattern::Tree, 4, 4);
        assert_eq!((0..4).map(|s| t.width_at(s)).collect::<Vec<_>>(), vec![1, 2, 4, 4]);
        assert_eq!(t.inputs(1, 1).as_slice(), [0]);
        assert_eq!(t.consumers(0, 0).as_slice(), [0, 1]);
    }

    #[test]
    fn inputs_and_consumers_mirror_each_other() {
        for (p, _) in Pattern::ALL {
            let s = shape(p, 8, 6);
            for t in 1..s.steps {
                for q in 0..s.width {
                    if !s.exists(t, q) {
                        continue;
                    }
                    for d in s.inputs(t, q) {
                        assert!(s.consumers(t - 1, d).contains(&q), "{p:?}: {d}@{} → {q}@{t}", t - 1);
                    }
                }
            }
        }
    }
}
