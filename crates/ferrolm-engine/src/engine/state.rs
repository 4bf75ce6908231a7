//! What the engine reports: per-step outputs of a request and the shared counters.

use std::sync::atomic::{AtomicU64, Ordering};

use ferrolm_sampling::TokenLogprobs;

use crate::request::FinishReason;

/// Logprob of one prompt token given the ones before it (with the top entries at that row).
pub type PromptLogprob = Option<TokenLogprobs>;

/// What one step produced for one sequence of a request (sequence `index` of `n`).
#[derive(Clone, Debug, Default)]
pub struct RequestOutput {
    pub index: u32,
    /// Tokens sampled this step (one, or none when a stop string swallowed them).
    pub token_ids: Vec<u32>,
    /// New text, safe to show: never half a UTF-8 character, never part of a stop string.
    pub text: String,
    /// Logprobs of `token_ids`, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// With the first output of sequence 0, when asked for: one entry per prompt token (the
    /// first is `None`).
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    pub finish_reason: Option<FinishReason>,
    pub num_prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache.
    pub num_cached_tokens: usize,
}

/// Counters the engine thread updates each step; read from any thread.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub num_running: AtomicU64,
    pub num_waiting: AtomicU64,
    /// Fraction of KV blocks in use (in the KV cache group where it is highest), as `f64` bits.
    kv_usage_bits: AtomicU64,
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub num_preemptions: AtomicU64,
    pub num_steps: AtomicU64,
    /// Steps launched while the step before was still running (see `EngineConfig::overlap_steps`).
    pub num_steps_ahead: AtomicU64,
    /// Microseconds from collecting a step (none launched ahead) to launching the next one while
    /// requests were running: the host's time between steps, when the device has nothing to do.
    pub host_gap_us: AtomicU64,
    /// Blocks of the first KV cache group's pool (full attention, or a model's one sliding
    /// group): `--num-kv-blocks`, or what the memory budget gave it.
    pub num_blocks: AtomicU64,
    pub step_times: StepTimes,
    /// Steps with grammar-constrained rows, and the microseconds spent computing their token
    /// masks (while the device ran each step's forward pass).
    pub masked_steps: AtomicU64,
    pub mask_us: AtomicU64,
}

/// Decode steps are timed in buckets of this many sequences ([`StepTimes`]).
pub const STEP_BUCKET_SEQS: usize = 32;
const STEP_BUCKETS: usize = 32;

/// Times of steps run back to back, from the collect of one to the collect of the next: the
/// device time of a step launched ahead, else also the host's time before its launch.
#[derive(Debug, Default)]
pub struct StepTimes {
    /// Steps without prompt tokens, by `sequences / STEP_BUCKET_SEQS` (the last bucket takes
    /// the rest): (steps, microseconds).
    decode: [(AtomicU64, AtomicU64); STEP_BUCKETS],
    /// Steps with prompt tokens: (steps, microseconds).
    mixed: (AtomicU64, AtomicU64),
}

impl StepTimes {
    pub(crate) fn record(&self, num_seqs: usize, has_prompt_tokens: bool, micros: u64) {
        let (steps, total) = if has_prompt_tokens {
            &self.mixed
        } else {
            &self.decode[(num_seqs / STEP_BUCKET_SEQS).min(STEP_BUCKETS - 1)]
        };
        steps.fetch_add(1, Ordering::Relaxed);
        total.fetch_add(micros, Ordering::Relaxed);
    }

    fn snapshot(&self) -> StepTimesSnapshot {
        let get =
            |(steps, micros): &(AtomicU64, AtomicU64)| (steps.load(Ordering::Relaxed), micros.load(Ordering::Relaxed));
        StepTimesSnapshot { decode: self.decode.iter().map(get).collect(), mixed: get(&self.mixed) }
    }
}

/// [`StepTimes`] read at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTimesSnapshot {
    /// (steps, microseconds) of decode steps of `i * STEP_BUCKET_SEQS` up to
    /// `(i + 1) * STEP_BUCKET_SEQS - 1` sequences (the last entry: that many or more).
    pub decode: Vec<(u64, u64)>,
    /// (steps, microseconds) of steps with prompt tokens.
    pub mixed: (u64, u64),
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStatsSnapshot {
    pub num_running: u64,
    pub num_waiting: u64,
    pub kv_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub num_preemptions: u64,
    pub num_steps: u64,
    pub num_steps_ahead: u64,
    pub host_gap_us: u64,
    pub num_blocks: u64,
    pub step_times: StepTimesSnapshot,
    pub masked_steps: u64,
    pub mask_us: u64,
}

impl EngineStats {
    pub(crate) fn set_kv_usage(&self, usage: f64) {
        self.kv_usage_bits.store(usage.to_bits(), Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> EngineStatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineStatsSnapshot {
            num_running: get(&self.num_running),
            num_waiting: get(&self.num_waiting),
            kv_usage: f64::from_bits(get(&self.kv_usage_bits)),
            prefix_cache_queries: get(&self.prefix_cache_queries),
            prefix_cache_hits: get(&self.prefix_cache_hits),
            prompt_tokens: get(&self.prompt_tokens),
            generation_tokens: get(&self.generation_tokens),
            num_preemptions: get(&self.num_preemptions),
            num_steps: get(&self.num_steps),
            num_steps_ahead: get(&self.num_steps_ahead),
            host_gap_us: get(&self.host_gap_us),
            masked_steps: get(&self.masked_steps),
            mask_us: get(&self.mask_us),
            num_blocks: get(&self.num_blocks),
            step_times: self.step_times.snapshot(),
        }
    }
}
