//! Times `cuda::paged_attention` in the Llama-3.1-8B shape (32 query heads, 8 KV heads,
//! head_dim 128, block_size 16, bf16) on random inputs.
//!
//! ```text
//! cargo build --release -p ferrolm-backend --features cuda --example attention_bench
//! target/release/examples/attention_bench
//! ```
//!
//! Cases: a decode step of 1 sequence at context 384, of 256 sequences at context 640, and a
//! 512-token prefill chunk of one sequence. Each is timed with CUDA events around one call, best
//! of 20 after a warm-up, and again as the mean of 32 back-to-back calls (one per layer, as a
//! model step issues them; best of 3 such runs). Small cases cycle through 32 layers' worth of K/V so that the reads
//! come from device memory, not the L2 cache. Decode lines give the K/V bytes read per call over
//! the time. Each case runs with its real `max_query_len` (the decode kernel for decodes) and
//! with a hint of 2, which sends decodes to the general kernel, for comparison.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use ferrolm_backend::cuda::{self, Gpu, GpuAttentionMetadata, GpuError, GpuTensor};
use ferrolm_backend::{DType, WeightView};
use half::bf16;

const NUM_HEADS: usize = 32;
const NUM_KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK_SIZE: usize = 16;
const KV_WIDTH: usize = NUM_KV_HEADS * HEAD_DIM;
/// Layers cycled through per case when one layer's K/V would fit in the L2 cache.
const LAYERS: usize = 32;
const REPS: usize = 20;

fn main() {
    let gpu = match Gpu::new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("no GPU: {e}");
            return;
        }
    };
    println!("{} (compute capability {:?})", gpu.name(), gpu.compute_capability());
    println!("{:<34} {:>12} {:>12} {:>14} {:>14}", "case", "best us", "mean32 us", "best GB/s", "mean32 GB/s");
    let cases: [(&str, usize, usize, usize); 3] = [
        ("decode batch 1, context 384", 1, 384, 1),
        ("decode batch 256, context 640", 256, 640, 1),
        ("prefill 512 of one sequence", 1, 512, 512),
    ];
    for (name, batch, context, q_len) in cases {
        if let Err(e) = run_case(&gpu, name, batch, context, q_len) {
            eprintln!("{name}: {e}");
        }
    }
}

/// One case's buffers: `sets` layers of block tables over one shared cache.
struct Case {
    q: GpuTensor,
    out: GpuTensor,
    k_cache: GpuTensor,
    v_cache: GpuTensor,
    query_start_loc: CudaSlice<u32>,
    seq_lens: CudaSlice<u32>,
    /// One `[batch, blocks_per_seq]` table per layer, over disjoint blocks.
    block_tables: Vec<CudaSlice<u32>>,
    blocks_per_seq: usize,
    kv_bytes: usize,
}

fn run_case(gpu: &Gpu, name: &str, batch: usize, context: usize, q_len: usize) -> Result<(), GpuError> {
    let mut case = Case::new(gpu, batch, context, q_len)?;
    let hints = if q_len == 1 { vec![1, 2] } else { vec![q_len] };
    for hint in hints {
        let label = if hint == q_len { name.to_string() } else { format!("  general kernel (hint {hint})") };
        let (best, mean) = case.time(gpu, hint)?;
        let gbs = |s: f64| case.kv_bytes as f64 / s / 1e9;
        let (best_bw, mean_bw) = if q_len == 1 {
            (format!("{:.0}", gbs(best)), format!("{:.0}", gbs(mean)))
        } else {
            ("-".into(), "-".into())
        };
        println!("{label:<34} {:>12.1} {:>12.1} {best_bw:>14} {mean_bw:>14}", best * 1e6, mean * 1e6);
    }
    Ok(())
}

impl Case {
    fn new(gpu: &Gpu, batch: usize, context: usize, q_len: usize) -> Result<Case, GpuError> {
        let blocks_per_seq = context.div_ceil(BLOCK_SIZE);
        let kv_bytes = batch * context * KV_WIDTH * 2 * 2;
        // Enough layers that one pass over them is several times a 50 MB L2.
        let sets = if kv_bytes >= 256 << 20 { 1 } else { LAYERS };
        let num_blocks = sets * batch * blocks_per_seq;
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let mut order: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.next() as usize % (i + 1));
        }
        let block_tables =
            order.chunks(batch * blocks_per_seq).map(|table| gpu.upload(table)).collect::<Result<Vec<_>, _>>()?;
        let cache_len = num_blocks * BLOCK_SIZE * KV_WIDTH;
        let k_cache = random_tensor(gpu, &mut rng, cache_len)?;
        let v_cache = random_tensor(gpu, &mut rng, cache_len)?;
        let tokens = batch * q_len;
        let q = random_tensor(gpu, &mut rng, tokens * NUM_HEADS * HEAD_DIM)?;
        let out = GpuTensor::zeros(gpu, DType::BF16, tokens * NUM_HEADS * HEAD_DIM)?;
        let query_start_loc: Vec<u32> = (0..=batch as u32).map(|r| r * q_len as u32).collect();
        Ok(Case {
            q,
            out,
            k_cache,
            v_cache,
            query_start_loc: gpu.upload(&query_start_loc)?,
            seq_lens: gpu.upload(&vec![context as u32; batch])?,
            block_tables,
            blocks_per_seq,
            kv_bytes,
        })
    }

    fn call(&mut self, gpu: &Gpu, layer: usize, max_query_len: usize) -> Result<(), GpuError> {
        let meta = GpuAttentionMetadata {
            query_start_loc: &self.query_start_loc,
            seq_lens: &self.seq_lens,
            block_tables: &self.block_tables[layer % self.block_tables.len()],
            max_blocks_per_seq: self.blocks_per_seq,
            max_query_len,
            block_size: BLOCK_SIZE,
            sliding_window: None,
            scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        };
        cuda::paged_attention(
            gpu,
            self.q.view(),
            self.k_cache.view(),
            self.v_cache.view(),
            &meta,
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            self.out.view_mut(),
        )
    }

    /// (best single call, mean of `LAYERS` back-to-back calls), in seconds.
    fn time(&mut self, gpu: &Gpu, max_query_len: usize) -> Result<(f64, f64), GpuError> {
        let ctx = gpu.stream().context();
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for layer in 0..LAYERS {
            self.call(gpu, layer, max_query_len)?;
        }
        gpu.synchronize()?;
        let mut best = f64::INFINITY;
        for rep in 0..REPS {
            start.record(gpu.stream())?;
            self.call(gpu, rep, max_query_len)?;
            end.record(gpu.stream())?;
            end.synchronize()?;
            best = best.min(start.elapsed_ms(&end)? as f64 / 1e3);
        }
        let mut mean = f64::INFINITY;
        for _ in 0..3 {
            start.record(gpu.stream())?;
            for layer in 0..LAYERS {
                self.call(gpu, layer, max_query_len)?;
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
