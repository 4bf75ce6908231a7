//! What the kernel benches share: the device, random inputs and the timing of back-to-back
//! calls. A bench takes what it needs of them.
#![allow(dead_code)]

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use ferrolm_backend::cuda::{
    AttentionKernel, AttentionWork, Fp8Cache, Gpu, GpuAttentionMetadata, GpuError, GpuOptions, GpuTensor,
    PagedAttention,
};
use ferrolm_backend::{DType, WeightView};
use half::bf16;

/// The server's defaults, with the switches the server takes from its command line read from
/// the same environment variables (`FERROLM_PDL=0`, `FERROLM_DECODE_WARP_ITEMS=0`,
/// `FERROLM_DECODE_TENSOR_COPIES=1`, `FERROLM_FP8_FAST_ACCUM=0`, `FERROLM_FP8_BLOCK_GEMM=0`,
/// `FERROLM_KERNEL_DEFINES="NAME=VALUE ..."`), so that one bench binary compares the variants.
pub fn gpu_options() -> GpuOptions {
    let set = |name: &str, default: bool| std::env::var(name).map_or(default, |v| !matches!(v.as_str(), "0" | "false"));
    let defines = std::env::var("FERROLM_KERNEL_DEFINES").unwrap_or_default();
    GpuOptions {
        programmatic_launch: set("FERROLM_PDL", true),
        decode_warp_items: set("FERROLM_DECODE_WARP_ITEMS", true),
        decode_tensor_copies: set("FERROLM_DECODE_TENSOR_COPIES", false),
        kernel_defines: defines.split_whitespace().map(str::to_string).collect(),
        fp8_fast_accumulation: set("FERROLM_FP8_FAST_ACCUM", true),
        fp8_block_gemm: set("FERROLM_FP8_BLOCK_GEMM", true),
    }
}

/// Device 0, its name and compute capability printed; `None` (said on stderr) without a GPU.
pub fn open_gpu() -> Option<Gpu> {
    match Gpu::new(0, &gpu_options()) {
        Ok(gpu) => {
            println!("{} (compute capability {:?})", gpu.name(), gpu.compute_capability());
            Some(gpu)
        }
        Err(e) => {
            eprintln!("no GPU: {e}");
            None
        }
    }
}

/// Calls per timed run.
pub const CALLS: usize = 64;

