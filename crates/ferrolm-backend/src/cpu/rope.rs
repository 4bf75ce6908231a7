//! Rotary position embedding in the GPT-NeoX / HF `rotate_half` layout: dimension `i` of a head
//! pairs with dimension `i + half`. Angles and their cos/sin are computed in f32, as HF
//! transformers does, so that positions far into a long context round the same way.

use rayon::prelude::*;

use super::PARALLEL_MIN_ELEMS;

/// Rotary embedding, GPT-NeoX / HF `rotate_half` layout, in place.
/// `x`: `[positions.len(), num_heads, head_dim]`. Only the first `2 * inv_freq.len()` dims of each
/// head rotate (partial rotary); the rest pass through. For pair `i < half` (half = inv_freq.len()):
/// `angle = positions[t] as f32 * inv_freq[i]` (computed in f32), `c = cos(angle) * attention_scaling`,
/// `s = sin(angle) * attention_scaling`, `(x[i], x[i + half]) <- (x[i] c - x[i+half] s, x[i+half] c + x[i] s)`.
pub fn rope(
    x: &mut [f32],
    positions: &[u32],
    num_heads: usize,
    head_dim: usize,
    inv_freq: &[f32],
    attention_scaling: f32,
) {
    let token_width = num_heads * head_dim;
    assert_eq!(
        x.len(),
        positions.len() * token_width,
        "rope: x has {} elements, expected [{} tokens, {num_heads} heads, {head_dim}]",
        x.len(),
        positions.len()
    );
    assert!(
        2 * inv_freq.len() <= head_dim,
        "rope: {} frequencies rotate more than head_dim {head_dim}",
        inv_freq.len()
    );
    if token_width == 0 {
        return;
    }
    let rotate_token = |cos_sin: &mut Vec<(f32, f32)>, (x, &pos): (&mut [f32], &u32)| {
        cos_sin.clear();
        cos_sin.extend(inv_freq.iter().map(|&f| {
            let angle = pos as f32 * f;
            (angle.cos() * attention_scaling, angle.sin() * attention_scaling)
        }));
        for head in x.chunks_exact_mut(head_dim) {
            rotate_head(head, cos_sin);
        }
    };
    if x.len() < PARALLEL_MIN_ELEMS {
        let mut cos_sin = Vec::with_capacity(inv_freq.len());
        x.chunks_mut(token_width).zip(positions).for_each(|t| rotate_token(&mut cos_sin, t));
    } else {
        x.par_chunks_mut(token_width).zip(positions).for_each_init(|| Vec::with_capacity(inv_freq.len()), rotate_token);
    }
}

/// Rotates the first `2 * cos_sin.len()` dims of one head.
fn rotate_head(head: &mut [f32], cos_sin: &[(f32, f32)]) {
    let half = cos_sin.len();
    let (lo, rest) = head.split_at_mut(half);
    for ((a, b), &(c, s)) in lo.iter_mut().zip(&mut rest[..half]).zip(cos_sin) {
        let (x0, x1) = (*a, *b);
        *a = x0 * c - x1 * s;
        *b = x1 * c + x0 * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, random_vec, rng};

    /// Rotation written from the formula, in f64 from the same f32 angle.
    fn reference(x: &[f32], positions: &[u32], heads: usize, dim: usize, inv_freq: &[f32], scaling: f32) -> Vec<f32> {
        let half = inv_freq.len();
        let mut out = x.to_vec();
        for (t, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = (t * heads + h) * dim;
                for i in 0..half {
                    let angle = (p as f32 * inv_freq[i]) as f64;
                    let (c, s) = (angle.cos() * scaling as f64, angle.sin() * scaling as f64);
                    let (x0, x1) = (x[base + i] as f64, x[base + i + half] as f64);
                    out[base + i] = (x0 * c - x1 * s) as f32;
                    out[base + i + half] = (x1 * c + x0 * s) as f32;
                }
            }
        }
        out
    }

    fn inv_freq(rotary_dim: usize, theta: f32) -> Vec<f32> {
        (0..rotary_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f32 / rotary_dim as f32)).collect()
    }

    #[test]
    fn full_and_partial_rotary_match_reference() {
        let mut rng = rng(4);
        // (tokens, heads, head_dim, rotary_dim, attention_scaling); the last is large enough for
        // the parallel path.
        let cases = [(3, 2, 8, 8, 1.0), (5, 3, 64, 32, 1.0), (4, 2, 16, 6, 1.25), (70, 8, 64, 64, 0.9)];
        for (tokens, heads, dim, rotary, scaling) in cases {
            let positions: Vec<u32> = (0..tokens as u32).map(|t| t * 37 + 5).collect();
            let freqs = inv_freq(rotary, 10000.0);
            let x = random_vec(&mut rng, tokens * heads * dim, 2.0);
            let mut y = x.clone();
            rope(&mut y, &positions, heads, dim, &freqs, scaling);
            let want = reference(&x, &positions, heads, dim, &freqs, scaling);
            assert_close(&y, &want, 1e-5, "rope");
            // The dims past the rotary part pass through untouched.
            for (i, (&got, &orig)) in y.iter().zip(&x).enumerate() {
                if i % dim >= rotary {
                    assert_eq!(got, orig, "pass-through dim {i}");
                }
            }
        }
    }

    #[test]
    fn position_zero_only_scales() {
        let x = [1.0, 2.0, 3.0, 4.0];
        let mut y = x;
        rope(&mut y, &[0], 1, 4, &[1.0, 0.5], 2.0);
        assert_eq!(y, [2.0, 4.0, 6.0, 8.0]);
    }

    #[test]
    #[should_panic(expected = "rotate more than head_dim")]
    fn rejects_too_many_frequencies() {
        rope(&mut [0.0; 4], &[0], 1, 4, &[1.0; 3], 1.0);
    }
}
