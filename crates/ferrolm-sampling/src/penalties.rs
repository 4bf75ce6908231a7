//! Penalties over the tokens a request has already seen, applied to its logits row
//! before anything else (vLLM's order: repetition, then frequency, then presence).
//!
//! - repetition (Hugging Face / vLLM): every token of the prompt or the output so far,
//!   counted once: `l > 0 ? l / p : l * p`.
//! - frequency and presence (OpenAI): output tokens only,
//!   `l -= frequency * count; l -= presence * (count > 0)`.
//!
//! The state is sparse (one [`TokenAdjust`] per token some penalty touches, kept up to date as
//! tokens are generated) so a request costs memory in the tokens it saw, not in the vocabulary,
//! and each step's plan copies the list as it is. Ids outside the logits row are skipped by
//! whoever applies the list, never indexed.

use std::collections::HashMap;

use crate::plan::TokenAdjust;

/// What a request has seen, and how hard to push back on it.
#[derive(Debug, Clone)]
pub(crate) struct Penalties {
    pub(crate) repetition: f32,
    pub(crate) presence: f32,
    pub(crate) frequency: f32,
    /// One entry per token a penalty touches: every distinct prompt id while the repetition
    /// penalty is on, every output id while any penalty is on. `mask` is always false here.
    adjusts: Vec<TokenAdjust>,
    /// Token id -> its entry in `adjusts`.
    index: HashMap<u32, usize>,
}

impl Penalties {
    pub(crate) fn new(repetition: f32, presence: f32, frequency: f32, prompt: &[u32]) -> Self {
        let mut p = Self { repetition, presence, frequency, adjusts: Vec::new(), index: HashMap::new() };
        if repetition != 1.0 {
            for &token in prompt {
                p.entry(token);
            }
        }
        p
    }

    /// Whether no entry changes any score.
    pub(crate) fn is_off(&self) -> bool {
        self.repetition == 1.0 && self.presence == 0.0 && self.frequency == 0.0
    }

    pub(crate) fn record(&mut self, token: u32) {
        if self.is_off() {
            return;
        }
        let i = self.entry(token);
        self.adjusts[i].output_count += 1;
    }

    /// The entries, in the order tokens were first seen.
    pub(crate) fn adjusts(&self) -> &[TokenAdjust] {
        &self.adjusts
    }

    /// Index of `token`'s entry in [`Self::adjusts`].
    pub(crate) fn position(&self, token: u32) -> Option<usize> {
        self.index.get(&token).copied()
    }

    fn entry(&mut self, token: u32) -> usize {
        let repetition = self.repetition != 1.0;
        let adjusts = &mut self.adjusts;
        *self.index.entry(token).or_insert_with(|| {
            adjusts.push(TokenAdjust { token, repetition, ..TokenAdjust::default() });
            adjusts.len() - 1
        })
    }
}

/// `l` after the penalties `a` calls for: repetition, then frequency and presence for output
/// tokens. Two roundings each for the latter, as vLLM's in-place updates.
pub(crate) fn penalize(mut l: f32, a: &TokenAdjust, repetition: f32, frequency: f32, presence: f32) -> f32 {
    if a.repetition {
        l = if l > 0.0 { l / repetition } else { l * repetition };
    }
    if a.output_count > 0 && (frequency != 0.0 || presence != 0.0) {
        l -= frequency * a.output_count as f32;
        l -= presence;
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The penalties applied to a whole row, as a plan does.
    fn apply(p: &Penalties, scores: &mut [f32]) {
        for a in p.adjusts() {
            if let Some(l) = scores.get_mut(a.token as usize) {
                *l = penalize(*l, a, p.repetition, p.frequency, p.presence);
            }
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        // prompt has 0 and 1 (twice); output has 1 and 2; token 3 is unseen.
        let mut p = Penalties::new(2.0, 0.0, 0.0, &[0, 1, 1, 99_999]);
        p.record(1);
        p.record(2);
        let mut scores = [4.0, -3.0, 1.5, 5.0];
        apply(&p, &mut scores);
        // each seen token penalized exactly once, however often it was seen
        assert_eq!(scores, [2.0, -6.0, 0.75, 5.0]);
        assert_eq!(p.adjusts().len(), 4, "one entry per distinct token");
    }

    #[test]
    fn frequency_and_presence_penalties_follow_openai() {
        let mut p = Penalties::new(1.0, 0.5, 0.25, &[3]);
        for t in [0, 0, 0, 2] {
            p.record(t);
        }
        let mut scores = [1.0, 1.0, 1.0, 1.0];
        apply(&p, &mut scores);
        // token 0: 1 - 0.25*3 - 0.5; token 2: 1 - 0.25 - 0.5; prompt-only token 3 untouched
        assert_eq!(scores, [-0.25, 1.0, 0.25, 1.0]);
    }

    #[test]
    fn repetition_applies_before_frequency_and_presence() {
        let mut p = Penalties::new(2.0, 1.0, 1.0, &[]);
        p.record(0);
        p.record(0);
        let mut scores = [6.0, -2.0];
        apply(&p, &mut scores);
        // 6 / 2 - 1*2 - 1 = 0
        assert_eq!(scores, [0.0, -2.0]);
    }

    #[test]
    fn negative_penalties_encourage_and_out_of_row_ids_are_skipped() {
        let mut p = Penalties::new(0.5, -1.0, 0.0, &[7]);
        p.record(1);
        p.record(42);
        let mut scores = [1.0, 1.0, -1.0];
        apply(&p, &mut scores);
        assert_eq!(scores, [1.0, 3.0, -1.0]);
    }

    #[test]
    fn no_entries_while_every_penalty_is_off() {
        let mut p = Penalties::new(1.0, 0.0, 0.0, &[1, 2, 3]);
        p.record(4);
        assert!(p.is_off());
        assert!(p.adjusts().is_empty());
    }
}
