//! `POST /v1/chat/completions`: messages rendered with the model's chat template, `n` samples,
//! logprobs in the chat shape, streaming (a first chunk with the role, content deltas, a last
//! chunk with the finish reason).

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use ferrolm_engine::RequestOutput;
use ferrolm_sampling::MAX_LOGPROBS;
use ferrolm_tokenizer::Tokenizer;

use super::{request_id, unix_now};
use crate::chat_prompt::Conversation;
use crate::error::ApiError;
use crate::generation::{client_finish_reason, Generation};
use crate::json::ApiJson;
use crate::limits::PromptShape;
use crate::logprobs::chat_token_logprob;
use crate::protocol::chat::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatResponseMessage,
};
use crate::protocol::completions::UsageField;
use crate::protocol::{check_model, StreamOptions, Usage};
use crate::sse::{self, json_response, to_json, ChunkFormat};
use crate::state::SharedState;
use crate::structured;

struct Shape {
    id: String,
    created: u64,
    model: String,
    /// Top logprobs per token when logprobs were asked for.
    top_logprobs: Option<usize>,
    return_token_ids: bool,
    tokenizer: Arc<Tokenizer>,
}

pub async fn create(
    State(state): State<SharedState>,
    ApiJson(mut req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    check_model(req.model.as_deref(), &state.config.served_model_name)?;
    let logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !logprobs {
        return Err(ApiError::invalid("top_logprobs needs logprobs set to true", Some("top_logprobs")));
    }
    if let Some(top) = req.top_logprobs.filter(|&t| t > MAX_LOGPROBS) {
        return Err(ApiError::invalid(
            format!("top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}"),
            Some("top_logprobs"),
        ));
    }
    check_text_reply(&req)?;
    let stream = req.stream.unwrap_or(false);
    let include_usage = StreamOptions::include_usage(req.stream_options.as_ref(), stream)?;
    let mut sampling = req.take_sampling();
    let structured = sampling.take_structured()?;
    sampling.max_tokens = req.max_completion_tokens.or(sampling.max_tokens);
    sampling.logprobs = logprobs.then(|| req.top_logprobs.unwrap_or(0));
    // No route default: an unset length runs to the end of the context, as vLLM does.
    let mut sampling = sampling.resolve(&state.defaults, None)?;
    sampling.grammar = structured::compile(&state, structured).await?;
    let limits = &state.config.limits;
    let request_shape = PromptShape { num_prompts: 1, n: sampling.params.n as usize, echo_logprobs: false };
    limits.check_sequences(request_shape)?;
    let conversation = Conversation {
        messages: std::mem::take(&mut req.messages),
        add_generation_prompt: req.add_generation_prompt,
        continue_final_message: req.continue_final_message,
        tools: req.tools.take(),
        chat_template_kwargs: req.chat_template_kwargs.take(),
    };
    let (tokenizer, max_model_len) = (Arc::clone(&state.tokenizer), state.engine.max_model_len());
    let prompt = state.work.run(move || conversation.prompt_ids(&tokenizer, max_model_len)).await?;
    limits.check_prompt_tokens(request_shape, &[prompt.len()], true)?;
    let shape = Shape {
        id: request_id("chatcmpl"),
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        top_logprobs: logprobs.then(|| req.top_logprobs.unwrap_or(0) as usize),
        return_token_ids: req.return_token_ids.unwrap_or(false),
        tokenizer: Arc::clone(&state.tokenizer),
    };
    let mut generation = Generation::start(&state, shape.id.clone(), vec![prompt], &sampling)?;
    if stream {
        return Ok(sse::respond(generation, ChatStream { shape, include_usage }));
    }
    generation.run_to_end().await?;
    // Text and logprobs of every choice, decoded and serialized: off the async threads.
    state.work.run(move || Ok(json_response(to_json(&shape.response(&generation))?))).await
}

impl Shape {
    fn logprobs(&self, lps: &[ferrolm_sampling::TokenLogprobs]) -> Option<ChatLogprobs> {
        self.top_logprobs.map(|num_top| ChatLogprobs {
            content: lps.iter().map(|lp| chat_token_logprob(&self.tokenizer, lp, num_top)).collect(),
        })
    }

    fn response(&self, g: &Generation) -> ChatCompletionResponse {
        let choices = g
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| ChatChoice {
                index,
                message: ChatResponseMessage { role: "assistant", content: c.text.clone() },
                logprobs: self.logprobs(&c.logprobs),
                finish_reason: client_finish_reason(c.finish),
                prompt_token_ids: self.return_token_ids.then(|| g.prompts[g.prompt_of(index)].clone()),
                token_ids: self.return_token_ids.then(|| c.token_ids.clone()),
            })
            .collect();
        ChatCompletionResponse {
            id: self.id.clone(),
            object: "chat.completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: g.usage(),
        }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: UsageField) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

struct ChatStream {
    shape: Shape,
    include_usage: bool,
}

impl ChatStream {
    fn usage_field(&self) -> UsageField {
        if self.include_usage {
            UsageField::Null
        } else {
            UsageField::Absent
        }
    }
}

impl ChunkFormat for ChatStream {
    fn needs_prompt_logprobs(&self) -> bool {
        false
    }

    fn chunks(
        &mut self,
        g: &Generation,
        choice: usize,
        out: &RequestOutput,
        first: bool,
    ) -> Result<Vec<String>, ApiError> {
        let shape = &self.shape;
        let mut chunks = Vec::new();
        if first {
            let c = ChatChunkChoice {
                index: choice,
                delta: ChatDelta { role: Some("assistant"), content: Some(String::new()) },
                logprobs: None,
                finish_reason: None,
                prompt_token_ids: shape.return_token_ids.then(|| g.prompts[g.prompt_of(choice)].clone()),
                token_ids: shape.return_token_ids.then(Vec::new),
            };
            chunks.push(to_json(&shape.chunk(vec![c], self.usage_field()))?);
        }
        let finish_reason = client_finish_reason(out.finish_reason);
        let has_logprobs = shape.top_logprobs.is_some() && !out.logprobs.is_empty();
        if out.text.is_empty() && finish_reason.is_none() && !has_logprobs && !shape.return_token_ids {
            return Ok(chunks);
        }
        let c = ChatChunkChoice {
            index: choice,
            delta: ChatDelta { role: None, content: (!out.text.is_empty()).then(|| out.text.clone()) },
            logprobs: shape.logprobs(&out.logprobs),
            finish_reason,
            prompt_token_ids: None,
            token_ids: shape.return_token_ids.then(|| out.token_ids.clone()),
        };
        chunks.push(to_json(&shape.chunk(vec![c], self.usage_field()))?);
        Ok(chunks)
    }

    fn usage_chunk(&self, usage: Usage) -> Option<Result<String, ApiError>> {
        self.include_usage.then(|| to_json(&self.shape.chunk(Vec::new(), UsageField::Usage(usage))))
    }
}

/// The reply is free text: `response_format` may only ask for text and `tool_choice` only for
/// `"none"` or `"auto"` (tools reach the chat template, tool calls are not parsed out).
fn check_text_reply(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    use serde_json::Value;
    match &req.tool_choice {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s == "none" || s == "auto" => Ok(()),
        Some(choice) => {
            let message = format!("tool_choice {choice} is not supported: only \"none\" and \"auto\"");
            Err(ApiError::invalid(message, Some("tool_choice")))
        }
    }
}
