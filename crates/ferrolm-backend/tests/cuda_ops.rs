//! Every CUDA op against the CPU op of the same name, on seeded random inputs, in f32, bf16 and
//! f16 activations. GPU outputs start as NaN so that an element an op fails to write shows up;
//! low-precision runs compare with the CPU op on inputs rounded to that dtype.
//!
//! Without a usable GPU each test prints `skipping: no GPU (<reason>)` and passes; a GPU that is
//! there but fails to open fails the test.

#![cfg(feature = "cuda")]

use ferrolm_backend::cpu;
use ferrolm_backend::cuda::{
    self, AttentionKernel, CudaSlice, Gemms, Gpu, GpuAttentionMetadata, GpuError, GpuFp8Matrix, GpuOptions,
    GpuRopeTable, GpuRowCodes, GpuTensor, PagedAttention, QkNorms, QkvOut, QkvRows,
};
use ferrolm_backend::{DType, Fp8GemmScaling, Fp8Matrix, Fp8Scales, Heads, HostTensor, WeightView};
use half::{bf16, f16};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---------------------------------------------------------------------------------------------
// Helpers

/// Activation dtypes under test and the largest relative error each may show.
const DTYPES: [(DType, f32); 3] = [(DType::F32, 1e-4), (DType::BF16, 1e-2), (DType::F16, 1e-2)];

fn gpu_or_skip() -> Option<Gpu> {
    match Gpu::new(0, &GpuOptions::default()) {
        Ok(gpu) => Some(gpu),
        Err(e) if e.means_no_gpu() => {
            eprintln!("skipping: no GPU ({e})");
            None
        }
        Err(e) => panic!("the GPU is there but could not be opened: {e}"),
    }
}

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `len` values uniform in `[-amplitude, amplitude)`.
fn random_vec(rng: &mut ChaCha8Rng, len: usize, amplitude: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-amplitude..amplitude)).collect()
}

/// The values `data` takes once stored in `dtype`.
fn rounded(data: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => data.to_vec(),
        DType::BF16 => data.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        DType::F16 => data.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
    }
}

/// A device tensor of `len` NaNs.
fn nan_tensor(gpu: &Gpu, dtype: DType, len: usize) -> Result<GpuTensor, GpuError> {
    GpuTensor::from_f32(gpu, &vec![f32::NAN; len], dtype)
}

/// Uploads `data` rounded to `dtype`; returns the tensor and the values it holds.
fn upload(gpu: &Gpu, data: &[f32], dtype: DType) -> Result<(GpuTensor, Vec<f32>), GpuError> {
    Ok((GpuTensor::from_f32(gpu, data, dtype)?, rounded(data, dtype)))
}

/// Asserts that no element is NaN (where `want` is not) and that the largest relative error,
/// `|got - want| / max(|want|, 1e-2 * max|want|)`, is at most `tol`. Returns that error.
fn check(what: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(!g.is_nan() || w.is_nan(), "{what}: element {i} is NaN (want {w})");
    }
    let (err, i) = worst_relative_error(got, want);
    assert!(err <= tol, "{what}: max relative error {err:e} at element {i}: got {}, want {}", got[i], want[i]);
    err
}

/// The largest relative error of `got` against `want` as [`check`] measures it, and where.
fn worst_relative_error(got: &[f32], want: &[f32]) -> (f32, usize) {
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
    let floor = (1e-2 * scale).max(f32::MIN_POSITIVE);
    let mut worst = (0.0f32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        let err = (g - w).abs() / w.abs().max(floor);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    worst
}

// ---------------------------------------------------------------------------------------------
// Device, tensors

#[test]
fn device_reports_itself_and_errors_are_one_line() -> Result<(), GpuError> {
    if let Err(e) = Gpu::new(4096, &GpuOptions::default()) {
        assert!(!e.to_string().contains('\n'), "multi-line error: {e}");
    } else {
        panic!("device 4096 should not exist");
    }
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let (free, total) = gpu.memory_info()?;
    let (major, minor) = gpu.compute_capability();
    eprintln!("{}: compute {major}.{minor}, {free} of {total} bytes free", gpu.name());
    assert!(!gpu.name().is_empty() && major >= 5 && free <= total && total > 0);
    gpu.synchronize()
}

#[test]
fn tensors_round_trip_through_views_and_dtypes() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(1);
    let data = random_vec(&mut rng, 1001, 3.0);
    let data_bf16: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
    let data_f16: Vec<f16> = data.iter().map(|&v| f16::from_f32(v)).collect();
    for (dtype, _) in DTYPES {
        let want = rounded(&data, dtype);
        let t = GpuTensor::from_f32(&gpu, &data, dtype)?;
        assert_eq!((t.dtype(), t.len()), (dtype, data.len()));
        assert_eq!(t.to_f32_vec(&gpu)?, want, "{dtype:?} round trip");
        // Weights of every storage dtype, converted to this one.
        for w in [WeightView::F32(&data), WeightView::BF16(&data_bf16), WeightView::F16(&data_f16)] {
            let from_w = GpuTensor::from_weights(&gpu, w, dtype)?;
            assert_eq!(from_w.to_f32_vec(&gpu)?, rounded(&w.to_f32_vec(), dtype), "{:?} -> {dtype:?}", w.dtype());
        }
        assert_eq!(t.slice(10..17).to_f32_vec(&gpu)?, want[10..17]);
        assert_eq!(t.rows(3..5, 7).to_f32_vec(&gpu)?, want[21..35]);

        // Writes through sub-views land where they should and nowhere else.
        let mut z = GpuTensor::zeros(&gpu, dtype, 20)?;
        assert_eq!(z.to_f32_vec(&gpu)?, vec![0.0; 20]);
        let (mut head, tail) = z.view_mut().split_at(5);
        head.copy_from_f32(&gpu, &[1.0, 2.0, 3.0, 4.0, 5.0])?;
        tail.rows(1..2, 5).copy_from(&gpu, t.slice(0..5))?;
        let mut want_z = vec![0.0; 20];
        want_z[..5].copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        want_z[10..15].copy_from_slice(&want[..5]);
        assert_eq!(z.to_f32_vec(&gpu)?, want_z, "{dtype:?} sub-view writes");
    }
    let ids = gpu.upload(&[3u32, 1, 4, 1, 5])?;
    assert_eq!(gpu.download(&ids)?, [3, 1, 4, 1, 5]);
    let empty = gpu.upload::<u32>(&[])?;
    assert!(gpu.download(&empty)?.is_empty());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Row-wise ops

#[test]
fn embedding_matches_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(2);
    for (vocab, hidden) in [(50, 24), (1000, 896), (300, 4096)] {
        let table: Vec<bf16> = random_vec(&mut rng, vocab * hidden, 1.0).into_iter().map(bf16::from_f32).collect();
        let ids: Vec<u32> = (0..37).map(|_| rng.random_range(0..vocab as u32)).collect();
        let ids_dev = gpu.upload(&ids)?;
        for (dtype, tol) in DTYPES {
            let table_dev = GpuTensor::from_weights(&gpu, WeightView::BF16(&table), dtype)?;
            let stored = rounded(&WeightView::BF16(&table).to_f32_vec(), dtype);
            for scale in [1.0f32, 29.9] {
                let mut out = nan_tensor(&gpu, dtype, ids.len() * hidden)?;
                cuda::embedding(&gpu, &ids_dev, table_dev.view(), hidden, scale, out.view_mut())?;
                let mut want = vec![0.0; ids.len() * hidden];
                cpu::embedding(&ids, WeightView::F32(&stored), hidden, scale, &mut want);
                check(
                    &format!("embedding {dtype:?} {vocab}x{hidden} scale {scale}"),
                    &out.to_f32_vec(&gpu)?,
                    &want,
                    tol,
                );
            }
        }
    }
    Ok(())
}

/// (rows, hidden): odd sizes, head-sized rows, and rows wider than one block's threads.
/// Rows of one element per thread and fewer, several per thread, and more than the norm kernels
/// keep in registers (5120 > 4 x 1024).
/// Widths of a multiple of 8 take the 16-byte-access kernels, others the element-wise ones; 16392
/// is more 8-element chunks than a block's threads keep in registers (2 x 1024).
const NORM_SHAPES: [(usize, usize); 8] =
    [(1, 7), (3, 64), (5, 896), (40, 1000), (3, 1001), (7, 4096), (2, 5120), (2, 16392)];

#[test]
fn rms_norm_matches_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(3);
    for (rows, h) in NORM_SHAPES {
        let x = random_vec(&mut rng, rows * h, 3.0);
        let w = random_vec(&mut rng, h, 2.0);
        let w_dev = GpuTensor::from_f32(&gpu, &w, DType::F32)?;
        for (dtype, tol) in DTYPES {
            let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
            let mut out = nan_tensor(&gpu, dtype, rows * h)?;
            cuda::rms_norm(&gpu, x_dev.view(), w_dev.view(), 1e-6, out.view_mut(), None)?;
            let mut want = vec![0.0; rows * h];
            cpu::rms_norm(&x_r, &w, 1e-6, &mut want);
            check(&format!("rms_norm {dtype:?} [{rows}, {h}]"), &out.to_f32_vec(&gpu)?, &want, tol);
        }
    }
    Ok(())
}

#[test]
fn add_rms_norm_updates_residual_and_normalizes_it() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(4);
    for (rows, h) in NORM_SHAPES {
        let residual = random_vec(&mut rng, rows * h, 3.0);
        let x = random_vec(&mut rng, rows * h, 3.0);
        let w = random_vec(&mut rng, h, 2.0);
        let w_dev = GpuTensor::from_f32(&gpu, &w, DType::F32)?;
        for (dtype, tol) in DTYPES {
            let (mut res_dev, mut res_r) = upload(&gpu, &residual, dtype)?;
            let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
            let mut out = nan_tensor(&gpu, dtype, rows * h)?;
            cuda::add_rms_norm(&gpu, res_dev.view_mut(), x_dev.view(), w_dev.view(), 1e-5, out.view_mut(), None)?;
            let mut want = vec![0.0; rows * h];
            cpu::add_rms_norm(&mut res_r, &x_r, &w, 1e-5, &mut want);
            let what = format!("add_rms_norm {dtype:?} [{rows}, {h}]");
            check(&format!("{what} residual"), &res_dev.to_f32_vec(&gpu)?, &res_r, tol);
            check(&what, &out.to_f32_vec(&gpu)?, &want, tol);
        }
    }
    Ok(())
}

/// The fused output norm and residual add (Gemma 2/3) against `rms_norm_inplace` then
/// `add_rms_norm`, with the residual in the layer dtype and in f32, on every norm shape (the
/// ones that are not whole 16-byte chunks take the op-by-op path).
#[test]
fn add_normed_rms_norm_equals_the_ops_it_fuses() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(45);
    for (rows, h) in NORM_SHAPES {
        let residual = random_vec(&mut rng, rows * h, 3.0);
        let x = random_vec(&mut rng, rows * h, 3.0);
        let x_w = GpuTensor::from_f32(&gpu, &random_vec(&mut rng, h, 2.0), DType::F32)?;
        let w = GpuTensor::from_f32(&gpu, &random_vec(&mut rng, h, 2.0), DType::F32)?;
        for (dtype, tol) in DTYPES {
            for residual_dtype in [dtype, DType::F32] {
                let what = format!("add_normed_rms_norm {dtype:?} (residual {residual_dtype:?}) [{rows}, {h}]");
                let mut res_want = GpuTensor::from_f32(&gpu, &residual, residual_dtype)?;
                let mut x_want = GpuTensor::from_f32(&gpu, &x, dtype)?;
                let mut want = nan_tensor(&gpu, dtype, rows * h)?;
                cuda::rms_norm_inplace(&gpu, x_want.view_mut(), x_w.view(), 1e-6)?;
                cuda::add_rms_norm(&gpu, res_want.view_mut(), x_want.view(), w.view(), 1e-6, want.view_mut(), None)?;
                let mut res_got = GpuTensor::from_f32(&gpu, &residual, residual_dtype)?;
                let mut x_got = GpuTensor::from_f32(&gpu, &x, dtype)?;
                let mut got = nan_tensor(&gpu, dtype, rows * h)?;
                cuda::add_normed_rms_norm(
                    &gpu,
                    res_got.view_mut(),
                    x_got.view_mut(),
                    x_w.view(),
                    w.view(),
                    1e-6,
                    got.view_mut(),
                    None,
                )?;
                check(&format!("{what} residual"), &res_got.to_f32_vec(&gpu)?, &res_want.to_f32_vec(&gpu)?, tol);
                check(&what, &got.to_f32_vec(&gpu)?, &want.to_f32_vec(&gpu)?, tol);
            }
        }
    }
    Ok(())
}

/// An f32 residual stream around bf16/f16 layers: embedding into f32, RMSNorm from f32, and the
/// fused add keeping the sum in f32 (exactly the CPU's sum) while `out` is in the layer dtype.
#[test]
fn f32_residual_stream_with_half_precision_layers() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(44);
    for (rows, h) in NORM_SHAPES {
        let table: Vec<bf16> = random_vec(&mut rng, 50 * h, 1.0).into_iter().map(bf16::from_f32).collect();
        let ids: Vec<u32> = (0..rows).map(|_| rng.random_range(0..50u32)).collect();
        let x = random_vec(&mut rng, rows * h, 3.0);
        let w = random_vec(&mut rng, h, 2.0);
        let w_dev = GpuTensor::from_f32(&gpu, &w, DType::F32)?;
        for (dtype, tol) in DTYPES.into_iter().filter(|(d, _)| *d != DType::F32) {
            let what = format!("{dtype:?} [{rows}, {h}]");
            let table_dev = GpuTensor::from_weights(&gpu, WeightView::BF16(&table), dtype)?;
            let stored = rounded(&WeightView::BF16(&table).to_f32_vec(), dtype);
            let mut residual = nan_tensor(&gpu, DType::F32, rows * h)?;
            cuda::embedding(&gpu, &gpu.upload(&ids)?, table_dev.view(), h, 3.0, residual.view_mut())?;
            let mut res_r = vec![0.0; rows * h];
            cpu::embedding(&ids, WeightView::F32(&stored), h, 3.0, &mut res_r);
            check(&format!("embedding to f32 {what}"), &residual.to_f32_vec(&gpu)?, &res_r, 1e-6);

            let mut out = nan_tensor(&gpu, dtype, rows * h)?;
            cuda::rms_norm(&gpu, residual.view(), w_dev.view(), 1e-6, out.view_mut(), None)?;
            let mut want = vec![0.0; rows * h];
            cpu::rms_norm(&res_r, &w, 1e-6, &mut want);
            check(&format!("rms_norm from f32 {what}"), &out.to_f32_vec(&gpu)?, &want, tol);

            let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
            cuda::add_rms_norm(&gpu, residual.view_mut(), x_dev.view(), w_dev.view(), 1e-6, out.view_mut(), None)?;
            cpu::add_rms_norm(&mut res_r, &x_r, &w, 1e-6, &mut want);
            check(&format!("add_rms_norm f32 residual {what}"), &residual.to_f32_vec(&gpu)?, &res_r, 1e-6);
            check(&format!("add_rms_norm f32 residual {what} out"), &out.to_f32_vec(&gpu)?, &want, tol);
        }
    }
    Ok(())
}

#[test]
fn rms_norm_inplace_normalizes_each_head() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(5);
    for (tokens, heads, head_dim) in [(1, 8, 64), (13, 16, 128), (33, 2, 128)] {
        let x = random_vec(&mut rng, tokens * heads * head_dim, 3.0);
        let w = random_vec(&mut rng, head_dim, 2.0);
        let w_dev = GpuTensor::from_f32(&gpu, &w, DType::F32)?;
        for (dtype, tol) in DTYPES {
            let (mut x_dev, mut want) = upload(&gpu, &x, dtype)?;
            cuda::rms_norm_inplace(&gpu, x_dev.view_mut(), w_dev.view(), 1e-6)?;
            cpu::rms_norm_inplace(&mut want, &w, 1e-6);
            check(
                &format!("rms_norm_inplace {dtype:?} {tokens}x{heads}x{head_dim}"),
                &x_dev.to_f32_vec(&gpu)?,
                &want,
                tol,
            );
        }
    }
    Ok(())
}

#[test]
fn split_qkv_copies_each_part() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(6);
    for (tokens, q_size, kv_size) in [(1, 64, 64), (17, 4096, 1024), (3, 896, 128)] {
        let width = q_size + 2 * kv_size;
        let qkv = random_vec(&mut rng, tokens * width, 1.0);
        for (dtype, _) in DTYPES {
            let (qkv_dev, qkv_r) = upload(&gpu, &qkv, dtype)?;
            let mut q = nan_tensor(&gpu, dtype, tokens * q_size)?;
            let mut k = nan_tensor(&gpu, dtype, tokens * kv_size)?;
            let mut v = nan_tensor(&gpu, dtype, tokens * kv_size)?;
            cuda::split_qkv(&gpu, qkv_dev.view(), q_size, kv_size, q.view_mut(), k.view_mut(), v.view_mut())?;
            let (q, k, v) = (q.to_f32_vec(&gpu)?, k.to_f32_vec(&gpu)?, v.to_f32_vec(&gpu)?);
            for (t, row) in qkv_r.chunks_exact(width).enumerate() {
                assert_eq!(q[t * q_size..][..q_size], row[..q_size], "q row {t}");
                assert_eq!(k[t * kv_size..][..kv_size], row[q_size..q_size + kv_size], "k row {t}");
                assert_eq!(v[t * kv_size..][..kv_size], row[q_size + kv_size..], "v row {t}");
            }
        }
    }
    Ok(())
}

#[test]
fn gated_activations_match_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(7);
    type CpuAct = fn(&[f32], usize, &mut [f32]);
    let ops: [(cuda::GatedActivation, CpuAct); 2] =
        [(cuda::GatedActivation::Silu, cpu::silu_and_mul), (cuda::GatedActivation::GeluTanh, cpu::gelu_tanh_and_mul)];
    // The last shape has more columns than its blocks of a row cover at once (a strided loop).
    for (rows, inter) in [(1, 5), (3, 128), (9, 4864), (2, 14336), (600, 4864)] {
        let mut gate_up = random_vec(&mut rng, rows * 2 * inter, 8.0);
        // Saturating inputs: no NaN from exp overflow.
        gate_up[0] = -200.0;
        gate_up[1.min(inter - 1)] = 200.0;
        for (dtype, tol) in DTYPES {
            let (gu_dev, gu_r) = upload(&gpu, &gate_up, dtype)?;
            for (act, cpu_op) in ops {
                let mut out = nan_tensor(&gpu, dtype, rows * inter)?;
                cuda::gated_activation(&gpu, act, gu_dev.view(), inter, out.view_mut(), None)?;
                let mut want = vec![0.0; rows * inter];
                cpu_op(&gu_r, inter, &mut want);
                check(&format!("{act:?} and mul {dtype:?} [{rows}, {inter}]"), &out.to_f32_vec(&gpu)?, &want, tol);
            }
        }
    }
    Ok(())
}

/// The kernel that measures the memory read rate reads every word once: its XOR of random
/// buffers, one word to several million (not a multiple of its grid's threads), is the host's;
/// the kernel that fills its buffer writes the pattern the host computes.
#[test]
fn stream_read_xor_reads_every_word() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(41);
    for words in [1usize, 1000, 3_000_017] {
        let host: Vec<u32> = (0..4 * words).map(|_| rng.random()).collect();
        let mut expected = [0u32; 4];
        for (i, w) in host.iter().enumerate() {
            expected[i % 4] ^= w;
        }
        assert_eq!(cuda::xor_words(&gpu, &gpu.upload(&host)?)?, expected, "{words} words");
    }
    // The read-rate buffer, written on the device: the host's pattern, word for word.
    for words in [0usize, 5, 1_000_003] {
        let pattern = gpu.download(&cuda::word_pattern(&gpu, words)?)?;
        let want: Vec<u32> = (0..words).map(|i| (i as u32).wrapping_mul(0x9e37_79b9) | 1).collect();
        assert!(pattern == want, "word_pattern({words})");
    }
    let rate = cuda::read_rate(&gpu, 64 << 20, 2)?;
    eprintln!("read rate over 64 MiB: {:.0} GB/s", rate / 1e9);
    assert!(rate.is_finite() && rate > 1e9, "read rate {rate} B/s");
    Ok(())
}

