//! Times `cuda::linear` for a few rows (the GEMV kernel) next to `cuda::linear_cublas` on the
//! same inputs, on the projections of the Llama-3.1-8B and Llama-3.2-1B shapes in bf16.
//!
//! ```text
//! cargo build --release -p ferrolm-backend --features cuda,bench-internals --example gemv_bench
//! target/release/examples/gemv_bench        # or `gemv_bench fp8`: the FP8 rows alone
//! target/release/examples/gemv_bench fp8-ksplit   # the FP8 GEMV at each split of k
//! target/release/examples/gemv_bench fp8-blocks   # by scale layout
//! ```
//!
//! Each shape's weights are cycled through in enough copies that one pass is several times the
//! 50 MB L2 cache, so the reads come from device memory as in a decode step. A line gives the
//! mean time per call over 64 back-to-back calls (best of 5 such runs) and the weight bytes read
//! per call over that time. Then the 8B projections and LM head at 192, 384, 512 and 8192 rows,
//! as TFLOP/s, on cuBLAS's default kernels and again after `Gemms::tune`. Last, the 8B
//! projections with FP8 weights (one scale per row): `cuda::linear_fp8` at 1 to 4 rows (the FP8
//! GEMV, one byte a weight, as GB/s of codes) and at 8 to 512 rows (the FP8 GEMM, the rows
//! quantized first, as TFLOP/s, untuned and after `tune_fp8_gemms`).

mod bench_support;

use bench_support::{best_mean, open_gpu, random_tensor};
use ferrolm_backend::cuda::{self, Gemms, Gpu, GpuError, GpuFp8Matrix, GpuTensor};
use ferrolm_backend::{DType, Fp8Matrix, Fp8Scales};

/// Bytes of weights cycled through per shape.
const WORKING_SET: usize = 512 << 20;

