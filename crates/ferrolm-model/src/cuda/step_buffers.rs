//! A step's index buffers on the device, and the host-side shape the decoder needs of it.

use ferrolm_backend::cuda::{
    AttentionWork, CudaBatch, CudaView, Gpu, GpuAttentionMetadata, GpuError, StagedBuffer, StagedPart,
};

use crate::decoder::StepRows;
use crate::input::ModelInput;

/// What a step's device batch needs from the host besides its buffers.
pub(super) struct StepShape {
    /// `[num_reqs + 1]`, as in the step's `ModelInput`: the flash kernel's work list is built
    /// from it on the host.
    query_start_loc: Vec<u32>,
    max_query_len: usize,
    max_blocks_per_seq: usize,
    pub(super) rows: StepRows,
}

impl StepShape {
    pub(super) fn of(input: &ModelInput) -> StepShape {
        let max_query_len = input.query_start_loc.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        StepShape {
            query_start_loc: input.query_start_loc.clone(),
            max_query_len,
            max_blocks_per_seq: input.max_blocks_per_seq,
            rows: input.step_rows(),
        }
    }
}

/// A step's index buffers on the device, as [`ModelInput`] holds them on the host, in one
/// buffer written by one copy from pinned memory (see [`StagedBuffer`]).
pub(super) struct StepBuffers {
    staged: StagedBuffer,
    /// Where each array lies, in the order of [`step_arrays`].
    parts: [StagedPart; 7],
}

/// `input`'s index arrays as bytes: token ids `[T]`, positions `[T]`, query_start_loc
/// `[num_reqs + 1]`, seq_lens `[num_reqs]`, block tables `[num_reqs, max_blocks_per_seq]`, slot
/// mapping `[T]` (i64), logits indices `[rows]`.
fn step_arrays(input: &ModelInput) -> [&[u8]; 7] {
    [
        bytemuck::cast_slice(&input.token_ids),
        bytemuck::cast_slice(&input.positions),
        bytemuck::cast_slice(&input.query_start_loc),
        bytemuck::cast_slice(&input.seq_lens),
        bytemuck::cast_slice(&input.block_tables),
        bytemuck::cast_slice(&input.slot_mapping),
        bytemuck::cast_slice(&input.logits_indices),
    ]
}

impl StepBuffers {
    /// New buffers holding `input`'s indices.
    pub(super) fn upload(gpu: &Gpu, input: &ModelInput) -> Result<StepBuffers, GpuError> {
        let arrays = step_arrays(input);
        let staged = StagedBuffer::new(gpu, StagedBuffer::bytes_for(arrays.iter().map(|a| a.len())))?;
        let mut buffers = StepBuffers { staged, parts: [StagedPart::default(); 7] };
        buffers.write(gpu, input)?;
        Ok(buffers)
    }

    /// Writes `input`'s indices into `this`, replacing it with a larger buffer when they do not
    /// fit (the eager path's buffers, reused from step to step).
    pub(super) fn upload_reusing(
        this: &mut Option<StepBuffers>,
        gpu: &Gpu,
        input: &ModelInput,
    ) -> Result<(), GpuError> {
        let bytes = StagedBuffer::bytes_for(step_arrays(input).iter().map(|a| a.len()));
        match this {
            Some(buffers) if buffers.staged.capacity() >= bytes => buffers.write(gpu, input),
            _ => {
                // Twice what this step needs, so that slowly growing steps reallocate rarely.
                let staged = StagedBuffer::new(gpu, 2 * bytes)?;
                let buffers = this.insert(StepBuffers { staged, parts: [StagedPart::default(); 7] });
                buffers.write(gpu, input)
            }
        }
    }

    /// Overwrites the buffers with `input`'s indices, which must have the lengths of those they
    /// were made for (a captured graph reads them at fixed addresses).
    pub(super) fn copy_from(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<(), GpuError> {
        let before = self.parts;
        self.write(gpu, input)?;
        assert_eq!(before, self.parts, "StepBuffers::copy_from: the step's arrays changed size");
        Ok(())
    }

    fn write(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<(), GpuError> {
        let parts = self.staged.write(gpu, &step_arrays(input))?;
        self.parts.copy_from_slice(&parts);
        Ok(())
    }

    /// The step as the device reads it. The model-wide attention window and scale are left to
    /// each layer ([`ferrolm_backend::LayerAttention`]).
    pub(super) fn batch<'a>(
        &'a self,
        shape: &'a StepShape,
        block_size: usize,
        work: &'a AttentionWork,
    ) -> CudaBatch<'a> {
        CudaBatch {
            token_ids: self.token_ids(),
            positions: self.view(1),
            slot_mapping: self.view(5),
            logits_indices: self.view(6),
            attention: GpuAttentionMetadata {
                query_start_loc: self.view(2),
                query_start_loc_host: &shape.query_start_loc,
                seq_lens: self.view(3),
                block_tables: self.view(4),
                max_blocks_per_seq: shape.max_blocks_per_seq,
                max_query_len: shape.max_query_len,
                block_size,
                sliding_window: None,
                scale: 1.0,
                softcap: None,
                work,
            },
        }
    }

    fn view<T: bytemuck::Pod>(&self, part: usize) -> CudaView<'_, T> {
        self.staged.view(self.parts[part])
    }

    pub(super) fn token_ids(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[0])
    }
}
