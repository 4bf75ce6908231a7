//! The tensor-core attention kernel for prefill chunks and mixed batches
//! (`kernels/flash_attention.cu`): the head sizes it is compiled for, its tile shape and its
//! work list.
//!
//! A block takes `TILE_ROWS` query rows of one KV head, as (token, query head) pairs of one
//! request, so that each K/V tile it gathers serves the whole GQA group; a decode of a mixed
//! batch is a request of one token. The blocks' work list, (request, first query row) per tile,
//! depends only on `query_start_loc` and the tile shape, so [`AttentionWork`] keeps it for all
//! the layers of a step.

use std::cell::OnceCell;
use std::fmt;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::attention::{softcap_arg, Caches, Operands};
use super::compile::{self, KernelFamilies};
use super::gpu::to_u32;
use super::{Gpu, GpuError, GpuView, GpuViewMut};
use crate::DType;

/// Query rows per block (`FA_ROWS` in flash_attention.cu): 16 per warp.
const TILE_ROWS: usize = 64;
/// Threads per block (`FA_THREADS`).
const THREADS: usize = 128;

/// The kernel of each head size, over caches in the activations' dtype and over FP8 caches (the
/// file has them for bf16 and f16 only).
pub(crate) const KERNELS: &[KernelFamilies] = &[
    KernelFamilies { source: &compile::FLASH_ATTENTION, names: &NAMES, large_shared: true },
    KernelFamilies { source: &compile::FLASH_ATTENTION, names: &FP8_NAMES, large_shared: true },
];

const NAMES: [&str; 5] = [
    "flash_attention_d64",
    "flash_attention_d80",
    "flash_attention_d96",
    "flash_attention_d128",
    "flash_attention_d256",
];
const FP8_NAMES: [&str; 5] = [
    "flash_attention_fp8kv_d64",
    "flash_attention_fp8kv_d80",
    "flash_attention_fp8kv_d96",
    "flash_attention_fp8kv_d128",
    "flash_attention_fp8kv_d256",
];

/// One compiled head size: keys per K/V tile and whether the Q fragments stay in registers
/// (the `BN` and `Q_IN_REGS` its kernel is instantiated with).
#[derive(Debug, PartialEq)]
pub(crate) struct FlashKernel {
    name: &'static str,
    /// The same over FP8 caches (`flash_attention_fp8kv_d{D}`).
    fp8_name: &'static str,
    head_dim: usize,
    key_tile: usize,
    q_in_regs: bool,
}

const VARIANTS: [FlashKernel; 5] = [
    FlashKernel { name: NAMES[0], fp8_name: FP8_NAMES[0], head_dim: 64, key_tile: 64, q_in_regs: true },
    FlashKernel { name: NAMES[1], fp8_name: FP8_NAMES[1], head_dim: 80, key_tile: 64, q_in_regs: true },
    FlashKernel { name: NAMES[2], fp8_name: FP8_NAMES[2], head_dim: 96, key_tile: 64, q_in_regs: true },
    FlashKernel { name: NAMES[3], fp8_name: FP8_NAMES[3], head_dim: 128, key_tile: 64, q_in_regs: true },
    // 128 f32 accumulators per thread leave no room for Q fragments or wider key tiles.
    FlashKernel { name: NAMES[4], fp8_name: FP8_NAMES[4], head_dim: 256, key_tile: 32, q_in_regs: false },
];

impl FlashKernel {
    /// The kernel for `head_dim` in `dtype`, if one is compiled.
    pub(crate) fn find(dtype: DType, head_dim: usize) -> Option<&'static FlashKernel> {
        if dtype == DType::F32 {
            return None;
        }
        VARIANTS.iter().find(|k| k.head_dim == head_dim)
    }

    /// Dynamic shared memory: double-buffered K and V tiles, plus the Q tile unless it is staged
    /// in the second K buffer; rows of `head_dim + 8` 2-byte elements.
    pub(crate) fn shared_bytes(&self) -> usize {
        let q_rows = if self.q_in_regs { 0 } else { TILE_ROWS };
        (4 * self.key_tile + q_rows) * (self.head_dim + 8) * 2
    }
}

/// How the query heads of a GQA group fill a block's rows: `heads_per_tile` heads of
/// `tokens_per_tile` tokens, and `head_chunks` blocks per KV head for groups wider than a tile.
#[derive(Clone, Copy, Debug, PartialEq)]
struct TileRows {
    heads_per_tile: usize,
    tokens_per_tile: usize,
    head_chunks: usize,
}