fn main() {
    let Some(gpu) = open_gpu() else { return };
    let gemms = match Gemms::new() {
        Ok(gemms) => gemms,
        Err(e) => return eprintln!("cuBLASLt: {e}"),
    };
    let shapes = [
        ("8b qkv", 6144, 4096),
        ("8b o_proj", 4096, 4096),
        ("8b gate_up", 28672, 4096),
        ("8b down", 4096, 14336),
        ("8b lm_head", 128256, 4096),
        ("1b qkv", 3072, 2048),
        ("1b o_proj", 2048, 2048),
        ("1b gate_up", 16384, 2048),
        ("1b down", 2048, 8192),
        ("1b lm_head", 128256, 2048),
    ];
    // `gemv_bench fp8`: the FP8 rows alone; `gemv_bench fp8-ksplit`: the FP8 GEMV at 1 and 4
    // rows with each split of k over a tile's (or column's) warps.
    match std::env::args().nth(1).as_deref() {
        Some("fp8") => return fp8_section(&gpu, &gemms, &shapes),
        Some("fp8-ksplit") => return fp8_ksplit_section(&gpu, &gemms, &shapes),
        Some("fp8-blocks") => return fp8_blocks_section(&gpu, &gemms, &shapes),
        _ => {}
    }
    println!("{:<34} {:>3} {:>10} {:>10} {:>10} {:>10}", "shape (n x k)", "m", "gemv us", "GB/s", "cublas us", "GB/s");
    for (name, n, k) in shapes {
        for m in [1, 2, 4] {
            if let Err(e) = run(&gpu, &gemms, name, m, n, k) {
                eprintln!("{name} m={m}: {e}");
            }
        }
    }
    // The GEMV kernel at one row with each split of k over a column's warps (`linear` picks one
    // by the shape: gemv_ksplit in src/cuda/linear.rs).
    println!();
    println!("{:<34} {:>10} {:>10} {:>10} {:>10}", "one row, us per call (n x k)", "ksplit 1", "2", "4", "8");
    for (name, n, k) in shapes.into_iter().filter(|&(_, n, _)| n != 128256) {
        match ksplit_times(&gpu, &gemms, n, k) {
            Ok(t) => println!(
                "{:<34} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                format!("{name} ({n} x {k})"),
                t[0] * 1e6,
                t[1] * 1e6,
                t[2] * 1e6,
                t[3] * 1e6
            ),
            Err(e) => eprintln!("{name} ksplit: {e}"),
        }
    }
    // Many rows (cuBLAS): a batch of decodes and a prefill chunk, as compute rates.
    println!();
    println!("{:<34} {:>10} {:>10} {:>10} {:>10}", "TFLOP/s (n x k), cuBLAS", "m 192", "384", "512", "8192");
    for (name, n, k) in shapes.into_iter().filter(|&(name, _, _)| name.starts_with("8b")) {
        let rates: Result<Vec<f64>, GpuError> =
            [192, 384, 512, 8192].into_iter().map(|m| gemm_rate(&gpu, &gemms, m, n, k)).collect();
        match rates {
            Ok(r) => println!(
                "{:<34} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
                format!("{name} ({n} x {k})"),
                r[0],
                r[1],
                r[2],
                r[3]
            ),
            Err(e) => eprintln!("{name} GEMM: {e}"),
        }
    }
    // The same after `Gemms::tune` (cuBLASLt where it beat cuBLAS by 3 % on one copy of the
    // weights); per row count, whether it kept a plan, the candidates it timed and cuBLAS's time
    // over the best candidate's.
    println!();
    println!("{:<34} {:>10} {:>10} {:>10} {:>10}  kept", "TFLOP/s (n x k), tuned", "m 192", "384", "512", "8192");
    for (name, n, k) in shapes.into_iter().filter(|&(name, _, _)| name.starts_with("8b")) {
        let ms = [192, 384, 512, 8192];
        let output = if n == 128256 { DType::F32 } else { DType::BF16 };
        let tuned = random_tensor(&gpu, DType::BF16, n * k, &mut 0x9e37_79b9_7f4a_7c15_u64)
            .and_then(|w| gemms.tune(&gpu, &ms, &[(w.view(), n, output)]));
        let rates: Result<Vec<f64>, GpuError> = ms.into_iter().map(|m| gemm_rate(&gpu, &gemms, m, n, k)).collect();
        match (tuned, rates) {
            (Ok(t), Ok(r)) => println!(
                "{:<34} {:>10.0} {:>10.0} {:>10.0} {:>10.0}  {:?}",
                format!("{name} ({n} x {k})"),
                r[0],
                r[1],
                r[2],
                r[3],
                t.iter()
                    .map(|t| (t.taken, t.candidates, t.best_us.map(|b| (t.default_us / b * 100.0).round() / 100.0)))
                    .collect::<Vec<_>>()
            ),
            (Err(e), _) | (_, Err(e)) => eprintln!("{name} tuned GEMM: {e}"),
        }
    }
    fp8_section(&gpu, &gemms, &shapes);
}

/// The 8B's projections with FP8 weights: the GEMV's rate at 1 to 4 rows (GB/s of codes) and
/// the FP8 GEMM's at more (TFLOP/s), untuned and tuned.
fn fp8_section(gpu: &Gpu, gemms: &Gemms, shapes: &[(&str, usize, usize)]) {
    println!();
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "FP8 (n x k)", "m1 GB/s", "m2 GB/s", "m4 GB/s", "m8 TF/s", "m64", "m512"
    );
    let ms = [1, 2, 4, 8, 64, 512];
    for &(name, n, k) in shapes.iter().filter(|&&(name, n, _)| name.starts_with("8b") && n != 128256) {
        match fp8_rates(gpu, gemms, n, k, &ms) {
            Ok(runs) => {
                for (r, label) in runs.iter().zip(["", " tuned"]) {
                    println!(
                        "{:<34} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0}",
                        format!("{name} ({n} x {k}){label}"),
                        r[0],
                        r[1],
                        r[2],
                        r[3],
                        r[4],
                        r[5]
                    );
                }
            }
            Err(e) => eprintln!("{name} FP8: {e}"),
        }
    }
}

