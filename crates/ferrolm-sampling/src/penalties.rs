//! Penalties over the tokens a request has already seen, applied to its logits row
//! before anything else (vLLM's order: repetition, then frequency, then presence).
//!
//! - repetition (Hugging Face / vLLM): every token of the prompt or the output so far,
//!   counted once: `l > 0 ? l / p : l * p`.
//! - frequency and presence (OpenAI): output tokens only,
//!   `l -= frequency * count; l -= presence * (count > 0)`.
//!
//! The state is sparse (a set of prompt ids, a map of output counts) so a request costs
//! memory in the tokens it saw, not in the vocabulary. Ids outside the logits row are
//! skipped, never indexed.

use std::collections::{HashMap, HashSet};

/// What a request has seen, and how hard to push back on it.
#[derive(Debug, Clone)]
pub(crate) struct Penalties {
    repetition: f32,
    presence: f32,
    frequency: f32,
    /// Distinct prompt ids; left empty when the repetition penalty is off.
    prompt_tokens: HashSet<u32>,
    /// Output token id -> times generated.
    output_counts: HashMap<u32, u32>,
}

impl Penalties {
    pub(crate) fn new(repetition: f32, presence: f32, frequency: f32, prompt: &[u32]) -> Self {
        let prompt_tokens = if repetition != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Self { repetition, presence, frequency, prompt_tokens, output_counts: HashMap::new() }
    }

    /// Whether [`Penalties::apply`] leaves every score as it is.
    pub(crate) fn is_off(&self) -> bool {
        self.repetition == 1.0 && self.presence == 0.0 && self.frequency == 0.0
    }

    pub(crate) fn record(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    // scores: [vocab]
    pub(crate) fn apply(&self, scores: &mut [f32]) {
        if self.repetition != 1.0 {
            let p = self.repetition;
            let penalize = |l: f32| if l > 0.0 { l / p } else { l * p };
            for &t in &self.prompt_tokens {
                if let Some(l) = scores.get_mut(t as usize) {
                    *l = penalize(*l);
                }
            }
            for &t in self.output_counts.keys() {
                if self.prompt_tokens.contains(&t) {
                    continue; // penalized once above
                }
                if let Some(l) = scores.get_mut(t as usize) {
                    *l = penalize(*l);
                }
            }
        }
        if self.frequency != 0.0 || self.presence != 0.0 {
            for (&t, &count) in &self.output_counts {
                if let Some(l) = scores.get_mut(t as usize) {
                    *l -= self.frequency * count as f32;
                    *l -= self.presence;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        // prompt has 0 and 1 (twice); output has 1 and 2; token 3 is unseen.
        let mut p = Penalties::new(2.0, 0.0, 0.0, &[0, 1, 1, 99_999]);
        p.record(1);
        p.record(2);
        let mut scores = [4.0, -3.0, 1.5, 5.0];
        p.apply(&mut scores);
        // each seen token penalized exactly once, however often it was seen
        assert_eq!(scores, [2.0, -6.0, 0.75, 5.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_follow_openai() {
        let mut p = Penalties::new(1.0, 0.5, 0.25, &[3]);
        for t in [0, 0, 0, 2] {
            p.record(t);
        }
        let mut scores = [1.0, 1.0, 1.0, 1.0];
        p.apply(&mut scores);
        // token 0: 1 - 0.25*3 - 0.5; token 2: 1 - 0.25 - 0.5; prompt-only token 3 untouched
        assert_eq!(scores, [-0.25, 1.0, 0.25, 1.0]);
    }

    #[test]
    fn repetition_applies_before_frequency_and_presence() {
        let mut p = Penalties::new(2.0, 1.0, 1.0, &[]);
        p.record(0);
        p.record(0);
        let mut scores = [6.0, -2.0];
        p.apply(&mut scores);
        // 6 / 2 - 1*2 - 1 = 0
        assert_eq!(scores, [0.0, -2.0]);
    }

    #[test]
    fn negative_penalties_encourage_and_out_of_row_ids_are_skipped() {
        let mut p = Penalties::new(0.5, -1.0, 0.0, &[7]);
        p.record(1);
        p.record(42);
        let mut scores = [1.0, 1.0, -1.0];
        p.apply(&mut scores);
        assert_eq!(scores, [1.0, 3.0, -1.0]);
    }
}
