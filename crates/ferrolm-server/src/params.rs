//! From a request's optional knobs to the engine's complete [`SamplingParams`].
//!
//! Precedence, field by field: what the client sent, then the model's `generation_config.json`,
//! then the route's own default (16 tokens for completions), then ferrolm's (OpenAI's) defaults.
//! Range checks are the engine's ([`SamplingParams::validate`] via `EngineHandle::submit`), so
//! the two routes and the CLI refuse the same values with the same messages.

use ferrolm_sampling::{GenerationDefaults, SamplingParams};

use crate::error::ApiError;
use crate::protocol::Stop;

/// The sampling fields both completion routes accept, as the client sent them.
#[derive(Debug, Default)]
pub struct RequestSampling {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub n: Option<u32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<u32>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
    pub logprobs: Option<u32>,
    pub prompt_logprobs: Option<u32>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
}

/// Sampling parameters for every prompt of a request, before the per-prompt `max_tokens` fit.
#[derive(Debug, Clone)]
pub struct ResolvedSampling {
    pub params: SamplingParams,
    /// Whether the client chose `max_tokens` (then it is never shortened to fit the context).
    pub client_max_tokens: bool,
}

impl RequestSampling {
    /// `route_max_tokens` applies when neither the client nor the model chose a length.
    pub fn resolve(
        self,
        model: &GenerationDefaults,
        route_max_tokens: Option<u32>,
    ) -> Result<ResolvedSampling, ApiError> {
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(ApiError::invalid("logit_bias is not supported", Some("logit_bias")));
        }
        let client_max_tokens = self.max_tokens.is_some();
        let from_client = GenerationDefaults {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_tokens: self.max_tokens,
        };
        let base = SamplingParams::default();
        let mut params = SamplingParams {
            n: self.n.unwrap_or(base.n),
            presence_penalty: self.presence_penalty.unwrap_or(base.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(base.frequency_penalty),
            // Any 64-bit seed is accepted; negative ones map onto the upper half of u64.
            seed: self.seed.map(|s| s as u64),
            max_tokens: None,
            min_tokens: self.min_tokens.unwrap_or(base.min_tokens),
            ignore_eos: self.ignore_eos.unwrap_or(base.ignore_eos),
            stop: self.stop.map(|s| s.0).unwrap_or_default(),
            stop_token_ids: self.stop_token_ids.unwrap_or_default(),
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(base.skip_special_tokens),
            ..base
        }
        .with_defaults(&from_client.or(model));
        if params.max_tokens.is_none() {
            params.max_tokens = route_max_tokens;
        }
        Ok(ResolvedSampling { params, client_max_tokens })
    }
}

impl ResolvedSampling {
    /// The parameters for one prompt: a length the client did not choose is shortened to the
    /// room left in the context (as vLLM does), so that a model default of, say, 512 new tokens
    /// does not refuse long prompts.
    pub fn for_prompt(&self, num_prompt_tokens: usize, max_model_len: usize) -> SamplingParams {
        let mut params = self.params.clone();
        if !self.client_max_tokens {
            let room = max_model_len.saturating_sub(num_prompt_tokens);
            if let Some(m) = params.max_tokens {
                if m as usize > room && room > 0 {
                    params.max_tokens = Some(room as u32);
                }
            }
        }
        params
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_then_model_then_route_defaults() -> Result<(), ApiError> {
        let model = GenerationDefaults { temperature: Some(0.6), top_k: Some(20), ..Default::default() };
        let r =
            RequestSampling { temperature: Some(0.0), n: Some(2), ..Default::default() }.resolve(&model, Some(16))?;
        assert_eq!(r.params.temperature, 0.0);
        assert_eq!(r.params.top_k, 20);
        assert_eq!(r.params.n, 2);
        assert_eq!(r.params.max_tokens, Some(16));
        assert!(!r.client_max_tokens);

        let model = GenerationDefaults { max_tokens: Some(512), ..Default::default() };
        let r = RequestSampling::default().resolve(&model, Some(16))?;
        assert_eq!(r.params.max_tokens, Some(512), "the model's max_new_tokens beats the route default");
        assert_eq!(r.for_prompt(100, 128).max_tokens, Some(28), "a default length fits the context");

        let r = RequestSampling { max_tokens: Some(600), ..Default::default() }.resolve(&model, Some(16))?;
        assert_eq!(r.for_prompt(100, 128).max_tokens, Some(600), "the client's length is never changed");
        Ok(())
    }

    #[test]
    fn logit_bias_is_refused_rather_than_ignored() {
        let mut bias = serde_json::Map::new();
        bias.insert("5".into(), serde_json::json!(100));
        let r = RequestSampling { logit_bias: Some(bias), ..Default::default() }
            .resolve(&GenerationDefaults::default(), None);
        assert!(matches!(r, Err(ApiError::InvalidRequest { .. })));
    }
}
