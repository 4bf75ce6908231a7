//! The paged KV cache on the device: writing new tokens' K/V ([`reshape_and_cache`]) and causal
//! attention over it ([`PagedAttention::run`]), with the semantics of the CPU ops of the same
//! names. [`PagedAttention`] owns what the decode kernels keep between launches (their merge
//! counters and split workspace, allocated once so that captured graphs keep valid addresses)
//! and the decode switches of [`super::GpuOptions`].
//!
//! Each layer's cache is a K and a V tensor of `[num_blocks * block_size, num_kv_heads * head_dim]`
//! in the activation dtype; `slot = block_id * block_size + offset`. An FP8 cache
//! (`--kv-cache-dtype fp8`) holds the same slots as e4m3 codes of each value divided by the
//! layer's K or V scale ([`Fp8Cache`], written by [`reshape_and_cache_fp8`]); its attention
//! ([`PagedAttention::run_fp8`]) takes the tensor-core decode kernel's block form in bf16 and
//! f16 (the CUDA-core one in f32, or for other head sizes) for decodes and the tensor-core
//! prefill kernel (or the general one) otherwise, but for a mixed batch's leading decodes, which
//! take the decode kernel; each in a form that reads codes: the per-warp decode forms read the
//! activations' dtype only.
//!
//! Four kernels compute attention. Batches of decodes (`max_query_len <= 1`) take a decode
//! kernel: one block per (token, KV head, context partition), K/V read once per GQA group, and,
//! when there are too few (token, KV head) pairs to fill the device, the context split into
//! partitions whose partial results the last block of each merges (flash-decoding). In bf16 and
//! f16, for head sizes 64, 80, 96 and 128, that is the tensor-core decode kernel
//! (`kernels/decode_attention.cu`, the block's query heads as the rows of one mma tile); else
//! the decode kernel of `kernels/attention.cu`, which works in f32 on CUDA cores.
//! Prefill chunks and mixed batches in bf16 or f16 take the tensor-core kernel of
//! [`super::flash_attention`] where it has the head size; everything else goes to the general
//! kernel, which tiles query rows and keys through shared memory in f32. All compute the same
//! function for any batch; `max_query_len` and the dtype only pick the kernel. Each kernel takes
//! a layer's soft-cap of the scores (Gemma 2: `float softcap`, 0 for none) and applies it where
//! it forms a score, so a soft-capped layer runs on whichever kernel its batch would take.

use cudarc::driver::sys::{
    cuTensorMapEncodeTiled, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use std::marker::PhantomData;

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig};

use super::flash_attention::{self, AttentionWork};
use super::gpu::{rows_config, to_u32};
use super::ops::same_dtype;
use super::{Gpu, GpuError, GpuView, GpuViewMut};
use crate::device::Heads;
use crate::DType;

use super::compile::{self, KernelFamilies};

/// The entry points of the paged KV cache ops: the tensor-core decode kernels exist for the half
/// types only.
pub(crate) const KERNELS: &[KernelFamilies] = &[
    KernelFamilies {
        source: &compile::ATTENTION,
        names: &["reshape_and_cache", "reshape_and_cache_fp8"],
        large_shared: false,
    },
    KernelFamilies {
        source: &compile::ATTENTION,
        names: &[
            "paged_attention",
            "paged_attention_decode_g1",
            "paged_attention_decode_g2",
            "paged_attention_decode_g4",
            "paged_attention_decode_g8",
            "paged_attention_fp8kv",
            "paged_attention_decode_fp8kv_g1",
            "paged_attention_decode_fp8kv_g2",
            "paged_attention_decode_fp8kv_g4",
            "paged_attention_decode_fp8kv_g8",
        ],
        large_shared: true,
    },
    KernelFamilies {
        source: &compile::DECODE_ATTENTION,
        names: &[
            DECODE_MMA_KERNELS[0].1,
            DECODE_MMA_KERNELS[1].1,
            DECODE_MMA_KERNELS[2].1,
            DECODE_MMA_KERNELS[3].1,
            DECODE_MMA_KERNELS[0].2,
            DECODE_MMA_KERNELS[1].2,
            DECODE_MMA_KERNELS[2].2,
            DECODE_MMA_KERNELS[3].2,
            DECODE_MMA_TENSOR_KERNELS[0].1,
            DECODE_MMA_TENSOR_KERNELS[1].1,
            DECODE_MMA_FP8_KERNELS[0].1,
            DECODE_MMA_FP8_KERNELS[1].1,
            DECODE_MMA_FP8_KERNELS[2].1,
            DECODE_MMA_FP8_KERNELS[3].1,
        ],
        large_shared: true,
    },
];

/// Keys per shared-memory tile (`ATTN_TILE` in attention.cu).
const KEY_TILE: usize = 32;
/// Accumulator elements per thread (`ATTN_ACC` in attention.cu).
const ACC_PER_THREAD: usize = 16;
/// Query tokens per block at most when a request has several.
const MAX_QUERY_TILE: usize = 32;

/// Threads of a decode block (`DECODE_WARPS * 32` in attention.cu).
const DECODE_THREADS: usize = 128;
/// Query heads a decode block takes at most (the largest `G` the kernel is instantiated for).
const DECODE_MAX_HEADS: usize = 8;
/// Elements of K (and of V) per shared-memory tile of the decode kernel (`DECODE_TILE_ELEMS`).
const DECODE_TILE_ELEMS: usize = 4096;
/// Tiles in the decode kernel's ring of K/V copies (`DECODE_STAGES`).
const DECODE_STAGES: usize = 4;
/// Decode blocks wanted per launch: a few per SM of a large GPU (132 on an H200), so that short
/// batches still fill the device. The context is split only for fewer (token, head block)
/// pairs than this, so it is also the number of merge counters [`PagedAttention`] keeps.
const DECODE_TARGET_BLOCKS: usize = 512;
/// Floats of the decode workspace [`PagedAttention`] keeps. A split launch aiming at `target_blocks` has
/// at most `2 * target_blocks` (block, partition) pairs (parts = ceil(target / blocks) for at most
/// `target` blocks), each of at most `max_heads` query heads with `head_dim + 2` floats: the
/// larger of the two kernels' products, at head_dim 256 (8.5 MB).
const DECODE_WORKSPACE_FLOATS: usize = 2 * split_heads_bound() * (256 + 2);

const fn split_heads_bound() -> usize {
    let cuda = CUDA_CORE_SPLIT.target_blocks * CUDA_CORE_SPLIT.max_heads;
    let mma = TENSOR_CORE_SPLIT.target_blocks * TENSOR_CORE_SPLIT.max_heads;
    if cuda > mma {
        cuda
    } else {
        mma
    }
}
/// Fewest keys per partition of the CUDA-core decode kernel: below this a block's fixed cost
/// outweighs its loads. The kernel's `DECODE_MIN_PART` is the same: it cuts each row's own
/// context into partitions of at least this many keys (the tensor-core kernel, of its tile).
const DECODE_MIN_PART: usize = 32;

/// The tensor-core decode kernel of each head size it is compiled for, `(head_dim, name)`;
/// loaded for bf16 and f16 only.
pub(crate) const DECODE_MMA_KERNELS: [(usize, &str, &str); 4] = [
    (64, "paged_decode_mma_d64", "paged_decode_mma_warp_d64"),
    (80, "paged_decode_mma_d80", "paged_decode_mma_warp_d80"),
    (96, "paged_decode_mma_d96", "paged_decode_mma_warp_d96"),
    (128, "paged_decode_mma_d128", "paged_decode_mma_warp_d128"),
];
/// The tensor-core decode kernel over FP8 caches (`paged_decode_mma_fp8kv_d{D}`, the block
/// kernel only), `(head_dim, name)`; loaded for bf16 and f16 only.
pub(crate) const DECODE_MMA_FP8_KERNELS: [(usize, &str); 4] = [
    (64, "paged_decode_mma_fp8kv_d64"),
    (80, "paged_decode_mma_fp8kv_d80"),
    (96, "paged_decode_mma_fp8kv_d96"),
    (128, "paged_decode_mma_fp8kv_d128"),
];
/// The per-warp kernel in its form that copies K/V tiles as boxes of the caches' tensor maps
/// (`paged_decode_mma_tensor_d{D}`, sm_90), `(head_dim, name)`; loaded for bf16 and f16 only.
pub(crate) const DECODE_MMA_TENSOR_KERNELS: [(usize, &str); 2] =
    [(64, "paged_decode_mma_tensor_d64"), (128, "paged_decode_mma_tensor_d128")];