/// The 8B's projections and LM head with FP8 weights through the FP8 GEMV at 1 and 4 rows, GB/s
/// of codes at each split of k (1, 2, 4, 8 warps) and at the kernel's own choice.
fn fp8_ksplit_section(gpu: &Gpu, gemms: &Gemms, shapes: &[(&str, usize, usize)]) {
    println!();
    println!(
        "{:<30} {:>3} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "FP8 GEMV GB/s (n x k)", "m", "ks 1", "2", "4", "8", "chosen"
    );
    for &(name, n, k) in shapes.iter().filter(|&&(name, _, _)| name.starts_with("8b")) {
        for m in [1, 4] {
            match fp8_ksplit_rates(gpu, gemms, n, k, m) {
                Ok(r) => println!(
                    "{:<30} {m:>3} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0}",
                    format!("{name} ({n} x {k})"),
                    r[0],
                    r[1],
                    r[2],
                    r[3],
                    r[4]
                ),
                Err(e) => eprintln!("{name} FP8 m={m}: {e}"),
            }
        }
    }
}

/// The 8B's projections with FP8 weights past the GEMV's rows, TFLOP/s (tuned), by the weights'
/// scales: one a row (the FP8 GEMM, activations per token), 128 x 128 blocks (the block GEMM,
/// activations per token and 128 columns), and 128 x 64 blocks, which no FP8 GEMM takes (the
/// matrix dequantized to bf16 per call, then cuBLAS).
fn fp8_blocks_section(gpu: &Gpu, gemms: &Gemms, shapes: &[(&str, usize, usize)]) {
    println!();
    if !gpu.options().fp8_block_gemm {
        println!("FERROLM_FP8_BLOCK_GEMM is off: the 128 x 128 rows take the dequantized copy too");
    }
    let ms = [8, 33, 64, 256, 2048];
    println!(
        "{:<44} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "FP8 TFLOP/s (n x k), scales", "m8", "m33", "m64", "m256", "m2048"
    );
    let layouts: [(&str, ScalesOf); 3] = [
        ("rows", |n, _| Fp8Scales::Rows((0..n).map(|i| (1 + i % 7) as f32 / 448.0).collect())),
        ("128 x 128", |n, k| block_scales(n, k, 128)),
        ("128 x 64 (dequantized)", |n, k| block_scales(n, k, 64)),
    ];
    for &(name, n, k) in shapes.iter().filter(|&&(name, n, _)| name.starts_with("8b") && n != 128256) {
        for (layout, scales) in layouts {
            let rates = fp8_scaled_weights(gpu, n, k, scales(n, k)).and_then(|weights| {
                let gemm_rows: Vec<usize> = ms.to_vec();
                cuda::tune_fp8_gemms(gpu, gemms, weights[0].view(), n, &gemm_rows, DType::BF16)?;
                fp8_gemm_rates(gpu, gemms, &weights, n, k, &ms)
            });
            match rates {
                Ok(r) => println!(
                    "{:<44} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0}",
                    format!("{name} ({n} x {k}), {layout}"),
                    r[0],
                    r[1],
                    r[2],
                    r[3],
                    r[4]
                ),
                Err(e) => eprintln!("{name} FP8 {layout}: {e}"),
            }
        }
    }
}

/// The scales of an `[n, k]` matrix.
type ScalesOf = fn(usize, usize) -> Fp8Scales;

/// A grid of `128 x block_cols` block scales over `[n, k]`.
fn block_scales(n: usize, k: usize, block_cols: usize) -> Fp8Scales {
    let scales = (0..n.div_ceil(128) * k.div_ceil(block_cols)).map(|i| (1 + i % 7) as f32 / 448.0).collect();
    Fp8Scales::Blocks { block_rows: 128, block_cols, scales }
}

/// TFLOP/s of `linear_fp8` over `weights` (copies of one `[n, k]` matrix) at each of `ms` rows,
/// with a scratch that holds the matrix dequantized.
fn fp8_gemm_rates(
    gpu: &Gpu,
    gemms: &Gemms,
    weights: &[GpuFp8Matrix],
    n: usize,
    k: usize,
    ms: &[usize],
) -> Result<Vec<f64>, GpuError> {
    let copies = weights.len();
    let largest = ms.iter().copied().max().unwrap_or(1);
    let x = random_tensor(gpu, DType::BF16, largest * k, &mut 0x2545_f491_4f6c_dd1d_u64)?;
    let mut y = GpuTensor::zeros(gpu, DType::BF16, largest * n)?;
    let mut scratch = GpuTensor::zeros(gpu, DType::BF16, (n * k).max(largest * k) + largest * 128 + 16)?;
    ms.iter()
        .map(|&m| {
            let t = best_mean(gpu, copies, |i| {
                let (x, w, y) = (x.slice(0..m * k), weights[i % copies].view(), y.slice_mut(0..m * n));
                cuda::linear_fp8(gpu, gemms, x, m, w, n, None, y, &mut scratch, None)
            })?;
            Ok(2.0 * (m * n * k) as f64 / t / 1e12)
        })
        .collect()
}

