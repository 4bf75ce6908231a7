//! Sampling and logprobs where the logits are (`kernels/sampling.cu`): per logits row, what
//! [`RowRequest::apply_masked`] (ferrolm-sampling) computes on the host, so that only the chosen
//! tokens and the logprobs asked for come back.
//!
//! One call is one copy of the rows' parameters (`[rows]` [`RowParams`]), their penalty/mask
//! lists concatenated (`[entries]` [`Adjust`], each row pointing at its own) and, when a row is
//! `masked`, the step's token masks (`[masked rows, words]` u32, each masked row pointing at its
//! first word) through a [`StagedBuffer`], a launch of a block per 4096 logits for the raw
//! statistics (max, argmax, sum of exponentials: the one pass every row needs; done by the row's
//! own block it took ~60 us of a batch-1 decode step over a 128k vocabulary), the same for the
//! weights of rows that sample without adjustments or top-k, a launch of a block per row for the
//! rest, and one download of `[rows]` [`RowResult`]s into pinned memory. Rows that sample, or
//! that have penalties or `min_tokens` masks, get a row of scratch for their processed scores.
//! The staging, scratch and result buffers are kept and grown, so a steady batch allocates
//! nothing.
//!
//! A token mask takes effect wherever a row's scores are formed, before its penalties: the
//! argmax of the statistics pass (so a masked greedy row with nothing to adjust still needs no
//! scratch), the weights pass, and the copy into scratch (an adjustment of a disallowed id leaves
//! it at `-inf`). The max and the sum of exponentials stay the raw row's: logprobs are never
//! masked. A mask shorter than the vocabulary disallows the ids past its words. Without a masked
//! row nothing of the masks is sent and the kernels take a null pointer.
//!
//! [`GpuSampler::launch`] only queues that work; [`GpuSampler::collect`] waits for the oldest
//! launch's download and answers it, so that the host can prepare (and launch) the next step
//! meanwhile. Such a next step takes its tokens from the device with
//! [`GpuSampler::write_sampled_tokens`].

use std::collections::VecDeque;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PinnedHostSlice};
use ferrolm_sampling::{RowRequest, TokenLogprobs, TokenMasks, MAX_LOGPROBS};

use super::gpu::to_u32;
use super::staging::StagedBuffer;
use super::{Gpu, GpuError, GpuView};

use super::compile::{self, KernelFamilies};

/// The sampler's entry points; `sample_rows` keeps its candidates in shared memory.
pub(crate) const KERNELS: &[KernelFamilies] = &[
    KernelFamilies {
        source: &compile::SAMPLING,
        names: &["logit_stats", "sample_weights", "sampled_tokens"],
        large_shared: false,
    },
    KernelFamilies { source: &compile::SAMPLING, names: &["sample_rows"], large_shared: true },
];

/// Threads per row (`SAMPLE_THREADS`).
const THREADS: u32 = 1024;
/// The radix select's per-warp histograms: `[warps, 256]` u32 counts, then `[warps, 256]` f64.
const SHARED_BYTES: usize = (THREADS as usize / 32) * RADIX_BINS * (4 + 8);
/// Threads per block of `logit_stats` (`STATS_THREADS`), and logits per block (`STATS_CHUNK`).
const STATS_THREADS: u32 = 256;
const STATS_CHUNK: usize = 4096;
/// Bins of a radix-select pass (`RADIX_BINS`).
const RADIX_BINS: usize = 256;
/// Top logprobs per row the kernel can return (`SAMPLE_MAX_TOP`).
const MAX_TOP: usize = 20;
const _: () = assert!(MAX_TOP == MAX_LOGPROBS as usize);

const MODE_GREEDY: u32 = 0;
const MODE_RANDOM: u32 = 1;
const MODE_LOGPROBS: u32 = 2;
const ADJUST_REPETITION: u32 = 1;
const ADJUST_MASK: u32 = 2;
/// No token / no scratch row.
const NO_ID: u32 = u32::MAX;

