//! vLLM's `POST /tokenize` and `POST /detokenize`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Either `prompt` (text) or `messages` (a conversation rendered with the chat template).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Value>>,
    /// Defaults to true for `prompt` and false for `messages` (the template adds them).
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    pub tools: Option<Value>,
    #[serde(default)]
    pub return_token_strs: bool,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}
