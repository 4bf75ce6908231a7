//! Deterministic inputs shared by the unit tests of the CPU ops.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub(crate) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `len` values uniform in `[-amplitude, amplitude)`.
pub(crate) fn random_vec(rng: &mut ChaCha8Rng, len: usize, amplitude: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-amplitude..amplitude)).collect()
}

/// An output buffer poisoned with NaN, so that any element an op fails to write shows up.
pub(crate) fn nan_vec(len: usize) -> Vec<f32> {
    vec![f32::NAN; len]
}

/// Asserts `|got - want| <= tol * max(1, |want|)` element-wise (NaN never passes).
pub(crate) fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= tol * w.abs().max(1.0);
        assert!(ok, "{what}: element {i}: got {g}, want {w}");
    }
}

/// A batch of no tokens, for ops that ignore the batch (the MoE op).
pub(crate) fn empty_batch() -> super::CpuBatch<'static> {
    super::CpuBatch {
        token_ids: &[],
        positions: &[],
        slot_mapping: &[],
        logits_indices: &[],
        attention: super::AttentionMetadata {
            query_start_loc: &[0],
            seq_lens: &[],
            block_tables: &[],
            max_blocks_per_seq: 0,
            block_size: 16,
            sliding_window: None,
            scale: 1.0,
            softcap: None,
        },
    }
}