/// Keys per warp and tile of the per-warp kernel (`DM_KEYS`): with tensor copies, one cache block.
const DECODE_MMA_WARP_KEYS: usize = 16;
/// Columns of a tensor-copy box: 128 bytes of 2-byte elements, the most 128-byte swizzling takes.
const TENSOR_BOX_COLUMNS: usize = 64;
/// Query heads of a tensor-core decode block (`DM_ROWS`: the rows of one mma tile).
const DECODE_MMA_HEADS: usize = 16;
/// Keys per tile of the tensor-core decode kernel (`DM_TILE_KEYS`), and its fewest keys per
/// partition: a shorter partition leaves warps of its one tile idle.
const DECODE_MMA_TILE_KEYS: usize = 64;
/// How a decode kernel splits a context.
#[derive(Clone, Copy, Debug)]
struct SplitPolicy {
    /// Query heads per block.
    max_heads: usize,
    /// Fewest keys per partition.
    min_part: usize,
    /// Blocks a split aims at (at most `DECODE_TARGET_BLOCKS`, the merge counters).
    target_blocks: usize,
}

/// The tensor-core kernel aims at one block per SM of a large GPU rather than four: its blocks
/// stream a partition several times faster, so more, shorter partitions only lengthen the merge
/// (H200, 8B shape, batch 1 at context 4096: 64 partitions of 64 keys 31.6 us, 16 of 256 keys
/// 16.4 us; at context 384 both give 6 partitions of 64).
const CUDA_CORE_SPLIT: SplitPolicy =
    SplitPolicy { max_heads: DECODE_MAX_HEADS, min_part: DECODE_MIN_PART, target_blocks: DECODE_TARGET_BLOCKS };
const TENSOR_CORE_SPLIT: SplitPolicy =
    SplitPolicy { max_heads: DECODE_MMA_HEADS, min_part: DECODE_MMA_TILE_KEYS, target_blocks: 128 };
/// Most partitions per (token, head); bounds the workspace and the combine step.
const DECODE_MAX_PARTS: usize = 128;

/// Describes the flattened batch for [`PagedAttention::run`], as [`crate::cpu::AttentionMetadata`]
/// does, with the index buffers on the device. Build one per step: its `work` keeps what the
/// step's first layer works out for the others.
#[derive(Debug)]
pub struct GpuAttentionMetadata<'a> {
    /// `[num_reqs + 1]`: request `r` owns query rows `query_start_loc[r]..query_start_loc[r + 1]`.
    pub query_start_loc: CudaView<'a, u32>,
    /// `[num_reqs + 1]`: the same on the host, from which the tensor-core kernel's work list is
    /// built.
    pub query_start_loc_host: &'a [u32],
    /// `[num_reqs]`: context length of request `r` after this step (cached + new tokens).
    pub seq_lens: CudaView<'a, u32>,
    /// `[num_reqs, max_blocks_per_seq]`, padded: the KV block ids of each request.
    pub block_tables: CudaView<'a, u32>,
    pub max_blocks_per_seq: usize,
    /// The most query rows of any request (1 for a batch of decodes). Only the work split
    /// depends on it; results are correct for any value.
    pub max_query_len: usize,
    pub block_size: usize,
    /// A query at position `p` sees keys at positions `j` with `p - window < j <= p` (HF semantics).
    pub sliding_window: Option<usize>,
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Attention-logit soft-cap (Gemma 2): each scaled score `s` becomes `cap * tanh(s / cap)`
    /// before the mask. Every kernel applies it where it forms the score.
    pub softcap: Option<f32>,
    /// Starts empty (`AttentionWork::default()`); filled by the first call that needs it, and
    /// shared by every layer's metadata of the step.
    pub work: &'a AttentionWork,
}

impl<'a> GpuAttentionMetadata<'a> {
    /// The metadata of the first `n` requests alone, each of one query row, with `work` for their
    /// work list.
    fn leading<'b>(&'b self, n: usize, work: &'b AttentionWork) -> GpuAttentionMetadata<'b> {
        debug_assert_eq!(leading_decodes(&self.query_start_loc_host[..n + 1]), n, "not {n} one-row requests first");
        GpuAttentionMetadata {
            query_start_loc: self.query_start_loc.slice(..n + 1),
            query_start_loc_host: &self.query_start_loc_host[..n + 1],
            seq_lens: self.seq_lens.slice(..n),
            block_tables: self.block_tables.slice(..n * self.max_blocks_per_seq),
            max_query_len: 1,
            work,
            ..*self
        }
    }
}

/// How many requests from the first have one query row each, rows 0, 1, ... of the batch (none
/// if the first request's rows do not start at row 0).
fn leading_decodes(query_start_loc: &[u32]) -> usize {
    if query_start_loc.first() != Some(&0) {
        return 0;
    }
    query_start_loc.windows(2).take_while(|w| w[1].checked_sub(w[0]) == Some(1)).count()
}

/// Writes each token's K and V into the paged cache at `slot_mapping[t]` (a negative slot is
/// padding and is skipped). `k`, `v`: `[T, kv_width]`; caches: `[num_blocks * block_size, kv_width]`,
/// all in one dtype. Slots must lie inside the cache (one past it is skipped).
pub fn reshape_and_cache(
    gpu: &Gpu,
    k: GpuView<'_>,
    v: GpuView<'_>,
    slot_mapping: &impl DevicePtr<i64>,
    kv_width: usize,
    k_cache: GpuViewMut<'_>,
    v_cache: GpuViewMut<'_>,
) -> Result<(), GpuError> {
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
    for dtype in [v.dtype(), k_cache.dtype(), v_cache.dtype()] {
        same_dtype("reshape_and_cache", k.dtype(), dtype);
    }
    if tokens == 0 {
        return Ok(());
    }
    let (k_ptr, v_ptr, slots_ptr) = (k.ptr(), v.ptr(), gpu.index_ptr(slot_mapping));
    let (kc_ptr, vc_ptr) = (k_cache.ptr(), v_cache.ptr());
    let width = to_u32("reshape_and_cache", "kv_width", kv_width);
    let num_slots = (k_cache.len() / kv_width) as i64;
    let mut launch = gpu.launch_builder("reshape_and_cache", k.dtype());
    launch.arg(&k_ptr).arg(&v_ptr).arg(&slots_ptr).arg(&kc_ptr).arg(&vc_ptr).arg(&width).arg(&num_slots);
    // SAFETY: the arguments match the kernel's parameters; the kernel checks every slot.
    unsafe { launch.launch(rows_config(tokens, kv_width)) }?;
    Ok(())
}

/// One layer's FP8 K (or V) cache: `[num_blocks * block_size, kv_width]` e4m3 codes of each value
/// divided by `scale`.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Cache<'a> {
    ptr: u64,
    len: usize,
    scale: f32,
    _codes: PhantomData<&'a CudaSlice<u8>>,
}

