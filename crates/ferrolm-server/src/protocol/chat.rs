//! `POST /v1/chat/completions`: request, response and stream chunk.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::completions::UsageField;
use super::{StreamOptions, Usage};
use crate::params::sampling_request;

sampling_request! {
    /// With the sampling fields of `sampling_request!`; `max_tokens` is deprecated by OpenAI in
    /// favour of `max_completion_tokens`, which wins when both are set.
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct ChatCompletionRequest {
        pub model: Option<String>,
        /// Kept as JSON: the chat template sees every field the client sent (`name`, `tool_calls`).
        pub messages: Vec<Value>,
        pub max_completion_tokens: Option<u32>,
        pub logprobs: Option<bool>,
        pub top_logprobs: Option<u32>,
        pub stream: Option<bool>,
        pub stream_options: Option<StreamOptions>,
        pub return_token_ids: Option<bool>,
        /// End the prompt with the assistant header (default true).
        pub add_generation_prompt: Option<bool>,
        /// Let the model continue the last message instead of starting a new one.
        pub continue_final_message: Option<bool>,
        pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
        /// Functions the model may call: `[{"type": "function", "function": {"name", "description",
        /// "parameters"}}]`, given to the chat template.
        pub tools: Option<Value>,
        /// `"none"`, `"auto"` (the default with tools), `"required"` or
        /// `{"type": "function", "function": {"name": ...}}`.
        pub tool_choice: Option<Value>,
        /// Whether a reply may hold several calls (default true).
        pub parallel_tool_calls: Option<bool>,
        /// OpenAI's identifier of the end user: accepted, not used.
        pub user: Option<String>,
    }
}

#[derive(Debug, Serialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Serialize)]
pub struct ChatResponseMessage {
    pub role: &'static str,
    /// Null when the message holds only reasoning or tool calls.
    pub content: Option<String>,
    /// The model's thinking, when a reasoning parser is set (vLLM's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallMessage>,
}

/// A tool call of a response message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallMessage {
    /// `call_` and 24 random letters and digits.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A piece of a streamed tool call: the first one of a call has its `id`, `type` and name (and
/// empty arguments), the later ones fragments of its arguments.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}
