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
    parts: Vec<StagedPart>,
}

/// Arrays of a step before the per-group ones (see [`step_arrays`]).
const SHARED_ARRAYS: usize = 5;

/// `input`'s index arrays as bytes: token ids `[T]`, positions `[T]`, query_start_loc
/// `[num_reqs + 1]`, seq_lens `[num_reqs]`, logits indices `[rows]`, then for each KV cache group
/// its block tables `[num_reqs, max_blocks_per_seq]` and slot mapping `[T]` (i64).
fn step_arrays(input: &ModelInput) -> Vec<&[u8]> {
    let mut arrays: Vec<&[u8]> = vec![
        bytemuck::cast_slice(&input.token_ids),
        bytemuck::cast_slice(&input.positions),
        bytemuck::cast_slice(&input.query_start_loc),
        bytemuck::cast_slice(&input.seq_lens),
        bytemuck::cast_slice(&input.logits_indices),
    ];
    for (tables, slots) in input.block_tables.iter().zip(&input.slot_mapping) {
        arrays.push(bytemuck::cast_slice(tables));
        arrays.push(bytemuck::cast_slice(slots));
    }
    arrays
}

impl StepBuffers {
    /// New buffers holding `input`'s indices.
    pub(super) fn upload(gpu: &Gpu, input: &ModelInput) -> Result<StepBuffers, GpuError> {
        let arrays = step_arrays(input);
        let staged = StagedBuffer::new(gpu, StagedBuffer::bytes_for(arrays.iter().map(|a| a.len())))?;
        let mut buffers = StepBuffers { staged, parts: Vec::new() };
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
                let buffers = this.insert(StepBuffers { staged, parts: Vec::new() });
                buffers.write(gpu, input)
            }
        }
    }

    /// Overwrites the buffers with `input`'s indices, which must have the lengths of those they
    /// were made for (a captured graph reads them at fixed addresses).
    pub(super) fn copy_from(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<(), GpuError> {
        let before = self.parts.clone();
        self.write(gpu, input)?;
        assert_eq!(before, self.parts, "StepBuffers::copy_from: the step's arrays changed size");
        Ok(())
    }

    fn write(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<(), GpuError> {
        self.parts = self.staged.write(gpu, &step_arrays(input))?;
        Ok(())
    }

    /// The step as the device reads it, once per KV cache group (each with the group's block
    /// tables and slot mapping). The model-wide attention window and scale are left to each
    /// layer ([`ferrolm_backend::LayerAttention`]).
    pub(super) fn batches<'a>(
        &'a self,
        shape: &'a StepShape,
        block_size: usize,
        work: &'a AttentionWork,
    ) -> Vec<CudaBatch<'a>> {
        let num_groups = (self.parts.len() - SHARED_ARRAYS) / 2;
        let batch = |group: usize| CudaBatch {
            token_ids: self.token_ids(),
            positions: self.view(1),
            slot_mapping: self.view(SHARED_ARRAYS + 2 * group + 1),
            logits_indices: self.view(4),
            attention: GpuAttentionMetadata {
                query_start_loc: self.view(2),
                query_start_loc_host: &shape.query_start_loc,
                seq_lens: self.view(3),
                block_tables: self.view(SHARED_ARRAYS + 2 * group),
                max_blocks_per_seq: shape.max_blocks_per_seq,
                max_query_len: shape.max_query_len,
                block_size,
                sliding_window: None,
                scale: 1.0,
                softcap: None,
                work,
            },
        };
        (0..num_groups).map(batch).collect()
    }

    fn view<T: bytemuck::Pod>(&self, part: usize) -> CudaView<'_, T> {
        self.staged.view(self.parts[part])
    }

    pub(super) fn token_ids(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[0])
    }
}