/// One row's parameters: `SampleRow` in sampling.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RowParams {
    u: f64,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    frequency_penalty: f32,
    presence_penalty: f32,
    /// 0 is off; a `top_k` beyond u32 is off too (it is not below the candidate count).
    top_k: u32,
    mode: u32,
    /// `MODE_LOGPROBS`: the token whose logprob is wanted.
    token: u32,
    num_top: u32,
    adjust_start: u32,
    adjust_len: u32,
    scratch_row: u32,
    /// The row's first word in the token masks; `NO_ID` when it has none.
    mask_start: u32,
}

/// One `TokenAdjust`: `SampleAdjust` in sampling.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Adjust {
    token: u32,
    output_count: u32,
    flags: u32,
}

/// One row's answer: `SampleOut` in sampling.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RowResult {
    /// `NO_ID` when nothing could be picked.
    token: u32,
    logprob: f32,
    top_ids: [u32; MAX_TOP],
    top_logprobs: [f32; MAX_TOP],
}

impl RowResult {
    /// What a fresh result buffer holds, so that a row the kernel failed to write reads as an
    /// impossible token with an impossible logprob (`0x7f7f7f7f`, 3.4e38), never as a plausible
    /// answer.
    const POISON: RowResult = RowResult {
        token: 0x7f7f_7f7f,
        logprob: f32::from_bits(0x7f7f_7f7f),
        top_ids: [0x7f7f_7f7f; MAX_TOP],
        top_logprobs: [f32::from_bits(0x7f7f_7f7f); MAX_TOP],
    };
}

const _: () = assert!(std::mem::size_of::<RowParams>() == 64);
const _: () = assert!(std::mem::size_of::<Adjust>() == 12);
const _: () = assert!(std::mem::size_of::<RowResult>() == 8 + 8 * MAX_TOP);

// SAFETY: plain `#[repr(C)]` data of u32/f32/f64 fields, laid out as their sampling.cu structs.
unsafe impl DeviceRepr for RowParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for Adjust {}
// SAFETY: as above; every bit pattern is a valid value.
unsafe impl DeviceRepr for RowResult {}
// SAFETY: u32 and f32 fields only: all zero bits is a valid value.
unsafe impl cudarc::driver::ValidAsZeroBits for RowResult {}

/// One chunk's raw statistics, written by `logit_stats` and read by `sample_rows` only:
/// `ChunkStats` in sampling.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ChunkStats {
    max: f32,
    best: f32,
    best_id: u32,
    _pad: u32,
    sum: f64,
}

const _: () = assert!(std::mem::size_of::<ChunkStats>() == 24);

// SAFETY: as above.
unsafe impl DeviceRepr for ChunkStats {}
// SAFETY: u32, f32 and f64 fields only: all zero bits is a valid value.
unsafe impl cudarc::driver::ValidAsZeroBits for ChunkStats {}

/// One chunk's weights of a row that samples without adjustments or top-k, written by
/// `sample_weights` and read by `sample_rows` only: `ChunkWeights` in sampling.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ChunkWeights {
    kept: u32,
    last: u32,
    max_w: f32,
    _pad: f32,
    total: f64,
}

const _: () = assert!(std::mem::size_of::<ChunkWeights>() == 24);

// SAFETY: as above.
unsafe impl DeviceRepr for ChunkWeights {}
// SAFETY: u32, f32 and f64 fields only: all zero bits is a valid value.
unsafe impl cudarc::driver::ValidAsZeroBits for ChunkWeights {}

/// What the host needs of a row to read its answer.
#[derive(Clone, Copy, Debug)]
enum RowKind {
    Sample { num_top: usize },
    Logprobs { token: u32, num_top: usize },
}

/// A launched call whose answer is not collected yet.
struct Pending {
    rows: Vec<RowKind>,
    vocab: usize,
    /// The rows' results, downloaded; `None` for a call of no rows.
    host: Option<PinnedHostSlice<RowResult>>,
    /// Recorded after the download.
    done: Option<CudaEvent>,
}

