//! What the engine runs each step: a model bound to its KV cache on one device.
//!
//! The engine owns one `Box<dyn ModelRunner>` and never sees device memory: it hands over the
//! flattened batch and gets back, per requested logits row, either the row itself (on the host,
//! for the CPU sampler and logprobs) or, where the engine says the argmax is all it needs, the
//! argmax token and its logprob, picked where the logits live (so a GPU copies back a few bytes
//! per sequence instead of a vocabulary-sized row).

use crate::config::ModelConfig;
use crate::input::{KvCache, ModelInput};
use crate::model::Model;
use crate::ModelError;

/// One logits row of a step's output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowLogits<'a> {
    /// `[vocab]`: the raw logits.
    Full(&'a [f32]),
    /// The argmax of the raw logits (lowest id on ties, NaN and -inf skipped) and its
    /// log-softmax value; `None` when every logit was NaN or -inf.
    Argmax { token: Option<u32>, logprob: f32 },
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum RowSlot {
    /// Row index into [`StepLogits::full`].
    Full(usize),
    Argmax {
        token: Option<u32>,
        logprob: f32,
    },
}

/// The logits of one step, one entry per element of `ModelInput::logits_indices`.
#[derive(Clone, Debug, Default)]
pub struct StepLogits {
    vocab: usize,
    /// `[num_full_rows, vocab]`
    full: Vec<f32>,
    rows: Vec<RowSlot>,
}

impl StepLogits {
    /// Every row in full: `logits` is `[rows, vocab]`.
    pub fn from_full(logits: Vec<f32>, vocab: usize) -> StepLogits {
        assert!(
            vocab > 0 && logits.len().is_multiple_of(vocab),
            "StepLogits: {} logits are not rows of {vocab}",
            logits.len()
        );
        let rows = (0..logits.len() / vocab).map(RowSlot::Full).collect();
        StepLogits { vocab, full: logits, rows }
    }

    /// An empty set of rows, to be filled in order with [`Self::push_full`] / [`Self::push_argmax`].
    pub fn with_vocab(vocab: usize) -> StepLogits {
        StepLogits { vocab, full: Vec::new(), rows: Vec::new() }
    }

    pub fn push_full(&mut self, row: &[f32]) {
        assert_eq!(row.len(), self.vocab, "StepLogits::push_full: row length");
        self.rows.push(RowSlot::Full(self.full.len() / self.vocab));
        self.full.extend_from_slice(row);
    }

    pub fn push_argmax(&mut self, token: Option<u32>, logprob: f32) {
        self.rows.push(RowSlot::Argmax { token, logprob });
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn row(&self, i: usize) -> RowLogits<'_> {
        match self.rows[i] {
            RowSlot::Full(r) => RowLogits::Full(&self.full[r * self.vocab..(r + 1) * self.vocab]),
            RowSlot::Argmax { token, logprob } => RowLogits::Argmax { token, logprob },
        }
    }
}

/// A model with its KV cache on one device.
pub trait ModelRunner: Send {
    fn config(&self) -> &ModelConfig;

    /// Where it runs, for logs and reports: `cpu`, `cuda:0 (NVIDIA H200)`.
    fn device(&self) -> String;

    /// Allocates (or replaces) the KV cache: `num_blocks` blocks of `block_size` tokens.
    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), ModelError>;

    /// Runs one step, writing the new tokens' K/V into the cache. Returns one row per element of
    /// `input.logits_indices`; where `argmax_only[i]` is true the runner may return
    /// [`RowLogits::Argmax`] instead of the full row.
    fn execute(&mut self, input: &ModelInput, argmax_only: &[bool]) -> Result<StepLogits, ModelError>;
}

/// The CPU backend: f32 arithmetic, weights in their checkpoint dtype.
pub struct CpuRunner {
    model: Model,
    kv: Option<KvCache>,
}

impl CpuRunner {
    pub fn new(model: Model) -> CpuRunner {
        CpuRunner { model, kv: None }
    }
}

impl From<Model> for Box<dyn ModelRunner> {
    fn from(model: Model) -> Box<dyn ModelRunner> {
        Box::new(CpuRunner::new(model))
    }
}

impl ModelRunner for CpuRunner {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn device(&self) -> String {
        "cpu".into()
    }

    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), ModelError> {
        self.kv = Some(self.model.new_kv_cache(num_blocks, block_size));
        Ok(())
    }

    fn execute(&mut self, input: &ModelInput, _argmax_only: &[bool]) -> Result<StepLogits, ModelError> {
        let kv = self.kv.as_mut().ok_or_else(|| ModelError::Device("execute before allocate_kv_cache".into()))?;
        // The sampler's argmax over the full row costs as much as any device-side pick here.
        let logits = self.model.forward(input, kv);
        Ok(StepLogits::from_full(logits, self.model.config.vocab_size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_keep_their_order_and_kind() {
        let mut s = StepLogits::with_vocab(3);
        s.push_argmax(Some(2), -0.5);
        s.push_full(&[1.0, 2.0, 3.0]);
        s.push_argmax(None, f32::NEG_INFINITY);
        s.push_full(&[4.0, 5.0, 6.0]);
        assert_eq!(s.len(), 4);
        assert_eq!(s.row(0), RowLogits::Argmax { token: Some(2), logprob: -0.5 });
        assert_eq!(s.row(1), RowLogits::Full(&[1.0, 2.0, 3.0]));
        assert_eq!(s.row(2), RowLogits::Argmax { token: None, logprob: f32::NEG_INFINITY });
        assert_eq!(s.row(3), RowLogits::Full(&[4.0, 5.0, 6.0]));
        let full = StepLogits::from_full(vec![0.0, 1.0, 2.0, 3.0], 2);
        assert_eq!(full.row(1), RowLogits::Full(&[2.0, 3.0]));
    }
}
