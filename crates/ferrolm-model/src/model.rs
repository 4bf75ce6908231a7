//! The model on the CPU: [`Model`] is the one decoder placed on [`Cpu`], with the conveniences
//! that tests and the CPU runner use.

use std::path::Path;

use ferrolm_backend::cpu::{AttentionMetadata, Cpu, CpuBatch};

use crate::activations::Activations;
use crate::config::ModelConfig;
use crate::decoder::{Decoder, StepRows};
use crate::input::{KvCache, ModelInput};
use crate::weights::WeightSource;
use crate::ModelError;

/// The decoder on the CPU: weights in host memory in their checkpoint dtype, f32 arithmetic.
pub type Model = Decoder<Cpu>;

impl Decoder<Cpu> {
    /// Loads a Hugging Face model directory (`config.json` + safetensors).
    pub fn from_dir(dir: &Path) -> Result<Model, ModelError> {
        if !dir.is_dir() {
            let source = std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory");
            return Err(ModelError::io(dir, source));
        }
        let config = ModelConfig::from_dir(dir)?;
        let src = WeightSource::open_dir(dir)?;
        Model::load(&Cpu::default(), config, &src)
    }

    /// A KV cache of `num_blocks` blocks of `block_size` tokens in every KV cache group.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> KvCache {
        let groups = self.config.kv_cache_groups().len();
        self.new_grouped_kv_cache(&vec![num_blocks; groups], block_size)
    }

    /// A KV cache of `num_blocks[g]` blocks of `block_size` tokens for the layers of KV cache
    /// group `g` ([`ModelConfig::kv_cache_groups`]); one count serves every group.
    pub fn new_grouped_kv_cache(&self, num_blocks: &[usize], block_size: usize) -> KvCache {
        let groups = self.config.kv_cache_groups().len();
        let num_blocks = if num_blocks.len() == 1 { vec![num_blocks[0]; groups] } else { num_blocks.to_vec() };
        let Ok(layers) = self.kv_cache(&Cpu::default(), &num_blocks, block_size);
        KvCache { num_blocks, block_size, kv_width: self.config.kv_size(), layers }
    }

    /// Runs one step with fresh activation buffers. Writes the new tokens' K/V into `kv` and
    /// returns the logits of the rows in `input.logits_indices`: `[logits_indices.len(), vocab]`.
    pub fn forward(&self, input: &ModelInput, kv: &mut KvCache) -> Vec<f32> {
        let mut acts = None;
        self.forward_with(input, kv, &mut acts).to_vec()
    }

    /// [`Self::forward`] into `acts`, reused from step to step; the logits stay there.
    pub(crate) fn forward_with<'a>(
        &self,
        input: &ModelInput,
        kv: &mut KvCache,
        acts: &'a mut Option<Activations<Cpu>>,
    ) -> &'a [f32] {
        let rows = input.step_rows();
        let Ok(_) = Activations::ensure(acts, &Cpu::default(), &self.config, rows.tokens, rows.logits);
        let acts = acts.as_mut().expect("activations were just ensured");
        let batches = cpu_batches(input, kv.block_size);
        acts.set_rows(rows.tokens, rows.logits);
        if rows.tokens > 0 {
            let Ok(()) = self.run(&Cpu::default(), &batches, rows, &mut kv.layers, acts);
        } else {
            // Nothing to run: no logits rows either.
            debug_assert_eq!(rows, StepRows { tokens: 0, logits: 0, identity: true });
        }
        acts.logits.as_slice()
    }
}

/// `input` as the CPU device reads it, once per KV cache group.
fn cpu_batches<'a>(input: &'a ModelInput, block_size: usize) -> Vec<CpuBatch<'a>> {
    let batch = |(block_tables, slot_mapping): (&'a Vec<u32>, &'a Vec<i64>)| CpuBatch {
        token_ids: &input.token_ids,
        positions: &input.positions,
        slot_mapping,
        logits_indices: &input.logits_indices,
        attention: AttentionMetadata {
            query_start_loc: &input.query_start_loc,
            seq_lens: &input.seq_lens,
            block_tables,
            max_blocks_per_seq: input.max_blocks_per_seq,
            block_size,
            // Set per layer by the decoder (`LayerAttention`).
            sliding_window: None,
            scale: 1.0,
            softcap: None,
        },
    };
    input.block_tables.iter().zip(&input.slot_mapping).map(batch).collect()
}
