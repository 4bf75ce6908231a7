//! KV cache groups: which layers share one set of block tables.
//!
//! Layers that attend over the same keys can share block tables: the layers without a window form
//! one group, the layers of each window another. A model without sliding layers has exactly one
//! group, the full-attention one; Mistral-style models (every layer slides) one sliding group;
//! Gemma 2/3 a full group and a sliding one. Groups are ordered full attention first, then by
//! window. The engine gives each group a block pool of its own and each request a table per
//! group (ferrolm-engine's `kv::group`); the batch carries every group's tables
//! ([`crate::ModelInput`]), each layer's cache is sized by its group's blocks, and each layer
//! reads its group's ([`ferrolm_backend::LayerAttention::kv_group`]).

use ferrolm_backend::DType;

use crate::config::ModelConfig;

/// The layers of one KV cache group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCacheGroup {
    /// The window every layer of the group attends through; `None`: full attention.
    pub sliding_window: Option<usize>,
    /// Ascending layer indices.
    pub layers: Vec<usize>,
}

impl KvCacheGroup {
    /// Bytes of one block of `block_size` tokens over the group's layers, K and V, on a device
    /// that computes in `dtype` (the cache's element is `config.kv_cache_dtype`'s).
    pub fn kv_bytes_per_block(&self, config: &ModelConfig, block_size: usize, dtype: DType) -> usize {
        self.layers.len() * 2 * block_size * config.kv_size() * config.kv_cache_dtype.size_in_bytes(dtype)
    }
}

impl ModelConfig {
    /// The model's KV cache groups: full attention first (also for a model without layers),
    /// then one group per window, narrowest first.
    pub fn kv_cache_groups(&self) -> Vec<KvCacheGroup> {
        let windows: Vec<Option<usize>> = (0..self.num_hidden_layers).map(|l| self.layer_window(l)).collect();
        let mut distinct: Vec<Option<usize>> = windows.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.is_empty() {
            distinct.push(None);
        }
        distinct
            .into_iter()
            .map(|w| KvCacheGroup {
                sliding_window: w,
                layers: (0..windows.len()).filter(|&l| windows[l] == w).collect(),
            })
            .collect()
    }

    /// The window of each KV cache group ([`Self::kv_cache_groups`]), in order.
    pub fn kv_cache_windows(&self) -> Vec<Option<usize>> {
        self.kv_cache_groups().iter().map(|g| g.sliding_window).collect()
    }

    /// The KV cache group of layer `layer`.
    pub fn kv_cache_group_of(&self, layer: usize) -> usize {
        let window = self.layer_window(layer);
        self.kv_cache_windows().iter().position(|&w| w == window).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::ModelError;

    fn config(sliding_window: Option<usize>) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_value(json!({
            "architectures": ["MistralForCausalLM"], "vocab_size": 320, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "sliding_window": sliding_window,
        }))
    }

    #[test]
    fn layers_group_by_window_full_attention_first() -> Result<(), ModelError> {
        let full = config(None)?;
        assert_eq!(full.kv_cache_groups(), vec![KvCacheGroup { sliding_window: None, layers: vec![0, 1, 2, 3] }]);
        let all = config(Some(24))?;
        assert_eq!(all.kv_cache_groups(), vec![KvCacheGroup { sliding_window: Some(24), layers: vec![0, 1, 2, 3] }]);
        assert_eq!(all.layer_attention(2).kv_group, 0);

        let mut hybrid = config(Some(24))?;
        hybrid.sliding_layers = vec![true, false, true, false];
        let groups = hybrid.kv_cache_groups();
        assert_eq!(
            groups,
            vec![
                KvCacheGroup { sliding_window: None, layers: vec![1, 3] },
                KvCacheGroup { sliding_window: Some(24), layers: vec![0, 2] },
            ]
        );
        assert_eq!(hybrid.kv_cache_windows(), vec![None, Some(24)]);
        let of: Vec<usize> = (0..4).map(|l| hybrid.layer_attention(l).kv_group).collect();
        assert_eq!(of, vec![1, 0, 1, 0]);
        // Two layers, K and V, 16 tokens of 2 heads of 16 in f32.
        assert_eq!(groups[1].kv_bytes_per_block(&hybrid, 16, DType::F32), 2 * 2 * 16 * 32 * 4);
        Ok(())
    }
}
