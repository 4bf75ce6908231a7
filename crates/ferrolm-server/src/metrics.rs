//! Prometheus metrics, with vLLM's metric names under the `ferrolm:` prefix.
//!
//! Each server owns its recorder (nothing is installed globally, so several servers can live in
//! one process, as the tests start them). Engine-wide gauges and counters are copied from
//! [`EngineHandle::stats`] when `/metrics` is scraped; the per-request histograms and the
//! finished-request counter are recorded by the handlers as requests progress.

use std::time::Duration;

use ferrolm_engine::EngineHandle;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Level, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

const NUM_REQUESTS_RUNNING: &str = "ferrolm:num_requests_running";
const NUM_REQUESTS_WAITING: &str = "ferrolm:num_requests_waiting";
const KV_CACHE_USAGE_PERC: &str = "ferrolm:kv_cache_usage_perc";
const PREFIX_CACHE_QUERIES: &str = "ferrolm:prefix_cache_queries_total";
const PREFIX_CACHE_HITS: &str = "ferrolm:prefix_cache_hits_total";
const PROMPT_TOKENS: &str = "ferrolm:prompt_tokens_total";
const GENERATION_TOKENS: &str = "ferrolm:generation_tokens_total";
const NUM_PREEMPTIONS: &str = "ferrolm:num_preemptions_total";
const REQUEST_SUCCESS: &str = "ferrolm:request_success_total";
const TTFT: &str = "ferrolm:time_to_first_token_seconds";
const ITL: &str = "ferrolm:inter_token_latency_seconds";
const E2E: &str = "ferrolm:e2e_request_latency_seconds";
const REQUEST_PROMPT_TOKENS: &str = "ferrolm:request_prompt_tokens";
const REQUEST_GENERATION_TOKENS: &str = "ferrolm:request_generation_tokens";

// Bucket bounds as vLLM's, with finer low buckets for ITL (small models decode in microseconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];
const TOKEN_COUNT_BUCKETS: &[f64] =
    &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0];

/// How a request ended, as the `finished_reason` label of `request_success_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishedReason {
    Stop,
    Length,
    Abort,
}

impl FinishedReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishedReason::Stop => "stop",
            FinishedReason::Length => "length",
            FinishedReason::Abort => "abort",
        }
    }
}

pub struct ServerMetrics {
    handle: PrometheusHandle,
    num_requests_running: Gauge,
    num_requests_waiting: Gauge,
    kv_cache_usage_perc: Gauge,
    prefix_cache_queries: Counter,
    prefix_cache_hits: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    num_preemptions: Counter,
    /// Indexed as [`FinishedReason`]: stop, length, abort.
    request_success: [Counter; 3],
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
}

impl ServerMetrics {
    /// A recorder whose every series carries `model_name="<served model name>"`, as vLLM's do.
    pub fn new(served_model_name: &str) -> ServerMetrics {
        let mut builder = PrometheusBuilder::new().add_global_label("model_name", served_model_name);
        for (name, buckets) in [
            (TTFT, TTFT_BUCKETS),
            (ITL, ITL_BUCKETS),
            (E2E, E2E_BUCKETS),
            (REQUEST_PROMPT_TOKENS, TOKEN_COUNT_BUCKETS),
            (REQUEST_GENERATION_TOKENS, TOKEN_COUNT_BUCKETS),
        ] {
            // NOTE: only an empty bucket list is refused; these are constants.
            builder = match builder.set_buckets_for_metric(Matcher::Full(name.to_string()), buckets) {
                Ok(b) => b,
                Err(_) => unreachable!("bucket lists are non-empty constants"),
            };
        }
        let recorder = builder.build_recorder();
        let r = &recorder;
        let describe = |kind: Kind, name: &'static str, unit: Option<Unit>, help: &'static str| {
            let (key_name, help) = (KeyName::from_const_str(name), SharedString::const_str(help));
            match kind {
                Kind::Counter => r.describe_counter(key_name, unit, help),
                Kind::Gauge => r.describe_gauge(key_name, unit, help),
                Kind::Histogram => r.describe_histogram(key_name, unit, help),
            }
        };
        describe(Kind::Gauge, NUM_REQUESTS_RUNNING, None, "Number of requests in model execution batches.");
        describe(Kind::Gauge, NUM_REQUESTS_WAITING, None, "Number of requests waiting to be processed.");
        describe(Kind::Gauge, KV_CACHE_USAGE_PERC, None, "KV-cache usage. 1 means 100 percent usage.");
        describe(
            Kind::Counter,
            PREFIX_CACHE_QUERIES,
            None,
            "Prefix cache queries, in terms of number of queried tokens.",
        );
        describe(Kind::Counter, PREFIX_CACHE_HITS, None, "Prefix cache hits, in terms of number of cached tokens.");
        describe(Kind::Counter, PROMPT_TOKENS, None, "Number of prefill tokens processed.");
        describe(Kind::Counter, GENERATION_TOKENS, None, "Number of generation tokens processed.");
        describe(Kind::Counter, NUM_PREEMPTIONS, None, "Cumulative number of preemptions from the engine.");
        describe(Kind::Counter, REQUEST_SUCCESS, None, "Count of finished requests, by finish reason.");
        describe(Kind::Histogram, TTFT, Some(Unit::Seconds), "Histogram of time to first token in seconds.");
        describe(Kind::Histogram, ITL, Some(Unit::Seconds), "Histogram of inter-token latency in seconds.");
        describe(Kind::Histogram, E2E, Some(Unit::Seconds), "Histogram of e2e request latency in seconds.");
        describe(Kind::Histogram, REQUEST_PROMPT_TOKENS, None, "Number of prefill tokens processed, per request.");
        describe(
            Kind::Histogram,
            REQUEST_GENERATION_TOKENS,
            None,
            "Number of generation tokens processed, per request.",
        );

        let success = |reason: FinishedReason| {
            counter_with(r, REQUEST_SUCCESS, vec![Label::new("finished_reason", reason.as_str())])
        };
        ServerMetrics {
            handle: recorder.handle(),
            num_requests_running: gauge(r, NUM_REQUESTS_RUNNING),
            num_requests_waiting: gauge(r, NUM_REQUESTS_WAITING),
            kv_cache_usage_perc: gauge(r, KV_CACHE_USAGE_PERC),
            prefix_cache_queries: counter_with(r, PREFIX_CACHE_QUERIES, vec![]),
            prefix_cache_hits: counter_with(r, PREFIX_CACHE_HITS, vec![]),
            prompt_tokens: counter_with(r, PROMPT_TOKENS, vec![]),
            generation_tokens: counter_with(r, GENERATION_TOKENS, vec![]),
            num_preemptions: counter_with(r, NUM_PREEMPTIONS, vec![]),
            request_success: [
                success(FinishedReason::Stop),
                success(FinishedReason::Length),
                success(FinishedReason::Abort),
            ],
            ttft: histogram(r, TTFT),
            itl: histogram(r, ITL),
            e2e: histogram(r, E2E),
            request_prompt_tokens: histogram(r, REQUEST_PROMPT_TOKENS),
            request_generation_tokens: histogram(r, REQUEST_GENERATION_TOKENS),
        }
    }

