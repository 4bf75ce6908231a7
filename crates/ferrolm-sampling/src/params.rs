//! `SamplingParams`: what one request asks of the sampler, and its validation.
//!
//! `SamplingParams` is always complete: every field holds the value the sampler will use.
//! Whether a field was set by the client is a question for the API edge, which has
//! `Option`s for it. The knobs a model's `generation_config.json` may change
//! (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) travel as
//! [`GenerationDefaults`], a struct of `Option`s; the server resolves a request as
//!
//! ```
//! # use ferrolm_sampling::{GenerationDefaults, SamplingParams};
//! # let model_defaults = GenerationDefaults::default();
//! let from_request = GenerationDefaults { temperature: Some(0.2), ..Default::default() };
//! let params = SamplingParams { n: 1, ..Default::default() }
//!     .with_defaults(&from_request.or(&model_defaults));
//! ```
//!
//! so the client wins field by field, then the model, then ferrolm's own defaults
//! (the OpenAI ones: temperature 1, no top-k/top-p/min-p, no penalties), as vLLM does.
//!
//! Invariant: a `RequestSampler` is only ever built from parameters that passed
//! [`SamplingParams::validate`].

use serde::{Deserialize, Serialize};

use crate::error::SamplingError;

/// Largest `n` (sequences per request) that is accepted.
pub const MAX_N: u32 = 128;
/// Largest number of top logprobs per token (`logprobs`, `prompt_logprobs`), as OpenAI.
pub const MAX_LOGPROBS: u32 = 20;
/// Most stop strings a request may give (OpenAI allows 4): each costs the output stage
/// nothing per token once compiled, but compiling and holding them is per request.
pub const MAX_STOP_STRINGS: usize = 32;
/// Longest stop string, in UTF-8 bytes: the text a sequence holds back is shorter than this.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Most `stop_token_ids` a request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 256;
/// Temperatures below this are greedy sampling (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;

/// Per-request sampling parameters, with vLLM's names and semantics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Number of sequences to generate for the request, 1..=128.
    pub n: u32,
    /// Softmax temperature, >= 0. 0 is greedy (argmax, ties to the lowest token id).
    pub temperature: f32,
    /// Keep only the k most likely tokens. 0 or -1 turns it off.
    pub top_k: i32,
    /// Keep the smallest set of most likely tokens whose mass reaches top_p, in (0, 1].
    /// 1 turns it off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top probability, in [0, 1].
    /// 0 turns it off.
    pub min_p: f32,
    /// Hugging Face repetition penalty over prompt and output tokens, > 0; 1 is off.
    /// A seen token's logit `l` becomes `l / p` when `l > 0`, else `l * p`.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over output tokens, in [-2, 2]: subtracted once from the
    /// logit of every token that was generated at least once.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over output tokens, in [-2, 2]: subtracted from a token's
    /// logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Seed of the request's random stream; without one the engine supplies its own.
    pub seed: Option<u64>,
    /// Most tokens to generate; `None` leaves it to the context length.
    pub max_tokens: Option<u32>,
    /// EOS and stop token ids cannot be sampled before this many output tokens.
    pub min_tokens: u32,
    /// Keep generating after EOS (stop_token_ids still stop).
    pub ignore_eos: bool,
    /// Strings that end generation; they are not part of the output. At most
    /// [`MAX_STOP_STRINGS`], each non-empty and at most [`MAX_STOP_STRING_BYTES`] bytes.
    pub stop: Vec<String>,
    /// Token ids that end generation, besides the model's EOS ids. At most
    /// [`MAX_STOP_TOKEN_IDS`].
    pub stop_token_ids: Vec<u32>,
    /// Return the logprob of each chosen token and this many top logprobs, 0..=20.
    pub logprobs: Option<u32>,
    /// Return logprobs of the prompt tokens and this many top logprobs, 0..=20.
    pub prompt_logprobs: Option<u32>,
    /// Leave special tokens out of the detokenized text.
    pub skip_special_tokens: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: None,
            min_tokens: 0,
            ignore_eos: false,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            skip_special_tokens: true,
        }
    }
}

/// The sampling knobs that may be left unset, each `None` when unset. Read from a model's
/// `generation_config.json` (other keys there are ignored; `max_new_tokens` is read as
/// `max_tokens`), or built by the server from the request's optional fields.
/// `do_sample` is ignored, as vLLM ignores it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    #[serde(alias = "max_new_tokens")]
    pub max_tokens: Option<u32>,
}

impl GenerationDefaults {
    /// Field by field: `self`'s value where set, else `fallback`'s.
    pub fn or(&self, fallback: &GenerationDefaults) -> GenerationDefaults {
        GenerationDefaults {
            temperature: self.temperature.or(fallback.temperature),
            top_p: self.top_p.or(fallback.top_p),
            top_k: self.top_k.or(fallback.top_k),
            min_p: self.min_p.or(fallback.min_p),
            repetition_penalty: self.repetition_penalty.or(fallback.repetition_penalty),
            max_tokens: self.max_tokens.or(fallback.max_tokens),
        }
    }
}

