//! FP8 (e4m3) weight matrices in host memory: a quantized checkpoint's codes with their scales,
//! as compressed-tensors and the block-wise `fp8` format store them, or as ferrolm quantizes a
//! matrix at load (`--quantization fp8`).
//!
//! Invariants: a matrix holds `rows * cols` codes, row-major; element `(r, c)` stands for
//! `f32(code) * scale(r, c)`, the product rounded once in f32, where the scale is the matrix's,
//! row `r`'s or the block's that holds `(r, c)` ([`Fp8Scales`]). That value is what the CPU
//! computes with ([`Fp8Matrix::dequantize`]) and what the FP8 reference fixtures were made from.

use float8::F8E4M3;
use rayon::prelude::*;

use crate::HostTensor;

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The smallest scale a quantizer gives a row, so that an all-zero row divides by no zero (the
/// floor vLLM's dynamic FP8 quantization takes).
const MIN_SCALE: f32 = 1.0 / (E4M3_MAX * 512.0);

/// Every e4m3 code's f32 value, by code (the CPU's FP8 KV cache decodes each row it reads).
static E4M3_VALUES: [f32; 256] = {
    let mut values = [0.0; 256];
    let mut code = 0;
    while code < 256 {
        values[code] = F8E4M3::from_bits(code as u8).to_f32();
        code += 1;
    }
    values
};

/// The f32 value of an e4m3 code (exact; NaN for the two NaN codes).
#[inline(always)]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_VALUES[code as usize]
}

/// `x` rounded to the nearest e4m3 value (ties to even), saturating at ±[`E4M3_MAX`], as CUDA's
/// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` rounds.
pub fn f32_to_e4m3(x: f32) -> u8 {
    F8E4M3::from_f32(x).to_bits()
}

/// Where a quantized matrix's scales apply.
#[derive(Clone, Debug, PartialEq)]
pub enum Fp8Scales {
    /// One scale for the whole matrix (compressed-tensors' `tensor` strategy).
    Tensor(f32),
    /// `[rows]`: one scale per output row (the `channel` strategy, and `--quantization fp8`).
    Rows(Vec<f32>),
    /// `[ceil(rows / block_rows), ceil(cols / block_cols)]`, row-major: one scale per block of
    /// `block_rows x block_cols` (the `fp8` format's `weight_block_size`), the last blocks of a
    /// row or column partial.
    Blocks { block_rows: usize, block_cols: usize, scales: Vec<f32> },
}

/// How the GPU's FP8 GEMM (the product of more rows than its FP8 GEMV takes) scales its two
/// operands, which its inputs are quantized to match (see [`Fp8Matrix::gemm_scaling`]).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Fp8GemmScaling {
    /// One scale per row of the weights (a tensor's or a channel's), the activations quantized
    /// per token.
    Rows,
    /// The weights' [`GEMM_BLOCK`]-square blocks (the block-wise `fp8` checkpoints'), the
    /// activations quantized per token and [`GEMM_BLOCK`] columns (DeepSeek-V3's scheme).
    Blocks,
}

/// The side of the weight blocks, and the width of the activation groups, of
/// [`Fp8GemmScaling::Blocks`].
pub const GEMM_BLOCK: usize = 128;

/// A `[rows, cols]` matrix of e4m3 codes and its scales.
#[derive(Clone, Debug)]
pub struct Fp8Matrix {
    rows: usize,
    cols: usize,
    codes: Vec<u8>,
    scales: Fp8Scales,
}

