//! `ferrolm bench throughput`: offline throughput. Every request is submitted at once, with
//! EOS ignored so that each produces exactly its output length; the engine batches them
//! continuously and the clock runs from the first submission to the last token.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use ferrolm_engine::{EngineHandle, GenerateRequest, StepTimesSnapshot, STEP_BUCKET_SEQS};
use serde::Serialize;
use serde_json::Value;

use super::bandwidth::{Bandwidth, BandwidthArgs, Device};
use super::limit::{self, GemmRate, RunWork, Served, StepCaps, ThroughputLimit};
use super::metrics::{LatencySummaries, RequestTiming};
use super::setup::{self, BenchModel, ModelArgs};
use super::structured::StructuredBench;
use super::workload::{BenchRequest, WorkloadArgs};
use super::{collect_timing, free_engine, join_timings, model_label, report, SamplingFlags};
use ferrolm_structured::Grammar;

#[derive(Args, Debug, Serialize)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub sampling: SamplingFlags,
    /// The bandwidth of the throughput limit, measured once the run is over and the engine freed.
    #[command(flatten)]
    #[serde(flatten)]
    pub bandwidth: BandwidthArgs,
    /// Constrain every request's output (see `bench::structured`), to measure what structured
    /// output costs against the same run without it.
    #[arg(long, value_enum)]
    pub structured_output: Option<StructuredBench>,
    /// Write every figure, the machine, the model and the flags to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(args: ThroughputArgs) -> Result<()> {
    args.workload.validate()?;
    args.sampling.check()?;
    let device = Device::of(&args.model.engine);
    let (engine, model) = setup::load(&args.model, args.workload.num_prompts, args.workload.longest_request())?;
    let requests = args.workload.requests(&model.prompts)?;
    let grammar = args.structured_output.map(|s| s.grammar(&model)).transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    let (timings, elapsed) = runtime.block_on(run_batch(&engine, &requests, &args, grammar.as_ref()))?;
    let mut results = summarize(&args, &engine, &model, &timings, elapsed);
    let stats = engine.stats();
    let steps = stats.step_times;
    free_engine(engine);
    let output_throughput = results["output_throughput"].as_f64().unwrap_or(0.0);
    let limit = match measure_limit(&args, device, &model, &timings, output_throughput) {
        Ok(limit) => Some(limit),
        Err(e) => {
            eprintln!("warning: no throughput limit: {e:#}");
            None
        }
    };

    let mut table = report::Table::new("Offline Throughput Benchmark Result");
    table
        .text("Model", model_label(&model))
        .text("Device", &model.device)
        .text("Successful requests", timings.iter().filter(|t| t.success).count())
        .num("Benchmark duration (s)", elapsed)
        .text("Total input tokens", results["total_input_tokens"].clone())
        .text("Total generated tokens", results["total_output_tokens"].clone())
        .num("Request throughput (req/s)", results["request_throughput"].as_f64().unwrap_or(0.0))
        .num("Output token throughput (tok/s)", output_throughput)
        .num("Total token throughput (tok/s)", results["total_token_throughput"].as_f64().unwrap_or(0.0))
        .latencies(&LatencySummaries::from_timings(&timings));
    let (mixed_steps, mixed_us) = steps.mixed;
    table.text("Steps with prompt tokens: count, mean (ms)", step_line(mixed_steps, mixed_us));
    for (i, &(count, micros)) in steps.decode.iter().enumerate().filter(|(_, &(count, _))| count > 0) {
        table.text(
            &format!("Decode steps of {} seqs: count, mean (ms)", bucket_label(i, steps.decode.len())),
            step_line(count, micros),
        );
    }
    if stats.masked_steps > 0 {
        let per_step_ms = stats.mask_us as f64 / stats.masked_steps as f64 / 1e3;
        table.text("Token masks: steps, mean per step (ms)", format!("{}, {per_step_ms:.3}", stats.masked_steps));
        results.insert("masked_steps".into(), stats.masked_steps.into());
        results.insert("mask_ms_per_step".into(), per_step_ms.into());
    }
    if let Some(limit) = &limit {
        limit.add_to(&mut table);
        limit.insert_into(&mut results);
    }
    table.print();
    if let Some(path) = &args.json {
        report::write_json(path, &results)?;
    }
    Ok(())
}