impl<'a> Fp8Cache<'a> {
    /// The first `len` codes of `codes`, read with `scale` (positive and finite).
    pub fn new(gpu: &Gpu, codes: &'a CudaSlice<u8>, len: usize, scale: f32) -> Fp8Cache<'a> {
        assert!(len <= codes.len(), "an FP8 cache of {len} codes in a buffer of {}", codes.len());
        assert!(scale.is_finite() && scale > 0.0, "an FP8 cache scale of {scale}");
        Fp8Cache { ptr: gpu.index_ptr(codes), len, scale, _codes: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// [`Fp8Cache`] to write.
pub struct Fp8CacheMut<'a> {
    view: Fp8Cache<'a>,
    _codes: PhantomData<&'a mut CudaSlice<u8>>,
}

impl<'a> Fp8CacheMut<'a> {
    /// The first `len` codes of `codes`, written with `scale` (positive and finite).
    pub fn new(gpu: &Gpu, codes: &'a mut CudaSlice<u8>, len: usize, scale: f32) -> Fp8CacheMut<'a> {
        Fp8CacheMut { view: Fp8Cache::new(gpu, codes, len, scale), _codes: PhantomData }
    }
}

/// [`reshape_and_cache`] into FP8 caches: each element stored as `e4m3(x / scale)` (rounded to
/// nearest even, saturating), as the CPU's FP8 cache stores it. `k`, `v`: `[T, kv_width]` in the
/// activations' dtype.
pub fn reshape_and_cache_fp8(
    gpu: &Gpu,
    k: GpuView<'_>,
    v: GpuView<'_>,
    slot_mapping: &impl DevicePtr<i64>,
    kv_width: usize,
    k_cache: Fp8CacheMut<'_>,
    v_cache: Fp8CacheMut<'_>,
) -> Result<(), GpuError> {
    let op = "reshape_and_cache_fp8";
    let tokens = slot_mapping.len();
    let (kc, vc) = (k_cache.view, v_cache.view);
    assert!(kv_width > 0, "{op}: kv_width is 0");
    assert_eq!(k.len(), tokens * kv_width, "{op}: k has {} elements, expected [{tokens}, {kv_width}]", k.len());
    assert_eq!(v.len(), tokens * kv_width, "{op}: v has {} elements, expected [{tokens}, {kv_width}]", v.len());
    assert_eq!(kc.len, vc.len, "{op}: k_cache and v_cache differ in size");
    assert_eq!(kc.len % kv_width, 0, "{op}: cache is not whole slots of {kv_width}");
    same_dtype(op, k.dtype(), v.dtype());
    if tokens == 0 {
        return Ok(());
    }
    let (k_ptr, v_ptr, slots_ptr) = (k.ptr(), v.ptr(), gpu.index_ptr(slot_mapping));
    let width = to_u32(op, "kv_width", kv_width);
    let num_slots = (kc.len / kv_width) as i64;
    let mut launch = gpu.launch_builder(op, k.dtype());
    launch.arg(&k_ptr).arg(&v_ptr).arg(&slots_ptr).arg(&kc.ptr).arg(&vc.ptr).arg(&width).arg(&num_slots);
    launch.arg(&kc.scale).arg(&vc.scale);
    // SAFETY: the arguments match the kernel's parameters; the kernel checks every slot.
    unsafe { launch.launch(rows_config(tokens, kv_width)) }?;
    Ok(())
}

/// Paged attention on one [`Gpu`], with the state its decode kernels keep between launches.
/// Create one per `Gpu` (it takes the decode switches of the `Gpu`'s [`super::GpuOptions`]) and
/// keep it as long as graphs that captured its launches are replayed.
pub struct PagedAttention {
    /// The decode attention kernel's partition-merge counters, one per (token, head block) of a
    /// split launch ([`DECODE_TARGET_BLOCKS`], more than a split launch has), zero between
    /// launches: allocated once, so that captured graphs keep a valid address.
    decode_counters: CudaSlice<u32>,
    /// The decode attention kernels' partial results when they split a context
    /// ([`DECODE_WORKSPACE_FLOATS`], the most a split launch needs): allocated once so that a
    /// captured decode step holds no allocation and its kernels follow one another.
    decode_workspace: CudaSlice<f32>,
    /// [`super::GpuOptions::decode_warp_items`]: unsplit tensor-core decodes may take the
    /// head-block-per-warp kernel.
    decode_warp_items: bool,
    /// [`super::GpuOptions::decode_tensor_copies`], on compute capability 9.0 and later only:
    /// the per-warp decode kernel copies K/V as tensor-map boxes where it can.
    decode_tensor_copies: bool,
}

impl PagedAttention {
    /// Allocates the decode kernels' counters and workspace on `gpu` and takes its switches.
    pub fn new(gpu: &Gpu) -> Result<PagedAttention, GpuError> {
        let stream = gpu.stream();
        let decode_counters = stream.alloc_zeros::<u32>(DECODE_TARGET_BLOCKS)?;
        // SAFETY: a decode kernel writes every element of the workspace that it reads.
        let decode_workspace = unsafe { stream.alloc::<f32>(DECODE_WORKSPACE_FLOATS) }?;
        let options = gpu.options();
        Ok(PagedAttention {
            decode_counters,
            decode_workspace,
            decode_warp_items: options.decode_warp_items,
            decode_tensor_copies: gpu.compute_capability().0 >= 9 && options.decode_tensor_copies,
        })
    }

    /// Causal attention of every query row over its request's paged K/V (which must already
    /// hold the new tokens: call [`reshape_and_cache`] first), as [`crate::cpu::paged_attention`].
    /// GQA: query head `h` reads KV head `h / (num_heads / num_kv_heads)`. `q`, `out`: `[T,
    /// num_heads, head_dim]`; caches as in [`reshape_and_cache`]; all in one dtype. Block ids
    /// past the cache read as zeros. `gpu` must be the one `self` was created on.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &Gpu,
        q: GpuView<'_>,
        k_cache: GpuView<'_>,
        v_cache: GpuView<'_>,
        meta: &GpuAttentionMetadata<'_>,
        heads: Heads,
        out: GpuViewMut<'_>,
    ) -> Result<(), GpuError> {
        let caches = Caches::Dense(k_cache, v_cache);
        self.attention(gpu, &Operands { q, caches, meta, heads }, out, AttentionKernel::Picked)
    }

    /// [`Self::run`] over FP8 caches (written by [`reshape_and_cache_fp8`]): `q` and `out` in the
    /// activations' dtype, each cached element read as its code times its cache's scale.
    #[allow(clippy::too_many_arguments)]
    pub fn run_fp8(
        &self,
        gpu: &Gpu,
        q: GpuView<'_>,
        k_cache: Fp8Cache<'_>,
        v_cache: Fp8Cache<'_>,
        meta: &GpuAttentionMetadata<'_>,
        heads: Heads,
        out: GpuViewMut<'_>,
    ) -> Result<(), GpuError> {
        let caches = Caches::Fp8(k_cache, v_cache);
        self.attention(gpu, &Operands { q, caches, meta, heads }, out, AttentionKernel::Picked)
    }

    /// [`Self::run_fp8`] on a kernel of the caller's choice (`Picked` or `General`), for tests
    /// that compare the kernels.
    #[cfg(feature = "bench-internals")]
    #[allow(clippy::too_many_arguments)]
    pub fn run_fp8_on(
        &self,
        kernel: AttentionKernel,
        gpu: &Gpu,
        q: GpuView<'_>,
        k_cache: Fp8Cache<'_>,
        v_cache: Fp8Cache<'_>,
        meta: &GpuAttentionMetadata<'_>,
        heads: Heads,
        out: GpuViewMut<'_>,
    ) -> Result<(), GpuError> {
        let caches = Caches::Fp8(k_cache, v_cache);
        self.attention(gpu, &Operands { q, caches, meta, heads }, out, kernel)
    }

    /// [`Self::run`] on a kernel of the caller's choice, for benchmarks and tests that compare
    /// the kernels. An error where the kernel does not apply (see [`AttentionKernel`]).
    #[cfg(feature = "bench-internals")]
    #[allow(clippy::too_many_arguments)]
    pub fn run_on(
        &self,
        kernel: AttentionKernel,
        gpu: &Gpu,
        q: GpuView<'_>,
        k_cache: GpuView<'_>,
        v_cache: GpuView<'_>,
        meta: &GpuAttentionMetadata<'_>,
        heads: Heads,
        out: GpuViewMut<'_>,
    ) -> Result<(), GpuError> {
        let caches = Caches::Dense(k_cache, v_cache);
        self.attention(gpu, &Operands { q, caches, meta, heads }, out, kernel)
    }
}

/// One call's inputs, as every attention kernel path takes them (checked in `attention`).
#[derive(Clone, Copy)]
pub(crate) struct Operands<'a> {
    /// `[T, num_heads, head_dim]`
    pub(crate) q: GpuView<'a>,
    pub(crate) caches: Caches<'a>,
    pub(crate) meta: &'a GpuAttentionMetadata<'a>,
    pub(crate) heads: Heads,
}

/// A layer's K and V caches, `[num_blocks * block_size, num_kv_heads * head_dim]` each.
#[derive(Clone, Copy)]
pub(crate) enum Caches<'a> {
    /// In the activations' dtype.
    Dense(GpuView<'a>, GpuView<'a>),
    Fp8(Fp8Cache<'a>, Fp8Cache<'a>),
}

impl Caches<'_> {
    /// Elements of each cache (the K cache's; `attention` checks that V's agree).
    pub(crate) fn len(&self) -> usize {
        self.lens().0
    }

    fn lens(&self) -> (usize, usize) {
        match self {
            Caches::Dense(k, v) => (k.len(), v.len()),
            Caches::Fp8(k, v) => (k.len, v.len),
        }
    }

    /// The K and V caches' addresses.
    pub(crate) fn ptrs(&self) -> (u64, u64) {
        match self {
            Caches::Dense(k, v) => (k.ptr(), v.ptr()),
            Caches::Fp8(k, v) => (k.ptr, v.ptr),
        }
    }

    /// The FP8 caches' scales, `(k, v)`; `None` for dense caches.
    pub(crate) fn fp8_scales(&self) -> Option<(f32, f32)> {
        match self {
            Caches::Dense(..) => None,
            Caches::Fp8(k, v) => Some((k.scale, v.scale)),
        }
    }

