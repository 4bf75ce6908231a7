//! Measures `linear` against the machine's memory bandwidth.
//!
//! ```text
//! cargo run --release -p ferrolm-backend --example linear_bandwidth [read] [gemv] [decode] [crossover]
//! ```
//!
//! Every weight set is several times the size of the last-level cache and is cycled through, so
//! the numbers are from DRAM, as in a real decode step. Prints: read and copy bandwidth, the GEMV
//! bandwidth per shape and dtype, a decode step of a Qwen2.5-0.5B-shaped model, and the time of
//! both `linear` paths as `m` grows (where `GEMV_MAX_M` should sit) and the GEMM path's
//! throughput on the real projections of that model for batched decode and prefill.

use std::hint::black_box;
use std::time::Instant;

use ferrolm_backend::cpu::{linear, linear_gemm, linear_gemv};
use ferrolm_backend::WeightView;
use half::{bf16, f16};
use rayon::prelude::*;

/// Bytes of weights cycled through per measurement (well past a 32 MiB L3).
const WORKING_SET: usize = 512 << 20;

fn main() {
    // Sections to run (all by default): read, gemv, decode, crossover.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let run = |section: &str| args.is_empty() || args.iter().any(|a| a == section);
    println!("rayon threads: {}", rayon::current_num_threads());
    if run("read") {
        memory_bandwidth();
    }
    if run("gemv") {
        for (n, k) in [(1152, 896), (896, 896), (4864, 896), (9728, 896), (896, 4864), (151936, 896)] {
            gemv_bandwidth::<bf16>("bf16", n, k);
        }
        gemv_bandwidth::<f16>("f16", 4864, 896);
        gemv_bandwidth::<f32>("f32", 4864, 896);
    }
    if run("decode") {
        decode_step();
    }
    if run("crossover") {
        crossover(4864, 896);
        for m in [64, 512] {
            for (n, k) in [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)] {
                gemm_throughput(m, n, k);
            }
        }
    }
}

fn best_of<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn memory_bandwidth() {
    let len = 1usize << 30;
    let src: Vec<u8> = (0..len).map(|i| i as u8).collect();
    let mut dst = vec![0u8; len];
    let bytes = len as f64;
    for prefetch in [false, true] {
        let one = best_of(5, || {
            black_box(read_words(&src, prefetch));
        });
        let all = best_of(5, || {
            black_box(read_all(&src, prefetch));
        });
        println!(
            "memory read{}: 1 thread {:5.1} GB/s, all threads {:5.1} GB/s",
            if prefetch { " with software prefetch" } else { "" },
            bytes / one / 1e9,
            bytes / all / 1e9
        );
    }
    let copy = best_of(5, || {
        dst.par_chunks_mut(1 << 18).zip(src.par_chunks(1 << 18)).for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&dst);
    });
    println!("memcpy, all threads: {:5.1} GB/s read + {:.1} GB/s write", bytes / copy / 1e9, bytes / copy / 1e9);
}

/// Reads every byte once, in parallel.
fn read_all(bytes: &[u8], prefetch: bool) -> u64 {
    bytes.par_chunks(1 << 17).map(|c| read_words(c, prefetch)).reduce(|| 0, |a, b| a ^ b)
}

/// Reads every byte once, eight bytes at a time; with `prefetch`, asks for the line
/// `PREFETCH_AHEAD` bytes ahead as each line is read, as the GEMV kernel does.
fn read_words(bytes: &[u8], prefetch: bool) -> u64 {
    const PREFETCH_AHEAD: usize = 2048;
    let (head, words, tail) = bytemuck::pod_align_to::<u8, u64>(bytes);
    let mut acc = head.iter().chain(tail).fold(0u64, |a, &b| a ^ b as u64);
    let mut lanes = [0u64; 8];
    for line in words.chunks(8) {
        #[cfg(target_arch = "x86_64")]
        if prefetch {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let ahead = line.as_ptr().cast::<i8>().wrapping_add(PREFETCH_AHEAD);
            // SAFETY: prefetching is a hint and never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead) };
        }
        for (l, &w) in lanes.iter_mut().zip(line) {
            *l ^= w;
        }
    }
    for l in lanes {
        acc ^= l;
    }
    acc
}

trait Elem: bytemuck::Pod + Send + Sync {
    fn from_f32(v: f32) -> Self;
    fn view(s: &[Self]) -> WeightView<'_>;
}

impl Elem for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn view(s: &[Self]) -> WeightView<'_> {
        WeightView::BF16(s)
    }
}

impl Elem for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn view(s: &[Self]) -> WeightView<'_> {
        WeightView::F16(s)
    }
}

impl Elem for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
    fn view(s: &[Self]) -> WeightView<'_> {
        WeightView::F32(s)
    }
}