impl SamplingParams {
    /// Overwrites every field that `defaults` sets and leaves the others alone.
    /// Validate the result: a model's defaults are not trusted more than a client's.
    pub fn with_defaults(mut self, defaults: &GenerationDefaults) -> Self {
        if let Some(t) = defaults.temperature {
            self.temperature = t;
        }
        if let Some(p) = defaults.top_p {
            self.top_p = p;
        }
        if let Some(k) = defaults.top_k {
            self.top_k = k;
        }
        if let Some(p) = defaults.min_p {
            self.min_p = p;
        }
        if let Some(p) = defaults.repetition_penalty {
            self.repetition_penalty = p;
        }
        if let Some(m) = defaults.max_tokens {
            self.max_tokens = Some(m);
        }
        self
    }

    /// True when sampling is argmax: temperature below [`GREEDY_TEMPERATURE_EPS`].
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE_EPS
    }

    /// Checks every field against its allowed range; the error names the first field
    /// found out of range, the range, and the value given.
    pub fn validate(&self) -> Result<(), SamplingError> {
        use SamplingError as E;
        if self.n < 1 || self.n > MAX_N {
            return Err(E::invalid("n", format!("must be in [1, {MAX_N}], got {}", self.n)));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(E::invalid("temperature", format!("must be a finite number >= 0, got {}", self.temperature)));
        }
        if self.top_k < -1 {
            return Err(E::invalid("top_k", format!("must be -1 or 0 (off) or >= 1, got {}", self.top_k)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(E::invalid("top_p", format!("must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(E::invalid("min_p", format!("must be in [0, 1], got {}", self.min_p)));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(E::invalid(
                "repetition_penalty",
                format!("must be a finite number > 0, got {}", self.repetition_penalty),
            ));
        }
        for (param, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return Err(E::invalid(param, format!("must be in [-2, 2], got {value}")));
            }
        }
        if let Some(max_tokens) = self.max_tokens {
            if max_tokens < 1 {
                return Err(E::invalid("max_tokens", format!("must be >= 1, got {max_tokens}")));
            }
            if self.min_tokens > max_tokens {
                return Err(E::invalid(
                    "min_tokens",
                    format!("must be <= max_tokens ({max_tokens}), got {}", self.min_tokens),
                ));
            }
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(E::invalid(
                "stop",
                format!("must hold at most {MAX_STOP_STRINGS} strings, got {}", self.stop.len()),
            ));
        }
        if let Some(i) = self.stop.iter().position(String::is_empty) {
            return Err(E::invalid("stop", format!("must not contain an empty string, got one at index {i}")));
        }
        if let Some((i, s)) = self.stop.iter().enumerate().find(|(_, s)| s.len() > MAX_STOP_STRING_BYTES) {
            return Err(E::invalid(
                "stop",
                format!("strings must be at most {MAX_STOP_STRING_BYTES} bytes, got {} at index {i}", s.len()),
            ));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(E::invalid(
                "stop_token_ids",
                format!("must hold at most {MAX_STOP_TOKEN_IDS} ids, got {}", self.stop_token_ids.len()),
            ));
        }
        for (param, value) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if let Some(v) = value.filter(|&v| v > MAX_LOGPROBS) {
                return Err(E::invalid(param, format!("must be in [0, {MAX_LOGPROBS}], got {v}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected(params: SamplingParams) -> Result<(&'static str, String), String> {
        match params.validate() {
            Err(SamplingError::InvalidParam { param, reason }) => Ok((param, reason)),
            other => Err(format!("expected InvalidParam, got {other:?}")),
        }
    }

    #[test]
    fn defaults_are_valid_and_openai_like() -> Result<(), SamplingError> {
        let p = SamplingParams::default();
        p.validate()?;
        assert_eq!(p.n, 1);
        assert_eq!(p.temperature, 1.0);
        assert_eq!(p.top_p, 1.0);
        assert_eq!(p.top_k, 0);
        assert_eq!(p.min_p, 0.0);
        assert_eq!(p.repetition_penalty, 1.0);
        assert!(p.skip_special_tokens);
        assert!(!p.is_greedy());
        Ok(())
    }

    #[test]
    fn each_bad_field_is_named_with_its_range() -> Result<(), String> {
        let d = SamplingParams::default;
        let cases: Vec<(SamplingParams, &str, &str)> = vec![
            (SamplingParams { n: 0, ..d() }, "n", "must be in [1, 128], got 0"),
            (SamplingParams { n: 129, ..d() }, "n", "got 129"),
            (SamplingParams { temperature: -0.5, ..d() }, "temperature", ">= 0, got -0.5"),
            (SamplingParams { temperature: f32::NAN, ..d() }, "temperature", "got NaN"),
            (SamplingParams { temperature: f32::INFINITY, ..d() }, "temperature", "finite"),
            (SamplingParams { top_k: -2, ..d() }, "top_k", "got -2"),
            (SamplingParams { top_p: 0.0, ..d() }, "top_p", "must be in (0, 1], got 0"),
            (SamplingParams { top_p: 1.5, ..d() }, "top_p", "got 1.5"),
            (SamplingParams { top_p: f32::NAN, ..d() }, "top_p", "got NaN"),
            (SamplingParams { min_p: -0.1, ..d() }, "min_p", "must be in [0, 1], got -0.1"),
            (SamplingParams { min_p: 1.1, ..d() }, "min_p", "got 1.1"),
            (SamplingParams { repetition_penalty: 0.0, ..d() }, "repetition_penalty", "> 0, got 0"),
            (SamplingParams { repetition_penalty: f32::NAN, ..d() }, "repetition_penalty", "NaN"),
            (SamplingParams { presence_penalty: 2.5, ..d() }, "presence_penalty", "must be in [-2, 2], got 2.5"),
            (SamplingParams { frequency_penalty: -3.0, ..d() }, "frequency_penalty", "got -3"),
            (SamplingParams { max_tokens: Some(0), ..d() }, "max_tokens", "must be >= 1, got 0"),
            (
                SamplingParams { max_tokens: Some(4), min_tokens: 5, ..d() },
                "min_tokens",
                "must be <= max_tokens (4), got 5",
            ),
            (
                SamplingParams { stop: vec!["a".into(), String::new()], ..d() },
                "stop",
                "empty string, got one at index 1",
            ),
            (SamplingParams { stop: vec!["x".into(); 33], ..d() }, "stop", "must hold at most 32 strings, got 33"),
            (
                SamplingParams { stop: vec!["x".into(), "é".repeat(129)], ..d() },
                "stop",
                "strings must be at most 256 bytes, got 258 at index 1",
            ),
            (
                SamplingParams { stop_token_ids: vec![7; 257], ..d() },
                "stop_token_ids",
                "must hold at most 256 ids, got 257",
            ),
            (SamplingParams { logprobs: Some(21), ..d() }, "logprobs", "must be in [0, 20], got 21"),
            (SamplingParams { prompt_logprobs: Some(100), ..d() }, "prompt_logprobs", "got 100"),
        ];
        for (params, field, needle) in cases {
            let (param, reason) = rejected(params)?;
            assert_eq!(param, field);
            assert!(reason.contains(needle), "{param}: {reason:?} lacks {needle:?}");
        }
        Ok(())
    }

    #[test]
    fn boundary_values_are_accepted() -> Result<(), SamplingError> {
        let d = SamplingParams::default;
        for p in [
            SamplingParams { n: 128, temperature: 0.0, ..d() },
            SamplingParams { top_k: -1, top_p: 1.0, min_p: 1.0, ..d() },
            SamplingParams { top_k: 1, top_p: 1e-6, min_p: 0.0, ..d() },
            SamplingParams { presence_penalty: -2.0, frequency_penalty: 2.0, ..d() },
            SamplingParams { max_tokens: Some(3), min_tokens: 3, ..d() },
            SamplingParams { min_tokens: 1000, logprobs: Some(20), prompt_logprobs: Some(0), ..d() },
            SamplingParams {
                stop: vec!["é".repeat(128); MAX_STOP_STRINGS],
                stop_token_ids: vec![3; MAX_STOP_TOKEN_IDS],
                ..d()
            },
        ] {
            p.validate()?;
        }
        Ok(())
    }

    #[test]
    fn error_message_reads_as_a_sentence() {
        let err = SamplingParams { top_p: 0.0, ..Default::default() }.validate();
        assert_eq!(err.map_err(|e| e.to_string()), Err("top_p must be in (0, 1], got 0".to_string()));
    }

    #[test]
    fn serde_fills_missing_fields_with_defaults() -> Result<(), serde_json::Error> {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.0, "stop": ["\n"], "seed": 7}"#)?;
        assert_eq!(
            p,
            SamplingParams { temperature: 0.0, stop: vec!["\n".into()], seed: Some(7), ..Default::default() }
        );
        let back: SamplingParams = serde_json::from_str(&serde_json::to_string(&p)?)?;
        assert_eq!(back, p);
        Ok(())
    }

    #[test]
    fn generation_config_defaults_apply_only_where_the_client_was_silent() -> Result<(), serde_json::Error> {
        let model: GenerationDefaults = serde_json::from_str(
            r#"{"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": true,
                "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 512}"#,
        )?;
        assert_eq!(
            model,
            GenerationDefaults {
                temperature: Some(0.6),
                top_p: Some(0.9),
                top_k: Some(20),
                max_tokens: Some(512),
                ..Default::default()
            }
        );
        let client = GenerationDefaults { temperature: Some(0.0), max_tokens: Some(16), ..Default::default() };
        let p = SamplingParams::default().with_defaults(&client.or(&model));
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.top_p, 0.9);
        assert_eq!(p.top_k, 20);
        assert_eq!(p.min_p, 0.0);
        assert_eq!(p.repetition_penalty, 1.0);
        assert_eq!(p.max_tokens, Some(16));
        assert!(p.is_greedy());

        let untouched = SamplingParams::default().with_defaults(&GenerationDefaults::default());
        assert_eq!(untouched, SamplingParams::default());
        Ok(())
    }
}