    /// Bytes of one cached element.
    fn elem_size(&self) -> usize {
        match self {
            Caches::Dense(k, _) => k.dtype().size_in_bytes(),
            Caches::Fp8(..) => 1,
        }
    }
}

/// Where a decode call takes the per-warp kernel's tensor-copy form (the kernel named).
#[derive(Clone, Copy, Debug, PartialEq)]
enum TensorCopies {
    Never,
    /// Wherever the per-warp kernel runs (`GpuOptions::decode_tensor_copies`).
    WherePerWarp(&'static str),
    /// For the whole batch, unsplit ([`AttentionKernel::TensorCopies`]).
    Always(&'static str),
}

/// Which kernel a [`PagedAttention::run_on`] call takes (`bench-internals` feature); without
/// the feature every call takes `Picked`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(feature = "bench-internals"), allow(dead_code))]
pub enum AttentionKernel {
    /// The one [`PagedAttention::run`] picks for the batch.
    Picked,
    /// The general kernel, whatever the batch, dtype and head size.
    General,
    /// The per-warp tensor-core decode kernel in its tensor-copy form, whatever the batch size
    /// and whether or not [`PagedAttention`] takes that form itself (`GpuOptions::decode_tensor_copies`); an
    /// error where it does not apply (see `tensor_copy_kernel`).
    TensorCopies,
}

impl PagedAttention {
    /// Checks the call, then takes the kernel `route` asks for or picks one.
    fn attention(
        &self,
        gpu: &Gpu,
        operands: &Operands<'_>,
        out: GpuViewMut<'_>,
        route: AttentionKernel,
    ) -> Result<(), GpuError> {
        let Operands { q, caches, meta, heads } = *operands;
        let Heads { num_heads, num_kv_heads, head_dim } = heads;
        let op = "paged_attention";
        assert!(
            num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
            "{op}: num_heads, num_kv_heads and head_dim must be positive"
        );
        assert_eq!(
            num_heads % num_kv_heads,
            0,
            "{op}: {num_heads} query heads do not share {num_kv_heads} KV heads evenly"
        );
        let token_width = num_heads * head_dim;
        assert_eq!(q.len() % token_width, 0, "{op}: q is not [T, {num_heads}, {head_dim}]");
        assert_eq!(out.len(), q.len(), "{op}: out and q differ in size");
        let num_reqs = meta.seq_lens.len();
        assert_eq!(meta.query_start_loc.len(), num_reqs + 1, "{op}: query_start_loc must have num_reqs + 1 entries");
        assert_eq!(
            meta.block_tables.len(),
            num_reqs * meta.max_blocks_per_seq,
            "{op}: block_tables is not [num_reqs, max_blocks_per_seq]"
        );
        assert!(meta.block_size > 0, "{op}: block_size is 0");
        assert!(meta.sliding_window != Some(0), "{op}: sliding window of 0 sees nothing");
        assert!(meta.softcap.is_none_or(|c| c > 0.0), "{op}: a soft-cap must be positive");
        let kv_width = num_kv_heads * head_dim;
        let (k_len, v_len) = caches.lens();
        assert_eq!(k_len, v_len, "{op}: k_cache and v_cache differ in size");
        assert_eq!(k_len % kv_width, 0, "{op}: cache is not whole slots");
        let (k_cache, v_cache) = match caches {
            Caches::Dense(k, v) => (k, v),
            Caches::Fp8(..) => {
                same_dtype(op, q.dtype(), out.dtype());
                if q.is_empty() {
                    return Ok(());
                }
                // Decodes take the tensor-core decode kernel's block form in bf16/f16, else the
                // CUDA-core one (`fp8_decode_kernel`); prefills the tensor-core prefill kernel
                // where it has the head size, a mixed batch's leading decodes the decode kernel
                // (`fp8_mixed`); the general kernel the rest.
                let flash = flash_attention::kernel_for(gpu, head_dim, q, caches, &out);
                return match route {
                    AttentionKernel::TensorCopies => Err(GpuError::Unsupported {
                        op: "PagedAttention::run_on(TensorCopies)",
                        reason: "an FP8 cache".into(),
                    }),
                    AttentionKernel::General => paged_general(gpu, operands, out),
                    _ if meta.max_query_len <= 1 => match fp8_decode_kernel(gpu, head_dim, q, caches, &out) {
                        Some(kernel) => self.paged_decode(gpu, kernel, TensorCopies::Never, operands, out),
                        None => paged_general(gpu, operands, out),
                    },
                    _ => match flash {
                        Some(kernel) => self.fp8_mixed(gpu, kernel, operands, out),
                        None => paged_general(gpu, operands, out),
                    },
                };
            }
        };
        for dtype in [k_cache.dtype(), v_cache.dtype(), out.dtype()] {
            same_dtype(op, q.dtype(), dtype);
        }
        let num_tokens = q.len() / token_width;
        if num_tokens == 0 {
            return Ok(());
        }

        let decode =
            if meta.max_query_len <= 1 { decode_kernel(gpu, head_dim, q, k_cache, v_cache, &out) } else { None };
        if route == AttentionKernel::TensorCopies {
            // The tensor-copy form is a form of the tensor-core decode kernel.
            let tensor = decode.filter(|k| matches!(k, DecodeKernel::TensorCore(..))).and_then(|kernel| {
                tensor_copy_kernel(gpu, meta, head_dim, q.dtype(), k_cache, v_cache).map(|name| (kernel, name))
            });
            let Some((kernel, tensor)) = tensor else {
                return Err(GpuError::Unsupported {
                    op: "PagedAttention::run_on(TensorCopies)",
                    reason: format!(
                    "needs decodes (max_query_len {}), bf16 or f16 (not {:?}), head_dim 64 or 128 (not {head_dim}), \
                     block_size 16 (not {}), no sliding window ({:?}) and compute capability 9.0 or later ({:?})",
                    meta.max_query_len,
                    q.dtype(),
                    meta.block_size,
                    meta.sliding_window,
                    gpu.compute_capability()
                ),
                });
            };
            let tensor = TensorCopies::Always(tensor);
            self.paged_decode(gpu, kernel, tensor, operands, out)
        } else if route == AttentionKernel::General {
            paged_general(gpu, operands, out)
        } else if let Some(kernel) = decode {
            let tensor = match self.decode_tensor_copies {
                true => tensor_copy_kernel(gpu, meta, head_dim, q.dtype(), k_cache, v_cache),
                false => None,
            };
            let tensor = tensor.map_or(TensorCopies::Never, TensorCopies::WherePerWarp);
            self.paged_decode(gpu, kernel, tensor, operands, out)
        } else if let Some(kernel) = flash_attention::kernel_for(gpu, head_dim, q, caches, &out) {
            flash_attention::paged_flash(gpu, kernel, operands, 0, out)
        } else {
            paged_general(gpu, operands, out)
        }
    }
}

/// Which decode kernel takes a batch of decodes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum DecodeKernel {
    /// `paged_attention_decode_g{G}` (attention.cu).
    Cuda,
    /// `paged_decode_mma_d{D}` (decode_attention.cu), and its head-block-per-warp form
    /// `paged_decode_mma_warp_d{D}` for unsplit contexts.
    TensorCore(&'static str, &'static str),
}

/// The decode kernel for these operands, if one takes them: the tensor-core kernel for bf16 and
/// f16 of its head sizes, else the CUDA-core one where it has the head size.
fn decode_kernel(
    gpu: &Gpu,
    head_dim: usize,
    q: GpuView<'_>,
    k_cache: GpuView<'_>,
    v_cache: GpuView<'_>,
    out: &GpuViewMut<'_>,
) -> Option<DecodeKernel> {
    // The tensor-core kernel reads Q and writes its output in pairs of elements, and copies K/V
    // rows 16 bytes at a time.
    let aligned = q.ptr().is_multiple_of(4)
        && out.ptr().is_multiple_of(4)
        && k_cache.ptr().is_multiple_of(16)
        && v_cache.ptr().is_multiple_of(16);
    let tensor_core = DECODE_MMA_KERNELS.iter().find(|&&(d, ..)| d == head_dim);
    match tensor_core {
        Some(&(_, name, warp_name))
            if q.dtype() != DType::F32
                && aligned
                && decode_mma_shared_bytes(head_dim, false) <= gpu.max_shared_per_block() =>
        {
            Some(DecodeKernel::TensorCore(name, warp_name))
        }
        _ => decode_supported(gpu, head_dim, Caches::Dense(k_cache, v_cache)).then_some(DecodeKernel::Cuda),
    }
}

/// The decode kernel over FP8 caches: the tensor-core block kernel in bf16 and f16 of its head
/// sizes, else the CUDA-core one where it has the head size.
fn fp8_decode_kernel(
    gpu: &Gpu,
    head_dim: usize,
    q: GpuView<'_>,
    caches: Caches<'_>,
    out: &GpuViewMut<'_>,
) -> Option<DecodeKernel> {
    let (k_ptr, v_ptr) = caches.ptrs();
    let aligned = q.ptr().is_multiple_of(4)
        && out.ptr().is_multiple_of(4)
        && k_ptr.is_multiple_of(16)
        && v_ptr.is_multiple_of(16);
    match DECODE_MMA_FP8_KERNELS.iter().find(|&&(d, _)| d == head_dim) {
        Some(&(_, name))
            if q.dtype() != DType::F32
                && aligned
                && decode_mma_shared_bytes(head_dim, true) <= gpu.max_shared_per_block() =>
        {
            Some(DecodeKernel::TensorCore(name, name))
        }
        _ => decode_supported(gpu, head_dim, caches).then_some(DecodeKernel::Cuda),
    }
}

/// The per-warp decode kernel's tensor-copy form for these operands, if it takes them: sm_90 or
/// later, bf16 or f16 of head size 64 or 128, block size 16 (a tile is one cache block) and no
/// sliding window (so every tile starts on a block), caches 16-byte aligned with slot
/// coordinates that fit an i32.
fn tensor_copy_kernel(
    gpu: &Gpu,
    meta: &GpuAttentionMetadata<'_>,
    head_dim: usize,
    dtype: DType,
    k_cache: GpuView<'_>,
    v_cache: GpuView<'_>,
) -> Option<&'static str> {
    let slots = k_cache.len() / head_dim.max(1);
    let fits = tensor_copies_fit(gpu.compute_capability(), dtype, meta.block_size, meta.sliding_window, slots)
        && k_cache.ptr().is_multiple_of(16)
        && v_cache.ptr().is_multiple_of(16);
    let kernel = DECODE_MMA_TENSOR_KERNELS.iter().find(|&&(d, _)| d == head_dim).map(|&(_, name)| name);
    kernel.filter(|_| fits && tensor_copy_shared_bytes(head_dim) <= gpu.max_shared_per_block())
}

