//! `cargo xtask results`: `docs/results.md`, generated from the JSON records in `docs/records/`.
//!
//! A record file is one result set: the figures that one command gave in one run, on one
//! machine, at one commit. The page has one table per (workload, machine), a row per figure,
//! with the anchor measured in the same run and the ratio figure ÷ anchor. The schema is the
//! `Record*` structs below; `docs/records/README.md` describes it for people writing records.
//! `--check` compares the page with what the records generate and fails when they differ.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde::Deserialize;

use crate::util;

/// Where the records live, relative to the workspace root.
pub const RECORDS_DIR: &str = "docs/records";
/// The generated page, relative to the workspace root.
pub const PAGE: &str = "docs/results.md";

/// A ratio given in a record (as its tool printed it, from unrounded figures) may differ from
/// figure ÷ anchor of the rounded figures by at most this fraction.
const RATIO_TOLERANCE: f64 = 0.02;

#[derive(Args)]
pub struct ResultsArgs {
    /// Write nothing: exit non-zero when the page is not what the records generate.
    #[arg(long)]
    check: bool,
    /// Directory of the record files (`*.json`), relative to the workspace root.
    #[arg(long, default_value = RECORDS_DIR)]
    records: PathBuf,
    /// The page to write (or check), relative to the workspace root.
    #[arg(long, default_value = PAGE)]
    out: PathBuf,
}

/// One record file: the figures one command gave in one run.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordSet {
    /// What ran, e.g. "Task Bench METG(50%), stencil_1d". With `machine`, names the table.
    pub workload: String,
    /// Where it ran, e.g. "2-core CI-class VM", "2× H200 SXM NV18 (nvidia-h200-x2)".
    pub machine: String,
    /// The command line that produced the figures (a result may name its own).
    pub command: String,
    /// The commit that was built and run (7 to 40 hex digits).
    pub commit: String,
    /// What `commit` is: the build that ran (the default), or only the commit that logged the
    /// figure where the source named no build.
    #[serde(default)]
    pub commit_source: CommitSource,
    /// The day of the run, `YYYY-MM-DD`.
    pub date: String,
    /// Where the figures were taken from, when not from the run's own output.
    #[serde(default)]
    pub source: Option<String>,
    /// The figures, in the order of the table's rows.
    pub results: Vec<RecordResult>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CommitSource {
    /// The commit whose build produced the figures.
    #[default]
    Build,
    /// The commit that recorded the figures in a log that named no build.
    Log,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    Higher,
    Lower,
}

/// One figure of a result set: a row of its table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordResult {
    /// What the figure measures, e.g. "METG(50%)", "IPC, 1 MiB × 8, a task per round".
    pub metric: String,
    /// Unit of the figure and of the anchor, e.g. "µs", "GB/s"; empty for a pure number.
    #[serde(default)]
    pub unit: String,
    /// Which direction is better, when one is.
    #[serde(default)]
    pub better: Option<Better>,
    /// Ferry's figure.
    pub figure: f64,
    /// Lowest and highest of the runs the figure summarizes, when it summarizes several.
    #[serde(default)]
    pub range: Option<[f64; 2]>,
    /// The anchor measured in the same run; absent when the run measured none.
    #[serde(default)]
    pub anchor: Option<RecordAnchor>,
    /// The ratio figure ÷ anchor as the tool printed it (from unrounded figures); computed from
    /// `figure` and `anchor` when absent.
    #[serde(default)]
    pub ratio: Option<f64>,
    /// This figure's command, where it differs from the set's.
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub notes: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordAnchor {
    /// What the anchor is, e.g. "taskbench-mpi, 2 ranks", "bare peer copy".
    pub name: String,
    /// Its figure, in the result's unit.
    pub figure: f64,
    #[serde(default)]
    pub range: Option<[f64; 2]>,
}

impl RecordResult {
    /// The ratio shown: the given one, else figure ÷ anchor.
    pub fn shown_ratio(&self) -> Option<f64> {
        self.ratio
            .or_else(|| self.anchor.as_ref().map(|a| self.figure / a.figure))
    }
}

