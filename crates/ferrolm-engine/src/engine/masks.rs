//! Token masks of grammar-constrained sequences: computed on the worker pool, one per masked
//! row of a launched step, and handed to the runner, which samples the step with them.
//!
//! A masked row's mask depends on every token before it, so a step launched ahead gets its
//! masks only after the step before is collected and its tokens advanced into their grammars;
//! the runner runs the forward pass meanwhile, so the masks cost the device nothing as long as
//! they take less than a forward pass. Unconstrained steps never come here.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use ferrolm_sampling::TokenMasks;
use ferrolm_structured::StructuredError;
use rayon::prelude::*;

use super::core::Engine;
use super::launch::Launched;
use crate::request::{FinishReason, RequestId};

impl Engine {
    /// Computes and sets `launched`'s token masks, once; a sequence whose grammar fails is
    /// aborted (its row samples from anything, and its answer is dropped).
    pub(super) fn set_token_masks(&mut self, launched: &mut Launched) {
        if launched.masked.is_empty() || launched.masks_set {
            return;
        }
        launched.masks_set = true;
        let started = Instant::now();
        let words = TokenMasks::words_for(self.runner.config().output_vocab_size);
        // Reused from step to step: every row is written in full below.
        let mut masks = std::mem::take(&mut self.masks);
        masks.reshape(launched.masked.len(), words);
        let failed = self.fill_masks(&launched.masked, &mut masks);
        let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.stats.masked_steps.fetch_add(1, Ordering::Relaxed);
        self.stats.mask_us.fetch_add(micros, Ordering::Relaxed);
        let set = self.runner.set_token_masks(&masks);
        self.masks = masks;
        if let Err(err) = set {
            launched.masks_failed = true;
            self.abort_step(&launched.out, &err.to_string());
            return;
        }
        for (id, err) in failed {
            tracing::error!(request = %id, %err, "engine fault: the grammar failed to give a token mask");
            self.scheduler.finish_request(id, FinishReason::Abort);
            self.send_final(id, FinishReason::Abort);
        }
    }

    /// Fills one mask per id of `masked` (`masks`' rows, in order) in parallel; a row whose
    /// sequence is gone (finished by the step before) allows every token. Returns the sequences
    /// whose grammar failed.
    fn fill_masks(&mut self, masked: &[RequestId], masks: &mut TokenMasks) -> Vec<(RequestId, StructuredError)> {
        let row_of: HashMap<RequestId, usize> = masked.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let words = masks.words;
        let mut rows: Vec<Option<&mut [u32]>> = masks.data.chunks_mut(words.max(1)).map(Some).collect();
        let mut jobs = Vec::with_capacity(masked.len());
        for (id, seq) in &mut self.sequences {
            let (Some(&row), Some(constraint)) = (row_of.get(id), seq.constraint.as_mut()) else { continue };
            if let Some(mask) = rows[row].take() {
                jobs.push((*id, constraint, mask));
            }
        }
        for gone in rows.into_iter().flatten() {
            gone.fill(u32::MAX);
        }
        jobs.into_par_iter()
            .filter_map(|(id, constraint, mask)| {
                let failed = constraint.fill_mask(mask).err();
                if failed.is_some() {
                    mask.fill(u32::MAX);
                }
                failed.map(|err| (id, err))
            })
            .collect()
    }
}