/// The shape conditions of [`tensor_copy_kernel`] (`slots`: rows of `head_dim` in a cache, an
/// upper bound on its slots' coordinate).
fn tensor_copies_fit(
    (major, _): (u32, u32),
    dtype: DType,
    block_size: usize,
    window: Option<usize>,
    slots: usize,
) -> bool {
    major >= 9
        && matches!(dtype, DType::BF16 | DType::F16)
        && block_size == DECODE_MMA_WARP_KEYS
        && window.is_none()
        && i32::try_from(slots).is_ok()
}

/// Shared memory of the per-warp kernel's tensor-copy form: each warp's ring of unpadded K/V
/// tiles of 16 keys, and 1 KiB to start it on the 1 KiB boundary 128-byte swizzling needs.
fn tensor_copy_shared_bytes(head_dim: usize) -> usize {
    let stages = if head_dim <= 64 { 4 } else { 3 };
    (DECODE_THREADS / 32) * stages * 2 * DECODE_MMA_WARP_KEYS * head_dim * 2 + 1024
}

/// A tensor map as a kernel parameter (`TensorMap` in common.cuh).
#[repr(transparent)]
struct KernelTensorMap(CUtensorMap);

// SAFETY: the driver's encoding, bytes the kernel takes by value (a `__grid_constant__`
// parameter of the same size and alignment).
unsafe impl DeviceRepr for KernelTensorMap {}

