//! Device buffers of activations and weights, in a dtype chosen at run time, and borrowed views
//! of element ranges so that ops can work on some rows of a buffer.
//!
//! A view is a device address, a length and a dtype, borrowed from its [`GpuTensor`]: Rust's
//! borrow rules then keep a tensor alive and unaliased for as long as an op's view of it exists.
//! Frees are ordered on the stream after the work already issued, so dropping a tensor right
//! after issuing an op on it is safe.

use std::marker::PhantomData;
use std::ops::Range;

use cudarc::driver::{result as driver, CudaSlice, DevicePtr};
use half::{bf16, f16};

use super::{Gpu, GpuError};
use crate::{DType, WeightView};

/// Elements converted on the host per copy when an upload changes the dtype.
const CONVERT_CHUNK: usize = 1 << 20;

/// A device buffer of `len` elements of `dtype`.
pub struct GpuTensor {
    dtype: DType,
    len: usize,
    /// At least one byte, so that an empty tensor still owns a valid allocation.
    buf: CudaSlice<u8>,
}

impl GpuTensor {
    /// `len` zeros of `dtype`.
    pub fn zeros(gpu: &Gpu, dtype: DType, len: usize) -> Result<GpuTensor, GpuError> {
        let buf = gpu.stream().alloc_zeros::<u8>((len * dtype.size_in_bytes()).max(1))?;
        Ok(GpuTensor { dtype, len, buf })
    }

    /// `len` elements of `dtype` with whatever the memory held: for buffers that every use
    /// writes before it reads.
    pub fn uninit(gpu: &Gpu, dtype: DType, len: usize) -> Result<GpuTensor, GpuError> {
        // SAFETY: bytes of any value are valid `u8`s; callers write before they read.
        let buf = unsafe { gpu.stream().alloc::<u8>((len * dtype.size_in_bytes()).max(1)) }?;
        Ok(GpuTensor { dtype, len, buf })
    }

    /// Uploads `data`, rounded to `dtype` on the host (round to nearest even).
    pub fn from_f32(gpu: &Gpu, data: &[f32], dtype: DType) -> Result<GpuTensor, GpuError> {
        GpuTensor::from_weights(gpu, WeightView::F32(data), dtype)
    }

    /// Uploads weights in their storage dtype, converted to `dtype` on the host when it differs.
    pub fn from_weights(gpu: &Gpu, w: WeightView<'_>, dtype: DType) -> Result<GpuTensor, GpuError> {
        let mut t = GpuTensor::zeros(gpu, dtype, w.len())?;
        t.view_mut().copy_from_weights(gpu, w)?;
        Ok(t)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn size_in_bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }

    pub fn view(&self) -> GpuView<'_> {
        let (ptr, _no_event) = self.buf.device_ptr(self.buf.stream());
        GpuView { ptr, len: self.len, dtype: self.dtype, _tensor: PhantomData }
    }

    pub fn view_mut(&mut self) -> GpuViewMut<'_> {
        let (ptr, _no_event) = self.buf.device_ptr(self.buf.stream());
        GpuViewMut { ptr, len: self.len, dtype: self.dtype, _tensor: PhantomData }
    }

    /// Elements `range`.
    pub fn slice(&self, range: Range<usize>) -> GpuView<'_> {
        self.view().slice(range)
    }

    /// Elements `range`, writable.
    pub fn slice_mut(&mut self, range: Range<usize>) -> GpuViewMut<'_> {
        self.view_mut().slice(range)
    }

    /// Rows `rows` of a `[_, width]` tensor.
    pub fn rows(&self, rows: Range<usize>, width: usize) -> GpuView<'_> {
        self.view().rows(rows, width)
    }

    /// Rows `rows` of a `[_, width]` tensor, writable.
    pub fn rows_mut(&mut self, rows: Range<usize>, width: usize) -> GpuViewMut<'_> {
        self.view_mut().rows(rows, width)
    }

    /// Downloads the tensor widened to f32 (waits for the work that writes it).
    pub fn to_f32_vec(&self, gpu: &Gpu) -> Result<Vec<f32>, GpuError> {
        self.view().to_f32_vec(gpu)
    }
}

