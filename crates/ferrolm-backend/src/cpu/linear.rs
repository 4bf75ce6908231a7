//! `linear`: `y = x · w^T (+ bias)` with f32 activations and weights in their storage dtype.
//!
//! Two strategies, both parallel over blocks of output columns (= weight rows), so each weight
//! element is read from memory by exactly one thread:
//! - decode-sized `m` ([`linear_gemv`]): weights are widened in registers and streamed once;
//!   the op is bound by memory bandwidth.
//! - prefill-sized `m` ([`linear_gemm`]): a block of weight rows is widened into a thread-local
//!   f32 scratch and multiplied with faer; the op is bound by arithmetic.

use std::cell::RefCell;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

use super::gemv::gemv_block;
use super::weights::{widen_into, Isa, WeightElem};
use crate::WeightView;

/// Largest `m` served by the GEMV path; above it weight reuse makes the GEMM path faster.
pub const GEMV_MAX_M: usize = 8;
/// Weight rows per parallel task of the GEMV path (a multiple of its 4-row tile).
const GEMV_BLOCK_ROWS: usize = 64;
/// Weight rows widened per parallel task of the GEMM path.
const GEMM_BLOCK_ROWS: usize = 128;

/// `y[m, n] = x[m, k] · w[n, k]^T (+ bias[n])`. `w` is in its storage dtype (HF layout `[out, in]`).
pub fn linear(x: &[f32], m: usize, k: usize, w: WeightView<'_>, n: usize, bias: Option<&[f32]>, y: &mut [f32]) {
    if m <= GEMV_MAX_M {
        linear_gemv(x, m, k, w, n, bias, y);
    } else {
        linear_gemm(x, m, k, w, n, bias, y);
    }
}

/// [`linear`] through the matrix-vector path, whatever `m` (exposed for benchmarks).
pub fn linear_gemv(x: &[f32], m: usize, k: usize, w: WeightView<'_>, n: usize, bias: Option<&[f32]>, y: &mut [f32]) {
    gemv_with(Isa::detect(), x, m, k, w, n, bias, y);
}

/// [`linear`] through the widen-then-GEMM path, whatever `m` (exposed for benchmarks).
pub fn linear_gemm(x: &[f32], m: usize, k: usize, w: WeightView<'_>, n: usize, bias: Option<&[f32]>, y: &mut [f32]) {
    gemm_with(Isa::detect(), x, m, k, w, n, bias, y);
}

fn check_shapes(x: &[f32], m: usize, k: usize, w: &WeightView<'_>, n: usize, bias: Option<&[f32]>, y: &[f32]) {
    assert_eq!(x.len(), m * k, "linear: x has {} elements, expected [m={m}, k={k}]", x.len());
    assert_eq!(w.len(), n * k, "linear: w has {} elements, expected [n={n}, k={k}]", w.len());
    assert_eq!(y.len(), m * n, "linear: y has {} elements, expected [m={m}, n={n}]", y.len());
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "linear: bias has {} elements, expected [n={n}]", b.len());
    }
}

#[allow(clippy::too_many_arguments)]
fn gemv_with(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightView<'_>,
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    check_shapes(x, m, k, &w, n, bias, y);
    match w {
        WeightView::F32(w) => gemv_typed(isa, x, m, k, w, n, bias, y),
        WeightView::F16(w) => gemv_typed(isa, x, m, k, w, n, bias, y),
        WeightView::BF16(w) => gemv_typed(isa, x, m, k, w, n, bias, y),
    }
}

#[allow(clippy::too_many_arguments)]
fn gemv_typed<E: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[E],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    // [m, n]
    let y = MatMut::from_row_major_slice_mut(y, m, n);
    y.par_col_chunks_mut(GEMV_BLOCK_ROWS).enumerate().for_each(|(b, y_block)| {
        let j0 = b * GEMV_BLOCK_ROWS;
        let rows = y_block.ncols();
        let w_block = &w[j0 * k..(j0 + rows) * k];
        let bias_block = bias.map(|b| &b[j0..j0 + rows]);
        gemv_block(isa, x, m, k, w_block, bias_block, y_block);
    });
}