pub fn run(args: ResultsArgs) -> Result<()> {
    let records = util::root().join(&args.records);
    let out = util::root().join(&args.out);
    let page = generate_from_dir(&records, &out)?;
    let shown = args.out.display();
    if args.check {
        let current = std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
        match first_difference(&current, &page) {
            None => {
                eprintln!("results: {shown} is up to date");
                Ok(())
            }
            Some((line, have, want)) => bail!(
                "{shown} is not what the records in {} generate (line {line}: has {have:?}, records give {want:?}); \
                 run `cargo xtask results`",
                args.records.display()
            ),
        }
    } else {
        let unchanged = std::fs::read_to_string(&out).is_ok_and(|c| c == page);
        if !unchanged {
            std::fs::write(&out, &page).with_context(|| format!("writing {}", out.display()))?;
        }
        eprintln!("results: {shown} {}", if unchanged { "unchanged" } else { "written" });
        Ok(())
    }
}

/// `--check` with the default paths, for `cargo xtask test`.
pub fn check_default() -> Result<()> {
    run(ResultsArgs {
        check: true,
        records: RECORDS_DIR.into(),
        out: PAGE.into(),
    })
}

/// Reads every `*.json` record in `dir` and renders the page that is to live at `out`.
/// Every bad record is reported, each with its file and field.
pub fn generate_from_dir(dir: &Path, out: &Path) -> Result<String> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading the records directory {}", dir.display()))?;
    let mut paths = Vec::new();
    for entry in entries {
        let path = entry.with_context(|| format!("reading {}", dir.display()))?.path();
        if path.extension().is_some_and(|e| e == "json") {
            paths.push(path);
        }
    }
    paths.sort();
    if paths.is_empty() {
        bail!("no records (*.json) in {}", dir.display());
    }
    let mut sets = Vec::new();
    let mut errors = Vec::new();
    for path in &paths {
        let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let shown = path.strip_prefix(util::root()).unwrap_or(path).display().to_string();
        match std::fs::read_to_string(path) {
            Ok(text) => match parse(&shown, &text) {
                Ok(set) => sets.push((name, set)),
                Err(e) => errors.push(format!("{e:#}")),
            },
            Err(e) => errors.push(format!("{shown}: {e}")),
        }
    }
    if !errors.is_empty() {
        bail!("{} bad record(s):\n  {}", errors.len(), errors.join("\n  "));
    }
    // The records as the page names them (from the workspace root) and links them (from the
    // page's directory, when they lie below it).
    let base = out.parent().unwrap_or(Path::new(""));
    let dirs = RecordsDir {
        shown: slashes(dir.strip_prefix(util::root()).unwrap_or(dir)),
        link: slashes(dir.strip_prefix(base).unwrap_or(dir)),
    };
    Ok(render(&sets, &dirs))
}

fn slashes(p: &Path) -> String {
    p.to_string_lossy().replace('\\', "/")
}

/// How the page names the records' directory, and how it links to it.
pub struct RecordsDir {
    /// From the workspace root, e.g. `docs/records`.
    pub shown: String,
    /// From the page's directory, e.g. `records`.
    pub link: String,
}

/// Parses and checks one record file; `name` is how errors name the file.
pub fn parse(name: &str, text: &str) -> Result<RecordSet> {
    let set: RecordSet = serde_json::from_str(text).map_err(|e| anyhow!(describe_json_error(name, text, &e)))?;
    validate(&set).map_err(|e| anyhow!("{name}: {e}"))?;
    Ok(set)
}

/// `file:line:column: path: message` for a syntax or schema error of serde_json, the path
/// (`results[2].anchor.figure`) found by scanning the text up to where the error was found.
fn describe_json_error(name: &str, text: &str, err: &serde_json::Error) -> String {
    let msg = err.to_string();
    let msg = match msg.rsplit_once(" at line ") {
        Some((m, _)) => m.to_string(),
        None => msg,
    };
    let (line, column) = (err.line(), err.column());
    if line == 0 {
        return format!("{name}: {msg}");
    }
    let offset = offset_of(text, line, column);
    let path = json_path_at(&text[..offset]);
    if path.is_empty() {
        format!("{name}:{line}:{column}: {msg}")
    } else {
        format!("{name}:{line}:{column}: {path}: {msg}")
    }
}

/// Byte offset of a 1-based (line, column), clamped to the text and to a character boundary.
fn offset_of(text: &str, line: usize, column: usize) -> usize {
    let mut start = 0;
    for (i, l) in text.split_inclusive('\n').enumerate() {
        if i + 1 == line {
            let mut at = (start + column).min(start + l.len()).min(text.len());
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            return at;
        }
        start += l.len();
    }
    text.len()
}

