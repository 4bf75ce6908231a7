//! `ferrolm bench serve`: drives any OpenAI-compatible server over HTTP, as vLLM's
//! `benchmark_serving.py` does: random token-id prompts, Poisson arrivals at `--request-rate`
//! (all at once when infinite), optionally at most `--max-concurrency` requests in flight, one
//! streaming completion each with EOS ignored.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_model::ModelConfig;
use ferrolm_tokenizer::Tokenizer;
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::sync::Semaphore;

use super::metrics::{LatencySummaries, RequestTiming};
use super::openai::Client;
use super::plot::{self, Series};
use super::workload::{poisson_arrivals, BenchRequest, PromptSampler, WorkloadArgs};
use super::{join_timings, report};

#[derive(Args, Debug, Serialize)]
pub struct ServeArgs {
    /// Base URL of the server.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Path of the completions endpoint.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Served model name; by default the first one `GET /v1/models` lists.
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer token sent with every request.
    #[arg(long, env = "OPENAI_API_KEY")]
    #[serde(skip)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Requests per second, arriving as a Poisson process; inf sends them all at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// Most requests in flight at once (unlimited by default).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Vocabulary to draw prompt ids from (else --tokenizer or --model-config gives it).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Model directory whose tokenizer.json gives the vocabulary and the special ids to avoid.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// A config.json whose vocab_size (and BOS/EOS ids) bound the prompt ids.
    #[arg(long)]
    pub model_config: Option<PathBuf>,
    /// Seconds before one request is given up as failed.
    #[arg(long, default_value_t = 3600.0)]
    pub request_timeout: f64,
    /// Write every figure, the machine and the flags to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the latency distribution (CDFs of TTFT and ITL) to this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Prompt ids that the served model's tokenizer accepts.
fn prompt_sampler(args: &ServeArgs) -> Result<PromptSampler> {
    if let Some(n) = args.vocab_size {
        return PromptSampler::new(n, []);
    }
    if let Some(dir) = &args.tokenizer {
        let tok = Tokenizer::from_dir(dir)?;
        let n = tok.vocab_size();
        return PromptSampler::new(n, (0..n as u32).filter(|&id| tok.is_special(id)));
    }
    if let Some(path) = &args.model_config {
        let c = ModelConfig::from_file(path)?;
        return PromptSampler::new(c.vocab_size, c.bos_token_id.into_iter().chain(c.eos_token_ids));
    }
    bail!(
        "bench serve needs the served model's vocabulary: pass --tokenizer DIR, --model-config FILE or --vocab-size N"
    )
}

pub fn run(args: ServeArgs) -> Result<()> {
    args.workload.validate()?;
    if args.request_rate.is_nan() || args.request_rate <= 0.0 {
        bail!("--request-rate must be positive (inf sends every request at once)");
    }
    if args.max_concurrency == Some(0) {
        bail!("--max-concurrency must be positive");
    }
    let requests = args.workload.requests(&prompt_sampler(&args)?)?;
    let timeout = Duration::from_secs_f64(args.request_timeout.max(0.001));
    let client = Client::new(&args.url, &args.endpoint, args.api_key.clone(), timeout)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (model, timings, duration) = runtime.block_on(async {
        let model = match &args.model {
            Some(name) => name.clone(),
            None => client.first_model().await?,
        };
        // One short request first, so that a wrong URL or model fails fast and clearly.
        let probe = BenchRequest { prompt_token_ids: requests[0].prompt_token_ids.clone(), output_len: 2 };
        let test = client.complete(&model, &probe).await;
        if !test.success {
            bail!("the test request to {} failed: {}", args.url, test.error.unwrap_or_default());
        }
        let (timings, duration) = run_load(&client, &model, &requests, &args).await?;
        Ok((model, timings, duration))
    })?;

    let summaries = LatencySummaries::from_timings(&timings);
    let results = results(&args, &model, &timings, &summaries, duration);
    print_table(&results, &summaries);
    if let Some(path) = &args.plot {
        let ttfts: Vec<f64> = timings.iter().filter(|t| t.success).map(|t| t.ttft * 1000.0).collect();
        let itls: Vec<f64> =
            timings.iter().filter(|t| t.success).flat_map(|t| t.itl.iter().map(|v| v * 1000.0)).collect();
        let title = format!("{model}: {} requests at {} req/s", timings.len(), rate_label(args.request_rate));
        let svg = plot::cdf_svg(
            &title,
            &[Series { title: "TTFT", values_ms: &ttfts }, Series { title: "ITL", values_ms: &itls }],
        );
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("latency plot written to {}", path.display());
    }
    if let Some(path) = &args.json {
        report::write_json(path, &results)?;
    }
    Ok(())
}

/// Sends every request at its arrival time (waiting for a free slot under --max-concurrency) and
/// waits for all; returns their timings and the seconds from the start to the last response.
async fn run_load(
    client: &Client,
    model: &str,
    requests: &[BenchRequest],
    args: &ServeArgs,
) -> Result<(Vec<RequestTiming>, f64)> {
    let arrivals = poisson_arrivals(requests.len(), args.request_rate, args.workload.seed);
    let slots = Arc::new(Semaphore::new(args.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS)));
    let bar = report::progress(requests.len(), "serve");
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (req, at)) in requests.iter().zip(arrivals).enumerate() {
        tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
        let (client, model, req, bar, slots) =
            (client.clone(), model.to_owned(), req.clone(), bar.clone(), Arc::clone(&slots));
        tasks.spawn(async move {
            let _slot = slots.acquire_owned().await;
            let timing = client.complete(&model, &req).await;
            bar.inc(1);
            (i, timing)
        });
    }
    let timings = join_timings(tasks, requests.len()).await?;
    let duration = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok((timings, duration))
}

