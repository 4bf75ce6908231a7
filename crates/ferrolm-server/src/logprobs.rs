//! The engine's logprobs in the two shapes of the API: the completions route's parallel lists
//! (`tokens`, `token_logprobs`, `top_logprobs` as `{token: logprob}` maps, `text_offset`) and the
//! chat route's per-token objects (`token`, `logprob`, `bytes`, `top_logprobs`).
//!
//! A token's text is its own decoding (special tokens included); a piece of a multi-byte
//! character decodes to U+FFFD, as in vLLM. Logprobs that are not finite become -9999.0, as in
//! vLLM, since JSON has no infinities.

use ferrolm_engine::PromptLogprob;
use ferrolm_sampling::TokenLogprobs;
use ferrolm_tokenizer::Tokenizer;

use crate::protocol::chat::{ChatTokenLogprob, ChatTopLogprob};
use crate::protocol::completions::{CompletionLogprobs, TopLogprobMap};

pub fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// Builds the completions logprobs of one choice, token by token; `text_offset` runs on from
/// one push to the next (prompt tokens first when echoed, then generated ones).
pub struct CompletionLogprobsBuilder {
    out: CompletionLogprobs,
    /// Characters of token text so far.
    offset: usize,
}

impl CompletionLogprobsBuilder {
    pub fn new() -> Self {
        CompletionLogprobsBuilder { out: CompletionLogprobs::default(), offset: 0 }
    }

    fn push_entry(&mut self, tokenizer: &Tokenizer, id: u32, logprob: Option<f32>, top: Option<&[(u32, f32)]>) {
        let text = token_text(tokenizer, id);
        let top = top.map(|top| {
            let mut map: Vec<(String, f32)> = Vec::with_capacity(top.len() + 1);
            // The chosen token is always listed, as OpenAI does: up to `logprobs + 1` entries.
            let chosen = logprob.filter(|_| !top.iter().any(|&(t, _)| t == id)).map(|lp| (id, lp));
            let mut entries: Vec<(u32, f32)> = top.iter().copied().chain(chosen).collect();
            entries.sort_by(|a, b| b.1.total_cmp(&a.1));
            for (t, lp) in entries {
                let s = token_text(tokenizer, t);
                if !map.iter().any(|(k, _)| *k == s) {
                    map.push((s, finite(lp)));
                }
            }
            TopLogprobMap(map)
        });
        self.out.text_offset.push(self.offset);
        self.offset += text.chars().count();
        self.out.tokens.push(text);
        self.out.token_logprobs.push(logprob.map(finite));
        self.out.top_logprobs.push(top);
    }

    /// The prompt's tokens; the first has no logprob (nothing predicts it).
    pub fn push_prompt(&mut self, tokenizer: &Tokenizer, prompt_ids: &[u32], logprobs: &[PromptLogprob]) {
        for (i, &id) in prompt_ids.iter().enumerate() {
            match logprobs.get(i).and_then(Option::as_ref) {
                Some(lp) => self.push_entry(tokenizer, id, Some(lp.logprob), Some(&lp.top_logprobs)),
                None => self.push_entry(tokenizer, id, None, None),
            }
        }
    }

    pub fn push(&mut self, tokenizer: &Tokenizer, lp: &TokenLogprobs) {
        self.push_entry(tokenizer, lp.token, Some(lp.logprob), Some(&lp.top_logprobs));
    }

    /// The entries pushed since the last call (a stream chunk's share), keeping the offset.
    pub fn take(&mut self) -> CompletionLogprobs {
        std::mem::take(&mut self.out)
    }
}

pub fn chat_token_logprob(tokenizer: &Tokenizer, lp: &TokenLogprobs, num_top: usize) -> ChatTokenLogprob {
    let token = token_text(tokenizer, lp.token);
    let top_logprobs = lp
        .top_logprobs
        .iter()
        .take(num_top)
        .map(|&(id, logprob)| {
            let token = token_text(tokenizer, id);
            ChatTopLogprob { bytes: token.as_bytes().to_vec(), token, logprob: finite(logprob) }
        })
        .collect();
    ChatTokenLogprob { bytes: token.as_bytes().to_vec(), token, logprob: finite(lp.logprob), top_logprobs }
}
