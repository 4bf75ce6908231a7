//! Times the element-wise kernels of a Llama-3.1-8B layer (bf16, f32 residual stream) at a
//! decode batch and at a prompt chunk: the gated activation over the gate/up projection and the
//! residual add with RMSNorm, each also writing its output's FP8 codes (what an FP8 model's
//! projections read) beyond the rows the FP8 GEMV takes.
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
use ferrolm_backend::cuda::{self, Gpu, GpuError, GpuRowCodes, GpuTensor};
use ferrolm_backend::DType;

const HIDDEN: usize = 4096;
const INTER: usize = 14336;
/// Bytes of inputs cycled through per case.
const WORKING_SET: usize = 256 << 20;

fn main() {
    let Some(gpu) = open_gpu() else { return };
    println!("{:<44} {:>6} {:>10} {:>10}", "op (8B shape)", "rows", "us", "GB/s");
    for rows in [1, 384, 8192] {
        let mut cases = vec![
            ("silu_and_mul", silu_and_mul(&gpu, rows, false)),
            ("add_rms_norm, f32 residual", add_rms_norm(&gpu, rows, false)),
        ];
        if rows > cuda::GEMV_MAX_M {
            cases.push(("silu_and_mul, FP8 codes too", silu_and_mul(&gpu, rows, true)));
            cases.push(("add_rms_norm, f32 residual, FP8 codes too", add_rms_norm(&gpu, rows, true)));
        }
        for (name, result) in cases {
            match result {
                Ok((seconds, bytes)) => {
                    println!("{:<44} {rows:>6} {:>10.2} {:>10.0}", name, seconds * 1e6, bytes as f64 / seconds / 1e9)
                }
                Err(e) => eprintln!("{name} rows={rows}: {e}"),
            }
        }
    }
}

/// `silu_and_mul` over `[rows, 2 * INTER]` (with its output's codes where `codes`): seconds per
/// call and bytes moved.
fn silu_and_mul(gpu: &Gpu, rows: usize, codes: bool) -> Result<(f64, usize), GpuError> {
    let bytes = rows * 3 * INTER * 2 + if codes { rows * (INTER + 4) } else { 0 };
    let copies = WORKING_SET.div_ceil(bytes).clamp(1, 64);
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let inputs = (0..copies)
        .map(|_| random_tensor(gpu, DType::BF16, rows * 2 * INTER, &mut seed))
        .collect::<Result<Vec<_>, _>>()?;
    let mut outputs =
        (0..copies).map(|_| GpuTensor::zeros(gpu, DType::BF16, rows * INTER)).collect::<Result<Vec<_>, _>>()?;
    let mut all_codes = codes_buffers(gpu, codes, copies, rows, INTER)?;
    let t = best_mean(gpu, copies, |i| {
        let i = i % copies;
        let codes = all_codes.get_mut(i).map(|c| c.rows_mut(rows));
        let act = cuda::GatedActivation::Silu;
        cuda::gated_activation(gpu, act, inputs[i].view(), INTER, outputs[i].view_mut(), codes)
    })?;
    Ok((t, bytes))
}

/// `add_rms_norm` of a bf16 `[rows, HIDDEN]` into an f32 residual (with the output's codes where
/// `codes`): seconds per call and bytes moved (the residual read and written, the input read,
/// the output and its codes written).
fn add_rms_norm(gpu: &Gpu, rows: usize, codes: bool) -> Result<(f64, usize), GpuError> {
    let bytes = rows * HIDDEN * (4 + 4 + 2 + 2) + if codes { rows * (HIDDEN + 4) } else { 0 };
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
    let mut all_codes = codes_buffers(gpu, codes, copies, rows, HIDDEN)?;
    let t = best_mean(gpu, copies, |i| {
        let i = i % copies;
        let (residual, out, codes) =
            (residuals[i].view_mut(), outputs[i].view_mut(), all_codes.get_mut(i).map(|c| c.rows_mut(rows)));
        cuda::add_rms_norm(gpu, residual, xs[i].view(), w.view(), 1e-5, out, codes)
    })?;
    Ok((t, bytes))
}

/// One codes buffer of `[rows, cols]` per copy where `codes`, else none.
fn codes_buffers(
    gpu: &Gpu,
    codes: bool,
    copies: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<GpuRowCodes>, GpuError> {
    let n = if codes { copies } else { 0 };
    (0..n).map(|_| GpuRowCodes::new(gpu, rows, cols)).collect()
}
