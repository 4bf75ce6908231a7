//! Times the element-wise kernels of a Llama-3.1-8B layer (bf16, f32 residual stream) at a
//! decode batch and at a prompt chunk: the gated activation over the gate/up projection and the
//! residual add with RMSNorm.
//!
//! ```text
//! cargo build --release -p ferrolm-backend --features cuda,bench-internals --example elementwise_bench
//! target/release/examples/elementwise_bench
//! ```
//!
//! Inputs are cycled through in enough copies that a pass is several times the 50 MB L2 cache,
//! so they come from device memory. A line gives the mean time per call over 64 back-to-back
//! calls (best of 5 such runs) and the bytes each call reads and writes over that time.

mod bench_support;

use bench_support::{best_mean, open_gpu, random_tensor};
use ferrolm_backend::cuda::{self, Gpu, GpuError, GpuTensor};
use ferrolm_backend::DType;

const HIDDEN: usize = 4096;
const INTER: usize = 14336;
/// Bytes of inputs cycled through per case.
const WORKING_SET: usize = 256 << 20;

fn main() {
    let Some(gpu) = open_gpu() else { return };
    println!("{:<44} {:>6} {:>10} {:>10}", "op (8B shape)", "rows", "us", "GB/s");
    for rows in [1, 384, 8192] {
        for (name, result) in
            [("silu_and_mul", silu_and_mul(&gpu, rows)), ("add_rms_norm, f32 residual", add_rms_norm(&gpu, rows))]
        {
            match result {
                Ok((seconds, bytes)) => {
                    println!("{:<44} {rows:>6} {:>10.2} {:>10.0}", name, seconds * 1e6, bytes as f64 / seconds / 1e9)
                }
                Err(e) => eprintln!("{name} rows={rows}: {e}"),
            }
        }
    }
}

/// `silu_and_mul` over `[rows, 2 * INTER]`: seconds per call and bytes moved.
fn silu_and_mul(gpu: &Gpu, rows: usize) -> Result<(f64, usize), GpuError> {
    let bytes = rows * 3 * INTER * 2;
    let copies = WORKING_SET.div_ceil(bytes).clamp(1, 64);
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let inputs = (0..copies)
        .map(|_| random_tensor(gpu, DType::BF16, rows * 2 * INTER, &mut seed))
        .collect::<Result<Vec<_>, _>>()?;
    let mut outputs =
        (0..copies).map(|_| GpuTensor::zeros(gpu, DType::BF16, rows * INTER)).collect::<Result<Vec<_>, _>>()?;
    let t = best_mean(gpu, copies, |i| {
        let i = i % copies;
        cuda::silu_and_mul(gpu, inputs[i].view(), INTER, outputs[i].view_mut())
    })?;
    Ok((t, bytes))
}

/// `add_rms_norm` of a bf16 `[rows, HIDDEN]` into an f32 residual: seconds per call and bytes
/// moved (the residual read and written, the input read, the output written).
fn add_rms_norm(gpu: &Gpu, rows: usize) -> Result<(f64, usize), GpuError> {
    let bytes = rows * HIDDEN * (4 + 4 + 2 + 2);
    let copies = WORKING_SET.div_ceil(bytes).clamp(1, 64);
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let xs = (0..copies)
        .map(|_| random_tensor(gpu, DType::BF16, rows * HIDDEN, &mut seed))
        .collect::<Result<Vec<_>, _>>()?;
    let mut residuals =
        (0..copies).map(|_| random_tensor(gpu, DType::F32, rows * HIDDEN, &mut seed)).collect::<Result<Vec<_>, _>>()?;
    let mut outputs =
        (0..copies).map(|_| GpuTensor::zeros(gpu, DType::BF16, rows * HIDDEN)).collect::<Result<Vec<_>, _>>()?;
    let w = random_tensor(gpu, DType::F32, HIDDEN, &mut seed)?;
    let t = best_mean(gpu, copies, |i| {
        let i = i % copies;
        cuda::add_rms_norm(gpu, residuals[i].view_mut(), xs[i].view(), w.view(), 1e-5, outputs[i].view_mut())
    })?;
    Ok((t, bytes))
}
