//! What the engine runs each step: a model bound to its KV cache on one device.
//!
//! The engine owns one `Box<dyn ModelRunner>` and never sees device memory or logits: it hands
//! over the flattened batch and, per logits row, a [`RowRequest`] (sample the next token with
//! this `SamplePlan`, or give the logprobs of this prompt token), and gets back only the chosen
//! tokens and the logprobs asked for. The runner does the work where the logits are, with the
//! semantics of [`RowRequest::apply`] (ferrolm-sampling), so a GPU copies back a few bytes per
//! row instead of a vocabulary-sized one.

use std::collections::VecDeque;

use ferrolm_sampling::{OwnedRowRequest, RowRequest, TokenLogprobs, TokenMasks};
use rayon::prelude::*;

use ferrolm_backend::cpu::Cpu;

use crate::activations::Activations;
use crate::config::ModelConfig;
use crate::input::{KvCache, ModelInput};
use crate::model::Model;
use crate::ModelError;

/// A model with its KV cache on one device.
pub trait ModelRunner: Send {
    fn config(&self) -> &ModelConfig;

    /// Where it runs, for logs and reports: `cpu`, `cuda:0 (NVIDIA H200)`.
    fn device(&self) -> String;

    /// Allocates (or replaces) the KV cache: `num_blocks[g]` blocks of `block_size` tokens for
    /// the layers of KV cache group `g` ([`ModelConfig::kv_cache_groups`]); one count serves
    /// every group.
    fn allocate_kv_cache(&mut self, num_blocks: &[usize], block_size: usize) -> Result<(), ModelError>;

    /// Computes logits, from the next launch on, only for ids below `num_ids` (a tokenizer's
    /// size) where the model has more ([`ModelConfig::limit_output_vocab`]): ids a tokenizer
    /// cannot decode are then never sampled, nor among the logprobs.
    fn limit_output_vocab(&mut self, num_ids: usize);