impl std::fmt::Debug for GpuTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuTensor({:?}, {})", self.dtype, self.len)
    }
}

/// A read-only range of a [`GpuTensor`].
#[derive(Clone, Copy, Debug)]
pub struct GpuView<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    _tensor: PhantomData<&'a GpuTensor>,
}

impl<'a> GpuView<'a> {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `range` of this view.
    pub fn slice(self, range: Range<usize>) -> GpuView<'a> {
        let (ptr, len) = sub_range(self.ptr, self.len, self.dtype, range);
        GpuView { ptr, len, ..self }
    }

    /// Rows `rows` of a `[_, width]` view.
    pub fn rows(self, rows: Range<usize>, width: usize) -> GpuView<'a> {
        self.slice(rows.start * width..rows.end * width)
    }

    /// Downloads the view widened to f32 (waits for the work that writes it).
    pub fn to_f32_vec(&self, gpu: &Gpu) -> Result<Vec<f32>, GpuError> {
        let mut bytes = vec![0u8; self.len * self.dtype.size_in_bytes()];
        if !bytes.is_empty() {
            // SAFETY: the view covers `bytes.len()` bytes of live device memory; the copy is
            // complete once the stream is synchronised below.
            unsafe { driver::memcpy_dtoh_async(&mut bytes, self.ptr, gpu.raw_stream()?) }?;
            gpu.synchronize()?;
        }
        Ok(decode_f32(&bytes, self.dtype))
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// A writable range of a [`GpuTensor`].
#[derive(Debug)]
pub struct GpuViewMut<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    _tensor: PhantomData<&'a mut GpuTensor>,
}

impl<'a> GpuViewMut<'a> {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_view(&self) -> GpuView<'_> {
        GpuView { ptr: self.ptr, len: self.len, dtype: self.dtype, _tensor: PhantomData }
    }

    /// A shorter-lived copy of this view, to pass to an op while keeping `self`.
    pub fn reborrow(&mut self) -> GpuViewMut<'_> {
        GpuViewMut { ptr: self.ptr, len: self.len, dtype: self.dtype, _tensor: PhantomData }
    }

    /// Elements `range` of this view.
    pub fn slice(self, range: Range<usize>) -> GpuViewMut<'a> {
        let (ptr, len) = sub_range(self.ptr, self.len, self.dtype, range);
        GpuViewMut { ptr, len, ..self }
    }

    /// Rows `rows` of a `[_, width]` view.
    pub fn rows(self, rows: Range<usize>, width: usize) -> GpuViewMut<'a> {
        self.slice(rows.start * width..rows.end * width)
    }

    /// Splits into elements `[0, mid)` and `[mid, len)`.
    pub fn split_at(self, mid: usize) -> (GpuViewMut<'a>, GpuViewMut<'a>) {
        assert!(mid <= self.len, "split_at: {mid} is past the view's {} elements", self.len);
        let (tail, tail_len) = sub_range(self.ptr, self.len, self.dtype, mid..self.len);
        let dtype = self.dtype;
        (
            GpuViewMut { ptr: self.ptr, len: mid, dtype, _tensor: PhantomData },
            GpuViewMut { ptr: tail, len: tail_len, dtype, _tensor: PhantomData },
        )
    }

    /// Overwrites the view with `data`, rounded to the view's dtype on the host.
    pub fn copy_from_f32(&mut self, gpu: &Gpu, data: &[f32]) -> Result<(), GpuError> {
        self.copy_from_weights(gpu, WeightView::F32(data))
    }

    /// Overwrites the view with `w`, converted to the view's dtype on the host when it differs.
    pub fn copy_from_weights(&mut self, gpu: &Gpu, w: WeightView<'_>) -> Result<(), GpuError> {
        assert_eq!(w.len(), self.len, "copy_from_weights: {} elements into a view of {}", w.len(), self.len);
        let elem = self.dtype.size_in_bytes();
        if w.dtype() == self.dtype {
            return self.upload_bytes(gpu, 0, weight_bytes(&w));
        }
        // Converted in chunks so that a large table never needs a second full copy on the host.
        let mut widened = vec![0.0f32; CONVERT_CHUNK.min(self.len)];
        for start in (0..self.len).step_by(CONVERT_CHUNK) {
            let n = CONVERT_CHUNK.min(self.len - start);
            w.slice(start, n).to_f32_into(&mut widened[..n]);
            self.upload_bytes(gpu, start * elem, &encode_f32(&widened[..n], self.dtype))?;
        }
        Ok(())
    }

    /// Overwrites the view with `src` (same dtype and length), on the device.
    pub fn copy_from(&mut self, gpu: &Gpu, src: GpuView<'_>) -> Result<(), GpuError> {
        assert_eq!(src.dtype, self.dtype, "copy_from: {:?} into {:?}", src.dtype, self.dtype);
        assert_eq!(src.len, self.len, "copy_from: {} elements into a view of {}", src.len, self.len);
        let bytes = self.len * self.dtype.size_in_bytes();
        if bytes > 0 {
            // SAFETY: both ranges are live device memory of `bytes` bytes, and cannot overlap
            // since `self` is borrowed mutably.
            unsafe { driver::memcpy_dtod_async(self.ptr, src.ptr, bytes, gpu.raw_stream()?) }?;
        }
        Ok(())
    }

    /// Downloads the view widened to f32.
    pub fn to_f32_vec(&self, gpu: &Gpu) -> Result<Vec<f32>, GpuError> {
        self.as_view().to_f32_vec(gpu)
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    fn upload_bytes(&mut self, gpu: &Gpu, offset: usize, bytes: &[u8]) -> Result<(), GpuError> {
        debug_assert!(offset + bytes.len() <= self.len * self.dtype.size_in_bytes());
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: the destination range lies inside the view; a pageable source is staged by the
        // driver before the call returns, so `bytes` may be dropped afterwards.
        unsafe { driver::memcpy_htod_async(self.ptr + offset as u64, bytes, gpu.raw_stream()?) }?;
        Ok(())
    }
}

