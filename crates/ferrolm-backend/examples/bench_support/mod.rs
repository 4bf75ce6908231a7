//! What the kernel benches share: the device, random inputs and the timing of back-to-back
//! calls. A bench takes what it needs of them.
#![allow(dead_code)]

use cudarc::driver::sys::CUevent_flags;
use ferrolm_backend::cuda::{Gpu, GpuError, GpuTensor};
use ferrolm_backend::{DType, WeightView};
use half::bf16;

/// Device 0, its name and compute capability printed; `None` (said on stderr) without a GPU.
pub fn open_gpu() -> Option<Gpu> {
    match Gpu::new(0) {
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

/// `len` random values in [-1, 1) (bf16-representable) stored as `dtype`; `seed` is a xorshift
/// state, advanced.
pub fn random_tensor(gpu: &Gpu, dtype: DType, len: usize, seed: &mut u64) -> Result<GpuTensor, GpuError> {
    let data: Vec<bf16> = (0..len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            bf16::from_f32((*seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect();
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