/// The run's work at this machine's GEMM rate and memory bandwidth.
fn measure_limit(
    args: &ThroughputArgs,
    device: Device,
    model: &BenchModel,
    timings: &[RequestTiming],
    output_throughput: f64,
) -> Result<MeasuredLimit> {
    let engine = &args.model.engine;
    let caps = StepCaps { max_num_seqs: engine.max_num_seqs, max_num_batched_tokens: engine.max_num_batched_tokens };
    let served: Vec<Served> =
        timings.iter().map(|t| Served { prompt_len: t.prompt_len, output_len: t.output_len }).collect();
    let work = RunWork::of(&model.config, &served, caps, &model.step_weights(), model.kv_bytes_per_context_token());
    let bandwidth = args.bandwidth.measure(device)?;
    // The GPU multiplies in the engine's dtype; the CPU in f32 from the stored weights.
    let weights = if device == Device::Cpu { model.dtype } else { model.activation_dtype };
    eprintln!("measuring {device:?} GEMM rate ({} rows)...", caps.max_num_batched_tokens);
    let rate = limit::measure_gemm_rate(
        device,
        &model.config,
        weights,
        caps.max_num_batched_tokens,
        limit::Fp8Switches::of(&engine.gpu),
    )?;
    let output_tokens = timings.iter().map(|t| t.output_len).sum();
    let limit = ThroughputLimit::of(&work, &rate, &bandwidth, output_tokens, output_throughput);
    Ok(MeasuredLimit { work, rate, bandwidth, limit })
}

/// The limit with the ceilings it was computed from.
struct MeasuredLimit {
    work: RunWork,
    rate: GemmRate,
    bandwidth: Bandwidth,
    limit: ThroughputLimit,
}

impl MeasuredLimit {
    fn add_to(&self, table: &mut report::Table) {
        let (w, l) = (&self.work, &self.limit);
        table.section("Throughput Limit (work at measured ceilings)");
        self.rate.add_to(table);
        table
            .num("Memory read bandwidth (GB/s)", self.bandwidth.gbps())
            .num("GEMM and attention arithmetic (TFLOP)", (w.gemm_flops + w.attention_flops) / 1e12)
            .num("K/V read by decode tokens (GB)", w.kv_read_bytes / 1e9)
            .num(&format!("Weights read in {} steps at fewest (GB)", w.min_steps), w.weight_read_bytes / 1e9);
        if w.experts_per_step > 0.0 {
            // The experts a mean step reads of each sparse layer, expected under uniform routing.
            table
                .num("Tokens a step, at the fewest steps", w.mean_step_tokens)
                .num("Experts read a layer a step (if uniform)", w.experts_per_step);
        }
        table
            .num("Limit, GEMMs then attention (tok/s)", l.in_sequence)
            .text("Fraction of that limit", format!("{:.1}%", l.fraction_in_sequence * 100.0))
            .num("Limit, all overlapped (tok/s)", l.overlapped)
            .text("Fraction of that limit", format!("{:.1}%", l.fraction_overlapped * 100.0));
    }

