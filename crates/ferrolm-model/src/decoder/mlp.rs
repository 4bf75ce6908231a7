//! A decoder layer's MLP: dense (one gate/up GEMM, the gated activation, down), or a mixture of
//! experts (a router into f32 logits, the routed experts in one device op, and Qwen2-MoE's
//! shared expert scaled by its sigmoid gate), with each family's checkpoint names.
//!
//! Every form reads the post-attention normed rows (`Activations::normed`) and overwrites the
//! layer's output (`Activations::pending`). Which layers are sparse is the config's
//! ([`ModelConfig::layer_is_sparse`]); a dense layer of a MoE model is an ordinary
//! `mlp.{gate,up,down}_proj` of `intermediate_size`.

use ferrolm_backend::{Device, Experts, GatedActivation, Linear, MoeInput};

use super::matrices::{Part, Role};
use super::Loader;
use crate::activations::Activations;
use crate::config::{Architecture, ModelConfig, MoeConfig};
use crate::ModelError;

/// One layer's MLP on device `D`.
pub enum Mlp<D: Device> {
    Dense {
        /// `[2 * intermediate, hidden]`: gate rows, then up rows.
        gate_up_proj: Linear<D>,
        /// `[hidden, intermediate]`
        down_proj: Linear<D>,
    },
    /// Boxed: far larger than the dense form.
    Moe(Box<SparseMoe<D>>),
}

/// A sparse layer's MLP: the router, the routed experts, and the shared expert if the family
/// has one.
pub struct SparseMoe<D: Device> {
    /// `[num_experts, hidden]`, computed into f32 logits.
    gate: Linear<D>,
    experts: Experts<D>,
    shared_expert: Option<SharedExpert<D>>,
}

/// Qwen2-MoE's shared expert: a gated MLP every token goes through, scaled by
/// `sigmoid(shared_expert_gate x)`.
pub struct SharedExpert<D: Device> {
    /// `[2 * shared_intermediate, hidden]`: gate rows, then up rows.
    gate_up_proj: Linear<D>,
    /// `[hidden, shared_intermediate]`
    down_proj: Linear<D>,
    /// `[1, hidden]`, computed into an f32 `[T, 1]`.
    gate: Linear<D>,
}

impl<D: Device> Mlp<D> {
    /// `a.pending = mlp(a.normed)`.
    pub(crate) fn forward(
        &self,
        dev: &D,
        batch: &D::Batch<'_>,
        act: GatedActivation,
        a: &mut Activations<D>,
    ) -> Result<(), D::Error> {
        match self {
            Mlp::Dense { gate_up_proj, down_proj } => {
                dev.gated_mlp(&a.normed, gate_up_proj, act, &mut a.gate_up, &mut a.act)?;
                dev.linear(&a.act, down_proj, &mut a.pending)
            }
            Mlp::Moe(moe) => {
                dev.linear(&a.normed, &moe.gate, &mut a.router_logits)?;
                let scratch = a.moe_scratch.as_mut().expect("the activations of a MoE model hold a MoE scratch");
                let input = MoeInput {
                    x: &a.normed,
                    router_logits: &a.router_logits,
                    experts: &moe.experts,
                    scratch,
                    out: &mut a.pending,
                };
                dev.moe(batch, input)?;
                if let Some(shared) = &moe.shared_expert {
                    dev.gated_mlp(&a.normed, &shared.gate_up_proj, act, &mut a.shared_gate_up, &mut a.shared_act)?;
                    dev.linear(&a.shared_act, &shared.down_proj, &mut a.shared_out)?;
                    dev.linear(&a.normed, &shared.gate, &mut a.shared_gate)?;
                    dev.add_sigmoid_gated(&mut a.pending, &a.shared_out, &a.shared_gate)?;
                }
                Ok(())
            }
        }
    }

    /// Every weight matrix of the MLP (for the bytes a model holds).
    pub(crate) fn matrices(&self) -> Vec<&D::Matrix> {
        match self {
            Mlp::Dense { gate_up_proj, down_proj } => vec![&gate_up_proj.weight, &down_proj.weight],
            Mlp::Moe(moe) => {
                let mut all = vec![&moe.gate.weight, &moe.experts.gate_up, &moe.experts.down];
                if let Some(s) = &moe.shared_expert {
                    all.extend([&s.gate_up_proj.weight, &s.down_proj.weight, &s.gate.weight]);
                }
                all
            }
        }
    }