/// Enough copies of an `[n, k]` weight to fill the working set.
fn weight_copies<E: Elem>(n: usize, k: usize) -> Vec<Vec<E>> {
    let copies = (WORKING_SET / (n * k * size_of::<E>())).max(2);
    (0..copies).map(|c| (0..n * k).map(|i| E::from_f32(((i * 31 + c) % 97) as f32 / 97.0 - 0.5)).collect()).collect()
}

fn gemv_bandwidth<E: Elem>(dtype: &str, n: usize, k: usize) {
    let weights = weight_copies::<E>(n, k);
    let x: Vec<f32> = (0..k).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut y = vec![0.0f32; n];
    // Reads of the same buffers, interleaved with the GEMV passes so that both see the same
    // machine (other processes may be running).
    let (mut read, mut gemv) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..6 {
        let t = Instant::now();
        for w in &weights {
            black_box(read_all(bytemuck::cast_slice(w), true));
        }
        read = read.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for w in &weights {
            linear(&x, 1, k, E::view(w), n, None, &mut y);
        }
        gemv = gemv.min(t.elapsed().as_secs_f64());
    }
    let bytes = (weights.len() * n * k * size_of::<E>()) as f64;
    println!(
        "gemv {dtype:>4} m=1 [{n:>6}, {k:>4}]: {:8.1} us  {:5.1} GB/s   (read of the same bytes {:5.1} GB/s: {:3.0}%)",
        gemv / weights.len() as f64 * 1e6,
        bytes / gemv / 1e9,
        bytes / read / 1e9,
        100.0 * read / gemv
    );
}

/// One decode token through 24 layers of Qwen2.5-0.5B-shaped projections plus the LM head.
fn decode_step() {
    let hidden = 896;
    let shapes = [(1152, hidden), (hidden, hidden), (2 * 4864, hidden), (hidden, 4864)];
    let layers: Vec<Vec<Vec<bf16>>> =
        (0..24).map(|_| shapes.iter().map(|&(n, k)| vec![bf16::from_f32(0.01); n * k]).collect()).collect();
    let lm_head = vec![bf16::from_f32(0.01); 151936 * hidden];
    let x = vec![0.5f32; 4864];
    let mut y = vec![0.0f32; 151936];
    let mut step = || {
        for layer in &layers {
            for (w, &(n, k)) in layer.iter().zip(&shapes) {
                linear(&x[..k], 1, k, WeightView::BF16(w), n, None, &mut y[..n]);
            }
        }
        linear(&x[..hidden], 1, hidden, WeightView::BF16(&lm_head), 151936, None, &mut y);
    };
    let bytes = (24 * shapes.iter().map(|&(n, k)| n * k).sum::<usize>() + 151936 * hidden) * 2;
    // Called from outside the pool, every `linear` hands its work over to the pool's threads and
    // waits for them; called from inside, the caller is one of them.
    let outside = best_of(5, &mut step);
    let inside = rayon::ThreadPoolBuilder::new().build().expect("thread pool").install(|| best_of(5, &mut step));
    for (how, seconds) in [("from outside the pool", outside), ("inside pool.install", inside)] {
        println!(
            "decode step, all projections of a 0.5B bf16 model ({:.0} MB), {how}: {:.2} ms  {:.1} GB/s",
            bytes as f64 / 1e6,
            seconds * 1e3,
            bytes as f64 / seconds / 1e9
        );
    }
}

fn crossover(n: usize, k: usize) {
    let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5)).collect();
    println!("bf16 [{n}, {k}] by m (weights cache-warm between reps):");
    for m in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 512] {
        let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let mut y = vec![0.0f32; m * n];
        let gemv = best_of(5, || linear_gemv(&x, m, k, WeightView::BF16(&w), n, None, &mut y));
        let gemm = best_of(5, || linear_gemm(&x, m, k, WeightView::BF16(&w), n, None, &mut y));
        let flops = 2.0 * (m * n * k) as f64;
        println!(
            "  m={m:>4}: gemv {:8.1} us ({:6.1} GFLOP/s)   gemm {:8.1} us ({:6.1} GFLOP/s)",
            gemv * 1e6,
            flops / gemv / 1e9,
            gemm * 1e6,
            flops / gemm / 1e9
        );
    }
}

/// GFLOP/s of the GEMM path on one bf16 `[n, k]` projection (weights cache-warm where they fit).
fn gemm_throughput(m: usize, n: usize, k: usize) {
    let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i % 97) as f32 / 97.0 - 0.5)).collect();
    let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut y = vec![0.0f32; m * n];
    let flops = 2.0 * (m * n * k) as f64;
    // About a second of measurement per shape, at least three reps.
    let reps = (1e11 / flops).clamp(3.0, 50.0) as usize;
    let gemm = best_of(reps, || linear_gemm(&x, m, k, WeightView::BF16(&w), n, None, &mut y));
    println!("gemm bf16 m={m:>4} [{n:>6}, {k:>4}]: {:9.1} us  {:6.1} GFLOP/s", gemm * 1e6, flops / gemm / 1e9);
}