    fn insert_into(&self, r: &mut serde_json::Map<String, Value>) {
        let (w, l) = (&self.work, &self.limit);
        self.bandwidth.insert_into(r);
        self.rate.insert_into(r);
        r.insert("compute_dtype_gemm_flops".into(), w.compute_dtype_gemm_flops.into());
        r.insert("gemm_flops".into(), w.gemm_flops.into());
        r.insert("attention_flops".into(), w.attention_flops.into());
        r.insert("kv_read_bytes".into(), w.kv_read_bytes.into());
        r.insert("weight_read_bytes".into(), w.weight_read_bytes.into());
        r.insert("min_steps".into(), w.min_steps.into());
        r.insert("mean_step_tokens".into(), w.mean_step_tokens.into());
        // Expected distinct routed experts a step reads per sparse layer under uniform routing,
        // E (1 - (1 - k/E)^B) at the mean step's B tokens; 0 for a dense model.
        r.insert("expected_experts_per_step".into(), w.experts_per_step.into());
        r.insert("limit_in_sequence_output_throughput".into(), l.in_sequence.into());
        r.insert("fraction_of_limit_in_sequence".into(), l.fraction_in_sequence.into());
        r.insert("limit_overlapped_output_throughput".into(), l.overlapped.into());
        r.insert("fraction_of_limit_overlapped".into(), l.fraction_overlapped.into());
    }
}

/// Submits every request, then waits for all of them; returns their timings and the seconds
/// from the first submission to the last output.
async fn run_batch(
    engine: &EngineHandle,
    requests: &[BenchRequest],
    args: &ThroughputArgs,
    grammar: Option<&Grammar>,
) -> Result<(Vec<RequestTiming>, f64)> {
    let bar = report::progress(requests.len(), "throughput");
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, req) in requests.iter().enumerate() {
        let params = args.sampling.params(req.output_len, args.workload.seed.wrapping_add(i as u64));
        let stream = engine
            .submit(GenerateRequest {
                prompt_token_ids: req.prompt_token_ids.clone(),
                params,
                grammar: grammar.cloned(),
            })
            .with_context(|| format!("request {i} was refused"))?;
        let (bar, prompt_len) = (bar.clone(), req.prompt_token_ids.len());
        tasks.spawn(async move {
            let timing = collect_timing(stream, start, prompt_len).await;
            bar.inc(1);
            (i, timing)
        });
    }
    let timings = join_timings(tasks, requests.len()).await?;
    let elapsed = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok((timings, elapsed))
}

fn summarize(
    args: &ThroughputArgs,
    engine: &EngineHandle,
    model: &BenchModel,
    timings: &[RequestTiming],
    elapsed: f64,
) -> serde_json::Map<String, Value> {
    let input: usize = timings.iter().map(|t| t.prompt_len).sum();
    let output: usize = timings.iter().map(|t| t.output_len).sum();
    let completed = timings.iter().filter(|t| t.success).count();
    let n = timings.len();
    let stats = engine.stats();
    let mut r = report::header("throughput", args);
    r.insert("device".into(), model.device.clone().into());
    r.insert("dtype".into(), setup::dtype_name(model.dtype).into());
    r.insert("model".into(), model.describe());
    r.insert("load_seconds".into(), model.load_seconds.into());
    r.insert("num_prompts".into(), n.into());
    r.insert("completed".into(), completed.into());
    r.insert("failed".into(), (n - completed).into());
    r.insert("input_len".into(), args.workload.input_len.into());
    r.insert("output_len".into(), args.workload.output_len.into());
    r.insert("random_range_ratio".into(), args.workload.random_range_ratio.into());
    r.insert("elapsed_time".into(), elapsed.into());
    r.insert("total_input_tokens".into(), input.into());
    r.insert("total_output_tokens".into(), output.into());
    r.insert("request_throughput".into(), (n as f64 / elapsed).into());
    r.insert("output_throughput".into(), (output as f64 / elapsed).into());
    r.insert("total_token_throughput".into(), ((input + output) as f64 / elapsed).into());
    // The names of vLLM's `benchmark_throughput.py`.
    r.insert("num_requests".into(), n.into());
    r.insert("total_num_tokens".into(), (input + output).into());
    r.insert("requests_per_second".into(), (n as f64 / elapsed).into());
    r.insert("tokens_per_second".into(), ((input + output) as f64 / elapsed).into());
    LatencySummaries::from_timings(timings).insert_into(&mut r);
    r.insert("num_steps".into(), stats.num_steps.into());
    r.insert("num_steps_ahead".into(), stats.num_steps_ahead.into());
    r.insert("host_gap_seconds".into(), (stats.host_gap_us as f64 / 1e6).into());
    r.insert("num_preemptions".into(), stats.num_preemptions.into());
    r.insert("num_kv_blocks".into(), stats.num_blocks.into());
    insert_step_times(&mut r, &stats.step_times);
    r
}