/// The device buffers of the sampler, kept from call to call.
#[derive(Default)]
pub struct GpuSampler {
    /// `[capacity, vocab]` f32: processed scores, then weights, of the rows that need them.
    scratch: Option<CudaSlice<f32>>,
    /// `[capacity]`, poisoned when allocated.
    results: Option<CudaSlice<RowResult>>,
    /// `[capacity]` chunks' statistics, `[rows, chunks]` per launch.
    stats: Option<CudaSlice<ChunkStats>>,
    /// `[capacity]` chunks' weights, `[rows, chunks]` per launch with a sampled row.
    weights: Option<CudaSlice<ChunkWeights>>,
    /// `[capacity, 256]` each: the first pass of the top-p select, by chunk (`sample_weights`),
    /// `[rows, chunks, 256]` per launch with a sampled row under top-p.
    top_counts: Option<CudaSlice<u32>>,
    top_masses: Option<CudaSlice<f64>>,
    /// The rows' parameters and adjustments, built on the host and sent in one copy.
    params: Vec<RowParams>,
    adjusts: Vec<Adjust>,
    staged: Option<StagedBuffer>,
    /// Launched calls, oldest first.
    pending: VecDeque<Pending>,
    /// Pinned result buffers of collected calls, for the next launches.
    spare: Vec<PinnedHostSlice<RowResult>>,
    /// Rows of the last launch: the results `write_sampled_tokens` may read.
    last_rows: usize,
}

// SAFETY: the pinned buffers and events are driver handles used by one owner at a time (the
// runner holding the sampler is moved between threads, never shared).
unsafe impl Send for GpuSampler {}

impl GpuSampler {
    pub fn new() -> GpuSampler {
        GpuSampler::default()
    }

