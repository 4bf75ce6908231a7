//! Whether a step's work split in two parts on two streams runs faster than on one stream: the
//! memory-bound decode attention of one part beside the compute-bound GEMMs of the other. Each
//! case is 32 layers of the Llama-3.1-8B's projections (qkv, o_proj, gate_up, down: cuBLAS, as
//! `Gemms::tune` leaves it at the rows used) and its paged attention, in the model's order;
//! the element-wise kernels are left out.
//!
//! ```text
//! cargo build --release -p ferrolm-backend --features cuda,bench-internals --example overlap_bench
//! target/release/examples/overlap_bench
//! ```
//!
//! Cases: a mixed step of the 1000-request benchmark (384 decodes at context 1500 and 8 prompts
//! of 976 tokens, 8192 rows) split into its decodes and its prompts; a smaller one (192 decodes
//! at 1000, 8 x 1000 prompt tokens); decode steps of 384 and 512 requests at context 1500 split
//! into halves. For each: the whole step on one stream (as ferrolm runs it), the two parts one
//! after the other on one stream (what splitting costs by itself), and the two parts on two
//! streams at once: of equal priority, with the first part's (the decodes') stream at the
//! highest priority, and that again with the second part's GEMMs on three quarters of the SMs
//! (`cublasSetSmCountTarget`, untuned), each the best of 3 steps. The streams share the weights (one copy of each
//! layer, 4 layers in turn, well past the 50 MB L2).

mod bench_support;

use bench_support::{gpu_options, open_gpu, random_tensor, AttentionCase, COMPACT_ZEROS, LAYERS, LLAMA_8B};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;
use ferrolm_backend::cuda::{self, AttentionKernel, Gemms, Gpu, GpuError, GpuTensor, StreamPriority};
use ferrolm_backend::DType;

/// The 8B's projections of one layer, `(n, k)`, in the order a layer runs them; attention
/// follows the first.
const PROJECTIONS: [(usize, usize); 4] = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)];
const WIDEST_N: usize = 28672;
const WIDEST_K: usize = 14336;
/// Copies of a layer's weights cycled through (436 MB each).
const WEIGHT_LAYERS: usize = 4;
const RUNS: usize = 3;