thread_local! {
    /// `[GEMM_BLOCK_ROWS, k]`: the current weight block widened to f32.
    static WIDENED_BLOCK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

#[allow(clippy::too_many_arguments)]
fn gemm_with(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightView<'_>,
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    check_shapes(x, m, k, &w, n, bias, y);
    match w {
        WeightView::F32(w) => gemm_typed(isa, x, m, k, w, n, bias, y),
        WeightView::F16(w) => gemm_typed(isa, x, m, k, w, n, bias, y),
        WeightView::BF16(w) => gemm_typed(isa, x, m, k, w, n, bias, y),
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm_typed<E: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[E],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    // [m, k]
    let x = MatRef::from_row_major_slice(x, m, k);
    // [m, n]
    let y = MatMut::from_row_major_slice_mut(y, m, n);
    y.par_col_chunks_mut(GEMM_BLOCK_ROWS).enumerate().for_each(|(b, mut y_block)| {
        let j0 = b * GEMM_BLOCK_ROWS;
        let rows = y_block.ncols();
        WIDENED_BLOCK.with_borrow_mut(|scratch| {
            scratch.resize(rows * k, 0.0);
            widen_into(isa, &w[j0 * k..(j0 + rows) * k], scratch);
            // [rows, k]
            let w_block = MatRef::from_row_major_slice(scratch.as_slice(), rows, k);
            matmul(y_block.as_mut(), Accum::Replace, x, w_block.transpose(), 1.0, Par::Seq);
        });
        if let Some(bias) = bias {
            for j in 0..rows {
                for i in 0..m {
                    y_block[(i, j)] += bias[j0 + j];
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::cpu::testutil::{nan_vec, random_vec, rng};

    /// Weights of one dtype together with their exact f32 values.
    struct TestWeight {
        exact: Vec<f32>,
        bf16: Vec<bf16>,
        f16: Vec<f16>,
    }

    impl TestWeight {
        fn new(values: Vec<f32>) -> TestWeight {
            let bf16: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            let f16: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            TestWeight { exact: values, bf16, f16 }
        }

        /// The three storage dtypes and the f32 values each stores.
        fn views(&self) -> Vec<(WeightView<'_>, Vec<f32>)> {
            vec![
                (WeightView::F32(&self.exact), self.exact.clone()),
                (WeightView::BF16(&self.bf16), self.bf16.iter().map(|v| v.to_f32()).collect()),
                (WeightView::F16(&self.f16), self.f16.iter().map(|v| v.to_f32()).collect()),
            ]
        }
    }

    /// `y = x · w^T + bias` in f64, with `sum |x_i w_i| + |bias|` per element as the error scale.
    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, bias: Option<&[f32]>) -> (Vec<f64>, Vec<f64>) {
        let mut y = vec![0.0; m * n];
        let mut scale = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let b = bias.map_or(0.0, |b| b[j] as f64);
                let (mut sum, mut abs) = (b, b.abs());
                for t in 0..k {
                    let p = x[i * k + t] as f64 * w[j * k + t] as f64;
                    sum += p;
                    abs += p.abs();
                }
                y[i * n + j] = sum;
                scale[i * n + j] = abs;
            }
        }
        (y, scale)
    }

    type LinearFn = Box<dyn Fn(&[f32], usize, usize, WeightView<'_>, usize, Option<&[f32]>, &mut [f32])>;

    fn strategies() -> Vec<(String, LinearFn)> {
        let mut all: Vec<(String, LinearFn)> = vec![("linear".into(), Box::new(linear))];
        for isa in Isa::available() {
            all.push((
                format!("gemv/{isa:?}"),
                Box::new(move |x, m, k, w, n, b, y| gemv_with(isa, x, m, k, w, n, b, y)),
            ));
            all.push((
                format!("gemm/{isa:?}"),
                Box::new(move |x, m, k, w, n, b, y| gemm_with(isa, x, m, k, w, n, b, y)),
            ));
        }
        all
    }

    #[test]
    fn matches_reference_for_all_dtypes_shapes_and_paths() {
        let mut rng = rng(0x11_7ea2);
        let strategies = strategies();
        for &m in &[1, 3, 5, 17, 64] {
            for &k in &[7, 8, 33, 96, 1000] {
                for &n in &[1, 5, 130] {
                    let x = random_vec(&mut rng, m * k, 1.0);
                    let w = TestWeight::new(random_vec(&mut rng, n * k, 0.5));
                    let bias = random_vec(&mut rng, n, 1.0);
                    for (view, stored) in w.views() {
                        for bias in [None, Some(bias.as_slice())] {
                            let (want, scale) = reference(&x, m, k, &stored, n, bias);
                            for (name, f) in &strategies {
                                let mut y = nan_vec(m * n);
                                f(&x, m, k, view, n, bias, &mut y);
                                for e in 0..m * n {
                                    let err = (y[e] as f64 - want[e]).abs();
                                    assert!(
                                        err <= 1e-5 * scale[e].max(1e-30),
                                        "{name} {:?} m={m} k={k} n={n} bias={} at {e}: {} vs {}",
                                        view.dtype(),
                                        bias.is_some(),
                                        y[e],
                                        want[e]
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn empty_inner_dimension_gives_bias() {
        let bias = [1.0, -2.0, 3.0];
        for (name, f) in strategies() {
            let mut y = nan_vec(2 * 3);
            f(&[], 2, 0, WeightView::F32(&[]), 3, Some(&bias), &mut y);
            assert_eq!(y, [1.0, -2.0, 3.0, 1.0, -2.0, 3.0], "{name}");
            f(&[], 2, 0, WeightView::F32(&[]), 3, None, &mut y);
            assert_eq!(y, [0.0; 6], "{name}");
        }
    }

    #[test]
    #[should_panic(expected = "linear: w has")]
    fn rejects_mismatched_weight() {
        let mut y = [0.0; 2];
        linear(&[1.0; 4], 1, 4, WeightView::F32(&[0.0; 7]), 2, None, &mut y);
    }
}