impl TileRows {
    fn new(group: usize) -> TileRows {
        let heads_per_tile = group.clamp(1, TILE_ROWS);
        TileRows {
            heads_per_tile,
            tokens_per_tile: TILE_ROWS / heads_per_tile,
            head_chunks: group.div_ceil(heads_per_tile),
        }
    }
}

/// `[num_items, 2]`: (request, first query row) of each tile of `tokens_per_tile` rows of the
/// requests from `first_request` on, no tile crossing into the next request. A chunk's last tiles
/// see the most keys, so they come first: the short ones then fill the end of the launch.
fn work_items(query_start_loc: &[u32], tokens_per_tile: usize, first_request: usize) -> Vec<u32> {
    let mut items = Vec::new();
    for (r, w) in query_start_loc.windows(2).enumerate().skip(first_request) {
        for first in (w[0]..w[1]).step_by(tokens_per_tile).rev() {
            items.extend([r as u32, first]);
        }
    }
    items
}

/// `(mul, shift)` such that `n / d == umulhi(n, mul) >> shift` for every `n < 2^31`, or `(0, 0)`
/// for `d == 1` (`fast_div` in flash_attention.cu): the kernel divides each key position by
/// the block size without a division instruction.
fn fast_divisor(d: u32) -> (u32, u32) {
    assert!(d > 0, "fast_divisor: division by 0");
    if d == 1 {
        return (0, 0);
    }
    let p = 31 + (32 - (d - 1).leading_zeros()); // 31 + ceil(log2 d)
    let mul = (1u64 << p).div_ceil(d as u64);
    (mul as u32, p - 32)
}

/// The work list of one step on the device.
struct WorkList {
    tokens_per_tile: usize,
    /// The requests before it are not in the list (another kernel takes them).
    first_request: usize,
    num_items: usize,
    /// `[num_items, 2]`, or `None` when no request has more than one row: item `r` is then
    /// request `r`, found by the kernel without a list, so that a batch of decodes uploads
    /// nothing (and can be captured in a graph). Also `None` for an empty list (`num_items` 0,
    /// nothing launched).
    items: Option<CudaSlice<u32>>,
}

impl WorkList {
    fn new(
        gpu: &Gpu,
        query_start_loc: &[u32],
        tokens_per_tile: usize,
        first_request: usize,
    ) -> Result<WorkList, GpuError> {
        assert!(query_start_loc.windows(2).all(|w| w[0] <= w[1]), "paged_attention: query_start_loc_host decreases");
        if first_request == 0 && query_start_loc.windows(2).all(|w| w[1] - w[0] <= 1) {
            let num_items = query_start_loc.len() - 1;
            return Ok(WorkList { tokens_per_tile, first_request, num_items, items: None });
        }
        let items = work_items(query_start_loc, tokens_per_tile, first_request);
        let num_items = items.len() / 2;
        let items = if items.is_empty() { None } else { Some(gpu.upload(&items)?) };
        Ok(WorkList { tokens_per_tile, first_request, num_items, items })
    }
}

/// The tensor-core kernel's work list for one step, built and uploaded by the first
/// [`super::PagedAttention::run`] call that needs it and reused by the step's other layers. It
/// belongs to the [`super::GpuAttentionMetadata`] it sits in: make a new one with each step's metadata.
#[derive(Default)]
pub struct AttentionWork {
    list: OnceCell<WorkList>,
}

/// A clone starts empty: it is a cache.
impl Clone for AttentionWork {
    fn clone(&self) -> AttentionWork {
        AttentionWork::default()
    }
}

impl fmt::Debug for AttentionWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let items = self.list.get().map(|l| l.num_items);
        f.debug_struct("AttentionWork").field("items", &items).finish()
    }
}

/// The kernel that takes this call, if any: bf16 or f16, a compiled head size, the 16-byte
/// alignment its loads need and shared memory the device has.
pub(crate) fn kernel_for(
    gpu: &Gpu,
    head_dim: usize,
    q: GpuView<'_>,
    caches: Caches<'_>,
    out: &GpuViewMut<'_>,
) -> Option<&'static FlashKernel> {
    let (k_ptr, v_ptr) = caches.ptrs();
    let aligned = [q.ptr(), k_ptr, v_ptr, out.ptr()].iter().all(|p| p.is_multiple_of(16));
    FlashKernel::find(q.dtype(), head_dim).filter(|k| aligned && k.shared_bytes() <= gpu.max_shared_per_block())
}