/// Copies of a random `[n, k]` FP8 matrix with row scales, enough that a pass over them is
/// several times the L2 cache.
fn fp8_weights(gpu: &Gpu, n: usize, k: usize) -> Result<Vec<GpuFp8Matrix>, GpuError> {
    let scales = Fp8Scales::Rows((0..n).map(|i| (1 + i % 7) as f32 / 448.0).collect());
    fp8_scaled_weights(gpu, n, k, scales)
}

/// Copies of a random `[n, k]` FP8 matrix with `scales`, enough that a pass over them is several
/// times the L2 cache.
fn fp8_scaled_weights(gpu: &Gpu, n: usize, k: usize, scales: Fp8Scales) -> Result<Vec<GpuFp8Matrix>, GpuError> {
    let copies = WORKING_SET.div_ceil(n * k).clamp(1, 16);
    // Codes of magnitude below 0x7e (no NaN), either sign; the copies hold the same values in
    // distinct memory.
    let codes: Vec<u8> = (0..n * k)
        .map(|i| {
            let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            ((h >> 40) % 0x7e) as u8 | ((h >> 32) as u8 & 0x80)
        })
        .collect();
    let w = Fp8Matrix::new(n, k, codes, scales).expect("codes and scales of the shape");
    (0..copies).map(|_| GpuFp8Matrix::new(gpu, &w).map(|m| m.expect("scales the kernels take"))).collect()
}

/// GB/s of codes of the FP8 GEMV at `m` rows with k split over 1, 2, 4 and 8 warps, then at
/// the kernel's own split.
fn fp8_ksplit_rates(gpu: &Gpu, gemms: &Gemms, n: usize, k: usize, m: usize) -> Result<[f64; 5], GpuError> {
    let weights = fp8_weights(gpu, n, k)?;
    let copies = weights.len();
    let x = random_tensor(gpu, DType::BF16, m * k, &mut 0x2545_f491_4f6c_dd1d_u64)?;
    let mut y = GpuTensor::zeros(gpu, DType::BF16, m * n)?;
    let mut scratch = GpuTensor::zeros(gpu, DType::BF16, 16)?;
    let mut rates = [0.0; 5];
    for (slot, ksplit) in [Some(1), Some(2), Some(4), Some(8), None].into_iter().enumerate() {
        let t = best_mean(gpu, copies, |i| {
            let (w, y) = (weights[i % copies].view(), y.view_mut());
            match ksplit {
                Some(ksplit) => cuda::linear_fp8_gemv_ksplit(gpu, gemms, x.view(), m, w, n, ksplit, y, &mut scratch),
                None => cuda::linear_fp8(gpu, gemms, x.view(), m, w, n, None, y, &mut scratch, None),
            }
        })?;
        rates[slot] = (n * k) as f64 / t / 1e9;
    }
    Ok(rates)
}

/// `linear_fp8` over copies of a random `[n, k]` FP8 matrix with row scales at each of `ms`
/// rows: GB/s of codes up to 4 rows, TFLOP/s beyond; before `tune_fp8_gemms`, then after.
fn fp8_rates(gpu: &Gpu, gemms: &Gemms, n: usize, k: usize, ms: &[usize]) -> Result<[Vec<f64>; 2], GpuError> {
    let weights = fp8_weights(gpu, n, k)?;
    let copies = weights.len();
    let largest = ms.iter().copied().max().unwrap_or(1);
    let x = random_tensor(gpu, DType::BF16, largest * k, &mut 0x2545_f491_4f6c_dd1d_u64)?;
    let mut y = GpuTensor::zeros(gpu, DType::BF16, largest * n)?;
    let mut scratch = GpuTensor::zeros(gpu, DType::BF16, (largest * k).div_ceil(2) + largest * 2 + 16)?;
    let mut runs = [Vec::new(), Vec::new()];
    for (run, tuned) in runs.iter_mut().zip([false, true]) {
        if tuned {
            let gemm_rows: Vec<usize> = ms.iter().copied().filter(|&m| m > cuda::GEMV_MAX_M).collect();
            cuda::tune_fp8_gemms(gpu, gemms, weights[0].view(), n, &gemm_rows, DType::BF16)?;
        }
        for &m in ms {
            let t = best_mean(gpu, copies, |i| {
                let (x, w, y) = (x.slice(0..m * k), weights[i % copies].view(), y.slice_mut(0..m * n));
                cuda::linear_fp8(gpu, gemms, x, m, w, n, None, y, &mut scratch, None)
            })?;
            let rate =
                if m <= cuda::GEMV_MAX_M { (n * k) as f64 / t / 1e9 } else { 2.0 * (m * n * k) as f64 / t / 1e12 };
            run.push(rate);
        }
    }
    Ok(runs)
}