#[test]
fn gather_rows_picks_rows() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(8);
    let (rows, width) = (50, 333);
    let src = random_vec(&mut rng, rows * width, 1.0);
    let indices = [49u32, 0, 7, 7, 23];
    let idx_dev = gpu.upload(&indices)?;
    for (dtype, _) in DTYPES {
        let (src_dev, src_r) = upload(&gpu, &src, dtype)?;
        let mut dst = nan_tensor(&gpu, dtype, indices.len() * width)?;
        cuda::gather_rows(&gpu, src_dev.view(), width, &idx_dev, dst.view_mut())?;
        let want: Vec<f32> = indices.iter().flat_map(|&r| src_r[r as usize * width..][..width].to_vec()).collect();
        assert_eq!(dst.to_f32_vec(&gpu)?, want, "{dtype:?}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// RoPE

fn inv_freq(rotary_dim: usize, theta: f32) -> Vec<f32> {
    (0..rotary_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f32 / rotary_dim as f32)).collect()
}

#[test]
fn rope_matches_cpu_for_full_partial_and_long_tables() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(9);
    // (tokens, heads, head_dim, rotary_dim, attention_scaling, long_start)
    let cases = [
        (3, 2, 8, 8, 1.0, None),
        (5, 3, 64, 32, 1.0, None),
        (4, 2, 16, 6, 1.25, None),
        (70, 8, 64, 64, 0.9, None),
        (33, 4, 128, 128, 1.0, None),
        (31, 8, 128, 64, 1.1, Some(600)),
    ];
    for (tokens, heads, dim, rotary, scaling, long_start) in cases {
        // Positions far into a long context, out of order, as a batch of requests has them.
        let mut positions: Vec<u32> = (0..tokens as u32).map(|t| t * 37 + 5).collect();
        positions.shuffle(&mut rng);
        positions[0] = 40_000;
        let short = inv_freq(rotary, 10000.0);
        let long: Vec<f32> = short.iter().map(|f| f * 0.5).collect();
        let table = GpuRopeTable::new(&gpu, &short, long_start.map(|s| (s, long.as_slice())), scaling)?;
        assert_eq!(table.rotary_dim(), rotary);
        let pos_dev = gpu.upload(&positions)?;
        let x = random_vec(&mut rng, tokens * heads * dim, 2.0);
        for (dtype, tol) in DTYPES {
            let (mut x_dev, mut want) = upload(&gpu, &x, dtype)?;
            cuda::rope(&gpu, x_dev.view_mut(), &pos_dev, heads, dim, &table)?;
            // The CPU op takes one table: rotate token by token with the one its position picks.
            for (t, &p) in positions.iter().enumerate() {
                let freqs = if long_start.is_some_and(|s| p >= s) { &long } else { &short };
                cpu::rope(&mut want[t * heads * dim..][..heads * dim], &[p], heads, dim, freqs, scaling);
            }
            check(
                &format!("rope {dtype:?} {tokens}x{heads}x{dim} rotary {rotary}"),
                &x_dev.to_f32_vec(&gpu)?,
                &want,
                tol,
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// KV cache and attention

#[test]
fn reshape_and_cache_writes_slots_and_skips_padding() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(10);
    let (kv_width, num_slots) = (2 * 128, 64);
    let slots: [i64; 7] = [17, -1, 0, 63, -1, 5, 40];
    let slots_dev = gpu.upload(&slots)?;
    let k = random_vec(&mut rng, slots.len() * kv_width, 1.0);
    let v = random_vec(&mut rng, slots.len() * kv_width, 1.0);
    for (dtype, _) in DTYPES {
        let (k_dev, k_r) = upload(&gpu, &k, dtype)?;
        let (v_dev, v_r) = upload(&gpu, &v, dtype)?;
        // Sentinels show which slots were written.
        let (mut kc_dev, mut kc) = upload(&gpu, &vec![-5.0; num_slots * kv_width], dtype)?;
        let (mut vc_dev, mut vc) = upload(&gpu, &vec![-6.0; num_slots * kv_width], dtype)?;
        cuda::reshape_and_cache(
            &gpu,
            k_dev.view(),
            v_dev.view(),
            &slots_dev,
            kv_width,
            kc_dev.view_mut(),
            vc_dev.view_mut(),
        )?;
        cpu::reshape_and_cache(&k_r, &v_r, &slots, kv_width, &mut kc, &mut vc);
        assert_eq!(kc_dev.to_f32_vec(&gpu)?, kc, "{dtype:?} k cache");
        assert_eq!(vc_dev.to_f32_vec(&gpu)?, vc, "{dtype:?} v cache");
    }
    Ok(())
}

/// The fused attention input step gives the bits of split_qkv, rope on q and k and
/// reshape_and_cache run one after another, padding slots included.
/// The attention block's input step op by op, as the fused kernels are checked against: split,
/// the q/k norms if any, `rope` on q and k, `reshape_and_cache` into caches of `num_slots`
/// slots filled with -5 (K) and -6 (V). Returns q and the two caches.
fn unfused_attention_input(
    gpu: &Gpu,
    qkv: &GpuTensor,
    rows: &QkvRows<'_, CudaSlice<u32>, CudaSlice<i64>>,
    norms: Option<QkNorms<'_>>,
    num_slots: usize,
) -> Result<(GpuTensor, GpuTensor, GpuTensor), GpuError> {
    let Heads { num_heads, num_kv_heads, head_dim } = rows.heads;
    let tokens = rows.positions.len();
    let (q_size, kv_size, dtype) = (num_heads * head_dim, num_kv_heads * head_dim, qkv.dtype());
    let (mut q, mut k, mut v) = (
        nan_tensor(gpu, dtype, tokens * q_size)?,
        nan_tensor(gpu, dtype, tokens * kv_size)?,
        nan_tensor(gpu, dtype, tokens * kv_size)?,
    );
    cuda::split_qkv(gpu, qkv.view(), q_size, kv_size, q.view_mut(), k.view_mut(), v.view_mut())?;
    if let Some(n) = norms {
        cuda::rms_norm_inplace(gpu, q.view_mut(), n.q, n.eps)?;
        cuda::rms_norm_inplace(gpu, k.view_mut(), n.k, n.eps)?;
    }
    cuda::rope(gpu, q.view_mut(), rows.positions, num_heads, head_dim, rows.table)?;
    cuda::rope(gpu, k.view_mut(), rows.positions, num_kv_heads, head_dim, rows.table)?;
    let mut k_cache = GpuTensor::from_f32(gpu, &vec![-5.0; num_slots * kv_size], dtype)?;
    let mut v_cache = GpuTensor::from_f32(gpu, &vec![-6.0; num_slots * kv_size], dtype)?;
    let slots = rows.slot_mapping;
    cuda::reshape_and_cache(gpu, k.view(), v.view(), slots, kv_size, k_cache.view_mut(), v_cache.view_mut())?;
    Ok((q, k_cache, v_cache))
}

/// Positions and cache slots of a step of `tokens` rows: positions 11, 64, 117, ..., slots
/// shuffled over a cache of `3 * tokens + 2`, every third row from the second on padding (slot
/// -1). Returns the cache's slot count too.
fn step_rows(rng: &mut ChaCha8Rng, tokens: usize) -> (Vec<u32>, Vec<i64>, usize) {
    let num_slots = 3 * tokens + 2;
    let mut slot_pool: Vec<i64> = (0..num_slots as i64).collect();
    slot_pool.shuffle(rng);
    let slots = (0..tokens).map(|t| if t % 3 == 1 { -1 } else { slot_pool[t] }).collect();
    let positions = (0..tokens as u32).map(|t| t * 53 + 11).collect();
    (positions, slots, num_slots)
}

/// Views of a q buffer and two caches as a step's outputs.
fn qkv_out<'a>(q: &'a mut GpuTensor, k_cache: &'a mut GpuTensor, v_cache: &'a mut GpuTensor) -> QkvOut<'a> {
    QkvOut { q: q.view_mut(), k_cache: k_cache.view_mut(), v_cache: v_cache.view_mut() }
}

#[test]
fn qkv_rope_cache_equals_the_ops_it_fuses() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(21);
    // (tokens, heads, kv_heads, head_dim, rotary_dim, long_start)
    // A few tokens spread each token over several blocks (1 x 8B's shape: 28), 64 and more take
    // one block per token.
    let cases = [
        (1, 4, 1, 8, 8, None),
        (7, 6, 2, 64, 32, None),
        (33, 32, 8, 128, 128, Some(500)),
        (5, 2, 2, 80, 0, None),
        (1, 32, 8, 128, 128, None),
        (70, 8, 2, 64, 64, Some(1000)),
    ];
    for (tokens, heads, kv_heads, dim, rotary, long_start) in cases {
        let (q_size, kv_size) = (heads * dim, kv_heads * dim);
        let (positions, slots, num_slots) = step_rows(&mut rng, tokens);
        let short = inv_freq(rotary, 10000.0);
        let long: Vec<f32> = short.iter().map(|f| f * 0.25).collect();
        let table = GpuRopeTable::new(&gpu, &short, long_start.map(|s| (s, long.as_slice())), 1.1)?;
        let (pos_dev, slots_dev) = (gpu.upload(&positions)?, gpu.upload(&slots)?);
        let qkv = random_vec(&mut rng, tokens * (q_size + 2 * kv_size), 2.0);
        for (dtype, _) in DTYPES {
            let what = format!("qkv_rope_cache {dtype:?} {tokens}x({heads}+2x{kv_heads})x{dim} rotary {rotary}");
            let qkv_dev = GpuTensor::from_f32(&gpu, &qkv, dtype)?;
            let sentinel = |v: f32| GpuTensor::from_f32(&gpu, &vec![v; num_slots * kv_size], dtype);
            let heads_of = Heads { num_heads: heads, num_kv_heads: kv_heads, head_dim: dim };
            let rows = QkvRows { positions: &pos_dev, slot_mapping: &slots_dev, heads: heads_of, table: &table };
            let (q, kc_want, vc_want) = unfused_attention_input(&gpu, &qkv_dev, &rows, None, num_slots)?;
            // Fused.
            let mut q_got = nan_tensor(&gpu, dtype, tokens * q_size)?;
            let (mut kc_got, mut vc_got) = (sentinel(-5.0)?, sentinel(-6.0)?);
            cuda::qkv_rope_cache(&gpu, qkv_dev.view(), &rows, qkv_out(&mut q_got, &mut kc_got, &mut vc_got))?;
            let bits = |t: &GpuTensor| -> Result<Vec<u32>, GpuError> {
                Ok(t.to_f32_vec(&gpu)?.iter().map(|x| x.to_bits()).collect())
            };
            assert_eq!(bits(&q_got)?, bits(&q)?, "{what}: q");
            assert_eq!(bits(&kc_got)?, bits(&kc_want)?, "{what}: k cache");
            assert_eq!(bits(&vc_got)?, bits(&vc_want)?, "{what}: v cache");
        }
    }
    Ok(())
}

/// The q/k-norm form against split, `rms_norm_inplace` on q and k, `rope` on both and
/// `reshape_and_cache`: every head size it is compiled for, with padding slots, the long RoPE
/// table, and a batch of one token. Within each dtype's tolerance: the sums of squares are
/// added in another order, so a bf16 rounding may differ; v and the slots not written are equal.
#[test]
fn qkv_norm_rope_cache_equals_the_ops_it_fuses() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(22);
    // (tokens, heads, kv_heads, head_dim, long_start): Qwen3's 32 + 2 x 4 of 128, Gemma 3 1B's
    // 4 + 2 x 1 of 256.
    let cases = [(1, 32, 4, 128, None), (7, 4, 1, 256, Some(200)), (70, 8, 2, 64, None), (3, 6, 3, 128, None)];
    for (tokens, heads, kv_heads, dim, long_start) in cases {
        let (q_size, kv_size) = (heads * dim, kv_heads * dim);
        let (positions, slots, num_slots) = step_rows(&mut rng, tokens);
        let short = inv_freq(dim, 10000.0);
        let long: Vec<f32> = short.iter().map(|f| f * 0.25).collect();
        let table = GpuRopeTable::new(&gpu, &short, long_start.map(|s| (s, long.as_slice())), 1.0)?;
        let (pos_dev, slots_dev) = (gpu.upload(&positions)?, gpu.upload(&slots)?);
        let qkv = random_vec(&mut rng, tokens * (q_size + 2 * kv_size), 2.0);
        let q_w = GpuTensor::from_f32(&gpu, &random_vec(&mut rng, dim, 1.5), DType::F32)?;
        let k_w = GpuTensor::from_f32(&gpu, &random_vec(&mut rng, dim, 1.5), DType::F32)?;
        let eps = 1e-6;
        for (dtype, tol) in DTYPES {
            let what = format!("qkv_norm_rope_cache {dtype:?} {tokens}x({heads}+2x{kv_heads})x{dim}");
            let qkv_dev = GpuTensor::from_f32(&gpu, &qkv, dtype)?;
            let sentinel = |v: f32| GpuTensor::from_f32(&gpu, &vec![v; num_slots * kv_size], dtype);
            let heads_of = Heads { num_heads: heads, num_kv_heads: kv_heads, head_dim: dim };
            let rows = QkvRows { positions: &pos_dev, slot_mapping: &slots_dev, heads: heads_of, table: &table };
            let norms = QkNorms { q: q_w.view(), k: k_w.view(), eps };
            let (q, kc_want, vc_want) = unfused_attention_input(&gpu, &qkv_dev, &rows, Some(norms), num_slots)?;
            // Fused.
            let mut q_got = nan_tensor(&gpu, dtype, tokens * q_size)?;
            let (mut kc_got, mut vc_got) = (sentinel(-5.0)?, sentinel(-6.0)?);
            assert!(cuda::qkv_norm_rope_cache_fits(dim, &table), "{what}: fits");
            let out = qkv_out(&mut q_got, &mut kc_got, &mut vc_got);
            cuda::qkv_norm_rope_cache(&gpu, qkv_dev.view(), &rows, norms, out)?;
            check(&format!("{what}: q"), &q_got.to_f32_vec(&gpu)?, &q.to_f32_vec(&gpu)?, tol);
            check(&format!("{what}: k cache"), &kc_got.to_f32_vec(&gpu)?, &kc_want.to_f32_vec(&gpu)?, tol);
            assert_eq!(vc_got.to_f32_vec(&gpu)?, vc_want.to_f32_vec(&gpu)?, "{what}: v cache");
        }
    }
    Ok(())
}

#[test]
fn linear_qkv_rope_cache_equals_linear_then_qkv_rope_cache() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(22);
    // (heads, kv_heads, head_dim, rotary_dim, k): 4, 2 and 1 rotary pairs per GEMV block (k
    // splits of 1, 2 and 4 warps), a head size that is no power of two, and a partial rotary
    // dimension (which takes the unfused path, as do 5 rows).
    let shapes = [
        (32, 8, 128, 128, 512),
        (8, 2, 64, 64, 1024),
        (4, 1, 64, 64, 16384),
        (6, 2, 80, 80, 8192),
        (4, 2, 64, 32, 256),
    ];
    for (heads, kv_heads, dim, rotary, k) in shapes {
        let (q_size, kv_size) = (heads * dim, kv_heads * dim);
        let n = q_size + 2 * kv_size;
        let w = random_vec(&mut rng, n * k, 0.1);
        let short = inv_freq(rotary, 10000.0);
        let long: Vec<f32> = short.iter().map(|f| f * 0.25).collect();
        let table = GpuRopeTable::new(&gpu, &short, Some((60, long.as_slice())), 1.1)?;
        for m in 1..=cuda::GEMV_MAX_M + 1 {
            let (positions, slots, num_slots) = step_rows(&mut rng, m);
            let (pos_dev, slots_dev) = (gpu.upload(&positions)?, gpu.upload(&slots)?);
            let x = random_vec(&mut rng, m * k, 1.0);
            for (dtype, _) in DTYPES {
                let what =
                    format!("linear_qkv_rope_cache {dtype:?} m={m} ({heads}+2x{kv_heads})x{dim} k={k} rotary {rotary}");
                let (x_dev, _) = upload(&gpu, &x, dtype)?;
                let (w_dev, _) = upload(&gpu, &w, dtype)?;
                let sentinel = |v: f32| GpuTensor::from_f32(&gpu, &vec![v; num_slots * kv_size], dtype);
                // Unfused.
                let mut qkv = nan_tensor(&gpu, dtype, m * n)?;
                cuda::linear(&gpu, &gemms, x_dev.view(), m, k, w_dev.view(), n, None, qkv.view_mut())?;
                let mut q_want = nan_tensor(&gpu, dtype, m * q_size)?;
                let (mut kc_want, mut vc_want) = (sentinel(-5.0)?, sentinel(-6.0)?);
                let heads_of = Heads { num_heads: heads, num_kv_heads: kv_heads, head_dim: dim };
                let rows = QkvRows { positions: &pos_dev, slot_mapping: &slots_dev, heads: heads_of, table: &table };
                cuda::qkv_rope_cache(&gpu, qkv.view(), &rows, qkv_out(&mut q_want, &mut kc_want, &mut vc_want))?;
                // Fused (or its fallback).
                let mut scratch = nan_tensor(&gpu, dtype, m * n)?;
                let mut q_got = nan_tensor(&gpu, dtype, m * q_size)?;
                let (mut kc_got, mut vc_got) = (sentinel(-5.0)?, sentinel(-6.0)?);
                let out = qkv_out(&mut q_got, &mut kc_got, &mut vc_got);
                cuda::linear_qkv_rope_cache(&gpu, &gemms, x_dev.view(), w_dev.view(), &rows, scratch.view_mut(), out)?;
                let bits = |t: &GpuTensor| -> Result<Vec<u32>, GpuError> {
                    Ok(t.to_f32_vec(&gpu)?.iter().map(|x| x.to_bits()).collect())
                };
                assert_eq!(bits(&q_got)?, bits(&q_want)?, "{what}: q");
                assert_eq!(bits(&kc_got)?, bits(&kc_want)?, "{what}: k cache");
                assert_eq!(bits(&vc_got)?, bits(&vc_want)?, "{what}: v cache");
            }
        }
    }
    Ok(())
}

/// `linear_fp8_qkv_rope_cache` (the tensor-core FP8 GEMV with the rotation and cache write in
/// its epilogue) gives the bits of `linear_fp8` into qkv followed by `qkv_rope_cache`, over
/// every scale layout, head sizes 128, 64 and 80 (8, 4 and 5 tiles of 8 pairs a head), k splits
/// of 1, 4 and 8 warps, k with a partial chunk, chunks left over after the rounds and a grid
/// with tiles past the last; the fit declines f32 activations, a partial rotary dimension and
/// blocks of 16 columns.
#[test]
fn linear_fp8_qkv_rope_cache_equals_linear_fp8_then_qkv_rope_cache() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(24);
    // (heads, kv_heads, head_dim, k)
    let shapes = [(32, 8, 128, 4096), (8, 2, 64, 1040), (6, 2, 80, 8192), (4, 1, 64, 128), (6, 2, 80, 384)];
    for (heads, kv_heads, dim, k) in shapes {
        let (q_size, kv_size) = (heads * dim, kv_heads * dim);
        let n = q_size + 2 * kv_size;
        let short = inv_freq(dim, 10000.0);
        let long: Vec<f32> = short.iter().map(|f| f * 0.25).collect();
        let table = GpuRopeTable::new(&gpu, &short, Some((60, long.as_slice())), 1.1)?;
        let heads_of = Heads { num_heads: heads, num_kv_heads: kv_heads, head_dim: dim };
        for (layout, w) in fp8_layouts(&mut rng, n, k) {
            let w_dev = GpuFp8Matrix::new(&gpu, &w)?.expect("the kernels take every layout under test");
            for m in 1..=cuda::GEMV_MAX_M {
                let (positions, slots, num_slots) = step_rows(&mut rng, m);
                let (pos_dev, slots_dev) = (gpu.upload(&positions)?, gpu.upload(&slots)?);
                let x = random_vec(&mut rng, m * k, 1.0);
                for (dtype, _) in DTYPES {
                    let what = format!(
                        "linear_fp8_qkv_rope_cache {layout} {dtype:?} m={m} ({heads}+2x{kv_heads})x{dim} k={k}"
                    );
                    let (x_dev, _) = upload(&gpu, &x, dtype)?;
                    let fits = cuda::fp8_qkv_rope_cache_fits(x_dev.view(), m, w_dev.view(), heads_of, &table);
                    assert_eq!(fits, dtype != DType::F32 && layout != "stacked", "{what}: fits");
                    if !fits {
                        continue;
                    }
                    let sentinel = |v: f32| GpuTensor::from_f32(&gpu, &vec![v; num_slots * kv_size], dtype);
                    let rows =
                        QkvRows { positions: &pos_dev, slot_mapping: &slots_dev, heads: heads_of, table: &table };
                    // Unfused.
                    let mut qkv = nan_tensor(&gpu, dtype, m * n)?;
                    let mut scratch = GpuTensor::uninit(&gpu, dtype, 16)?;
                    let (x_view, w_view) = (x_dev.view(), w_dev.view());
                    cuda::linear_fp8(&gpu, &gemms, x_view, m, w_view, n, None, qkv.view_mut(), &mut scratch, None)?;
                    let mut q_want = nan_tensor(&gpu, dtype, m * q_size)?;
                    let (mut kc_want, mut vc_want) = (sentinel(-5.0)?, sentinel(-6.0)?);
                    cuda::qkv_rope_cache(&gpu, qkv.view(), &rows, qkv_out(&mut q_want, &mut kc_want, &mut vc_want))?;
                    // Fused.
                    let mut q_got = nan_tensor(&gpu, dtype, m * q_size)?;
                    let (mut kc_got, mut vc_got) = (sentinel(-5.0)?, sentinel(-6.0)?);
                    let out = qkv_out(&mut q_got, &mut kc_got, &mut vc_got);
                    cuda::linear_fp8_qkv_rope_cache(&gpu, x_view, w_view, &rows, out)?;
                    let bits = |t: &GpuTensor| -> Result<Vec<u32>, GpuError> {
                        Ok(t.to_f32_vec(&gpu)?.iter().map(|x| x.to_bits()).collect())
                    };
                    assert_eq!(bits(&q_got)?, bits(&q_want)?, "{what}: q");
                    assert_eq!(bits(&kc_got)?, bits(&kc_want)?, "{what}: k cache");
                    assert_eq!(bits(&vc_got)?, bits(&vc_want)?, "{what}: v cache");
                }
            }
        }
        // A partial rotary dimension takes the unfused path.
        let partial = GpuRopeTable::new(&gpu, &inv_freq(dim / 2, 10000.0), None, 1.0)?;
        let scales = (0..n).map(|_| rng.random_range(0.5f32..2.0) / 448.0).collect();
        let w = GpuFp8Matrix::new(&gpu, &random_fp8(&mut rng, n, k, Fp8Scales::Rows(scales)))?.expect("row scales");
        let x = GpuTensor::from_f32(&gpu, &random_vec(&mut rng, k, 1.0), DType::BF16)?;
        assert!(!cuda::fp8_qkv_rope_cache_fits(x.view(), 1, w.view(), heads_of, &partial), "partial rotary: fits");
    }
    Ok(())
}

/// A flattened batch laid out in a paged cache, on the host (values as stored in `dtype`).
struct Batch {
    /// `[T, num_heads * head_dim]`
    q: Vec<f32>,
    /// `[num_blocks * block_size, kv_width]`; slots no request owns are NaN.
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    query_start_loc: Vec<u32>,
    seq_lens: Vec<u32>,
    block_tables: Vec<u32>,
    max_blocks_per_seq: usize,
    max_query_len: usize,
}

