//! CPU backend ops (f32 arithmetic, multi-threaded with rayon).
//!
//! Contract shared by every op: row-major buffers, shapes given in the doc comments, output
//! buffers fully overwritten (never accumulated into unless the name says so). Shape mismatches
//! are caller bugs and panic with the op's name.
//!
//! Layout: `linear` (with its kernels in `gemv` and the dtype widening in `weights`) carries
//! nearly all of a forward pass's time; the other ops are one module each (`moe`: a
//! mixture-of-experts MLP through `linear`, expert by expert).

mod activation;
mod attention;
mod device;
mod embedding;
mod gemv;
mod kv_cache;
mod linear;
mod moe;
mod norm;
mod rope;
mod softcap;
#[cfg(test)]
mod testutil;
mod weights;

pub use activation::{gelu_tanh_and_mul, silu_and_mul};
pub use attention::{paged_attention, AttentionMetadata};
pub use device::{Cpu, CpuBatch, CpuKvLayer, CpuMatrix, CpuRope, CpuTensor, Fp8Inputs};
pub use embedding::embedding;
pub use kv_cache::{reshape_and_cache, reshape_and_cache_into, KvStore, KvView};
pub use linear::{linear, linear_gemm, linear_gemv, GEMV_MAX_M};
pub use moe::{add_sigmoid_gated, moe, CpuMoeScratch, MoeWeights};
pub use norm::{add_rms_norm, rms_norm, rms_norm_inplace};
pub use rope::rope;
pub use softcap::softcap;

/// Element count below which an op runs on the calling thread: for a decode step's few rows,
/// handing work to the thread pool costs more than it saves.
const PARALLEL_MIN_ELEMS: usize = 1 << 15;