/// The mean times of decode steps by batch size and of steps with prompt tokens.
fn insert_step_times(r: &mut serde_json::Map<String, Value>, steps: &StepTimesSnapshot) {
    let (decode_steps, decode_us) =
        steps.decode.iter().fold((0, 0), |(n, t), &(count, micros)| (n + count, t + micros));
    r.insert("num_decode_steps".into(), decode_steps.into());
    r.insert("mean_decode_step_ms".into(), mean_ms(decode_steps, decode_us).into());
    let by_batch: Vec<Value> = steps
        .decode
        .iter()
        .enumerate()
        .filter(|(_, &(count, _))| count > 0)
        .map(|(i, &(count, micros))| {
            serde_json::json!({"seqs": bucket_label(i, steps.decode.len()), "steps": count, "mean_ms": mean_ms(count, micros)})
        })
        .collect();
    r.insert("decode_steps_by_batch".into(), by_batch.into());
    r.insert("num_mixed_steps".into(), steps.mixed.0.into());
    r.insert("mean_mixed_step_ms".into(), mean_ms(steps.mixed.0, steps.mixed.1).into());
}

/// "64-95" for bucket 2; "992+" for the last.
fn bucket_label(i: usize, buckets: usize) -> String {
    let low = i * STEP_BUCKET_SEQS;
    if i + 1 == buckets {
        format!("{low}+")
    } else {
        format!("{low}-{}", low + STEP_BUCKET_SEQS - 1)
    }
}

fn mean_ms(count: u64, micros: u64) -> f64 {
    if count == 0 {
        0.0
    } else {
        micros as f64 / count as f64 / 1e3
    }
}

fn step_line(count: u64, micros: u64) -> String {
    format!("{count}, {:.2}", mean_ms(count, micros))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_times_report_means_by_kind_and_batch() {
        let mut decode = vec![(0, 0); 32];
        decode[0] = (4, 8_000); // 1-31 requests: 2 ms each
        decode[12] = (10, 300_000); // 384-415: 30 ms each
        decode[31] = (1, 50_000); // 992 and up
        let steps = StepTimesSnapshot { decode, mixed: (2, 400_000) };
        let mut r = serde_json::Map::new();
        insert_step_times(&mut r, &steps);
        assert_eq!(r["num_decode_steps"], 15);
        assert!((r["mean_decode_step_ms"].as_f64().unwrap() - 358.0 / 15.0).abs() < 1e-9);
        assert_eq!(r["num_mixed_steps"], 2);
        assert_eq!(r["mean_mixed_step_ms"], 200.0);
        let by_batch = r["decode_steps_by_batch"].as_array().unwrap();
        let rows: Vec<(&str, u64, f64)> = by_batch
            .iter()
            .map(|b| (b["seqs"].as_str().unwrap(), b["steps"].as_u64().unwrap(), b["mean_ms"].as_f64().unwrap()))
            .collect();
        assert_eq!(rows, [("0-31", 4, 2.0), ("384-415", 10, 30.0), ("992+", 1, 50.0)]);
    }

    #[test]
    fn no_steps_give_zero_means() {
        let mut r = serde_json::Map::new();
        insert_step_times(&mut r, &StepTimesSnapshot { decode: vec![(0, 0); 32], mixed: (0, 0) });
        assert_eq!(r["mean_decode_step_ms"], 0.0);
        assert_eq!(r["mean_mixed_step_ms"], 0.0);
        assert!(r["decode_steps_by_batch"].as_array().unwrap().is_empty());
    }
}
