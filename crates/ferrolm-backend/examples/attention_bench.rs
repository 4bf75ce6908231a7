//! Times `cuda::paged_attention` in the Llama-3.1-8B shape (32 query heads, 8 KV heads,
//! head_dim 128, block_size 16, bf16; one case with one KV head) on random inputs, next to the general kernel
//! (`cuda::paged_attention_general`) on the same inputs.
//!
//! ```text
//! cargo build --release -p ferrolm-backend --features cuda --example attention_bench
//! target/release/examples/attention_bench ["decode batch 384"]   # only the cases named so
//! ```
//!
//! Cases: a decode step of 1 sequence at context 384 and 4096, of 256 sequences at context 640
//! and 1500 and of 232 at 1500 (the decode kernel), the same bytes as 384 at 1500 in 192, 384 and 768
//! sequences, in 3072 sequences of one KV head, and spread over 16 layers of a 75 GB cache as a
//! server's cache holds them, a 512-token and a 2048-token prompt of one sequence, a
//! mixed step of 16 512-token prompts with 200 decodes at context 600 (the tensor-core kernel),
//! the same with the decodes first as the scheduler orders them, and 384 decodes at context
//! 1500 before 8 1000-token prompts (a mixed step of the 1000-request benchmark), and those
//! prompts alone. Each is timed with
//! CUDA events around one call, best of 20 after a warm-up, and again as the mean of 32
//! back-to-back calls (one per layer, as a model step issues them, sharing one metadata and so
//! one work list; best of 3 such runs). Small cases cycle through 32 layers' worth of K/V so that
//! the reads come from device memory, not the L2 cache. Decode lines give the K/V bytes read per
//! call over the time.

mod bench_support;

use bench_support::open_gpu;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use ferrolm_backend::cuda::{self, Gpu, GpuAttentionMetadata, GpuError, GpuTensor};
use ferrolm_backend::{DType, WeightView};
use half::bf16;

const HEAD_DIM: usize = 128;
const BLOCK_SIZE: usize = 16;
/// Layers cycled through per case when one layer's K/V would fit in the L2 cache.
const LAYERS: usize = 32;
const REPS: usize = 20;

