//! The activation buffers of a step, on any device: sized for the largest step seen so far
//! (grown by doubling), reused from step to step.
//!
//! Reuse saves a dozen allocations per step and keeps the buffers where they are, which
//! captured CUDA graphs rely on: [`Activations::ensure`] says when they moved. The one list of
//! buffers ([`Specs`]) both allocates them and prices them ([`Activations::bytes`]), so that the
//! memory a GPU keeps back for them is what they take; a MoE model's device scratch
//! ([`Device::moe_scratch`]) is priced with them.
//!
//! A buffer a model has no use for has zero columns: the dense MLP's of a model whose every
//! layer is sparse, the router's and the shared expert's of a dense model.

use ferrolm_backend::{Device, MoeShape, Precision, Shaped};

use crate::config::ModelConfig;

/// Fewest tokens and logits rows the buffers are sized for.
const MIN_CAPACITY: usize = 16;

/// The buffers of one step of up to `tokens` tokens and `rows` logits rows.
pub struct Activations<D: Device> {
    tokens: usize,
    rows: usize,
    /// f32 `[tokens, hidden]`: the residual stream stays f32 between layers (the layers compute
    /// in the device's dtype), so rounding does not accumulate over the depth of the model.
    pub residual: D::Tensor,
    /// `[tokens, hidden]`
    pub normed: D::Tensor,
    /// `[tokens, hidden]`: the previous sub-layer's output, added into `residual` by the next norm.
    pub pending: D::Tensor,
    /// `[tokens, q_size + 2 * kv_size]`
    pub qkv: D::Tensor,
    /// `[tokens, q_size]`
    pub q: D::Tensor,
    /// `[tokens, kv_size]` each: the unfused attention input's split K and V (zero columns
    /// where the device's fused form writes K and V straight from `qkv`).
    pub k: D::Tensor,
    pub v: D::Tensor,
    /// `[tokens, q_size]`
    pub attn: D::Tensor,
    /// `[tokens, hidden]`
    pub o: D::Tensor,
    /// `[tokens, 2 * intermediate]`: the dense MLPs'.
    pub gate_up: D::Tensor,
    /// `[tokens, intermediate]`
    pub act: D::Tensor,
    /// f32 `[tokens, num_experts]`
    pub router_logits: D::Tensor,
    /// `[tokens, 2 * shared_expert_intermediate]`
    pub shared_gate_up: D::Tensor,
    /// `[tokens, shared_expert_intermediate]`
    pub shared_act: D::Tensor,
    /// `[tokens, hidden]`: the shared expert's output, before its gate.
    pub shared_out: D::Tensor,
    /// f32 `[tokens, 1]`: the shared expert's gate logit.
    pub shared_gate: D::Tensor,
    /// The routed experts' scratch, for `tokens` tokens; `None` in a dense model.
    pub moe_scratch: Option<D::MoeScratch>,
    /// f32 `[rows, hidden]` and `[rows, hidden]`: the logits rows gathered before the final norm.
    pub last_residual: D::Tensor,
    pub last_out: D::Tensor,
    /// `[rows, hidden]`
    pub final_normed: D::Tensor,
    /// f32 `[rows, output_vocab_size]`
    pub logits: D::Tensor,
}

/// How many rows a buffer has: one per token of the step, or one per logits row.
#[derive(Clone, Copy)]
enum Per {
    Token,
    Row,
}

/// One buffer's precision, width and row kind.
#[derive(Clone, Copy)]
struct Spec(Precision, usize, Per);

/// Every buffer of [`Activations`], field for field.
struct Specs {
    residual: Spec,
    normed: Spec,
    pending: Spec,
    qkv: Spec,
    q: Spec,
    k: Spec,
    v: Spec,
    attn: Spec,
    o: Spec,
    gate_up: Spec,
    act: Spec,
    router_logits: Spec,
    shared_gate_up: Spec,
    shared_act: Spec,
    shared_out: Spec,
    shared_gate: Spec,
    last_residual: Spec,
    last_out: Spec,
    final_normed: Spec,
    logits: Spec,
}

impl Specs {
    fn of(cfg: &ModelConfig, splits_kv: bool) -> Specs {
        use Per::{Row, Token};
        use Precision::{Compute, F32};
        // What the layers' projections read, where FP8 GEMMs over per-token codes take them: a
        // device may keep the codes too.
        let fp8_inputs = cfg.quantization.is_some_and(|q| q.scales_whole_rows());
        let input = if fp8_inputs { Precision::ProjectionInput } else { Compute };
        let (h, q) = (cfg.hidden_size, cfg.q_size());
        let kv = cfg.kv_size();
        let split = if splits_kv { kv } else { 0 };
        let any_dense = (0..cfg.num_hidden_layers).any(|i| !cfg.layer_is_sparse(i));
        let inter = if any_dense { cfg.intermediate_size } else { 0 };
        let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
        let shared = cfg.moe.as_ref().and_then(|m| m.shared_expert_intermediate_size).unwrap_or(0);
        let shared_out = if shared > 0 { h } else { 0 };
        Specs {
            residual: Spec(F32, h, Token),
            normed: Spec(input, h, Token),
            pending: Spec(Compute, h, Token),
            qkv: Spec(Compute, q + 2 * kv, Token),
            q: Spec(Compute, q, Token),
            k: Spec(Compute, split, Token),
            v: Spec(Compute, split, Token),
            attn: Spec(Compute, q, Token),
            o: Spec(Compute, h, Token),
            gate_up: Spec(Compute, 2 * inter, Token),
            act: Spec(input, inter, Token),
            router_logits: Spec(F32, experts, Token),
            shared_gate_up: Spec(Compute, 2 * shared, Token),
            shared_act: Spec(input, shared, Token),
            shared_out: Spec(Compute, shared_out, Token),
            shared_gate: Spec(F32, usize::from(shared > 0), Token),
            last_residual: Spec(F32, h, Row),
            last_out: Spec(Compute, h, Row),
            // The LM head stays in the compute dtype (`--quantization fp8` leaves it, as vLLM does).
            final_normed: Spec(Compute, h, Row),
            logits: Spec(F32, cfg.output_vocab_size, Row),
        }
    }

