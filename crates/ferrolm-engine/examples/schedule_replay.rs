//! Replays an offline batch (every request submitted at once, each producing exactly its output
//! length) through the scheduler alone, with no model, and prices each step with a step-cost
//! model: what a schedule's shape (batch sizes, waves, preemptions) costs, before a GPU runs it.
//!
//! ```text
//! cargo run --release -p ferrolm-engine --example schedule_replay -- \
//!     --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-seqs 384 \
//!     --max-num-batched-tokens 8192 --kv-tokens 968000
//! ```
//!
//! A step costs `--step-ms`, plus per decode request `--decode-us` and `--attention-us` scaled by
//! its context over `--attention-context`, plus `--prompt-us` per prompt token (recomputed tokens
//! of a preempted request included). The defaults are the fit of the Llama-3.1-8B's
//! 1000-request run on one H200 (docs/PERFORMANCE.md).

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;

use ferrolm_engine::{KvCacheGroupConfig, Request, RequestId, Scheduler, SchedulerConfig};

/// `--name value` flags with their defaults.
const FLAGS: [(&str, f64); 11] = [
    ("num-prompts", 1000.0),
    ("input-len", 1000.0),
    ("output-len", 1000.0),
    ("max-num-seqs", 384.0),
    ("max-num-batched-tokens", 8192.0),
    ("kv-tokens", 968_000.0),
    ("step-ms", 4.1),
    ("decode-us", 20.0),
    ("attention-us", 48.0),
    ("attention-context", 1500.0),
    ("prompt-us", 23.4),
];
const BLOCK_SIZE: usize = 16;
/// Decode batches are reported in buckets of this many requests.
const BUCKET: usize = 32;

fn parse() -> Result<HashMap<&'static str, f64>, String> {
    let mut values: HashMap<&'static str, f64> = FLAGS.iter().copied().collect();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let name = arg.strip_prefix("--").ok_or_else(|| format!("unexpected argument `{arg}`"))?;
        let (key, _) = FLAGS.iter().find(|(k, _)| *k == name).ok_or_else(|| format!("unknown flag `{arg}`"))?;
        let value = args.next().ok_or_else(|| format!("`{arg}` needs a value"))?;
        let value: f64 = value.parse().map_err(|_| format!("`{arg}`: `{value}` is not a number"))?;
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("`{arg}` must be a non-negative number"));
        }
        values.insert(key, value);
    }
    Ok(values)
}

/// What the replay counted.
#[derive(Default)]
struct Replay {
    seconds: f64,
    steps: usize,
    /// Steps with prompt tokens: count and seconds.
    mixed: (usize, f64),
    /// The decodes those steps carry, and their share of the steps' seconds (their GEMMs and
    /// attention): what running a step's decodes beside its prompt tokens could hide.
    mixed_decodes: (usize, f64),
    /// Decode-only steps by bucket of batch size: count and seconds.
    decode: BTreeMap<usize, (usize, f64)>,
    /// Prompt tokens computed: each prompt's once, and again after each preemption (less what
    /// the prefix cache still held when the request came back).
    prompt_tokens: usize,
    output_tokens: usize,
}

fn main() -> ExitCode {
    let flags = match parse() {
        Ok(flags) => flags,
        Err(e) => {
            eprintln!("schedule_replay: {e}");
            return ExitCode::from(2);
        }
    };
    let int = |name: &str| flags[name] as usize;
    let (n, input, output) = (int("num-prompts"), int("input-len"), int("output-len"));
    let config = SchedulerConfig {
        max_num_seqs: int("max-num-seqs").max(1),
        max_num_batched_tokens: int("max-num-batched-tokens").max(1),
        block_size: BLOCK_SIZE,
        kv_cache_groups: vec![KvCacheGroupConfig::full(int("kv-tokens") / BLOCK_SIZE)],
        max_model_len: input + output,
        long_prefill_token_threshold: None,
        max_prompt_logprob_rows: 256,
        enable_prefix_caching: true,
    };
    let mut scheduler = match Scheduler::new(config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("schedule_replay: {e}");
            return ExitCode::from(2);
        }
    };
    for i in 0..n {
        // Distinct prompts (no prefix shared), as a throughput benchmark's random ones.
        let prompt: Vec<u32> = (0..input).map(|t| (i * input + t) as u32).collect();
        if let Err(e) = scheduler.add_request(Request::new(RequestId(i as u64), prompt, output)) {
            eprintln!("schedule_replay: request {i}: {e}");
            return ExitCode::from(2);
        }
    }

    let mut replay = Replay::default();
    while scheduler.has_unfinished_requests() {
        let out = scheduler.schedule();
        if out.is_empty() {
            eprintln!("schedule_replay: the scheduler made no progress (is the cache too small for one request?)");
            return ExitCode::FAILURE;
        }
        let (mut decodes, mut context, mut prompt_tokens) = (0usize, 0usize, 0usize);
        for r in &out.scheduled {
            // A decode: one token of a request already past its prompt (not a recomputation).
            if !r.is_new && r.num_scheduled_tokens == 1 && r.num_computed_tokens >= input {
                decodes += 1;
                context += r.seq_len();
            } else {
                prompt_tokens += r.num_scheduled_tokens;
            }
        }
        let decode_ms = decodes as f64 * flags["decode-us"] / 1e3
            + context as f64 / flags["attention-context"].max(1.0) * flags["attention-us"] / 1e3;
        let ms = flags["step-ms"] + decode_ms + prompt_tokens as f64 * flags["prompt-us"] / 1e3;
        let seconds = ms / 1e3;
        replay.seconds += seconds;
        replay.steps += 1;
        replay.prompt_tokens += prompt_tokens;
        if prompt_tokens > 0 {
            replay.mixed.0 += 1;
            replay.mixed.1 += seconds;
            replay.mixed_decodes.0 += decodes;
            replay.mixed_decodes.1 += decode_ms / 1e3;
        } else {
            let bucket = replay.decode.entry(decodes / BUCKET * BUCKET).or_default();
            bucket.0 += 1;
            bucket.1 += seconds;
        }
        let sampled: Vec<(RequestId, Vec<u32>)> =
            out.scheduled.iter().filter(|r| r.samples_next_token).map(|r| (r.request_id, vec![0])).collect();
        match scheduler.update_from_output(&sampled) {
            Ok(finished) => replay.output_tokens += finished.iter().map(|r| r.num_output_tokens()).sum::<usize>(),
            Err(e) => {
                eprintln!("schedule_replay: {e}");
                return ExitCode::FAILURE;
            }
        }
    }

    println!("steps with prompt tokens: {} ({:.1} s)", replay.mixed.0, replay.mixed.1);
    println!(
        "  their decodes: {:.0} a step on average ({:.1} s of the steps)",
        replay.mixed_decodes.0 as f64 / replay.mixed.0.max(1) as f64,
        replay.mixed_decodes.1
    );
    for (low, (count, seconds)) in &replay.decode {
        println!("decode steps of {low}-{}: {count} ({seconds:.1} s)", low + BUCKET - 1);
    }
    println!("preemptions: {}", scheduler.num_preemptions());
    println!(
        "prompt tokens computed: {} ({} recomputed)",
        replay.prompt_tokens,
        replay.prompt_tokens.saturating_sub(n * input)
    );
    println!(
        "{} steps, {:.1} s predicted: {:.0} output tok/s",
        replay.steps,
        replay.seconds,
        replay.output_tokens as f64 / replay.seconds
    );
    ExitCode::SUCCESS
}
