//! Writing new keys and values into the paged KV cache.
//!
//! The cache is a flat array of slots (`slot = block_id * block_size + offset`), each holding
//! one token's K (or V) for every KV head: `[num_blocks * block_size, kv_width]`.

/// Writes each token's K and V into the paged cache at `slot_mapping[t]` (a negative slot is
/// padding and is skipped). `k`, `v`: `[T, kv_width]`; caches: `[num_blocks * block_size, kv_width]`
/// (`kv_width = num_kv_heads * head_dim`).
pub fn reshape_and_cache(
    k: &[f32],
    v: &[f32],
    slot_mapping: &[i64],
    kv_width: usize,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
) {
    let tokens = slot_mapping.len();
    assert!(kv_width > 0, "reshape_and_cache: kv_width is 0");
    assert_eq!(
        k.len(),
        tokens * kv_width,
        "reshape_and_cache: k has {} elements, expected [{tokens}, {kv_width}]",
        k.len()
    );
    assert_eq!(
        v.len(),
        tokens * kv_width,
        "reshape_and_cache: v has {} elements, expected [{tokens}, {kv_width}]",
        v.len()
    );
    assert_eq!(k_cache.len(), v_cache.len(), "reshape_and_cache: k_cache and v_cache differ in size");
    assert_eq!(k_cache.len() % kv_width, 0, "reshape_and_cache: cache is not whole slots of {kv_width}");
    let num_slots = k_cache.len() / kv_width;
    for ((&slot, k), v) in slot_mapping.iter().zip(k.chunks_exact(kv_width)).zip(v.chunks_exact(kv_width)) {
        if slot < 0 {
            continue;
        }
        let slot = slot as usize;
        assert!(slot < num_slots, "reshape_and_cache: slot {slot} outside the cache of {num_slots} slots");
        k_cache[slot * kv_width..(slot + 1) * kv_width].copy_from_slice(k);
        v_cache[slot * kv_width..(slot + 1) * kv_width].copy_from_slice(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{random_vec, rng};

    #[test]
    fn writes_tokens_to_their_slots_and_skips_padding() {
        let mut rng = rng(8);
        let (kv_width, num_slots) = (6, 10);
        let slots: [i64; 5] = [7, -1, 0, 9, -1];
        let k = random_vec(&mut rng, slots.len() * kv_width, 1.0);
        let v = random_vec(&mut rng, slots.len() * kv_width, 1.0);
        // Sentinel values show which slots were written.
        let mut k_cache = vec![-5.0; num_slots * kv_width];
        let mut v_cache = vec![-6.0; num_slots * kv_width];
        reshape_and_cache(&k, &v, &slots, kv_width, &mut k_cache, &mut v_cache);
        for slot in 0..num_slots {
            let cached_k = &k_cache[slot * kv_width..(slot + 1) * kv_width];
            let cached_v = &v_cache[slot * kv_width..(slot + 1) * kv_width];
            match slots.iter().position(|&s| s == slot as i64) {
                Some(t) => {
                    assert_eq!(cached_k, &k[t * kv_width..(t + 1) * kv_width], "k slot {slot}");
                    assert_eq!(cached_v, &v[t * kv_width..(t + 1) * kv_width], "v slot {slot}");
                }
                None => {
                    assert!(cached_k.iter().all(|&x| x == -5.0), "k slot {slot} was written");
                    assert!(cached_v.iter().all(|&x| x == -6.0), "v slot {slot} was written");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside the cache")]
    fn rejects_slots_past_the_cache() {
        reshape_and_cache(&[0.0; 2], &[0.0; 2], &[3], 2, &mut [0.0; 6], &mut [0.0; 6]);
    }
}