    fn all(&self) -> [Spec; 20] {
        [
            self.residual,
            self.normed,
            self.pending,
            self.qkv,
            self.q,
            self.k,
            self.v,
            self.attn,
            self.o,
            self.gate_up,
            self.act,
            self.router_logits,
            self.shared_gate_up,
            self.shared_act,
            self.shared_out,
            self.shared_gate,
            self.last_residual,
            self.last_out,
            self.final_normed,
            self.logits,
        ]
    }
}

/// The routed experts' shape, in a MoE model.
fn moe_shape(cfg: &ModelConfig) -> Option<MoeShape> {
    cfg.moe.as_ref().map(|m| m.shape(cfg.hidden_size))
}

/// The capacity the buffers get for a step of `tokens` tokens and `rows` logits rows.
fn capacity(tokens: usize, rows: usize) -> (usize, usize) {
    (tokens.max(MIN_CAPACITY).next_power_of_two(), rows.max(MIN_CAPACITY).next_power_of_two())
}

impl<D: Device> Activations<D> {
    /// Buffers for steps of up to `tokens` tokens and `rows` logits rows (rounded up to powers
    /// of two).
    pub fn new(dev: &D, cfg: &ModelConfig, tokens: usize, rows: usize) -> Result<Activations<D>, D::Error> {
        let (tokens, rows) = capacity(tokens, rows);
        let s = Specs::of(cfg, dev.splits_kv(cfg.qk_norm, cfg.kv_cache_dtype));
        let make = |Spec(precision, cols, per): Spec| {
            let n = match per {
                Per::Token => tokens,
                Per::Row => rows,
            };
            dev.tensor(precision, n, cols)
        };
        Ok(Activations {
            tokens,
            rows,
            residual: make(s.residual)?,
            normed: make(s.normed)?,
            pending: make(s.pending)?,
            qkv: make(s.qkv)?,
            q: make(s.q)?,
            k: make(s.k)?,
            v: make(s.v)?,
            attn: make(s.attn)?,
            o: make(s.o)?,
            gate_up: make(s.gate_up)?,
            act: make(s.act)?,
            router_logits: make(s.router_logits)?,
            shared_gate_up: make(s.shared_gate_up)?,
            shared_act: make(s.shared_act)?,
            shared_out: make(s.shared_out)?,
            shared_gate: make(s.shared_gate)?,
            moe_scratch: moe_shape(cfg).map(|shape| dev.moe_scratch(tokens, shape)).transpose()?,
            last_residual: make(s.last_residual)?,
            last_out: make(s.last_out)?,
            final_normed: make(s.final_normed)?,
            logits: make(s.logits)?,
        })
    }

    /// Bytes [`Activations::new`] allocates on `dev` for these sizes.
    pub fn bytes(dev: &D, cfg: &ModelConfig, tokens: usize, rows: usize) -> usize {
        let (tokens, rows) = capacity(tokens, rows);
        let size = |Spec(precision, cols, per): Spec| {
            let n = match per {
                Per::Token => tokens,
                Per::Row => rows,
            };
            dev.tensor_bytes(precision, n, cols)
        };
        let buffers: usize =
            Specs::of(cfg, dev.splits_kv(cfg.qk_norm, cfg.kv_cache_dtype)).all().into_iter().map(size).sum();
        buffers + moe_shape(cfg).map_or(0, |shape| dev.moe_scratch_bytes(tokens, shape))
    }

    /// Makes room for a step of `tokens` tokens and `rows` logits rows. Returns whether the
    /// buffers moved (then every captured graph that uses them is stale).
    pub fn ensure(
        this: &mut Option<Activations<D>>,
        dev: &D,
        cfg: &ModelConfig,
        tokens: usize,
        rows: usize,
    ) -> Result<bool, D::Error> {
        if let Some(a) = this {
            // NOTE: the logits' width changes when a runner's output vocabulary is limited.
            if a.tokens >= tokens && a.rows >= rows && a.logits.cols() == cfg.output_vocab_size {
                return Ok(false);
            }
        }
        let (old_tokens, old_rows) = this.as_ref().map_or((0, 0), |a| (a.tokens, a.rows));
        // Free the old buffers first so that their memory can be reused.
        *this = None;
        *this = Some(Activations::new(dev, cfg, tokens.max(old_tokens), rows.max(old_rows))?);
        Ok(true)
    }

    /// Sets the rows every op of the next step sees.
    pub(crate) fn set_rows(&mut self, tokens: usize, rows: usize) {
        for t in [
            &mut self.residual,
            &mut self.normed,
            &mut self.pending,
            &mut self.qkv,
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.attn,
            &mut self.o,
            &mut self.gate_up,
            &mut self.act,
            &mut self.router_logits,
            &mut self.shared_gate_up,
            &mut self.shared_act,
            &mut self.shared_out,
            &mut self.shared_gate,
        ] {
            t.set_rows(tokens);
        }
        for t in [&mut self.last_residual, &mut self.last_out, &mut self.final_normed, &mut self.logits] {
            t.set_rows(rows);
        }
    }
}