/// The tensor map of one layer's K or V cache for the tensor-copy kernel: 3-d, `head_dim`
/// columns by `num_kv_heads` heads by the cache's slots, read in boxes of 64 columns of one head
/// by 16 slots with 128-byte swizzling; coordinates past the cache read as zeros.
fn cache_tensor_map(cache: GpuView<'_>, num_kv_heads: usize, head_dim: usize) -> Result<KernelTensorMap, GpuError> {
    let elem = cache.dtype().size_in_bytes();
    let data_type = match cache.dtype() {
        DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::F32 => unreachable!("tensor copies take half types (tensor_copy_kernel)"),
    };
    let slots = cache.len() / (num_kv_heads * head_dim);
    let dims = [head_dim as u64, num_kv_heads as u64, slots as u64];
    // Bytes between consecutive heads and slots (the innermost stride is the element's).
    let strides = [(head_dim * elem) as u64, (num_kv_heads * head_dim * elem) as u64];
    let boxes = [TENSOR_BOX_COLUMNS as u32, 1, DECODE_MMA_WARP_KEYS as u32];
    let element_strides = [1u32; 3];
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer is valid for the rank (3) the call is given; the cache's address is
    // a device address, 16-byte aligned (tensor_copy_kernel).
    unsafe {
        cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            3,
            cache.ptr() as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()?;
    Ok(KernelTensorMap(map))
}

/// Shared memory of a tensor-core decode block: its ring of K/V tiles (4 tiles for head size
/// 64, 3 above; rows of `head_dim + 8` 2-byte elements, or over FP8 caches of `head_dim + 16`
/// codes), which the cross-warp merge of 16 rows' f32 states reuses at the end (over FP8 caches
/// rows of `head_dim + head_dim / 32`, skewed against bank conflicts).
fn decode_mma_shared_bytes(head_dim: usize, fp8: bool) -> usize {
    let stages = if head_dim <= 64 { 4 } else { 3 };
    let row = if fp8 { head_dim + 16 } else { (head_dim + 8) * 2 };
    let ring = stages * 2 * DECODE_MMA_TILE_KEYS * row;
    let red_row = if fp8 { head_dim + head_dim / 32 } else { head_dim };
    let merge = 4 * (DECODE_THREADS / 32) * DECODE_MMA_HEADS * (red_row + 2);
    ring.max(merge)
}

/// The CUDA-core decode kernel reads 8 elements per lane, `head_dim / 8` lanes per key, and copies
/// K/V rows into shared memory 16 bytes at a time (an FP8 row of at least 16 codes).
fn decode_supported(gpu: &Gpu, head_dim: usize, caches: Caches<'_>) -> bool {
    let lanes = head_dim / 8;
    let ((k_ptr, v_ptr), elem_size) = (caches.ptrs(), caches.elem_size());
    head_dim.is_multiple_of(8)
        && lanes.is_power_of_two()
        && lanes <= 32
        && head_dim * elem_size >= 16
        && k_ptr.is_multiple_of(16)
        && v_ptr.is_multiple_of(16)
        && decode_shared_bytes(elem_size, DECODE_MAX_HEADS, head_dim) <= gpu.max_shared_per_block()
}

/// Shared memory of a decode block: the ring of K/V tiles, which the cross-warp merge of `g`
/// heads' f32 states reuses at the end.
fn decode_shared_bytes(elem_size: usize, g: usize, head_dim: usize) -> usize {
    let ring = DECODE_STAGES * 2 * DECODE_TILE_ELEMS * elem_size;
    let merge = 4 * (DECODE_THREADS / 32) * g * (head_dim + 2);
    ring.max(merge)
}

/// The `float softcap` every attention kernel takes: 0 for none.
pub(crate) fn softcap_arg(meta: &GpuAttentionMetadata<'_>) -> f32 {
    meta.softcap.unwrap_or(0.0)
}

/// The arguments both kernels take after their pointers, in order.
fn shape_args(
    op: &str,
    meta: &GpuAttentionMetadata<'_>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    num_blocks: usize,
) -> [u32; 7] {
    [
        to_u32(op, "num_heads", num_heads),
        to_u32(op, "num_kv_heads", num_kv_heads),
        to_u32(op, "head_dim", head_dim),
        to_u32(op, "max_blocks_per_seq", meta.max_blocks_per_seq),
        to_u32(op, "block_size", meta.block_size),
        u32::try_from(num_blocks).unwrap_or(u32::MAX),
        // 0 is "no window"; a window past u32 sees everything, as no window does.
        meta.sliding_window.map_or(0, |w| u32::try_from(w).unwrap_or(0)),
    ]
}

impl PagedAttention {
    /// A batch of prefill rows over FP8 caches on the tensor-core prefill kernel, but for its
    /// leading requests of one row each (a step's decodes, which the scheduler puts first): those
    /// take the FP8 decode kernel, which reads the codes at about the memory's rate, where the
    /// prefill kernel converts each K/V tile for a decode's few query rows.
    fn fp8_mixed(
        &self,
        gpu: &Gpu,
        flash: &flash_attention::FlashKernel,
        operands: &Operands<'_>,
        mut out: GpuViewMut<'_>,
    ) -> Result<(), GpuError> {
        let Operands { q, caches, meta, heads } = *operands;
        let decodes = leading_decodes(meta.query_start_loc_host);
        let decode = if decodes > 0 { fp8_decode_kernel(gpu, heads.head_dim, q, caches, &out) } else { None };
        let Some(decode) = decode else {
            return flash_attention::paged_flash(gpu, flash, operands, 0, out);
        };
        flash_attention::paged_flash(gpu, flash, operands, decodes, out.reborrow())?;
        let work = AttentionWork::default();
        let meta = meta.leading(decodes, &work);
        let token_width = heads.num_heads * heads.head_dim;
        let operands = Operands { q: q.rows(0..decodes, token_width), caches, meta: &meta, heads };
        self.paged_decode(gpu, decode, TensorCopies::Never, &operands, out.rows(0..decodes, token_width))
    }

    fn paged_decode(
        &self,
        gpu: &Gpu,
        kernel: DecodeKernel,
        tensor_copies: TensorCopies,
        operands: &Operands<'_>,
        out: GpuViewMut<'_>,
    ) -> Result<(), GpuError> {
        let Operands { q, caches, meta, heads } = *operands;
        let Heads { num_heads, num_kv_heads, head_dim } = heads;
        let op = "paged_attention";
        let num_tokens = q.len() / (num_heads * head_dim);
        let num_reqs = meta.seq_lens.len();
        // The longest context any row can see, from the block tables' width (no read of seq_lens).
        let mut max_context = meta.max_blocks_per_seq * meta.block_size;
        if let Some(w) = meta.sliding_window {
            max_context = max_context.min(w);
        }
        let group = num_heads / num_kv_heads;
        let policy = match kernel {
            DecodeKernel::Cuda => CUDA_CORE_SPLIT,
            DecodeKernel::TensorCore(..) => TENSOR_CORE_SPLIT,
        };
        let mut split = DecodeSplit::new(policy, group, num_tokens * num_kv_heads, max_context);
        if let TensorCopies::Always(_) = tensor_copies {
            // The per-warp kernel takes whole contexts.
            split.num_parts = 1;
            split.part_len = max_context.next_multiple_of(16);
        }
        let num_parts = split.num_parts;

        // Partial results of each (token, head, partition): out then (max, sum), f32; none when the
        // context is not split.
        let partial_len = num_tokens * num_heads * num_parts * head_dim;
        let stats_len = num_tokens * num_heads * num_parts * 2;
        // The kept workspace holds any split the kernels make (see DECODE_WORKSPACE_FLOATS);
        // a larger one (a head size past 256) is allocated for the call, stream-ordered.
        let fits = partial_len + stats_len <= DECODE_WORKSPACE_FLOATS;
        let workspace = if num_parts > 1 && !fits {
            // SAFETY: the decode kernel writes every element the merge reads.
            Some(unsafe { gpu.stream().alloc::<f32>(partial_len + stats_len) }?)
        } else {
            None
        };
        let base = match &workspace {
            Some(ws) => gpu.index_ptr(ws),
            None => gpu.index_ptr(&self.decode_workspace),
        };
        let (part_out, part_ml) =
            if num_parts > 1 { (base, base + (partial_len * std::mem::size_of::<f32>()) as u64) } else { (0u64, 0u64) };

        let kv_width = num_kv_heads * head_dim;
        let num_blocks = caches.len() / kv_width / meta.block_size;
        let (g, fp8) = (split.heads_per_block, caches.fp8_scales());
        let shared = match kernel {
            DecodeKernel::Cuda => decode_shared_bytes(caches.elem_size(), g, head_dim),
            DecodeKernel::TensorCore(..) => decode_mma_shared_bytes(head_dim, fp8.is_some()),
        };
        let head_blocks = num_tokens * num_kv_heads * split.head_chunks;
        assert!(
        num_parts == 1 || head_blocks <= DECODE_TARGET_BLOCKS,
        "paged_attention: {head_blocks} head blocks split into partitions, more than the {DECODE_TARGET_BLOCKS} counters"
    );
        // Unsplit, the tensor-core kernel may give each warp a head block of its own (in its
        // tensor-copy form where the call asks for it).
        let forced = matches!(tensor_copies, TensorCopies::Always(_));
        // Over FP8 caches the block kernel only.
        let per_warp = matches!(kernel, DecodeKernel::TensorCore(..))
            && fp8.is_none()
            && (forced
                || num_parts == 1 && self.decode_warp_items && {
                    // Two blocks of the tensor-core kernel per SM at most, by their registers.
                    let sm_blocks = gpu.blocks_per_multiprocessor(shared).min(2) * gpu.multiprocessors();
                    warp_items_fill_as_well(head_blocks, DECODE_THREADS / 32, sm_blocks)
                });
        let tensor_copies = match tensor_copies {
            TensorCopies::Always(name) | TensorCopies::WherePerWarp(name) if per_warp => Some(name),
            _ => None,
        };
        let shared = if tensor_copies.is_some() { tensor_copy_shared_bytes(head_dim) } else { shared };
        let blocks = if per_warp { head_blocks.div_ceil(DECODE_THREADS / 32) } else { head_blocks };
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32(op, "tokens times KV heads times head chunks", blocks),
                to_u32(op, "partitions", num_parts),
                1,
            ),
            block_dim: (DECODE_THREADS as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let ((kc_ptr, vc_ptr), q_ptr, out_ptr) = (caches.ptrs(), q.ptr(), out.ptr());
        let counters_ptr = gpu.index_ptr(&self.decode_counters);
        let qsl_ptr = gpu.index_ptr(&meta.query_start_loc);
        let lens_ptr = gpu.index_ptr(&meta.seq_lens);
        let tables_ptr = gpu.index_ptr(&meta.block_tables);
        let reqs = to_u32(op, "num_reqs", num_reqs);
        let args = shape_args(op, meta, num_heads, num_kv_heads, head_dim, num_blocks);
        let (part_len, softcap) = (to_u32(op, "partition length", split.part_len), softcap_arg(meta));
        let name = tensor_copies.unwrap_or(match (kernel, g, fp8.is_some()) {
            (DecodeKernel::TensorCore(_, warp_name), ..) if per_warp => warp_name,
            (DecodeKernel::TensorCore(name, _), ..) => name,
            (DecodeKernel::Cuda, 1, false) => "paged_attention_decode_g1",
            (DecodeKernel::Cuda, 2, false) => "paged_attention_decode_g2",
            (DecodeKernel::Cuda, 4, false) => "paged_attention_decode_g4",
            (DecodeKernel::Cuda, _, false) => "paged_attention_decode_g8",
            (DecodeKernel::Cuda, 1, true) => "paged_attention_decode_fp8kv_g1",
            (DecodeKernel::Cuda, 2, true) => "paged_attention_decode_fp8kv_g2",
            (DecodeKernel::Cuda, 4, true) => "paged_attention_decode_fp8kv_g4",
            (DecodeKernel::Cuda, _, true) => "paged_attention_decode_fp8kv_g8",
        });
        let mut launch = gpu.launch_builder(name, q.dtype());
        launch.arg(&q_ptr).arg(&kc_ptr).arg(&vc_ptr).arg(&out_ptr).arg(&part_out).arg(&part_ml).arg(&counters_ptr);
        launch.arg(&qsl_ptr).arg(&lens_ptr).arg(&tables_ptr).arg(&reqs);
        for a in &args {
            launch.arg(a);
        }
        launch.arg(&meta.scale).arg(&softcap).arg(&part_len);
        // The FP8 kernels take the caches' scales after the others.
        if let Some((k_scale, v_scale)) = &fp8 {
            launch.arg(k_scale).arg(v_scale);
        }
        // The tensor-copy form takes the caches' tensor maps after the others.
        let maps = match (tensor_copies, caches) {
            (Some(_), Caches::Dense(k_cache, v_cache)) => Some((
                cache_tensor_map(k_cache, num_kv_heads, head_dim)?,
                cache_tensor_map(v_cache, num_kv_heads, head_dim)?,
            )),
            (Some(_), Caches::Fp8(..)) => unreachable!("FP8 caches never take the per-warp or tensor-copy form"),
            (None, _) => None,
        };
        if let Some((k_map, v_map)) = &maps {
            launch.arg(k_map).arg(v_map);
        }
        // SAFETY: the arguments match the kernel's parameters in order (the decode kernels take the
        // same, the tensor-copy form two tensor maps more); head_dim, dtype and alignment suit the
        // kernel (`decode_kernel`, `fp8_decode_kernel`, `tensor_copy_kernel`), the workspace holds `num_parts` partitions of every (token, head),
        // there is a zeroed counter per block of a partition (checked above), and the shared memory
        // is as the kernel lays it out.
        unsafe { launch.launch(cfg) }?;

        // The workspace's free is queued on the stream after the kernel.
        drop(workspace);
        Ok(())
    }
}

/// Whether `items` head blocks, each a whole context, keep the device as busy when each of a
/// block's `warps` takes one (`items / warps` blocks) as when a block takes one (`items`
/// blocks), with `slots` blocks resident at a time. The per-warp kernel streams ~5 % faster
/// (no merge across warps), but it runs `warps` times fewer, longer blocks: 1536 items on an
/// H200 (264 slots) are 1.45 waves of whole contexts where the block kernel runs 5.8 waves of a
/// quarter (batch 192 at 3000: 710 us against 589).
fn warp_items_fill_as_well(items: usize, warps: usize, slots: usize) -> bool {
    // The busy fraction of the device over the launch's waves of equal blocks.
    let fill = |blocks: usize| blocks as f64 / (blocks.div_ceil(slots) * slots) as f64;
    fill(items.div_ceil(warps)) >= fill(items)
}

/// How a decode kernel splits the work: `heads_per_block` query heads of one KV head per block
/// (the CUDA-core kernel's `G`, or the 16 rows of the tensor-core kernel's tile), `head_chunks`
/// blocks per KV head, and `num_parts` partitions of at most `part_len` keys for the longest
/// context the tables hold. Each row cuts its own visible keys into the `num_parts` (equal,
/// the last taking what remains; see `decode_work_of` in kernels/attention.cu).
#[derive(Debug, PartialEq)]
struct DecodeSplit {
    heads_per_block: usize,
    head_chunks: usize,
    num_parts: usize,
    part_len: usize,
}

impl DecodeSplit {
    /// `policy`: the kernel's; `rows`: (token, KV head) pairs; `max_context`: the most keys a row
    /// can see.
    fn new(policy: SplitPolicy, group: usize, rows: usize, max_context: usize) -> DecodeSplit {
        let SplitPolicy { max_heads, min_part, target_blocks } = policy;
        let heads_per_block = max_heads.min(group.next_power_of_two());
        let head_chunks = group.div_ceil(heads_per_block);
        let max_context = max_context.max(1);
        let blocks = (rows * head_chunks).max(1);
        let parts = target_blocks.div_ceil(blocks).min(max_context.div_ceil(min_part)).clamp(1, DECODE_MAX_PARTS);
        let part_len = max_context.div_ceil(parts).next_multiple_of(16);
        DecodeSplit { heads_per_block, head_chunks, num_parts: max_context.div_ceil(part_len), part_len }
    }
}

fn paged_general(gpu: &Gpu, operands: &Operands<'_>, out: GpuViewMut<'_>) -> Result<(), GpuError> {
    let Operands { q, caches, meta, heads } = *operands;
    let Heads { num_heads, num_kv_heads, head_dim } = heads;
    let op = "paged_attention";
    let num_tokens = q.len() / (num_heads * head_dim);
    let num_reqs = meta.seq_lens.len();
    let kv_width = num_kv_heads * head_dim;
    let shape = TileShape::new(num_heads / num_kv_heads, head_dim, meta.max_query_len);
    let shared = shape.shared_bytes(head_dim);
    if shared > gpu.max_shared_per_block() {
        return Err(GpuError::Unsupported {
            op,
            reason: format!(
                "head_dim {head_dim} needs {shared} bytes of shared memory per block, the device has {}",
                gpu.max_shared_per_block()
            ),
        });
    }
    let cfg = LaunchConfig {
        grid_dim: (
            to_u32(op, "query tiles", num_tokens.div_ceil(shape.q_tile)),
            to_u32(op, "num_kv_heads", num_kv_heads),
            to_u32(op, "head chunks", (num_heads / num_kv_heads).div_ceil(shape.heads_per_block)),
        ),
        block_dim: (shape.threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let ((kc_ptr, vc_ptr), q_ptr, out_ptr) = (caches.ptrs(), q.ptr(), out.ptr());
    let qsl_ptr = gpu.index_ptr(&meta.query_start_loc);
    let lens_ptr = gpu.index_ptr(&meta.seq_lens);
    let tables_ptr = gpu.index_ptr(&meta.block_tables);
    let num_blocks = caches.len() / kv_width / meta.block_size;
    let (reqs, tokens) = (to_u32(op, "num_reqs", num_reqs), to_u32(op, "num_tokens", num_tokens));
    let args = shape_args(op, meta, num_heads, num_kv_heads, head_dim, num_blocks);
    let (q_tile, heads_per_block) = (shape.q_tile as u32, shape.heads_per_block as u32);
    let softcap = softcap_arg(meta);
    let fp8 = caches.fp8_scales();
    let name = if fp8.is_some() { "paged_attention_fp8kv" } else { op };
    let mut launch = gpu.launch_builder(name, q.dtype());
    launch.arg(&q_ptr).arg(&kc_ptr).arg(&vc_ptr).arg(&out_ptr).arg(&qsl_ptr).arg(&lens_ptr).arg(&tables_ptr);
    launch.arg(&reqs).arg(&tokens);
    for a in &args {
        launch.arg(a);
    }
    launch.arg(&meta.scale).arg(&softcap).arg(&q_tile).arg(&heads_per_block);
    if let Some((k_scale, v_scale)) = &fp8 {
        launch.arg(k_scale).arg(v_scale);
    }
    // SAFETY: the arguments match the kernel's parameters in order (the FP8 kernel's two scales
    // last); the tile shape keeps every
    // block's accumulators within `threads * ACC_PER_THREAD` and its shared memory as computed.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// How the general kernel splits the work: each block takes `q_tile` tokens and
/// `heads_per_block` query heads of one KV head, so that its rows share every K/V tile.
#[derive(Debug, PartialEq)]
struct TileShape {
    threads: usize,
    q_tile: usize,
    heads_per_block: usize,
}

impl TileShape {
    fn new(group: usize, head_dim: usize, max_query_len: usize) -> TileShape {
        // Decodes have one row per query head: a smaller block keeps more of them resident.
        let threads = if max_query_len <= 1 { 128 } else { 256 };
        let rows_cap = (threads * ACC_PER_THREAD / head_dim).max(1);
        let heads_per_block = group.min(rows_cap);
        let q_tile = if max_query_len <= 1 { 1 } else { (rows_cap / heads_per_block).clamp(1, MAX_QUERY_TILE) };
        TileShape { threads, q_tile, heads_per_block }
    }

    /// Dynamic shared memory of one block: q, K and V tiles, scores and softmax state, all f32.
    fn shared_bytes(&self, head_dim: usize) -> usize {
        let rows = self.q_tile * self.heads_per_block;
        4 * (rows * head_dim + KEY_TILE * (head_dim + 1) + KEY_TILE * head_dim + rows * KEY_TILE + 3 * rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_keep_accumulators_within_the_block() {
        for group in [1, 2, 4, 7, 8, 16, 32, 64] {
            for head_dim in [32, 64, 80, 128, 256, 512] {
                for max_query_len in [1, 2, 17, 4096] {
                    let s = TileShape::new(group, head_dim, max_query_len);
                    let rows = s.q_tile * s.heads_per_block;
                    assert!(rows * head_dim <= s.threads * ACC_PER_THREAD, "{s:?} group {group} dim {head_dim}");
                    assert!(s.heads_per_block >= 1 && s.heads_per_block <= group && s.q_tile >= 1);
                    if max_query_len == 1 {
                        assert_eq!(s.q_tile, 1);
                    }
                }
            }
        }
    }

    #[test]
    fn prefill_tiles_share_keys_across_tokens_and_heads() {
        assert_eq!(TileShape::new(8, 128, 100), TileShape { threads: 256, q_tile: 4, heads_per_block: 8 });
        assert_eq!(TileShape::new(1, 128, 100), TileShape { threads: 256, q_tile: 32, heads_per_block: 1 });
        assert_eq!(TileShape::new(32, 128, 1), TileShape { threads: 128, q_tile: 1, heads_per_block: 16 });
    }

    #[test]
    fn decode_split_covers_the_context_and_fills_the_device() {
        for policy in [CUDA_CORE_SPLIT, TENSOR_CORE_SPLIT] {
            let SplitPolicy { max_heads, min_part, .. } = policy;
            for group in [1, 2, 3, 4, 6, 7, 8, 16, 24, 32] {
                for rows in [1, 8, 64, 2048, 100_000] {
                    for max_context in [0, 1, 16, 17, 384, 640, 3000, 131_072] {
                        let s = DecodeSplit::new(policy, group, rows, max_context);
                        assert!(s.heads_per_block <= max_heads, "{s:?}");
                        assert!(s.heads_per_block * s.head_chunks >= group, "{s:?} group {group}");
                        assert!(s.heads_per_block * (s.head_chunks - 1) < group, "{s:?} group {group}");
                        assert!(s.num_parts >= 1 && s.num_parts <= DECODE_MAX_PARTS, "{s:?}");
                        assert!(s.num_parts * s.part_len >= max_context, "{s:?} context {max_context}");
                        assert!((s.num_parts - 1) * s.part_len < max_context.max(1), "{s:?} context {max_context}");
                        if s.num_parts > 1 {
                            assert!(s.part_len >= min_part, "{s:?}");
                        }
                    }
                }
            }
        }
        // The tensor-core kernel's head chunks are those the kernel works out, ceil(group / 16).
        for group in 1..=100 {
            let s = DecodeSplit::new(TENSOR_CORE_SPLIT, group, 8, 100);
            assert_eq!(s.head_chunks, group.div_ceil(DECODE_MMA_HEADS), "{s:?}");
        }
        // Llama-3.1-8B (group 4, 8 KV heads): batch 1 splits its context, batch 256 does not.
        let (cuda, mma) = (CUDA_CORE_SPLIT, TENSOR_CORE_SPLIT);
        let one = DecodeSplit::new(cuda, 4, 8, 400);
        assert_eq!(one, DecodeSplit { heads_per_block: 4, head_chunks: 1, num_parts: 13, part_len: 32 });
        let one = DecodeSplit::new(mma, 4, 8, 400);
        assert_eq!(one, DecodeSplit { heads_per_block: 4, head_chunks: 1, num_parts: 7, part_len: 64 });
        // At context 4096 the tensor-core kernel takes 16 partitions of 256 keys, not 64 of 64.
        let long = DecodeSplit::new(mma, 4, 8, 4096);
        assert_eq!(long, DecodeSplit { heads_per_block: 4, head_chunks: 1, num_parts: 16, part_len: 256 });
        let many = DecodeSplit::new(mma, 4, 256 * 8, 656);
        assert_eq!(many, DecodeSplit { heads_per_block: 4, head_chunks: 1, num_parts: 1, part_len: 656 });
    }

    #[test]
    fn split_decodes_fit_the_gpu_workspace() {
        let mut largest = 0;
        for policy in [CUDA_CORE_SPLIT, TENSOR_CORE_SPLIT] {
            for group in [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17, 32, 96] {
                for kv_heads in [1, 2, 4, 8, 16, 32] {
                    for tokens in [1, 2, 3, 7, 16, 31, 64, 100, 256, 511, 512] {
                        for context in [1, 16, 100, 1000, 4096, 32768, 131072] {
                            let s = DecodeSplit::new(policy, group, tokens * kv_heads, context);
                            if s.num_parts == 1 {
                                continue;
                            }
                            // What paged_decode takes of the workspace at head_dim 256.
                            let floats = tokens * kv_heads * group * s.num_parts * (256 + 2);
                            assert!(floats <= DECODE_WORKSPACE_FLOATS, "{s:?} tokens {tokens} x {kv_heads} x {group}");
                            largest = largest.max(floats);
                        }
                    }
                }
            }
        }
        // The bound is reached, not just respected from afar.
        assert!(largest * 2 > DECODE_WORKSPACE_FLOATS, "largest split {largest}");
    }

    #[test]
    fn warp_items_are_taken_where_their_waves_fill_the_device() {
        // H200: 132 SMs, two tensor-core decode blocks each; 4 warps per block; the 8B's 8 KV
        // heads, so items = 8 * batch.
        let slots = 264;
        for (batch, per_warp) in [(192, false), (232, true), (256, true), (384, true), (768, true)] {
            assert_eq!(warp_items_fill_as_well(8 * batch, 4, slots), per_warp, "batch {batch}");
        }
        // 3072 items of one KV head, as batch 384 of 8.
        assert!(warp_items_fill_as_well(3072, 4, slots));
        // A single wave either way: the per-warp kernel's 66 blocks leave 3/4 of the SMs idle.
        assert!(!warp_items_fill_as_well(264, 4, slots));
    }

    #[test]
    fn tensor_copies_take_hopper_half_types_in_whole_blocks() {
        let hopper = (9, 0);
        assert!(tensor_copies_fit(hopper, DType::BF16, 16, None, 1 << 20));
        assert!(tensor_copies_fit((10, 0), DType::F16, 16, None, 1 << 20));
        // Before sm_90, in f32, with tiles that are not whole blocks, with a window (tiles that
        // start inside a block), or with slots past an i32 coordinate.
        assert!(!tensor_copies_fit((8, 9), DType::BF16, 16, None, 1 << 20));
        assert!(!tensor_copies_fit(hopper, DType::F32, 16, None, 1 << 20));
        for block_size in [5, 8, 32] {
            assert!(!tensor_copies_fit(hopper, DType::BF16, block_size, None, 1 << 20), "block size {block_size}");
        }
        assert!(!tensor_copies_fit(hopper, DType::BF16, 16, Some(4096), 1 << 20));
        assert!(tensor_copies_fit(hopper, DType::BF16, 16, None, i32::MAX as usize));
        assert!(!tensor_copies_fit(hopper, DType::BF16, 16, None, i32::MAX as usize + 1));
        // The kernel exists for the head sizes whose rows are whole 64-column boxes.
        for (head_dim, name) in DECODE_MMA_TENSOR_KERNELS {
            assert_eq!(head_dim % TENSOR_BOX_COLUMNS, 0, "{name}");
        }
    }

    #[test]
    fn tensor_copy_blocks_fit_two_per_sm() {
        // Unpadded rows: less than the padded ring, with the 1 KiB of alignment.
        assert_eq!(tensor_copy_shared_bytes(128), 4 * 3 * 2 * 16 * 128 * 2 + 1024);
        assert_eq!(tensor_copy_shared_bytes(64), 4 * 4 * 2 * 16 * 64 * 2 + 1024);
        for (head_dim, _) in DECODE_MMA_TENSOR_KERNELS {
            assert!(
                tensor_copy_shared_bytes(head_dim) <= decode_mma_shared_bytes(head_dim, false),
                "head_dim {head_dim}"
            );
            assert!(2 * (tensor_copy_shared_bytes(head_dim) + 1024) <= 228 * 1024, "head_dim {head_dim}");
        }
    }

    #[test]
    fn leading_decodes_counts_the_one_row_requests_before_any_other() {
        assert_eq!(leading_decodes(&[0, 1, 2, 3]), 3);
        assert_eq!(leading_decodes(&[0, 1, 2, 40, 41]), 2);
        assert_eq!(leading_decodes(&[0, 37, 38]), 0);
        // A request of no rows ends the run.
        assert_eq!(leading_decodes(&[0, 1, 1, 2]), 1);
        assert_eq!(leading_decodes(&[0]), 0);
        assert_eq!(leading_decodes(&[3, 4, 5]), 0);
    }

    #[test]
    fn tensor_core_decode_blocks_fit_two_per_sm() {
        // An H200 SM has 228 KiB of shared memory, 1 KiB of it reserved per block.
        for (head_dim, ..) in DECODE_MMA_KERNELS {
            for fp8 in [false, true] {
                let bytes = decode_mma_shared_bytes(head_dim, fp8);
                assert!(2 * (bytes + 1024) <= 228 * 1024, "head_dim {head_dim} fp8 {fp8}");
            }
            // The FP8 form's launch bounds ask for three (its registers allow them).
            assert!(3 * (decode_mma_shared_bytes(head_dim, true) + 1024) <= 228 * 1024, "head_dim {head_dim}");
        }
        assert_eq!(decode_mma_shared_bytes(128, false), 104_448);
        assert_eq!(decode_mma_shared_bytes(64, false), 73_728);
        // FP8: 3 stages of K and V codes in rows padded to 144 bytes (3 x 2 x 64 x 144); at head
        // size 64, 4 stages (4 x 2 x 64 x 80), above the merge's 4 x 4 x 16 x 68 f32.
        assert_eq!(decode_mma_shared_bytes(128, true), 55_296);
        assert_eq!(decode_mma_shared_bytes(64, true), 40_960);
    }
}
