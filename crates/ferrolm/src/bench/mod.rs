//! `ferrolm bench`: offline throughput, single-request latency and serving load, with vLLM's
//! flag names and result keys so that figures compare directly with vLLM's benchmark scripts.
//!
//! - `throughput`: every request submitted at once to an in-process engine, with the run's work
//!   priced at the machine's GEMM rate and memory bandwidth (the throughput limit).
//! - `latency`: one request at a time, with the machine's memory bandwidth and the batch-1 decode
//!   limit it implies, and the first token's limit at the GEMM rate.
//! - `serve`: Poisson arrivals against any OpenAI-compatible server over HTTP.
//!
//! Every mode prints an aligned table and, with `--json FILE`, writes every figure together with
//! the machine, the model shape, the flags and the git revision.

mod bandwidth;
mod latency;
mod limit;
mod metrics;
mod openai;
mod plot;
mod report;
mod serve;
mod setup;
mod structured;
mod throughput;
mod workload;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use ferrolm_engine::{EngineHandle, FinishReason, RequestStream};
use ferrolm_sampling::SamplingParams;
use serde::Serialize;
use tokio::task::JoinSet;

use bandwidth::Device;
use metrics::RequestTiming;
use setup::BenchModel;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Offline throughput: all requests at once through the in-process engine.
    Throughput(throughput::ThroughputArgs),
    /// Latency of one request at a time: TTFT, TPOT, ITL, and the decode bandwidth limit.
    Latency(latency::LatencyArgs),
    /// Load an OpenAI-compatible server over HTTP with Poisson arrivals.
    Serve(serve::ServeArgs),
}

pub fn run(args: BenchArgs) -> Result<()> {
    match args.command {
        BenchCommand::Throughput(args) => throughput::run(args),
        BenchCommand::Latency(args) => latency::run(args),
        BenchCommand::Serve(args) => serve::run(args),
    }
}

/// How benchmark requests sample (`bench latency` and `bench throughput`).
#[derive(Args, Clone, Debug, Serialize)]
pub struct SamplingFlags {
    /// Sampling temperature; 0 is greedy. Above 0 each request samples with its own seed
    /// derived from --seed.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of most likely tokens whose probability reaches this,
    /// in (0, 1]; 1 is off. Llama 3's generation_config.json asks for 0.9 (with temperature 0.6).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
}

impl SamplingFlags {
    /// Refuses values the engine would refuse, before anything is loaded.
    fn check(&self) -> Result<()> {
        self.params(1, 0).validate().map_err(|e| anyhow::anyhow!("invalid sampling flags: {e}"))
    }

    /// Sampling for one benchmark request: exactly `max_tokens` outputs (EOS ignored), greedy at
    /// temperature 0, else seeded by `seed`, with nucleus sampling below `top_p` 1.
    fn params(&self, max_tokens: usize, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            seed: Some(seed),
            max_tokens: Some(max_tokens as u32),
            ignore_eos: true,
            ..SamplingParams::default()
        }
    }
}

/// Waits for every task of `tasks`, each answering its request's index and timing; returns the
/// `n` timings in request order.
async fn join_timings(mut tasks: JoinSet<(usize, RequestTiming)>, n: usize) -> Result<Vec<RequestTiming>> {
    let mut timings = vec![RequestTiming::default(); n];
    while let Some(joined) = tasks.join_next().await {
        let (i, timing) = joined.context("a request task failed")?;
        timings[i] = timing;
    }
    Ok(timings)
}

/// Drains one request's outputs, timing each against `sent`.
async fn collect_timing(mut stream: RequestStream, sent: Instant, prompt_len: usize) -> RequestTiming {
    let mut timing = RequestTiming { prompt_len, ..RequestTiming::default() };
    let mut last: Option<Instant> = None;
    let mut finish = None;
    while let Some(out) = stream.recv().await {
        let now = Instant::now();
        if !out.token_ids.is_empty() {
            match last {
                None => timing.ttft = (now - sent).as_secs_f64(),
                Some(prev) => timing.itl.push((now - prev).as_secs_f64()),
            }
            last = Some(now);
            timing.output_len += out.token_ids.len();
        }
        finish = out.finish_reason.or(finish);
    }
    timing.latency = last.map_or(0.0, |t| (t - sent).as_secs_f64());
    timing.success = matches!(finish, Some(FinishReason::Length | FinishReason::Stop));
    if !timing.success {
        timing.error = Some(format!("the engine ended the request ({finish:?})"));
    }
    timing
}

/// Stops `engine` and waits for it to free the model and the KV cache, so that the machine's
/// ceilings are measured on free memory (said on stderr if it does not end in time).
fn free_engine(engine: EngineHandle) {
    if !engine.shutdown(Duration::from_secs(60)) {
        eprintln!("warning: the engine did not stop within 60 s; measuring beside it");
    }
}

/// "Qwen2ForCausalLM 494M", for the table.
fn model_label(model: &BenchModel) -> String {
    let params = model.config.num_parameters() as f64;
    let size = match params {
        p if p >= 1e9 => format!("{:.2}B", p / 1e9),
        p if p >= 1e6 => format!("{:.0}M", p / 1e6),
        p => format!("{:.0}K", p / 1e3),
    };
    format!("{} {size}", model.config.architecture.hf_name())
}