impl Batch {
    /// Requests of `(seq_len, q_len)` with random K/V scattered over shuffled blocks.
    fn random(
        rng: &mut ChaCha8Rng,
        heads: Heads,
        requests: &[(usize, usize)],
        block_size: usize,
        dtype: DType,
    ) -> Batch {
        let kv_width = heads.num_kv_heads * heads.head_dim;
        let blocks_per_req: Vec<usize> = requests.iter().map(|&(s, _)| s.div_ceil(block_size)).collect();
        let max_blocks_per_seq = blocks_per_req.iter().max().copied().unwrap_or(0) + 1;
        let num_blocks = blocks_per_req.iter().sum::<usize>() + 5;
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        free.shuffle(rng);
        let mut block_tables = vec![0u32; requests.len() * max_blocks_per_seq];
        let mut k_cache = vec![f32::NAN; num_blocks * block_size * kv_width];
        let mut v_cache = vec![f32::NAN; num_blocks * block_size * kv_width];
        let (mut query_start_loc, mut seq_lens, mut q) = (vec![0u32], Vec::new(), Vec::new());
        for (r, &(seq_len, q_len)) in requests.iter().enumerate() {
            let table = &mut block_tables[r * max_blocks_per_seq..][..blocks_per_req[r]];
            for entry in table.iter_mut() {
                *entry = free.pop().expect("enough blocks");
            }
            let slots: Vec<i64> =
                (0..seq_len).map(|j| (table[j / block_size] as usize * block_size + j % block_size) as i64).collect();
            let k = rounded(&random_vec(rng, seq_len * kv_width, 1.0), dtype);
            let v = rounded(&random_vec(rng, seq_len * kv_width, 1.0), dtype);
            cpu::reshape_and_cache(&k, &v, &slots, kv_width, &mut k_cache, &mut v_cache);
            query_start_loc.push(query_start_loc[r] + q_len as u32);
            seq_lens.push(seq_len as u32);
            q.extend(rounded(&random_vec(rng, q_len * heads.num_heads * heads.head_dim, 1.5), dtype));
        }
        let max_query_len = requests.iter().map(|&(_, q)| q).max().unwrap_or(0);
        Batch { q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_blocks_per_seq, max_query_len }
    }

    /// The same batch with block tables `width` entries wide (at least its own), the extra
    /// entries 0: as a CUDA graph pads them for the longest context it may replay.
    fn widened(mut self, width: usize) -> Batch {
        assert!(width >= self.max_blocks_per_seq);
        let old = self.max_blocks_per_seq;
        self.block_tables = self
            .block_tables
            .chunks_exact(old)
            .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0, width - old)))
            .collect();
        self.max_blocks_per_seq = width;
        self
    }
}

/// The kernel `PagedAttention::run` picks.
const PICKED: AttentionKernel = AttentionKernel::Picked;

/// Runs the CPU op and the GPU op on `kernel` on `batch` and compares; `max_query_len`
/// overrides the batch's own hint.
#[allow(clippy::too_many_arguments)]
fn compare_attention(
    kernel: AttentionKernel,
    gpu: &Gpu,
    batch: &Batch,
    heads: Heads,
    block_size: usize,
    window: Option<usize>,
    dtype: DType,
    tol: f32,
    max_query_len: usize,
) -> Result<f32, GpuError> {
    let want = cpu_attention(batch, heads, block_size, window, None);
    let got = gpu_attention(kernel, gpu, batch, heads, block_size, window, dtype, max_query_len)?;
    let what = format!("paged_attention {dtype:?} {heads:?} window {window:?} max_query_len {max_query_len}");
    Ok(check(&what, &got, &want, tol))
}

/// The CPU op on `batch` (scale `1 / sqrt(head_dim)`), scores soft-capped at `softcap`.
fn cpu_attention(
    batch: &Batch,
    heads: Heads,
    block_size: usize,
    window: Option<usize>,
    softcap: Option<f32>,
) -> Vec<f32> {
    let (kc, vc) = (cpu::KvView::F32(&batch.k_cache), cpu::KvView::F32(&batch.v_cache));
    cpu_attention_over(batch, heads, block_size, window, softcap, kc, vc)
}

/// [`cpu_attention`] over caches `kc` and `vc` in place of the batch's own.
fn cpu_attention_over(
    batch: &Batch,
    heads: Heads,
    block_size: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    kc: cpu::KvView<'_>,
    vc: cpu::KvView<'_>,
) -> Vec<f32> {
    let meta = cpu::AttentionMetadata {
        query_start_loc: &batch.query_start_loc,
        seq_lens: &batch.seq_lens,
        block_tables: &batch.block_tables,
        max_blocks_per_seq: batch.max_blocks_per_seq,
        block_size,
        sliding_window: window,
        scale: 1.0 / (heads.head_dim as f32).sqrt(),
        softcap,
    };
    let mut out = vec![0.0; batch.q.len()];
    let (h, kv, d) = (heads.num_heads, heads.num_kv_heads, heads.head_dim);
    cpu::paged_attention(&batch.q, kc, vc, &meta, h, kv, d, &mut out);
    out
}

/// A batch's index buffers on the device.
struct BatchIndices {
    query_start_loc: CudaSlice<u32>,
    seq_lens: CudaSlice<u32>,
    block_tables: CudaSlice<u32>,
}

impl BatchIndices {
    fn upload(gpu: &Gpu, batch: &Batch) -> Result<BatchIndices, GpuError> {
        Ok(BatchIndices {
            query_start_loc: gpu.upload(&batch.query_start_loc)?,
            seq_lens: gpu.upload(&batch.seq_lens)?,
            block_tables: gpu.upload(&batch.block_tables)?,
        })
    }

    /// The GPU op's metadata of `batch` (scale `1 / sqrt(head_dim)`).
    #[allow(clippy::too_many_arguments)]
    fn meta<'a>(
        &'a self,
        batch: &'a Batch,
        heads: Heads,
        block_size: usize,
        window: Option<usize>,
        softcap: Option<f32>,
        max_query_len: usize,
        work: &'a cuda::AttentionWork,
    ) -> GpuAttentionMetadata<'a> {
        GpuAttentionMetadata {
            query_start_loc: self.query_start_loc.as_view(),
            query_start_loc_host: &batch.query_start_loc,
            seq_lens: self.seq_lens.as_view(),
            block_tables: self.block_tables.as_view(),
            max_blocks_per_seq: batch.max_blocks_per_seq,
            max_query_len,
            block_size,
            sliding_window: window,
            scale: 1.0 / (heads.head_dim as f32).sqrt(),
            softcap,
            work,
        }
    }
}

/// The GPU op on `kernel` on `batch`, its output as f32.
#[allow(clippy::too_many_arguments)]
fn gpu_attention(
    kernel: AttentionKernel,
    gpu: &Gpu,
    batch: &Batch,
    heads: Heads,
    block_size: usize,
    window: Option<usize>,
    dtype: DType,
    max_query_len: usize,
) -> Result<Vec<f32>, GpuError> {
    gpu_attention_capped(kernel, gpu, batch, heads, block_size, window, None, dtype, max_query_len)
}

/// [`gpu_attention`] with the scores soft-capped at `softcap`.
#[allow(clippy::too_many_arguments)]
fn gpu_attention_capped(
    kernel: AttentionKernel,
    gpu: &Gpu,
    batch: &Batch,
    heads: Heads,
    block_size: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    dtype: DType,
    max_query_len: usize,
) -> Result<Vec<f32>, GpuError> {
    let (indices, work) = (BatchIndices::upload(gpu, batch)?, Default::default());
    let gpu_meta = indices.meta(batch, heads, block_size, window, softcap, max_query_len, &work);
    let q = GpuTensor::from_f32(gpu, &batch.q, dtype)?;
    let k_cache = GpuTensor::from_f32(gpu, &batch.k_cache, dtype)?;
    let v_cache = GpuTensor::from_f32(gpu, &batch.v_cache, dtype)?;
    let mut out = nan_tensor(gpu, dtype, batch.q.len())?;
    let attention = PagedAttention::new(gpu)?;
    attention.run_on(kernel, gpu, q.view(), k_cache.view(), v_cache.view(), &gpu_meta, heads, out.view_mut())?;
    out.to_f32_vec(gpu)
}

/// A prefill chunk after 263 cached tokens, a request with no rows this step, a first token, a
/// whole prefill, a deep decode, a chunk that ends a block, and a decode one past a block edge:
/// 92 query rows over contexts from 1 to 1000.
const MIXED: [(usize, usize); 8] = [(300, 37), (40, 0), (1, 1), (19, 19), (1000, 1), (64, 33), (17, 1), (5, 1)];
/// A step's decodes first, as the scheduler orders them, then prompts (and a decode among them).
const DECODES_FIRST: [(usize, usize); 6] = [(1000, 1), (17, 1), (1, 1), (300, 37), (5, 1), (64, 33)];
/// Decodes only, at depths on and off block edges.
const DECODES: [(usize, usize); 7] = [(1, 1), (16, 1), (17, 1), (100, 1), (1000, 1), (333, 1), (2, 1)];

#[test]
fn paged_attention_matches_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(11);
    let head_configs = [
        Heads { num_heads: 4, num_kv_heads: 4, head_dim: 64 },
        Heads { num_heads: 8, num_kv_heads: 2, head_dim: 128 },
        Heads { num_heads: 16, num_kv_heads: 2, head_dim: 128 },
        Heads { num_heads: 8, num_kv_heads: 1, head_dim: 64 },
        // More query heads per KV head than one decode block takes.
        Heads { num_heads: 32, num_kv_heads: 1, head_dim: 128 },
        Heads { num_heads: 6, num_kv_heads: 3, head_dim: 80 },
        Heads { num_heads: 4, num_kv_heads: 2, head_dim: 256 },
    ];
    let block_size = 16;
    let mut worst = [0.0f32; 3];
    for heads in head_configs {
        for window in [None, Some(50), Some(1)] {
            for (d, (dtype, tol)) in DTYPES.into_iter().enumerate() {
                let mixed = Batch::random(&mut rng, heads, &MIXED, block_size, dtype);
                let err = compare_attention(
                    PICKED,
                    &gpu,
                    &mixed,
                    heads,
                    block_size,
                    window,
                    dtype,
                    tol,
                    mixed.max_query_len,
                )?;
                worst[d] = worst[d].max(err);
                let decodes = Batch::random(&mut rng, heads, &DECODES, block_size, dtype);
                let err = compare_attention(PICKED, &gpu, &decodes, heads, block_size, window, dtype, tol, 1)?;
                worst[d] = worst[d].max(err);
            }
        }
    }
    // The work split must not change results: a mixed batch under the decode split.
    let heads = Heads { num_heads: 8, num_kv_heads: 2, head_dim: 128 };
    let mixed = Batch::random(&mut rng, heads, &MIXED, block_size, DType::F32);
    compare_attention(PICKED, &gpu, &mixed, heads, block_size, None, DType::F32, 1e-4, 1)?;
    eprintln!("paged_attention max relative error: f32 {:e}, bf16 {:e}, f16 {:e}", worst[0], worst[1], worst[2]);
    Ok(())
}

#[test]
fn paged_attention_long_prefill() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(12);
    let heads = Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 };
    // A 1500-token prefill chunk after 500 cached tokens, next to two decodes.
    let requests = [(2000, 1500), (700, 1), (1, 1)];
    for (dtype, tol) in DTYPES {
        let batch = Batch::random(&mut rng, heads, &requests, 16, dtype);
        for window in [None, Some(777)] {
            compare_attention(PICKED, &gpu, &batch, heads, 16, window, dtype, tol, batch.max_query_len)?;
        }
    }
    Ok(())
}

/// Decode-only batches deep enough to split the context: a single sequence at depths that give
/// 1, 2 (one of them empty), 20 and about 95 partitions, 16 sequences of mixed depth, and 256
/// sequences (no split, several chunks per block).
#[test]
fn paged_attention_decode_splits_long_contexts() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(13);
    let configs = [
        // Llama-3.1-8B: 4 query heads per KV head.
        Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 },
        Heads { num_heads: 32, num_kv_heads: 4, head_dim: 128 },
        Heads { num_heads: 16, num_kv_heads: 2, head_dim: 64 },
    ];
    let depths = [1, 17, 600, 3000];
    let mut batches: Vec<Vec<(usize, usize)>> = depths.iter().map(|&d| vec![(d, 1)]).collect();
    batches.push((0..16).map(|i| (depths[i % 4] + i, 1)).collect());
    compare_decodes(&gpu, &mut rng, &configs, &batches, &[None, Some(50), Some(1000)], None)?;
    let heads = Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 };
    let requests: Vec<(usize, usize)> = (0..256).map(|i| ([1, 17, 100, 600][i % 4] + i % 7, 1)).collect();
    for (dtype, tol) in [DTYPES[0], DTYPES[1]] {
        let batch = Batch::random(&mut rng, heads, &requests, 16, dtype);
        compare_attention(PICKED, &gpu, &batch, heads, 16, None, dtype, tol, 1)?;
        compare_attention(PICKED, &gpu, &batch, heads, 16, Some(300), dtype, tol, 1)?;
    }
    // One sequence 3000 deep among 255 short ones.
    let mut requests: Vec<(usize, usize)> = (0..255).map(|i| (1 + i % 40, 1)).collect();
    requests.push((3000, 1));
    let batch = Batch::random(&mut rng, heads, &requests, 16, DType::BF16);
    compare_attention(PICKED, &gpu, &batch, heads, 16, None, DType::BF16, 1e-2, 1)?;
    Ok(())
}

/// Short decodes in block tables far wider than their contexts (8192 keys, as a graph pads
/// them): each row cuts its own context into the launch's partitions, whatever the width. Lone
/// sequences of 1, 17, 130 and 600 keys and four together, with and without windows, on the
/// CUDA-core kernel (head_dim 256, Gemma's; a single KV head) and the tensor-core one.
#[test]
fn paged_attention_decode_splits_short_contexts_in_wide_tables() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(18);
    let configs = [
        Heads { num_heads: 4, num_kv_heads: 1, head_dim: 256 },
        Heads { num_heads: 32, num_kv_heads: 4, head_dim: 128 },
        Heads { num_heads: 16, num_kv_heads: 8, head_dim: 256 },
    ];
    let depths = [1, 17, 130, 600];
    let mut batches: Vec<Vec<(usize, usize)>> = depths.iter().map(|&d| vec![(d, 1)]).collect();
    batches.push(depths.iter().map(|&d| (d, 1)).collect());
    compare_decodes(&gpu, &mut rng, &configs, &batches, &[None, Some(100), Some(512)], Some(8192 / 16))
}

/// Each batch of decodes on each head configuration, in every dtype and window, with 16-token
/// blocks and block tables `width` entries wide (their own width where `None`).
fn compare_decodes(
    gpu: &Gpu,
    rng: &mut ChaCha8Rng,
    configs: &[Heads],
    batches: &[Vec<(usize, usize)>],
    windows: &[Option<usize>],
    width: Option<usize>,
) -> Result<(), GpuError> {
    for &heads in configs {
        for (dtype, tol) in DTYPES {
            for requests in batches {
                let mut batch = Batch::random(rng, heads, requests, 16, dtype);
                if let Some(width) = width {
                    batch = batch.widened(width);
                }
                for &window in windows {
                    compare_attention(PICKED, gpu, &batch, heads, 16, window, dtype, tol, 1)?;
                }
            }
        }
    }
    Ok(())
}

/// Half-precision head configurations the tensor-core kernel takes: every head size it is
/// compiled for, and GQA groups of 1, 2, 3 (21 tokens per 64-row tile), 4, 6, 8 and 96 (two
/// head chunks per KV head).
const TENSOR_CORE_HEADS: [Heads; 8] = [
    Heads { num_heads: 4, num_kv_heads: 4, head_dim: 128 },
    Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 },
    Heads { num_heads: 16, num_kv_heads: 2, head_dim: 64 },
    Heads { num_heads: 6, num_kv_heads: 2, head_dim: 64 },
    Heads { num_heads: 12, num_kv_heads: 2, head_dim: 96 },
    Heads { num_heads: 8, num_kv_heads: 4, head_dim: 80 },
    Heads { num_heads: 8, num_kv_heads: 2, head_dim: 256 },
    Heads { num_heads: 96, num_kv_heads: 1, head_dim: 64 },
];

/// Prefill chunks and mixed batches in bf16 and f16, which take the tensor-core kernel: a
/// chunk 571 tokens into its context, a whole 100-token prompt, decodes at several depths, a
/// request with no rows, chunks of 64, 2 and 13 after cached tokens (lengths on and off the
/// tile sizes), with windows shorter than a chunk and block sizes other than 16 (5 is not a
/// power of two). Block ids are shuffled over the cache.
#[test]
fn paged_attention_tensor_core_prefill_and_mixed_batches() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(14);
    let requests = [(700, 129), (100, 100), (1, 1), (333, 1), (90, 0), (65, 64), (17, 2), (1000, 1), (47, 13)];
    let mut worst = [0.0f32; 2];
    for heads in TENSOR_CORE_HEADS {
        for (block_size, window) in [(16, None), (16, Some(37)), (8, Some(200)), (32, None), (5, Some(1))] {
            for (d, (dtype, tol)) in [DTYPES[1], DTYPES[2]].into_iter().enumerate() {
                let batch = Batch::random(&mut rng, heads, &requests, block_size, dtype);
                let err = compare_attention(
                    PICKED,
                    &gpu,
                    &batch,
                    heads,
                    block_size,
                    window,
                    dtype,
                    tol,
                    batch.max_query_len,
                )?;
                worst[d] = worst[d].max(err);
            }
        }
    }
    eprintln!("tensor-core paged_attention max relative error: bf16 {:e}, f16 {:e}", worst[0], worst[1]);
    Ok(())
}

/// Batches of decodes on the tensor-core prefill kernel (one work item per request, no list
/// uploaded), sent there by a hint above 1.
#[test]
fn paged_attention_tensor_core_decodes() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(15);
    for heads in TENSOR_CORE_HEADS {
        for (dtype, tol) in [DTYPES[1], DTYPES[2]] {
            let batch = Batch::random(&mut rng, heads, &DECODES, 16, dtype);
            for window in [None, Some(50)] {
                compare_attention(PICKED, &gpu, &batch, heads, 16, window, dtype, tol, 2)?;
            }
        }
    }
    Ok(())
}

/// A lone decode 3000 deep: its context split into partitions where the kernel splits.
const DEEP_DECODE: [(usize, usize); 1] = [(3000, 1)];

/// 300 decodes at depths from 1 to 400: too many to split.
fn many_decodes() -> Vec<(usize, usize)> {
    (0..300).map(|i| (1 + (i * 37) % 400, 1)).collect()
}

/// Batches of decodes in bf16 and f16, which take the tensor-core decode kernel: every head
/// size it is compiled for; GQA groups of 1, 3, 4, 7, 16 (a whole tile of rows) and 24 (a whole
/// and a partial head chunk); block sizes 16, 5 (not a power of two) and 32; windows; a lone
/// sequence 3000 deep (its context split into partitions, one shorter than a tile) and decodes
/// at depths on and off block and tile edges; and 300 sequences, too many to split.
#[test]
fn paged_attention_tensor_core_decode_kernel() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(17);
    let configs = [
        Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 },
        Heads { num_heads: 8, num_kv_heads: 8, head_dim: 128 },
        Heads { num_heads: 6, num_kv_heads: 2, head_dim: 64 },
        Heads { num_heads: 14, num_kv_heads: 2, head_dim: 64 },
        Heads { num_heads: 16, num_kv_heads: 1, head_dim: 96 },
        Heads { num_heads: 48, num_kv_heads: 2, head_dim: 80 },
    ];
    let edges = [(1, 1), (63, 1), (64, 1), (65, 1), (129, 1), (700, 1), (17, 1)];
    let (deep, many) = (DEEP_DECODE, many_decodes());
    let mut worst = [0.0f32; 2];
    for heads in configs {
        for (block_size, window) in [(16, None), (5, Some(100)), (32, Some(1))] {
            for (d, (dtype, tol)) in [DTYPES[1], DTYPES[2]].into_iter().enumerate() {
                for requests in [&deep[..], &edges[..], &many[..]] {
                    let batch = Batch::random(&mut rng, heads, requests, block_size, dtype);
                    let err = compare_attention(PICKED, &gpu, &batch, heads, block_size, window, dtype, tol, 1)?;
                    worst[d] = worst[d].max(err);
                }
            }
        }
    }
    eprintln!("tensor-core decode max relative error: bf16 {:e}, f16 {:e}", worst[0], worst[1]);
    Ok(())
}

