//! What one API request may ask of the server, so that no single client can take it from the
//! others: its sequences (prompts times `n`), its prompt tokens, and the prompt logprob rows its
//! response carries. Each check runs as soon as what it needs is known, before the work that
//! grows with it: the sequences straight after parsing, the prompt lengths first by a bound from
//! their bytes (no tokenizing), then exactly once tokenized.
//!
//! Every refusal is a 400 that names the limit and the flag that raises it.

use ferrolm_tokenizer::Tokenizer;

use crate::error::ApiError;

/// Per-request caps; `ferrolm serve` flags raise them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Sequences of one request: its prompts times `n` (`--max-request-sequences`).
    pub max_sequences: usize,
    /// Prompt tokens of one request, summed over its prompts (`--max-request-prompt-tokens`).
    pub max_prompt_tokens: usize,
    /// Prompt logprob rows one response carries: every choice of a completion with `echo` and
    /// `logprobs` repeats its prompt's (`--max-request-prompt-logprob-rows`).
    pub max_prompt_logprob_rows: usize,
}

impl Default for RequestLimits {
    /// 256 sequences (the most `n` the engine takes for one prompt), 1M prompt tokens, 64K
    /// prompt logprob rows (about 40 MB of JSON at 20 top logprobs a row).
    fn default() -> Self {
        RequestLimits { max_sequences: 256, max_prompt_tokens: 1 << 20, max_prompt_logprob_rows: 1 << 16 }
    }
}

/// One request's prompts as far as the limits care, before or after tokenizing.
#[derive(Debug, Clone, Copy)]
pub struct PromptShape {
    pub num_prompts: usize,
    /// Samples per prompt.
    pub n: usize,
    /// Whether each choice carries its prompt's logprobs (`echo` with `logprobs`).
    pub echo_logprobs: bool,
}

impl RequestLimits {
    /// The sequence cap, from the request's shape alone.
    pub fn check_sequences(&self, shape: PromptShape) -> Result<(), ApiError> {
        let sequences = shape.num_prompts.saturating_mul(shape.n);
        if sequences > self.max_sequences {
            return Err(ApiError::invalid(
                format!(
                    "this request asks for {sequences} sequences ({} prompts x n = {}); at most {} are \
                     allowed per request (--max-request-sequences)",
                    shape.num_prompts, shape.n, self.max_sequences
                ),
                Some(if shape.num_prompts > 1 { "prompt" } else { "n" }),
            ));
        }
        Ok(())
    }

    /// The token caps on prompt lengths known so far: exact counts, or lower bounds from the
    /// text's bytes before tokenizing (`exact` says which, for the message).
    pub fn check_prompt_tokens(&self, shape: PromptShape, lengths: &[usize], exact: bool) -> Result<(), ApiError> {
        let at_least = if exact { "" } else { "at least " };
        let total: usize = lengths.iter().sum();
        if total > self.max_prompt_tokens {
            return Err(ApiError::invalid(
                format!(
                    "the prompts of this request have {at_least}{total} tokens in all; at most {} are allowed per \
                     request (--max-request-prompt-tokens)",
                    self.max_prompt_tokens
                ),
                Some("prompt"),
            ));
        }
        if shape.echo_logprobs {
            let rows = total.saturating_mul(shape.n);
            if rows > self.max_prompt_logprob_rows {
                return Err(ApiError::invalid(
                    format!(
                        "echo with logprobs would return {at_least}{rows} prompt logprob rows ({total} prompt tokens x \
                         n = {}); at most {} are allowed per request (--max-request-prompt-logprob-rows)",
                        shape.n, self.max_prompt_logprob_rows
                    ),
                    Some("logprobs"),
                ));
            }
        }
        Ok(())
    }
}

/// Refuses a text that cannot fit the model's context, by a lower bound on its tokens from its
/// bytes, so that a huge prompt costs no tokenizing. Answers the bound.
pub fn check_text_fits(
    tokenizer: &Tokenizer,
    text: &str,
    max_model_len: usize,
    param: &str,
) -> Result<usize, ApiError> {
    let at_least = tokenizer.min_tokens_for(text.len());
    if at_least > max_model_len {
        return Err(ApiError::invalid(
            format!(
                "the text has at least {at_least} tokens ({} bytes); this model's maximum context length is \
                 {max_model_len} tokens",
                text.len()
            ),
            Some(param),
        ));
    }
    Ok(at_least)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(err: ApiError) -> String {
        err.to_string()
    }

    #[test]
    fn sequences_are_prompts_times_n() {
        let limits = RequestLimits { max_sequences: 8, ..RequestLimits::default() };
        let shape = |num_prompts, n| PromptShape { num_prompts, n, echo_logprobs: false };
        assert!(limits.check_sequences(shape(4, 2)).is_ok());
        let err = limits.check_sequences(shape(3, 3)).err().map(message).unwrap_or_default();
        assert!(err.contains("9 sequences (3 prompts x n = 3)") && err.contains("--max-request-sequences"), "{err}");
        assert!(limits.check_sequences(shape(usize::MAX, 2)).is_err(), "no overflow");
    }

    #[test]
    fn prompt_tokens_and_echoed_logprob_rows_are_capped() {
        let limits = RequestLimits { max_sequences: 64, max_prompt_tokens: 100, max_prompt_logprob_rows: 120 };
        let plain = PromptShape { num_prompts: 2, n: 4, echo_logprobs: false };
        assert!(limits.check_prompt_tokens(plain, &[60, 40], true).is_ok());
        let err = limits.check_prompt_tokens(plain, &[60, 41], false).err().map(message).unwrap_or_default();
        assert!(err.contains("at least 101 tokens"), "{err}");
        let echo = PromptShape { echo_logprobs: true, ..plain };
        assert!(limits.check_prompt_tokens(echo, &[20, 10], true).is_ok(), "30 x 4 = 120 rows");
        let err = limits.check_prompt_tokens(echo, &[20, 11], true).err().map(message).unwrap_or_default();
        assert!(err.contains("124 prompt logprob rows") && err.contains("--max-request-prompt-logprob-rows"), "{err}");
    }
}