/// The path of the JSON value being read where `prefix` ends, e.g. `results[1].anchor.figure`
/// (the innermost key or index named so far; a prefix that closed an object names the
/// object's own path).
fn json_path_at(prefix: &str) -> String {
    enum Frame {
        Object { key: Option<String>, want_key: bool },
        Array(usize),
    }
    let mut stack: Vec<Frame> = Vec::new();
    let mut last_closed: Option<String> = None;
    let mut chars = prefix.chars();
    let render = |stack: &[Frame]| {
        let mut p = String::new();
        for f in stack {
            match f {
                Frame::Object { key: Some(k), .. } => {
                    if !p.is_empty() {
                        p.push('.');
                    }
                    p.push_str(k);
                }
                Frame::Object { key: None, .. } => {}
                Frame::Array(i) => {
                    let _ = write!(p, "[{i}]");
                }
            }
        }
        p
    };
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                let mut s = String::new();
                let mut escaped = false;
                for c in chars.by_ref() {
                    if escaped {
                        s.push(c);
                        escaped = false;
                    } else if c == '\\' {
                        escaped = true;
                    } else if c == '"' {
                        break;
                    } else {
                        s.push(c);
                    }
                }
                if let Some(Frame::Object { key, want_key }) = stack.last_mut() {
                    if *want_key {
                        *key = Some(s);
                        *want_key = false;
                    }
                }
                last_closed = None;
            }
            '{' => {
                stack.push(Frame::Object {
                    key: None,
                    want_key: true,
                });
                last_closed = None;
            }
            '[' => {
                stack.push(Frame::Array(0));
                last_closed = None;
            }
            '}' | ']' => {
                // A missing field is reported just after its object: name that object.
                stack.pop();
                last_closed = Some(render(&stack));
            }
            ',' => {
                match stack.last_mut() {
                    Some(Frame::Object { key, want_key }) => {
                        *key = None;
                        *want_key = true;
                    }
                    Some(Frame::Array(i)) => *i += 1,
                    None => {}
                }
                last_closed = None;
            }
            _ => {}
        }
    }
    last_closed.unwrap_or_else(|| render(&stack))
}

