//! Compute backends of ferrolm.
//!
//! Activations are always f32 on the CPU backend; weights stay in the dtype they had in the
//! checkpoint (bf16, f16 or f32) and are read through a [`WeightView`], converted to f32 as they
//! are used, so that a bf16 model costs two bytes per parameter in memory.
//!
//! All buffers are row-major and carry their shape in a comment: `[rows, cols]`.
//!
//! With the `cuda` feature, the `cuda` module holds the same ops on an NVIDIA GPU, with
//! activations in f32, bf16 or f16 device memory.
//!
//! [`Device`] is the one interface the decoder runs on: shaped activation buffers and the ops of
//! a decoder step, implemented by [`cpu::Cpu`] and `cuda::Cuda` over those ops.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod fp8;
mod host;

pub use device::{
    unfused_attention_input, AttentionInput, Device, Experts, GatedActivation, Heads, KvCacheDtype, KvScales,
    LayerAttention, Linear, MatrixUse, MoeInput, MoeShape, Precision, RopeFrequencies, Shaped,
};
pub use fp8::{Fp8GemmScaling, Fp8Matrix, Fp8Scales};
pub use host::{HostTensor, SharedBytes};

use half::{bf16, f16};

/// The element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// A borrowed, typed view of weight data, in its storage dtype.
#[derive(Clone, Copy, Debug)]
pub enum WeightView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl<'a> WeightView<'a> {
    pub fn len(&self) -> usize {
        match self {
            WeightView::F32(s) => s.len(),
            WeightView::F16(s) => s.len(),
            WeightView::BF16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        match self {
            WeightView::F32(_) => DType::F32,
            WeightView::F16(_) => DType::F16,
            WeightView::BF16(_) => DType::BF16,
        }
    }

    /// Elements `[start, start + len)`.
    pub fn slice(&self, start: usize, len: usize) -> WeightView<'a> {
        match *self {
            WeightView::F32(s) => WeightView::F32(&s[start..start + len]),
            WeightView::F16(s) => WeightView::F16(&s[start..start + len]),
            WeightView::BF16(s) => WeightView::BF16(&s[start..start + len]),
        }
    }

    /// Converts `self` element-wise into `out` (same length).
    pub fn to_f32_into(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.len(), "to_f32_into: length mismatch");
        match self {
            WeightView::F32(s) => out.copy_from_slice(s),
            WeightView::F16(s) => {
                for (o, x) in out.iter_mut().zip(s.iter()) {
                    *o = x.to_f32();
                }
            }
            WeightView::BF16(s) => {
                for (o, x) in out.iter_mut().zip(s.iter()) {
                    *o = x.to_f32();
                }
            }
        }
    }

    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.to_f32_into(&mut out);
        out
    }
}
