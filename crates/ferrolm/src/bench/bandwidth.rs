//! Memory read bandwidth of this machine, and the batch-1 decode limit it sets.
//!
//! One decode step of one request reads every weight matrix once plus the request's K and V, and
//! does little arithmetic per byte: its speed limit is `bandwidth / bytes read per token`. The
//! bandwidth is measured, not taken from a datasheet: a multi-threaded streaming read over a
//! buffer far larger than the caches, best of a few repetitions.
//!
//! On the CPU that is a multi-threaded streaming read; on a GPU, a kernel that reads the buffer
//! with 16-byte streaming loads from every thread the device holds (`cuda::read_rate`). A
//! device-to-device copy would understate it: on an H200 a copy moves ~3.9 TB/s (read and
//! written bytes counted) where reads alone stream ~4.6 TB/s, and a decode step only reads.

use std::hint::black_box;
use std::time::Instant;

use clap::Args;
use rayon::prelude::*;
use serde::Serialize;

/// How the memory bandwidth is measured (`bench latency` and `bench throughput`).
#[derive(Args, Clone, Debug, Serialize)]
pub struct BandwidthArgs {
    /// Size of the buffer the memory bandwidth is measured on, in MiB (much larger than caches).
    #[arg(long, default_value_t = 1024)]
    pub bandwidth_buffer_mb: usize,
    /// Passes over that buffer (each time it is measured); the fastest counts.
    #[arg(long, default_value_t = 5)]
    pub bandwidth_repetitions: usize,
}

impl BandwidthArgs {
    /// Measures `device`'s bandwidth as these flags say.
    pub fn measure(&self, device: Device) -> anyhow::Result<Bandwidth> {
        eprintln!("measuring {device:?} memory bandwidth ({} MiB buffer)...", self.bandwidth_buffer_mb);
        measure(device, self.bandwidth_buffer_mb << 20, self.bandwidth_repetitions)
    }
}

/// Elements (u64) per parallel task: 512 KiB, large enough to stream, small enough to balance.
const CHUNK: usize = 1 << 16;

/// The device whose memory feeds the decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The first GPU (`cuda` builds only).
    Cuda,
}