impl Fp8Matrix {
    /// Checks that `codes` and `scales` fit `[rows, cols]`; the message says what does not.
    pub fn new(rows: usize, cols: usize, codes: Vec<u8>, scales: Fp8Scales) -> Result<Fp8Matrix, String> {
        if codes.len() != rows * cols {
            return Err(format!("{} FP8 codes for a [{rows}, {cols}] matrix", codes.len()));
        }
        let expected = match &scales {
            Fp8Scales::Tensor(_) => 1,
            Fp8Scales::Rows(s) => {
                if s.len() != rows {
                    return Err(format!("{} row scales for {rows} rows", s.len()));
                }
                rows
            }
            Fp8Scales::Blocks { block_rows, block_cols, scales } => {
                if *block_rows == 0 || *block_cols == 0 {
                    return Err("a weight block of zero rows or columns".into());
                }
                let want = rows.div_ceil(*block_rows) * cols.div_ceil(*block_cols);
                if scales.len() != want {
                    return Err(format!(
                        "{} block scales for a [{rows}, {cols}] matrix in blocks of [{block_rows}, {block_cols}] \
                         (it needs {want})",
                        scales.len()
                    ));
                }
                want
            }
        };
        let all: &[f32] = match &scales {
            Fp8Scales::Tensor(s) => std::slice::from_ref(s),
            Fp8Scales::Rows(s) | Fp8Scales::Blocks { scales: s, .. } => s,
        };
        if let Some(bad) = all.iter().find(|s| !s.is_finite()) {
            return Err(format!("a scale of {bad} among {expected}"));
        }
        Ok(Fp8Matrix { rows, cols, codes, scales })
    }

    /// Per-row quantization, as `--quantization fp8` quantizes a checkpoint's matrix: row `r`'s
    /// scale is `max(amax_r / 448, MIN_SCALE)` and its codes `e4m3(w / scale)`, in f32.
    pub fn quantize_rows(w: &HostTensor) -> Fp8Matrix {
        let [_, cols] = w.shape() else { panic!("Fp8Matrix::quantize_rows: a matrix of shape {:?}", w.shape()) };
        let Fp8Matrix { rows, cols, codes, scales } = Fp8Matrix::quantize_blocks(w, 1, (*cols).max(1));
        let Fp8Scales::Blocks { scales, .. } = scales else { unreachable!("quantize_blocks gives blocks") };
        Fp8Matrix { rows, cols, codes, scales: Fp8Scales::Rows(scales) }
    }

