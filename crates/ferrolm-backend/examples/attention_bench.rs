//! Times `PagedAttention::run` in the Llama-3.1-8B shape (32 query heads, 8 KV heads,
//! head_dim 128, block_size 16, bf16; one case with one KV head) on random inputs, next to the general kernel
//! (`PagedAttention::run_on(AttentionKernel::General, ..)`) on the same inputs.
//!
//! ```text
//! cargo build --release -p ferrolm-backend --features cuda,bench-internals --example attention_bench
//! target/release/examples/attention_bench ["decode batch 384"]   # only the cases named so
//! ```
//!
//! Cases: a decode step of 1 sequence at context 384 and 4096, of 256 sequences at context 640
//! and 1500 and of 232 at 1500 (the decode kernel), the same bytes as 384 at 1500 in 192, 384 and 768
//! sequences, 396, 512 and 528 at 1500 (3, 3.88 and 4 waves of the per-warp kernel on an H200),
//! in 3072 sequences of one KV head, and spread over 16 layers of a 75 GB cache as a
//! server's cache holds them, a 512-token and a 2048-token prompt of one sequence, a
//! mixed step of 16 512-token prompts with 200 decodes at context 600 (the tensor-core kernel),
//! the same with the decodes first as the scheduler orders them, and 384 decodes at context
//! 1500 before 8 1000-token prompts (a mixed step of the 1000-request benchmark), and those
//! prompts alone; then five of these over FP8 caches (`--kv-cache-dtype fp8`). Each is timed with
//! CUDA events around one call, best of 20 after a warm-up, and again as the mean of 32
//! back-to-back calls (one per layer, as a model step issues them, sharing one metadata and so
//! one work list; best of 3 such runs). Small cases cycle through 32 layers' worth of K/V so that
//! the reads come from device memory, not the L2 cache. Decode lines give the K/V bytes read per
//! call over the time; on sm_90 decode cases also run on the per-warp kernel's tensor-copy form
//! (`AttentionKernel::TensorCopies`).

mod bench_support;

use bench_support::{open_gpu, AttentionCase, CacheLayout, Heads, COMPACT, COMPACT_FP8, LAYERS, LLAMA_8B};
use cudarc::driver::sys::CUevent_flags;
use ferrolm_backend::cuda::{AttentionKernel, Gpu, GpuError};

const REPS: usize = 20;
const ONE_KV_HEAD: Heads = Heads { query: 4, kv: 1 };
/// As a server's cache holds them: each layer's blocks drawn from a cache twice the batch's
/// size, and 16 such layers in turn.
const SERVER_CACHE: CacheLayout = CacheLayout { spread: 2, layers: 16, random: false, fp8: false };

