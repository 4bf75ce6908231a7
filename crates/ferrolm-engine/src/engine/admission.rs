//! Backpressure: what the requests accepted and not yet finished weigh, counted in sequences
//! (prompts times `n`) and prompt tokens, so that one request of many prompts or a long one
//! weighs what it costs rather than one.
//!
//! Invariants:
//! - A client request's [`Load`] is reserved once, by the handle before its `Add` is sent, and
//!   released once, by the engine thread when its last sequence ends (or by the handle when the
//!   `Add` never reached the engine).
//! - A reservation that would take either count past its limit is undone and refused, so the
//!   counts never stay above the limits.

use std::sync::atomic::{AtomicUsize, Ordering};

/// What a set of requests weighs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Sequences: each prompt counts `n`.
    pub sequences: usize,
    /// Prompt tokens, each prompt counted once (its `n` sequences share it through the prefix
    /// cache).
    pub prompt_tokens: usize,
}

impl Load {
    /// One prompt of `prompt_tokens` tokens sampled `n` times.
    pub fn of_prompt(prompt_tokens: usize, n: u32) -> Load {
        Load { sequences: n as usize, prompt_tokens }
    }

    pub fn plus(self, other: Load) -> Load {
        Load {
            sequences: self.sequences.saturating_add(other.sequences),
            prompt_tokens: self.prompt_tokens.saturating_add(other.prompt_tokens),
        }
    }

    pub fn minus(self, other: Load) -> Load {
        Load {
            sequences: self.sequences.saturating_sub(other.sequences),
            prompt_tokens: self.prompt_tokens.saturating_sub(other.prompt_tokens),
        }
    }

    /// Whether either count is above `limit`'s.
    pub fn exceeds(self, limit: Load) -> bool {
        self.sequences > limit.sequences || self.prompt_tokens > limit.prompt_tokens
    }
}

/// The load of every client request accepted and not finished, shared by the handles and the
/// engine thread.
#[derive(Debug, Default)]
pub(crate) struct PendingLoad {
    sequences: AtomicUsize,
    prompt_tokens: AtomicUsize,
}

impl PendingLoad {
    pub(crate) fn get(&self) -> Load {
        Load {
            sequences: self.sequences.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
        }
    }

    /// Adds `load` unless that takes the total past `limit`; then answers the total it found.
    pub(crate) fn try_reserve(&self, load: Load, limit: Load) -> Result<(), Load> {
        let before = Load {
            sequences: self.sequences.fetch_add(load.sequences, Ordering::AcqRel),
            prompt_tokens: self.prompt_tokens.fetch_add(load.prompt_tokens, Ordering::AcqRel),
        };
        if before.plus(load).exceeds(limit) {
            self.release(load);
            return Err(before);
        }
        Ok(())
    }

    pub(crate) fn release(&self, load: Load) {
        self.sequences.fetch_sub(load.sequences, Ordering::AcqRel);
        self.prompt_tokens.fetch_sub(load.prompt_tokens, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_stop_at_either_limit_and_leave_nothing_behind() {
        let pending = PendingLoad::default();
        let limit = Load { sequences: 10, prompt_tokens: 100 };
        assert_eq!(pending.try_reserve(Load::of_prompt(60, 4), limit), Ok(()));
        assert_eq!(pending.try_reserve(Load::of_prompt(41, 1), limit), Err(Load { sequences: 4, prompt_tokens: 60 }));
        assert_eq!(pending.try_reserve(Load::of_prompt(10, 7), limit), Err(Load { sequences: 4, prompt_tokens: 60 }));
        assert_eq!(pending.get(), Load { sequences: 4, prompt_tokens: 60 }, "refusals leave no trace");
        assert_eq!(pending.try_reserve(Load::of_prompt(40, 6), limit), Ok(()), "exactly at both limits");
        pending.release(Load { sequences: 10, prompt_tokens: 100 });
        assert_eq!(pending.get(), Load::default());
    }
}
