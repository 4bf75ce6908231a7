//! Gated MLP activations over a fused `[gate | up]` projection: `out = act(gate) * up`.

use rayon::prelude::*;

use super::PARALLEL_MIN_ELEMS;

/// `out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]`; `gate_up`: `[rows, 2 * inter]`, `out`: `[rows, inter]`.
pub fn silu_and_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    act_and_mul("silu_and_mul", gate_up, inter, out, silu);
}

/// As [`silu_and_mul`] with the tanh approximation of GELU (`gelu_pytorch_tanh`).
pub fn gelu_tanh_and_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    act_and_mul("gelu_tanh_and_mul", gate_up, inter, out, gelu_tanh);
}

/// `x * sigmoid(x)`; for very negative `x`, `exp(-x)` overflows to infinity and the result is -0.
#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, PyTorch's `gelu(approximate="tanh")`.
#[inline]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

fn act_and_mul(op: &str, gate_up: &[f32], inter: usize, out: &mut [f32], act: fn(f32) -> f32) {
    assert!(inter > 0, "{op}: inter is 0");
    assert_eq!(gate_up.len() % (2 * inter), 0, "{op}: gate_up has {} elements, not rows of 2 * {inter}", gate_up.len());
    let rows = gate_up.len() / (2 * inter);
    assert_eq!(out.len(), rows * inter, "{op}: out has {} elements, expected [{rows}, {inter}]", out.len());
    let row = |(o, gu): (&mut [f32], &[f32])| {
        let (gate, up) = gu.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = act(g) * u;
        }
    };
    if out.len() < PARALLEL_MIN_ELEMS {
        out.chunks_mut(inter).zip(gate_up.chunks(2 * inter)).for_each(row);
    } else {
        out.par_chunks_mut(inter).zip(gate_up.par_chunks(2 * inter)).for_each(row);
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
    fn activations_saturate_without_nan() {
        let gate_up = [-200.0, 200.0, -200.0, 200.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = nan_vec(4);
        silu_and_mul(&gate_up, 4, &mut out);
        assert_eq!(out, [0.0, 200.0, 0.0, 200.0]);
        gelu_tanh_and_mul(&gate_up, 4, &mut out);
        assert_eq!(out, [0.0, 200.0, 0.0, 200.0]);
    }
}
