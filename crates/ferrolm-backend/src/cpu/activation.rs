//! Gated MLP activations over a fused `[gate | up]` projection: `out = act(gate) * up`.
//!
//! `exp` is computed by [`exp`] below rather than libm: it is branch-free, so the row loops
//! vectorize (eight lanes with AVX2), which matters because a prefill step evaluates it
//! `tokens x intermediate` times per layer.

use rayon::prelude::*;

use super::weights::Isa;
use super::PARALLEL_MIN_ELEMS;

/// `out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]`; `gate_up`: `[rows, 2 * inter]`, `out`: `[rows, inter]`.
pub fn silu_and_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    act_and_mul("silu_and_mul", gate_up, inter, out, Act::Silu);
}

/// As [`silu_and_mul`] with the tanh approximation of GELU (`gelu_pytorch_tanh`).
pub fn gelu_tanh_and_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    act_and_mul("gelu_tanh_and_mul", gate_up, inter, out, Act::GeluTanh);
}

#[derive(Clone, Copy)]
enum Act {
    Silu,
    GeluTanh,
}

/// `e^x` within 2 ulp for normal results; overflows to +inf above ~88.72 and flushes to 0
/// below ~-87.34 (where the true value is subnormal), like libm at the ends; NaN gives NaN.
///
/// Cody-Waite reduction `x = n ln2 + r`, `|r| <= ln2 / 2`, then a degree-6 polynomial for
/// `e^r` and `2^n` built in the exponent bits.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Out of this range the result is inf or 0 anyway; clamping keeps `n` in [-127, 128].
    let xc = x.clamp(-88.0, 88.75);
    let n = (xc * LOG2E + 0.5).floor();
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // Taylor coefficients 1/k! are within an ulp of the minimax ones on this interval.
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2^n in the exponent bits, as 2^(n-1) * 2 for n > 0 so that n = 128 fits; n = -127 gives
    // 0 (the flush), and the product overflows to +inf past f32::MAX.
    let big = n > 0.0;
    let n1 = if big { n - 1.0 } else { n };
    let scale = f32::from_bits(((n1 as i32 + 127) as u32) << 23);
    let e = p * scale * if big { 2.0 } else { 1.0 };
    // NaN propagates: `clamp` keeps it, and so does every step after.
    if x.is_nan() {
        x
    } else {
        e
    }
}

/// `x * sigmoid(x)`; for very negative `x`, `exp(-x)` overflows to infinity and the result is -0.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, PyTorch's `gelu(approximate="tanh")`,
/// with `1 + tanh(u) = 2 - 2 / (e^{2u} + 1)`.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    0.5 * x * (2.0 - 2.0 / (exp(2.0 * u) + 1.0))
}

#[inline(always)]
fn row_generic(act: Act, out: &mut [f32], gate: &[f32], up: &[f32]) {
    match act {
        Act::Silu => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = silu(g) * u;
            }
        }
        Act::GeluTanh => {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = gelu_tanh(g) * u;
            }
        }
    }
}

/// [`row_generic`] compiled for AVX2 + FMA, where the loops vectorize eight wide.
///
/// # Safety
/// The CPU must support [`Isa::Avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(act: Act, out: &mut [f32], gate: &[f32], up: &[f32]) {
    row_generic(act, out, gate, up);
}

fn row(isa: Isa, act: Act, out: &mut [f32], gate: &[f32], up: &[f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is `Avx2` only where the CPU supports it.
        Isa::Avx2 => unsafe { row_avx2(act, out, gate, up) },
        Isa::Scalar => row_generic(act, out, gate, up),
    }
}

fn act_and_mul(op: &str, gate_up: &[f32], inter: usize, out: &mut [f32], act: Act) {
    assert!(inter > 0, "{op}: inter is 0");
    assert_eq!(gate_up.len() % (2 * inter), 0, "{op}: gate_up has {} elements, not rows of 2 * {inter}", gate_up.len());
    let rows = gate_up.len() / (2 * inter);
    assert_eq!(out.len(), rows * inter, "{op}: out has {} elements, expected [{rows}, {inter}]", out.len());
    let isa = Isa::detect();
    let run = |(o, gu): (&mut [f32], &[f32])| {
        let (gate, up) = gu.split_at(inter);
        row(isa, act, o, gate, up);
    };
    if out.len() < PARALLEL_MIN_ELEMS {
        out.chunks_mut(inter).zip(gate_up.chunks(2 * inter)).for_each(run);
    } else {
        out.par_chunks_mut(inter).zip(gate_up.par_chunks(2 * inter)).for_each(run);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, nan_vec, random_vec, rng};

    fn reference(gate_up: &[f32], inter: usize, act: fn(f64) -> f64) -> Vec<f32> {
        let mut out = Vec::new();
        for row in gate_up.chunks(2 * inter) {
            out.extend((0..inter).map(|j| (act(row[j] as f64) * row[inter + j] as f64) as f32));
        }
        out
    }

    fn silu_ref(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    fn gelu_tanh_ref(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    }

    const SHAPES: [(usize, usize); 3] = [(1, 5), (3, 128), (9, 4864)];

    #[test]
    fn silu_and_mul_matches_reference() {
        let mut rng = rng(5);
        for (rows, inter) in SHAPES {
            let gate_up = random_vec(&mut rng, rows * 2 * inter, 8.0);
            let mut out = nan_vec(rows * inter);
            silu_and_mul(&gate_up, inter, &mut out);
            assert_close(&out, &reference(&gate_up, inter, silu_ref), 1e-5, "silu_and_mul");
        }
    }

    #[test]
    fn gelu_tanh_and_mul_matches_reference() {
        let mut rng = rng(6);
        for (rows, inter) in SHAPES {
            let gate_up = random_vec(&mut rng, rows * 2 * inter, 8.0);
            let mut out = nan_vec(rows * inter);
            gelu_tanh_and_mul(&gate_up, inter, &mut out);
            assert_close(&out, &reference(&gate_up, inter, gelu_tanh_ref), 1e-5, "gelu_tanh_and_mul");
        }
    }

    #[test]
    fn exp_is_within_two_ulp_and_saturates_like_libm() {
        let mut x = -87.0f32;
        while x <= 88.7 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            assert!((got - want).abs() <= 2.4e-7 * want, "exp({x}) = {got}, want {want}");
            x += 0.013;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-90.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn every_isa_matches_the_reference() {
        let mut rng = rng(7);
        let gate_up = random_vec(&mut rng, 2 * 1037, 12.0);
        let (gate, up) = gate_up.split_at(1037);
        for isa in Isa::available() {
            for (act, f) in [(Act::Silu, silu_ref as fn(f64) -> f64), (Act::GeluTanh, gelu_tanh_ref)] {
                let mut out = nan_vec(1037);
                row(isa, act, &mut out, gate, up);
                assert_close(&out, &reference(&gate_up, 1037, f), 1e-5, &format!("{isa:?}"));
            }
        }
    }

    #[test]
    fn activations_saturate_without_nan() {
        let gate_up = [-200.0, 200.0, -200.0, 200.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = nan_vec(4);
        silu_and_mul(&gate_up, 4, &mut out);
        assert_eq!(out, [0.0, 200.0, 0.0, 200.0]);
        gelu_tanh_and_mul(&gate_up, 4, &mut out);
        assert_eq!(out, [0.0, 200.0, 0.0, 200.0]);
    }
}