/// The next value of the xorshift state `seed`: the inputs need to be varied, not statistically
/// strong.
pub fn next_random(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// `len` random values in [-1, 1) (bf16-representable) stored as `dtype`; `seed` is a xorshift
/// state, advanced.
pub fn random_tensor(gpu: &Gpu, dtype: DType, len: usize, seed: &mut u64) -> Result<GpuTensor, GpuError> {
    let data: Vec<bf16> =
        (0..len).map(|_| bf16::from_f32((next_random(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)).collect();
    GpuTensor::from_weights(gpu, WeightView::BF16(&data), dtype)
}

/// The best mean time per call (seconds) of `call(i)` over 5 runs of `CALLS` back-to-back calls,
/// after one warm-up pass over `copies`.
pub fn best_mean(
    gpu: &Gpu,
    copies: usize,
    mut call: impl FnMut(usize) -> Result<(), GpuError>,
) -> Result<f64, GpuError> {
    let ctx = gpu.stream().context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for i in 0..copies {
        call(i)?;
    }
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        start.record(gpu.stream())?;
        for i in 0..CALLS {
            call(i)?;
        }
        end.record(gpu.stream())?;
        end.synchronize()?;
        best = best.min(start.elapsed_ms(&end)? as f64 / 1e3 / CALLS as f64);
    }
    Ok(best)
}

/// Head size and KV block size of the attention cases (the Llama families').
pub const HEAD_DIM: usize = 128;
pub const BLOCK_SIZE: usize = 16;
/// Layers cycled through per case when one layer's K/V would fit in the L2 cache.
pub const LAYERS: usize = 32;

/// Query heads and KV heads of an attention case.
#[derive(Clone, Copy)]
pub struct Heads {
    pub query: usize,
    pub kv: usize,
}

pub const LLAMA_8B: Heads = Heads { query: 32, kv: 8 };

/// Where a case's K/V blocks lie: `spread` times as many blocks as the case reads, of which it
/// reads a random set, in `layers` caches used in turn (0: as many as keep a pass over them
/// several times the L2), holding random values or zeros (which take as long to attend over
/// and much less time to set up), in bf16 or as FP8 codes (`--kv-cache-dtype fp8`'s caches:
/// one byte an element, read with a scale).
#[derive(Clone, Copy)]
pub struct CacheLayout {
    pub spread: usize,
    pub layers: usize,
    pub random: bool,
    pub fp8: bool,
}

pub const COMPACT: CacheLayout = CacheLayout { spread: 1, layers: 0, random: true, fp8: false };
pub const COMPACT_ZEROS: CacheLayout = CacheLayout { spread: 1, layers: 0, random: false, fp8: false };
pub const COMPACT_FP8: CacheLayout = CacheLayout { fp8: true, ..COMPACT };

/// The scale an FP8 case's caches are read with: random codes (up to 448) as values up to 1.
const FP8_CACHE_SCALE: f32 = 1.0 / 448.0;

/// One layer's K and V caches, `[num_blocks * BLOCK_SIZE, heads.kv * HEAD_DIM]` each.
pub enum LayerCache {
    Bf16(GpuTensor, GpuTensor),
    /// e4m3 codes, read with [`FP8_CACHE_SCALE`].
    Fp8(CudaSlice<u8>, CudaSlice<u8>),
}

/// One attention case: `(context length, query rows)` of each sequence, its buffers and its
/// step's metadata buffers, apart so that a step's metadata can borrow the one while calls
/// write into the other.
pub struct AttentionCase {
    pub buffers: AttentionBuffers,
    pub step: StepBuffers,
    /// K and V bytes one call reads.
    pub kv_bytes: usize,
}

/// A case's query of bf16 random values, its output, and `caches.len()` layers' K/V caches, all
/// addressed by one block table as a model's layers are; with the op's own decode workspace, so
/// that cases issued on different streams at once share none.
pub struct AttentionBuffers {
    pub attention: PagedAttention,
    pub heads: Heads,
    pub q: GpuTensor,
    pub out: GpuTensor,
    pub caches: Vec<LayerCache>,
}

/// A case's attention metadata on the device and the host.
pub struct StepBuffers {
    query_start_loc_host: Vec<u32>,
    query_start_loc: CudaSlice<u32>,
    seq_lens: CudaSlice<u32>,
    /// `[num_reqs, blocks_per_seq]`, over shuffled blocks.
    block_tables: CudaSlice<u32>,
    blocks_per_seq: usize,
    max_query_len: usize,
    /// The flash kernel's work list, built by the first call that needs it.
    work: AttentionWork,
}

impl AttentionCase {
    pub fn new(
        gpu: &Gpu,
        heads: Heads,
        cache: CacheLayout,
        requests: &[(usize, usize)],
    ) -> Result<AttentionCase, GpuError> {
        let kv_width = heads.kv * HEAD_DIM;
        let blocks_per_seq = requests.iter().map(|&(s, _)| s.div_ceil(BLOCK_SIZE)).max().unwrap_or(0);
        let context: usize = requests.iter().map(|&(s, _)| s).sum();
        let kv_bytes = context * kv_width * 2 * if cache.fp8 { 1 } else { 2 };
        let read_blocks = requests.len() * blocks_per_seq;
        let num_blocks = read_blocks * cache.spread;
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut order: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, next_random(&mut seed) as usize % (i + 1));
        }
        order.truncate(read_blocks);
        let cache_len = num_blocks * BLOCK_SIZE * kv_width;
        // Enough layers that one pass over them is several times a 50 MB L2.
        let layers = match cache.layers {
            0 if kv_bytes >= 256 << 20 => 1,
            0 => LAYERS,
            n => n,
        };
        let mut bf16_cache = || {
            if cache.random {
                random_tensor(gpu, DType::BF16, cache_len, &mut seed)
            } else {
                GpuTensor::zeros(gpu, DType::BF16, cache_len)
            }
        };
        let caches = if cache.fp8 {
            // Random codes but the two NaNs (0x7f, 0xff), or zeros; the same in every layer.
            let codes: Vec<u8> = if cache.random {
                (0..cache_len).map(|i| (next_random(&mut (i as u64 + 1)) % 0x7f) as u8 | ((i as u8) << 7)).collect()
            } else {
                vec![0; cache_len]
            };
            (0..layers)
                .map(|_| Ok(LayerCache::Fp8(gpu.upload(&codes)?, gpu.upload(&codes)?)))
                .collect::<Result<Vec<_>, GpuError>>()?
        } else {
            (0..layers)
                .map(|_| Ok(LayerCache::Bf16(bf16_cache()?, bf16_cache()?)))
                .collect::<Result<Vec<_>, GpuError>>()?
        };
        let tokens: usize = requests.iter().map(|&(_, q)| q).sum();
        let q = random_tensor(gpu, DType::BF16, tokens * heads.query * HEAD_DIM, &mut seed)?;
        let out = GpuTensor::zeros(gpu, DType::BF16, tokens * heads.query * HEAD_DIM)?;
        let mut query_start_loc_host = vec![0u32];
        for (r, &(_, q_len)) in requests.iter().enumerate() {
            query_start_loc_host.push(query_start_loc_host[r] + q_len as u32);
        }
        let seq_lens: Vec<u32> = requests.iter().map(|&(s, _)| s as u32).collect();
        Ok(AttentionCase {
            buffers: AttentionBuffers { attention: PagedAttention::new(gpu)?, heads, q, out, caches },
            step: StepBuffers {
                query_start_loc: gpu.upload(&query_start_loc_host)?,
                query_start_loc_host,
                seq_lens: gpu.upload(&seq_lens)?,
                block_tables: gpu.upload(&order)?,
                blocks_per_seq,
                max_query_len: requests.iter().map(|&(_, q)| q).max().unwrap_or(0),
                work: AttentionWork::default(),
            },
            kv_bytes,
        })
    }
}