fn main() {
    let Some(gpu) = open_gpu() else { return };
    println!("{:<42} {:>12} {:>12} {:>14} {:>14}", "case", "best us", "mean32 us", "best GB/s", "mean32 GB/s");
    let mut mixed = vec![(512, 512); 16];
    mixed.extend([(600, 1); 200]);
    // As the scheduler orders a step: running requests' decodes first, then new prompts.
    let mut decodes_first = vec![(600, 1); 200];
    decodes_first.extend([(512, 512); 16]);
    let mut full_step = vec![(1500, 1); 384];
    full_step.extend([(1000, 1000); 8]);
    let full_step_fp8 = full_step.clone();
    let cases = [
        ("decode batch 1, context 384", LLAMA_8B, COMPACT, vec![(384, 1)]),
        ("decode batch 1, context 4096", LLAMA_8B, COMPACT, vec![(4096, 1)]),
        ("decode batch 256, context 640", LLAMA_8B, COMPACT, vec![(640, 1); 256]),
        ("decode batch 256, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 256]),
        // The last requests of the 1000-request benchmark (1000 = 384 + 384 + 232).
        ("decode batch 232, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 232]),
        // The same bytes at three batch sizes: what each block's fixed cost and the last wave
        // take; then as 3072 sequences of one KV head, whose 16-key pages are 4 KiB contiguous
        // where the 8B's are 16 rows of 256 bytes 2 KiB apart.
        ("decode batch 384, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 384]),
        ("decode batch 512, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 512]),
        // On an H200 the per-warp kernel holds 132 x 8 head blocks at once: 396 and 528 requests
        // (8 KV heads each) are 3 and 4 whole waves, 512 is 3.88. Equal times per call at 512
        // and 528 would say the last wave's idle warps cost what a full wave does.
        ("decode batch 396, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 396]),
        ("decode batch 528, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 528]),
        ("decode batch 192, context 3000", LLAMA_8B, COMPACT, vec![(3000, 1); 192]),
        ("decode batch 768, context 750", LLAMA_8B, COMPACT, vec![(750, 1); 768]),
        ("decode batch 3072 x 1 KV head, context 1500", ONE_KV_HEAD, COMPACT, vec![(1500, 1); 3072]),
        // As a server's cache holds them: each layer's blocks drawn from a cache twice the
        // batch's size, and 16 such layers in turn (75 GB).
        ("decode batch 384, context 1500, 16 layers of a 75 GB cache", LLAMA_8B, SERVER_CACHE, vec![(1500, 1); 384]),
        ("prefill 512 of one sequence", LLAMA_8B, COMPACT, vec![(512, 512)]),
        ("prefill 2048 of one sequence", LLAMA_8B, COMPACT, vec![(2048, 2048)]),
        ("mixed 16 x 512 prefill + 200 decodes @600", LLAMA_8B, COMPACT, mixed),
        ("mixed 200 decodes @600 + 16 x 512 prefill", LLAMA_8B, COMPACT, decodes_first),
        ("mixed 384 decodes @1500 + 8 x 1000 prefill", LLAMA_8B, COMPACT, full_step),
        // That step's prompts alone: with "decode batch 384, context 1500", what the mixed
        // step's one launch costs against a launch for each kind.
        ("prefill 8 x 1000", LLAMA_8B, COMPACT, vec![(1000, 1000); 8]),
        // Over FP8 caches (`--kv-cache-dtype fp8`): half the bytes a key, converted on the way in.
        ("FP8 cache: decode batch 1, context 384", LLAMA_8B, COMPACT_FP8, vec![(384, 1)]),
        ("FP8 cache: decode batch 1, context 4096", LLAMA_8B, COMPACT_FP8, vec![(4096, 1)]),
        ("FP8 cache: decode batch 512, context 1500", LLAMA_8B, COMPACT_FP8, vec![(1500, 1); 512]),
        ("FP8 cache: prefill 2048 of one sequence", LLAMA_8B, COMPACT_FP8, vec![(2048, 2048)]),
        ("FP8 cache: mixed 384 decodes @1500 + 8 x 1000 prefill", LLAMA_8B, COMPACT_FP8, full_step_fp8),
    ];
    // An argument keeps only the cases whose name holds it (e.g. to profile one).
    let only = std::env::args().nth(1).unwrap_or_default();
    for (name, heads, cache, requests) in cases.iter().filter(|(name, ..)| name.contains(&only)) {
        if let Err(e) = run_case(&gpu, name, *heads, *cache, requests) {
            eprintln!("{name}: {e}");
        }
    }
}

/// `requests`: (context length, query rows) of each sequence.
fn run_case(
    gpu: &Gpu,
    name: &str,
    heads: Heads,
    cache: CacheLayout,
    requests: &[(usize, usize)],
) -> Result<(), GpuError> {
    let mut case = AttentionCase::new(gpu, heads, cache, requests)?;
    let decode_only = requests.iter().all(|&(_, q)| q == 1);
    // Decodes also on the per-warp kernel's tensor-copy form, where the device has it (sm_90),
    // over bf16 caches (FP8 caches take the block kernel).
    let tensor = decode_only && !cache.fp8 && gpu.compute_capability().0 >= 9;
    let kernels = [AttentionKernel::Picked, AttentionKernel::General]
        .into_iter()
        .chain(tensor.then_some(AttentionKernel::TensorCopies));
    for kernel in kernels {
        let label = match kernel {
            AttentionKernel::Picked => name.to_string(),
            AttentionKernel::General => "  general kernel".to_string(),
            AttentionKernel::TensorCopies => "  per-warp kernel, tensor copies".to_string(),
        };
        let (best, mean) = time(gpu, &mut case, kernel)?;
        let gbs = |s: f64| case.kv_bytes as f64 / s / 1e9;
        let (best_bw, mean_bw) = if decode_only {
            (format!("{:.0}", gbs(best)), format!("{:.0}", gbs(mean)))
        } else {
            ("-".into(), "-".into())
        };
        println!("{label:<42} {:>12.1} {:>12.1} {best_bw:>14} {mean_bw:>14}", best * 1e6, mean * 1e6);
    }
    Ok(())
}

/// (best single call, mean of `LAYERS` back-to-back calls), in seconds, on `kernel`. Each run of
/// `LAYERS` calls is one step: one metadata, whose work list the first call builds.
fn time(gpu: &Gpu, case: &mut AttentionCase, kernel: AttentionKernel) -> Result<(f64, f64), GpuError> {
    let AttentionCase { buffers, step, .. } = case;
    let ctx = gpu.stream().context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let meta = step.metadata();
    for layer in 0..LAYERS {
        buffers.attend(gpu, &meta, layer, kernel)?;
    }
    gpu.synchronize()?;
    let mut best = f64::INFINITY;
    for rep in 0..REPS {
        start.record(gpu.stream())?;
        buffers.attend(gpu, &meta, rep, kernel)?;
        end.record(gpu.stream())?;
        end.synchronize()?;
        best = best.min(start.elapsed_ms(&end)? as f64 / 1e3);
    }
    let mut mean = f64::INFINITY;
    for _ in 0..3 {
        let meta = step.metadata();
        start.record(gpu.stream())?;
        for layer in 0..LAYERS {
            buffers.attend(gpu, &meta, layer, kernel)?;
        }
        end.record(gpu.stream())?;
        end.synchronize()?;
        mean = mean.min(start.elapsed_ms(&end)? as f64 / 1e3 / LAYERS as f64);
    }
    gpu.synchronize()?;
    Ok((best, mean))
}