    /// Quantization in blocks of `block_rows x block_cols` (the last of a row or column partial),
    /// as the block-wise `fp8` checkpoints are quantized (128 x 128), and as the FP8 GEMM over
    /// such weights quantizes its activations (1 x 128: per token and 128 columns): each block's
    /// scale is `max(amax / 448, MIN_SCALE)` and its codes `e4m3(w / scale)`, in f32.
    pub fn quantize_blocks(w: &HostTensor, block_rows: usize, block_cols: usize) -> Fp8Matrix {
        let [rows, cols] = w.shape() else { panic!("Fp8Matrix::quantize_blocks: a matrix of shape {:?}", w.shape()) };
        let (rows, cols) = (*rows, *cols);
        assert!(block_rows > 0 && block_cols > 0, "Fp8Matrix::quantize_blocks: blocks of {block_rows} x {block_cols}");
        let values = w.to_f32_vec();
        let grid_cols = cols.div_ceil(block_cols);
        // Each block row's amax per block column, then its scales.
        let mut scales = vec![0.0f32; rows.div_ceil(block_rows) * grid_cols];
        scales.par_chunks_mut(grid_cols.max(1)).enumerate().for_each(|(br, scales)| {
            let block = &values[br * block_rows * cols..((br + 1) * block_rows).min(rows) * cols];
            for row in block.chunks(cols.max(1)) {
                for (s, piece) in scales.iter_mut().zip(row.chunks(block_cols)) {
                    *s = piece.iter().fold(*s, |m, x| m.max(x.abs()));
                }
            }
            for s in scales.iter_mut() {
                *s = (*s / E4M3_MAX).max(MIN_SCALE);
            }
        });
        let mut codes = vec![0u8; rows * cols];
        codes.par_chunks_mut(cols.max(1)).zip(values.par_chunks(cols.max(1))).enumerate().for_each(
            |(r, (codes, row))| {
                let scales = &scales[(r / block_rows) * grid_cols..];
                for (c, (code, &x)) in codes.iter_mut().zip(row).enumerate() {
                    *code = f32_to_e4m3(x / scales[c / block_cols]);
                }
            },
        );
        Fp8Matrix { rows, cols, codes, scales: Fp8Scales::Blocks { block_rows, block_cols, scales } }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `[rows, cols]`, row-major.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    pub fn scales(&self) -> &Fp8Scales {
        &self.scales
    }

    /// The scale of element `(r, c)`.
    pub fn scale(&self, r: usize, c: usize) -> f32 {
        match &self.scales {
            Fp8Scales::Tensor(s) => *s,
            Fp8Scales::Rows(s) => s[r],
            Fp8Scales::Blocks { block_rows, block_cols, scales } => {
                scales[(r / block_rows) * self.cols.div_ceil(*block_cols) + c / block_cols]
            }
        }
    }

    /// The scales as one block grid, whatever the strategy: `(block_rows, block_cols, scales)`,
    /// element `(r, c)` taking `scales[(r / block_rows) * ceil(cols / block_cols) + c / block_cols]`.
    /// A tensor scale is one block of the whole matrix, row scales blocks of one row.
    pub fn scale_grid(&self) -> (usize, usize, &[f32]) {
        let (rows, cols) = (self.rows.max(1), self.cols.max(1));
        match &self.scales {
            Fp8Scales::Tensor(s) => (rows, cols, std::slice::from_ref(s)),
            Fp8Scales::Rows(s) => (1, cols, s),
            Fp8Scales::Blocks { block_rows, block_cols, scales } => (*block_rows, *block_cols, scales),
        }
    }

    /// How an FP8 GEMM scales its product with this matrix (as stacked for the device), if one
    /// takes it: columns in whole 16-code chunks, and one scale per row, or blocks of
    /// [`GEMM_BLOCK`] x [`GEMM_BLOCK`] over whole blocks of columns. The GPU also needs its
    /// activations in bf16 or f16, a multiple of 16 output features, and cuBLASLt to offer the
    /// GEMM.
    pub fn gemm_scaling(&self) -> Option<Fp8GemmScaling> {
        let (block_rows, block_cols, _) = self.scale_grid();
        if !self.cols.is_multiple_of(16) {
            None
        } else if block_cols >= self.cols {
            Some(Fp8GemmScaling::Rows)
        } else if (block_rows, block_cols) == (GEMM_BLOCK, GEMM_BLOCK) && self.cols.is_multiple_of(GEMM_BLOCK) {
            Some(Fp8GemmScaling::Blocks)
        } else {
            None
        }
    }

    /// Activations `x` (`[m, k]`) quantized as an FP8 GEMM of `scaling` quantizes them: per token,
    /// or per token and [`GEMM_BLOCK`] columns.
    pub fn quantize_inputs(x: &HostTensor, scaling: Fp8GemmScaling) -> Fp8Matrix {
        match scaling {
            Fp8GemmScaling::Rows => Fp8Matrix::quantize_rows(x),
            Fp8GemmScaling::Blocks => Fp8Matrix::quantize_blocks(x, 1, GEMM_BLOCK),
        }
    }

    /// The matrix whose rows are the rows of `parts` in order (fused projections), with one
    /// block grid of scales ([`Fp8Scales::Blocks`]) and the same values. Where the parts' grids
    /// have the same blocks and each part but the last ends on a block row, the grids are laid
    /// end to end; otherwise each row takes its own scales, in blocks as wide as the greatest
    /// common divisor of the parts' block widths (so that no new block straddles two old ones).
    pub fn stack(parts: Vec<Fp8Matrix>) -> Result<Fp8Matrix, String> {
        if let [one] = parts.as_slice() {
            if matches!(one.scales, Fp8Scales::Blocks { .. }) {
                return Ok(parts.into_iter().next().expect("one part"));
            }
            // The codes move; only the scales take the grid's form.
            let (block_rows, block_cols, scales) = one.scale_grid();
            let scales = Fp8Scales::Blocks { block_rows, block_cols, scales: scales.to_vec() };
            let Fp8Matrix { rows, cols, codes, .. } = parts.into_iter().next().expect("one part");
            return Fp8Matrix::new(rows, cols, codes, scales);
        }
        let Some(first) = parts.first() else { return Err("no parts to stack".into()) };
        let cols = first.cols;
        if let Some(p) = parts.iter().find(|p| p.cols != cols) {
            return Err(format!("parts of {cols} and {} columns", p.cols));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let (block_rows, block_cols, _) = first.scale_grid();
        let aligned = parts.iter().enumerate().all(|(i, p)| {
            let (br, bc, _) = p.scale_grid();
            (br, bc) == (block_rows, block_cols) && (i + 1 == parts.len() || p.rows.is_multiple_of(br))
        });
        let (block_rows, block_cols, scales) = if aligned {
            (block_rows, block_cols, parts.iter().flat_map(|p| p.scale_grid().2.iter().copied()).collect())
        } else {
            let block_cols = parts.iter().fold(0, |g, p| gcd(g, p.scale_grid().1));
            let grid_cols = cols.div_ceil(block_cols.max(1));
            let mut scales = Vec::with_capacity(rows * grid_cols);
            for p in &parts {
                for r in 0..p.rows {
                    scales.extend((0..grid_cols).map(|b| p.scale(r, b * block_cols)));
                }
            }
            (1, block_cols, scales)
        };
        let mut codes = Vec::with_capacity(rows * cols);
        for p in parts {
            codes.extend_from_slice(&p.codes);
        }
        Fp8Matrix::new(rows, cols, codes, Fp8Scales::Blocks { block_rows, block_cols, scales })
    }

    /// The matrix's values in f32 (see the module's invariants).
    pub fn dequantize(&self) -> HostTensor {
        let mut values = vec![0.0f32; self.rows * self.cols];
        let cols = self.cols.max(1);
        values.par_chunks_mut(cols).zip(self.codes.par_chunks(cols)).enumerate().for_each(|(r, (out, codes))| {
            for (c, (x, &code)) in out.iter_mut().zip(codes).enumerate() {
                *x = e4m3_to_f32(code) * self.scale(r, c);
            }
        });
        HostTensor::from_f32(vec![self.rows, self.cols], values)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips_and_midpoints_round_to_even() {
        let finite: Vec<u8> = (0..=255u8).filter(|c| c & 0x7f != 0x7f).collect();
        for &c in &finite {
            let x = e4m3_to_f32(c);
            assert!(x.is_finite(), "code {c:#x}");
            // -0 and +0 are both zero; every other code comes back as itself.
            let back = f32_to_e4m3(x);
            assert!(back == c || (x == 0.0 && back & 0x7f == 0), "code {c:#x} -> {x} -> {back:#x}");
        }
        assert_eq!(e4m3_to_f32(0x7e), E4M3_MAX);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        // Between neighbours a and b (b = a + 1 in code order, positive codes), the midpoint goes to
        // the even code, and a hair either side to the nearer one.
        for a in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(a), e4m3_to_f32(a + 1));
            let mid = (lo + hi) / 2.0;
            let even = if a % 2 == 0 { a } else { a + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "midpoint of {a:#x} and {:#x}", a + 1);
            assert_eq!(f32_to_e4m3(mid - (hi - lo) / 64.0), a);
            assert_eq!(f32_to_e4m3(mid + (hi - lo) / 64.0), a + 1);
            assert_eq!(f32_to_e4m3(-mid), even | 0x80);
        }
        // Saturation, not NaN, past the largest value.
        assert_eq!(f32_to_e4m3(1e6), 0x7e);
        assert_eq!(f32_to_e4m3(-1e6), 0xfe);
    }

    #[test]
    fn each_scale_applies_where_its_strategy_says() {
        let codes: Vec<u8> = (0..15u8).map(|i| f32_to_e4m3(i as f32)).collect();
        let value = |m: &Fp8Matrix| m.dequantize().to_f32_vec();
        let tensor = Fp8Matrix::new(3, 5, codes.clone(), Fp8Scales::Tensor(0.5)).unwrap();
        assert_eq!(value(&tensor), (0..15).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
        let rows = Fp8Matrix::new(3, 5, codes.clone(), Fp8Scales::Rows(vec![1.0, 2.0, 4.0])).unwrap();
        assert_eq!(value(&rows), (0..15).map(|i| i as f32 * [1.0, 2.0, 4.0][i / 5]).collect::<Vec<_>>());
        // Blocks of 2 x 2 over 3 x 5: a 2 x 3 grid, the last row and column of blocks partial.
        let grid = vec![1.0, 2.0, 3.0, 10.0, 20.0, 30.0];
        let blocks = Fp8Scales::Blocks { block_rows: 2, block_cols: 2, scales: grid.clone() };
        let blocks = Fp8Matrix::new(3, 5, codes.clone(), blocks).unwrap();
        let expected: Vec<f32> = (0..15).map(|i| i as f32 * grid[(i / 5) / 2 * 3 + (i % 5) / 2]).collect();
        assert_eq!(value(&blocks), expected);

        let wrong = Fp8Scales::Blocks { block_rows: 2, block_cols: 2, scales: vec![1.0; 4] };
        let err = Fp8Matrix::new(3, 5, codes.clone(), wrong).unwrap_err();
        assert!(err.contains("needs 6"), "{err}");
        assert!(Fp8Matrix::new(3, 5, codes[..14].to_vec(), Fp8Scales::Tensor(1.0)).is_err());
        assert!(Fp8Matrix::new(3, 5, codes.clone(), Fp8Scales::Rows(vec![1.0; 2])).is_err());
        assert!(Fp8Matrix::new(3, 5, codes, Fp8Scales::Tensor(f32::NAN)).is_err());
    }

    #[test]
    fn quantizing_rows_keeps_each_value_within_half_a_step() {
        let (rows, cols) = (4, 64);
        let mut values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0).collect();
        values[cols..2 * cols].fill(0.0); // an all-zero row
        let w = HostTensor::from_f32(vec![rows, cols], values.clone());
        let q = Fp8Matrix::quantize_rows(&w);
        let back = q.dequantize().to_f32_vec();
        for r in 0..rows {
            let row = &values[r * cols..(r + 1) * cols];
            let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (c, &x) in row.iter().enumerate() {
                // e4m3 keeps 3 mantissa bits: a relative step of at most 1/8 of the value's binade,
                // and subnormal steps of 2^-9 scales near zero.
                let scale = q.scale(r, c);
                let tol = (x.abs() / 16.0).max(scale * 2f32.powi(-10)) * 1.0001;
                assert!((back[r * cols + c] - x).abs() <= tol, "({r}, {c}): {x} -> {}", back[r * cols + c]);
            }
            if amax > 0.0 {
                // The row's largest magnitude maps to 448 exactly.
                assert_eq!(q.scale(r, 0), amax / E4M3_MAX);
            }
        }
        assert!(back[cols..2 * cols].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn quantizing_blocks_quantizes_each_block_as_a_row_of_its_own() {
        // 5 x 20 in blocks of 2 x 8: block rows of 2, 2 and 1, block columns of 8, 8 and 4.
        let (rows, cols, br, bc) = (5, 20, 2, 8);
        let mut values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0).collect();
        values[..8].fill(0.0); // block (0, 0) zero in its first row only
        for r in 0..2 {
            values[r * cols + 8..r * cols + 16].fill(0.0); // block (0, 1) all zero
        }
        let q = Fp8Matrix::quantize_blocks(&HostTensor::from_f32(vec![rows, cols], values.clone()), br, bc);
        let Fp8Scales::Blocks { block_rows: 2, block_cols: 8, scales } = q.scales() else { panic!("{:?}", q.scales()) };
        assert_eq!(scales.len(), 3 * 3);
        for (b, &scale) in scales.iter().enumerate() {
            let (r0, c0) = ((b / 3) * br, (b % 3) * bc);
            // The block's elements, quantized as one row would be: the same scale and codes.
            let block: Vec<f32> = (r0..(r0 + br).min(rows))
                .flat_map(|r| values[r * cols + c0..r * cols + (c0 + bc).min(cols)].to_vec())
                .collect();
            let as_row = Fp8Matrix::quantize_rows(&HostTensor::from_f32(vec![1, block.len()], block));
            assert_eq!(scale.to_bits(), as_row.scale(0, 0).to_bits(), "block {b}");
            let codes: Vec<u8> = (r0..(r0 + br).min(rows))
                .flat_map(|r| q.codes()[r * cols + c0..r * cols + (c0 + bc).min(cols)].to_vec())
                .collect();
            assert_eq!(codes, as_row.codes(), "block {b}");
        }
        assert_eq!(scales[1], MIN_SCALE);
        // Blocks of one row as wide as the matrix are the rows' quantization.
        let w = HostTensor::from_f32(vec![rows, cols], values);
        let (whole, per_row) = (Fp8Matrix::quantize_blocks(&w, 1, cols), Fp8Matrix::quantize_rows(&w));
        assert_eq!(whole.codes(), per_row.codes());
        assert_eq!(whole.dequantize().to_f32_vec(), per_row.dequantize().to_f32_vec());
    }

    #[test]
    fn stacking_keeps_every_value_and_one_grid() {
        let part = |rows: usize, cols: usize, seed: usize, scales: Fp8Scales| {
            let codes = (0..rows * cols).map(|i| ((i * 37 + seed * 11) % 120) as u8).collect();
            Fp8Matrix::new(rows, cols, codes, scales).unwrap()
        };
        let check = |parts: Vec<Fp8Matrix>, grid: (usize, usize)| {
            let expected: Vec<f32> = parts.iter().flat_map(|p| p.dequantize().to_f32_vec()).collect();
            let stacked = Fp8Matrix::stack(parts).unwrap();
            let (br, bc, _) = stacked.scale_grid();
            assert_eq!((br, bc), grid);
            assert!(matches!(stacked.scales(), Fp8Scales::Blocks { .. }));
            assert_eq!(stacked.dequantize().to_f32_vec(), expected);
        };
        let blocks = |rows: usize, cols: usize, br: usize, bc: usize, base: f32| Fp8Scales::Blocks {
            block_rows: br,
            block_cols: bc,
            scales: (0..rows.div_ceil(br) * cols.div_ceil(bc)).map(|i| base + i as f32).collect(),
        };
        // q, k, v in 2 x 4 blocks, each ending on a block row: the grids end to end.
        check(
            vec![
                part(4, 8, 1, blocks(4, 8, 2, 4, 1.0)),
                part(2, 8, 2, blocks(2, 8, 2, 4, 10.0)),
                part(3, 8, 3, blocks(3, 8, 2, 4, 20.0)),
            ],
            (2, 4),
        );
        // A part ending inside a block row: per-row blocks 4 wide.
        check(vec![part(3, 8, 1, blocks(3, 8, 2, 4, 1.0)), part(2, 8, 2, blocks(2, 8, 2, 4, 10.0))], (1, 4));
        // Tensor scales of different parts: one block per row.
        check(vec![part(3, 8, 1, Fp8Scales::Tensor(0.5)), part(2, 8, 2, Fp8Scales::Tensor(2.0))], (1, 8));
        // Row scales and blocks 4 wide mixed (a 6-wide block width too): gcd(8, 4, 6) = 2.
        check(
            vec![
                part(2, 8, 1, Fp8Scales::Rows(vec![1.0, 2.0])),
                part(3, 8, 2, blocks(3, 8, 2, 4, 5.0)),
                part(2, 8, 3, blocks(2, 8, 1, 6, 9.0)),
            ],
            (1, 2),
        );
        // One part keeps its grid.
        check(vec![part(3, 8, 1, Fp8Scales::Rows(vec![1.0, 2.0, 3.0]))], (1, 8));
        assert!(Fp8Matrix::stack(vec![part(2, 8, 1, Fp8Scales::Tensor(1.0)), part(2, 4, 1, Fp8Scales::Tensor(1.0))])
            .is_err());
    }
}
