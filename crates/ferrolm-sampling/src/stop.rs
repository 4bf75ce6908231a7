//! Stop strings over streamed text, and why a sequence finished.
//!
//! `StopChecker` is fed the text deltas of one sequence as the detokenizer produces them.
//! It ends the sequence at the first stop string to be completed (the one whose first
//! occurrence ends earliest in the text; among those ending at the same byte, the longest),
//! which is where a streaming server has to stop. The stop string and all after it are
//! dropped.
//!
//! Invariants:
//! - Text that could still turn out to be the start of a stop string is held back, so no
//!   streamed delta ever carries part of a stop string that later completes. Held text is
//!   the longest suffix that could, so it is shorter than the longest stop string.
//! - Concatenated emits plus `flush` equal the text cut at the stop string (or the whole
//!   text), however the text was split into deltas.
//! - Every cut falls on a char boundary: the output is valid UTF-8 by construction.

use serde::{Deserialize, Serialize};

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
    stops: Vec<String>,
    /// Text seen but not yet emitted: the longest suffix that is a proper prefix of a
    /// stop string, never a whole one.
    held: String,
    /// Index into `stops` of the string that ended the sequence.
    matched: Option<usize>,
}

impl StopChecker {
    /// Empty strings are ignored (validation rejects them anyway).
    pub fn new(stops: &[String]) -> Self {
        Self { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new(), matched: None }
    }

    /// Whether a stop string has ended the sequence.
    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that ended the sequence (vLLM's `stop_reason`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Feeds the next piece of text. After a stop, further deltas are ignored.
    pub fn push(&mut self, delta: &str) -> StopResult {
        if self.is_stopped() {
            return StopResult { emit: String::new(), stopped: true };
        }
        if self.stops.is_empty() {
            return StopResult { emit: delta.to_owned(), stopped: false };
        }
        self.held.push_str(delta);

        // Earliest end, then earliest start (the longest string), then list order.
        let first_completed = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at + s.len(), at, i)))
            .min();
        if let Some((_, at, i)) = first_completed {
            self.held.truncate(at);
            self.matched = Some(i);
            return StopResult { emit: std::mem::take(&mut self.held), stopped: true };
        }

        let keep_from = self.hold_start();
        let rest = self.held.split_off(keep_from);
        let emit = std::mem::replace(&mut self.held, rest);
        StopResult { emit, stopped: false }
    }

    /// The text still held back, once the sequence ended for another reason; "" after a
    /// stop string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Byte index where the longest suffix that may begin a stop string starts
    /// (`held.len()` when none may).
    fn hold_start(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A proper prefix of a stop string is at most `longest - 1` bytes long.
        let earliest = self.held.len().saturating_sub(longest.saturating_sub(1));
        (earliest..self.held.len())
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests;