fn main() {
    let Some(a) = open_gpu() else { return };
    // More `Gpu`s on the same device: the same (primary) context, each with its own stream,
    // cuBLAS handle and attention workspace; the last one's stream at the highest priority.
    let options = gpu_options();
    let others =
        Gpu::new(0, &options).and_then(|b| Ok((b, Gpu::new_with_priority(0, StreamPriority::Highest, &options)?)));
    let (b, high) = match others {
        Ok(gpus) => gpus,
        Err(e) => return eprintln!("second stream: {e}"),
    };
    let (a, b, high) = match (Stream::new(a), Stream::new(b), Stream::new(high)) {
        (Ok(a), Ok(b), Ok(high)) => (a, b, high),
        (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => return eprintln!("cuBLASLt: {e}"),
    };
    let weights = match layer_weights(&a.gpu) {
        Ok(w) => w,
        Err(e) => return eprintln!("weights: {e}"),
    };
    println!(
        "{:<44} {:>10} {:>14} {:>12} {:>12} {:>12} {:>9}",
        "case (32 layers), ms", "one stream", "split in turn", "two streams", "first high", "3/4 SM GEMM", "best/one"
    );
    let decodes = |n: usize, context: usize| vec![(context, 1); n];
    let prompts = |n: usize, len: usize| vec![(len, len); n];
    let cases = [
        ("mixed: 384 decodes @1500 | 8 x 976 prompt", decodes(384, 1500), prompts(8, 976)),
        ("mixed: 192 decodes @1000 | 8 x 1000 prompt", decodes(192, 1000), prompts(8, 1000)),
        ("decode 384 @1500: 192 | 192", decodes(192, 1500), decodes(192, 1500)),
        ("decode 512 @1500: 256 | 256", decodes(256, 1500), decodes(256, 1500)),
    ];
    let only = std::env::args().nth(1).unwrap_or_default();
    for (name, first, second) in cases.iter().filter(|(name, ..)| name.contains(&only)) {
        if let Err(e) = run_case([&a, &b, &high], &weights, name, first, second) {
            eprintln!("{name}: {e}");
        }
    }
}

/// A `Gpu` and the GEMM plans tuned on it (each stream keeps its own, as each would in a
/// server).
struct Stream {
    gpu: Gpu,
    gemms: Gemms,
}

impl Stream {
    fn new(gpu: Gpu) -> Result<Stream, GpuError> {
        Ok(Stream { gpu, gemms: Gemms::new()? })
    }
}

/// `WEIGHT_LAYERS` layers of random bf16 projections, on `gpu` (shared by both streams: one
/// context).
fn layer_weights(gpu: &Gpu) -> Result<Vec<Vec<GpuTensor>>, GpuError> {
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    (0..WEIGHT_LAYERS)
        .map(|_| PROJECTIONS.iter().map(|&(n, k)| random_tensor(gpu, DType::BF16, n * k, &mut seed)).collect())
        .collect()
}

/// One part of a step: its rows' activations and its attention.
struct Part {
    rows: usize,
    /// `[rows, WIDEST_K]` input and `[rows, WIDEST_N]` output, sliced per projection.
    x: GpuTensor,
    y: GpuTensor,
    attention: AttentionCase,
}

impl Part {
    /// `requests`: (context length, query rows) of each sequence.
    fn new(gpu: &Gpu, requests: &[(usize, usize)]) -> Result<Part, GpuError> {
        let attention = AttentionCase::new(gpu, LLAMA_8B, COMPACT_ZEROS, requests)?;
        let rows = requests.iter().map(|&(_, q)| q).sum();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        Ok(Part {
            rows,
            x: random_tensor(gpu, DType::BF16, rows * WIDEST_K, &mut seed)?,
            y: GpuTensor::zeros(gpu, DType::BF16, rows * WIDEST_N)?,
            attention,
        })
    }

    /// Tunes the GEMMs at this part's rows on `s`, as the engine does at load for its batches.
    fn tune(&self, s: &Stream, weights: &[Vec<GpuTensor>]) -> Result<(), GpuError> {
        let shapes: Vec<_> = weights[0].iter().zip(PROJECTIONS).map(|(w, (n, _))| (w.view(), n, DType::BF16)).collect();
        s.gemms.tune(&s.gpu, &[self.rows], &shapes).map(|_| ())
    }

    /// Issues 32 layers on `s`'s stream: qkv, attention, o_proj, gate_up, down.
    fn issue_step(&mut self, s: &Stream, weights: &[Vec<GpuTensor>]) -> Result<(), GpuError> {
        let Stream { gpu, gemms } = s;
        let Part { rows, x, y, attention } = self;
        let m = *rows;
        let meta = attention.step.metadata();
        for layer in 0..LAYERS {
            let w = &weights[layer % weights.len()];
            for (p, &(n, k)) in PROJECTIONS.iter().enumerate() {
                cuda::linear(gpu, gemms, x.slice(0..m * k), m, k, w[p].view(), n, None, y.slice_mut(0..m * n))?;
                if p == 0 {
                    attention.buffers.attend(gpu, &meta, layer, AttentionKernel::Picked)?;
                }
            }
        }
        Ok(())
    }
}

/// Seconds between two events recorded on `gpu`'s stream around `issue`, best of `RUNS` after
/// one warm-up.
fn best_time(gpu: &Gpu, mut issue: impl FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError> {
    let (start, end) = (event(gpu)?, event(gpu)?);
    issue()?;
    gpu.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..RUNS {
        start.record(gpu.stream())?;
        issue()?;
        end.record(gpu.stream())?;
        end.synchronize()?;
        best = best.min(start.elapsed_ms(&end)? as f64 / 1e3);
    }
    Ok(best)
}

fn event(gpu: &Gpu) -> Result<CudaEvent, GpuError> {
    Ok(gpu.stream().context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// `gpus`: the stream of the whole step and of the second part, the first part's stream of
/// equal priority, and one of the highest priority.
fn run_case(
    gpus: [&Stream; 3],
    weights: &[Vec<GpuTensor>],
    name: &str,
    first: &[(usize, usize)],
    second: &[(usize, usize)],
) -> Result<(), GpuError> {
    let [a, b, high] = gpus;
    let whole_requests: Vec<_> = first.iter().chain(second).copied().collect();
    let one_stream = {
        let mut whole = Part::new(&a.gpu, &whole_requests)?;
        whole.tune(a, weights)?;
        let t = best_time(&a.gpu, || whole.issue_step(a, weights))?;
        a.gemms.clear();
        t
    };
    let mut first = Part::new(&a.gpu, first)?;
    let mut second = Part::new(&a.gpu, second)?;
    first.tune(a, weights)?;
    second.tune(a, weights)?;
    let in_turn = best_time(&a.gpu, || {
        first.issue_step(a, weights)?;
        second.issue_step(a, weights)
    })?;
    let mut two_streams = [0.0; 3];
    for (slot, side) in [b, high, high].into_iter().enumerate() {
        first.tune(side, weights)?;
        if slot == 2 {
            a.gemms.clear();
            a.gpu.set_gemm_sm_count_target(Some(a.gpu.multiprocessors() * 3 / 4))?;
        }
        // The side stream starts when `a` reaches the fork event, and `a` waits for its last
        // layer.
        let (fork, join) = (event(&a.gpu)?, event(&side.gpu)?);
        two_streams[slot] = best_time(&a.gpu, || {
            fork.record(a.gpu.stream())?;
            side.gpu.stream().wait(&fork)?;
            first.issue_step(side, weights)?;
            second.issue_step(a, weights)?;
            join.record(side.gpu.stream())?;
            a.gpu.stream().wait(&join)?;
            Ok(())
        })?;
        side.gemms.clear();
    }
    a.gpu.set_gemm_sm_count_target(None)?;
    a.gemms.clear();
    println!(
        "{name:<44} {:>10.2} {:>14.2} {:>12.2} {:>12.2} {:>12.2} {:>9.3}",
        one_stream * 1e3,
        in_turn * 1e3,
        two_streams[0] * 1e3,
        two_streams[1] * 1e3,
        two_streams[2] * 1e3,
        two_streams.iter().fold(f64::INFINITY, |m, &t| m.min(t)) / one_stream
    );
    Ok(())
}
