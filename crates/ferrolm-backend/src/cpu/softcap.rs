//! Soft-capping of scores (Gemma 2's final logits): `x = cap * tanh(x / cap)`, which keeps every
//! value inside `(-cap, cap)` and leaves small ones nearly unchanged.

use rayon::prelude::*;

use super::PARALLEL_MIN_ELEMS;

/// `x[i] = cap * tanh(x[i] / cap)` in place, in HF's order (divide, tanh, multiply); `cap > 0`.
pub fn softcap(x: &mut [f32], cap: f32) {
    assert!(cap > 0.0, "softcap: the cap must be positive, not {cap}");
    let cap_one = |v: &mut f32| *v = (*v / cap).tanh() * cap;
    if x.len() < PARALLEL_MIN_ELEMS {
        x.iter_mut().for_each(cap_one);
    } else {
        x.par_chunks_mut(PARALLEL_MIN_ELEMS).for_each(|chunk| chunk.iter_mut().for_each(cap_one));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{random_vec, rng};

    #[test]
    fn caps_large_values_and_keeps_small_ones() {
        let mut x = vec![0.0, 1e-3, -1e-3, 30.0, -30.0, 1e6, -1e6, f32::INFINITY];
        softcap(&mut x, 30.0);
        assert_eq!(x[0], 0.0);
        assert!((x[1] - 1e-3).abs() < 1e-9 && (x[2] + 1e-3).abs() < 1e-9, "{x:?}");
        assert!((x[3] - 30.0 * 1f32.tanh()).abs() < 1e-5 && x[4] == -x[3], "{x:?}");
        assert_eq!((x[5], x[6], x[7]), (30.0, -30.0, 30.0));
    }

    #[test]
    fn large_buffers_match_the_sequential_path() {
        let mut rng = rng(4);
        let x = random_vec(&mut rng, 3 * PARALLEL_MIN_ELEMS + 5, 80.0);
        let mut parallel = x.clone();
        softcap(&mut parallel, 20.0);
        let sequential: Vec<f32> = x.iter().map(|&v| (v / 20.0).tanh() * 20.0).collect();
        assert_eq!(parallel, sequential);
        assert!(parallel.iter().all(|v| v.abs() <= 20.0));
    }
}