    /// Starts one step, which writes the new tokens' K/V into the cache; [`Self::collect`] gives
    /// its answer. `rows` has one request per element of `input.logits_indices`. A step may be
    /// launched before the one launched just before it is collected (at most one ahead): its
    /// `input.previous_tokens` then name that step's sampled rows, and a device runs it right
    /// after that step while the host waits for the first answer. Without previous tokens, it
    /// is launched only when nothing is in flight.
    ///
    /// When a row's plan is `masked`, the step's sampling waits for [`Self::set_token_masks`]:
    /// the forward pass runs meanwhile, so the host computes the masks while the device works.
    fn launch(&mut self, input: &ModelInput, rows: &[RowRequest<'_>]) -> Result<(), ModelError>;

    /// The token masks of the last launched step's `masked` rows, in row order: exactly once
    /// after a launch with such rows, before the next launch and before collecting the step
    /// (the step before it may be collected meanwhile). A mask shorter than the vocabulary
    /// disallows the ids past it.
    fn set_token_masks(&mut self, masks: &TokenMasks) -> Result<(), ModelError>;

    /// The answer of the oldest launched step not yet collected: one entry per row, as
    /// [`RowRequest::apply`] gives it for that row's raw logits (`None` only for a `Sample` row
    /// where no token could be picked).
    fn collect(&mut self) -> Result<Vec<Option<TokenLogprobs>>, ModelError>;

    /// Runs one step with nothing in flight: [`Self::launch`], then [`Self::collect`].
    fn execute(
        &mut self,
        input: &ModelInput,
        rows: &[RowRequest<'_>],
    ) -> Result<Vec<Option<TokenLogprobs>>, ModelError> {
        self.launch(input, rows)?;
        self.collect()
    }

    /// [`Self::execute`] for a step with `masked` rows: launch, their masks, collect.
    fn execute_masked(
        &mut self,
        input: &ModelInput,
        rows: &[RowRequest<'_>],
        masks: &TokenMasks,
    ) -> Result<Vec<Option<TokenLogprobs>>, ModelError> {
        self.launch(input, rows)?;
        self.set_token_masks(masks)?;
        self.collect()
    }
}

/// Checks that `num_blocks` gives one count per KV cache group of `config`, or one for all.
pub(crate) fn check_kv_groups(config: &ModelConfig, num_blocks: &[usize]) -> Result<(), ModelError> {
    let groups = config.kv_cache_groups().len();
    if num_blocks.len() == 1 || num_blocks.len() == groups {
        Ok(())
    } else {
        Err(ModelError::Config(format!("KV cache sizes for {} groups, the model has {groups}", num_blocks.len())))
    }
}

/// The tokens a step's answers sampled, per logits row (the previous tokens of a step after it).
pub fn sampled_tokens(answers: &[Option<TokenLogprobs>]) -> Vec<Option<u32>> {
    answers.iter().map(|a| a.as_ref().map(|a| a.token)).collect()
}

/// [`RowRequest::apply_masked`] for every row of `logits`: `[rows.len(), vocab]`, rows in
/// parallel; `masks` has one row per `masked` row, in order.
///
/// # Panics
/// When `masks` has not one row per masked row.
pub fn apply_rows(
    logits: &[f32],
    vocab: usize,
    rows: &[RowRequest<'_>],
    masks: &TokenMasks,
) -> Vec<Option<TokenLogprobs>> {
    assert_eq!(
        logits.len(),
        rows.len() * vocab,
        "apply_rows: {} logits for {} rows of {vocab}",
        logits.len(),
        rows.len()
    );
    let mask_of = mask_rows(rows);
    let num_masked = mask_of.iter().flatten().count();
    assert_eq!(masks.num_rows(), num_masked, "apply_rows: {} masks for {num_masked} masked rows", masks.num_rows());
    logits
        .par_chunks_exact(vocab.max(1))
        .zip(rows)
        .zip(mask_of)
        .map(|((row, req), mask)| req.apply_masked(row, mask.map(|m| masks.row(m))))
        .collect()
}

/// Per row, the index of its mask among the step's masked rows.
pub fn mask_rows(rows: &[RowRequest<'_>]) -> Vec<Option<usize>> {
    let mut next = 0;
    rows.iter()
        .map(|r| {
            r.is_masked().then(|| {
                next += 1;
                next - 1
            })
        })
        .collect()
}

/// The CPU backend: f32 arithmetic, weights in their checkpoint dtype. A launch runs the step
/// at once; its answer waits in a queue for `collect`. A step with masked rows keeps its logits
/// until its masks come.
pub struct CpuRunner {
    model: Model,
    kv: Option<KvCache>,
    /// Reused by every step; `None` until the first.
    acts: Option<Activations<Cpu>>,
    answers: VecDeque<Vec<Option<TokenLogprobs>>>,
    /// The tokens the last launched step sampled, per logits row.
    last_sampled: Vec<Option<u32>>,
    /// The last launched step, while its masked rows wait for their masks.
    awaiting_masks: Option<AwaitingMasks>,
}

/// A step's logits and row requests, owned, until its masks come.
struct AwaitingMasks {
    // [rows, output_vocab_size]
    logits: Vec<f32>,
    rows: Vec<OwnedRowRequest>,
}

impl CpuRunner {
    pub fn new(model: Model) -> CpuRunner {
        CpuRunner {
            model,
            kv: None,
            acts: None,
            answers: VecDeque::new(),
            last_sampled: Vec::new(),
            awaiting_masks: None,
        }
    }

    /// Queues a launched step's answer.
    fn queue(&mut self, answers: Vec<Option<TokenLogprobs>>) {
        self.last_sampled = sampled_tokens(&answers);
        self.answers.push_back(answers);
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

    fn allocate_kv_cache(&mut self, num_blocks: &[usize], block_size: usize) -> Result<(), ModelError> {
        check_kv_groups(&self.model.config, num_blocks)?;
        self.kv = Some(self.model.new_grouped_kv_cache(num_blocks, block_size));
        Ok(())
    }

    fn limit_output_vocab(&mut self, num_ids: usize) {
        self.model.config.limit_output_vocab(num_ids);
    }

    fn launch(&mut self, input: &ModelInput, rows: &[RowRequest<'_>]) -> Result<(), ModelError> {
        assert_eq!(rows.len(), input.logits_indices.len(), "launch: {} requests for the logits rows", rows.len());
        assert!(self.awaiting_masks.is_none(), "launch: the step before still waits for its token masks");
        let kv = self.kv.as_mut().ok_or(ModelError::NoKvCache)?;
        let filled;
        let input = if input.previous_tokens.is_empty() {
            input
        } else {
            let mut copy = input.clone();
            copy.fill_previous_tokens(&self.last_sampled)?;
            filled = copy;
            &filled
        };
        let logits = self.model.forward_with(input, kv, &mut self.acts); // [rows, output_vocab_size]
        if rows.iter().any(RowRequest::is_masked) {
            let rows = rows.iter().map(OwnedRowRequest::of).collect();
            self.awaiting_masks = Some(AwaitingMasks { logits: logits.to_vec(), rows });
        } else {
            let answers = apply_rows(logits, self.model.config.output_vocab_size, rows, &TokenMasks::default());
            self.queue(answers);
        }
        Ok(())
    }

    fn set_token_masks(&mut self, masks: &TokenMasks) -> Result<(), ModelError> {
        let step = self.awaiting_masks.take().ok_or(ModelError::NothingLaunched)?;
        let rows: Vec<RowRequest<'_>> = step.rows.iter().map(OwnedRowRequest::borrow).collect();
        let answers = apply_rows(&step.logits, self.model.config.output_vocab_size, &rows, masks);
        self.queue(answers);
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<Option<TokenLogprobs>>, ModelError> {
        // NOTE: a step waiting for its masks has no answer queued yet: the oldest is another's.
        self.answers.pop_front().ok_or(ModelError::NothingLaunched)
    }
}

#[cfg(test)]
mod tests {
    use ferrolm_sampling::{token_logprobs, SamplePlan};

    use super::*;

    #[test]
    fn each_row_gets_its_own_request() {
        let logits = [1.0, 3.0, 2.0, f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY, 5.0, 4.0, 6.0];
        let greedy = SamplePlan::greedy(1);
        let rows =
            [RowRequest::Sample(&greedy), RowRequest::Sample(&greedy), RowRequest::Logprobs { token: 7, num_top: 2 }];
        let got = apply_rows(&logits, 3, &rows, &TokenMasks::default());
        assert_eq!(got[0], Some(token_logprobs(&logits[..3], 1, 1)));
        assert_eq!(got[1], None, "nothing to pick from a masked row");
        assert_eq!(got[2], Some(token_logprobs(&logits[6..], 7, 2)));
    }
}
