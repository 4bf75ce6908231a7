//! `linear`: `y = x · w^T (+ bias)` with f32 activations and weights in their storage dtype.
//!
//! Two strategies, both parallel over blocks of output columns (= weight rows), so each weight
//! element is read from memory by exactly one thread:
//! - decode-sized `m` ([`linear_gemv`]): weights are widened in registers and streamed once;
//!   the op is bound by memory bandwidth.
//! - prefill-sized `m` ([`linear_gemm`]): a block of weight rows is widened into a thread-local
//!   f32 scratch and multiplied with faer; the op is bound by arithmetic.

use std::cell::Cell;

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
/// Most weight rows widened per parallel task of the GEMM path.
const GEMM_BLOCK_ROWS: usize = 128;
/// Fewest weight rows per task of the GEMM path (below it `x` is re-read too often).
const GEMM_MIN_BLOCK_ROWS: usize = 32;
/// Fewest rows of `x` per task of the GEMM path.
const GEMM_MIN_CHUNK_ROWS: usize = 64;

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
    /// `[rows, k]`: the current weight block widened to f32. Taken out while in use, so a
    /// nested task stolen by the same thread finds it empty and allocates its own.
    static WIDENED_BLOCK: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// How the GEMM path splits `y[m, n]`: blocks of `cols` output columns (one widening of their
/// weight rows each), and within a block, chunks of `rows` rows of `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GemmTiling {
    cols: usize,
    rows: usize,
}

impl GemmTiling {
    /// Enough tasks to keep `threads` busy (about four each) without making blocks so narrow
    /// that the multiply stops reusing `x`: column blocks shrink from [`GEMM_BLOCK_ROWS`] down to
    /// [`GEMM_MIN_BLOCK_ROWS`] first, then rows are split, never below [`GEMM_MIN_CHUNK_ROWS`].
    fn new(m: usize, n: usize, threads: usize) -> GemmTiling {
        let wanted = 4 * threads.max(1);
        let cols = n.div_ceil(wanted).next_multiple_of(16).clamp(GEMM_MIN_BLOCK_ROWS, GEMM_BLOCK_ROWS);
        let col_blocks = n.div_ceil(cols);
        let row_chunks = wanted.div_ceil(col_blocks).min(m.div_ceil(GEMM_MIN_CHUNK_ROWS)).max(1);
        GemmTiling { cols, rows: m.div_ceil(row_chunks) }
    }
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
    let tiling = GemmTiling::new(m, n, rayon::current_num_threads());
    // [m, k]
    let x = MatRef::from_row_major_slice(x, m, k);
    // [m, n]
    let y = MatMut::from_row_major_slice_mut(y, m, n);
    y.par_col_chunks_mut(tiling.cols).enumerate().for_each(|(b, y_block)| {
        let j0 = b * tiling.cols;
        let cols = y_block.ncols();
        let mut scratch = WIDENED_BLOCK.take();
        scratch.resize(cols * k, 0.0);
        widen_into(isa, &w[j0 * k..(j0 + cols) * k], &mut scratch);
        // [cols, k]
        let w_block = MatRef::from_row_major_slice(scratch.as_slice(), cols, k);
        y_block.par_row_chunks_mut(tiling.rows).enumerate().for_each(|(c, mut y_chunk)| {
            let i0 = c * tiling.rows;
            let x_chunk = x.subrows(i0, y_chunk.nrows());
            matmul(y_chunk.as_mut(), Accum::Replace, x_chunk, w_block.transpose(), 1.0, Par::Seq);
            if let Some(bias) = bias {
                for j in 0..cols {
                    for i in 0..y_chunk.nrows() {
                        y_chunk[(i, j)] += bias[j0 + j];
                    }
                }
            }
        });
        WIDENED_BLOCK.set(scratch);
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
    fn gemm_tiling_keeps_threads_busy_within_bounds() {
        // Wide outputs: full-width blocks, rows unsplit.
        assert_eq!(GemmTiling::new(64, 151_936, 16), GemmTiling { cols: 128, rows: 64 });
        // Narrow outputs on many threads: narrower blocks, then row chunks for long prefills.
        assert_eq!(GemmTiling::new(64, 896, 16), GemmTiling { cols: 32, rows: 64 });
        assert_eq!(GemmTiling::new(2048, 896, 16), GemmTiling { cols: 32, rows: 683 });
        assert_eq!(GemmTiling::new(4096, 896, 64), GemmTiling { cols: 32, rows: 410 });
        // Two threads: blocks as wide as the task count allows.
        assert_eq!(GemmTiling::new(64, 896, 2), GemmTiling { cols: 112, rows: 64 });
        assert_eq!(GemmTiling::new(9, 5, 2), GemmTiling { cols: 32, rows: 9 });
    }

    #[test]
    fn gemm_matches_reference_when_split_over_rows_and_columns() {
        // 300 rows and 70 columns on a pool of 8 threads: several row chunks and column blocks.
        let (m, k, n) = (300, 40, 70);
        let mut rng = rng(0x5917);
        let x = random_vec(&mut rng, m * k, 1.0);
        let w = random_vec(&mut rng, n * k, 0.5);
        let bias = random_vec(&mut rng, n, 1.0);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
        let tiling = pool.install(|| GemmTiling::new(m, n, rayon::current_num_threads()));
        assert!(tiling.rows < m && tiling.cols < n, "{tiling:?}");
        let mut y = nan_vec(m * n);
        pool.install(|| linear_gemm(&x, m, k, WeightView::F32(&w), n, Some(&bias), &mut y));
        let (want, scale) = reference(&x, m, k, &w, n, Some(&bias));
        for e in 0..m * n {
            assert!((y[e] as f64 - want[e]).abs() <= 1e-5 * scale[e], "at {e}: {} vs {}", y[e], want[e]);
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