/// The address and length of elements `range` of a view; panics when out of bounds.
fn sub_range(ptr: u64, len: usize, dtype: DType, range: Range<usize>) -> (u64, usize) {
    assert!(range.start <= range.end && range.end <= len, "slice {range:?} is outside a view of {len} elements");
    (ptr + (range.start * dtype.size_in_bytes()) as u64, range.len())
}

fn weight_bytes<'w>(w: &WeightView<'w>) -> &'w [u8] {
    match *w {
        WeightView::F32(s) => bytemuck::cast_slice(s),
        WeightView::F16(s) => bytemuck::cast_slice(s),
        WeightView::BF16(s) => bytemuck::cast_slice(s),
    }
}

fn encode_f32(data: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(data).to_vec(),
        DType::BF16 => data.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
        DType::F16 => data.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
    }
}

fn decode_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        DType::BF16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_conversion_round_trips_through_each_dtype() {
        let data = [1.0f32, -2.5, 3.140625, 1e-3, 65504.0];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let bytes = encode_f32(&data, dtype);
            assert_eq!(bytes.len(), data.len() * dtype.size_in_bytes());
            let back = decode_f32(&bytes, dtype);
            for (&b, &d) in back.iter().zip(&data) {
                let want = match dtype {
                    DType::F32 => d,
                    DType::BF16 => bf16::from_f32(d).to_f32(),
                    DType::F16 => f16::from_f32(d).to_f32(),
                };
                assert_eq!(b, want, "{dtype:?}");
            }
        }
    }

    #[test]
    fn sub_ranges_offset_by_whole_elements() {
        assert_eq!(sub_range(1000, 10, DType::BF16, 3..7), (1006, 4));
        assert_eq!(sub_range(1000, 10, DType::F32, 10..10), (1040, 0));
    }

    #[test]
    #[should_panic(expected = "outside a view")]
    fn sub_ranges_past_the_end_panic() {
        sub_range(0, 4, DType::F32, 2..5);
    }
}
