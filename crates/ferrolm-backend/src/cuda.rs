//! CUDA backend ops (`cuda` feature): the GPU counterparts of [`crate::cpu`], same layouts and
//! same math, with activations in a dtype chosen at run time (f32, bf16 or f16).
//!
//! Contract shared by every op, as on the CPU: row-major buffers, shapes in the doc comments,
//! outputs fully overwritten unless the name says otherwise, and shape or dtype mismatches are
//! caller bugs that panic with the op's name. What can fail at run time (a missing driver, a
//! launch, a copy) is a [`GpuError`].
//!
//! Invariants:
//! - One [`Gpu`] owns one stream and issues every op, copy and cuBLAS call on it, so work runs
//!   in the order it was issued. cudarc's per-buffer event tracking is therefore switched off.
//! - Arithmetic is f32 whatever the storage dtype; each op rounds its outputs to the storage
//!   dtype once. Small parameter vectors (norm weights, biases, RoPE frequencies) stay f32.
//! - Index buffers (token ids, positions, slot mapping, block tables, query_start_loc,
//!   seq_lens) are device slices or views; a step's are written in one copy through a
//!   [`StagedBuffer`].
//!
//! Layout: `gpu` (the device handle: context, stream, cuBLAS handle, kernels and their launch)
//! and `compile` (NVRTC and its disk cache) set up; `tensor` holds device buffers; the ops are
//! split by kind, with their CUDA C++ source in `kernels/`. An op family that keeps state
//! between calls owns it: [`PagedAttention`] (the decode kernels' counters and workspace) and
//! [`Gemms`] (the cuBLASLt handle and tuned plans), each created on a `Gpu` and passed beside
//! it. [`Cuda`] holds the three for the model. Items only benchmarks and tests call
//! ([`PagedAttention::run_on`], `linear_cublas`, ...) need the `bench-internals` feature.

mod attention;
mod compile;
mod device;
mod error;
mod flash_attention;
mod fp8;
mod gemm_tune;
mod gpu;
mod linear;
mod moe;
mod ops;
mod read_rate;
mod rope;
mod sampling;
mod staging;
mod tensor;

pub use crate::GatedActivation;

/// The entry points every op family loads, by kernel file (`Gpu::new` loads them all).
const KERNELS: [&[compile::KernelFamilies]; 9] = [
    ops::KERNELS,
    linear::KERNELS,
    fp8::KERNELS,
    moe::KERNELS,
    rope::KERNELS,
    attention::KERNELS,
    flash_attention::KERNELS,
    sampling::KERNELS,
    read_rate::KERNELS,
];

#[cfg(feature = "bench-internals")]
pub use attention::AttentionKernel;
pub use attention::{
    reshape_and_cache, reshape_and_cache_fp8, Fp8Cache, Fp8CacheMut, GpuAttentionMetadata, PagedAttention,
};
pub use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
pub use device::{Cuda, CudaBatch, CudaKvLayer, CudaMatrix, CudaTensor};
pub use error::GpuError;
pub use flash_attention::AttentionWork;
pub use fp8::{tune_gemms as tune_fp8_gemms, Fp8View, GpuFp8Matrix, GpuRowCodes, RowCodes, RowCodesMut};
pub use gemm_tune::{Fp8GemmShape, Fp8GemmTuning, GemmShape, GemmTuning, Gemms};
#[cfg(feature = "bench-internals")]
pub use gpu::StreamPriority;
pub use gpu::{Gpu, GpuGraph, GpuOptions};
pub use linear::{linear, linear_fp8, linear_gated, linear_gated_fp8, Fp8Operands, GatedOut, GEMV_MAX_M};
#[cfg(feature = "bench-internals")]
pub use linear::{linear_cublas, linear_fp8_gemv_ksplit, linear_gemv_ksplit};
#[cfg(feature = "bench-internals")]
pub use moe::moe_on_path;
pub use moe::{add_sigmoid_gated, moe, moe_path, GpuExperts, GpuMoeScratch, MoePath, GEMV_MAX_SLOTS_PER_EXPERT};
pub use ops::{
    add_normed_rms_norm, add_rms_norm, embedding, gated_activation, gather_rows, rms_norm, rms_norm_inplace, softcap,
    split_qkv,
};
pub use read_rate::read_rate;
#[cfg(feature = "bench-internals")]
pub use read_rate::{word_pattern, xor_words};
pub use rope::{
    fp8_qkv_rope_cache_fits, linear_fp8_qkv_rope_cache, linear_qkv_rope_cache, qkv_norm_rope_cache,
    qkv_norm_rope_cache_fits, qkv_rope_cache, rope, GpuRopeTable, QkNorms, QkvOut, QkvRows,
};
pub use sampling::GpuSampler;
pub use staging::{StagedBuffer, StagedPart};
pub use tensor::{GpuTensor, GpuView, GpuViewMut};
