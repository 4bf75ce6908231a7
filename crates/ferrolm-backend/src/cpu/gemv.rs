//! Matrix-vector kernels for decode-sized batches: `y[i, j] = x[i, :] · w[j, :]` for a block of
//! weight rows and up to a handful of activation rows.
//!
//! Decode is bound by the bandwidth of reading the weights, so each weight element is loaded
//! from memory once, widened to f32 in registers, and used against every activation row while
//! it is there. Activations stay in L1. For one or two activation rows the weights are walked
//! row after row, a strictly sequential stream, with the dot product split over several
//! accumulators so the FMA chains are independent; with more activation rows, pairs of weight
//! rows share each activation load. Rows are prefetched well ahead of use.

use faer::MatMut;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::weights::{Isa, WeightElem};

/// `out[i, j] = x[i, :] · w[j, :] (+ bias[j])` with `x`: `[m, k]`, `w`: `[rows, k]`,
/// `out`: `[m, rows]` (any strides), `bias`: `[rows]`.
pub(crate) fn gemv_block<E: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[E],
    bias: Option<&[f32]>,
    out: MatMut<'_, f32>,
) {
    let rows = out.ncols();
    assert_eq!(x.len(), m * k, "gemv_block: x is not [m, k]");
    assert_eq!(w.len(), rows * k, "gemv_block: w is not [rows, k]");
    assert_eq!(out.nrows(), m, "gemv_block: out is not [m, rows]");
    if let Some(b) = bias {
        assert_eq!(b.len(), rows, "gemv_block: bias is not [rows]");
    }
    match isa {
        Isa::Scalar => gemv_scalar(x, m, k, w, bias, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed after the CPU was checked for it; shapes
        // were asserted above.
        Isa::Avx2 => unsafe { gemv_avx2(x, m, k, w, bias, out) },
    }
}

fn gemv_scalar<E: WeightElem>(x: &[f32], m: usize, k: usize, w: &[E], bias: Option<&[f32]>, mut out: MatMut<'_, f32>) {
    if k == 0 {
        // Keep `chunks_exact` below away from a zero chunk size.
        for j in 0..out.ncols() {
            for i in 0..m {
                out[(i, j)] = bias.map_or(0.0, |b| b[j]);
            }
        }
        return;
    }
    for (j, w_row) in w.chunks_exact(k).enumerate() {
        let b = bias.map_or(0.0, |b| b[j]);
        for (i, x_row) in x.chunks_exact(k).enumerate() {
            out[(i, j)] = dot_scalar(w_row, x_row) + b;
        }
    }
}

/// `w · x` with eight partial sums, so it vectorises without reassociation licence. Plain
/// multiply-add: `mul_add` would be a libm call on CPUs built without FMA.
fn dot_scalar<E: WeightElem>(w: &[E], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut w_chunks = w.chunks_exact(8);
    let mut x_chunks = x.chunks_exact(8);
    for (wc, xc) in (&mut w_chunks).zip(&mut x_chunks) {
        for l in 0..8 {
            acc[l] += wc[l].to_f32() * xc[l];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (&wv, &xv) in w_chunks.remainder().iter().zip(x_chunks.remainder()) {
        sum += wv.to_f32() * xv;
    }
    sum
}

/// Weight rows per outer step of the AVX2 kernel: every chunk of activation rows is applied to
/// them while they are in L1.
#[cfg(target_arch = "x86_64")]
const ROW_TILE: usize = 4;
/// Activation rows handled per pass over a row tile (more would spill the 16 ymm registers).
#[cfg(target_arch = "x86_64")]
const X_TILE: usize = 4;
/// How far ahead of the FMAs each weight row is prefetched. The hardware prefetchers alone leave
/// bf16 GEMV at ~75% of read bandwidth on some x86 parts, because the loop retires few bytes per
/// instruction; 2 KiB ahead covers the DRAM latency at the rate one core consumes weights.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 2048;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_avx2<E: WeightElem>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[E],
    bias: Option<&[f32]>,
    mut out: MatMut<'_, f32>,
) {
    let rows = out.ncols();
    let mut j = 0;
    while j < rows {
        let tile = ROW_TILE.min(rows - j);
        let w_tile = &w[j * k..(j + tile) * k];
        // The tile's rows are loaded from memory on the first pass and from L1 on the others.
        let mut i = 0;
        while i < m {
            let xs = X_TILE.min(m - i);
            let x_tile = &x[i * k..(i + xs) * k];
            // SAFETY: `w_tile` is `[tile, k]` and `x_tile` is `[xs, k]`.
            let sums = unsafe { tile_avx2_dispatch(w_tile, tile, x_tile, xs, k) };
            for r in 0..tile {
                let b = bias.map_or(0.0, |b| b[j + r]);
                for s in 0..xs {
                    out[(i + s, j + r)] = sums[r][s] + b;
                }
            }
            i += xs;
        }
        j += tile;
    }
}

/// Picks the register tiling for `tile` weight rows against `xs` activation rows.
/// Returns `sums[r][s] = w[r, :] · x[s, :]` in the top-left `[tile, xs]` corner.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2_dispatch<E: WeightElem>(
    w: &[E],
    tile: usize,
    x: &[f32],
    xs: usize,
    k: usize,
) -> [[f32; X_TILE]; ROW_TILE] {
    let mut sums = [[0.0f32; X_TILE]; ROW_TILE];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    // SAFETY (all calls): each kernel reads `R` rows of `w` and `M` rows of `x` of length `k`,
    // with `R <= tile` and `M <= xs` as the slices hold.
    unsafe {
        match (tile, xs) {
            (_, 1) => {
                for r in 0..tile {
                    copy(&mut sums, r, &tile_avx2::<E, 1, 1, 4>(wp.add(r * k), xp, k));
                }
            }
            (_, 2) => {
                for r in 0..tile {
                    copy(&mut sums, r, &tile_avx2::<E, 1, 2, 2>(wp.add(r * k), xp, k));
                }
            }
            (_, 3) => {
                for r in (0..tile).step_by(2) {
                    if r + 2 <= tile {
                        copy(&mut sums, r, &tile_avx2::<E, 2, 3, 1>(wp.add(r * k), xp, k));
                    } else {
                        copy(&mut sums, r, &tile_avx2::<E, 1, 3, 1>(wp.add(r * k), xp, k));
                    }
                }
            }
            _ => {
                for r in (0..tile).step_by(2) {
                    if r + 2 <= tile {
                        copy(&mut sums, r, &tile_avx2::<E, 2, 4, 1>(wp.add(r * k), xp, k));
                    } else {
                        copy(&mut sums, r, &tile_avx2::<E, 1, 4, 1>(wp.add(r * k), xp, k));
                    }
                }
            }
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn copy<const R: usize, const M: usize>(sums: &mut [[f32; X_TILE]; ROW_TILE], row: usize, part: &[[f32; M]; R]) {
    for (r, part_row) in part.iter().enumerate() {
        sums[row + r][..M].copy_from_slice(part_row);
    }
}

/// `R x M` dot products of `R` weight rows at `w` (row stride `k`) with `M` activation rows at
/// `x` (row stride `k`), eight lanes at a time. Each pair gets `U` accumulators over interleaved
/// 8-wide steps, so that the chains of dependent FMAs stay short when `R * M` is small.
///
/// # Safety
/// `w..w + R * k` and `x..x + M * k` must be readable; the CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<E: WeightElem, const R: usize, const M: usize, const U: usize>(
    w: *const E,
    x: *const f32,
    k: usize,
) -> [[f32; M]; R] {
    let mut acc = [[[_mm256_setzero_ps(); M]; R]; U];
    let mut c = 0;
    // SAFETY (both loops): `c + 8 * U <= k` resp. `c + 8 <= k`, so every read of row `s` of `x`
    // (`s * k + c + ..`) and of row `r` of `w` stays inside that row.
    while c + 8 * U <= k {
        // One prefetch per cache line: every step when a step covers a line or more, else on
        // the steps that enter a new line.
        let step_bytes = 8 * U * size_of::<E>();
        if (c * size_of::<E>()) % 64 < step_bytes {
            for r in 0..R {
                let ahead = w.wrapping_add(r * k + c).cast::<i8>().wrapping_add(PREFETCH_BYTES);
                for line in (0..step_bytes).step_by(64) {
                    // Prefetching is a hint: it never faults, so the address may run past `w`.
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
                }
            }
        }
        for (u, acc_u) in acc.iter_mut().enumerate() {
            unsafe { fma_step::<E, R, M>(w, x, k, c + 8 * u, acc_u) };
        }
        c += 8 * U;
    }
    while c + 8 <= k {
        unsafe { fma_step::<E, R, M>(w, x, k, c, &mut acc[0]) };
        c += 8;
    }
    let mut sums = [[0.0f32; M]; R];
    for r in 0..R {
        for s in 0..M {
            let mut v = acc[0][r][s];
            for acc_u in &acc[1..] {
                v = _mm256_add_ps(v, acc_u[r][s]);
            }
            let mut sum = hsum(v);
            for t in c..k {
                // SAFETY: `t < k`, so both reads are inside row `r` of `w` and row `s` of `x`.
                let (wv, xv) = unsafe { ((*w.add(r * k + t)).to_f32(), *x.add(s * k + t)) };
                sum = wv.mul_add(xv, sum);
            }
            sums[r][s] = sum;
        }
    }
    sums
}

/// `acc[r][s] += w[r, c..c + 8] * x[s, c..c + 8]` lane-wise.
///
/// # Safety
/// `c + 8 <= k` and the pointers as in [`tile_avx2`].
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fma_step<E: WeightElem, const R: usize, const M: usize>(
    w: *const E,
    x: *const f32,
    k: usize,
    c: usize,
    acc: &mut [[__m256; M]; R],
) {
    let mut xv = [_mm256_setzero_ps(); M];
    for (s, v) in xv.iter_mut().enumerate() {
        // SAFETY: the caller keeps `c + 8 <= k`.
        *v = unsafe { _mm256_loadu_ps(x.add(s * k + c)) };
    }
    for (r, acc_row) in acc.iter_mut().enumerate() {
        // SAFETY: as above.
        let wv = unsafe { E::load8(w.add(r * k + c)) };
        for (a, &xs) in acc_row.iter_mut().zip(&xv) {
            *a = _mm256_fmadd_ps(wv, xs, *a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    let single = _mm_add_ss(pair, _mm_shuffle_ps::<0b01>(pair, pair));
    _mm_cvtss_f32(single)
}
