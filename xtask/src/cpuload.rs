//! What else used the machine while a benchmark ran: the CPU time of processes other than this
//! one and its children, and the hypervisor's steal, as fractions of all the cores' time.
//!
//! A 2-core VM has phases (minutes at a time when its cores run slower) and shares its cores with whatever else runs — a build,
//! a helper. `xtask metg` records both per sweep, so that a sweep that ran beside other work is
//! seen as such instead of being read as a slower runtime.
//!
//! Sources: the `cpu` line of `/proc/stat` (all cores: user nice system idle iowait irq softirq
//! steal …, in clock ticks) and fields 14–17 of `/proc/self/stat` (utime, stime, cutime, cstime:
//! this process and its waited-for children, in the same ticks), so the units cancel. A child's
//! time counts once it has been waited for, which `run_once` does for every run.

/// The machine's and this process tree's CPU ticks at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stamp {
    busy: u64,
    steal: u64,
    total: u64,
    ours: u64,
}

/// Fractions of all the cores' time between two stamps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Used by processes other than this one and its children.
    pub other: f64,
    /// Taken by the hypervisor (steal).
    pub steal: f64,
}

/// Now, or `None` where `/proc` cannot be read (not Linux).
pub fn stamp() -> Option<Stamp> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let me = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (busy, steal, total) = parse_cpu_line(&stat)?;
    Some(Stamp {
        busy,
        steal,
        total,
        ours: parse_own_ticks(&me)?,
    })
}

impl Stamp {
    /// The load from `self` to `later`; `None` when no tick passed.
    pub fn until(&self, later: &Stamp) -> Option<Load> {
        let total = later.total.checked_sub(self.total).filter(|&t| t > 0)? as f64;
        let busy = later.busy.saturating_sub(self.busy);
        let ours = later.ours.saturating_sub(self.ours);
        Some(Load {
            other: busy.saturating_sub(ours) as f64 / total,
            steal: later.steal.saturating_sub(self.steal) as f64 / total,
        })
    }
}

/// (busy, steal, total) ticks of `/proc/stat`'s aggregate `cpu` line; busy excludes idle,
/// iowait and steal (guest time is already inside user).
fn parse_cpu_line(stat: &str) -> Option<(u64, u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    // Older kernels end the line early: missing fields are zero.
    let at = |k: usize| v.get(k).copied().unwrap_or(0);
    let (user, nice, system, idle, iowait, irq, softirq, steal) =
        (at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
    let busy = user + nice + system + irq + softirq;
    Some((busy, steal, busy + idle + iowait + steal))
}

/// utime + stime + cutime + cstime of `/proc/self/stat` (fields 14–17; the command name, field
/// 2, is in parentheses and may hold spaces, so fields are counted after its closing one).
fn parse_own_ticks(me: &str) -> Option<u64> {
    let rest = &me[me.rfind(')')? + 1..];
    // After the name: field 3 (state) is the first; fields 14..=17 are the 12th to 15th.
    let f: Vec<&str> = rest.split_whitespace().collect();
    (11..15)
        .map(|k| f.get(k)?.parse::<i64>().ok())
        .sum::<Option<i64>>()
        .map(|t| t.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_line_is_split_into_busy_steal_and_total() {
        let stat = "cpu  100 5 50 800 10 3 2 40 0 0\ncpu0 50 2 25 400 5 1 1 20 0 0\nintr 1 2\n";
        assert_eq!(parse_cpu_line(stat), Some((160, 40, 1010)));
        assert_eq!(parse_cpu_line("cpu0 1 2 3 4\n"), None, "only the aggregate line counts");
        assert_eq!(parse_cpu_line("cpu  1 x 3 4\n"), None);
    }

    #[test]
    fn own_ticks_skip_a_command_name_with_spaces() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        // utime stime cutime cstime …
        let me = "4242 (x task (2)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 20 0 1 0";
        assert_eq!(parse_own_ticks(me), Some(11 + 12 + 13 + 14));
        assert_eq!(parse_own_ticks("4242 (short) S 1 2"), None);
    }

    #[test]
    fn load_counts_only_what_others_used() {
        let a = Stamp {
            busy: 1000,
            steal: 10,
            total: 4000,
            ours: 300,
        };
        let b = Stamp {
            busy: 1500,
            steal: 30,
            total: 5000,
            ours: 700,
        };
        let l = a.until(&b).unwrap();
        assert!((l.other - 0.1).abs() < 1e-12 && (l.steal - 0.02).abs() < 1e-12, "{l:?}");
        assert_eq!(a.until(&a), None, "no tick passed");
    }

    #[test]
    fn this_machine_is_stamped_and_our_own_time_is_ours() {
        if !std::path::Path::new("/proc/stat").exists() {
            return;
        }
        let a = stamp().expect("this machine's /proc parses");
        // Burn CPU in this process until its own ticks move (at most 5 s): that time must be
        // counted as ours, not as another process's.
        let t0 = std::time::Instant::now();
        let mut b = a;
        let mut x = 0u64;
        while b.ours == a.ours && t0.elapsed().as_secs() < 5 {
            for i in 0..1_000_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            std::hint::black_box(x);
            b = stamp().expect("this machine's /proc parses");
        }
        assert!(b.ours > a.ours, "5 s of this process's CPU left its ticks unchanged");
        assert!(b.total >= a.total && b.busy >= a.busy, "{a:?} → {b:?}");
        if let Some(l) = a.until(&b) {
            assert!(
                (0.0..=1.0).contains(&l.other) && (0.0..=1.0).contains(&l.steal),
                "{l:?}"
            );
        }
    }
}