    pub fn record_ttft(&self, d: Duration) {
        self.ttft.record(d.as_secs_f64());
    }

    pub fn record_itl(&self, d: Duration) {
        self.itl.record(d.as_secs_f64());
    }

    /// One sequence (one choice) ended, however it ended.
    pub fn record_sequence_finished(&self, reason: FinishedReason) {
        self.request_success[reason as usize].increment(1);
    }

    /// One API request ended: its latency and token counts.
    pub fn record_request(&self, e2e: Duration, prompt_tokens: usize, generation_tokens: usize) {
        self.e2e.record(e2e.as_secs_f64());
        self.request_prompt_tokens.record(prompt_tokens as f64);
        self.request_generation_tokens.record(generation_tokens as f64);
    }

    /// The Prometheus text exposition, with the engine's counters as of now.
    pub fn render(&self, engine: &EngineHandle) -> String {
        let s = engine.stats();
        self.num_requests_running.set(s.num_running as f64);
        self.num_requests_waiting.set(s.num_waiting as f64);
        self.kv_cache_usage_perc.set(s.kv_usage);
        self.prefix_cache_queries.absolute(s.prefix_cache_queries);
        self.prefix_cache_hits.absolute(s.prefix_cache_hits);
        self.prompt_tokens.absolute(s.prompt_tokens);
        self.generation_tokens.absolute(s.generation_tokens);
        self.num_preemptions.absolute(s.num_preemptions);
        self.handle.render()
    }

    /// Folds recent histogram samples into their buckets; without it they pile up between scrapes.
    pub fn run_upkeep(&self) {
        self.handle.run_upkeep();
    }
}

enum Kind {
    Counter,
    Gauge,
    Histogram,
}

const METADATA: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

fn counter_with(r: &PrometheusRecorder, name: &'static str, labels: Vec<Label>) -> Counter {
    r.register_counter(&Key::from_parts(name, labels), &METADATA)
}

fn gauge(r: &PrometheusRecorder, name: &'static str) -> Gauge {
    r.register_gauge(&Key::from_static_name(name), &METADATA)
}

fn histogram(r: &PrometheusRecorder, name: &'static str) -> Histogram {
    r.register_histogram(&Key::from_static_name(name), &METADATA)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_render_as_histograms_with_the_model_label() {
        let m = ServerMetrics::new("tiny");
        m.record_ttft(Duration::from_millis(30));
        m.record_sequence_finished(FinishedReason::Length);
        m.record_request(Duration::from_millis(80), 5, 7);
        let text = m.handle.render();
        assert!(text.contains("# TYPE ferrolm:time_to_first_token_seconds histogram"), "{text}");
        assert!(
            text.contains("ferrolm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.04\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ferrolm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.02\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("ferrolm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1"),
            "{text}"
        );
        assert!(text.contains("ferrolm:request_generation_tokens_sum{model_name=\"tiny\"} 7"), "{text}");
    }
}
