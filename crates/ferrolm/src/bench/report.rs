//! What a benchmark leaves behind: an aligned table on stdout, a progress bar on stderr while it
//! runs, and a JSON file holding every figure with the machine, the model, the flags and the
//! revision that produced it.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::metrics::LatencySummaries;

/// Label column width of the terminal table.
const LABEL_WIDTH: usize = 44;
/// Value column width of the terminal table.
const VALUE_WIDTH: usize = 14;

/// A table of figures, in sections, printed with aligned columns.
pub struct Table {
    out: String,
}

impl Table {
    pub fn new(title: &str) -> Table {
        let mut table = Table { out: String::new() };
        table.rule(title, '=');
        table
    }

    fn rule(&mut self, title: &str, fill: char) {
        let width = LABEL_WIDTH + VALUE_WIDTH + 1;
        let title = if title.is_empty() { String::new() } else { format!(" {title} ") };
        let left = width.saturating_sub(title.len()) / 2;
        let right = width.saturating_sub(title.len() + left);
        let fill = |n| std::iter::repeat_n(fill, n).collect::<String>();
        let _ = writeln!(self.out, "{}{title}{}", fill(left), fill(right));
    }

    pub fn section(&mut self, title: &str) -> &mut Table {
        self.rule(title, '-');
        self
    }

    pub fn text(&mut self, label: &str, value: impl std::fmt::Display) -> &mut Table {
        let _ = writeln!(self.out, "{:<LABEL_WIDTH$} {:>VALUE_WIDTH$}", format!("{label}:"), value.to_string());
        self
    }

    /// A figure with two decimals.
    pub fn num(&mut self, label: &str, value: f64) -> &mut Table {
        self.text(label, format!("{value:.2}"))
    }

    /// Mean, median, P90 and P99 of one latency metric.
    pub fn latency(&mut self, title: &str, short: &str, s: &super::metrics::Summary) -> &mut Table {
        self.section(title);
        self.num(&format!("Mean {short} (ms)"), s.mean);
        self.num(&format!("Median {short} (ms)"), s.median);
        self.num(&format!("P90 {short} (ms)"), s.p90);
        self.num(&format!("P99 {short} (ms)"), s.p99)
    }

    pub fn latencies(&mut self, s: &LatencySummaries) -> &mut Table {
        self.latency("Time to First Token", "TTFT", &s.ttft);
        self.latency("Time per Output Token (excl. 1st token)", "TPOT", &s.tpot);
        self.latency("Inter-token Latency", "ITL", &s.itl);
        self.latency("End-to-end Latency", "E2EL", &s.e2el)
    }

    pub fn print(&mut self) {
        self.rule("", '=');
        print!("{}", self.out);
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(len: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}") {
        bar.set_style(style);
    }
    bar.set_prefix(what.to_owned());
    bar
}

fn read_proc(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// The machine the benchmark ran on: hostname, CPU model, cores, memory.
pub fn machine() -> Value {
    let hostname = read_proc("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into());
    let cpuinfo = read_proc("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_owned()))
        .unwrap_or_else(|| "unknown".into());
    let num_cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let memory_bytes = read_proc("/proc/meminfo").and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    json!({
        "hostname": hostname,
        "cpu_model": cpu_model,
        "num_cpus": num_cpus,
        "rayon_threads": rayon::current_num_threads(),
        "memory_bytes": memory_bytes,
        "memory_gib": memory_bytes.map(|b| b as f64 / (1u64 << 30) as f64),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    })
}

/// `$FERROLM_GIT_REVISION` (for a binary run away from its checkout), else `git rev-parse HEAD`
/// of the working directory, else of the source tree, else "unknown".
pub fn git_revision() -> String {
    if let Some(rev) = std::env::var("FERROLM_GIT_REVISION").ok().filter(|r| !r.trim().is_empty()) {
        return rev.trim().to_owned();
    }
    let in_dir = |dir: &Path| {
        Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    std::env::current_dir()
        .ok()
        .and_then(|d| in_dir(&d))
        .or_else(|| in_dir(Path::new(env!("CARGO_MANIFEST_DIR"))))
        .unwrap_or_else(|| "unknown".into())
}

/// Now, in UTC, as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format_utc(secs)
}

fn format_utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The fields every result file carries besides its figures.
pub fn header(bench: &str, flags: &impl Serialize) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert("bench".into(), bench.into());
    map.insert("date".into(), utc_now().into());
    map.insert("ferrolm_version".into(), env!("CARGO_PKG_VERSION").into());
    map.insert("git_revision".into(), git_revision().into());
    map.insert("command".into(), std::env::args().collect::<Vec<_>>().into());
    map.insert("flags".into(), serde_json::to_value(flags).unwrap_or(Value::Null));
    map.insert("machine".into(), machine());
    map
}

pub fn write_json(path: &Path, value: &Map<String, Value>) -> Result<()> {
    let text = serde_json::to_string_pretty(value).context("cannot serialize the results")?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("results written to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn table_columns_line_up() {
        let mut t = Table::new("Result");
        t.text("Successful requests", 12).num("Request throughput (req/s)", 1.23456).section("TTFT");
        t.num("Mean TTFT (ms)", 1234.5);
        let rows: Vec<&str> = t.out.lines().filter(|l| l.contains(':')).collect();
        assert_eq!(rows.len(), 3);
        assert!(rows.iter().all(|r| r.len() == LABEL_WIDTH + VALUE_WIDTH + 1), "{rows:?}");
        assert!(rows[1].ends_with(" 1.23"));
        assert!(t.out.lines().all(|l| l.chars().count() == LABEL_WIDTH + VALUE_WIDTH + 1), "{}", t.out);
    }

    #[test]
    fn machine_has_the_documented_fields() {
        let m = machine();
        for key in ["hostname", "cpu_model", "num_cpus", "memory_bytes"] {
            assert!(m.get(key).is_some(), "{key}");
        }
    }
}
