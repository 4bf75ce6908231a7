//! Times `cuda::moe` on the expert shapes of Qwen3-30B-A3B (128 experts of 2048 -> 768, top 8)
//! and Mixtral-8x7B (8 experts of 4096 -> 14336, top 2) in bf16, at decode and prefill sizes, on
//! the path `moe_path` picks and on the others.
//!
//! ```text
//! cargo build --release -p ferrolm-backend --features cuda,bench-internals --example moe_bench
//! target/release/examples/moe_bench
//! ```
//!
//! Each call routes its own random router logits (16 sets, used in turn), so that a decode step
//! reads other experts than the step before, as a model's layers do, rather than hitting the
//! L2. A line gives the mean time per call over 64 back-to-back calls (best of 5 such runs),
//! the weight bytes of the experts the calls chose over that time, next to the device's read
//! rate, and the GEMM rate. Before the timings, the paths are checked against each other on the
//! first logits set.

mod bench_support;

use bench_support::{best_mean, next_random, open_gpu, random_tensor};
use ferrolm_backend::cuda::{self, Gpu, GpuError, GpuExperts, GpuMoeScratch, GpuTensor, MoePath};
use ferrolm_backend::{DType, GatedActivation, MoeShape};

/// Router logit sets per case, used in turn.
const LOGIT_SETS: usize = 16;

struct Case {
    name: &'static str,
    shape: MoeShape,
    tokens: &'static [usize],
}

const CASES: [Case; 2] = [
    Case {
        name: "qwen3-30b-a3b",
        shape: MoeShape { num_experts: 128, top_k: 8, inter: 768, hidden: 2048 },
        tokens: &[1, 2, 4, 8, 16, 64, 256, 1024, 8192],
    },
    Case {
        name: "mixtral-8x7b",
        shape: MoeShape { num_experts: 8, top_k: 2, inter: 14336, hidden: 4096 },
        tokens: &[1, 8, 32, 64, 256, 4096],
    },
];

fn main() {
    let Some(gpu) = open_gpu() else { return };
    let read_rate = match cuda::read_rate(&gpu, 4 << 30, 3) {
        Ok(rate) => rate,
        Err(e) => return eprintln!("read rate: {e}"),
    };
    println!("device read rate {:.0} GB/s", read_rate / 1e9);
    for case in &CASES {
        if let Err(e) = run(&gpu, case, read_rate) {
            eprintln!("{}: {e}", case.name);
        }
    }
}

/// The experts the host's routing of `logits` picks (HF's: top_k of the softmax, which are the
/// top_k logits).
fn distinct_experts(logits: &[f32], shape: MoeShape) -> usize {
    let mut used = vec![false; shape.num_experts];
    for row in logits.chunks_exact(shape.num_experts) {
        let mut order: Vec<usize> = (0..shape.num_experts).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        for &e in &order[..shape.top_k] {
            used[e] = true;
        }
    }
    used.iter().filter(|&&u| u).count()
}

fn run(gpu: &Gpu, case: &Case, read_rate: f64) -> Result<(), GpuError> {
    let MoeShape { num_experts, top_k, inter, hidden } = case.shape;
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let gate_up = random_tensor(gpu, DType::BF16, num_experts * 2 * inter * hidden, &mut seed)?;
    let down = random_tensor(gpu, DType::BF16, num_experts * hidden * inter, &mut seed)?;
    let experts = GpuExperts {
        gate_up: gate_up.view(),
        down: down.view(),
        shape: case.shape,
        norm_topk_prob: true,
        activation: GatedActivation::Silu,
    };
    let expert_bytes = 3 * inter * hidden * 2;
    let max_tokens = case.tokens.iter().copied().max().unwrap_or(0);
    let mut scratch = GpuMoeScratch::new(gpu, DType::BF16, max_tokens, case.shape)?;
    println!();
    println!(
        "{} (experts {num_experts}, top {top_k}, hidden {hidden}, inter {inter}): {:.1} MB per expert",
        case.name,
        expert_bytes as f64 / 1e6
    );
    println!("{:>6} {:<22} {:>10} {:>8} {:>10} {:>7} {:>9}", "T", "path", "us", "experts", "GB/s", "% read", "TFLOP/s");
    for &tokens in case.tokens {
        let x = random_tensor(gpu, DType::BF16, tokens * hidden, &mut seed)?;
        let mut out = GpuTensor::zeros(gpu, DType::BF16, tokens * hidden)?;
        let mut host_logits = Vec::new();
        let mut logits = Vec::new();
        for _ in 0..LOGIT_SETS {
            let set: Vec<f32> = (0..tokens * num_experts)
                .map(|_| (next_random(&mut seed) >> 40) as f32 / (1u64 << 22) as f32 - 2.0)
                .collect();
            logits.push(GpuTensor::from_f32(gpu, &set, DType::F32)?);
            host_logits.push(set);
        }
        let experts_used: f64 =
            host_logits.iter().map(|l| distinct_experts(l, case.shape) as f64).sum::<f64>() / LOGIT_SETS as f64;
        let own = cuda::moe_path(tokens, case.shape);
        let mut paths = vec![own];
        for path in [MoePath::Gemv, MoePath::Grouped { block_m: 16 }, MoePath::Grouped { block_m: 64 }] {
            // The GEMV path past a few hundred slots only loops longer.
            let gemv_too_long = path == MoePath::Gemv && tokens * top_k > 2048;
            if !paths.contains(&path) && !gemv_too_long {
                paths.push(path);
            }
        }
        // The paths against the first: the same routing and products up to the rounding of the
        // down projections the grouped path stores.
        let mut first: Option<Vec<f32>> = None;
        for &path in &paths {
            cuda::moe_on_path(gpu, x.view(), logits[0].view(), &experts, &mut scratch, out.view_mut(), path)?;
            let got = out.to_f32_vec(gpu)?;
            match &first {
                None => first = Some(got),
                Some(want) => {
                    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
                    let diff = got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
                    if diff > 2e-2 * scale || got.iter().any(|g| g.is_nan()) {
                        println!("  {path:?} differs from {:?} at T={tokens}: {diff:e} of {scale:e}", paths[0]);
                    }
                }
            }
        }
        for &path in &paths {
            let secs = best_mean(gpu, LOGIT_SETS, |i| {
                let l = logits[i % LOGIT_SETS].view();
                cuda::moe_on_path(gpu, x.view(), l, &experts, &mut scratch, out.view_mut(), path)
            })?;
            let bytes = experts_used * expert_bytes as f64;
            let flops = 2.0 * (tokens * top_k) as f64 * 3.0 * (inter * hidden) as f64;
            let label = format!("{path:?}{}", if path == own { " *" } else { "" });
            println!(
                "{tokens:>6} {label:<22} {:>10.1} {experts_used:>8.1} {:>10.0} {:>6.0}% {:>9.1}",
                secs * 1e6,
                bytes / secs / 1e9,
                100.0 * bytes / secs / read_rate,
                flops / secs / 1e12
            );
        }
    }
    Ok(())
}
