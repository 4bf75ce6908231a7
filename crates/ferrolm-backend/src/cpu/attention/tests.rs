//! `paged_attention` against dense attention computed per request from contiguous K/V.

use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::cpu::testutil::{assert_close, nan_vec, random_vec, rng};
use crate::cpu::{reshape_and_cache_into, KvStore};
use crate::fp8::{e4m3_to_f32, f32_to_e4m3};
use crate::KvCacheDtype;

struct Heads {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

/// One request of the batch: its K/V over the whole context and its queries (the last `q_len`
/// positions).
struct Request {
    seq_len: usize,
    q_len: usize,
    /// `[seq_len, num_kv_heads * head_dim]`
    k: Vec<f32>,
    v: Vec<f32>,
    /// `[q_len, num_heads * head_dim]`
    q: Vec<f32>,
}

impl Request {
    fn random(rng: &mut ChaCha8Rng, heads: &Heads, seq_len: usize, q_len: usize) -> Request {
        let kv_width = heads.num_kv_heads * heads.head_dim;
        Request {
            seq_len,
            q_len,
            k: random_vec(rng, seq_len * kv_width, 1.0),
            v: random_vec(rng, seq_len * kv_width, 1.0),
            q: random_vec(rng, q_len * heads.num_heads * heads.head_dim, 1.5),
        }
    }
}

/// Dense attention of one request in f64: `[q_len, num_heads, head_dim]`.
fn dense_attention(req: &Request, heads: &Heads, window: Option<usize>, scale: f32) -> Vec<f32> {
    dense_attention_capped(req, heads, window, scale, None)
}

/// [`dense_attention`] with each scaled score soft-capped at `softcap`.
fn dense_attention_capped(
    req: &Request,
    heads: &Heads,
    window: Option<usize>,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    let (d, kv_width) = (heads.head_dim, heads.num_kv_heads * heads.head_dim);
    let group = heads.num_heads / heads.num_kv_heads;
    let mut out = Vec::with_capacity(req.q.len());
    for i in 0..req.q_len {
        let pos = req.seq_len - req.q_len + i;
        for h in 0..heads.num_heads {
            let kvh = h / group;
            let q = &req.q[(i * heads.num_heads + h) * d..][..d];
            let visible: Vec<usize> = (0..=pos).filter(|&j| window.is_none_or(|w| j + w > pos)).collect();
            let scores: Vec<f64> = visible
                .iter()
                .map(|&j| {
                    let k = &req.k[j * kv_width + kvh * d..][..d];
                    let s = q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64;
                    softcap.map_or(s, |cap| cap as f64 * (s / cap as f64).tanh())
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for c in 0..d {
                let acc: f64 =
                    visible.iter().zip(&weights).map(|(&j, &w)| w * req.v[j * kv_width + kvh * d + c] as f64).sum();
                out.push((acc / total) as f32);
            }
        }
    }
    out
}

/// How [`run_paged`] lays out and scores a batch.
#[derive(Clone, Copy)]
struct Paged {
    block_size: usize,
    window: Option<usize>,
    scale: f32,
    softcap: Option<f32>,
    /// The cache's element type (an FP8 cache's scale is 1).
    cache: KvCacheDtype,
}

impl Paged {
    fn f32(block_size: usize, window: Option<usize>, scale: f32, softcap: Option<f32>) -> Paged {
        Paged { block_size, window, scale, softcap, cache: KvCacheDtype::Auto }
    }
}

/// A cache of `len` elements that reads as NaN everywhere (0x7f is an e4m3 NaN).
fn poisoned(cache: KvCacheDtype, len: usize) -> KvStore {
    match cache {
        KvCacheDtype::Auto => KvStore::F32(nan_vec(len)),
        KvCacheDtype::Fp8 => KvStore::Fp8 { codes: vec![0x7f; len], scale: 1.0 },
    }
}

/// Scatters every request's K/V into randomly chosen, non-contiguous blocks of a NaN-filled
/// cache and runs `paged_attention` on the whole batch, as `paged` says.
fn run_paged(rng: &mut ChaCha8Rng, requests: &[Request], heads: &Heads, paged: Paged) -> Vec<f32> {
    let Paged { block_size, window, scale, softcap, cache } = paged;
    let kv_width = heads.num_kv_heads * heads.head_dim;
    let blocks_per_req: Vec<usize> = requests.iter().map(|r| r.seq_len.div_ceil(block_size)).collect();
    let max_blocks_per_seq = blocks_per_req.iter().max().copied().unwrap_or(0) + 2;
    // Spare blocks stay NaN: reading one poisons the result.
    let num_blocks = blocks_per_req.iter().sum::<usize>() + 7;
    let mut free: Vec<u32> = (0..num_blocks as u32).collect();
    free.shuffle(rng);

    // Padding entries point outside the cache, so reading one panics.
    let mut block_tables = vec![u32::MAX; requests.len() * max_blocks_per_seq];
    let mut k_cache = poisoned(cache, num_blocks * block_size * kv_width);
    let mut v_cache = poisoned(cache, num_blocks * block_size * kv_width);
    let (mut query_start_loc, mut seq_lens, mut q) = (vec![0u32], Vec::new(), Vec::new());
    for (r, req) in requests.iter().enumerate() {
        let table = &mut block_tables[r * max_blocks_per_seq..][..blocks_per_req[r]];
        for entry in table.iter_mut() {
            *entry = free.pop().expect("enough blocks");
        }
        let slot_mapping: Vec<i64> =
            (0..req.seq_len).map(|j| (table[j / block_size] as usize * block_size + j % block_size) as i64).collect();
        reshape_and_cache_into(&req.k, &req.v, &slot_mapping, kv_width, &mut k_cache, &mut v_cache);
        query_start_loc.push(query_start_loc[r] + req.q_len as u32);
        seq_lens.push(req.seq_len as u32);
        q.extend_from_slice(&req.q);
    }
    let meta = AttentionMetadata {
        query_start_loc: &query_start_loc,
        seq_lens: &seq_lens,
        block_tables: &block_tables,
        max_blocks_per_seq,
        block_size,
        sliding_window: window,
        scale,
        softcap,
    };
    let mut out = nan_vec(q.len());
    let (k, v) = (k_cache.view(), v_cache.view());
    paged_attention(&q, k, v, &meta, heads.num_heads, heads.num_kv_heads, heads.head_dim, &mut out);
    out
}

/// A full prefill, a prefill chunk continuing 28 cached tokens, and decodes at several depths
/// (including the very first token).
const BATCH: [(usize, usize); 5] = [(11, 11), (37, 9), (20, 1), (1, 1), (64, 1)];

#[test]
fn mixed_batch_matches_dense_attention() {
    let mut rng = rng(9);
    let head_configs = [
        Heads { num_heads: 6, num_kv_heads: 2, head_dim: 16 },
        Heads { num_heads: 6, num_kv_heads: 2, head_dim: 20 },
        Heads { num_heads: 6, num_kv_heads: 1, head_dim: 8 },
        Heads { num_heads: 3, num_kv_heads: 3, head_dim: 12 },
    ];
    for heads in &head_configs {
        let scale = 1.0 / (heads.head_dim as f32).sqrt();
        for block_size in [4, 16] {
            for window in [None, Some(5), Some(16)] {
                let requests: Vec<Request> =
                    BATCH.iter().map(|&(s, q)| Request::random(&mut rng, heads, s, q)).collect();
                let got = run_paged(&mut rng, &requests, heads, Paged::f32(block_size, window, scale, None));
                let want: Vec<f32> = requests.iter().flat_map(|r| dense_attention(r, heads, window, scale)).collect();
                let what = format!(
                    "heads {}/{} dim {} block_size {block_size} window {window:?}",
                    heads.num_heads, heads.num_kv_heads, heads.head_dim
                );
                assert_close(&got, &want, 1e-5, &what);
            }
        }
    }
}

/// Scores of about +-2 (scale 1), capped at 1.5: the batch matches dense attention with the
/// same cap and differs from it without one.
#[test]
fn softcapped_scores_match_dense_attention() {
    let mut rng = rng(12);
    let heads = Heads { num_heads: 6, num_kv_heads: 2, head_dim: 16 };
    let (scale, cap) = (1.0, 1.5);
    for window in [None, Some(5)] {
        let requests: Vec<Request> = BATCH.iter().map(|&(s, q)| Request::random(&mut rng, &heads, s, q)).collect();
        let got = run_paged(&mut rng, &requests, &heads, Paged::f32(4, window, scale, Some(cap)));
        let want: Vec<f32> =
            requests.iter().flat_map(|r| dense_attention_capped(r, &heads, window, scale, Some(cap))).collect();
        assert_close(&got, &want, 1e-5, &format!("softcap {cap}, window {window:?}"));
        let uncapped: Vec<f32> = requests.iter().flat_map(|r| dense_attention(r, &heads, window, scale)).collect();
        let moved = got.iter().zip(&uncapped).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(moved > 1e-2, "the cap changed nothing (window {window:?}): {moved}");
    }
}

/// An FP8 cache holds e4m3(x), and the attention over it is dense attention over those values:
/// exactly what an f32 cache of the rounded K/V gives.
#[test]
fn an_fp8_cache_attends_over_the_rounded_values() {
    let mut rng = rng(13);
    let heads = Heads { num_heads: 6, num_kv_heads: 2, head_dim: 16 };
    let round = |x: &f32| e4m3_to_f32(f32_to_e4m3(*x));
    for window in [None, Some(5)] {
        let requests: Vec<Request> = BATCH.iter().map(|&(s, q)| Request::random(&mut rng, &heads, s, q)).collect();
        let fp8 = Paged { cache: KvCacheDtype::Fp8, ..Paged::f32(4, window, 0.25, None) };
        let got = run_paged(&mut rng, &requests, &heads, fp8);
        let rounded: Vec<Request> = requests
            .iter()
            .map(|r| Request {
                k: r.k.iter().map(round).collect(),
                v: r.v.iter().map(round).collect(),
                q: r.q.clone(),
                ..*r
            })
            .collect();
        assert_eq!(got, run_paged(&mut rng, &rounded, &heads, Paged::f32(4, window, 0.25, None)), "window {window:?}");
        let want: Vec<f32> = rounded.iter().flat_map(|r| dense_attention(r, &heads, window, 0.25)).collect();
        assert_close(&got, &want, 1e-5, "fp8 cache");
        let unrounded = run_paged(&mut rng, &requests, &heads, Paged::f32(4, window, 0.25, None));
        assert_ne!(got, unrounded, "the cache rounded nothing");
    }
}

#[test]
fn window_of_one_returns_own_value() {
    let mut rng = rng(10);
    let heads = Heads { num_heads: 4, num_kv_heads: 2, head_dim: 8 };
    let requests: Vec<Request> = BATCH.iter().map(|&(s, q)| Request::random(&mut rng, &heads, s, q)).collect();
    let got = run_paged(&mut rng, &requests, &heads, Paged::f32(4, Some(1), 0.3, None));
    let mut want = Vec::new();
    for req in &requests {
        for i in 0..req.q_len {
            let pos = req.seq_len - req.q_len + i;
            for h in 0..heads.num_heads {
                let kvh = h / 2;
                want.extend_from_slice(&req.v[(pos * 2 + kvh) * 8..][..8]);
            }
        }
    }
    assert_eq!(got, want);
}

#[test]
fn large_scores_do_not_overflow() {
    let mut rng = rng(11);
    let heads = Heads { num_heads: 2, num_kv_heads: 1, head_dim: 8 };
    let mut requests: Vec<Request> = BATCH.iter().map(|&(s, q)| Request::random(&mut rng, &heads, s, q)).collect();
    for req in &mut requests {
        req.q.iter_mut().for_each(|x| *x *= 300.0);
    }
    let got = run_paged(&mut rng, &requests, &heads, Paged::f32(16, None, 1.0, None));
    let want: Vec<f32> = requests.iter().flat_map(|r| dense_attention(r, &heads, None, 1.0)).collect();
    assert_close(&got, &want, 1e-3, "large scores");
}

#[test]
#[should_panic(expected = "queries but a context of")]
fn rejects_more_queries_than_context() {
    let meta = AttentionMetadata {
        query_start_loc: &[0, 3],
        seq_lens: &[2],
        block_tables: &[0],
        max_blocks_per_seq: 1,
        block_size: 4,
        sliding_window: None,
        scale: 1.0,
        softcap: None,
    };
    paged_attention(&[0.0; 3], KvView::F32(&[0.0; 4]), KvView::F32(&[0.0; 4]), &meta, 1, 1, 1, &mut [0.0; 3]);
}
