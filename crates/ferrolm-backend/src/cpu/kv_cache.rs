//! Writing new keys and values into the paged KV cache.
//!
//! The cache is a flat array of slots (`slot = block_id * block_size + offset`), each holding
//! one token's K (or V) for every KV head: `[num_blocks * block_size, kv_width]`. A layer keeps
//! its K and V in f32, or, with `--kv-cache-dtype fp8`, as e4m3 codes of `x / scale` with one
//! scale for the layer's K and one for its V ([`KvStore`]); the attention reads
//! `e4m3(x / scale) * scale` back.

use crate::fp8::{e4m3_to_f32, f32_to_e4m3};
use crate::KvCacheDtype;

/// One layer's K or V cache, `[num_slots, kv_width]`.
#[derive(Clone, Debug)]
pub enum KvStore {
    F32(Vec<f32>),
    /// e4m3 codes of `x / scale`.
    Fp8 {
        codes: Vec<u8>,
        scale: f32,
    },
}

/// A [`KvStore`] as the attention reads it.
#[derive(Clone, Copy, Debug)]
pub enum KvView<'a> {
    F32(&'a [f32]),
    Fp8 { codes: &'a [u8], scale: f32 },
}

impl KvStore {
    /// `len` elements of `dtype`, zero; an FP8 store holds codes of `x / scale`.
    pub fn zeros(dtype: KvCacheDtype, len: usize, scale: f32) -> KvStore {
        match dtype {
            KvCacheDtype::Auto => KvStore::F32(vec![0.0; len]),
            KvCacheDtype::Fp8 => KvStore::Fp8 { codes: vec![0; len], scale },
        }
    }

    pub fn view(&self) -> KvView<'_> {
        match self {
            KvStore::F32(values) => KvView::F32(values),
            KvStore::Fp8 { codes, scale } => KvView::Fp8 { codes, scale: *scale },
        }
    }

    /// Overwrites elements `start..start + row.len()` with `row`.
    fn write(&mut self, start: usize, row: &[f32]) {
        match self {
            KvStore::F32(values) => values[start..start + row.len()].copy_from_slice(row),
            KvStore::Fp8 { codes, scale } => {
                for (code, &x) in codes[start..start + row.len()].iter_mut().zip(row) {
                    *code = f32_to_e4m3(x / *scale);
                }
            }
        }
    }
}

impl<'a> KvView<'a> {
    pub fn len(&self) -> usize {
        match self {
            KvView::F32(values) => values.len(),
            KvView::Fp8 { codes, .. } => codes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..start + buf.len()` in f32: borrowed from an f32 cache, decoded into `buf`
    /// from an FP8 one.
    #[inline(always)]
    pub fn row<'b>(&self, start: usize, buf: &'b mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            KvView::F32(values) => &values[start..start + buf.len()],
            KvView::Fp8 { codes, scale } => {
                for (x, &code) in buf.iter_mut().zip(&codes[start..]) {
                    *x = e4m3_to_f32(code) * scale;
                }
                buf
            }
        }
    }
}

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
    assert_eq!(k_cache.len(), v_cache.len(), "reshape_and_cache: k_cache and v_cache differ in size");
    scatter(k, v, slot_mapping, kv_width, k_cache.len(), |start, k_row, v_row| {
        k_cache[start..start + kv_width].copy_from_slice(k_row);
        v_cache[start..start + kv_width].copy_from_slice(v_row);
    });
}

/// [`reshape_and_cache`] into a layer's stores, whatever their dtype.
pub fn reshape_and_cache_into(
    k: &[f32],
    v: &[f32],
    slot_mapping: &[i64],
    kv_width: usize,
    k_cache: &mut KvStore,
    v_cache: &mut KvStore,
) {
    let len = k_cache.view().len();
    assert_eq!(len, v_cache.view().len(), "reshape_and_cache: k_cache and v_cache differ in size");
    scatter(k, v, slot_mapping, kv_width, len, |start, k_row, v_row| {
        k_cache.write(start, k_row);
        v_cache.write(start, v_row);
    });
}

/// Checks the shapes, then hands `write` each token's first cache element and its K and V rows.
fn scatter(
    k: &[f32],
    v: &[f32],
    slot_mapping: &[i64],
    kv_width: usize,
    cache_len: usize,
    mut write: impl FnMut(usize, &[f32], &[f32]),
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
    assert_eq!(cache_len % kv_width, 0, "reshape_and_cache: cache is not whole slots of {kv_width}");
    let num_slots = cache_len / kv_width;
    for ((&slot, k), v) in slot_mapping.iter().zip(k.chunks_exact(kv_width)).zip(v.chunks_exact(kv_width)) {
        if slot < 0 {
            continue;
        }
        let slot = slot as usize;
        assert!(slot < num_slots, "reshape_and_cache: slot {slot} outside the cache of {num_slots} slots");
        write(slot * kv_width, k, v);
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
    fn an_fp8_store_keeps_e4m3_codes_of_the_scaled_values() {
        let (kv_width, num_slots) = (4, 3);
        let k: Vec<f32> = vec![0.3, -1.7, 300.0, 1000.0];
        let v: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
        let mut k_cache = KvStore::zeros(KvCacheDtype::Fp8, num_slots * kv_width, 1.0);
        let mut v_cache = KvStore::Fp8 { codes: vec![0; num_slots * kv_width], scale: 0.5 };
        reshape_and_cache_into(&k, &v, &[2], kv_width, &mut k_cache, &mut v_cache);
        let mut buf = [0.0; 4];
        // Rounded to e4m3 (3 mantissa bits), saturating at 448.
        assert_eq!(k_cache.view().row(2 * kv_width, &mut buf), &[0.3125, -1.75, 288.0, 448.0]);
        assert_eq!(v_cache.view().row(2 * kv_width, &mut buf), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(k_cache.view().row(0, &mut buf), &[0.0; 4]);
        let KvStore::Fp8 { codes, .. } = &v_cache else { unreachable!() };
        assert_eq!(codes[2 * kv_width..], [f32_to_e4m3(2.0), f32_to_e4m3(4.0), f32_to_e4m3(6.0), f32_to_e4m3(8.0)]);
    }

    #[test]
    #[should_panic(expected = "outside the cache")]
    fn rejects_slots_past_the_cache() {
        reshape_and_cache(&[0.0; 2], &[0.0; 2], &[3], 2, &mut [0.0; 6], &mut [0.0; 6]);
    }
}