    /// The projections whose output is in the compute dtype, as GEMM tuning times them: the
    /// dense gate/up and down, or the shared expert's (a router's f32 logits and the routed
    /// experts' grouped products are not plain projections).
    pub(crate) fn projections(&self) -> Vec<&Linear<D>> {
        match self {
            Mlp::Dense { gate_up_proj, down_proj } => vec![gate_up_proj, down_proj],
            Mlp::Moe(moe) => moe.shared_expert.iter().flat_map(|s| [&s.gate_up_proj, &s.down_proj]).collect(),
        }
    }
}

impl<D: Device> Loader<'_, D>
where
    ModelError: From<D::Error>,
{
    /// Layer `i`'s MLP under prefix `p` (`model.layers.{i}`).
    pub(super) fn mlp(&self, i: usize, p: &str) -> Result<Mlp<D>, ModelError> {
        let cfg = self.cfg;
        match &cfg.moe {
            Some(moe) if moe.layer_is_sparse(i) => Ok(Mlp::Moe(Box::new(self.sparse_moe(p, moe)?))),
            _ => self.dense_mlp(p, cfg),
        }
    }

    fn dense_mlp(&self, p: &str, cfg: &ModelConfig) -> Result<Mlp<D>, ModelError> {
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let gate_up_proj = if cfg.fused_projections {
            self.linear(&[(format!("{p}.mlp.gate_up_proj"), 2 * inter)], h, cfg.mlp_bias, Role::Projection)?
        } else {
            let gate_up = [("gate_proj", inter), ("up_proj", inter)].map(|(n, o)| (format!("{p}.mlp.{n}"), o));
            self.linear(&gate_up, h, cfg.mlp_bias, Role::Projection)?
        };
        let down_proj = self.linear(&[(format!("{p}.mlp.down_proj"), h)], inter, cfg.mlp_bias, Role::Projection)?;
        Ok(Mlp::Dense { gate_up_proj, down_proj })
    }

    /// Mixtral: `block_sparse_moe.gate` and `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up,
    /// down); Qwen: `mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`, and Qwen2-MoE's
    /// `mlp.shared_expert.*` with `mlp.shared_expert_gate`.
    fn sparse_moe(&self, p: &str, moe: &MoeConfig) -> Result<SparseMoe<D>, ModelError> {
        let cfg = self.cfg;
        let (h, inter, e) = (cfg.hidden_size, moe.moe_intermediate_size, moe.num_experts);
        let (block, [gate_name, up_name, down_name]) = match cfg.architecture {
            Architecture::Mixtral => (format!("{p}.block_sparse_moe"), ["w1", "w3", "w2"]),
            _ => (format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"]),
        };
        let gate = self.linear(&[(format!("{block}.gate"), e)], h, false, Role::AsStored)?;
        let (mut gate_up, mut down): (Vec<Part>, Vec<Part>) = (Vec::with_capacity(2 * e), Vec::with_capacity(e));
        for x in 0..e {
            let expert = format!("{block}.experts.{x}");
            gate_up.push((format!("{expert}.{gate_name}"), [inter, h]));
            gate_up.push((format!("{expert}.{up_name}"), [inter, h]));
            down.push((format!("{expert}.{down_name}"), [h, inter]));
        }
        let experts = Experts {
            gate_up: self.matrix(&gate_up, Role::Experts)?,
            down: self.matrix(&down, Role::Experts)?,
            num_experts: e,
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
            inter,
            hidden: h,
            activation: cfg.activation,
        };
        let shared_expert = match moe.shared_expert_intermediate_size {
            Some(si) => {
                let s = format!("{block}.shared_expert");
                Some(SharedExpert {
                    gate_up_proj: self.linear(
                        &[(format!("{s}.gate_proj"), si), (format!("{s}.up_proj"), si)],
                        h,
                        false,
                        Role::Projection,
                    )?,
                    down_proj: self.linear(&[(format!("{s}.down_proj"), h)], si, false, Role::Projection)?,
                    gate: self.linear(&[(format!("{block}.shared_expert_gate"), 1)], h, false, Role::AsStored)?,
                })
            }
            None => None,
        };
        Ok(SparseMoe { gate, experts, shared_expert })
    }
}