impl Device {
    /// The device an engine started with `args` runs on (`auto` probes for a GPU).
    pub fn of(args: &crate::loader::EngineArgs) -> Device {
        use crate::loader::Device as Flag;
        match args.device {
            Flag::Cpu => Device::Cpu,
            Flag::Cuda => Device::Cuda,
            #[cfg(feature = "cuda")]
            Flag::Auto if !matches!(ferrolm_backend::cuda::Gpu::new(0, &Default::default()), Err(e) if e.means_no_gpu()) => {
                Device::Cuda
            }
            Flag::Auto => Device::Cpu,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Bandwidth {
    /// Best of the repetitions, bytes per second.
    pub bytes_per_s: f64,
    pub buffer_bytes: usize,
    pub repetitions: usize,
    pub threads: usize,
}

impl Bandwidth {
    pub fn gbps(&self) -> f64 {
        self.bytes_per_s / 1e9
    }

    /// The measurement's figures, for a JSON report.
    pub fn insert_into(&self, r: &mut serde_json::Map<String, serde_json::Value>) {
        r.insert("memory_bandwidth_gbps".into(), self.gbps().into());
        r.insert("bandwidth_buffer_bytes".into(), self.buffer_bytes.into());
        r.insert("bandwidth_repetitions".into(), self.repetitions.into());
        r.insert("bandwidth_threads".into(), self.threads.into());
    }

    /// The faster of two measurements, counting the repetitions of both.
    pub fn best_of(self, other: Bandwidth) -> Bandwidth {
        let best = if other.bytes_per_s > self.bytes_per_s { other } else { self };
        Bandwidth { repetitions: self.repetitions + other.repetitions, ..best }
    }
}

/// Reads `buffer_bytes` of memory `repetitions` times (CPU: with every rayon thread; GPU: with
/// the read kernel) and keeps the fastest pass.
pub fn measure(device: Device, buffer_bytes: usize, repetitions: usize) -> anyhow::Result<Bandwidth> {
    match device {
        Device::Cpu => Ok(measure_cpu_read(buffer_bytes, repetitions)),
        Device::Cuda => measure_gpu_read(buffer_bytes, repetitions),
    }
}

#[cfg(not(feature = "cuda"))]
fn measure_gpu_read(_buffer_bytes: usize, _repetitions: usize) -> anyhow::Result<Bandwidth> {
    anyhow::bail!("this build of ferrolm has no CUDA backend (build with `--features cuda`)")
}

#[cfg(feature = "cuda")]
fn measure_gpu_read(buffer_bytes: usize, repetitions: usize) -> anyhow::Result<Bandwidth> {
    use anyhow::Context;
    use ferrolm_backend::cuda;

    let gpu = cuda::Gpu::new(0, &Default::default()).context("cannot measure the GPU's bandwidth")?;
    let len = buffer_bytes.max(64 << 20) / 16 * 16;
    Ok(Bandwidth {
        bytes_per_s: cuda::read_rate(&gpu, len, repetitions)?,
        buffer_bytes: len,
        repetitions: repetitions.max(1),
        threads: 0,
    })
}

fn measure_cpu_read(buffer_bytes: usize, repetitions: usize) -> Bandwidth {
    let len = (buffer_bytes / 8).max(CHUNK);
    // [len] of distinct non-zero words: untouched (or all-zero) pages would map the shared zero
    // page and read from cache.
    let mut buf = vec![0u64; len];
    buf.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
        for (i, x) in chunk.iter_mut().enumerate() {
            *x = ((c * CHUNK + i) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        }
    });
    let mut best = f64::INFINITY;
    for _ in 0..repetitions.max(1) {
        let start = Instant::now();
        let sum = buf.par_chunks(CHUNK).map(sum_words).reduce(|| 0, u64::wrapping_add);
        black_box(sum);
        best = best.min(start.elapsed().as_secs_f64());
    }
    Bandwidth {
        bytes_per_s: (len * 8) as f64 / best,
        buffer_bytes: len * 8,
        repetitions: repetitions.max(1),
        threads: rayon::current_num_threads(),
    }
}

/// Eight independent accumulators, so that the loop vectorizes and is bound by loads alone.
fn sum_words(chunk: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut lanes = chunk.chunks_exact(8);
    for block in &mut lanes {
        for (a, &x) in acc.iter_mut().zip(block) {
            *a = a.wrapping_add(x);
        }
    }
    let tail = lanes.remainder().iter().fold(0u64, |s, &x| s.wrapping_add(x));
    acc.iter().fold(tail, |s, &a| s.wrapping_add(a))
}

/// The batch-1 decode limit and how close a measured rate came to it.
#[derive(Clone, Copy, Debug)]
pub struct DecodeLimit {
    /// Bytes one decode step reads: weights plus K and V over the mean context.
    pub bytes_per_token: f64,
    pub tokens_per_s: f64,
    /// Measured decode rate / limit.
    pub fraction: f64,
}

pub fn decode_limit(bandwidth: &Bandwidth, bytes_per_token: f64, measured_tokens_per_s: f64) -> DecodeLimit {
    let tokens_per_s = bandwidth.bytes_per_s / bytes_per_token;
    DecodeLimit { bytes_per_token, tokens_per_s, fraction: measured_tokens_per_s / tokens_per_s }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_every_word() {
        let v: Vec<u64> = (1..=21).collect();
        assert_eq!(sum_words(&v), 231);
    }

    #[test]
    fn bandwidth_is_positive_and_limit_is_consistent() {
        let bw = measure(Device::Cpu, 8 << 20, 2).expect("the CPU can always be measured");
        assert!(bw.bytes_per_s > 0.0 && bw.bytes_per_s.is_finite());
        assert_eq!(bw.buffer_bytes, 8 << 20);
        let limit = decode_limit(&bw, 1e6, 10.0);
        assert!((limit.tokens_per_s - bw.bytes_per_s / 1e6).abs() < 1e-6 * limit.tokens_per_s);
        assert!((limit.fraction * limit.tokens_per_s - 10.0).abs() < 1e-9);
        let slower = Bandwidth { bytes_per_s: bw.bytes_per_s / 2.0, ..bw };
        let best = slower.best_of(bw);
        assert_eq!((best.bytes_per_s, best.repetitions), (bw.bytes_per_s, 4));
    }
}