impl StepBuffers {
    /// The step's metadata (one per step: the first call builds its work list).
    pub fn metadata(&self) -> GpuAttentionMetadata<'_> {
        GpuAttentionMetadata {
            query_start_loc: self.query_start_loc.as_view(),
            query_start_loc_host: &self.query_start_loc_host,
            seq_lens: self.seq_lens.as_view(),
            block_tables: self.block_tables.as_view(),
            max_blocks_per_seq: self.blocks_per_seq,
            max_query_len: self.max_query_len,
            block_size: BLOCK_SIZE,
            sliding_window: None,
            scale: 1.0 / (HEAD_DIM as f32).sqrt(),
            softcap: None,
            work: &self.work,
        }
    }
}

impl AttentionBuffers {
    /// One call on `layer`'s cache (in turn), on `kernel`, with `meta` from the same case's
    /// [`StepBuffers::metadata`].
    pub fn attend(
        &mut self,
        gpu: &Gpu,
        meta: &GpuAttentionMetadata<'_>,
        layer: usize,
        kernel: AttentionKernel,
    ) -> Result<(), GpuError> {
        let Heads { query, kv } = self.heads;
        let heads = ferrolm_backend::Heads { num_heads: query, num_kv_heads: kv, head_dim: HEAD_DIM };
        let (q, out) = (self.q.view(), self.out.view_mut());
        match &self.caches[layer % self.caches.len()] {
            LayerCache::Bf16(k, v) => self.attention.run_on(kernel, gpu, q, k.view(), v.view(), meta, heads, out),
            LayerCache::Fp8(k, v) => {
                let k = Fp8Cache::new(gpu, k, k.len(), FP8_CACHE_SCALE);
                let v = Fp8Cache::new(gpu, v, v.len(), FP8_CACHE_SCALE);
                self.attention.run_fp8_on(kernel, gpu, q, k, v, meta, heads, out)
            }
        }
    }
}