fn main() {
    let Some(gpu) = open_gpu() else { return };
    println!("{:<42} {:>12} {:>12} {:>14} {:>14}", "case", "best us", "mean32 us", "best GB/s", "mean32 GB/s");
    let mut mixed = vec![(512, 512); 16];
    mixed.extend([(600, 1); 200]);
    // As the scheduler orders a step: running requests' decodes first, then new prompts.
    let mut decodes_first = vec![(600, 1); 200];
    decodes_first.extend([(512, 512); 16]);
    let mut full_step = vec![(1500, 1); 384];
    full_step.extend([(1000, 1000); 8]);
    let cases = [
        ("decode batch 1, context 384", LLAMA_8B, COMPACT, vec![(384, 1)]),
        ("decode batch 1, context 4096", LLAMA_8B, COMPACT, vec![(4096, 1)]),
        ("decode batch 256, context 640", LLAMA_8B, COMPACT, vec![(640, 1); 256]),
        ("decode batch 256, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 256]),
        // The last requests of the 1000-request benchmark (1000 = 384 + 384 + 232).
        ("decode batch 232, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 232]),
        // The same bytes at three batch sizes: what each block's fixed cost and the last wave
        // take; then as 3072 sequences of one KV head, whose 16-key pages are 4 KiB contiguous
        // where the 8B's are 16 rows of 256 bytes 2 KiB apart.
        ("decode batch 384, context 1500", LLAMA_8B, COMPACT, vec![(1500, 1); 384]),
        ("decode batch 192, context 3000", LLAMA_8B, COMPACT, vec![(3000, 1); 192]),
        ("decode batch 768, context 750", LLAMA_8B, COMPACT, vec![(750, 1); 768]),
        ("decode batch 3072 x 1 KV head, context 1500", ONE_KV_HEAD, COMPACT, vec![(1500, 1); 3072]),
        // As a server's cache holds them: each layer's blocks drawn from a cache twice the
        // batch's size, and 16 such layers in turn (75 GB).
        ("decode batch 384, context 1500, 16 layers of a 75 GB cache", LLAMA_8B, SERVER_CACHE, vec![(1500, 1); 384]),
        ("prefill 512 of one sequence", LLAMA_8B, COMPACT, vec![(512, 512)]),
        ("prefill 2048 of one sequence", LLAMA_8B, COMPACT, vec![(2048, 2048)]),
        ("mixed 16 x 512 prefill + 200 decodes @600", LLAMA_8B, COMPACT, mixed),
        ("mixed 200 decodes @600 + 16 x 512 prefill", LLAMA_8B, COMPACT, decodes_first),
        ("mixed 384 decodes @1500 + 8 x 1000 prefill", LLAMA_8B, COMPACT, full_step),
        // That step's prompts alone: with "decode batch 384, context 1500", what the mixed
        // step's one launch costs against a launch for each kind.
        ("prefill 8 x 1000", LLAMA_8B, COMPACT, vec![(1000, 1000); 8]),
    ];
    // An argument keeps only the cases whose name holds it (e.g. to profile one).
    let only = std::env::args().nth(1).unwrap_or_default();
    for (name, heads, cache, requests) in cases.iter().filter(|(name, ..)| name.contains(&only)) {
        if let Err(e) = run_case(&gpu, name, *heads, *cache, requests) {
            eprintln!("{name}: {e}");
        }
    }
}

/// Query heads and KV heads of a case.
#[derive(Clone, Copy)]
struct Heads {
    query: usize,
    kv: usize,
}

const LLAMA_8B: Heads = Heads { query: 32, kv: 8 };
const ONE_KV_HEAD: Heads = Heads { query: 4, kv: 1 };

/// Where a case's K/V blocks lie: `spread` times as many blocks as the case reads, of which it
/// reads a random set, in `layers` caches used in turn (0: as many as keep a pass over them
/// several times the L2, and random values; else zeros, which take as long to attend over).
#[derive(Clone, Copy)]
struct CacheLayout {
    spread: usize,
    layers: usize,
}

const COMPACT: CacheLayout = CacheLayout { spread: 1, layers: 0 };
const SERVER_CACHE: CacheLayout = CacheLayout { spread: 2, layers: 16 };

/// `requests`: (context length, query rows) of each sequence.
fn run_case(
    gpu: &Gpu,
    name: &str,
    heads: Heads,
    cache: CacheLayout,
    requests: &[(usize, usize)],
) -> Result<(), GpuError> {
    let mut case = Case::new(gpu, heads, cache, requests)?;
    let decode_only = requests.iter().all(|&(_, q)| q == 1);
    for general in [false, true] {
        let label = if general { "  general kernel".to_string() } else { name.to_string() };
        let (best, mean) = case.time(gpu, general)?;
        let gbs = |s: f64| case.kv_bytes as f64 / s / 1e9;
        let (best_bw, mean_bw) = if decode_only {
            (format!("{:.0}", gbs(best)), format!("{:.0}", gbs(mean)))
        } else {
            ("-".into(), "-".into())
        };
        println!("{label:<42} {:>12.1} {:>12.1} {best_bw:>14} {mean_bw:>14}", best * 1e6, mean * 1e6);
    }
    Ok(())
}

/// One case's buffers: `sets` layers' K/V caches, all addressed by one block table as a model's
/// layers are.
struct Case {
    heads: Heads,
    q: GpuTensor,
    out: GpuTensor,
    /// `[num_blocks * BLOCK_SIZE, heads.kv * HEAD_DIM]` K and V of each layer.
    caches: Vec<(GpuTensor, GpuTensor)>,
    query_start_loc_host: Vec<u32>,
    query_start_loc: CudaSlice<u32>,
    seq_lens: CudaSlice<u32>,
    /// `[num_reqs, blocks_per_seq]`, over shuffled blocks.
    block_tables: CudaSlice<u32>,
    blocks_per_seq: usize,
    max_query_len: usize,
    kv_bytes: usize,
}

impl Case {
    fn new(gpu: &Gpu, heads: Heads, cache: CacheLayout, requests: &[(usize, usize)]) -> Result<Case, GpuError> {
        let kv_width = heads.kv * HEAD_DIM;
        let blocks_per_seq = requests.iter().map(|&(s, _)| s.div_ceil(BLOCK_SIZE)).max().unwrap_or(0);
        let context: usize = requests.iter().map(|&(s, _)| s).sum();
        let kv_bytes = context * kv_width * 2 * 2;
        let read_blocks = requests.len() * blocks_per_seq;
        let num_blocks = read_blocks * cache.spread;
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let mut order: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.next() as usize % (i + 1));
        }
        order.truncate(read_blocks);
        let cache_len = num_blocks * BLOCK_SIZE * kv_width;
        let caches = if cache.layers == 0 {
            // Enough layers that one pass over them is several times a 50 MB L2.
            let sets = if kv_bytes >= 256 << 20 { 1 } else { LAYERS };
            (0..sets)
                .map(|_| Ok((random_tensor(gpu, &mut rng, cache_len)?, random_tensor(gpu, &mut rng, cache_len)?)))
                .collect::<Result<Vec<_>, GpuError>>()?
        } else {
            (0..cache.layers)
                .map(|_| {
                    Ok((GpuTensor::zeros(gpu, DType::BF16, cache_len)?, GpuTensor::zeros(gpu, DType::BF16, cache_len)?))
                })
                .collect::<Result<Vec<_>, GpuError>>()?
        };
        let tokens: usize = requests.iter().map(|&(_, q)| q).sum();
        let q = random_tensor(gpu, &mut rng, tokens * heads.query * HEAD_DIM)?;
        let out = GpuTensor::zeros(gpu, DType::BF16, tokens * heads.query * HEAD_DIM)?;
        let mut query_start_loc_host = vec![0u32];
        for (r, &(_, q_len)) in requests.iter().enumerate() {
            query_start_loc_host.push(query_start_loc_host[r] + q_len as u32);
        }
        let seq_lens: Vec<u32> = requests.iter().map(|&(s, _)| s as u32).collect();
        Ok(Case {
            heads,
            q,
            out,
            caches,
            query_start_loc: gpu.upload(&query_start_loc_host)?,
            query_start_loc_host,
            seq_lens: gpu.upload(&seq_lens)?,
            block_tables: gpu.upload(&order)?,
            blocks_per_seq,
            max_query_len: requests.iter().map(|&(_, q)| q).max().unwrap_or(0),
            kv_bytes,
        })
    }

    /// (best single call, mean of `LAYERS` back-to-back calls), in seconds, on the kernel
    /// `paged_attention` picks or on the general kernel. Each run of `LAYERS` calls is one step:
    /// one metadata, whose work list the first call builds.
    fn time(&mut self, gpu: &Gpu, general: bool) -> Result<(f64, f64), GpuError> {
        let attend = if general { cuda::paged_attention_general } else { cuda::paged_attention };
        let Case { heads, q, out, caches, .. } = self;
        let Heads { query: num_heads, kv: num_kv_heads } = *heads;
        let step = || GpuAttentionMetadata {
            query_start_loc: self.query_start_loc.as_view(),
            query_start_loc_host: &self.query_start_loc_host,
            seq_lens: self.seq_lens.as_view(),
            block_tables: self.block_tables.as_view(),
            max_blocks_per_seq: self.blocks_per_seq,
            max_query_len: self.max_query_len,
            block_size: BLOCK_SIZE,
            sliding_window: None,
            scale: 1.0 / (HEAD_DIM as f32).sqrt(),
            work: Default::default(),
        };
        let mut call = |meta: &GpuAttentionMetadata<'_>, layer: usize| {
            let (k_cache, v_cache) = &caches[layer % caches.len()];
            attend(
                gpu,
                q.view(),
                k_cache.view(),
                v_cache.view(),
                meta,
                num_heads,
                num_kv_heads,
                HEAD_DIM,
                out.view_mut(),
            )
        };
        let ctx = gpu.stream().context();
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let meta = step();
        for layer in 0..LAYERS {
            call(&meta, layer)?;
        }
        gpu.synchronize()?;
        let mut best = f64::INFINITY;
        for rep in 0..REPS {
            start.record(gpu.stream())?;
            call(&meta, rep)?;
            end.record(gpu.stream())?;
            end.synchronize()?;
            best = best.min(start.elapsed_ms(&end)? as f64 / 1e3);
        }
        let mut mean = f64::INFINITY;
        for _ in 0..3 {
            let meta = step();
            start.record(gpu.stream())?;
            for layer in 0..LAYERS {
                call(&meta, layer)?;
            }
            end.record(gpu.stream())?;
            end.synchronize()?;
            mean = mean.min(start.elapsed_ms(&end)? as f64 / 1e3 / LAYERS as f64);
        }
        gpu.synchronize()?;
        Ok((best, mean))
    }
}

/// `len` bf16 values uniform in [-1, 1) on the device.
fn random_tensor(gpu: &Gpu, rng: &mut XorShift, len: usize) -> Result<GpuTensor, GpuError> {
    let data: Vec<bf16> = (0..len).map(|_| bf16::from_f32(rng.uniform())).collect();
    GpuTensor::from_weights(gpu, WeightView::BF16(&data), DType::BF16)
}

/// A small fast generator: the inputs need to be varied, not statistically strong.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}
