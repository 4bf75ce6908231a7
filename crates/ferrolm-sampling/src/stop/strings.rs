//! A request's stop strings compiled once into one Aho-Corasick automaton, shared by the `n`
//! sequences of the request, so that matching costs the same per byte of text however many stop
//! strings there are.
//!
//! Invariants:
//! - Pattern ids are positions in the list of the non-empty stop strings, in the order the
//!   request gave them (empty strings are left out: they would match everywhere).
//! - The automaton has standard (overlapping) semantics: a match state lists every stop string
//!   that ends at that byte, so the first match state met while stepping is at the earliest end.

use std::sync::Arc;

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::contiguous::NFA;
use aho_corasick::{Anchored, MatchKind};

use crate::error::SamplingError;

/// The compiled stop strings of one request; cheap to clone (the automaton is shared).
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    /// `None` when there is no non-empty stop string.
    compiled: Option<Arc<Compiled>>,
}

#[derive(Debug)]
struct Compiled {
    nfa: NFA,
    /// By pattern id.
    strings: Vec<String>,
    /// Start state of a search from anywhere in the text.
    unanchored_start: StateID,
    /// Start state of a search for a stop string that begins at a given byte.
    anchored_start: StateID,
}

/// Where stepping over some text stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scan {
    /// No stop string completed; the state after the last byte.
    Running(MatchState),
    /// Stop string `pattern`, `len` bytes long, completed at byte `end` (exclusive) of the
    /// bytes just stepped over; it may have begun in the text before them.
    Matched { pattern: usize, len: usize, end: usize },
}

/// Where a sequence's text stands in the automaton: which suffix of it may begin a stop string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatchState(StateID);

impl StopStrings {
    /// Compiles `stops`; empty strings are ignored (validation refuses them anyway).
    pub fn new(stops: &[String]) -> Result<StopStrings, SamplingError> {
        let strings: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        if strings.is_empty() {
            return Ok(StopStrings { compiled: None });
        }
        let build_error =
            |e: &dyn std::fmt::Display| SamplingError::invalid("stop", format!("cannot be compiled: {e}"));
        let nfa = NFA::builder()
            .match_kind(MatchKind::Standard)
            // The checker steps the automaton byte by byte; a prefilter would go unused.
            .prefilter(false)
            .build(&strings)
            .map_err(|e| build_error(&e))?;
        let unanchored_start = nfa.start_state(Anchored::No).map_err(|e| build_error(&e))?;
        let anchored_start = nfa.start_state(Anchored::Yes).map_err(|e| build_error(&e))?;
        Ok(StopStrings { compiled: Some(Arc::new(Compiled { nfa, strings, unanchored_start, anchored_start })) })
    }

    /// No (non-empty) stop string: nothing is ever held back or cut.
    pub fn is_empty(&self) -> bool {
        self.compiled.is_none()
    }

    /// Number of (non-empty) stop strings.
    pub fn len(&self) -> usize {
        self.compiled.as_ref().map_or(0, |c| c.strings.len())
    }

    /// Stop string `pattern` (an index among the non-empty ones, in the request's order).
    pub(crate) fn get(&self, pattern: usize) -> Option<&str> {
        self.compiled.as_ref().and_then(|c| c.strings.get(pattern)).map(String::as_str)
    }

    /// The state of a text that has not started yet; `None` without stop strings.
    pub(crate) fn start(&self) -> Option<MatchState> {
        self.compiled.as_ref().map(|c| MatchState(c.unanchored_start))
    }

    /// Steps from `state` over `bytes` and stops at the first stop string to complete: the one
    /// that ends earliest; among those ending at the same byte the longest, then the first in
    /// the list. Without stop strings nothing ever matches.
    pub(crate) fn scan(&self, state: MatchState, bytes: &[u8]) -> Scan {
        let Some(c) = self.compiled.as_deref() else { return Scan::Running(state) };
        let mut sid = state.0;
        for (at, &byte) in bytes.iter().enumerate() {
            sid = c.nfa.next_state(Anchored::No, sid, byte);
            if c.nfa.is_special(sid) && c.nfa.is_match(sid) {
                // Every stop string ending here is listed: the longest, then the first, wins.
                let pattern = (0..c.nfa.match_len(sid))
                    .map(|i| c.nfa.match_pattern(sid, i))
                    .min_by_key(|&pid| (std::cmp::Reverse(c.nfa.pattern_len(pid)), pid.as_usize()));
                if let Some(pid) = pattern {
                    return Scan::Matched { pattern: pid.as_usize(), len: c.nfa.pattern_len(pid), end: at + 1 };
                }
            }
        }
        Scan::Running(MatchState(sid))
    }

    /// Byte index in `text` where its longest suffix that is a proper prefix of a stop string
    /// starts (`text.len()` when no suffix is), given `state`, the state after `text` (and
    /// whatever came before it, which the suffix never reaches into: the caller holds back at
    /// least that suffix).
    ///
    /// Costs nothing when the state says no suffix may begin a stop string (the usual case);
    /// else one anchored walk per candidate start, each ending at the first byte no stop string
    /// continues with, over at most the longest stop string's length of text.
    pub(crate) fn hold_start(&self, state: MatchState, text: &str) -> usize {
        let Some(c) = self.compiled.as_deref() else { return text.len() };
        if c.nfa.is_start(state.0) {
            return text.len();
        }
        // A proper prefix of a stop string is at most `longest - 1` bytes long.
        let earliest = text.len().saturating_sub(c.nfa.max_pattern_len().saturating_sub(1));
        // NOTE: a stop string is valid UTF-8, so it never begins inside a char of the text;
        // the check on char boundaries only skips the walks that would fail at once.
        (earliest..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .find(|&i| c.begins_a_stop_string(&text.as_bytes()[i..]))
            .unwrap_or(text.len())
    }
}

impl Compiled {
    /// Whether `bytes` are the beginning of some stop string (or a whole one).
    fn begins_a_stop_string(&self, bytes: &[u8]) -> bool {
        let mut sid = self.anchored_start;
        for &byte in bytes {
            // An anchored search never follows a failure transition: leaving the trie of the
            // stop strings is the dead state.
            sid = self.nfa.next_state(Anchored::Yes, sid, byte);
            if self.nfa.is_dead(sid) {
                return false;
            }
        }
        true
    }
}
