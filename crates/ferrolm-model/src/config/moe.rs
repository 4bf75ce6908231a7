//! The mixture-of-experts part of a config (Qwen2-MoE, Qwen3-MoE, Mixtral), read with HF's
//! defaults for the keys a `config.json` leaves out.
//!
//! Which layers are sparse is HF's rule ([`MoeConfig::layer_is_sparse`]); the others keep a
//! dense MLP of `intermediate_size`.

use ferrolm_backend::MoeShape;
use serde::Deserialize;
use serde_json::Value;

use super::Architecture;
use crate::ModelError;

/// The routed experts of a MoE model and where they sit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// Routed experts per sparse layer (`num_experts`, Mixtral's `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub num_experts_per_tok: usize,
    /// Renormalize the top-k routing weights to sum to one (Qwen's `norm_topk_prob`, false
    /// unless set; Mixtral always does).
    pub norm_topk_prob: bool,
    /// Each routed expert's intermediate size (Qwen's `moe_intermediate_size`; Mixtral's
    /// experts use `intermediate_size`).
    pub moe_intermediate_size: usize,
    /// Qwen2-MoE's shared expert beside the routed ones (a gated MLP of this size, scaled by a
    /// sigmoid gate); `None` for the others.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Every `decoder_sparse_step`-th layer is sparse (1: all of them).
    pub decoder_sparse_step: usize,
    /// Layers that keep a dense MLP whatever the step.
    pub mlp_only_layers: Vec<usize>,
}

/// The MoE keys of a `config.json`; unknown keys are ignored.
#[derive(Deserialize)]
struct RawMoe {
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    norm_topk_prob: Option<bool>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

impl MoeConfig {
    /// The MoE config of an `architecture` model from its `config.json` value; `None` for a
    /// dense family. Missing keys take the defaults of HF's config classes.
    pub(crate) fn from_value(
        architecture: Architecture,
        value: &Value,
        intermediate_size: usize,
    ) -> Result<Option<MoeConfig>, ModelError> {
        let raw = RawMoe::deserialize(value).map_err(|e| ModelError::Config(e.to_string()))?;
        let experts = raw.num_experts.or(raw.num_local_experts);
        let config = match architecture {
            Architecture::Mixtral => MoeConfig {
                num_experts: experts.unwrap_or(8),
                num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(2),
                norm_topk_prob: true,
                moe_intermediate_size: intermediate_size,
                shared_expert_intermediate_size: None,
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
            },
            Architecture::Qwen2Moe => MoeConfig {
                num_experts: experts.unwrap_or(60),
                num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(4),
                norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
                moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(1408),
                shared_expert_intermediate_size: Some(raw.shared_expert_intermediate_size.unwrap_or(5632)),
                decoder_sparse_step: raw.decoder_sparse_step.unwrap_or(1),
                mlp_only_layers: raw.mlp_only_layers.unwrap_or_default(),
            },
            Architecture::Qwen3Moe => MoeConfig {
                num_experts: experts.unwrap_or(128),
                num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(8),
                norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
                moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(768),
                shared_expert_intermediate_size: None,
                decoder_sparse_step: raw.decoder_sparse_step.unwrap_or(1),
                mlp_only_layers: raw.mlp_only_layers.unwrap_or_default(),
            },
            _ => return Ok(None),
        };
        config.check()?;
        Ok(Some(config))
    }

