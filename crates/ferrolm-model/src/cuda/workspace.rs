//! Device buffers that outlive a step: the activations every step writes (sized for the largest
//! step seen so far, grown by doubling), and the index buffers of a step.
//!
//! Reusing the activations saves a dozen allocations per step and, more importantly, keeps their
//! addresses fixed, which captured decode graphs rely on: the runner drops its graphs whenever
//! [`Activations::ensure`] reallocates.

use ferrolm_backend::cuda::{CudaView, Gpu, GpuError, GpuTensor, StagedBuffer, StagedPart};
use ferrolm_backend::DType;

use crate::config::ModelConfig;
use crate::input::ModelInput;

/// Fewest tokens and logits rows the buffers are sized for.
const MIN_CAPACITY: usize = 16;

/// The activations of one step of up to `tokens` tokens and `rows` logits rows.
pub(super) struct Activations {
    pub(super) tokens: usize,
    pub(super) rows: usize,
    /// f32 `[tokens, hidden]`: the residual stream stays f32 between layers (the layers compute
    /// in the model dtype), so rounding does not accumulate over the depth of the model.
    pub(super) residual: GpuTensor,
    /// `[tokens, hidden]`
    pub(super) normed: GpuTensor,
    /// `[tokens, hidden]`: the previous sub-layer's output, added into `residual` by the next norm.
    pub(super) pending: GpuTensor,
    /// `[tokens, q_size + 2 * kv_size]`
    pub(super) qkv: GpuTensor,
    /// `[tokens, q_size]`
    pub(super) q: GpuTensor,
    /// `[tokens, kv_size]` each; only models with q/k norms use them (the others write K and V
    /// straight from `qkv` into the cache).
    pub(super) k: GpuTensor,
    pub(super) v: GpuTensor,
    /// `[tokens, q_size]`
    pub(super) attn: GpuTensor,
    /// `[tokens, hidden]`
    pub(super) o: GpuTensor,
    /// `[tokens, 2 * intermediate]`
    pub(super) gate_up: GpuTensor,
    /// `[tokens, intermediate]`
    pub(super) act: GpuTensor,
    /// f32 `[rows, hidden]` and `[rows, hidden]`: the logits rows gathered before the final norm.
    pub(super) last_residual: GpuTensor,
    pub(super) last_out: GpuTensor,
    /// `[rows, hidden]`
    pub(super) final_normed: GpuTensor,
    /// f32 `[rows, vocab]`
    pub(super) logits: GpuTensor,
}

impl Activations {
    pub(super) fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        dtype: DType,
        tokens: usize,
        rows: usize,
    ) -> Result<Self, GpuError> {
        let (tokens, rows) = (tokens.max(MIN_CAPACITY), rows.max(MIN_CAPACITY));
        let (h, q_size, kv_size, inter) = (cfg.hidden_size, cfg.q_size(), cfg.kv_size(), cfg.intermediate_size);
        // Every buffer is written before it is read: no zeroing needed.
        let buf = |dt: DType, len: usize| GpuTensor::uninit(gpu, dt, len);
        let has_qk_norm = cfg.qk_norm;
        Ok(Activations {
            tokens,
            rows,
            residual: buf(DType::F32, tokens * h)?,
            normed: buf(dtype, tokens * h)?,
            pending: buf(dtype, tokens * h)?,
            qkv: buf(dtype, tokens * (q_size + 2 * kv_size))?,
            q: buf(dtype, tokens * q_size)?,
            k: buf(dtype, if has_qk_norm { tokens * kv_size } else { 0 })?,
            v: buf(dtype, if has_qk_norm { tokens * kv_size } else { 0 })?,
            attn: buf(dtype, tokens * q_size)?,
            o: buf(dtype, tokens * h)?,
            gate_up: buf(dtype, tokens * 2 * inter)?,
            act: buf(dtype, tokens * inter)?,
            last_residual: buf(DType::F32, rows * h)?,
            last_out: buf(dtype, rows * h)?,
            final_normed: buf(dtype, rows * h)?,
            logits: buf(DType::F32, rows * cfg.vocab_size)?,
        })
    }

    /// Makes room for a step of `tokens` tokens and `rows` logits rows. Returns whether the
    /// buffers moved (then every captured graph that uses them is stale).
    pub(super) fn ensure(
        this: &mut Option<Activations>,
        gpu: &Gpu,
        cfg: &ModelConfig,
        dtype: DType,
        tokens: usize,
        rows: usize,
    ) -> Result<bool, GpuError> {
        if let Some(a) = this {
            if a.tokens >= tokens && a.rows >= rows {
                return Ok(false);
            }
        }
        let (old_tokens, old_rows) = this.as_ref().map_or((0, 0), |a| (a.tokens, a.rows));
        // Free the old buffers first so that their memory can be reused.
        *this = None;
        let tokens = tokens.max(old_tokens).next_power_of_two();
        let rows = rows.max(old_rows).next_power_of_two();
        *this = Some(Activations::new(gpu, cfg, dtype, tokens, rows)?);
        Ok(true)
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

    pub(super) fn token_ids(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[0])
    }

    pub(super) fn positions(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[1])
    }

    pub(super) fn query_start_loc(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[2])
    }

    pub(super) fn seq_lens(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[3])
    }

    pub(super) fn block_tables(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[4])
    }

    pub(super) fn slot_mapping(&self) -> CudaView<'_, i64> {
        self.staged.view(self.parts[5])
    }

    pub(super) fn logits_indices(&self) -> CudaView<'_, u32> {
        self.staged.view(self.parts[6])
    }
}
