//! Greedy decoding straight from device logits: per row, the argmax token, the max logit and the
//! log-normaliser, so that neither greedy sampling nor the chosen token's logprob needs the
//! logits on the host.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::gpu::to_u32;
use super::{Gpu, GpuError, GpuView};

/// Threads per row of logits.
const THREADS: u32 = 1024;

/// One row's summary. NaN and `-inf` logits are no candidates; ties go to the lower id.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowArgmax {
    /// `None` when every logit is NaN or `-inf`.
    pub token_id: Option<u32>,
    /// The largest logit (`-inf` without a candidate).
    pub max: f32,
    /// `log(sum(exp(logits)))` over the candidates.
    pub logsumexp: f32,
    /// The log-probability of `token_id`, `-ln(sum(exp(logits - max)))`, computed without the
    /// cancellation of `max - logsumexp`.
    pub token_logprob: f32,
}

/// The [`RowArgmax`] of every row of `logits`: `[rows, vocab]` (any activation dtype).
pub fn argmax_logsumexp(gpu: &Gpu, logits: GpuView<'_>, vocab: usize) -> Result<Vec<RowArgmax>, GpuError> {
    assert!(vocab > 0, "argmax_logsumexp: vocab is 0");
    let rows = logits.len() / vocab;
    if rows == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the kernel writes every element of both buffers before they are read.
    let (mut ids, mut stats) = unsafe { (gpu.stream().alloc::<u32>(rows)?, gpu.stream().alloc::<f32>(2 * rows)?) };
    argmax_logsumexp_into(gpu, logits, vocab, &mut ids, &mut stats)?;
    let (ids, stats) = (gpu.download(&ids)?, gpu.download(&stats)?);
    Ok(ids
        .iter()
        .zip(stats.chunks_exact(2))
        .map(|(&id, s)| {
            let (max, ln_sum) = (s[0], s[1]);
            RowArgmax {
                token_id: (id != u32::MAX).then_some(id),
                max,
                logsumexp: max + ln_sum,
                token_logprob: if id == u32::MAX { f32::NEG_INFINITY } else { -ln_sum },
            }
        })
        .collect())
}

/// The device half of [`argmax_logsumexp`]: `ids`: `[rows]` (`u32::MAX` without a candidate),
/// `stats`: `[rows, 2]` = (max, ln(sum(exp(logit - max)))).
pub fn argmax_logsumexp_into(
    gpu: &Gpu,
    logits: GpuView<'_>,
    vocab: usize,
    ids: &mut CudaSlice<u32>,
    stats: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    assert!(vocab > 0, "argmax_logsumexp: vocab is 0");
    assert_eq!(logits.len() % vocab, 0, "argmax_logsumexp: logits are not rows of {vocab}");
    let rows = logits.len() / vocab;
    assert!(ids.len() >= rows, "argmax_logsumexp: ids hold {} of {rows} rows", ids.len());
    assert!(stats.len() >= 2 * rows, "argmax_logsumexp: stats hold {} of [{rows}, 2]", stats.len());
    if rows == 0 {
        return Ok(());
    }
    let (logits_ptr, ids_ptr, stats_ptr) = (logits.ptr(), gpu.index_ptr(&*ids), gpu.index_ptr(&*stats));
    let vocab_u32 = to_u32("argmax_logsumexp", "vocab", vocab);
    let mut launch = gpu.launch_builder("argmax_logsumexp", logits.dtype());
    launch.arg(&logits_ptr).arg(&vocab_u32).arg(&ids_ptr).arg(&stats_ptr);
    let cfg = LaunchConfig {
        grid_dim: (to_u32("argmax_logsumexp", "rows", rows), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters; both outputs hold `rows` rows.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
