//! Device buffers that outlive a step: the activations every step writes (sized for the largest
//! step seen so far, grown by doubling), and the index buffers of a step.
//!
//! Reusing the activations saves a dozen allocations per step and, more importantly, keeps their
//! addresses fixed, which captured decode graphs rely on: the runner drops its graphs whenever
//! [`Activations::ensure`] reallocates.

use ferrolm_backend::cuda::{CudaSlice, Gpu, GpuError, GpuTensor};
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

/// A step's index buffers on the device, as [`ModelInput`] holds them on the host.
pub(super) struct StepBuffers {
    /// `[T]`
    pub(super) token_ids: CudaSlice<u32>,
    /// `[T]`
    pub(super) positions: CudaSlice<u32>,
    /// `[num_reqs + 1]`
    pub(super) query_start_loc: CudaSlice<u32>,
    /// `[num_reqs]`
    pub(super) seq_lens: CudaSlice<u32>,
    /// `[num_reqs, max_blocks_per_seq]`
    pub(super) block_tables: CudaSlice<u32>,
    /// `[T]`
    pub(super) slot_mapping: CudaSlice<i64>,
    /// `[rows]`
    pub(super) logits_indices: CudaSlice<u32>,
}

impl StepBuffers {
    /// Fresh buffers holding `input`'s indices.
    pub(super) fn upload(gpu: &Gpu, input: &ModelInput) -> Result<StepBuffers, GpuError> {
        Ok(StepBuffers {
            token_ids: gpu.upload(&input.token_ids)?,
            positions: gpu.upload(&input.positions)?,
            query_start_loc: gpu.upload(&input.query_start_loc)?,
            seq_lens: gpu.upload(&input.seq_lens)?,
            block_tables: gpu.upload(&input.block_tables)?,
            slot_mapping: gpu.upload(&input.slot_mapping)?,
            logits_indices: gpu.upload(&input.logits_indices)?,
        })
    }

    /// Overwrites the buffers with `input`'s indices, which must have exactly their lengths.
    pub(super) fn copy_from(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<(), GpuError> {
        gpu.upload_into(&input.token_ids, &mut self.token_ids)?;
        gpu.upload_into(&input.positions, &mut self.positions)?;
        gpu.upload_into(&input.query_start_loc, &mut self.query_start_loc)?;
        gpu.upload_into(&input.seq_lens, &mut self.seq_lens)?;
        gpu.upload_into(&input.block_tables, &mut self.block_tables)?;
        gpu.upload_into(&input.slot_mapping, &mut self.slot_mapping)?;
        gpu.upload_into(&input.logits_indices, &mut self.logits_indices)?;
        Ok(())
    }
}