    fn check(&self) -> Result<(), ModelError> {
        let fail = |message: String| Err(ModelError::Config(message));
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return fail(format!(
                "num_experts_per_tok ({}) must be between 1 and the number of experts ({})",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if self.moe_intermediate_size == 0 {
            return fail("`moe_intermediate_size` must be positive".into());
        }
        if self.shared_expert_intermediate_size == Some(0) {
            return fail("`shared_expert_intermediate_size` must be positive".into());
        }
        if self.decoder_sparse_step == 0 {
            return fail("`decoder_sparse_step` must be positive".into());
        }
        Ok(())
    }

    /// HF's rule: layer `layer` routes through experts unless it is one of `mlp_only_layers`,
    /// and then when `(layer + 1) % decoder_sparse_step == 0`.
    pub fn layer_is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// The routed experts' shape in a model of `hidden` wide.
    pub fn shape(&self, hidden: usize) -> MoeShape {
        MoeShape {
            num_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            inter: self.moe_intermediate_size,
            hidden,
        }
    }

    /// Elements of one routed expert's matrices (gate, up, down) in a model `hidden` wide.
    pub fn expert_matrix_elements(&self, hidden: usize) -> usize {
        3 * hidden * self.moe_intermediate_size
    }

    /// Elements of one sparse layer's matrices besides its routed experts: the router and the
    /// shared expert with its gate.
    pub fn router_and_shared_elements(&self, hidden: usize) -> usize {
        let shared = self.shared_expert_intermediate_size.map_or(0, |inter| 3 * hidden * inter + hidden);
        self.num_experts * hidden + shared
    }

    /// The distinct experts a step of `tokens` tokens reads per sparse layer, expected under
    /// uniform routing: `E (1 - (1 - k / E)^B)` (each expert is missed by a token with
    /// probability `1 - k / E`). Exactly `k` at one token; at most `min(E, B k)`.
    pub fn expected_distinct_experts(&self, tokens: f64) -> f64 {
        let (e, k) = (self.num_experts as f64, self.num_experts_per_tok as f64);
        if tokens <= 1.0 {
            return k * tokens.max(0.0);
        }
        (e * (1.0 - (1.0 - k / e).powf(tokens))).min(tokens * k)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn qwen(extra: Value) -> MoeConfig {
        let mut v = json!({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16});
        v.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        MoeConfig::from_value(Architecture::Qwen3Moe, &v, 64).expect("valid").expect("moe")
    }

    #[test]
    fn sparse_layers_follow_hf_rule() {
        let every = qwen(json!({}));
        assert!((0..4).all(|i| every.layer_is_sparse(i)));
        let step2 = qwen(json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]}));
        let sparse: Vec<usize> = (0..6).filter(|&i| step2.layer_is_sparse(i)).collect();
        assert_eq!(sparse, [1, 5]);
        let only = qwen(json!({"mlp_only_layers": [0, 2]}));
        assert_eq!((0..4).filter(|&i| only.layer_is_sparse(i)).collect::<Vec<_>>(), [1, 3]);
        let none = MoeConfig { num_experts: 0, ..every };
        assert!(!none.layer_is_sparse(0));
    }

    #[test]
    fn defaults_and_key_spellings_are_hf_s() -> Result<(), ModelError> {
        let v = json!({"num_local_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": false});
        let mixtral = MoeConfig::from_value(Architecture::Mixtral, &v, 96)?.expect("moe");
        assert_eq!((mixtral.num_experts, mixtral.moe_intermediate_size), (6, 96));
        assert!(mixtral.norm_topk_prob, "Mixtral always renormalizes");
        let qwen3 = MoeConfig::from_value(Architecture::Qwen3Moe, &json!({}), 1)?.expect("moe");
        assert_eq!((qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size), (128, 8, 768));
        assert!(!qwen3.norm_topk_prob && qwen3.shared_expert_intermediate_size.is_none());
        let qwen2 = MoeConfig::from_value(Architecture::Qwen2Moe, &json!({"num_experts": 4}), 1)?.expect("moe");
        assert_eq!((qwen2.num_experts, qwen2.shared_expert_intermediate_size), (4, Some(5632)));
        assert!(MoeConfig::from_value(Architecture::Llama, &json!({"num_experts": 4}), 1)?.is_none());
        Ok(())
    }

    #[test]
    fn impossible_routing_is_refused() {
        for bad in
            [json!({"num_experts_per_tok": 9}), json!({"num_experts_per_tok": 0}), json!({"decoder_sparse_step": 0})]
        {
            let mut v = json!({"num_experts": 8, "num_experts_per_tok": 2});
            v.as_object_mut().expect("object").extend(bad.as_object().expect("object").clone());
            let err = MoeConfig::from_value(Architecture::Qwen3Moe, &v, 1).expect_err("refused").to_string();
            assert!(err.contains("num_experts_per_tok") || err.contains("decoder_sparse_step"), "{err}");
        }
    }

    #[test]
    fn distinct_experts_grow_from_k_to_e() {
        let c = MoeConfig { num_experts: 8, num_experts_per_tok: 2, ..qwen(json!({})) };
        assert_eq!(c.expected_distinct_experts(1.0), 2.0);
        // Two tokens: 8 (1 - (3/4)^2) = 3.5 experts, fewer than the 4 picks.
        assert!((c.expected_distinct_experts(2.0) - 3.5).abs() < 1e-12);
        assert!((c.expected_distinct_experts(1000.0) - 8.0).abs() < 1e-9);
        let every = MoeConfig { num_experts_per_tok: 8, ..c };
        assert_eq!(every.expected_distinct_experts(3.0), 8.0);
    }
}
