//! Streaming detokenization: turns the ids a request generates, one at a time, into text
//! deltas a client can append.
//!
//! Byte-level tokens may each hold part of a multi-byte character, and some decoders change
//! a token's text depending on what precedes it (SentencePiece's leading space). So a token
//! is never decoded alone: the detokenizer keeps a small window of ids and two offsets into
//! it, as vLLM and TGI do:
//!
//! ```text
//!   window:  [ ..prefix.. | ..new.. ]
//!             ^0           ^read_offset  ^window.len()
//! ```
//!
//! `prefix_text = decode(window[..read_offset])` is text already emitted (kept as context);
//! `decode(window)` minus `prefix_text` is the candidate delta. It is emitted only when it
//! does not end in U+FFFD, since a trailing U+FFFD may be a character whose remaining bytes
//! are still to come. On emission the window drops everything before the old `read_offset`,
//! so each push decodes a few tokens, not the whole sequence.
//!
//! Invariant: the deltas of `push` and `finish` concatenate to the text the generated ids
//! decode to (after the prompt's text), and no delta ends in a split character. A run of
//! ids that never completes a character (invalid UTF-8) is held back until one does or until
//! `finish`, so it grows the window meanwhile.

use std::sync::Arc;

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Prompt tokens kept as decoding context for the first generated token (vLLM uses 5).
const INITIAL_CONTEXT_TOKENS: usize = 5;

/// One request's streaming detokenizer.
#[derive(Debug)]
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// Ids from the first one still needed as context to the latest one.
    window: Vec<u32>,
    /// `window[..read_offset]` has been emitted; `window[read_offset..]` has not.
    read_offset: usize,
    /// `decode(window[..read_offset])`.
    prefix_text: String,
}

impl IncrementalDetokenizer {
    /// Starts a stream after `prompt_ids`, whose last few ids serve as context.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_ids: &[u32], skip_special_tokens: bool) -> Result<Self> {
        let context_start = prompt_ids.len().saturating_sub(INITIAL_CONTEXT_TOKENS);
        let window = prompt_ids[context_start..].to_vec();
        for &id in &window {
            tokenizer.check_id(id)?;
        }
        let prefix_text = tokenizer.decode_unchecked(&window, skip_special_tokens)?;
        let read_offset = window.len();
        Ok(IncrementalDetokenizer { tokenizer, skip_special_tokens, window, read_offset, prefix_text })
    }

    /// Adds one generated id and returns the text it completes, possibly empty.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer.check_id(id)?;
        self.window.push(id);
        let text = self.tokenizer.decode_unchecked(&self.window, self.skip_special_tokens)?;
        if text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        self.emit(text)
    }

    /// Returns whatever is held back (an incomplete character comes out as U+FFFD). The
    /// stream may go on afterwards.
    pub fn finish(&mut self) -> Result<String> {
        if self.read_offset == self.window.len() {
            return Ok(String::new());
        }
        let text = self.tokenizer.decode_unchecked(&self.window, self.skip_special_tokens)?;
        self.emit(text)
    }

    /// Emits `text` (the decode of the whole window) minus the prefix, and moves the window.
    fn emit(&mut self, text: String) -> Result<String> {
        let delta = match text.strip_prefix(self.prefix_text.as_str()) {
            Some(rest) => rest.to_string(),
            // The decoder rewrote the end of the prefix (a prompt ending inside a character
            // that the first generated token completes): emit from where the two differ.
            None => text.get(common_prefix_len(&self.prefix_text, &text)..).unwrap_or_default().to_string(),
        };
        if delta.is_empty() {
            // Nothing visible yet (e.g. a skipped special token): keep the offsets, so the
            // next token is decoded with the same context.
            return Ok(delta);
        }
        // The new prefix is what was just read; what came before it is no longer needed.
        self.window.drain(..self.read_offset);
        self.read_offset = self.window.len();
        self.prefix_text = self.tokenizer.decode_unchecked(&self.window, self.skip_special_tokens)?;
        Ok(delta)
    }

    /// Ids currently held as context or pending; stays small while text decodes cleanly.
    pub fn window_len(&self) -> usize {
        self.window.len()
    }
}

/// Length in bytes of the longest common prefix of `a` and `b` that ends on a char boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}
