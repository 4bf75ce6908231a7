//! `POST /v1/completions`: request, response and stream chunk.

use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

use super::{Prompts, StreamOptions, Usage};
use crate::params::sampling_request;

sampling_request! {
    /// OpenAI's default length for this route is 16 (`max_tokens`, with the other sampling fields
    /// in `sampling_request!`).
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct CompletionRequest {
        pub model: Option<String>,
        pub prompt: Prompts,
        /// Top logprobs per token, 0..=20 (the chosen token's logprob is always given).
        pub logprobs: Option<u32>,
        /// Prepend the prompt to the text (with its logprobs when `logprobs` is set).
        pub echo: Option<bool>,
        pub stream: Option<bool>,
        pub stream_options: Option<StreamOptions>,
        /// vLLM: add `prompt_token_ids` and `token_ids` to each choice.
        pub return_token_ids: Option<bool>,
        pub best_of: Option<u32>,
        pub suffix: Option<String>,
        /// OpenAI's identifier of the end user: accepted, not used.
        pub user: Option<String>,
    }
}

#[derive(Debug, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

#[derive(Debug, Default, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// One chunk of a streamed completion; `usage` is present (as `null` until the last chunk)
/// only when the client asked for it.
#[derive(Debug, Serialize)]
pub struct CompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

/// The legacy completions logprobs: parallel lists, one entry per token.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// `null` for the first prompt token (nothing predicts it).
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<TopLogprobMap>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

/// `{token: logprob}` in descending order of logprob. Tokens whose text is the same as an
/// earlier entry's keep only the first (higher) one, so that the JSON object has unique keys.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, logprob) in &self.0 {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

/// A chunk's `usage`: left out, `null`, or the counts.
#[derive(Debug, Clone, PartialEq)]
pub enum UsageField {
    Absent,
    Null,
    Usage(Usage),
}

impl UsageField {
    /// A content chunk's `usage`: `null` when the client asked for usage (it comes in a chunk
    /// of its own at the end), else left out.
    pub fn of_content_chunk(include_usage: bool) -> UsageField {
        if include_usage {
            UsageField::Null
        } else {
            UsageField::Absent
        }
    }

    pub fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl Serialize for UsageField {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Absent | UsageField::Null => s.serialize_none(),
            UsageField::Usage(u) => u.serialize(s),
        }
    }
}
