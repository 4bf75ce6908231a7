//! Weights in host memory, in their storage dtype: what a checkpoint loader hands a device to
//! place ([`crate::Device::matrix`]).
//!
//! Invariant: a [`HostTensor`] always holds exactly `shape.iter().product()` elements of its
//! dtype, and a shared byte range is aligned for that dtype.

use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

use crate::{DType, WeightView};

/// Bytes a tensor may borrow without copying them (a memory-mapped checkpoint file).
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Where a tensor's elements live.
enum Storage {
    /// Bytes `[start, end)` of shared memory, aligned for the dtype.
    Shared {
        bytes: SharedBytes,
        start: usize,
        end: usize,
    },
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// A weight tensor in host memory, in its storage dtype.
pub struct HostTensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostTensor({:?}, {:?})", self.dtype, self.shape)
    }
}

impl HostTensor {
    /// Elements of `dtype` in bytes `[start, end)` of `bytes`, borrowed where they are aligned for
    /// the dtype and copied otherwise. Panics when the range does not hold `shape` exactly.
    pub fn from_bytes(bytes: SharedBytes, start: usize, end: usize, dtype: DType, shape: Vec<usize>) -> HostTensor {
        let data = &(*bytes).as_ref()[start..end];
        let expected = shape.iter().product::<usize>() * dtype.size_in_bytes();
        assert_eq!(data.len(), expected, "HostTensor::from_bytes: {} bytes for {shape:?} of {dtype:?}", data.len());
        if (data.as_ptr() as usize).is_multiple_of(dtype.size_in_bytes()) {
            return HostTensor { dtype, shape, storage: Storage::Shared { bytes, start, end } };
        }
        let storage = match dtype {
            DType::F32 => {
                Storage::F32(data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            DType::F16 => Storage::F16(data.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect()),
            DType::BF16 => Storage::BF16(data.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()),
        };
        HostTensor { dtype, shape, storage }
    }

    pub fn from_f32(shape: Vec<usize>, data: Vec<f32>) -> HostTensor {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "HostTensor::from_f32: shape {shape:?}");
        HostTensor { dtype: DType::F32, shape, storage: Storage::F32(data) }
    }

    pub fn from_f16(shape: Vec<usize>, data: Vec<f16>) -> HostTensor {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "HostTensor::from_f16: shape {shape:?}");
        HostTensor { dtype: DType::F16, shape, storage: Storage::F16(data) }
    }

    pub fn from_bf16(shape: Vec<usize>, data: Vec<bf16>) -> HostTensor {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "HostTensor::from_bf16: shape {shape:?}");
        HostTensor { dtype: DType::BF16, shape, storage: Storage::BF16(data) }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn size_in_bytes(&self) -> usize {
        self.num_elements() * self.dtype.size_in_bytes()
    }

    pub fn view(&self) -> WeightView<'_> {
        match &self.storage {
            Storage::Shared { bytes, start, end } => {
                let bytes = &(**bytes).as_ref()[*start..*end];
                // Alignment was checked when the tensor was made.
                match self.dtype {
                    DType::F32 => WeightView::F32(bytemuck::cast_slice(bytes)),
                    DType::F16 => WeightView::F16(bytemuck::cast_slice(bytes)),
                    DType::BF16 => WeightView::BF16(bytemuck::cast_slice(bytes)),
                }
            }
            Storage::F32(v) => WeightView::F32(v),
            Storage::F16(v) => WeightView::F16(v),
            Storage::BF16(v) => WeightView::BF16(v),
        }
    }

    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.view().to_f32_vec()
    }

    /// Stacks tensors of equal dtype and trailing dims along dim 0 (q/k/v or gate/up into one
    /// matrix). One part is returned as it is; more are copied into owned memory.
    pub fn concat_rows(mut parts: Vec<HostTensor>) -> HostTensor {
        assert!(!parts.is_empty(), "concat_rows: no parts");
        if parts.len() == 1 {
            return parts.pop().expect("one part");
        }
        let first = &parts[0];
        assert!(parts.iter().all(|p| p.dtype == first.dtype), "concat_rows: mixed dtypes");
        assert!(parts.iter().all(|p| p.shape[1..] == first.shape[1..]), "concat_rows: mixed trailing dims");
        let mut shape = first.shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        let storage = match first.dtype {
            DType::F32 => Storage::F32(concat(&parts, |v| match v {
                WeightView::F32(s) => s,
                _ => unreachable!("dtype checked"),
            })),
            DType::F16 => Storage::F16(concat(&parts, |v| match v {
                WeightView::F16(s) => s,
                _ => unreachable!("dtype checked"),
            })),
            DType::BF16 => Storage::BF16(concat(&parts, |v| match v {
                WeightView::BF16(s) => s,
                _ => unreachable!("dtype checked"),
            })),
        };
        HostTensor { dtype: first.dtype, shape, storage }
    }

    /// Converts to `dtype` (owned) unless it is already in it.
    pub fn into_dtype(self, dtype: DType) -> HostTensor {
        if self.dtype == dtype {
            return self;
        }
        let values = self.to_f32_vec();
        let storage = match dtype {
            DType::F32 => Storage::F32(values),
            DType::F16 => Storage::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::BF16 => Storage::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        };
        HostTensor { dtype, shape: self.shape, storage }
    }
}

fn concat<T: Copy>(parts: &[HostTensor], get: impl Fn(WeightView<'_>) -> &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(parts.iter().map(HostTensor::num_elements).sum());
    for p in parts {
        out.extend_from_slice(get(p.view()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_bytes_are_copied_and_aligned_ones_borrowed() {
        let values = [1.5f32, -2.0, 3.25];
        let mut bytes = vec![0u8];
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        bytes.extend([0u8; 3]);
        let shared: SharedBytes = Arc::new(bytes);
        let odd = HostTensor::from_bytes(Arc::clone(&shared), 1, 13, DType::F32, vec![3]);
        assert_eq!(odd.to_f32_vec(), values);
        let whole = HostTensor::from_bytes(shared, 0, 4, DType::BF16, vec![2]);
        assert!(matches!(whole.storage, Storage::Shared { .. }));
    }

    #[test]
    fn rows_concatenate_in_order() {
        let a = HostTensor::from_f32(vec![1, 2], vec![1.0, 2.0]);
        let b = HostTensor::from_f32(vec![2, 2], vec![3.0, 4.0, 5.0, 6.0]);
        let c = HostTensor::concat_rows(vec![a, b]);
        assert_eq!(c.shape(), &[3, 2]);
        assert_eq!(c.to_f32_vec(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(c.into_dtype(DType::BF16).size_in_bytes(), 12);
    }
}