/// The per-warp decode kernel in its tensor-copy form (sm_90: K/V tiles as boxes of the caches'
/// tensor maps, 128-byte swizzled) against the CPU, on the batches of the test above that it
/// takes (head sizes 64 and 128, block size 16, no window): a lone sequence 3000 deep, depths on
/// and off block edges (whose last blocks' unused rows hold NaN, as every slot no request owns
/// does), and 300 sequences. Where it does not apply the call is an error, not a fallback.
#[test]
fn paged_attention_tensor_copies_match_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(19);
    let heads = Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 };
    let edges = [(1, 1), (15, 1), (16, 1), (17, 1), (129, 1), (700, 1), (33, 1)];
    let batch = Batch::random(&mut rng, heads, &edges, 16, DType::BF16);
    let refused = |block_size, window| {
        matches!(
            compare_attention(
                AttentionKernel::TensorCopies,
                &gpu,
                &batch,
                heads,
                block_size,
                window,
                DType::BF16,
                1.0,
                1
            ),
            Err(GpuError::Unsupported { .. })
        )
    };
    if gpu.compute_capability().0 < 9 {
        assert!(refused(16, None), "tensor copies before sm_90");
        return Ok(());
    }
    // A window, or blocks that are not one tile, are refused.
    assert!(refused(16, Some(100)), "a sliding window");
    let wide = Batch::random(&mut rng, heads, &edges, 32, DType::BF16);
    let wide_refused =
        compare_attention(AttentionKernel::TensorCopies, &gpu, &wide, heads, 32, None, DType::BF16, 1.0, 1);
    assert!(matches!(wide_refused, Err(GpuError::Unsupported { .. })), "block size 32");

    // Block ids past the cache read as zeros, as on the kernel `paged_attention` picks: the
    // second block of each request that has one points past the cache (the last one, partly
    // filled, for the 17-token request).
    let mut past = Batch::random(&mut rng, heads, &edges, 16, DType::BF16);
    let num_blocks = past.k_cache.len() / (heads.num_kv_heads * heads.head_dim * 16);
    for (r, &(seq_len, _)) in edges.iter().enumerate() {
        if seq_len > 16 {
            past.block_tables[r * past.max_blocks_per_seq + 1] = (num_blocks + r) as u32;
        }
    }
    let picked = gpu_attention(PICKED, &gpu, &past, heads, 16, None, DType::BF16, 1)?;
    let tensor = gpu_attention(AttentionKernel::TensorCopies, &gpu, &past, heads, 16, None, DType::BF16, 1)?;
    check("tensor copies of block ids past the cache", &tensor, &picked, DTYPES[1].1);

    let configs = [
        Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 },
        Heads { num_heads: 8, num_kv_heads: 8, head_dim: 128 },
        Heads { num_heads: 6, num_kv_heads: 2, head_dim: 64 },
        Heads { num_heads: 14, num_kv_heads: 2, head_dim: 64 },
        Heads { num_heads: 24, num_kv_heads: 1, head_dim: 128 },
    ];
    let (deep, many) = (DEEP_DECODE, many_decodes());
    let mut worst = [0.0f32; 2];
    for heads in configs {
        for (d, (dtype, tol)) in [DTYPES[1], DTYPES[2]].into_iter().enumerate() {
            for requests in [&deep[..], &edges[..], &many[..]] {
                let batch = Batch::random(&mut rng, heads, requests, 16, dtype);
                let err =
                    compare_attention(AttentionKernel::TensorCopies, &gpu, &batch, heads, 16, None, dtype, tol, 1)?;
                worst[d] = worst[d].max(err);
            }
        }
    }
    eprintln!("tensor-copy decode max relative error: bf16 {:e}, f16 {:e}", worst[0], worst[1]);
    Ok(())
}

/// 2048-token prompts in the Llama-3.1-8B shape (bf16) and a smaller one (f16): whole, as a
/// chunk after 300 cached tokens next to a decode, and under a 1000-token window.
#[test]
fn paged_attention_tensor_core_long_prompts() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(16);
    let cases = [
        (Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 }, DTYPES[1]),
        (Heads { num_heads: 8, num_kv_heads: 1, head_dim: 64 }, DTYPES[2]),
    ];
    for (heads, (dtype, tol)) in cases {
        for requests in [vec![(2048, 2048)], vec![(2348, 2048), (900, 1)]] {
            let batch = Batch::random(&mut rng, heads, &requests, 16, dtype);
            for window in [None, Some(1000)] {
                compare_attention(PICKED, &gpu, &batch, heads, 16, window, dtype, tol, batch.max_query_len)?;
            }
        }
    }
    Ok(())
}

/// One step's metadata serves every layer: the work list built by the first call is reused by
/// the next, and a call with another GQA group (another tile shape) builds its own. The general
/// kernel, forced, agrees too.
#[test]
fn paged_attention_work_list_is_shared_by_a_steps_layers() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let attention = PagedAttention::new(&gpu)?;
    let requests = [(300, 37), (1, 1), (19, 19), (1000, 1), (64, 33)];
    let (block_size, dtype, tol) = (16, DType::BF16, 1e-2);
    let shapes = [
        Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 },
        Heads { num_heads: 32, num_kv_heads: 8, head_dim: 128 },
        Heads { num_heads: 8, num_kv_heads: 8, head_dim: 128 },
    ];
    // The same seed gives the same block tables whatever the head shape.
    let batches: Vec<Batch> =
        shapes.iter().map(|&h| Batch::random(&mut rng(17), h, &requests, block_size, dtype)).collect();
    let layout = &batches[0];
    let (qsl, lens, tables) =
        (gpu.upload(&layout.query_start_loc)?, gpu.upload(&layout.seq_lens)?, gpu.upload(&layout.block_tables)?);
    let scale = 1.0 / 128f32.sqrt();
    let meta = GpuAttentionMetadata {
        query_start_loc: qsl.as_view(),
        query_start_loc_host: &layout.query_start_loc,
        seq_lens: lens.as_view(),
        block_tables: tables.as_view(),
        max_blocks_per_seq: layout.max_blocks_per_seq,
        max_query_len: layout.max_query_len,
        block_size,
        sliding_window: None,
        scale,
        softcap: None,
        work: &Default::default(),
    };
    for (i, (heads, batch)) in shapes.iter().zip(&batches).enumerate() {
        assert_eq!(batch.block_tables, layout.block_tables);
        let cpu_meta = cpu::AttentionMetadata {
            query_start_loc: &batch.query_start_loc,
            seq_lens: &batch.seq_lens,
            block_tables: &batch.block_tables,
            max_blocks_per_seq: batch.max_blocks_per_seq,
            block_size,
            sliding_window: None,
            scale,
            softcap: None,
        };
        let mut want = vec![0.0; batch.q.len()];
        let (h, kv, d) = (heads.num_heads, heads.num_kv_heads, heads.head_dim);
        let (kc, vc) = (cpu::KvView::F32(&batch.k_cache), cpu::KvView::F32(&batch.v_cache));
        cpu::paged_attention(&batch.q, kc, vc, &cpu_meta, h, kv, d, &mut want);
        let q = GpuTensor::from_f32(&gpu, &batch.q, dtype)?;
        let k_cache = GpuTensor::from_f32(&gpu, &batch.k_cache, dtype)?;
        let v_cache = GpuTensor::from_f32(&gpu, &batch.v_cache, dtype)?;
        for general in [false, true] {
            let kernel = if general { AttentionKernel::General } else { AttentionKernel::Picked };
            let mut out = nan_tensor(&gpu, dtype, batch.q.len())?;
            let (q, k, v) = (q.view(), k_cache.view(), v_cache.view());
            attention.run_on(kernel, &gpu, q, k, v, &meta, *heads, out.view_mut())?;
            check(&format!("layer {i} {heads:?} general {general}"), &out.to_f32_vec(&gpu)?, &want, tol);
        }
    }
    Ok(())
}

/// The soft-cap of the tests below: scores are about +-0.5 (queries up to 1.5, keys up to 1,
/// scale `1 / sqrt(head_dim)`), so a cap of 0.5 moves every output far past the tolerances.
const SOFTCAP: f32 = 0.5;

/// Gemma 2's attention-logit soft-cap on every kernel `PagedAttention` can take, against the CPU:
/// each case names the path it is meant to reach, and first checks that the cap moves the
/// reference by several tolerances (so that a kernel ignoring it fails). Head shapes of Gemma 2
/// 9B (16 heads over 8 KV heads of 256: the CUDA-core decode kernel, which keeps batch-1 decodes
/// fast, and the flash kernel of head size 256) and 27B (32 over 16 of 128: the tensor-core
/// decode kernels and the flash kernel of head size 128); the general kernel in f32 and forced.
#[test]
fn paged_attention_softcap_on_every_kernel() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(21);
    let gemma_9b = Heads { num_heads: 16, num_kv_heads: 8, head_dim: 256 };
    let gemma_27b = Heads { num_heads: 32, num_kv_heads: 16, head_dim: 128 };
    let (f32_, bf16, f16) = (DTYPES[0], DTYPES[1], DTYPES[2]);
    let (one, deep, many) = ([(37, 1)], DEEP_DECODE, many_decodes());
    let general = AttentionKernel::General;
    let cases = [
        ("CUDA-core decode kernel, batch 1", PICKED, gemma_9b, &one[..], None, bf16),
        ("CUDA-core decode kernel, split context", PICKED, gemma_9b, &deep[..], Some(1000), bf16),
        ("CUDA-core decode kernel", PICKED, gemma_9b, &DECODES[..], Some(50), f16),
        ("CUDA-core decode kernel in f32", PICKED, gemma_27b, &DECODES[..], None, f32_),
        ("tensor-core decode kernel, batch 1", PICKED, gemma_27b, &one[..], None, bf16),
        ("tensor-core decode kernel, split context", PICKED, gemma_27b, &deep[..], None, bf16),
        ("tensor-core decode kernels, 300 decodes", PICKED, gemma_27b, &many[..], Some(50), f16),
        ("flash prefill kernel of head size 256", PICKED, gemma_9b, &MIXED[..], Some(50), bf16),
        ("flash prefill kernel of head size 128", PICKED, gemma_27b, &MIXED[..], None, f16),
        ("general kernel in f32", PICKED, gemma_9b, &MIXED[..], Some(50), f32_),
        ("general kernel, forced", general, gemma_27b, &MIXED[..], None, bf16),
    ];
    for (path, kernel, heads, requests, window, (dtype, tol)) in cases {
        check_softcapped(&gpu, &mut rng, path, kernel, heads, requests, window, dtype, tol)?;
    }
    if gpu.compute_capability().0 >= 9 {
        let copies = AttentionKernel::TensorCopies;
        for requests in [&deep[..], &DECODES[..], &many[..]] {
            let path = "tensor-copy decode kernel (sm_90)";
            check_softcapped(&gpu, &mut rng, path, copies, gemma_27b, requests, None, DType::BF16, DTYPES[1].1)?;
        }
    }
    Ok(())
}

/// One case of [`paged_attention_softcap_on_every_kernel`]: `requests` in blocks of 16 on
/// `kernel`, scores capped at [`SOFTCAP`].
#[allow(clippy::too_many_arguments)]
fn check_softcapped(
    gpu: &Gpu,
    rng: &mut ChaCha8Rng,
    path: &str,
    kernel: AttentionKernel,
    heads: Heads,
    requests: &[(usize, usize)],
    window: Option<usize>,
    dtype: DType,
    tol: f32,
) -> Result<(), GpuError> {
    let what = format!("softcap on the {path}: {dtype:?} {heads:?} window {window:?}");
    let batch = Batch::random(rng, heads, requests, 16, dtype);
    let want = cpu_attention(&batch, heads, 16, window, Some(SOFTCAP));
    let (moved, _) = worst_relative_error(&cpu_attention(&batch, heads, 16, window, None), &want);
    assert!(moved > 4.0 * tol, "{what}: the cap moves the reference by only {moved:e}, too little to test");
    let max_query_len = batch.max_query_len;
    let got = gpu_attention_capped(kernel, gpu, &batch, heads, 16, window, Some(SOFTCAP), dtype, max_query_len)?;
    check(&what, &got, &want, tol);
    Ok(())
}