/// TFLOP/s of `linear` at `m` rows (cuBLAS past a few rows).
fn gemm_rate(gpu: &Gpu, gemms: &Gemms, m: usize, n: usize, k: usize) -> Result<f64, GpuError> {
    let Operands { weights, x, mut y } = Operands::new(gpu, m, n, k)?;
    let copies = weights.len();
    let t = best_mean(gpu, copies, |i| {
        cuda::linear(gpu, gemms, x.view(), m, k, weights[i % copies].view(), n, None, y.view_mut())
    })?;
    Ok(2.0 * (m * n * k) as f64 / t / 1e12)
}

/// One shape's operands: enough copies of random `[n, k]` weights that a pass over them is
/// several times the L2 cache, an `[m, k]` input and an `[m, n]` output (f32 for the LM head, as
/// the model computes it).
struct Operands {
    weights: Vec<GpuTensor>,
    x: GpuTensor,
    y: GpuTensor,
}

impl Operands {
    fn new(gpu: &Gpu, m: usize, n: usize, k: usize) -> Result<Operands, GpuError> {
        let copies = WORKING_SET.div_ceil(n * k * 2).clamp(1, 16);
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let weights =
            (0..copies).map(|_| random_tensor(gpu, DType::BF16, n * k, &mut seed)).collect::<Result<Vec<_>, _>>()?;
        let x = random_tensor(gpu, DType::BF16, m * k, &mut seed)?;
        let out_dtype = if n == 128256 { DType::F32 } else { DType::BF16 };
        Ok(Operands { weights, x, y: GpuTensor::zeros(gpu, out_dtype, m * n)? })
    }
}

/// One row through the GEMV kernel with k split over 1, 2, 4 and 8 warps per column.
fn ksplit_times(gpu: &Gpu, gemms: &Gemms, n: usize, k: usize) -> Result<[f64; 4], GpuError> {
    let Operands { weights, x, mut y } = Operands::new(gpu, 1, n, k)?;
    let copies = weights.len();
    let mut times = [0.0; 4];
    for (slot, ksplit) in [1, 2, 4, 8].into_iter().enumerate() {
        times[slot] = best_mean(gpu, copies, |i| {
            cuda::linear_gemv_ksplit(gpu, gemms, x.view(), 1, k, weights[i % copies].view(), n, ksplit, y.view_mut())
        })?;
    }
    Ok(times)
}

fn run(gpu: &Gpu, gemms: &Gemms, name: &str, m: usize, n: usize, k: usize) -> Result<(), GpuError> {
    let bytes = n * k * 2;
    let Operands { weights, x, mut y } = Operands::new(gpu, m, n, k)?;
    let copies = weights.len();
    let mut times = [0.0f64; 2];
    for (slot, lin) in [cuda::linear, cuda::linear_cublas].into_iter().enumerate() {
        times[slot] = best_mean(gpu, copies, |i| {
            lin(gpu, gemms, x.view(), m, k, weights[i % copies].view(), n, None, y.view_mut())
        })?;
    }
    let gbs = |s: f64| bytes as f64 / s / 1e9;
    println!(
        "{:<34} {m:>3} {:>10.2} {:>10.0} {:>10.2} {:>10.0}",
        format!("{name} ({n} x {k})"),
        times[0] * 1e6,
        gbs(times[0]),
        times[1] * 1e6,
        gbs(times[1])
    );
    Ok(())
}
