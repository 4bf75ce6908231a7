//! RMSNorm as Hugging Face computes it in f32: `x * rsqrt(mean(x^2) + eps)`, then times the
//! weight. Rows are `w.len()` wide; every op checks that its buffers hold whole rows.

use rayon::prelude::*;

use super::PARALLEL_MIN_ELEMS;

/// Row-wise RMSNorm: `out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w`. `x`, `out`: `[rows, w.len()]`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = check_rows("rms_norm", x.len(), w);
    assert_eq!(out.len(), x.len(), "rms_norm: out has {} elements, x has {}", out.len(), x.len());
    let norm_row = |(o, x): (&mut [f32], &[f32])| normalize_into(x, w, eps, o);
    if x.len() < PARALLEL_MIN_ELEMS {
        out.chunks_mut(hidden).zip(x.chunks(hidden)).for_each(norm_row);
    } else {
        out.par_chunks_mut(hidden).zip(x.par_chunks(hidden)).for_each(norm_row);
    }
}

/// Fused residual add + RMSNorm: `residual += x; out = rms_norm(residual, w, eps)`.
pub fn add_rms_norm(residual: &mut [f32], x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = check_rows("add_rms_norm", residual.len(), w);
    assert_eq!(x.len(), residual.len(), "add_rms_norm: x has {} elements, residual {}", x.len(), residual.len());
    assert_eq!(out.len(), residual.len(), "add_rms_norm: out has {} elements, residual {}", out.len(), residual.len());
    let add_norm_row = |((r, x), o): ((&mut [f32], &[f32]), &mut [f32])| {
        for (r, &x) in r.iter_mut().zip(x) {
            *r += x;
        }
        normalize_into(r, w, eps, o);
    };
    if x.len() < PARALLEL_MIN_ELEMS {
        residual.chunks_mut(hidden).zip(x.chunks(hidden)).zip(out.chunks_mut(hidden)).for_each(add_norm_row);
    } else {
        residual
            .par_chunks_mut(hidden)
            .zip(x.par_chunks(hidden))
            .zip(out.par_chunks_mut(hidden))
            .for_each(add_norm_row);
    }
}

/// In-place row-wise RMSNorm over rows of `w.len()` (used per head for q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let hidden = check_rows("rms_norm_inplace", x.len(), w);
    let norm_row = |x: &mut [f32]| {
        let inv_rms = inv_rms(x, eps);
        for (x, &w) in x.iter_mut().zip(w) {
            *x = *x * inv_rms * w;
        }
    };
    if x.len() < PARALLEL_MIN_ELEMS {
        x.chunks_mut(hidden).for_each(norm_row);
    } else {
        x.par_chunks_mut(hidden).for_each(norm_row);
    }
}

/// Asserts that `len` elements are whole rows of `w.len()`; returns the row width.
fn check_rows(op: &str, len: usize, w: &[f32]) -> usize {
    assert!(!w.is_empty(), "{op}: empty weight");
    assert_eq!(len % w.len(), 0, "{op}: {len} elements are not whole rows of {}", w.len());
    w.len()
}

fn normalize_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv_rms = inv_rms(x, eps);
    for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
        *o = x * inv_rms * w;
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, the sum of squares kept in f32 with eight partial sums.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] += c[l] * c[l];
        }
    }
    let sum_sq = acc.iter().sum::<f32>() + chunks.remainder().iter().map(|v| v * v).sum::<f32>();
    1.0 / (sum_sq / x.len() as f32 + eps).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, nan_vec, random_vec, rng};

    fn reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let h = w.len();
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks(h) {
            let mean_sq = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / h as f64;
            let inv = 1.0 / (mean_sq + eps as f64).sqrt();
            out.extend(row.iter().zip(w).map(|(&v, &w)| (v as f64 * inv * w as f64) as f32));
        }
        out
    }

    /// Small rows go through the sequential path, large ones through the parallel one.
    const SHAPES: [(usize, usize); 4] = [(1, 7), (3, 64), (5, 896), (40, 1000)];

    #[test]
    fn rms_norm_matches_reference() {
        let mut rng = rng(1);
        for (rows, h) in SHAPES {
            let x = random_vec(&mut rng, rows * h, 3.0);
            let w = random_vec(&mut rng, h, 2.0);
            let mut out = nan_vec(rows * h);
            rms_norm(&x, &w, 1e-6, &mut out);
            assert_close(&out, &reference(&x, &w, 1e-6), 1e-5, "rms_norm");
        }
    }

    #[test]
    fn eps_matters_for_small_inputs() {
        let x = [1e-3f32; 4];
        let w = [1.0f32; 4];
        let mut out = nan_vec(4);
        rms_norm(&x, &w, 1e-6, &mut out);
        assert_close(&out, &reference(&x, &w, 1e-6), 1e-5, "rms_norm eps");
        assert!(out[0] < 0.71, "eps was ignored: {}", out[0]);
    }

    #[test]
    fn add_rms_norm_updates_residual_and_normalizes_it() {
        let mut rng = rng(2);
        for (rows, h) in SHAPES {
            let residual = random_vec(&mut rng, rows * h, 3.0);
            let x = random_vec(&mut rng, rows * h, 3.0);
            let w = random_vec(&mut rng, h, 2.0);
            let sum: Vec<f32> = residual.iter().zip(&x).map(|(a, b)| a + b).collect();
            let mut res = residual.clone();
            let mut out = nan_vec(rows * h);
            add_rms_norm(&mut res, &x, &w, 1e-5, &mut out);
            assert_eq!(res, sum, "residual");
            assert_close(&out, &reference(&sum, &w, 1e-5), 1e-5, "add_rms_norm");
        }
    }

    #[test]
    fn rms_norm_inplace_matches_reference() {
        let mut rng = rng(3);
        for (rows, h) in SHAPES {
            let x = random_vec(&mut rng, rows * h, 3.0);
            let w = random_vec(&mut rng, h, 2.0);
            let mut y = x.clone();
            rms_norm_inplace(&mut y, &w, 1e-6);
            assert_close(&y, &reference(&x, &w, 1e-6), 1e-5, "rms_norm_inplace");
        }
    }

    #[test]
    #[should_panic(expected = "not whole rows")]
    fn rejects_partial_rows() {
        rms_norm(&[0.0; 10], &[1.0; 4], 1e-6, &mut [0.0; 10]);
    }
}