/// The logits' soft-cap in place against the CPU op: values up to +-150 under Gemma 2's cap of
/// 30 and a cap of 0.5, over Gemma 3's 262,144-token vocabulary, Gemma 2's 256,000 and a few
/// odd widths.
#[test]
fn softcap_matches_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(22);
    for (rows, vocab) in [(1, 7), (3, 1000), (2, 262_144), (5, 256_000)] {
        for cap in [30.0, 0.5] {
            let x = random_vec(&mut rng, rows * vocab, 150.0);
            let mut want = x.clone();
            cpu::softcap(&mut want, cap);
            let mut logits = GpuTensor::from_f32(&gpu, &x, DType::F32)?;
            cuda::softcap(&gpu, logits.view_mut(), cap)?;
            check(&format!("softcap {cap} of [{rows}, {vocab}]"), &logits.to_f32_vec(&gpu)?, &want, 1e-6);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Linear and logits

/// A second `Gpu` on the device, its stream at the highest priority, shares the first one's
/// context: it runs ops on the first one's buffers (both GEMM routes, cuBLAS on all SMs and on
/// 8) with the same results.
#[test]
fn a_gpu_of_highest_priority_works_on_another_gpus_buffers() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let high = cuda::Gpu::new_with_priority(0, cuda::StreamPriority::Highest, &GpuOptions::default())?;
    let mut rng = rng(31);
    let (k, n) = (256, 384);
    for (m, sm_target) in [(1, None), (200, None), (200, Some(8))] {
        high.set_gemm_sm_count_target(sm_target)?;
        let x = random_vec(&mut rng, m * k, 1.0);
        let w = random_vec(&mut rng, n * k, 0.5);
        let (x_dev, x_r) = upload(&gpu, &x, DType::BF16)?;
        let (w_dev, w_r) = upload(&gpu, &w, DType::BF16)?;
        let mut y = nan_tensor(&gpu, DType::F32, m * n)?;
        gpu.synchronize()?;
        cuda::linear(&high, &gemms, x_dev.view(), m, k, w_dev.view(), n, None, y.view_mut())?;
        high.synchronize()?;
        let mut want = vec![0.0; m * n];
        cpu::linear(&x_r, m, k, WeightView::F32(&w_r), n, None, &mut want);
        let what = format!("linear on the high-priority stream, m={m}, SM target {sm_target:?}");
        check(&what, &y.to_f32_vec(&gpu)?, &want, 1e-3);
    }
    Ok(())
}

#[test]
fn linear_matches_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(13);
    // m up to GEMV_MAX_M takes the GEMV kernel where k is a multiple of 8 (not k = 100), one
    // or several of its unrolled steps (k = 1000: 125 chunks for 32 lanes) and its tail;
    // larger m take cuBLAS. `linear_cublas` is checked on the same inputs.
    for &m in &[1, 2, 3, 4, 7, 64, 130] {
        for &k in &[64, 100, 1000] {
            for &n in &[1, 130, 2048] {
                let x = random_vec(&mut rng, m * k, 1.0);
                let w = random_vec(&mut rng, n * k, 0.5);
                let bias = random_vec(&mut rng, n, 1.0);
                let bias_dev = GpuTensor::from_f32(&gpu, &bias, DType::F32)?;
                for (dtype, tol) in DTYPES {
                    let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
                    let (w_dev, w_r) = upload(&gpu, &w, dtype)?;
                    // Outputs in the activation dtype, and f32 ones (logits): exact products of
                    // rounded inputs, summed in f32 (by tensor cores for bf16 and f16).
                    let f32_tol = if dtype == DType::F32 { 1e-4 } else { 1e-3 };
                    for (y_dtype, y_tol) in [(dtype, tol), (DType::F32, f32_tol)] {
                        for with_bias in [false, true] {
                            let b = with_bias.then_some(bias.as_slice());
                            let mut want = vec![0.0; m * n];
                            cpu::linear(&x_r, m, k, WeightView::F32(&w_r), n, b, &mut want);
                            for cublas in [false, m <= cuda::GEMV_MAX_M] {
                                let lin = if cublas { cuda::linear_cublas } else { cuda::linear };
                                let mut y = nan_tensor(&gpu, y_dtype, m * n)?;
                                let b_dev = with_bias.then(|| bias_dev.view());
                                lin(&gpu, &gemms, x_dev.view(), m, k, w_dev.view(), n, b_dev, y.view_mut())?;
                                let what = format!(
                                    "linear {dtype:?}->{y_dtype:?} m={m} k={k} n={n} bias={with_bias} cublas={cublas}"
                                );
                                check(&what, &y.to_f32_vec(&gpu)?, &want, y_tol);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// GEMMs through the cuBLASLt plans that tuning keeps give cuBLAS's products (within the sum
/// order), with and without bias, into the activation dtype and into f32, as do cuBLAS's own
/// GEMMs once the plans are forgotten. Every plan is kept here (`Gemms::tune_always`), so that the
/// cuBLASLt path runs whatever the timings say.
#[test]
fn tuned_gemms_match_cublas() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(31);
    let (k, n) = (1024, 1536);
    let ms = [8, 48, 130, 384];
    let w = random_vec(&mut rng, n * k, 0.5);
    let bias = random_vec(&mut rng, n, 1.0);
    let bias_dev = GpuTensor::from_f32(&gpu, &bias, DType::F32)?;
    for (dtype, tol) in DTYPES.into_iter().filter(|(d, _)| *d != DType::F32) {
        let (w_dev, w_r) = upload(&gpu, &w, dtype)?;
        for (y_dtype, with_bias) in [(dtype, false), (DType::F32, false), (dtype, true)] {
            // `linear` with a bias into a half type computes an f32 product first.
            let gemm_out = if with_bias { DType::F32 } else { y_dtype };
            let report = gemms.tune_always(&gpu, &ms, &[(w_dev.view(), n, gemm_out)])?;
            assert_eq!(report.len(), ms.len(), "{dtype:?}: one tuning per row count");
            for t in &report {
                assert!(t.candidates >= 1 && t.taken, "{dtype:?}: cuBLASLt offered nothing that ran: {t:?}");
                assert!(t.default_us > 0.0 && t.best_us.is_some_and(|us| us > 0.0), "{t:?}");
            }
            for &m in &ms {
                let x = random_vec(&mut rng, m * k, 1.0);
                let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
                let b = with_bias.then_some(bias.as_slice());
                let mut want = vec![0.0; m * n];
                cpu::linear(&x_r, m, k, WeightView::F32(&w_r), n, b, &mut want);
                let run = |gpu: &Gpu| -> Result<Vec<f32>, GpuError> {
                    let mut y = nan_tensor(gpu, y_dtype, m * n)?;
                    let b_dev = with_bias.then(|| bias_dev.view());
                    cuda::linear(gpu, &gemms, x_dev.view(), m, k, w_dev.view(), n, b_dev, y.view_mut())?;
                    y.to_f32_vec(gpu)
                };
                let what = format!("tuned linear {dtype:?}->{y_dtype:?} m={m} bias={with_bias}");
                let tol = if y_dtype == DType::F32 { 1e-3 } else { tol };
                check(&what, &run(&gpu)?, &want, tol);
                gemms.clear();
                check(&format!("{what}, plans forgotten"), &run(&gpu)?, &want, tol);
                gemms.tune_always(&gpu, &[m], &[(w_dev.view(), n, gemm_out)])?;
            }
            gemms.clear();
        }
    }
    Ok(())
}

/// The GEMV kernel with k split over 1 to 8 warps per column (k of 2048, 8200, 16384 and 32768
/// under 4096 columns), with k not a multiple of the warps' stride (a tail), at every row count
/// it takes (or cuBLAS, past its weights for several rows), against the CPU.
#[test]
fn linear_of_few_rows_splits_long_rows_across_warps() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(15);
    for m in 1..=cuda::GEMV_MAX_M {
        for &k in &[2048, 8200, 16384, 32768] {
            for &n in &[1, 37, 300] {
                let x = random_vec(&mut rng, m * k, 1.0);
                let w = random_vec(&mut rng, n * k, 0.5);
                for (dtype, tol) in DTYPES {
                    let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
                    let (w_dev, w_r) = upload(&gpu, &w, dtype)?;
                    let mut y = nan_tensor(&gpu, DType::F32, m * n)?;
                    cuda::linear(&gpu, &gemms, x_dev.view(), m, k, w_dev.view(), n, None, y.view_mut())?;
                    let mut want = vec![0.0; m * n];
                    cpu::linear(&x_r, m, k, WeightView::F32(&w_r), n, None, &mut want);
                    let f32_tol = if dtype == DType::F32 { 1e-4 } else { tol.min(1e-3) };
                    check(&format!("linear {dtype:?}->F32 m={m} k={k} n={n}"), &y.to_f32_vec(&gpu)?, &want, f32_tol);
                }
            }
        }
    }
    Ok(())
}

/// `linear_gated` (the GEMV kernel with the activation in its epilogue, for up to 4 rows without
/// a bias) gives the bits of `linear` followed by `silu_and_mul` / `gelu_tanh_and_mul`, with k
/// split or not; with 5 rows or a bias it is that composition. Both against the CPU as well.
#[test]
fn linear_gated_matches_linear_then_activation() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(18);
    for act in [cuda::GatedActivation::Silu, cuda::GatedActivation::GeluTanh] {
        for m in 1..=cuda::GEMV_MAX_M + 1 {
            for &(k, inter) in &[(64, 100), (2048, 300), (8200, 37), (1024, 2100)] {
                for with_bias in [false, true] {
                    let x = random_vec(&mut rng, m * k, 1.0);
                    let w = random_vec(&mut rng, 2 * inter * k, 0.1);
                    let b = random_vec(&mut rng, 2 * inter, 0.5);
                    for (dtype, tol) in DTYPES {
                        let what = format!("linear_gated {act:?} {dtype:?} m={m} k={k} inter={inter} bias {with_bias}");
                        let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
                        let (w_dev, w_r) = upload(&gpu, &w, dtype)?;
                        let b_dev = GpuTensor::from_f32(&gpu, &b, DType::F32)?;
                        let bias = with_bias.then(|| b_dev.view());
                        let mut gate_up = nan_tensor(&gpu, dtype, m * 2 * inter)?;
                        let mut got = nan_tensor(&gpu, dtype, m * inter)?;
                        cuda::linear_gated(
                            &gpu,
                            &gemms,
                            x_dev.view(),
                            m,
                            k,
                            w_dev.view(),
                            inter,
                            bias,
                            act,
                            gate_up.view_mut(),
                            got.view_mut(),
                            None,
                        )?;
                        let mut want = nan_tensor(&gpu, dtype, m * inter)?;
                        cuda::linear(
                            &gpu,
                            &gemms,
                            x_dev.view(),
                            m,
                            k,
                            w_dev.view(),
                            2 * inter,
                            bias,
                            gate_up.view_mut(),
                        )?;
                        cuda::gated_activation(&gpu, act, gate_up.view(), inter, want.view_mut(), None)?;
                        let (got, want) = (got.to_f32_vec(&gpu)?, want.to_f32_vec(&gpu)?);
                        let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(same, "{what}: differs from linear then the activation");

                        let mut gu = vec![0.0; m * 2 * inter];
                        cpu::linear(&x_r, m, k, WeightView::F32(&w_r), 2 * inter, with_bias.then_some(&b[..]), &mut gu);
                        let gu = rounded(&gu, dtype);
                        let mut cpu_out = vec![0.0; m * inter];
                        match act {
                            cuda::GatedActivation::Silu => cpu::silu_and_mul(&gu, inter, &mut cpu_out),
                            cuda::GatedActivation::GeluTanh => cpu::gelu_tanh_and_mul(&gu, inter, &mut cpu_out),
                        }
                        // gate and up are rounded to the dtype before the activation, so a sum one
                        // rounding step off on the GPU moves the result by up to two such steps.
                        check(&what, &got, &cpu_out, if dtype == DType::F32 { tol } else { 2.0 * tol });
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn linear_of_a_row_range_writes_only_those_rows() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(14);
    let (m, k, n) = (9, 96, 40);
    let x = random_vec(&mut rng, m * k, 1.0);
    let w = random_vec(&mut rng, n * k, 0.5);
    let bias = random_vec(&mut rng, n, 1.0);
    let bias_dev = GpuTensor::from_f32(&gpu, &bias, DType::F32)?;
    for (dtype, tol) in DTYPES {
        let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
        let (w_dev, w_r) = upload(&gpu, &w, dtype)?;
        let mut y = nan_tensor(&gpu, dtype, m * n)?;
        cuda::linear(
            &gpu,
            &gemms,
            x_dev.rows(2..5, k),
            3,
            k,
            w_dev.view(),
            n,
            Some(bias_dev.view()),
            y.rows_mut(2..5, n),
        )?;
        let got = y.to_f32_vec(&gpu)?;
        let mut want = vec![0.0; 3 * n];
        cpu::linear(&x_r[2 * k..5 * k], 3, k, WeightView::F32(&w_r), n, Some(&bias), &mut want);
        check(&format!("linear {dtype:?} rows 2..5"), &got[2 * n..5 * n], &want, tol);
        assert!(got[..2 * n].iter().chain(&got[5 * n..]).all(|v| v.is_nan()), "rows outside the range were written");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Sampling: `GpuSampler` against the host definition of each row's answer, `RowRequest::apply`.

use ferrolm_sampling::{RequestSampler, RowRequest, SamplePlan, SamplingParams, TokenLogprobs};

/// Relative nudge of u, top_p and min_p under which a host choice must not change for a case to
/// be compared: the kernel's weights can differ from the host's by an ulp (its exp is the f64 one
/// rounded, the host's is libm's expf) and its f64 sums run in another order, which moves a
/// cumulative boundary by far less than this.
const SAMPLE_MARGIN: f64 = 2e-6;

/// Whether nudging the plan's u, top_p or min_p by `SAMPLE_MARGIN` changes the host's choice
/// (under the row's token mask, for a `masked` plan).
fn fragile(plan: &SamplePlan, row: &[f32], mask: Option<&[u32]>) -> bool {
    if plan.greedy {
        return false;
    }
    let token = plan.apply_masked(row, mask).map(|t| t.token);
    // Within the parameters' ranges: top_p and min_p at 1 stay there.
    let nudge = |x: f64, sign: f64| (x * (1.0 + sign * SAMPLE_MARGIN)).min(1.0);
    [-1.0, 1.0].into_iter().any(|sign| {
        let mut nudged =
            vec![SamplePlan { u: (plan.u + sign * SAMPLE_MARGIN).clamp(0.0, 1.0 - 1e-12), ..plan.clone() }];
        if plan.top_p < 1.0 {
            nudged.push(SamplePlan { top_p: nudge(f64::from(plan.top_p), sign) as f32, ..plan.clone() });
        }
        if plan.min_p > 0.0 {
            nudged.push(SamplePlan { min_p: nudge(f64::from(plan.min_p), sign) as f32, ..plan.clone() });
        }
        nudged.iter().any(|p| p.apply_masked(row, mask).map(|t| t.token) != token)
    })
}

/// A plan as the engine makes them: a sampler over random parameters (every filter, penalty and
/// mask, each often off), a random prompt and outputs, while under `min_tokens` or past it.
fn random_plan(rng: &mut ChaCha8Rng, vocab: usize) -> SamplePlan {
    let v = vocab as u32;
    let pick = |rng: &mut ChaCha8Rng, values: &[f32]| values[rng.random_range(0..values.len())];
    let params = SamplingParams {
        temperature: pick(rng, &[0.0, 0.0, 0.4, 1.0, 1.6]),
        top_k: [0, 0, 1, 2, 50, vocab as i32 - 1, vocab as i32, vocab as i32 + 10][rng.random_range(0..8)],
        top_p: pick(rng, &[1.0, 1.0, 0.95, 0.5, 1e-6]),
        min_p: pick(rng, &[0.0, 0.0, 0.02, 0.3]),
        repetition_penalty: pick(rng, &[1.0, 1.0, 1.3, 0.8]),
        presence_penalty: pick(rng, &[0.0, 0.0, 0.7, -0.4]),
        frequency_penalty: pick(rng, &[0.0, 0.0, 0.3, -0.2]),
        seed: Some(rng.random()),
        min_tokens: [0, 0, 5][rng.random_range(0..3)],
        ignore_eos: rng.random_bool(0.3),
        stop_token_ids: (0..rng.random_range(0..4)).map(|_| rng.random_range(0..v + 5)).collect(),
        logprobs: [None, Some(0), Some(1), Some(5), Some(20)][rng.random_range(0..5)],
        ..SamplingParams::default()
    };
    let prompt: Vec<u32> = (0..rng.random_range(0..64)).map(|_| rng.random_range(0..v + 3)).collect();
    let mut sampler = RequestSampler::new(&params, &prompt, 0).expect("valid params");
    for _ in 0..rng.random_range(0..8) {
        sampler.record(rng.random_range(0..v));
    }
    let eos: Vec<u32> = (0..rng.random_range(0..3)).map(|_| rng.random_range(0..v)).collect();
    sampler.plan(&eos)
}

/// A logits row of one of several kinds: smooth, coarse (many exact ties), peaked, with NaN and
/// +-inf sprinkled in, or with nothing to pick.
fn sampling_row(rng: &mut ChaCha8Rng, vocab: usize, kind: usize) -> Vec<f32> {
    let mut row = random_vec(rng, vocab, 8.0);
    match kind % 6 {
        0 => {}
        1 => row.iter_mut().for_each(|l| *l = (*l * 2.0).round() / 2.0),
        2 => {
            for _ in 0..5 {
                row[rng.random_range(0..vocab)] += 12.0;
            }
        }
        3 => {
            for (i, special) in [f32::NAN, f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY].into_iter().enumerate() {
                for _ in 0..1 + vocab / 50 {
                    row[rng.random_range(0..vocab)] = special;
                }
                row[i % vocab] = special;
            }
        }
        4 => row[rng.random_range(0..vocab)] = f32::INFINITY,
        _ => {
            if rng.random_bool(0.5) {
                row.fill(f32::NEG_INFINITY);
            } else {
                row.iter_mut()
                    .enumerate()
                    .for_each(|(i, l)| *l = if i % 2 == 0 { f32::NAN } else { f32::NEG_INFINITY });
            }
        }
    }
    row
}

/// Equal tokens, equal top ids, logprobs within 1e-4 (NaN where the host has NaN).
fn assert_same_answer(got: &Option<TokenLogprobs>, want: &Option<TokenLogprobs>, what: &str) {
    let close = |g: f32, w: f32| (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= 1e-4;
    match (got, want) {
        (None, None) => {}
        (Some(g), Some(w)) => {
            assert_eq!(g.token, w.token, "{what}: token");
            assert!(close(g.logprob, w.logprob), "{what}: logprob {} vs {}", g.logprob, w.logprob);
            let ids = |t: &TokenLogprobs| t.top_logprobs.iter().map(|p| p.0).collect::<Vec<_>>();
            assert_eq!(ids(g), ids(w), "{what}: top ids");
            for (a, b) in g.top_logprobs.iter().zip(&w.top_logprobs) {
                assert!(close(a.1, b.1), "{what}: top logprob of {}: {} vs {}", a.0, a.1, b.1);
            }
        }
        _ => panic!("{what}: {got:?} vs {want:?}"),
    }
}

/// `rows` random cases over `vocab` in one launch: sample plans of every kind (u re-drawn where
/// the host's choice sits on a boundary) and prompt-logprob rows (in and out of the row).
fn check_sampling_launch(
    gpu: &Gpu,
    sampler: &mut cuda::GpuSampler,
    rng: &mut ChaCha8Rng,
    vocab: usize,
    rows: usize,
    dtype: DType,
) -> Result<(), GpuError> {
    let logits: Vec<f32> = (0..rows).flat_map(|r| sampling_row(rng, vocab, r)).collect();
    let (dev, stored) = upload(gpu, &logits, dtype)?;
    let mut plans = Vec::new();
    for r in 0..rows {
        let row = &stored[r * vocab..][..vocab];
        let mut plan = random_plan(rng, vocab);
        let mut tries = 0;
        while fragile(&plan, row, None) {
            plan.u = rng.random();
            tries += 1;
            assert!(tries < 100, "no robust u for row {r}");
        }
        plans.push(plan);
    }
    let requests: Vec<RowRequest> = plans
        .iter()
        .enumerate()
        .map(|(r, plan)| match r % 5 {
            4 => RowRequest::Logprobs {
                token: if r % 10 == 4 { rng.random_range(0..vocab as u32) } else { u32::MAX },
                num_top: [0, 3, 20][r % 3],
            },
            _ => RowRequest::Sample(plan),
        })
        .collect();
    let got = sampler.sample(gpu, dev.view(), vocab, &requests)?;
    assert_eq!(got.len(), rows);
    for (r, (req, g)) in requests.iter().zip(&got).enumerate() {
        let want = req.apply(&stored[r * vocab..][..vocab]);
        assert_same_answer(g, &want, &format!("{dtype:?} vocab {vocab} row {r} ({req:?})"));
    }
    Ok(())
}

#[test]
fn sampling_matches_the_host_sampler() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(16);
    let mut sampler = cuda::GpuSampler::new();
    // Several launches per size on one sampler: later ones find earlier results in the buffers.
    // Up to Gemma 3's 262,144 tokens.
    for (vocab, launches, rows) in [(7, 6, 40), (1000, 6, 40), (32_001, 4, 24), (128_256, 3, 16), (262_144, 2, 8)] {
        for _ in 0..launches {
            check_sampling_launch(&gpu, &mut sampler, &mut rng, vocab, rows, DType::F32)?;
        }
        check_sampling_launch(&gpu, &mut sampler, &mut rng, vocab, rows / 2, DType::F32)?;
    }
    // bf16 logits: coarse values, so ties everywhere.
    check_sampling_launch(&gpu, &mut sampler, &mut rng, 32_001, 24, DType::BF16)?;
    Ok(())
}

/// Greedy rows with nothing to adjust (the sampler finds their argmax in its first pass) at a
/// 151,936-token vocabulary: a tie far apart (won by the lower id), masked and NaN entries (whole
/// chunks of the first pass among them), a row
/// with nothing to pick, and logits near 1e4 (where `max - logsumexp` would lose bits), with and
/// without top logprobs.
#[test]
fn greedy_sampling_edges_match_the_host() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(15);
    let mut sampler = cuda::GpuSampler::new();
    let vocab = 151_936;
    let rows = 5;
    let mut logits = random_vec(&mut rng, rows * vocab, 10.0);
    logits[vocab + 40_000] = 25.0;
    logits[vocab + 100] = 25.0;
    for i in (0..vocab).step_by(3) {
        logits[2 * vocab + i] = f32::NEG_INFINITY;
    }
    logits[2 * vocab + 7] = f32::NAN;
    // Whole chunks of the statistics pass (4096 ids) with nothing to count: NaN, then -inf.
    logits[2 * vocab + 4096..2 * vocab + 8192].fill(f32::NAN);
    logits[2 * vocab + 8192..2 * vocab + 12_288].fill(f32::NEG_INFINITY);
    logits[3 * vocab..4 * vocab].fill(f32::NEG_INFINITY);
    logits[4 * vocab..].iter_mut().for_each(|l| *l += 1.0e4);
    let plans: Vec<SamplePlan> = (0..rows).map(|r| SamplePlan::greedy([0, 5][r % 2])).collect();
    let requests: Vec<RowRequest> = plans.iter().map(RowRequest::Sample).collect();
    for dtype in [DType::F32, DType::BF16] {
        let (dev, stored) = upload(&gpu, &logits, dtype)?;
        let got = sampler.sample(&gpu, dev.view(), vocab, &requests)?;
        for (r, (req, g)) in requests.iter().zip(&got).enumerate() {
            let want = req.apply(&stored[r * vocab..][..vocab]);
            assert_same_answer(g, &want, &format!("{dtype:?} greedy row {r}"));
        }
        assert_eq!(got[1].as_ref().map(|t| t.token), Some(100), "{dtype:?}: the tie goes to the lower id");
        assert!(got[3].is_none(), "{dtype:?}: a row of -inf has nothing to pick");
    }
    Ok(())
}

/// The filters' edges one by one on one row: ties at the top-k threshold and inside the nucleus,
/// k at and beyond the candidate count, top_p 1 and tiny, min_p, and masks over the whole row.
#[test]
fn sampling_filters_at_their_edges_match_the_host() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(17);
    let mut sampler = cuda::GpuSampler::new();
    let vocab = 32_001;
    // Values in steps of 0.25: a few hundred distinct values, each shared by ~100 ids.
    let mut row: Vec<f32> = random_vec(&mut rng, vocab, 20.0).iter().map(|l| (l * 4.0).round() / 4.0).collect();
    row[17] = f32::NEG_INFINITY;
    let base = SamplePlan {
        greedy: false,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        u: 0.5,
        num_top_logprobs: 20,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        adjusts: Vec::new(),
        masked: false,
    };
    let mut plans = Vec::new();
    for top_k in [1, 2, 37, 150, 1000, vocab - 2, vocab - 1, vocab, vocab + 1] {
        plans.push(SamplePlan { top_k, ..base.clone() });
    }
    for top_p in [1.0, 0.999, 0.9, 0.5, 0.1, 1e-6] {
        plans.push(SamplePlan { top_p, ..base.clone() });
        plans.push(SamplePlan { top_p, top_k: 500, temperature: 0.3, ..base.clone() });
    }
    for min_p in [1e-4, 0.1, 0.5, 1.0] {
        plans.push(SamplePlan { min_p, top_p: 0.9, ..base.clone() });
    }
    // Everything masked but two ids, one of them out of the ones the mask list names.
    let mask_all: Vec<_> = (0..vocab as u32)
        .filter(|&t| t != 5 && t != 31_000)
        .map(|token| ferrolm_sampling::TokenAdjust { token, mask: true, ..Default::default() })
        .collect();
    plans.push(SamplePlan { adjusts: mask_all.clone(), ..base.clone() });
    plans.push(SamplePlan { adjusts: mask_all, greedy: true, ..base.clone() });
    let n = plans.len();
    for (i, plan) in plans.iter_mut().enumerate() {
        let mut tries = 0;
        while fragile(plan, &row, None) {
            plan.u = rng.random();
            tries += 1;
            assert!(tries < 100, "no robust u for case {i}");
        }
    }
    let logits: Vec<f32> = (0..n).flat_map(|_| row.iter().copied()).collect();
    let dev = GpuTensor::from_f32(&gpu, &logits, DType::F32)?;
    let requests: Vec<RowRequest> = plans.iter().map(RowRequest::Sample).collect();
    let got = sampler.sample(&gpu, dev.view(), vocab, &requests)?;
    for (i, (plan, g)) in plans.iter().zip(&got).enumerate() {
        let what = format!("case {i} (top_k {}, top_p {}, min_p {})", plan.top_k, plan.top_p, plan.min_p);
        assert_same_answer(g, &plan.apply(&row), &what);
    }
    Ok(())
}

/// An answer bit for bit (NaN logprobs included): token, logprob bits, top (id, logprob bits).
type AnswerBits = Option<(u32, u32, Vec<(u32, u32)>)>;

fn answer_bits(a: &Option<TokenLogprobs>) -> AnswerBits {
    a.as_ref().map(|t| (t.token, t.logprob.to_bits(), t.top_logprobs.iter().map(|&(i, l)| (i, l.to_bits())).collect()))
}

/// A row's answer depends on the row alone: the same rows give bit-identical results alone, in
/// another order among others, and again.
#[test]
fn sampling_is_deterministic_and_batch_invariant() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(18);
    let mut sampler = cuda::GpuSampler::new();
    let vocab = 50_000;
    let rows = 12;
    let logits: Vec<f32> = (0..rows).flat_map(|r| sampling_row(&mut rng, vocab, r)).collect();
    let plans: Vec<SamplePlan> = (0..rows).map(|_| random_plan(&mut rng, vocab)).collect();
    let dev = GpuTensor::from_f32(&gpu, &logits, DType::F32)?;
    let requests: Vec<RowRequest> = plans.iter().map(RowRequest::Sample).collect();
    let together: Vec<_> = sampler.sample(&gpu, dev.view(), vocab, &requests)?.iter().map(answer_bits).collect();
    let again: Vec<_> = sampler.sample(&gpu, dev.view(), vocab, &requests)?.iter().map(answer_bits).collect();
    assert_eq!(again, together, "run twice");
    let mut order: Vec<usize> = (0..rows).collect();
    order.shuffle(&mut rng);
    let shuffled: Vec<f32> = order.iter().flat_map(|&r| logits[r * vocab..][..vocab].iter().copied()).collect();
    let shuffled_dev = GpuTensor::from_f32(&gpu, &shuffled, DType::F32)?;
    let shuffled_requests: Vec<RowRequest> = order.iter().map(|&r| requests[r]).collect();
    let got = sampler.sample(&gpu, shuffled_dev.view(), vocab, &shuffled_requests)?;
    for (j, &r) in order.iter().enumerate() {
        assert_eq!(answer_bits(&got[j]), together[r], "row {r} at position {j}");
        let alone = sampler.sample(&gpu, dev.slice(r * vocab..(r + 1) * vocab), vocab, &requests[r..=r])?;
        assert_eq!(answer_bits(&alone[0]), together[r], "row {r} alone");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Token masks: `GpuSampler::sample_masked` against `RowRequest::apply_masked`.

use ferrolm_sampling::mask::{allow, allows};
use ferrolm_sampling::TokenMasks;

/// How many ids a token mask allows.
#[derive(Clone, Copy, Debug)]
enum Density {
    /// One id, below the vocabulary and the mask's end.
    One,
    /// About 1 % of the ids.
    Sparse,
    /// About half of the bits of every word, those past the vocabulary too.
    Half,
    /// Every bit of every word.
    All,
    /// None: the row has nothing to pick.
    Nothing,
}

const DENSITIES: [Density; 5] = [Density::One, Density::Sparse, Density::Half, Density::All, Density::Nothing];

/// A token mask of `words` words over a vocabulary of `vocab` ids.
fn random_mask(rng: &mut ChaCha8Rng, vocab: usize, words: usize, density: Density) -> Vec<u32> {
    let mut mask = vec![0u32; words];
    let covered = vocab.min(32 * words) as u32;
    match density {
        Density::One => allow(&mut mask, rng.random_range(0..covered)),
        Density::Sparse => (0..covered).filter(|_| rng.random_bool(0.01)).for_each(|t| allow(&mut mask, t)),
        Density::Half => mask.iter_mut().for_each(|w| *w = rng.random()),
        Density::All => mask.fill(u32::MAX),
        Density::Nothing => {}
    }
    mask
}

/// A token mask for a failure message: its density, its words, how many ids of the vocabulary
/// it allows and the first of them.
fn describe_mask(mask: &[u32], vocab: usize, density: Density) -> String {
    let allowed: Vec<u32> = (0..vocab as u32).filter(|&t| allows(mask, t)).collect();
    let first = &allowed[..allowed.len().min(6)];
    format!("{density:?} mask of {} words, {} of {vocab} ids allowed, first {first:?}", mask.len(), allowed.len())
}

/// A plan for a failure message, without its adjustment list.
fn describe_plan(plan: &SamplePlan) -> String {
    let min_tokens = plan.adjusts.iter().filter(|a| a.mask).count();
    format!(
        "{} plan: temperature {}, top_k {}, top_p {}, min_p {}, u {}, penalties {}/{}/{} over {} ids \
         ({min_tokens} masked for min_tokens), {} top logprobs",
        if plan.greedy { "greedy" } else { "random" },
        plan.temperature,
        plan.top_k,
        plan.top_p,
        plan.min_p,
        plan.u,
        plan.repetition_penalty,
        plan.frequency_penalty,
        plan.presence_penalty,
        plan.adjusts.len(),
        plan.num_top_logprobs,
    )
}

/// A masked plan of one of the sampler's paths (`variant` 0..5): as `random_plan` draws it;
/// greedy with nothing to adjust (the argmax of the statistics pass); greedy with the drawn
/// penalties and `min_tokens` masks (a row of scratch); random with nothing to adjust and no
/// top-k (the weights pass, top-p and min-p now and then); random under top-k with the drawn
/// adjustments.
fn masked_plan(rng: &mut ChaCha8Rng, vocab: usize, variant: usize) -> SamplePlan {
    let mut plan = random_plan(rng, vocab);
    let pick = |rng: &mut ChaCha8Rng, values: &[f32]| values[rng.random_range(0..values.len())];
    match variant % 5 {
        0 => {}
        1 => {
            plan.greedy = true;
            plan.adjusts.clear();
        }
        2 => plan.greedy = true,
        3 => {
            plan.greedy = false;
            plan.temperature = pick(rng, &[0.5, 1.0, 1.5]);
            plan.top_k = 0;
            plan.top_p = pick(rng, &[1.0, 1.0, 0.9, 0.3]);
            plan.min_p = pick(rng, &[0.0, 0.0, 0.05]);
            plan.adjusts.clear();
            plan.u = rng.random();
        }
        _ => {
            plan.greedy = false;
            plan.temperature = pick(rng, &[0.7, 1.0]);
            plan.top_k = [1, 3, 100][rng.random_range(0..3)];
            plan.u = rng.random();
        }
    }
    plan.masked = true;
    plan
}

/// What a row of a masked launch asks for.
#[derive(Clone, Copy, Debug)]
enum Role {
    Logprobs,
    Unmasked,
    /// The row's mask (its index among the masked rows), the plan's variant and the density.
    Masked {
        mask: usize,
        variant: usize,
        density: Density,
    },
}

/// `template` with a u whose host choice on `row` is not `fragile`.
fn robust(rng: &mut ChaCha8Rng, template: &SamplePlan, row: &[f32], mask: Option<&[u32]>) -> SamplePlan {
    let mut plan = SamplePlan { u: if template.greedy { 0.0 } else { rng.random() }, ..template.clone() };
    let mut tries = 0;
    while fragile(&plan, row, mask) {
        plan.u = rng.random();
        tries += 1;
        assert!(tries < 100, "no robust u for {}", describe_plan(&plan));
    }
    plan
}

/// `rows` rows over `vocab` in one `sample_masked` launch, against `RowRequest::apply_masked`:
/// masked rows (masks of `words` words; plan variant and density from `first_combo` on, one
/// combination per masked row, every other one with decoys 60 above the row's disallowed ids)
/// among unmasked sample rows and prompt-logprob rows. Returns how many masked rows it had.
#[allow(clippy::too_many_arguments)]
fn check_masked_launch(
    gpu: &Gpu,
    sampler: &mut cuda::GpuSampler,
    rng: &mut ChaCha8Rng,
    vocab: usize,
    rows: usize,
    words: usize,
    dtype: DType,
    first_combo: usize,
) -> Result<usize, GpuError> {
    let mut roles = Vec::with_capacity(rows);
    let mut masks = TokenMasks::new(0, words);
    let mut logits: Vec<f32> = Vec::with_capacity(rows * vocab); // [rows, vocab]
    for r in 0..rows {
        let mut row = sampling_row(rng, vocab, r);
        let role = match r % 5 {
            4 => Role::Logprobs,
            2 => Role::Unmasked,
            _ => {
                let mask = masks.num_rows();
                let combo = first_combo + mask;
                let (variant, density) = (combo % 5, DENSITIES[(combo / 5) % 5]);
                masks.data.extend(random_mask(rng, vocab, words, density));
                if combo.is_multiple_of(2) {
                    let m = masks.row(mask);
                    row.iter_mut().enumerate().filter(|(t, _)| !allows(m, *t as u32)).for_each(|(_, l)| *l += 60.0);
                }
                Role::Masked { mask, variant, density }
            }
        };
        roles.push(role);
        logits.extend(row);
    }
    let (dev, stored) = upload(gpu, &logits, dtype)?;
    let mut plans = Vec::with_capacity(rows);
    for (r, role) in roles.iter().enumerate() {
        let row = &stored[r * vocab..][..vocab];
        let (plan, mask) = match *role {
            Role::Masked { mask, variant, .. } => (masked_plan(rng, vocab, variant), Some(masks.row(mask))),
            _ => (random_plan(rng, vocab), None),
        };
        plans.push(robust(rng, &plan, row, mask));
    }
    let requests: Vec<RowRequest> = roles
        .iter()
        .zip(&plans)
        .enumerate()
        .map(|(r, (role, plan))| match role {
            Role::Logprobs => RowRequest::Logprobs {
                token: if r % 10 == 4 { rng.random_range(0..vocab as u32) } else { u32::MAX },
                num_top: [0, 3, 20][r % 3],
            },
            _ => RowRequest::Sample(plan),
        })
        .collect();
    let got = sampler.sample_masked(gpu, dev.view(), vocab, &requests, &masks)?;
    assert_eq!(got.len(), rows);
    for (r, ((req, role), g)) in requests.iter().zip(&roles).zip(&got).enumerate() {
        let row = &stored[r * vocab..][..vocab];
        let mut what = format!("{dtype:?} vocab {vocab} row {r}: ");
        match (*role, req) {
            (Role::Masked { mask, variant, density }, RowRequest::Sample(plan)) => {
                let m = masks.row(mask);
                what += &format!("{} (variant {variant}), {}", describe_plan(plan), describe_mask(m, vocab, density));
                assert_same_answer(g, &req.apply_masked(row, Some(m)), &what);
                if let Some(t) = g {
                    assert!(allows(m, t.token), "{what}: token {} is not allowed", t.token);
                }
            }
            (Role::Unmasked, RowRequest::Sample(plan)) => {
                what += &format!("unmasked {}", describe_plan(plan));
                assert_same_answer(g, &req.apply(row), &what);
            }
            _ => {
                what += &format!("{req:?}");
                assert_same_answer(g, &req.apply(row), &what);
            }
        }
    }
    Ok(masks.num_rows())
}

/// Masked rows (masks of every density, every path of the sampler, decoys above the disallowed
/// ids) mixed with unmasked and prompt-logprob rows, against `RowRequest::apply_masked`: masks
/// as long as the vocabulary, shorter (the ids past them disallowed) and longer (bits past the
/// vocabulary ignored), over small and large vocabularies, and unmasked launches between masked
/// ones on the same sampler.
#[test]
fn masked_sampling_matches_the_host_sampler() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(19);
    let mut sampler = cuda::GpuSampler::new();
    let mut combo = 0;
    for (vocab, launches, rows) in [(7, 3, 40), (1000, 3, 40), (32_001, 2, 40), (128_256, 2, 20), (151_936, 1, 12)] {
        let full = TokenMasks::words_for(vocab);
        for words in [full, (full / 2).max(1), full + 3] {
            for _ in 0..launches {
                combo += check_masked_launch(&gpu, &mut sampler, &mut rng, vocab, rows, words, DType::F32, combo)?;
            }
            check_sampling_launch(&gpu, &mut sampler, &mut rng, vocab, rows / 2, DType::F32)?;
        }
    }
    let words = TokenMasks::words_for(32_001);
    check_masked_launch(&gpu, &mut sampler, &mut rng, 32_001, 40, words, DType::BF16, combo)?;
    Ok(())
}

/// Masked rows at a 151,936-token vocabulary with known answers, greedy (the argmax of the
/// statistics pass, and with a penalty, of a row of scratch) and random (the weights pass, and
/// under top-k): the raw argmax disallowed (the best allowed id is in another chunk), a tie of
/// allowed ids far apart (the lower wins) under a higher disallowed id, one allowed id (always
/// picked, with its raw logprob), one allowed id at -inf and no allowed id (nothing to pick);
/// then a mask shorter than the vocabulary under decoys past its end. Logprobs stay the raw
/// row's.
#[test]
fn masked_sampling_edges_match_the_host() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(20);
    let mut sampler = cuda::GpuSampler::new();
    let vocab = 151_936;
    let words = TokenMasks::words_for(vocab);
    let mut logits = random_vec(&mut rng, 5 * vocab, 10.0); // [5, vocab]
    let mut masks = TokenMasks::new(5, words);
    // 0: the argmax (id 5) disallowed; the best allowed is id 100_000.
    logits[5] = 50.0;
    logits[100_000] = 20.0;
    [3, 70_000, 100_000].into_iter().for_each(|t| allow(masks.row_mut(0), t));
    // 1: allowed ids 9_000 and 140_000 tie under a disallowed 40 at id 4_000; half the rest allowed.
    let (tie, low, high) = (vocab + 9_000, vocab + 140_000, vocab + 4_000);
    (logits[tie], logits[low], logits[high]) = (30.0, 30.0, 40.0);
    masks.row_mut(1).iter_mut().for_each(|w| *w = rng.random());
    allow(masks.row_mut(1), 9_000);
    allow(masks.row_mut(1), 140_000);
    masks.row_mut(1)[4_000 / 32] &= !(1 << (4_000 % 32));
    // 2: id 123_456 alone.
    allow(masks.row_mut(2), 123_456);
    // 3: id 77 alone, at -inf.
    logits[3 * vocab + 77] = f32::NEG_INFINITY;
    allow(masks.row_mut(3), 77);
    // 4: nothing allowed.
    let dev = GpuTensor::from_f32(&gpu, &logits, DType::F32)?;
    let row = |r: usize| &logits[r * vocab..][..vocab];
    let greedy = SamplePlan { masked: true, ..SamplePlan::greedy(5) };
    let penalized = SamplePlan {
        repetition_penalty: 1.3,
        adjusts: vec![ferrolm_sampling::TokenAdjust { token: 100_000, repetition: true, ..Default::default() }],
        ..greedy.clone()
    };
    let random = SamplePlan { greedy: false, temperature: 1.0, ..greedy.clone() };
    let top_k = SamplePlan { top_k: 2, top_p: 0.8, ..random.clone() };
    for template in [&greedy, &penalized, &random, &top_k] {
        let plans: Vec<SamplePlan> = (0..5).map(|r| robust(&mut rng, template, row(r), Some(masks.row(r)))).collect();
        let requests: Vec<RowRequest> = plans.iter().map(RowRequest::Sample).collect();
        let got = sampler.sample_masked(&gpu, dev.view(), vocab, &requests, &masks)?;
        let what = |r: usize| format!("row {r}: {}", describe_plan(&plans[r]));
        for (r, g) in got.iter().enumerate() {
            assert_same_answer(g, &requests[r].apply_masked(row(r), Some(masks.row(r))), &what(r));
            if let Some(g) = g {
                assert!(allows(masks.row(r), g.token), "{}: token {} is not allowed", what(r), g.token);
                let raw = ferrolm_sampling::token_logprobs(row(r), g.token, 5);
                assert_eq!(g.top_logprobs[0].0, raw.top_logprobs[0].0, "{}: the top logprob is the raw row's", what(r));
            }
        }
        let token = |r: usize| got[r].as_ref().map(|t| t.token);
        if template.greedy {
            assert_eq!(token(0), Some(100_000), "{}: the best allowed id", what(0));
            assert_eq!(token(1), Some(9_000), "{}: the tie goes to the lower allowed id", what(1));
        }
        assert_eq!(token(2), Some(123_456), "{}: the one allowed id", what(2));
        assert_eq!(token(3), None, "{}: the one allowed id is at -inf", what(3));
        assert_eq!(token(4), None, "{}: nothing allowed", what(4));
    }

    // A mask of 1000 words (ids below 32,000) allowing all of them, under decoys at 50 past its end.
    let mut short = TokenMasks::new(2, 1000);
    short.data.fill(u32::MAX);
    let mut logits = random_vec(&mut rng, 2 * vocab, 10.0);
    for t in (32_000..vocab).step_by(97) {
        logits[t] = 50.0;
        logits[vocab + t] = 50.0;
    }
    let dev = GpuTensor::from_f32(&gpu, &logits, DType::F32)?;
    let row = |r: usize| &logits[r * vocab..][..vocab];
    for template in [&greedy, &random] {
        let plans: Vec<SamplePlan> = (0..2).map(|r| robust(&mut rng, template, row(r), Some(short.row(r)))).collect();
        let requests: Vec<RowRequest> = plans.iter().map(RowRequest::Sample).collect();
        let got = sampler.sample_masked(&gpu, dev.view(), vocab, &requests, &short)?;
        for (r, g) in got.iter().enumerate() {
            let what = format!("short mask, row {r}: {}", describe_plan(&plans[r]));
            assert_same_answer(g, &requests[r].apply_masked(row(r), Some(short.row(r))), &what);
            let token = g.as_ref().map_or(u32::MAX, |t| t.token);
            assert!(token < 32_000, "{what}: token {token} is past the mask");
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts

use ferrolm_backend::cuda::{GpuExperts, GpuMoeScratch, MoePath};
use ferrolm_backend::{GatedActivation, MoeShape};
use rayon::prelude::*;

/// One MoE layer under test: its shape, routing and the token counts it is run at.
struct MoeCase {
    name: &'static str,
    shape: MoeShape,
    norm_topk_prob: bool,
    activation: GatedActivation,
    /// An expert every token picks (its logit above every other).
    hot_expert: Option<usize>,
    tokens: &'static [usize],
}

const MOE_TOKENS: &[usize] = &[1, 2, 7, 64, 300, 2048];

const MOE_CASES: [MoeCase; 6] = [
    // Rows that end inside a 32-wide k tile and a column tile (72, 40).
    MoeCase {
        name: "small",
        shape: MoeShape { num_experts: 8, top_k: 2, inter: 40, hidden: 72 },
        norm_topk_prob: true,
        activation: GatedActivation::Silu,
        hot_expert: None,
        tokens: MOE_TOKENS,
    },
    MoeCase {
        name: "top-1",
        shape: MoeShape { num_experts: 16, top_k: 1, inter: 48, hidden: 64 },
        norm_topk_prob: false,
        activation: GatedActivation::GeluTanh,
        hot_expert: None,
        tokens: MOE_TOKENS,
    },
    // Qwen3-30B-A3B's routing (128 experts, top 8) on narrower experts.
    MoeCase {
        name: "qwen3-like",
        shape: MoeShape { num_experts: 128, top_k: 8, inter: 104, hidden: 256 },
        norm_topk_prob: true,
        activation: GatedActivation::Silu,
        hot_expert: None,
        tokens: MOE_TOKENS,
    },
    MoeCase {
        name: "qwen3-like, hot expert, no renormalization",
        shape: MoeShape { num_experts: 128, top_k: 8, inter: 104, hidden: 256 },
        norm_topk_prob: false,
        activation: GatedActivation::Silu,
        hot_expert: Some(77),
        tokens: &[1, 7, 300],
    },
    // Rows long enough for the GEMV kernels' unrolled loads, and the down rows of a token
    // (4 x 2048) split over two warps.
    MoeCase {
        name: "long rows",
        shape: MoeShape { num_experts: 16, top_k: 4, inter: 2048, hidden: 1024 },
        norm_topk_prob: true,
        activation: GatedActivation::Silu,
        hot_expert: None,
        tokens: &[1, 7, 64],
    },
    // Gate/up rows of 8192 split over two warps.
    MoeCase {
        name: "wide",
        shape: MoeShape { num_experts: 4, top_k: 2, inter: 64, hidden: 8192 },
        norm_topk_prob: false,
        activation: GatedActivation::GeluTanh,
        hot_expert: None,
        tokens: &[1, 7, 64],
    },
];

/// `value` as stored in `dtype`.
fn round_to(value: f32, dtype: DType) -> f32 {
    rounded(&[value], dtype)[0]
}

/// Router logits `[tokens, num_experts]`: each row a shuffle of evenly spaced values (so no two
/// probabilities are within rounding of each other), with the hot expert above them all, and in
/// every third row the top_k-th and the next logit made equal (the tie goes to the lower id).
fn moe_logits(rng: &mut ChaCha8Rng, case: &MoeCase, tokens: usize) -> Vec<f32> {
    let (e, k) = (case.shape.num_experts, case.shape.top_k);
    let mut logits = Vec::with_capacity(tokens * e);
    for t in 0..tokens {
        let mut ranks: Vec<usize> = (0..e).collect();
        ranks.shuffle(rng);
        let mut row: Vec<f32> = ranks.iter().map(|&r| (r as f32 - e as f32 / 2.0) * 4.0 / e as f32).collect();
        if let Some(hot) = case.hot_expert {
            row[hot] = 3.0;
        }
        if t % 3 == 0 && k < e {
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            row[order[k]] = row[order[k - 1]];
        }
        logits.extend(row);
    }
    logits
}

/// HF's routing: the top_k experts by softmax probability (ties to the lower id) and their
/// weights, renormalized when asked.
fn moe_route(logits: &[f32], top_k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<(usize, f32)> = exps.iter().map(|&e| e / sum).enumerate().collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1));
    order.truncate(top_k);
    if normalize {
        let total: f32 = order.iter().map(|&(_, p)| p).sum();
        order.iter_mut().for_each(|(_, p)| *p /= total);
    }
    order
}

/// The spacing of `dtype`'s values at `|v|` (0 for f32, whose rounding the order term of
/// `moe_reference` covers).
fn spacing(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 0.0,
        DType::BF16 => {
            let b = bf16::from_f32(v.abs());
            bf16::from_bits(b.to_bits() + 1).to_f32() - b.to_f32()
        }
        DType::F16 => {
            let h = f16::from_f32(v.abs());
            f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()
        }
    }
}

/// The MoE layer token by token on the host, in f32 on inputs already rounded to the dtype,
/// rounding where the GPU stores an intermediate: gate and up, the activation, and (the grouped
/// path, `round_y`) each expert's down projection. Returns the output and, per element, the
/// slack the GPU's may need beyond the check's tolerance: its f32 sums run in another order,
/// so they differ in their last bits, and a stored intermediate near a rounding boundary may
/// round the other way. Per chosen expert, weighted: 2^-20 of the sums of |products| through
/// both projections (the gate and up sums' carried through the activation), four spacings of
/// the activation times the largest |down| weight (a gate, up or activation that rounded the
/// other way), and one spacing of the down projection when it is stored.
fn moe_reference(
    case: &MoeCase,
    x: &[f32],
    logits: &[f32],
    gate_up: &[f32],
    down: &[f32],
    dtype: DType,
    round_y: bool,
) -> (Vec<f32>, Vec<f32>) {
    let MoeShape { num_experts, top_k, inter, hidden } = case.shape;
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
    let token = |t: usize| {
        let x = &x[t * hidden..][..hidden];
        let mut out = vec![0.0f32; hidden];
        let mut slack = vec![0.0f32; hidden];
        for (e, weight) in moe_route(&logits[t * num_experts..][..num_experts], top_k, case.norm_topk_prob) {
            let rows = &gate_up[e * 2 * inter * hidden..][..2 * inter * hidden];
            // Each gate and up sum, and the sum of its |products|.
            let sums: Vec<(f32, f32)> = rows
                .chunks_exact(hidden)
                .map(|w| (dot(w, x), w.iter().zip(x).map(|(w, x)| (w * x).abs()).sum::<f32>()))
                .collect();
            let gu: Vec<f32> = sums.iter().map(|&(v, _)| round_to(v, dtype)).collect();
            // How far each activation moves per unit of error of its gate and up sums: the
            // activations' slopes are below 1.2 and their values below |gate| + 1.
            let act_order: Vec<f32> = (0..inter)
                .map(|c| {
                    let ((g, g_mag), (u, u_mag)) = (sums[c], sums[inter + c]);
                    1.2 * u.abs() * g_mag + (g.abs() + 1.0) * u_mag
                })
                .collect();
            let mut act = vec![0.0; inter];
            match case.activation {
                GatedActivation::Silu => cpu::silu_and_mul(&gu, inter, &mut act),
                GatedActivation::GeluTanh => cpu::gelu_tanh_and_mul(&gu, inter, &mut act),
            }
            let act = rounded(&act, dtype);
            let rows = &down[e * hidden * inter..][..hidden * inter];
            for ((o, s), w) in out.iter_mut().zip(slack.iter_mut()).zip(rows.chunks_exact(inter)) {
                let y = dot(w, &act);
                let stored = if round_y { round_to(y, dtype) } else { y };
                *o += weight * stored;
                let magnitude: f32 =
                    w.iter().zip(&act).zip(&act_order).map(|((w, a), o)| (w * a).abs() + w.abs() * o).sum();
                let flip = w.iter().zip(&act).fold(0.0f32, |m, (w, a)| m.max(w.abs() * spacing(*a, dtype)));
                let y_flip = if round_y { spacing(y, dtype) } else { 0.0 };
                *s += weight * (magnitude * 2f32.powi(-20) + 4.0 * flip + y_flip);
            }
        }
        out.into_iter().zip(slack)
    };
    (0..x.len() / hidden).into_par_iter().flat_map_iter(token).unzip()
}

/// [`check`] with a slack per element: `|got - want|` beyond `slack` is held to `tol`.
fn check_with_slack(what: &str, got: &[f32], want: &[f32], slack: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
    let floor = (1e-2 * scale).max(f32::MIN_POSITIVE);
    let mut worst = (0.0f32, 0usize);
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(slack).enumerate() {
        assert!(!g.is_nan(), "{what}: element {i} is NaN (want {w})");
        let err = ((g - w).abs() - s).max(0.0) / w.abs().max(floor);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, i) = worst;
    assert!(
        err <= tol,
        "{what}: max relative error {err:e} at element {i}: got {}, want {} (slack {})",
        got[i],
        want[i],
        slack[i]
    );
}

/// The paths a step of `tokens` tokens is checked on: its own, and every other.
fn moe_paths(tokens: usize, shape: MoeShape) -> Vec<MoePath> {
    let mut paths = vec![cuda::moe_path(tokens, shape)];
    for path in [
        MoePath::Gemv,
        MoePath::Grouped { block_m: 16 },
        MoePath::Grouped { block_m: 32 },
        MoePath::Grouped { block_m: 64 },
    ] {
        if !paths.contains(&path) {
            paths.push(path);
        }
    }
    paths
}

fn check_moe_case(gpu: &Gpu, case: &MoeCase, seed: u64) -> Result<(), GpuError> {
    let mut rng = rng(seed);
    let MoeShape { num_experts, inter, hidden, .. } = case.shape;
    let gate_up = random_vec(&mut rng, num_experts * 2 * inter * hidden, 2.0 / (hidden as f32).sqrt());
    let down = random_vec(&mut rng, num_experts * hidden * inter, 2.0 / (inter as f32).sqrt());
    let max_tokens = case.tokens.iter().copied().max().unwrap_or(0);
    let x = random_vec(&mut rng, max_tokens * hidden, 1.0);
    let logits = moe_logits(&mut rng, case, max_tokens);
    let logits_dev = GpuTensor::from_f32(gpu, &logits, DType::F32)?;
    for (dtype, tol) in DTYPES {
        let (gate_up_dev, gate_up_r) = upload(gpu, &gate_up, dtype)?;
        let (down_dev, down_r) = upload(gpu, &down, dtype)?;
        let (x_dev, x_r) = upload(gpu, &x, dtype)?;
        let experts = GpuExperts {
            gate_up: gate_up_dev.view(),
            down: down_dev.view(),
            shape: case.shape,
            norm_topk_prob: case.norm_topk_prob,
            activation: case.activation,
        };
        // One scratch for every step of the case, as a model keeps one for its largest step.
        let mut scratch = GpuMoeScratch::new(gpu, dtype, max_tokens, case.shape)?;
        for &tokens in case.tokens {
            let x_view = x_dev.slice(0..tokens * hidden);
            let logits_view = logits_dev.slice(0..tokens * num_experts);
            let (x_t, logits_t) = (&x_r[..tokens * hidden], &logits[..tokens * num_experts]);
            let gemv_want = moe_reference(case, x_t, logits_t, &gate_up_r, &down_r, dtype, false);
            let grouped_want = match dtype {
                DType::F32 => gemv_want.clone(),
                _ => moe_reference(case, x_t, logits_t, &gate_up_r, &down_r, dtype, true),
            };
            for path in moe_paths(tokens, case.shape) {
                let mut out = nan_tensor(gpu, dtype, tokens * hidden)?;
                cuda::moe_on_path(gpu, x_view, logits_view, &experts, &mut scratch, out.view_mut(), path)?;
                let (want, slack) = if matches!(path, MoePath::Gemv) { &gemv_want } else { &grouped_want };
                let what = format!("moe {} {dtype:?} T={tokens} {path:?}", case.name);
                check_with_slack(&what, &out.to_f32_vec(gpu)?, want, slack, tol);
            }
        }
    }
    Ok(())
}

/// [`check_moe_case`] on each case, seeded `first_seed`, `first_seed + 1`, ...
fn check_moe_cases(gpu: &Gpu, cases: &[MoeCase], first_seed: u64) -> Result<(), GpuError> {
    for (i, case) in cases.iter().enumerate() {
        check_moe_case(gpu, case, first_seed + i as u64)?;
    }
    Ok(())
}

#[test]
fn moe_of_small_experts_matches_a_host_reference() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    check_moe_cases(&gpu, &MOE_CASES[..2], 40)
}

#[test]
fn moe_with_qwen3_routing_matches_a_host_reference() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    check_moe_cases(&gpu, &MOE_CASES[2..4], 50)
}

#[test]
fn moe_of_long_rows_matches_a_host_reference() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    check_moe_cases(&gpu, &MOE_CASES[4..], 60)
}

/// A step of no tokens writes nothing and fails nothing; one past the scratch's tokens panics.
#[test]
fn moe_of_no_tokens_is_a_no_op() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let shape = MoeShape { num_experts: 4, top_k: 2, inter: 8, hidden: 16 };
    let gate_up = GpuTensor::zeros(&gpu, DType::BF16, 4 * 2 * 8 * 16)?;
    let down = GpuTensor::zeros(&gpu, DType::BF16, 4 * 16 * 8)?;
    let experts = GpuExperts {
        gate_up: gate_up.view(),
        down: down.view(),
        shape,
        norm_topk_prob: true,
        activation: GatedActivation::Silu,
    };
    let mut scratch = GpuMoeScratch::new(&gpu, DType::BF16, 4, shape)?;
    let (x, logits) = (GpuTensor::zeros(&gpu, DType::BF16, 0)?, GpuTensor::zeros(&gpu, DType::F32, 0)?);
    let mut out = GpuTensor::zeros(&gpu, DType::BF16, 0)?;
    cuda::moe(&gpu, x.view(), logits.view(), &experts, &mut scratch, out.view_mut())?;
    gpu.synchronize()?;
    let (x, logits) = (GpuTensor::zeros(&gpu, DType::BF16, 5 * 16)?, GpuTensor::zeros(&gpu, DType::F32, 5 * 4)?);
    let mut out = GpuTensor::zeros(&gpu, DType::BF16, 5 * 16)?;
    let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        cuda::moe(&gpu, x.view(), logits.view(), &experts, &mut scratch, out.view_mut())
    }));
    assert!(past.is_err(), "5 tokens in a scratch for 4 should panic");
    Ok(())
}

#[test]
fn add_sigmoid_gated_matches_the_host() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(70);
    for (rows, width) in [(1, 8), (7, 2048), (300, 1000)] {
        let out0 = random_vec(&mut rng, rows * width, 2.0);
        let x = random_vec(&mut rng, rows * width, 2.0);
        let mut gate = random_vec(&mut rng, rows, 6.0);
        // Saturating gates: 0 and 1, no NaN.
        gate[0] = -200.0;
        if rows > 1 {
            gate[1] = 200.0;
        }
        let gate_dev = GpuTensor::from_f32(&gpu, &gate, DType::F32)?;
        for (dtype, tol) in DTYPES {
            let (mut out_dev, out_r) = upload(&gpu, &out0, dtype)?;
            let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
            cuda::add_sigmoid_gated(&gpu, out_dev.view_mut(), x_dev.view(), gate_dev.view(), width)?;
            let want: Vec<f32> =
                (0..rows * width).map(|i| out_r[i] + x_r[i] / (1.0 + (-gate[i / width]).exp())).collect();
            check(&format!("add_sigmoid_gated {dtype:?} [{rows}, {width}]"), &out_dev.to_f32_vec(&gpu)?, &want, tol);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// FP8 weights

/// A `[rows, cols]` FP8 matrix of random finite codes (no NaN codes) with `scales`.
fn random_fp8(rng: &mut ChaCha8Rng, rows: usize, cols: usize, scales: Fp8Scales) -> Fp8Matrix {
    let codes = (0..rows * cols)
        .map(|_| loop {
            let c: u8 = rng.random();
            if c & 0x7f != 0x7f {
                break c;
            }
        })
        .collect();
    Fp8Matrix::new(rows, cols, codes, scales).expect("a valid FP8 matrix")
}

/// The scale layouts an FP8 product meets, for a `[rows, cols]` matrix: per tensor, per row,
/// 128 x 128 blocks (partial at the edges where 128 does not divide), 16 x 64 blocks (the
/// narrowest the tensor-core GEMV takes), and q/k/v parts in blocks that do not end on a block
/// row (stacked as one-row blocks 16 wide, which the GEMV of gemv.cu takes).
fn fp8_layouts(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<(&'static str, Fp8Matrix)> {
    let scale = |rng: &mut ChaCha8Rng| rng.random_range(0.5f32..2.0) / 448.0;
    let tensor_scale = scale(rng);
    let tensor = random_fp8(rng, rows, cols, Fp8Scales::Tensor(tensor_scale));
    let per_row = (0..rows).map(|_| scale(rng)).collect();
    let per_row = random_fp8(rng, rows, cols, Fp8Scales::Rows(per_row));
    let grid = (0..rows.div_ceil(128) * cols.div_ceil(128)).map(|_| scale(rng)).collect();
    let blocks = random_fp8(rng, rows, cols, Fp8Scales::Blocks { block_rows: 128, block_cols: 128, scales: grid });
    let grid = (0..rows.div_ceil(16) * cols.div_ceil(64)).map(|_| scale(rng)).collect();
    let narrow = random_fp8(rng, rows, cols, Fp8Scales::Blocks { block_rows: 16, block_cols: 64, scales: grid });
    let split = rows / 3 + 1;
    let mut part = |rows: usize| {
        let grid = (0..rows.div_ceil(8) * cols.div_ceil(16)).map(|_| scale(rng)).collect();
        random_fp8(rng, rows, cols, Fp8Scales::Blocks { block_rows: 8, block_cols: 16, scales: grid })
    };
    let parts = vec![part(split), part(rows - split)];
    let stacked = Fp8Matrix::stack(parts).expect("parts of one width");
    vec![
        ("tensor", Fp8Matrix::stack(vec![tensor]).unwrap()),
        ("rows", Fp8Matrix::stack(vec![per_row]).unwrap()),
        ("blocks", Fp8Matrix::stack(vec![blocks]).unwrap()),
        ("blocks of 64 columns", Fp8Matrix::stack(vec![narrow]).unwrap()),
        ("stacked", stacked),
    ]
}

/// `linear_fp8` against the CPU's product with the dequantized weights: the FP8 GEMV for 1 to 4
/// rows (k in one or several rounds of chunks, narrow and wide matrices so k split or not; for
/// the tensor-core kernel splits of 1, 2, 4 and 8 warps, a round with chunks left over, and k
/// ending 16 and 48 columns into a chunk), and
/// the dequantized matrix through cuBLAS for more (n is no multiple of 16, so no FP8 GEMM), with
/// and without bias, into the activation dtype and into f32, over every scale layout. An odd n
/// leaves the last of the paired GEMV's warps (2 to 4 rows) one row.
#[test]
fn fp8_linear_matches_cpu_on_dequantized_weights() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(41);
    let shapes = [(64, 130), (256, 131), (512, 130), (1040, 300), (1072, 300), (1536, 300), (4096, 4100), (8192, 130)];
    for &(k, n) in &shapes {
        for (layout, w) in fp8_layouts(&mut rng, n, k) {
            let w_dev = GpuFp8Matrix::new(&gpu, &w)?.expect("the kernels take every layout under test");
            let w_f32 = w.dequantize().to_f32_vec();
            let bias = random_vec(&mut rng, n, 1.0);
            let bias_dev = GpuTensor::from_f32(&gpu, &bias, DType::F32)?;
            for &m in &[1, 2, 3, 4, 5, 33] {
                let x = random_vec(&mut rng, m * k, 1.0);
                for (dtype, tol) in DTYPES {
                    let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
                    let mut scratch = GpuTensor::uninit(&gpu, dtype, n * k)?;
                    // Beyond the GEMV the weights are dequantized to the activation dtype first.
                    let w_r = if m <= cuda::GEMV_MAX_M { w_f32.clone() } else { rounded(&w_f32, dtype) };
                    let f32_tol = if dtype == DType::F32 { 1e-4 } else { 1e-3 };
                    for (y_dtype, y_tol) in [(dtype, tol), (DType::F32, f32_tol)] {
                        for with_bias in [false, true] {
                            let b = with_bias.then_some(bias.as_slice());
                            let mut want = vec![0.0; m * n];
                            cpu::linear(&x_r, m, k, WeightView::F32(&w_r), n, b, &mut want);
                            let mut y = nan_tensor(&gpu, y_dtype, m * n)?;
                            let b_dev = with_bias.then(|| bias_dev.view());
                            let w_view = w_dev.view();
                            cuda::linear_fp8(
                                &gpu,
                                &gemms,
                                x_dev.view(),
                                m,
                                w_view,
                                n,
                                b_dev,
                                y.view_mut(),
                                &mut scratch,
                                None,
                            )?;
                            let what = format!(
                                "linear_fp8 {layout} {dtype:?}->{y_dtype:?} m={m} k={k} n={n} bias={with_bias}"
                            );
                            check(&what, &y.to_f32_vec(&gpu)?, &want, y_tol);
                        }
                    }
                }
            }
            // The first rows only (an LM head's prefix), into f32.
            let (m, rows) = (2, n / 2 + 1);
            let x = random_vec(&mut rng, m * k, 1.0);
            for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 1e-3)] {
                let (x_dev, x_r) = upload(&gpu, &x, dtype)?;
                let mut scratch = GpuTensor::uninit(&gpu, dtype, n * k)?;
                let mut y = nan_tensor(&gpu, DType::F32, m * rows)?;
                let (x_view, w_view) = (x_dev.view(), w_dev.view());
                cuda::linear_fp8(&gpu, &gemms, x_view, m, w_view, rows, None, y.view_mut(), &mut scratch, None)?;
                let mut want = vec![0.0; m * rows];
                cpu::linear(&x_r, m, k, WeightView::F32(&w_f32[..rows * k]), rows, None, &mut want);
                let what = format!("linear_fp8 {layout} {dtype:?} first {rows} rows");
                check(&what, &y.to_f32_vec(&gpu)?, &want, tol);
            }
        }
    }
    Ok(())
}

/// `linear_gated_fp8` up to 4 rows (the GEMV with the activation in its epilogue) gives the bits
/// of `linear_fp8` into gate_up followed by the activation (beyond 4 rows it is that composition:
/// `fp8_gemm_matches_cpu_on_quantized_activations` checks it).
#[test]
fn fp8_linear_gated_matches_fp8_linear_then_activation() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(43);
    for act in [cuda::GatedActivation::Silu, cuda::GatedActivation::GeluTanh] {
        for &(k, inter) in &[(256, 100), (2048, 1100)] {
            for (layout, w) in fp8_layouts(&mut rng, 2 * inter, k) {
                let w_dev = GpuFp8Matrix::new(&gpu, &w)?.expect("the kernels take every layout under test");
                for m in 1..=cuda::GEMV_MAX_M {
                    let x = random_vec(&mut rng, m * k, 1.0);
                    for (dtype, _) in DTYPES {
                        let (x_dev, _) = upload(&gpu, &x, dtype)?;
                        let mut scratch = GpuTensor::uninit(&gpu, dtype, 2 * inter * k)?;
                        let mut gate_up = nan_tensor(&gpu, dtype, m * 2 * inter)?;
                        let mut got = nan_tensor(&gpu, dtype, m * inter)?;
                        let (x_view, w_view) = (x_dev.view(), w_dev.view());
                        let (gu, out) = (gate_up.view_mut(), got.view_mut());
                        cuda::linear_gated_fp8(
                            &gpu,
                            &gemms,
                            x_view,
                            m,
                            w_view,
                            inter,
                            None,
                            act,
                            cuda::Fp8Operands { scratch: &mut scratch, x_codes: None },
                            cuda::GatedOut { gate_up: gu, out, codes: None },
                        )?;
                        let mut want = nan_tensor(&gpu, dtype, m * inter)?;
                        let gu = gate_up.view_mut();
                        cuda::linear_fp8(&gpu, &gemms, x_view, m, w_view, 2 * inter, None, gu, &mut scratch, None)?;
                        cuda::gated_activation(&gpu, act, gate_up.view(), inter, want.view_mut(), None)?;
                        let (got, want) = (got.to_f32_vec(&gpu)?, want.to_f32_vec(&gpu)?);
                        assert!(!got.iter().any(|v| v.is_nan()), "linear_gated_fp8 {layout} {dtype:?} m={m}: NaN");
                        let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(
                            same,
                            "linear_gated_fp8 {act:?} {layout} {dtype:?} m={m} k={k}: differs from the composition"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// More rows of bf16 or f16 activations over a matrix of one scale per row take cuBLASLt's FP8
/// GEMM, the activations quantized per token first (per token and 128 columns beside weights in
/// 128 x 128 blocks): against the CPU's product of the dequantized weights with the activations
/// quantized the same way (amax / 448 per row or group, codes rounded to nearest even), which
/// `crate::fp8` computes on the host. With and without bias, into the activation dtype and f32,
/// over all the rows and over the first half (an LM head's prefix), and as the gate/up
/// projection with its activation after it. Row counts that are no multiple of 4 take the
/// block GEMM's padding.
#[test]
fn fp8_gemm_matches_cpu_on_quantized_activations() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut failures = Vec::new();
    // With the default options (cuBLASLt's fast accumulation, the GEMM over 128 x 128 blocks),
    // then with its promotions to f32 and the blocks dequantized instead.
    fp8_gemm_cases(&gpu, &mut failures)?;
    drop(gpu);
    let options = GpuOptions { fp8_fast_accumulation: false, fp8_block_gemm: false, ..Default::default() };
    fp8_gemm_cases(&Gpu::new(0, &options)?, &mut failures)?;
    assert!(failures.is_empty(), "{} cases out of bounds:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

/// The cases of `fp8_gemm_matches_cpu_on_quantized_activations` on `gpu`, those out of bounds
/// added to `failures`.
fn fp8_gemm_cases(gpu: &Gpu, failures: &mut Vec<String>) -> Result<(), GpuError> {
    let fast = gpu.options().fp8_fast_accumulation;
    let gemms = Gemms::new()?;
    let mut rng = rng(47);
    // The message of a mismatch: the likeliest cause is a GEMM that did not run in FP8.
    let why = "(fails where cuBLASLt has no FP8 GEMM and the weights are dequantized instead)";
    // 640 columns: 5 blocks of 128, their scales padded to 8 a block row, over 2 block rows.
    for &(k, n) in &[(256, 128), (640, 256), (4096, 1024)] {
        let layouts = fp8_layouts(&mut rng, n, k);
        for (layout, w) in layouts.into_iter().filter(|(l, _)| matches!(*l, "tensor" | "rows" | "blocks")) {
            let scaling = w.gemm_scaling().expect("an FP8 GEMM takes every layout under test");
            // Block scales always promote (see gemm_tune.rs).
            let fast = fast && scaling == Fp8GemmScaling::Rows;
            let w_dev = GpuFp8Matrix::new(gpu, &w)?.expect("the kernels take every layout under test");
            if scaling == Fp8GemmScaling::Blocks && !gpu.options().fp8_block_gemm {
                // Off: no block GEMM to tune (the matrix is dequantized, as
                // `fp8_linear_matches_cpu_on_dequantized_weights` checks).
                let report = cuda::tune_fp8_gemms(gpu, &gemms, w_dev.view(), n, &[64], DType::BF16)?;
                assert!(report.is_empty(), "FP8 GEMM {layout}: a block GEMM tuned with the option off");
                continue;
            }
            let w_f32 = w.dequantize().to_f32_vec();
            let bias = random_vec(&mut rng, n, 1.0);
            let bias_dev = GpuTensor::from_f32(gpu, &bias, DType::F32)?;
            for &m in &[5, 64, 130] {
                // Magnitudes that differ by token and by 128 columns, so that each group of a
                // token has a scale of its own (a scale read from the wrong group shows).
                let x: Vec<f32> = random_vec(&mut rng, m * k, 1.0)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * (1 + (i / k + 3 * (i % k / 128)) % 7) as f32)
                    .collect();
                for (dtype, tol) in DTYPES.into_iter().filter(|(d, _)| *d != DType::F32) {
                    let (x_dev, x_r) = upload(gpu, &x, dtype)?;
                    let x_q = Fp8Matrix::quantize_inputs(&HostTensor::from_f32(vec![m, k], x_r), scaling)
                        .dequantize()
                        .to_f32_vec();
                    let mut scratch = GpuTensor::uninit(gpu, dtype, n * k + m * k)?;
                    // Σ |x_i w_i| of each output: what the tensor cores' FP8 accumulation errs by
                    // a fraction of (it keeps fewer bits than f32 between promotions).
                    let (x_abs, w_abs): (Vec<f32>, Vec<f32>) =
                        (x_q.iter().map(|v| v.abs()).collect(), w_f32.iter().map(|v| v.abs()).collect());
                    let mut magnitude = vec![0.0; m * n];
                    cpu::linear(&x_abs, m, k, WeightView::F32(&w_abs), n, None, &mut magnitude);
                    for (rows, tuned) in [(n, false), (n / 2, false), (n, true), (n / 2, true)] {
                        if tuned {
                            // The fastest of cuBLASLt's algorithms from now on, as at load.
                            for output in [dtype, DType::F32] {
                                let report = cuda::tune_fp8_gemms(gpu, &gemms, w_dev.view(), rows, &[m], output)?;
                                // One GEMM, or (blocks past 64 rows no multiple of 4) two: the
                                // rows to the last multiple of 4, then the rest padded to 4.
                                let tuned_rows: usize = report.iter().map(|t| t.shape.m).sum();
                                assert!(
                                    tuned_rows >= m && tuned_rows < m + 4,
                                    "FP8 GEMM {layout} m={m} rows={rows}: not tuned {why}"
                                );
                                for t in &report {
                                    assert!(fast || !t.fast_accumulation, "fast accumulation where it is off");
                                    assert_eq!(t.shape.scaling, scaling, "FP8 GEMM {layout}: tuned as {scaling:?}");
                                }
                            }
                        }
                        for with_bias in [false, true] {
                            let b = with_bias.then_some(&bias[..rows]);
                            let mut want = vec![0.0; m * rows];
                            cpu::linear(&x_q, m, k, WeightView::F32(&w_f32[..rows * k]), rows, b, &mut want);
                            for y_dtype in [dtype, DType::F32] {
                                let mut y = nan_tensor(gpu, y_dtype, m * rows)?;
                                let (x_view, w_view) = (x_dev.view(), w_dev.view());
                                let b_dev = with_bias.then(|| bias_dev.slice(0..rows));
                                cuda::linear_fp8(
                                    gpu,
                                    &gemms,
                                    x_view,
                                    m,
                                    w_view,
                                    rows,
                                    b_dev,
                                    y.view_mut(),
                                    &mut scratch,
                                    None,
                                )?;
                                let what = format!(
                                    "FP8 GEMM {layout} {dtype:?}->{y_dtype:?} m={m} k={k} rows={rows}/{n} bias={with_bias} \
                                     tuned={tuned} fast={fast} {why}"
                                );
                                let got = y.to_f32_vec(gpu)?;
                                let rows_magnitude: Vec<f32> =
                                    (0..m).flat_map(|r| magnitude[r * n..r * n + rows].to_vec()).collect();
                                let worst = fp8_gemm_error(&got, &want, &rows_magnitude, y_dtype);
                                let (relative, _) = worst_relative_error(&got, &want);
                                let line = format!("{what}: error {worst:.2e} of Σ|x w|, relative {relative:.2e}");
                                eprintln!("{line}");
                                if worst > fp8_accumulation_bound(k, fast) {
                                    failures.push(line);
                                }
                            }
                        }
                    }
                    // w as [gate; up] of inter = n / 2: the product within the accumulation
                    // bound, as above, and the activation over the product the GPU wrote.
                    let inter = n / 2;
                    let mut want_gu = vec![0.0; m * n];
                    cpu::linear(&x_q, m, k, WeightView::F32(&w_f32), n, None, &mut want_gu);
                    let mut gate_up = nan_tensor(gpu, dtype, m * n)?;
                    let mut got = nan_tensor(gpu, dtype, m * inter)?;
                    let (x_view, w_view, act) = (x_dev.view(), w_dev.view(), cuda::GatedActivation::Silu);
                    let (gu_view, out) = (gate_up.view_mut(), got.view_mut());
                    cuda::linear_gated_fp8(
                        gpu,
                        &gemms,
                        x_view,
                        m,
                        w_view,
                        inter,
                        None,
                        act,
                        cuda::Fp8Operands { scratch: &mut scratch, x_codes: None },
                        cuda::GatedOut { gate_up: gu_view, out, codes: None },
                    )?;
                    let what = format!("FP8 GEMM gated {layout} {dtype:?} m={m} k={k} inter={inter} fast={fast} {why}");
                    let got_gu = gate_up.to_f32_vec(gpu)?;
                    let product = fp8_gemm_error(&got_gu, &want_gu, &magnitude, dtype);
                    let mut want = vec![0.0; m * inter];
                    cpu::silu_and_mul(&got_gu, inter, &mut want);
                    let got = got.to_f32_vec(gpu)?;
                    let (activation, _) = worst_relative_error(&got, &want);
                    let line = format!(
                        "{what}: the product's error {product:.2e} of Σ|x w|, the activation's relative error \
                         {activation:.2e}"
                    );
                    eprintln!("{line}");
                    if product > fp8_accumulation_bound(k, fast)
                        || activation > tol
                        || got.iter().any(|v| !v.is_finite())
                    {
                        failures.push(line);
                    }
                }
            }
        }
    }
    Ok(())
}

/// What an FP8 GEMM over `k` may err by beyond rounding its output, as a fraction of
/// Σ |x_i w_i|. The tensor cores keep fewer bits than f32 in the FP8 products' running sums
/// (about 14, as DeepSeek-V3's report measured on Hopper), and 2^-11 is four times the 2^-13 by
/// which a 14-bit sum may be off: the bound where cuBLASLt promotes the sums to f32 every few k
/// steps. With fast accumulation (the default) a sum takes k / 32 such roundings (one per FP8
/// mma of k 32), never flushed: a further 2^-13 times their square root, as for roundings that
/// do not all lean one way. On an H100 the promoting GEMMs came within 3.6e-4 (k 256) and 5.1e-5
/// (k 4096), the fast ones within 5.1e-4 and 7.3e-4, against bounds of 8.3e-4 and 1.9e-3.
/// Above k 256 the bound no longer tells the dequantized fallback (unquantized activations,
/// about 5.6e-4 at k 4096) from an FP8 GEMM: the k 256 cases and the tuning's report do.
fn fp8_accumulation_bound(k: usize, fast_accumulation: bool) -> f32 {
    let promoted = 1.0 / 2048.0;
    if fast_accumulation {
        promoted + (k as f32 / 32.0).sqrt() / 8192.0
    } else {
        promoted
    }
}

/// The largest error of `got` against `want` beyond the rounding of an output of `dtype` (a
/// relative 2^-8 for bf16, 2^-11 for f16), as a fraction of each output's Σ |x_i w_i|
/// (`magnitude`); infinite where a value is NaN.
fn fp8_gemm_error(got: &[f32], want: &[f32], magnitude: &[f32], dtype: DType) -> f32 {
    let rounding = match dtype {
        DType::BF16 => 1.0 / 256.0,
        DType::F16 => 1.0 / 2048.0,
        _ => 0.0,
    };
    let mut worst = 0.0f32;
    for ((&g, &w), &mag) in got.iter().zip(want).zip(magnitude) {
        if g.is_nan() {
            return f32::INFINITY;
        }
        let beyond = ((g - w).abs() - rounding * w.abs()).max(0.0);
        worst = worst.max(beyond / mag.max(f32::MIN_POSITIVE));
    }
    worst
}

/// `codes` (`[rows, cols]`, written by a kernel) against the host's per-row quantization of the
/// values `values` that kernel wrote: bit for bit, codes and scales.
fn check_row_codes(what: &str, gpu: &Gpu, codes: &GpuRowCodes, values: &GpuTensor, rows: usize, cols: usize) {
    let values = values.to_f32_vec(gpu).expect("values");
    let want = Fp8Matrix::quantize_rows(&HostTensor::from_f32(vec![rows, cols], values[..rows * cols].to_vec()));
    let (got_codes, got_scales) = codes.to_host(gpu, rows).expect("codes");
    let Fp8Scales::Rows(want_scales) = want.scales() else { unreachable!("quantize_rows gives row scales") };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got_scales), bits(want_scales), "{what}: the rows' FP8 scales");
    let wrong = got_codes.iter().zip(want.codes()).filter(|(g, w)| g != w).count();
    assert_eq!(wrong, 0, "{what}: {wrong} of {} FP8 codes differ from the host's", rows * cols);
}

/// The ops that write an FP8 projection's input (the norms, the gated activations, and the gated
/// FP8 product that ends in one) write its rows' codes bit for bit as the GEMM's own
/// quantization (`Fp8Matrix::quantize_rows` of the values they wrote), and an FP8 product that
/// reads those codes gives the bits of one that quantizes its input itself.
#[test]
fn fused_fp8_codes_match_quantizing_the_rows() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let gemms = Gemms::new()?;
    let mut rng = rng(53);
    for (dtype, _) in DTYPES.into_iter().filter(|(d, _)| *d != DType::F32) {
        // 4096: the 16-byte kernels; 3584: the same at a block of 448 threads (not a power of
        // two); 100: the element-wise ones.
        for &(rows, h) in &[(5, 4096), (37, 3584), (9, 100)] {
            let what = |op: &str| format!("{op} {dtype:?} rows={rows} hidden={h}");
            let x = random_vec(&mut rng, rows * h, 2.0);
            let residual = random_vec(&mut rng, rows * h, 2.0);
            let w = GpuTensor::from_f32(&gpu, &random_vec(&mut rng, h, 1.0), DType::F32)?;
            let x_w = GpuTensor::from_f32(&gpu, &random_vec(&mut rng, h, 1.0), DType::F32)?;
            let (x_dev, _) = upload(&gpu, &x, dtype)?;
            let mut codes = GpuRowCodes::new(&gpu, rows + 3, h)?;
            let mut out = nan_tensor(&gpu, dtype, rows * h)?;
            cuda::rms_norm(&gpu, x_dev.view(), w.view(), 1e-6, out.view_mut(), Some(codes.rows_mut(rows)))?;
            check_row_codes(&what("rms_norm"), &gpu, &codes, &out, rows, h);
            let res = GpuTensor::from_f32(&gpu, &residual, DType::F32)?;
            cuda::rms_norm(&gpu, res.view(), w.view(), 1e-6, out.view_mut(), Some(codes.rows_mut(rows)))?;
            check_row_codes(&what("rms_norm from f32"), &gpu, &codes, &out, rows, h);
            for residual_dtype in [DType::F32, dtype] {
                let mut res = GpuTensor::from_f32(&gpu, &residual, residual_dtype)?;
                let codes_mut = Some(codes.rows_mut(rows));
                cuda::add_rms_norm(&gpu, res.view_mut(), x_dev.view(), w.view(), 1e-5, out.view_mut(), codes_mut)?;
                check_row_codes(
                    &what(&format!("add_rms_norm {residual_dtype:?} residual")),
                    &gpu,
                    &codes,
                    &out,
                    rows,
                    h,
                );
                let mut x_normed = GpuTensor::from_f32(&gpu, &x, dtype)?;
                let (res, x_view, out_view) = (res.view_mut(), x_normed.view_mut(), out.view_mut());
                let codes_mut = Some(codes.rows_mut(rows));
                cuda::add_normed_rms_norm(&gpu, res, x_view, x_w.view(), w.view(), 1e-6, out_view, codes_mut)?;
                check_row_codes(&what("add_normed_rms_norm"), &gpu, &codes, &out, rows, h);
            }
            let inter = h;
            let (gate_up, _) = upload(&gpu, &random_vec(&mut rng, rows * 2 * inter, 3.0), dtype)?;
            for act in [cuda::GatedActivation::Silu, cuda::GatedActivation::GeluTanh] {
                let (out_view, codes_mut) = (out.view_mut(), Some(codes.rows_mut(rows)));
                cuda::gated_activation(&gpu, act, gate_up.view(), inter, out_view, codes_mut)?;
                check_row_codes(&what(&format!("{act:?} and mul")), &gpu, &codes, &out, rows, inter);
            }
            // The FP8 GEMM over these codes, against the same product quantizing `out` itself.
            if h % 16 == 0 {
                let n = 256;
                let wq = Fp8Matrix::quantize_rows(&HostTensor::from_f32(vec![n, h], random_vec(&mut rng, n * h, 1.0)));
                let w_dev = GpuFp8Matrix::new(&gpu, &wq)?.expect("row scales over whole chunks");
                let mut scratch = GpuTensor::uninit(&gpu, dtype, n * h + rows * h)?;
                let mut ys = Vec::new();
                for x_codes in [None, Some(codes.rows(rows))] {
                    let mut y = nan_tensor(&gpu, dtype, rows * n)?;
                    let (x_view, w_view) = (out.view(), w_dev.view());
                    cuda::linear_fp8(&gpu, &gemms, x_view, rows, w_view, n, None, y.view_mut(), &mut scratch, x_codes)?;
                    ys.push(y.to_f32_vec(&gpu)?);
                }
                let same = ys[0].iter().zip(&ys[1]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{}: the FP8 GEMM over the fused codes differs", what("linear_fp8"));
            }
        }
        // A gated FP8 product writes its output's codes, through the GEMV (up to 4 rows) or the
        // GEMM and the activation.
        let (k, inter) = (512, 384);
        let wq = Fp8Matrix::quantize_rows(&HostTensor::from_f32(
            vec![2 * inter, k],
            random_vec(&mut rng, 2 * inter * k, 1.0),
        ));
        let w_dev = GpuFp8Matrix::new(&gpu, &wq)?.expect("row scales over whole chunks");
        for m in [3, 20] {
            let (x_dev, _) = upload(&gpu, &random_vec(&mut rng, m * k, 1.0), dtype)?;
            let mut scratch = GpuTensor::uninit(&gpu, dtype, 2 * inter * k + m * k)?;
            let mut gate_up = nan_tensor(&gpu, dtype, m * 2 * inter)?;
            let mut out = nan_tensor(&gpu, dtype, m * inter)?;
            let mut codes = GpuRowCodes::new(&gpu, m, inter)?;
            let fp8 = cuda::Fp8Operands { scratch: &mut scratch, x_codes: None };
            let gated =
                cuda::GatedOut { gate_up: gate_up.view_mut(), out: out.view_mut(), codes: Some(codes.rows_mut(m)) };
            let (x_view, w_view, act) = (x_dev.view(), w_dev.view(), cuda::GatedActivation::Silu);
            cuda::linear_gated_fp8(&gpu, &gemms, x_view, m, w_view, inter, None, act, fp8, gated)?;
            check_row_codes(&format!("linear_gated_fp8 {dtype:?} m={m}"), &gpu, &codes, &out, m, inter);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// FP8 KV cache

/// `reshape_and_cache_fp8` writes the codes the CPU's FP8 store writes (`e4m3(x / scale)`, ties
/// to even, saturating: the large values here pass 448 times the scale), and only the slots the
/// mapping names.
#[test]
fn reshape_and_cache_fp8_writes_the_cpus_codes() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(51);
    let (kv_width, num_slots, scales) = (2 * 64, 64, (0.01f32, 0.03f32));
    let slots: [i64; 7] = [17, -1, 0, 63, -1, 5, 40];
    let slots_dev = gpu.upload(&slots)?;
    let k = random_vec(&mut rng, slots.len() * kv_width, 6.0);
    let v = random_vec(&mut rng, slots.len() * kv_width, 1.0);
    for (dtype, _) in DTYPES {
        let (k_dev, k_r) = upload(&gpu, &k, dtype)?;
        let (v_dev, v_r) = upload(&gpu, &v, dtype)?;
        // A sentinel code (0x55) shows which slots were written.
        let mut k_codes = gpu.upload(&vec![0x55u8; num_slots * kv_width])?;
        let mut v_codes = gpu.upload(&vec![0x55u8; num_slots * kv_width])?;
        let len = num_slots * kv_width;
        let k_cache = cuda::Fp8CacheMut::new(&gpu, &mut k_codes, len, scales.0);
        let v_cache = cuda::Fp8CacheMut::new(&gpu, &mut v_codes, len, scales.1);
        cuda::reshape_and_cache_fp8(&gpu, k_dev.view(), v_dev.view(), &slots_dev, kv_width, k_cache, v_cache)?;
        let mut kc = cpu::KvStore::Fp8 { codes: vec![0x55; num_slots * kv_width], scale: scales.0 };
        let mut vc = cpu::KvStore::Fp8 { codes: vec![0x55; num_slots * kv_width], scale: scales.1 };
        cpu::reshape_and_cache_into(&k_r, &v_r, &slots, kv_width, &mut kc, &mut vc);
        let codes = |store: &cpu::KvStore| match store {
            cpu::KvStore::Fp8 { codes, .. } => codes.clone(),
            cpu::KvStore::F32(_) => unreachable!("an FP8 store"),
        };
        assert_eq!(gpu.download(&k_codes)?, codes(&kc), "{dtype:?} k codes");
        assert_eq!(gpu.download(&v_codes)?, codes(&vc), "{dtype:?} v codes");
        assert!(codes(&kc).iter().any(|&c| c & 0x7f == 0x7e), "some K values saturate");
    }
    Ok(())
}

/// Attention over FP8 caches against the CPU's over the same codes: decodes (the tensor-core
/// decode kernel in bf16 and f16, the CUDA-core one in f32, their contexts split or not), mixed
/// prefill and decode batches (the tensor-core prefill kernel in bf16 and f16), the decodes with
/// a hint past one row (the decode kernels too: a batch's leading one-row requests take them),
/// and the general kernel on all of them, with GQA (up to 12 query heads a KV head: the decode
/// kernel's second 8 rows) and a sliding window. In bf16 and f16, query heads differ in size by
/// factors of 16, so that the decode kernel's per-row scaling of Q into halves differs from row
/// to row.
///
/// The tensor-core prefill kernel (picked in bf16 and f16 past one row, but for a batch's leading
/// decodes, which take the decode kernel) converts each code to its value times the cache's scale
/// rounded to the activations' dtype before its arithmetic: its rows' reference is the CPU's
/// attention over those values, and the dense kernels over them must give what it gives. The other kernels compute with the codes' values as the CPU reads them (the tensor-core
/// decode kernel takes them as exact halves and applies the scales in f32), and are held to the
/// CPU over the codes: a kernel that rounded each K/V value to bf16 would miss, since a short
/// context's output, a sum of few values that cancel, can move by 10 % of itself.
#[test]
fn paged_attention_over_fp8_caches_matches_cpu() -> Result<(), GpuError> {
    let Some(gpu) = gpu_or_skip() else { return Ok(()) };
    let mut rng = rng(53);
    let block_size = 16;
    let scales = (0.004f32, 0.006f32);
    let attention = PagedAttention::new(&gpu)?;
    let mut failures = Vec::new();
    // Head sizes of every kernel form: 128 and 64 (all tensor-core), 80 and 96 (tensor-core decode
    // with loads of 2 and 4 codes; no CUDA-core decode), 256 (CUDA-core decode, the prefill
    // kernel's Q in shared memory).
    let all_heads = [
        Heads { num_heads: 8, num_kv_heads: 2, head_dim: 128 },
        Heads { num_heads: 4, num_kv_heads: 4, head_dim: 64 },
        Heads { num_heads: 4, num_kv_heads: 2, head_dim: 80 },
        Heads { num_heads: 12, num_kv_heads: 1, head_dim: 96 },
        Heads { num_heads: 2, num_kv_heads: 1, head_dim: 256 },
    ];
    for heads in all_heads {
        let batches = [(&DECODES[..], None), (&MIXED[..], None), (&DECODES_FIRST[..], None), (&DECODES[..], Some(40))];
        for (requests, window) in batches {
            for (dtype, tol) in DTYPES {
                let mut batch = Batch::random(&mut rng, heads, requests, block_size, dtype);
                // Query heads of three sizes (powers of two apart: the values stay the dtype's),
                // where the decode kernel scales Q's rows into halves. Not in f32: scores 16 times
                // larger put two f32 summation orders 1e-4 to 6e-4 apart on these outputs.
                if dtype != DType::F32 {
                    for (i, row) in batch.q.chunks_mut(heads.head_dim).enumerate() {
                        let factor = [0.0625f32, 1.0, 16.0][i % heads.num_heads % 3];
                        row.iter_mut().for_each(|x| *x *= factor);
                    }
                }
                // The caches as FP8 codes (NaN slots no request owns stay NaN codes, never read).
                let encode = |values: &[f32], scale: f32| -> Vec<u8> {
                    values.iter().map(|&x| ferrolm_backend::fp8::f32_to_e4m3(x / scale)).collect()
                };
                let (k_codes, v_codes) = (encode(&batch.k_cache, scales.0), encode(&batch.v_cache, scales.1));
                let kc = cpu::KvView::Fp8 { codes: &k_codes, scale: scales.0 };
                let vc = cpu::KvView::Fp8 { codes: &v_codes, scale: scales.1 };
                let want = cpu_attention_over(&batch, heads, block_size, window, None, kc, vc);

                let indices = BatchIndices::upload(&gpu, &batch)?;
                let (k_dev, v_dev) = (gpu.upload(&k_codes)?, gpu.upload(&v_codes)?);
                let q = GpuTensor::from_f32(&gpu, &batch.q, dtype)?;
                // The caches as the FP8 kernels convert them before their arithmetic: each code
                // times its scale, rounded to the dtype.
                let converted = |codes: &[u8], scale: f32| -> Vec<f32> {
                    let values: Vec<f32> =
                        codes.iter().map(|&c| ferrolm_backend::fp8::e4m3_to_f32(c) * scale).collect();
                    rounded(&values, dtype)
                };
                let (k_vals, v_vals) = (converted(&k_codes, scales.0), converted(&v_codes, scales.1));
                let (kv, vv) = (cpu::KvView::F32(&k_vals), cpu::KvView::F32(&v_vals));
                let want_converted = cpu_attention_over(&batch, heads, block_size, window, None, kv, vv);
                let (k_conv, v_conv) = (upload(&gpu, &k_vals, dtype)?.0, upload(&gpu, &v_vals, dtype)?.0);
                // The leading one-row requests' output values, which the decode kernels take.
                let token_width = heads.num_heads * heads.head_dim;
                let leading = batch.query_start_loc.windows(2).take_while(|w| w[1] - w[0] == 1).count() * token_width;
                // The batch's own hint, and (decodes) a hint past 1.
                let hints = if batch.max_query_len <= 1 { vec![1, 2] } else { vec![batch.max_query_len] };
                let runs = hints.into_iter().flat_map(|hint| [(PICKED, hint), (AttentionKernel::General, hint)]);
                for (kernel, max_query_len) in runs {
                    let work = Default::default();
                    let gpu_meta = indices.meta(&batch, heads, block_size, window, None, max_query_len, &work);
                    let len = k_codes.len();
                    let (k_cache, v_cache) = (
                        cuda::Fp8Cache::new(&gpu, &k_dev, len, scales.0),
                        cuda::Fp8Cache::new(&gpu, &v_dev, len, scales.1),
                    );
                    let mut out = nan_tensor(&gpu, dtype, batch.q.len())?;
                    let out_view = out.view_mut();
                    attention.run_fp8_on(kernel, &gpu, q.view(), k_cache, v_cache, &gpu_meta, heads, out_view)?;
                    let mut dense = nan_tensor(&gpu, dtype, batch.q.len())?;
                    let (kd, vd) = (k_conv.view(), v_conv.view());
                    attention.run_on(kernel, &gpu, q.view(), kd, vd, &gpu_meta, heads, dense.view_mut())?;
                    let got = out.to_f32_vec(&gpu)?;
                    assert!(got.iter().all(|x| x.is_finite()), "FP8 paged_attention: a value not finite");
                    // The rows (from the first) computed with the codes' values: all but where the
                    // prefill kernel takes the batch, there the leading decodes only.
                    let prefill = dtype != DType::F32 && kernel == PICKED && max_query_len > 1;
                    let exact = if prefill { leading } else { got.len() };
                    let dense = dense.to_f32_vec(&gpu)?;
                    let (vs_codes, _) = worst_relative_error(&got[..exact], &want[..exact]);
                    let (vs_converted, _) = worst_relative_error(&got[exact..], &want_converted[exact..]);
                    // The same values through the dense kernels (where the FP8 kernel rounds them
                    // as these hold them): the same arithmetic, within an output rounding.
                    let (vs_dense, _) = worst_relative_error(&got[exact..], &dense[exact..]);
                    let dense_tol = match dtype {
                        DType::BF16 => 1.0 / 128.0,
                        DType::F16 => 1.0 / 1024.0,
                        _ => 1e-5,
                    };
                    let what = format!(
                        "FP8 paged_attention {kernel:?} {dtype:?} {heads:?} window {window:?} hint {max_query_len}: \
                         {} rows over the codes in f32, {vs_codes:.2e} from the CPU; {} over them rounded to the \
                         dtype, {vs_converted:.2e} from the CPU and {vs_dense:.2e} from the dense kernels",
                        exact / token_width,
                        (got.len() - exact) / token_width
                    );
                    eprintln!("{what}");
                    if vs_codes > tol || vs_converted > tol || vs_dense > dense_tol {
                        failures.push(what);
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} cases out of bounds:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}
