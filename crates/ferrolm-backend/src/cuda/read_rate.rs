//! How fast the device reads its memory: the ceiling of every memory-bound kernel that only
//! reads (a decode step's weights, K and V).
//!
//! A device-to-device copy also writes, and on an H200 it moves ~3.9 TB/s (read and write
//! counted) where a kernel that only reads streams ~4.6 TB/s: priced at the copy rate, a decode
//! kernel's reads would look closer to their limit than they are. [`read_rate`] reads a buffer
//! far larger than the L2 with the `stream_read_xor` kernel (16-byte streaming loads, the whole
//! device full of threads), filled on the device by [`word_pattern`]; [`xor_words`] checks that
//! kernel: it returns what it read.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, GpuError};
use crate::DType;

use super::compile::{self, KernelFamilies};

pub(crate) const KERNELS: &[KernelFamilies] = &[KernelFamilies {
    source: &compile::ELEMENTWISE,
    names: &["stream_read_xor", "fill_word_pattern"],
    large_shared: false,
}];

/// Blocks per multiprocessor and threads per block of the read: two waves of 64 warps per SM,
/// as many loads in flight as the device allows (on an H200 ~1 % faster than one wave).
const BLOCKS_PER_SM: usize = 16;
const THREADS: u32 = 256;

/// The XOR of every 16-byte word of `src` (a multiple of 4 elements) as four u32 lanes, read on
/// the device by the kernel [`read_rate`] times. Waits for the result. (The read-rate test's
/// check that every word is read: `bench-internals`.)
#[cfg(feature = "bench-internals")]
pub fn xor_words(gpu: &Gpu, src: &CudaSlice<u32>) -> Result<[u32; 4], GpuError> {
    let mut sink = gpu.upload(&[0u32; 4])?;
    launch_read(gpu, src, &mut sink)?;
    let words = gpu.download(&sink)?;
    Ok([words[0], words[1], words[2], words[3]])
}

/// Bytes per second the device reads: the fastest of `repetitions` timings of back-to-back
/// reads of a buffer of `bytes` (whole 16-byte words, at least one) of non-zero words, far
/// larger than the L2 for the rate to be the memory's, each timing the mean of
/// several after an untimed one (`Gpu::time_us`), so that the device is busy while the host
/// queues the timed reads: a lone read between two events also times its launch (a 1 GiB read
/// on an H200 timed that way gave 4.13 TB/s where the same loads over 8 GiB, ten reads to an
/// event pair, gave 4.58).
pub fn read_rate(gpu: &Gpu, bytes: usize, repetitions: usize) -> Result<f64, GpuError> {
    let words = bytes.max(16) / 16 * 4;
    let src = word_pattern(gpu, words)?;
    let mut sink = gpu.upload(&[0u32; 4])?;
    let mut best_us = f32::INFINITY;
    for _ in 0..repetitions.max(1) {
        best_us = best_us.min(gpu.time_us(|| launch_read(gpu, &src, &mut sink))?);
    }
    Ok((words * 4) as f64 / (f64::from(best_us) / 1e6))
}

/// A new device buffer of `words` distinct non-zero words, `(i * 0x9e3779b9) | 1` at index i
/// (wrapping), written on the device: a host fill and upload of a GiB takes about a second.
pub fn word_pattern(gpu: &Gpu, words: usize) -> Result<CudaSlice<u32>, GpuError> {
    if words == 0 {
        return Ok(gpu.stream().null()?);
    }
    // SAFETY: the kernel below writes every element before anything reads it.
    let dst = unsafe { gpu.stream().alloc::<u32>(words) }?;
    let (dst_ptr, n) = (gpu.index_ptr(&dst), words as u64);
    let mut launch = gpu.launch_builder("fill_word_pattern", DType::F32);
    launch.arg(&dst_ptr).arg(&n);
    // SAFETY: `dst` holds n u32, as the kernel's parameters say.
    unsafe { launch.launch(device_full(gpu)) }?;
    Ok(dst)
}

fn launch_read(gpu: &Gpu, src: &CudaSlice<u32>, sink: &mut CudaSlice<u32>) -> Result<(), GpuError> {
    assert_eq!(src.len() % 4, 0, "stream_read_xor: {} u32 are not 16-byte words", src.len());
    let (src_ptr, sink_ptr, n16) = (gpu.index_ptr(src), gpu.index_ptr(sink), (src.len() / 4) as u64);
    let mut launch = gpu.launch_builder("stream_read_xor", DType::F32);
    launch.arg(&src_ptr).arg(&n16).arg(&sink_ptr);
    // SAFETY: `src` holds n16 words and `sink` four u32, as the kernel's parameters say.
    unsafe { launch.launch(device_full(gpu)) }
}

/// A grid-stride launch with [`BLOCKS_PER_SM`] blocks of [`THREADS`] on every multiprocessor.
fn device_full(gpu: &Gpu) -> LaunchConfig {
    let blocks = (gpu.multiprocessors() * BLOCKS_PER_SM) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}
