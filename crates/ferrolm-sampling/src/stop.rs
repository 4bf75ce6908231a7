//! Stop strings over streamed text, and why a sequence finished.
//!
//! `StopChecker` is fed the text deltas of one sequence as the detokenizer produces them.
//! It ends the sequence at the first stop string to be completed (the one whose first
//! occurrence ends earliest in the text; among those ending at the same byte, the longest;
//! among equal ones, the first in the list), which is where a streaming server has to stop.
//! The stop string and all after it are dropped. The strings are matched by one automaton
//! ([`StopStrings`], compiled once per request), stepped over each delta's bytes and kept
//! between deltas, so the cost of a delta does not grow with the number of stop strings.
//!
//! Invariants:
//! - Text that could still turn out to be the start of a stop string is held back, so no
//!   streamed delta ever carries part of a stop string that later completes. Held text is
//!   the longest suffix that could, so it is shorter than the longest stop string.
//! - Concatenated emits plus `flush` equal the text cut at the stop string (or the whole
//!   text), however the text was split into deltas.
//! - Every cut falls on a char boundary: the output is valid UTF-8 by construction.

mod strings;

use serde::{Deserialize, Serialize};

pub use strings::StopStrings;
use strings::{MatchState, Scan};

/// Why a sequence ended, as OpenAI spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The client went away or the request was cancelled.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one `push` lets through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopResult {
    /// Text that is safe to stream now.
    pub emit: String,
    /// A stop string completed: the sequence is finished, nothing more will be emitted.
    pub stopped: bool,
}

/// Stop-string matcher for one sequence.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: StopStrings,
    /// Where the text seen so far stands in the automaton; `None` without stop strings.
    state: Option<MatchState>,
    /// Text seen but not yet emitted: the longest suffix that is a proper prefix of a
    /// stop string, never a whole one.
    held: String,
    /// Index among the (non-empty) stop strings of the one that ended the sequence.
    matched: Option<usize>,
}

impl StopChecker {
    /// A checker over `stops`, compiled once per request and shared by its sequences.
    pub fn new(stops: StopStrings) -> Self {
        Self { state: stops.start(), stops, held: String::new(), matched: None }
    }

    /// Whether a stop string has ended the sequence.
    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that ended the sequence (vLLM's `stop_reason`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.and_then(|i| self.stops.get(i))
    }

    /// Feeds the next piece of text. After a stop, further deltas are ignored.
    ///
    /// Costs O(`delta`) steps of the automaton, plus the check of the held suffix when the text
    /// ends in what may begin a stop string; never a pass per stop string.
    pub fn push(&mut self, delta: &str) -> StopResult {
        if self.is_stopped() {
            return StopResult { emit: String::new(), stopped: true };
        }
        let Some(state) = self.state else {
            return StopResult { emit: delta.to_owned(), stopped: false };
        };
        let base = self.held.len();
        self.held.push_str(delta);
        match self.stops.scan(state, delta.as_bytes()) {
            Scan::Matched { pattern, len, end } => {
                // The stop string began within the held text at the earliest: held text is the
                // longest suffix that could begin one.
                self.held.truncate((base + end).saturating_sub(len));
                self.matched = Some(pattern);
                StopResult { emit: std::mem::take(&mut self.held), stopped: true }
            }
            Scan::Running(state) => {
                self.state = Some(state);
                let keep_from = self.stops.hold_start(state, &self.held);
                let rest = self.held.split_off(keep_from);
                let emit = std::mem::replace(&mut self.held, rest);
                StopResult { emit, stopped: false }
            }
        }
    }

    /// The text still held back, once the sequence ended for another reason; "" after a
    /// stop string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests;
