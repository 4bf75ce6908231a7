//! The wire types of the OpenAI-compatible API (and vLLM's extensions to it), with serde.
//!
//! Requests keep every optional knob an `Option`, so that "the client said nothing" stays
//! distinguishable from "the client asked for the default" (the model's generation_config fills
//! in only the former). A field a route does not know is refused with a 400 that names it, as
//! OpenAI's API does ("unrecognized request argument"): a misspelt `max_tokens` or a feature
//! this server lacks must not pass silently as the defaults.

pub mod chat;
pub mod completions;
pub mod models;
pub mod tokenize;

use serde::de::{Deserializer, Error as _};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Token counts of a response (`usage`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` and no choices before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

impl StreamOptions {
    /// Whether a request streaming or not (`stream`) with these options ends its stream with a
    /// usage chunk; options on a request that does not stream are an error, as OpenAI's.
    pub fn include_usage(options: Option<&StreamOptions>, stream: bool) -> Result<bool, crate::ApiError> {
        match options {
            Some(_) if !stream => Err(crate::ApiError::invalid(
                "stream_options is only allowed when stream is true",
                Some("stream_options"),
            )),
            options => Ok(options.and_then(|o| o.include_usage).unwrap_or(false)),
        }
    }
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stop(pub Vec<String>);

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Null => Ok(Stop(Vec::new())),
            Value::String(s) => Ok(Stop(vec![s])),
            Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(D::Error::custom("stop must be a string or a list of strings")),
                })
                .collect::<Result<_, _>>()
                .map(Stop),
            _ => Err(D::Error::custom("stop must be a string or a list of strings")),
        }
    }
}

/// One prompt of a completion request.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// `prompt`: a string, a list of token ids, or a non-empty list of either (one choice set each).
#[derive(Debug, Clone, PartialEq)]
pub struct Prompts(pub Vec<PromptInput>);

const PROMPT_SHAPE: &str = "prompt must be a string, a list of token ids, or a list of strings or of token id lists";

fn token_ids<E: serde::de::Error>(items: &[Value]) -> Result<Vec<u32>, E> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| E::custom(format!("token ids must be integers in [0, {}], got {v}", u32::MAX)))
        })
        .collect()
}

impl<'de> Deserialize<'de> for Prompts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let items = match Value::deserialize(d)? {
            Value::String(s) => return Ok(Prompts(vec![PromptInput::Text(s)])),
            Value::Array(items) => items,
            _ => return Err(D::Error::custom(PROMPT_SHAPE)),
        };
        match items.first() {
            None => Err(D::Error::custom("prompt must not be an empty list")),
            Some(Value::Number(_)) => Ok(Prompts(vec![PromptInput::Ids(token_ids(&items)?)])),
            Some(_) => items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(PromptInput::Text(s.clone())),
                    Value::Array(ids) => Ok(PromptInput::Ids(token_ids(ids)?)),
                    _ => Err(D::Error::custom(PROMPT_SHAPE)),
                })
                .collect::<Result<_, _>>()
                .map(Prompts),
        }
    }
}

/// A request's `model` must be the served model's name; leaving it out means the served model.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), crate::ApiError> {
    match requested {
        Some(name) if name != served => Err(crate::ApiError::ModelNotFound(name.to_string())),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts(json: &str) -> Result<Vec<PromptInput>, String> {
        serde_json::from_str::<Prompts>(json).map(|p| p.0).map_err(|e| e.to_string())
    }

    #[test]
    fn every_prompt_shape_parses() {
        use PromptInput::{Ids, Text};
        assert_eq!(prompts(r#""hi""#), Ok(vec![Text("hi".into())]));
        assert_eq!(prompts("[1, 2, 3]"), Ok(vec![Ids(vec![1, 2, 3])]));
        assert_eq!(prompts(r#"["a", "b"]"#), Ok(vec![Text("a".into()), Text("b".into())]));
        assert_eq!(prompts("[[1], [2, 3]]"), Ok(vec![Ids(vec![1]), Ids(vec![2, 3])]));
        assert_eq!(prompts(r#"["a", [2]]"#), Ok(vec![Text("a".into()), Ids(vec![2])]));
    }

    #[test]
    fn bad_prompts_are_refused() {
        for bad in ["[]", "3", "{}", "[1, -2]", "[1, \"a\"]", "[1.5]", "[[1], 7]", "[4294967296]", "null"] {
            assert!(prompts(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn stop_is_a_string_or_a_list() {
        let stop = |json: &str| serde_json::from_str::<Stop>(json).map(|s| s.0).map_err(|e| e.to_string());
        assert_eq!(stop(r#""\n""#), Ok(vec!["\n".to_string()]));
        assert_eq!(stop(r#"["a", "b"]"#), Ok(vec!["a".to_string(), "b".to_string()]));
        assert!(stop("[1]").is_err());
        assert!(stop("5").is_err());
    }
}