    /// For each row of `logits` (`[rows.len(), vocab]`, any activation dtype, read only), what
    /// [`RowRequest::apply`] gives for that row on the host: the sampled token (or `None` when
    /// nothing can be picked) or the given token, with its raw logprob and the top logprobs.
    /// [`Self::launch`] then [`Self::collect`], with nothing else in flight; no row may be
    /// `masked` (see [`Self::sample_masked`]).
    pub fn sample(
        &mut self,
        gpu: &Gpu,
        logits: GpuView<'_>,
        vocab: usize,
        rows: &[RowRequest<'_>],
    ) -> Result<Vec<Option<TokenLogprobs>>, GpuError> {
        self.sample_masked(gpu, logits, vocab, rows, &TokenMasks::default())
    }

    /// [`Self::sample`] where `masked` rows take their token masks from `masks` (one row per
    /// masked row, in order), as [`RowRequest::apply_masked`] does.
    ///
    /// # Panics
    /// When `masks` has not one row per masked row.
    pub fn sample_masked(
        &mut self,
        gpu: &Gpu,
        logits: GpuView<'_>,
        vocab: usize,
        rows: &[RowRequest<'_>],
        masks: &TokenMasks,
    ) -> Result<Vec<Option<TokenLogprobs>>, GpuError> {
        assert!(self.pending.is_empty(), "sample_rows: a launched call is still to collect");
        self.launch(gpu, logits, vocab, rows, masks)?;
        self.collect()
    }

    /// Queues [`Self::sample_masked`]'s work on the `Gpu`'s stream: nothing waits for the
    /// device. Its answer comes from [`Self::collect`], calls being answered in launch order.
    ///
    /// # Panics
    /// When `masks` has not one row per masked row.
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        logits: GpuView<'_>,
        vocab: usize,
        rows: &[RowRequest<'_>],
        masks: &TokenMasks,
    ) -> Result<(), GpuError> {
        assert!(vocab > 0, "sample_rows: vocab is 0");
        let num_masked = rows.iter().filter(|r| r.is_masked()).count();
        assert_eq!(
            masks.num_rows(),
            num_masked,
            "sample_rows: {} token masks for {num_masked} masked rows",
            masks.num_rows()
        );
        assert_eq!(logits.len(), rows.len() * vocab, "sample_rows: logits are not {} rows of {vocab}", rows.len());
        let kinds = rows.iter().map(row_kind).collect();
        self.last_rows = rows.len();
        if rows.is_empty() {
            self.pending.push_back(Pending { rows: kinds, vocab, host: None, done: None });
            return Ok(());
        }
        if gpu.max_shared_per_block() < SHARED_BYTES {
            return Err(GpuError::Unsupported {
                op: "sample_rows",
                reason: format!(
                    "needs {SHARED_BYTES} bytes of shared memory per block, the device has {}",
                    gpu.max_shared_per_block()
                ),
            });
        }
        let vocab_u32 = to_u32("sample_rows", "vocab", vocab);
        let num_rows = to_u32("sample_rows", "rows", rows.len());

        // [masked rows, words]
        let mask_words = &masks.data[..num_masked * masks.words];
        let words_u32 = to_u32("sample_rows", "mask words", masks.words);
        // Each masked row's first word is a u32 offset.
        to_u32("sample_rows", "mask words in all", mask_words.len());

        self.params.clear();
        self.adjusts.clear();
        let mut scratch_rows = 0;
        let mut next_mask = 0;
        for row in rows {
            let mut params = row_params(row, &mut self.adjusts, &mut scratch_rows);
            if row.is_masked() {
                params.mask_start = next_mask * words_u32;
                next_mask += 1;
            }
            self.params.push(params);
        }
        // The masks travel only when a row has one: an unconstrained batch copies what it did
        // before masks existed.
        let all_arrays = [plain_bytes(&self.params), plain_bytes(&self.adjusts), plain_bytes(mask_words)];
        let arrays = &all_arrays[..if num_masked > 0 { 3 } else { 2 }];
        let bytes = StagedBuffer::bytes_for(arrays.iter().map(|a| a.len()));
        if self.staged.as_ref().is_none_or(|s| s.capacity() < bytes) {
            self.staged = None;
            self.staged = Some(StagedBuffer::new(gpu, bytes.next_power_of_two())?);
        }
        let staged = self.staged.as_mut().expect("allocated above");
        let parts = staged.write(gpu, arrays)?;
        let params_ptr = staged.ptr(gpu, parts[0]);
        // Plain greedy batches have no list at all: the kernel then never reads the pointer.
        let adjusts_ptr = if self.adjusts.is_empty() { 0 } else { staged.ptr(gpu, parts[1]) };
        // Null without a masked row: the kernels then read no row's `mask_start`.
        let masks_ptr = if num_masked > 0 { staged.ptr(gpu, parts[2]) } else { 0 };
        let scratch_len = scratch_rows as usize * vocab;
        if scratch_len > 0 {
            let len = (scratch_rows as usize).next_power_of_two() * vocab;
            // SAFETY: the kernel writes each element of a row's scratch before it reads it.
            unsafe { grow(gpu, &mut self.scratch, scratch_len, len) }?;
        }
        if self.results.as_ref().is_none_or(|r| r.len() < rows.len()) {
            self.results = None;
            self.results = Some(gpu.upload(&vec![RowResult::POISON; rows.len().next_power_of_two()])?);
        }
        let chunks = vocab.div_ceil(STATS_CHUNK);
        let stats_len = rows.len() * chunks;
        let stats_alloc = stats_len.next_power_of_two();
        // SAFETY: `logit_stats` writes every chunk of the launch's rows before `sample_rows`
        // reads them.
        unsafe { grow(gpu, &mut self.stats, stats_len, stats_alloc) }?;
        let sampled = self.params.iter().any(|p| p.mode == MODE_RANDOM);
        if sampled {
            // SAFETY: `sample_weights` writes every chunk of the rows `sample_rows` reads them of.
            unsafe { grow(gpu, &mut self.weights, stats_len, stats_alloc) }?;
        }
        let nucleus = self.params.iter().any(|p| p.mode == MODE_RANDOM && p.top_p < 1.0);
        if nucleus {
            let (len, alloc) = (stats_len * RADIX_BINS, stats_alloc * RADIX_BINS);
            // SAFETY: `sample_weights` writes every bin of the chunks of the rows `sample_rows`
            // reads them of (sampled rows under top-p).
            unsafe { grow(gpu, &mut self.top_counts, len, alloc) }?;
            // SAFETY: as above.
            unsafe { grow(gpu, &mut self.top_masses, len, alloc) }?;
        }
        let results = self.results.as_mut().expect("allocated above");

        let logits_ptr = logits.ptr();
        let stats_ptr = gpu.index_ptr(self.stats.as_ref().expect("allocated above"));
        let chunks_u32 = to_u32("sample_rows", "chunks", chunks);
        let mut launch = gpu.launch_builder("logit_stats", logits.dtype());
        launch.arg(&logits_ptr).arg(&vocab_u32).arg(&chunks_u32).arg(&stats_ptr);
        launch.arg(&params_ptr).arg(&masks_ptr).arg(&words_u32);
        let cfg =
            LaunchConfig { grid_dim: (num_rows, chunks_u32, 1), block_dim: (STATS_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `rows` rows of `vocab` logits, room for `[rows, chunks]` statistics, `rows`
        // parameter rows, and either no masks or one mask of `words` words per masked row, each
        // masked row's `mask_start` pointing at its own.
        unsafe { launch.launch(cfg) }?;

        let scratch_ptr = self.scratch.as_ref().map_or(0, |s| gpu.index_ptr(s));
        // The top-p select's first pass by chunk, for launches with a row under top-p (else null).
        let (mut top_counts_ptr, mut top_masses_ptr) = (0u64, 0u64);
        if let (true, Some(counts), Some(masses)) = (nucleus, &self.top_counts, &self.top_masses) {
            (top_counts_ptr, top_masses_ptr) = (gpu.index_ptr(counts), gpu.index_ptr(masses));
        }
        // The weights of rows that sample without adjustments or top-k, many blocks per row; none
        // when every row is greedy (sample_rows then takes a null pointer).
        let weights_ptr = match (sampled, &self.weights) {
            (true, Some(weights)) => {
                let weights_ptr = gpu.index_ptr(weights);
                let mut launch = gpu.launch_builder("sample_weights", logits.dtype());
                launch.arg(&logits_ptr).arg(&vocab_u32).arg(&chunks_u32).arg(&stats_ptr);
                launch.arg(&params_ptr).arg(&scratch_ptr).arg(&weights_ptr).arg(&top_counts_ptr).arg(&top_masses_ptr);
                launch.arg(&masks_ptr).arg(&words_u32);
                // SAFETY: as logit_stats, then its statistics, parameter rows whose scratch rows
                // lie in `scratch` (every sampled row has one), room for `[rows, chunks]` and,
                // with a row under top-p, for `[rows, chunks, 256]` twice, and the masks as
                // logit_stats takes them.
                unsafe { launch.launch(cfg) }?;
                weights_ptr
            }
            _ => 0,
        };
        let results_ptr = gpu.index_ptr(&*results);
        let mut launch = gpu.launch_builder("sample_rows", logits.dtype());
        launch.arg(&logits_ptr).arg(&vocab_u32).arg(&stats_ptr).arg(&weights_ptr);
        launch.arg(&top_counts_ptr).arg(&top_masses_ptr).arg(&chunks_u32);
        launch.arg(&params_ptr).arg(&adjusts_ptr).arg(&masks_ptr).arg(&words_u32).arg(&scratch_ptr).arg(&results_ptr);
        let cfg = LaunchConfig {
            grid_dim: (num_rows, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SHARED_BYTES as u32,
        };
        // SAFETY: the arguments match the kernel's parameters: the statistics just written,
        // `rows` parameter rows whose adjustment ranges lie in `adjusts`, whose masks lie in the
        // masks (as above) and whose scratch rows lie in `scratch`, and a result buffer of at
        // least `rows` entries.
        unsafe { launch.launch(cfg) }?;
        let mut host = match self.spare.iter().position(|h| h.len() >= rows.len()) {
            Some(i) => self.spare.swap_remove(i),
            // Plain pinned memory (not write-combined: the host reads it).
            // SAFETY: the host reads only the rows a download has written.
            None => unsafe { gpu.stream().context().alloc_pinned_with_flags(rows.len().next_power_of_two(), 0) }?,
        };
        gpu.stream().memcpy_dtoh(&results.slice(..rows.len()), &mut host)?;
        let done = gpu.stream().record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        self.pending.push_back(Pending { rows: kinds, vocab, host: Some(host), done: Some(done) });
        Ok(())
    }

    /// Waits for the oldest launched call not yet collected and answers it as [`Self::sample`]
    /// does.
    pub fn collect(&mut self) -> Result<Vec<Option<TokenLogprobs>>, GpuError> {
        let Some(pending) = self.pending.pop_front() else {
            return Err(GpuError::Unsupported { op: "sample_rows", reason: "collect with nothing launched".into() });
        };
        let (Some(host), Some(done)) = (pending.host, pending.done) else {
            return Ok(Vec::new());
        };
        // A spinning wait on this event first; the slice's own (blocking-sync) event is then
        // complete too.
        done.synchronize()?;
        let out = host.as_slice()?;
        let answers = pending.rows.iter().zip(out).map(|(row, r)| token_logprobs(*row, r, pending.vocab)).collect();
        self.spare.push(host);
        Ok(answers)
    }

    /// Writes into `token_ids` (a step's tokens on the device) the tokens the last launched call
    /// sampled: `pairs` holds `(t, row)` pairs, each making `token_ids[t]` the token sampled from
    /// that call's row `row` (0 where none was picked or the row is out of range). Queued on the
    /// stream, after that call and before whatever is issued next.
    ///
    /// # Panics
    /// When a `t` lies outside `token_ids`.
    pub fn write_sampled_tokens(
        &self,
        gpu: &Gpu,
        pairs: &[(u32, u32)],
        device_pairs: &CudaView<'_, u32>,
        vocab: usize,
        token_ids: &CudaView<'_, u32>,
    ) -> Result<(), GpuError> {
        let num_pairs = pairs.len();
        if num_pairs == 0 {
            return Ok(());
        }
        assert_eq!(device_pairs.len(), 2 * num_pairs, "sampled_tokens: the device pairs are not the host's");
        assert!(
            pairs.iter().all(|&(t, _)| (t as usize) < token_ids.len()),
            "sampled_tokens: a pair writes past the step's {} tokens",
            token_ids.len()
        );
        let (pairs_ptr, token_ids_ptr) = (gpu.index_ptr(device_pairs), gpu.index_ptr(token_ids));
        let results_ptr = self.results.as_ref().map_or(0, |r| gpu.index_ptr(r));
        // With no result buffer yet, no row is in range: every token becomes 0.
        let num_results = if results_ptr == 0 { 0 } else { to_u32("sampled_tokens", "rows", self.last_rows) };
        let n = to_u32("sampled_tokens", "pairs", num_pairs);
        let vocab = to_u32("sampled_tokens", "vocab", vocab);
        let mut launch = gpu.launch_builder("sampled_tokens", crate::DType::F32);
        launch.arg(&results_ptr).arg(&num_results).arg(&pairs_ptr).arg(&n).arg(&vocab).arg(&token_ids_ptr);
        let cfg = LaunchConfig { grid_dim: (n.div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `num_pairs` pairs whose `t` lie in `token_ids` (checked above, and the device
        // pairs are the host's); the kernel checks rows against the results the last launch wrote.
        unsafe { launch.launch(cfg) }
    }
}

/// The kernel's parameter structs that have no padding bytes (their sizes are asserted above).
trait Unpadded: DeviceRepr {}
impl Unpadded for RowParams {}
impl Unpadded for Adjust {}
impl Unpadded for u32 {}

/// The bytes of a slice of the kernel's parameter structs.
fn plain_bytes<T: Unpadded>(items: &[T]) -> &[u8] {
    // SAFETY: `#[repr(C)]` structs of 4- and 8-byte fields with no padding, so every byte of the
    // slice is initialized.
    unsafe { std::slice::from_raw_parts(items.as_ptr().cast::<u8>(), std::mem::size_of_val(items)) }
}

/// Makes `buf` hold at least `len` elements: if it holds fewer, it is freed first (stream
/// ordered), then `alloc_len` (at least `len`) uninitialized elements are taken.
///
/// # Safety
/// Every element a kernel reads of the buffer must have been written by a kernel before it.
unsafe fn grow<T: DeviceRepr>(
    gpu: &Gpu,
    buf: &mut Option<CudaSlice<T>>,
    len: usize,
    alloc_len: usize,
) -> Result<(), GpuError> {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = None;
        // SAFETY: the caller's promise.
        *buf = Some(unsafe { gpu.stream().alloc::<T>(alloc_len) }?);
    }
    Ok(())
}

/// The kernel's parameters for `row`, without a token mask; its adjustments go to the end of
/// `adjusts`, and it takes the next scratch row if it needs one.
fn row_params(row: &RowRequest<'_>, adjusts: &mut Vec<Adjust>, scratch_rows: &mut u32) -> RowParams {
    match *row {
        RowRequest::Sample(plan) => {
            let adjust_start = to_u32("sample_rows", "adjustments", adjusts.len());
            adjusts.extend(plan.adjusts.iter().map(|a| Adjust {
                token: a.token,
                output_count: a.output_count,
                flags: if a.repetition { ADJUST_REPETITION } else { 0 } | if a.mask { ADJUST_MASK } else { 0 },
            }));
            // Greedy rows with nothing to adjust take the argmax that the statistics pass found
            // (among the ids their mask allows).
            let scratch_row = if plan.greedy && plan.adjusts.is_empty() {
                NO_ID
            } else {
                *scratch_rows += 1;
                *scratch_rows - 1
            };
            RowParams {
                u: plan.u,
                temperature: plan.temperature,
                top_p: plan.top_p,
                min_p: plan.min_p,
                repetition_penalty: plan.repetition_penalty,
                frequency_penalty: plan.frequency_penalty,
                presence_penalty: plan.presence_penalty,
                top_k: u32::try_from(plan.top_k).unwrap_or(u32::MAX),
                mode: if plan.greedy { MODE_GREEDY } else { MODE_RANDOM },
                token: NO_ID,
                num_top: num_top(plan.num_top_logprobs),
                adjust_start,
                adjust_len: to_u32("sample_rows", "adjustments", plan.adjusts.len()),
                scratch_row,
                mask_start: NO_ID,
            }
        }
        RowRequest::Logprobs { token, num_top: n } => RowParams {
            mode: MODE_LOGPROBS,
            token,
            num_top: num_top(n),
            scratch_row: NO_ID,
            mask_start: NO_ID,
            ..RowParams::default()
        },
    }
}

fn num_top(n: usize) -> u32 {
    assert!(n <= MAX_TOP, "sample_rows: {n} top logprobs asked for, at most {MAX_TOP}");
    n as u32
}

fn row_kind(row: &RowRequest<'_>) -> RowKind {
    match *row {
        RowRequest::Sample(plan) => RowKind::Sample { num_top: plan.num_top_logprobs },
        RowRequest::Logprobs { token, num_top } => RowKind::Logprobs { token, num_top },
    }
}

/// The host's answer for `row` from the kernel's `r`.
fn token_logprobs(row: RowKind, r: &RowResult, vocab: usize) -> Option<TokenLogprobs> {
    let (token, num_top) = match row {
        RowKind::Sample { num_top } => ((r.token != NO_ID).then_some(r.token)?, num_top),
        RowKind::Logprobs { token, num_top } => (token, num_top),
    };
    let n = num_top.min(vocab);
    let top_logprobs = r.top_ids[..n].iter().copied().zip(r.top_logprobs[..n].iter().copied()).collect();
    Some(TokenLogprobs { token, logprob: r.logprob, top_logprobs })
}
