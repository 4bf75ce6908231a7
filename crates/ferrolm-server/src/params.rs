//! From a request's optional knobs to the engine's complete [`SamplingParams`].
//!
//! Precedence, field by field: what the client sent, then the model's `generation_config.json`,
//! then the route's own default (16 tokens for completions), then ferrolm's (OpenAI's) defaults.
//! Range checks are the engine's ([`SamplingParams::validate`] via `EngineHandle::submit`), so
//! the two routes and the CLI refuse the same values with the same messages.

use ferrolm_engine::resolve_max_tokens;
use ferrolm_sampling::{GenerationDefaults, SamplingParams};

use crate::error::ApiError;
use crate::structured::{self, Requested};
use ferrolm_structured::Grammar;

/// Declares a request type with, after its own fields, the sampling fields that both completion
/// routes take, listed here once, and a `take_sampling` that moves them into a
/// [`RequestSampling`].
///
/// NOTE: not a `#[serde(flatten)]` struct: serde buffers flattened fields, so a bad value
/// there would lose the field name that the 400 names (`param`), and `deny_unknown_fields`
/// (how an unknown parameter is refused by name) does not hold across a flatten.
macro_rules! sampling_request {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }) => {
        $crate::params::sampling_request!(@ [$(#[$meta])*] $name [$($(#[$fmeta])* pub $field: $ty,)*]
            max_tokens: Option<u32>,
            temperature: Option<f32>,
            top_p: Option<f32>,
            top_k: Option<i32>,
            min_p: Option<f32>,
            repetition_penalty: Option<f32>,
            presence_penalty: Option<f32>,
            frequency_penalty: Option<f32>,
            n: Option<u32>,
            seed: Option<i64>,
            stop: Option<$crate::protocol::Stop>,
            ignore_eos: Option<bool>,
            min_tokens: Option<u32>,
            stop_token_ids: Option<Vec<u32>>,
            skip_special_tokens: Option<bool>,
            logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
            response_format: Option<serde_json::Value>,
            structured_outputs: Option<serde_json::Value>,
        );
    };
    (@ [$($meta:tt)*] $name:ident [$($own:tt)*] $($field:ident: $ty:ty,)*) => {
        $($meta)*
        pub struct $name {
            $($own)*
            $(pub $field: $ty,)*
        }

        impl $name {
            /// The sampling fields, moved out (those of the route's own, such as `logprobs`,
            /// are the route's to fill in).
            pub fn take_sampling(&mut self) -> $crate::params::RequestSampling {
                $crate::params::RequestSampling {
                    $($field: self.$field.take(),)*
                    ..Default::default()
                }
            }
        }
    };
}
pub(crate) use sampling_request;

sampling_request! {
    /// The sampling knobs of a request, as the client sent them.
    #[derive(Debug, Default)]
    pub struct RequestSampling {
        /// Top logprobs per sampled token (each route spells it its own way).
        pub logprobs: Option<u32>,
        /// Top logprobs per prompt token (completions' `echo` with `logprobs`).
        pub prompt_logprobs: Option<u32>,
    }
}

/// Sampling parameters for every prompt of a request, before each prompt's length is settled.
#[derive(Debug, Clone)]
pub struct ResolvedSampling {
    /// `max_tokens` is the client's, if it chose one.
    pub params: SamplingParams,
    /// The model's length, else the route's: used where the client chose none.
    pub default_max_tokens: Option<u32>,
    /// The grammar every sequence follows (see `structured`), compiled by the route.
    pub grammar: Option<Grammar>,
}

impl RequestSampling {
    /// The request's `response_format` or `structured_outputs` constraint, taken out.
    pub fn take_structured(&mut self) -> Result<Option<Requested>, ApiError> {
        structured::requested(self.response_format.take(), self.structured_outputs.take())
    }

    /// `route_max_tokens` applies when neither the client nor the model chose a length.
    pub fn resolve(
        self,
        model: &GenerationDefaults,
        route_max_tokens: Option<u32>,
    ) -> Result<ResolvedSampling, ApiError> {
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(ApiError::invalid("logit_bias is not supported", Some("logit_bias")));
        }
        let default_max_tokens = model.max_tokens.or(route_max_tokens);
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
        params.max_tokens = self.max_tokens;
        Ok(ResolvedSampling { params, default_max_tokens, grammar: None })
    }
}

impl ResolvedSampling {
    /// The parameters for one prompt, its length settled by the engine's one rule
    /// ([`resolve_max_tokens`]): a default length is shortened to the room left in the context
    /// (as vLLM does), so that a model default of, say, 512 new tokens does not refuse long
    /// prompts; the client's is never changed.
    pub fn for_prompt(&self, num_prompt_tokens: usize, max_model_len: usize) -> SamplingParams {
        let max_tokens =
            resolve_max_tokens(self.params.max_tokens, self.default_max_tokens, num_prompt_tokens, max_model_len);
        SamplingParams { max_tokens: Some(max_tokens), ..self.params.clone() }
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
        assert_eq!(r.for_prompt(10, 128).max_tokens, Some(16));
        assert_eq!(r.params.max_tokens, None, "the client chose no length");

        let model = GenerationDefaults { max_tokens: Some(512), ..Default::default() };
        let r = RequestSampling::default().resolve(&model, Some(16))?;
        assert_eq!(r.for_prompt(10, 1024).max_tokens, Some(512), "the model's max_new_tokens beats the route default");
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