/// [`super::PagedAttention::run`] on `kernel` for the requests from `first_request` on (their rows
/// of `out`; the earlier requests' rows are left as they are); the arguments are already checked.
pub(crate) fn paged_flash(
    gpu: &Gpu,
    kernel: &FlashKernel,
    operands: &Operands<'_>,
    first_request: usize,
    out: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    let Operands { q, caches, meta, heads } = *operands;
    let (num_heads, num_kv_heads) = (heads.num_heads, heads.num_kv_heads);
    let op = "paged_attention";
    let head_dim = kernel.head_dim;
    let num_reqs = meta.seq_lens.len();
    let qsl = meta.query_start_loc_host;
    assert_eq!(qsl.len(), num_reqs + 1, "{op}: query_start_loc_host must have num_reqs + 1 entries");
    let num_tokens = q.len() / (num_heads * head_dim);
    assert_eq!(qsl[num_reqs] as usize, num_tokens, "{op}: query_start_loc_host does not end at q's {num_tokens} rows");
    let rows = TileRows::new(num_heads / num_kv_heads);

    let mut fresh = None;
    let list = match meta.work.list.get() {
        Some(list) if list.tokens_per_tile == rows.tokens_per_tile && list.first_request == first_request => list,
        _ => fresh.insert(WorkList::new(gpu, qsl, rows.tokens_per_tile, first_request)?),
    };
    if list.num_items == 0 {
        return Ok(());
    }

    let blocks = list.num_items * num_kv_heads * rows.head_chunks;
    assert!(blocks <= i32::MAX as usize, "{op}: {blocks} blocks exceed the grid");
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: kernel.shared_bytes() as u32,
    };
    let kv_width = num_kv_heads * head_dim;
    let num_blocks = u32::try_from(caches.len() / kv_width / meta.block_size).unwrap_or(u32::MAX);
    assert!(
        meta.max_blocks_per_seq * meta.block_size < 1 << 31,
        "{op}: contexts of {} blocks of {} exceed the kernel's 2^31 positions",
        meta.max_blocks_per_seq,
        meta.block_size
    );
    let block_size = to_u32(op, "block_size", meta.block_size);
    let (bs_mul, bs_shift) = fast_divisor(block_size);
    let ((kc_ptr, vc_ptr), q_ptr, out_ptr) = (caches.ptrs(), q.ptr(), out.ptr());
    let work_ptr = list.items.as_ref().map_or(0, |items| gpu.index_ptr(items));
    let qsl_ptr = gpu.index_ptr(&meta.query_start_loc);
    let lens_ptr = gpu.index_ptr(&meta.seq_lens);
    let tables_ptr = gpu.index_ptr(&meta.block_tables);
    let args = [
        to_u32(op, "num_heads", num_heads),
        to_u32(op, "num_kv_heads", num_kv_heads),
        to_u32(op, "max_blocks_per_seq", meta.max_blocks_per_seq),
        block_size,
        bs_mul,
        bs_shift,
        num_blocks,
        // 0 is "no window"; a window past u32 sees everything, as no window does.
        meta.sliding_window.map_or(0, |w| u32::try_from(w).unwrap_or(0)),
    ];
    let (scale_log2, softcap) = (meta.scale * std::f32::consts::LOG2_E, softcap_arg(meta));
    let (heads_per_tile, head_chunks) = (rows.heads_per_tile as u32, rows.head_chunks as u32);
    let fp8 = caches.fp8_scales();
    let name = if fp8.is_some() { kernel.fp8_name } else { kernel.name };
    let mut launch = gpu.launch_builder(name, q.dtype());
    launch.arg(&q_ptr).arg(&kc_ptr).arg(&vc_ptr).arg(&out_ptr).arg(&work_ptr);
    launch.arg(&qsl_ptr).arg(&lens_ptr).arg(&tables_ptr);
    for a in &args {
        launch.arg(a);
    }
    launch.arg(&scale_log2).arg(&softcap).arg(&heads_per_tile).arg(&head_chunks);
    // The FP8 kernel takes the caches' scales last.
    if let Some((k_scale, v_scale)) = &fp8 {
        launch.arg(k_scale).arg(v_scale);
    }
    // SAFETY: the arguments match the kernel's parameters in order; `kernel_for` checked the
    // dtype, head size and alignment; every work item lies inside its request's query rows
    // (`work_items` over the checked `query_start_loc_host`, or one item per request without a
    // list), and the shared memory is as the kernel lays it out.
    unsafe { launch.launch(cfg) }?;

    if let Some(fresh) = fresh {
        // Kept for the step's next layers unless a list of another shape holds the place.
        let _ = meta.work.list.set(fresh);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_hold_whole_gqa_groups_in_sixty_four_rows() {
        let t =
            |heads_per_tile, tokens_per_tile, head_chunks| TileRows { heads_per_tile, tokens_per_tile, head_chunks };
        assert_eq!(TileRows::new(1), t(1, 64, 1));
        assert_eq!(TileRows::new(4), t(4, 16, 1));
        assert_eq!(TileRows::new(8), t(8, 8, 1));
        // 21 tokens of 3 heads: 63 rows, one of padding.
        assert_eq!(TileRows::new(3), t(3, 21, 1));
        assert_eq!(TileRows::new(64), t(64, 1, 1));
        assert_eq!(TileRows::new(96), t(64, 1, 2));
        for group in 1..=200 {
            let r = TileRows::new(group);
            assert!(r.heads_per_tile * r.tokens_per_tile <= TILE_ROWS, "{r:?}");
            assert!(r.heads_per_tile * r.head_chunks >= group && r.heads_per_tile * (r.head_chunks - 1) < group);
        }
    }

    #[test]
    fn work_items_tile_each_request_last_tile_first() {
        // Rows 0..5 (a chunk of 5), none, 5..6 (a decode), 6..22 (16 rows).
        let qsl = [0, 5, 5, 6, 22];
        assert_eq!(work_items(&qsl, 4, 0), vec![0, 4, 0, 0, 2, 5, 3, 18, 3, 14, 3, 10, 3, 6]);
        assert_eq!(work_items(&qsl, 64, 0), vec![0, 0, 2, 5, 3, 6]);
        assert!(work_items(&[0], 16, 0).is_empty());
        // Every row in exactly one tile of its own request.
        for tpt in [1, 2, 3, 8, 21, 64] {
            let mut covered = vec![0; 22];
            for item in work_items(&qsl, tpt, 0).chunks(2) {
                let (r, first) = (item[0] as usize, item[1]);
                let end = first.saturating_add(tpt as u32).min(qsl[r + 1]);
                assert!(qsl[r] <= first && first < qsl[r + 1]);
                (first..end).for_each(|t| covered[t as usize] += 1);
            }
            assert!(covered.iter().all(|&c| c == 1), "tokens_per_tile {tpt}: {covered:?}");
        }
        // From request 2 on: requests 0 and 1 have no tile.
        assert_eq!(work_items(&qsl, 4, 2), vec![2, 5, 3, 18, 3, 14, 3, 10, 3, 6]);
        assert!(work_items(&qsl, 4, 4).is_empty());
    }

    #[test]
    fn fast_divisor_divides_positions_exactly() {
        let umulhi = |n: u32, m: u32| ((n as u64 * m as u64) >> 32) as u32;
        for d in (1..=300).chain([512, 528, 1000, 4096, 65_537, (1 << 31) - 1]) {
            let (mul, shift) = fast_divisor(d);
            let n_max = (1u32 << 31) - 1;
            let edges = (1..2000u64).map(|i| i * d as u64 - 1).filter(|&n| n <= n_max as u64).map(|n| n as u32);
            for n in (0..5000).chain((0..64).map(|i| n_max - i)).chain(edges) {
                let q = if mul == 0 { n } else { umulhi(n, mul) >> shift };
                assert_eq!(q, n / d, "{n} / {d}");
            }
        }
    }

    #[test]
    fn half_types_of_compiled_head_sizes_take_the_kernel() {
        for dtype in [DType::BF16, DType::F16] {
            for head_dim in [64, 80, 96, 128, 256] {
                let k = FlashKernel::find(dtype, head_dim).expect("compiled");
                assert_eq!(k.name, format!("flash_attention_d{head_dim}"));
                assert!(k.shared_bytes() <= 227 * 1024, "{k:?}");
            }
            for head_dim in [32, 48, 112, 192, 512] {
                assert_eq!(FlashKernel::find(dtype, head_dim), None);
            }
        }
        assert_eq!(FlashKernel::find(DType::F32, 128), None);
        // Llama-3.1-8B: 68 KiB, three blocks' worth on an H200's 227 KiB.
        assert_eq!(FlashKernel::find(DType::BF16, 128).map(FlashKernel::shared_bytes), Some(69_632));
    }
}