/// Checks what serde cannot: non-empty names, the commit and date formats, finite figures,
/// ranges that hold their figure, a positive anchor and a given ratio that agrees with it.
fn validate(set: &RecordSet) -> Result<()> {
    for (field, value) in [
        ("workload", &set.workload),
        ("machine", &set.machine),
        ("command", &set.command),
    ] {
        if value.trim().is_empty() {
            bail!("{field}: must not be empty");
        }
    }
    if !(7..=40).contains(&set.commit.len()) || !set.commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("commit: {:?} is not 7 to 40 hex digits", set.commit);
    }
    check_date(&set.date).map_err(|e| anyhow!("date: {:?} {e}", set.date))?;
    if set.results.is_empty() {
        bail!("results: no figures");
    }
    for (i, r) in set.results.iter().enumerate() {
        let at = |field: &str| format!("results[{i}].{field}");
        if r.metric.trim().is_empty() {
            bail!("{}: must not be empty", at("metric"));
        }
        if r.command.as_deref().is_some_and(|c| c.trim().is_empty()) {
            bail!("{}: must not be empty when given", at("command"));
        }
        if !r.figure.is_finite() {
            bail!("{}: {} is not a finite number", at("figure"), r.figure);
        }
        check_range(r.range, r.figure).map_err(|e| anyhow!("{}: {e}", at("range")))?;
        match (&r.anchor, r.ratio) {
            (None, Some(_)) => bail!("{}: given without an anchor", at("ratio")),
            (None, None) => {}
            (Some(a), ratio) => {
                if a.name.trim().is_empty() {
                    bail!("{}: must not be empty", at("anchor.name"));
                }
                if !(a.figure.is_finite() && a.figure > 0.0) {
                    bail!("{}: {} is not a positive number", at("anchor.figure"), a.figure);
                }
                check_range(a.range, a.figure).map_err(|e| anyhow!("{}: {e}", at("anchor.range")))?;
                if let Some(given) = ratio {
                    let computed = r.figure / a.figure;
                    if !(given.is_finite() && given > 0.0) {
                        bail!("{}: {given} is not a positive number", at("ratio"));
                    }
                    if ((given - computed) / computed).abs() > RATIO_TOLERANCE {
                        bail!(
                            "{}: {given} disagrees with figure ÷ anchor = {} ÷ {} = {computed:.4}",
                            at("ratio"),
                            r.figure,
                            a.figure
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

fn check_range(range: Option<[f64; 2]>, figure: f64) -> Result<()> {
    if let Some([lo, hi]) = range {
        if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
            bail!("[{lo}, {hi}] is not [lowest, highest]");
        }
        if !(lo <= figure && figure <= hi) {
            bail!("[{lo}, {hi}] does not hold the figure {figure}");
        }
    }
    Ok(())
}

fn check_date(date: &str) -> Result<()> {
    let parts: Vec<&str> = date.split('-').collect();
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    if parts.len() != 3 || !digits(parts[0], 4) || !digits(parts[1], 2) || !digits(parts[2], 2) {
        bail!("is not YYYY-MM-DD");
    }
    let (month, day): (u32, u32) = (parts[1].parse()?, parts[2].parse()?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        bail!("is not a calendar date");
    }
    Ok(())
}

/// The page: a header, then one table per (workload, machine), sorted by workload then
/// machine; rows in the order of the record files' names, then of their results.
pub fn render(sets: &[(String, RecordSet)], dirs: &RecordsDir) -> String {
    let (shown, link) = (&dirs.shown, &dirs.link);
    let mut groups: BTreeMap<(&str, &str), Vec<(&str, &RecordSet)>> = BTreeMap::new();
    for (name, set) in sets {
        groups
            .entry((set.workload.trim(), set.machine.trim()))
            .or_default()
            .push((name, set));
    }
    let figures: usize = sets.iter().map(|(_, s)| s.results.len()).sum();
    let mut page = String::new();
    let _ = write!(
        page,
        "# Results\n\n\
         <!-- Generated by `cargo xtask results` from {shown}/*.json. Edit the records, not this page. -->\n\n\
         Current figures of ferry, one table per workload and machine: {figures} figures from {} records. This \
         page is generated: add or edit a record in [`{shown}/`]({link}/) (schema: \
         [`{shown}/README.md`]({link}/README.md)), then run `cargo xtask results`; `cargo xtask \
         results --check` fails when the page is not what the records give.\n\n\
         - **anchor**: a reference measured in the same run as the figure (same process, call or sweep); \
         **ratio** = figure ÷ anchor. \"—\": the run measured no anchor.\n\
         - ↑ higher is better, ↓ lower is better. A range in parentheses is the lowest and highest of the \
         runs a figure summarizes.\n\
         - A commit marked † is the one that recorded the figure in the work log, which named no build for it.\n\
         - \"Work log\" in a record's source: the dated log these records were first taken from, \
         `docs/benchmarks.md` (sessions 1–30, 2026-11-22 to 2026-11-28), now in git history: \
         `git show b47892c:docs/benchmarks.md`.\n",
        sets.len()
    );
    for ((workload, machine), rows) in &groups {
        let _ = write!(
            page,
            "\n## {} — {}\n\n| metric | figure | anchor | ratio | command | commit | date |\n|---|---|---|---|---|---|---|\n",
            inline(workload),
            inline(machine)
        );
        let mut notes = Vec::new();
        for (_, set) in rows {
            for r in &set.results {
                let mut metric = inline(&r.metric);
                match r.better {
                    Some(Better::Higher) => metric.push_str(" ↑"),
                    Some(Better::Lower) => metric.push_str(" ↓"),
                    None => {}
                }
                if let Some(n) = &r.notes {
                    notes.push(n.as_str());
                    let _ = write!(metric, " [{}]", notes.len());
                }
                let anchor = r.anchor.as_ref().map_or_else(
                    || "—".to_string(),
                    |a| format!("{}: {}", inline(&a.name), fmt_value(a.figure, &r.unit, a.range)),
                );
                let ratio = r.shown_ratio().map_or_else(|| "—".to_string(), fmt_ratio);
                let commit = match set.commit_source {
                    CommitSource::Build => format!("`{}`", set.commit),
                    CommitSource::Log => format!("`{}`†", set.commit),
                };
                let _ = writeln!(
                    page,
                    "| {metric} | {} | {anchor} | {ratio} | {} | {commit} | {} |",
                    fmt_value(r.figure, &r.unit, r.range),
                    code(r.command.as_deref().unwrap_or(&set.command)),
                    set.date
                );
            }
        }
        page.push('\n');
        for (i, n) in notes.iter().enumerate() {
            let _ = writeln!(page, "- [{}] {}", i + 1, inline(n));
        }
        let sources: Vec<String> = rows
            .iter()
            .map(|(name, set)| match &set.source {
                Some(s) => format!("[`{name}`]({link}/{name}) ({})", inline(s)),
                None => format!("[`{name}`]({link}/{name})"),
            })
            .collect();
        let _ = writeln!(
            page,
            "{}Records: {}.",
            if notes.is_empty() { "" } else { "\n" },
            sources.join("; ")
        );
    }
    page
}

/// Text for one table cell or list item: no line breaks, pipes escaped.
fn inline(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}

/// A command as inline code (plain text if it holds a backtick), pipes escaped for the table.
fn code(s: &str) -> String {
    let s = inline(s);
    if s.contains('`') {
        s
    } else {
        format!("`{s}`")
    }
}

/// A figure with its unit and range: `1.97 µs (1.9–2.84)`.
fn fmt_value(x: f64, unit: &str, range: Option<[f64; 2]>) -> String {
    let mut s = fmt_num(x);
    if !unit.trim().is_empty() {
        s.push(' ');
        s.push_str(unit.trim());
    }
    if let Some([lo, hi]) = range {
        let _ = write!(s, " ({}–{})", fmt_num(lo), fmt_num(hi));
    }
    s
}

/// The shortest decimal that reads back as `x`; scientific below 0.001 and from a million
/// up (`3.557e11`, `1.16e-4`), thousands grouped in whole numbers from 10 000 (`251,065`).
pub fn fmt_num(x: f64) -> String {
    let a = x.abs();
    if x != 0.0 && !(1e-3..1e6).contains(&a) {
        return format!("{x:e}");
    }
    if x.fract() == 0.0 && a >= 1e4 {
        let digits = format!("{a:.0}");
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        return if x < 0.0 { format!("-{out}") } else { out };
    }
    format!("{x}")
}

/// A ratio with two decimals below 10, one below 100, none above: `2.47×`, `22.8×`, `264×`.
pub fn fmt_ratio(r: f64) -> String {
    if r >= 100.0 {
        format!("{r:.0}×")
    } else if r >= 10.0 {
        format!("{r:.1}×")
    } else {
        format!("{r:.2}×")
    }
}

/// The first line where `have` and `want` differ: (1-based line, have's line, want's line).
fn first_difference(have: &str, want: &str) -> Option<(usize, String, String)> {
    if have == want {
        return None;
    }
    let (mut h, mut w) = (have.lines(), want.lines());
    let mut n = 0;
    loop {
        n += 1;
        match (h.next(), w.next()) {
            (Some(a), Some(b)) if a == b => continue,
            (None, None) => {
                // Only the trailing newline differs.
                return Some((n, "(end of file)".into(), "(end of file)".into()));
            }
            (a, b) => {
                let show = |l: Option<&str>| l.map_or_else(|| "(end of file)".to_string(), str::to_string);
                return Some((n, show(a), show(b)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(workload: &str, machine: &str, results: &str) -> String {
        format!(
            r#"{{"workload": "{workload}", "machine": "{machine}", "command": "cargo xtask metg",
                "commit": "d282244", "date": "2026-11-28", "results": {results}}}"#
        )
    }

    const ONE: &str = r#"[{"metric": "METG(50%)", "unit": "µs", "better": "lower", "figure": 1.97,
        "range": [1.90, 2.84], "anchor": {"name": "taskbench-mpi", "figure": 0.80}, "ratio": 2.47}]"#;

    #[test]
    fn numbers_and_ratios_are_formatted() {
        assert_eq!(fmt_ratio(2.4625), "2.46×");
        assert_eq!(fmt_ratio(1.0), "1.00×");
        assert_eq!(fmt_ratio(22.75), "22.8×");
        assert_eq!(fmt_ratio(263.6), "264×");
        assert_eq!(fmt_num(3.557e11), "3.557e11");
        assert_eq!(fmt_num(1.160e-4), "1.16e-4");
        assert_eq!(fmt_num(251065.0), "251,065");
        assert_eq!(fmt_num(1097.0), "1097");
        assert_eq!(fmt_num(158991.789961), "158991.789961");
        assert_eq!(fmt_num(0.80), "0.8");
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_value(1.97, "µs", Some([1.9, 2.84])), "1.97 µs (1.9–2.84)");
    }

    #[test]
    fn the_given_ratio_is_shown_else_the_computed_one() {
        let s = parse("a.json", &set("w", "m", ONE)).unwrap();
        assert_eq!(s.results[0].shown_ratio().map(fmt_ratio).as_deref(), Some("2.47×"));
        let computed = ONE.replace(r#", "ratio": 2.47"#, "");
        let s = parse("a.json", &set("w", "m", &computed)).unwrap();
        assert_eq!(s.results[0].shown_ratio().map(fmt_ratio).as_deref(), Some("2.46×"));
    }

    #[test]
    fn one_table_per_workload_and_machine_rows_in_file_order() {
        let no_anchor = r#"[{"metric": "tasks/s", "figure": 251065}]"#;
        let sets = vec![
            ("1.json".to_string(), parse("1.json", &set("B", "vm", ONE)).unwrap()),
            (
                "2.json".to_string(),
                parse("2.json", &set("A", "gpu", no_anchor)).unwrap(),
            ),
            (
                "3.json".to_string(),
                parse("3.json", &set("B", "vm", no_anchor)).unwrap(),
            ),
            (
                "4.json".to_string(),
                parse("4.json", &set("B", "gpu", no_anchor)).unwrap(),
            ),
        ];
        let dirs = RecordsDir {
            shown: "docs/records".into(),
            link: "records".into(),
        };
        let page = render(&sets, &dirs);
        let headings: Vec<&str> = page.lines().filter(|l| l.starts_with("## ")).collect();
        assert_eq!(headings, ["## A — gpu", "## B — gpu", "## B — vm"]);
        let b_vm = page.split("## B — vm").nth(1).unwrap();
        let rows: Vec<&str> = b_vm
            .lines()
            .filter(|l| l.starts_with("| METG") || l.starts_with("| tasks"))
            .collect();
        assert_eq!(
            rows,
            [
                "| METG(50%) ↓ | 1.97 µs (1.9–2.84) | taskbench-mpi: 0.8 µs | 2.47× | `cargo xtask metg` | `d282244` | 2026-11-28 |",
                "| tasks/s | 251,065 | — | — | `cargo xtask metg` | `d282244` | 2026-11-28 |",
            ]
        );
        assert!(b_vm.contains("Records: [`1.json`](records/1.json); [`3.json`](records/3.json)."));
    }

    #[test]
    fn a_malformed_record_names_its_file_and_field() {
        let err = |text: &str| format!("{:#}", parse("docs/records/bad.json", text).unwrap_err());
        // A wrong type deep inside: the path of the field.
        let e = err(&set("w", "m", &ONE.replace("\"figure\": 0.80", "\"figure\": \"0.80\"")));
        assert!(e.starts_with("docs/records/bad.json:"), "{e}");
        assert!(e.contains("results[0].anchor.figure: invalid type: string"), "{e}");
        // A missing field: its name and the object that lacks it.
        let e = err(&set("w", "m", ONE).replace(r#""commit": "d282244","#, ""));
        assert!(e.contains("missing field `commit`"), "{e}");
        let e = err(&set("w", "m", &ONE.replace(r#""metric": "METG(50%)", "#, "")));
        assert!(e.contains("results[0]: missing field `metric`"), "{e}");
        // An unknown field.
        let e = err(&set("w", "m", &ONE.replace("\"unit\"", "\"units\"")));
        assert!(e.contains("unknown field `units`"), "{e}");
        // Checks beyond the types.
        let e = err(&set("w", "m", &ONE.replace("2.47", "3.5")));
        assert!(e.contains("bad.json: results[0].ratio: 3.5 disagrees"), "{e}");
        let e = err(&set("w", "m", ONE).replace("2026-11-28", "28.11.2026"));
        assert!(e.contains("bad.json: date: \"28.11.2026\" is not YYYY-MM-DD"), "{e}");
        let e = err(&set("w", "m", &ONE.replace("[1.90, 2.84]", "[2.0, 2.84]")));
        assert!(
            e.contains("results[0].range: [2, 2.84] does not hold the figure 1.97"),
            "{e}"
        );
        let e = err(&set("w", "m", r#"[{"metric": "x", "figure": 1, "ratio": 2}]"#));
        assert!(e.contains("results[0].ratio: given without an anchor"), "{e}");
        let e = err("{\"workload\": ");
        assert!(e.starts_with("docs/records/bad.json:1:"), "{e}");
    }

    #[test]
    fn check_reports_the_first_differing_line() {
        assert_eq!(first_difference("a\nb\n", "a\nb\n"), None);
        assert_eq!(first_difference("a\nb\n", "a\nc\n"), Some((2, "b".into(), "c".into())));
        assert_eq!(
            first_difference("a\n", "a\nb\n"),
            Some((2, "(end of file)".into(), "b".into()))
        );
    }
}