fn rate_label(rate: f64) -> String {
    if rate.is_infinite() {
        "inf".into()
    } else {
        format!("{rate}")
    }
}

fn results(
    args: &ServeArgs,
    model: &str,
    timings: &[RequestTiming],
    summaries: &LatencySummaries,
    duration: f64,
) -> Map<String, Value> {
    let ok: Vec<&RequestTiming> = timings.iter().filter(|t| t.success).collect();
    let input: usize = ok.iter().map(|t| t.prompt_len).sum();
    let output: usize = ok.iter().map(|t| t.output_len).sum();
    let mut r = report::header("serve", args);
    r.insert("url".into(), args.url.clone().into());
    r.insert("served_model_name".into(), model.into());
    r.insert("num_prompts".into(), timings.len().into());
    r.insert(
        "request_rate".into(),
        if args.request_rate.is_infinite() { "inf".into() } else { args.request_rate.into() },
    );
    r.insert("burstiness".into(), 1.0.into());
    r.insert("max_concurrency".into(), args.max_concurrency.into());
    r.insert("duration".into(), duration.into());
    r.insert("completed".into(), ok.len().into());
    r.insert("failed".into(), (timings.len() - ok.len()).into());
    r.insert("total_input_tokens".into(), input.into());
    r.insert("total_output_tokens".into(), output.into());
    r.insert("request_throughput".into(), (ok.len() as f64 / duration).into());
    r.insert("output_throughput".into(), (output as f64 / duration).into());
    r.insert("total_token_throughput".into(), ((input + output) as f64 / duration).into());
    summaries.insert_into(&mut r);
    r.insert("input_lens".into(), timings.iter().map(|t| t.prompt_len).collect::<Vec<_>>().into());
    r.insert("output_lens".into(), timings.iter().map(|t| t.output_len).collect::<Vec<_>>().into());
    r.insert("ttfts".into(), timings.iter().map(|t| t.ttft).collect::<Vec<_>>().into());
    r.insert("errors".into(), timings.iter().map(|t| t.error.clone().unwrap_or_default()).collect::<Vec<_>>().into());
    r
}

fn print_table(r: &Map<String, Value>, s: &LatencySummaries) {
    let f = |key: &str| r.get(key).and_then(Value::as_f64).unwrap_or(0.0);
    let concurrency = r.get("max_concurrency").and_then(Value::as_u64).map_or("unlimited".into(), |c| c.to_string());
    let rate = r.get("request_rate").map_or(String::new(), |v| v.as_str().map_or(v.to_string(), str::to_owned));
    let mut table = report::Table::new("Serving Benchmark Result");
    table
        .text("Successful requests", f("completed"))
        .text("Failed requests", f("failed"))
        .text("Maximum request concurrency", concurrency)
        .text("Request rate configured (RPS)", rate)
        .num("Benchmark duration (s)", f("duration"))
        .text("Total input tokens", f("total_input_tokens"))
        .text("Total generated tokens", f("total_output_tokens"))
        .num("Request throughput (req/s)", f("request_throughput"))
        .num("Output token throughput (tok/s)", f("output_throughput"))
        .num("Total token throughput (tok/s)", f("total_token_throughput"))
        .latencies(s)
        .print();
}
