//! Per-request timings and their summaries (mean, median, percentiles), named as vLLM's benchmark
//! scripts name them so that results compare key for key.
//!
//! Definitions (as in vLLM):
//! - TTFT: from sending the request to the first output chunk.
//! - ITL: the gap between two consecutive output chunks of one request.
//! - TPOT: `(e2e latency - TTFT) / (output tokens - 1)`, per request with more than one output token.
//! - E2EL: from sending the request to its last output.

use serde_json::{Map, Value};

/// What one request measured. Times are in seconds.
#[derive(Clone, Debug, Default)]
pub struct RequestTiming {
    pub prompt_len: usize,
    pub output_len: usize,
    pub ttft: f64,
    /// Gaps between consecutive output chunks after the first.
    pub itl: Vec<f64>,
    pub latency: f64,
    pub success: bool,
    pub error: Option<String>,
}

impl RequestTiming {
    /// Time per output token after the first; `None` with fewer than two output tokens.
    pub fn tpot(&self) -> Option<f64> {
        (self.output_len > 1).then(|| (self.latency - self.ttft) / (self.output_len - 1) as f64)
    }
}

/// Summary of a sample, in the sample's unit.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Summary {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p90: f64,
    pub p99: f64,
}

/// The `p`-th percentile (0..=100) of `sorted` (ascending) with linear interpolation between the
/// closest ranks (numpy's default), 0 for an empty sample.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

/// Mean, median, population standard deviation and percentiles; all 0 for an empty sample (as
/// vLLM reports an empty metric).
pub fn summarize(values: &[f64]) -> Summary {
    if values.is_empty() {
        return Summary::default();
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    Summary {
        mean,
        median: percentile(&sorted, 50.0),
        std: var.sqrt(),
        p90: percentile(&sorted, 90.0),
        p99: percentile(&sorted, 99.0),
    }
}

/// The latency summaries of a set of requests (successful ones only), in milliseconds.
#[derive(Clone, Debug, Default)]
pub struct LatencySummaries {
    pub ttft: Summary,
    pub tpot: Summary,
    pub itl: Summary,
    pub e2el: Summary,
}

impl LatencySummaries {
    pub fn from_timings(timings: &[RequestTiming]) -> LatencySummaries {
        let ok = || timings.iter().filter(|t| t.success);
        let ms = |v: f64| v * 1000.0;
        let ttfts: Vec<f64> = ok().map(|t| ms(t.ttft)).collect();
        let tpots: Vec<f64> = ok().filter_map(RequestTiming::tpot).map(ms).collect();
        let itls: Vec<f64> = ok().flat_map(|t| t.itl.iter().copied()).map(ms).collect();
        let e2els: Vec<f64> = ok().map(|t| ms(t.latency)).collect();
        LatencySummaries {
            ttft: summarize(&ttfts),
            tpot: summarize(&tpots),
            itl: summarize(&itls),
            e2el: summarize(&e2els),
        }
    }

    /// Adds `mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p90_ttft_ms`, `p99_ttft_ms` and the
    /// same for `tpot`, `itl` and `e2el`.
    pub fn insert_into(&self, map: &mut Map<String, Value>) {
        for (name, s) in [("ttft", &self.ttft), ("tpot", &self.tpot), ("itl", &self.itl), ("e2el", &self.e2el)] {
            for (stat, v) in [("mean", s.mean), ("median", s.median), ("std", s.std), ("p90", s.p90), ("p99", s.p99)] {
                map.insert(format!("{stat}_{name}_ms"), Value::from(v));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentile_interpolates_like_numpy() {
        // numpy.percentile([1, 2, 3, 4], [0, 50, 90, 99, 100]) = [1, 2.5, 3.7, 3.97, 4]
        let v = [1.0, 2.0, 3.0, 4.0];
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 50.0), 2.5));
        assert!(close(percentile(&v, 90.0), 3.7));
        assert!(close(percentile(&v, 99.0), 3.97));
        assert!(close(percentile(&v, 100.0), 4.0));
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn summary_of_unsorted_sample() {
        let s = summarize(&[5.0, 1.0, 4.0, 2.0, 3.0]);
        assert!(close(s.mean, 3.0));
        assert!(close(s.median, 3.0));
        assert!(close(s.std, 2f64.sqrt()));
        assert!(close(s.p90, 4.6));
        assert!(close(s.p99, 4.96));
        assert!(s.median <= s.p90 && s.p90 <= s.p99);
        assert_eq!(summarize(&[]), Summary::default());
    }

    #[test]
    fn tpot_skips_single_token_requests_and_failures() {
        let timings = [
            RequestTiming {
                output_len: 5,
                ttft: 0.1,
                latency: 0.5,
                success: true,
                itl: vec![0.1; 4],
                ..Default::default()
            },
            RequestTiming { output_len: 1, ttft: 0.2, latency: 0.2, success: true, ..Default::default() },
            RequestTiming { output_len: 3, ttft: 9.0, latency: 9.0, success: false, ..Default::default() },
        ];
        let s = LatencySummaries::from_timings(&timings);
        assert!(close(s.tpot.mean, 100.0));
        assert!(close(s.ttft.mean, 150.0));
        assert!(close(s.itl.median, 100.0));
        // E2E latencies [200, 500] ms: p99 = 200 + 0.99 * 300.
        assert!(close(s.e2el.p99, 497.0));
        let mut map = Map::new();
        s.insert_into(&mut map);
        for key in ["mean_ttft_ms", "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "std_ttft_ms"] {
            assert!(map.contains_key(key), "{key}");
        }
    }
}
