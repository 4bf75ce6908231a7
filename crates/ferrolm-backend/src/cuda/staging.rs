//! Small host arrays sent to the device in one copy: a step's index buffers (token ids,
//! positions, block tables, ...), which would otherwise take a copy each from pageable memory,
//! every one a driver call and a staging copy while the GPU waits for the step.
//!
//! Invariants: the arrays lie in one device buffer, each at a 16-byte aligned offset, in the
//! order given; the host side is pinned memory, rewritten only once the copy that last read it
//! has completed (an event recorded after each copy says when).

use cudarc::driver::sys::{cuMemcpyHtoDAsync_v2, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaSlice, CudaView, DevicePtr, PinnedHostSlice};

use super::{Gpu, GpuError};

/// Alignment of each array in the buffer, in bytes (the widest index type is 8 bytes; 16 keeps
/// vector loads possible).
const ALIGN: usize = 16;

/// Where one array lies in a [`StagedBuffer`]: byte offset and element count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagedPart {
    offset: usize,
    /// Bytes.
    len: usize,
}

/// A device buffer of several index arrays and the pinned host buffer they are written through.
pub struct StagedBuffer {
    device: CudaSlice<u8>,
    host: PinnedHostSlice<u8>,
    /// Recorded after the last copy from `host`.
    copied: Option<CudaEvent>,
}

// SAFETY: the pinned host buffer and the event are plain driver handles, used by one owner at a
// time (the runner that holds this buffer is moved between threads, never shared).
unsafe impl Send for StagedBuffer {}

impl StagedBuffer {
    /// Bytes a buffer needs for arrays of these sizes in bytes, laid out as [`Self::write`] does.
    pub fn bytes_for(sizes: impl IntoIterator<Item = usize>) -> usize {
        sizes.into_iter().fold(0usize, |end, size| end.next_multiple_of(ALIGN) + size).max(ALIGN)
    }

    /// A buffer of `capacity` bytes on the device and in pinned host memory.
    pub fn new(gpu: &Gpu, capacity: usize) -> Result<StagedBuffer, GpuError> {
        let capacity = capacity.max(ALIGN);
        // SAFETY: the device bytes are read only where `write` has copied arrays.
        let device = unsafe { gpu.stream().alloc::<u8>(capacity) }?;
        // SAFETY: the host bytes are written before each copy that reads them.
        let host = unsafe { gpu.stream().context().alloc_pinned::<u8>(capacity) }?;
        Ok(StagedBuffer { device, host, copied: None })
    }

    /// Bytes the buffer holds.
    pub fn capacity(&self) -> usize {
        self.device.len()
    }

    /// Lays `arrays` out one after another (16-byte aligned) and copies them to the device in one
    /// copy on the `Gpu`'s stream, ordered before whatever is issued next. Returns where each one
    /// lies. Panics when they do not fit (size the buffer with [`Self::bytes_for`]).
    pub fn write(&mut self, gpu: &Gpu, arrays: &[&[u8]]) -> Result<Vec<StagedPart>, GpuError> {
        let total = Self::bytes_for(arrays.iter().map(|a| a.len()));
        assert!(total <= self.capacity(), "StagedBuffer: {total} bytes do not fit in {}", self.capacity());
        if let Some(event) = &self.copied {
            // The previous copy must have read the host bytes before they are overwritten.
            event.synchronize()?;
        }
        let host_ptr = self.host.as_mut_ptr()?;
        let mut parts = Vec::with_capacity(arrays.len());
        let mut end = 0usize;
        for array in arrays {
            let offset = end.next_multiple_of(ALIGN);
            // SAFETY: `offset + len <= total <= capacity` bytes of pinned memory, which no copy
            // is reading (synchronized above); the source is a live slice of `len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(array.as_ptr(), host_ptr.add(offset), array.len()) };
            parts.push(StagedPart { offset, len: array.len() });
            end = offset + array.len();
        }
        let stream = gpu.raw_stream()?;
        let (dst, _no_event) = self.device.device_ptr(gpu.stream());
        // SAFETY: both ranges hold `end` bytes; the host memory is pinned and stays untouched until
        // the event recorded below has completed.
        unsafe { cuMemcpyHtoDAsync_v2(dst, host_ptr as *const _, end, stream) }.result()?;
        self.copied = Some(gpu.stream().record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?);
        Ok(parts)
    }

    /// The device address of the array at `part`, for a kernel argument.
    pub fn ptr(&self, gpu: &Gpu, part: StagedPart) -> u64 {
        let (base, _no_event) = self.device.device_ptr(gpu.stream());
        base + part.offset as u64
    }

    /// The array at `part` as `T`s (`part` came from [`Self::write`] on this buffer with an array
    /// of `T`s).
    pub fn view<T: bytemuck::Pod>(&self, part: StagedPart) -> CudaView<'_, T> {
        let size = std::mem::size_of::<T>();
        assert_eq!(part.len % size, 0, "StagedBuffer: {} bytes are not whole elements of {size}", part.len);
        let bytes = self.device.slice(part.offset..part.offset + part.len);
        // SAFETY: the bytes were written from a slice of `T`s (plain data), at an offset aligned
        // for any index type.
        unsafe { bytes.transmute::<T>(part.len / size) }.expect("the part lies within the buffer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_are_laid_out_on_16_byte_boundaries() {
        assert_eq!(StagedBuffer::bytes_for([]), 16);
        assert_eq!(StagedBuffer::bytes_for([4]), 16);
        assert_eq!(StagedBuffer::bytes_for([4, 8]), 24);
        assert_eq!(StagedBuffer::bytes_for([16, 1, 0, 3]), 35);
        assert_eq!(StagedBuffer::bytes_for([17, 17]), 49);
    }
}
