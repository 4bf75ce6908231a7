//! `POST /v1/chat/completions`: messages rendered with the model's chat template, `n` samples,
//! logprobs in the chat shape, streaming (a first chunk with the role, deltas, a last chunk with
//! the finish reason). Each choice's reply is read by `chat_output`: reasoning split off, tool
//! calls parsed out (`reading` decides how, from the request and the server's parsers).

mod reading;
mod stream;

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use ferrolm_engine::FinishReason;
use ferrolm_sampling::MAX_LOGPROBS;
use ferrolm_tokenizer::Tokenizer;

use super::{request_id, unix_now};
use crate::chat_output::{parse_message, tool_call_id, OutputParsing};
use crate::chat_prompt::Conversation;
use crate::error::ApiError;
use crate::generation::{client_finish_reason, Generation};
use crate::json::ApiJson;
use crate::limits::PromptShape;
use crate::logprobs::chat_token_logprob;
use crate::protocol::chat::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, FunctionCall, ToolCallMessage,
};
use crate::protocol::completions::UsageField;
use crate::protocol::{check_model, StreamOptions};
use crate::sse::{self, json_response, to_json};
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
    parsing: OutputParsing,
    /// Special tokens were kept in the text for the parsers: the end-of-sequence token's text
    /// is cut off the reply.
    cut_special_end: bool,
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
    let reply = reading::reply_reading(&req, &state)?;
    let stream = req.stream.unwrap_or(false);
    let include_usage = StreamOptions::include_usage(req.stream_options.as_ref(), stream)?;
    let mut sampling = req.take_sampling();
    let structured = reading::constraint(reply.schema, sampling.take_structured()?);
    let cut_special_end = reply.keep_special_tokens && sampling.skip_special_tokens.is_none();
    if cut_special_end {
        sampling.skip_special_tokens = Some(false);
    }
    sampling.max_tokens = req.max_completion_tokens.or(sampling.max_tokens);
    sampling.logprobs = logprobs.then(|| req.top_logprobs.unwrap_or(0));
    // No route default: an unset length runs to the end of the context, as vLLM does.
    let mut sampling = sampling.resolve(&state.defaults, None)?;
    let limits = &state.config.limits;
    let request_shape = PromptShape { num_prompts: 1, n: sampling.params.n as usize, echo_logprobs: false };
    limits.check_sequences(request_shape)?;
    // NOTE: after the checks that cost nothing: compiling a constraint can take milliseconds.
    sampling.grammar = structured::compile(&state, structured).await?;
    let conversation = Conversation {
        messages: std::mem::take(&mut req.messages),
        add_generation_prompt: req.add_generation_prompt,
        continue_final_message: req.continue_final_message,
        tools: req.tools.take(),
        chat_template_kwargs: req.chat_template_kwargs.take(),
    };
    let (tokenizer, max_model_len) = (Arc::clone(&state.tokenizer), state.engine.max_model_len());
    let prompt = state.work.run(move || conversation.prompt(&tokenizer, max_model_len)).await?;
    limits.check_prompt_tokens(request_shape, &[prompt.ids.len()], true)?;
    let reasoning = state.config.reasoning_parser;
    let parsing = OutputParsing {
        reasoning,
        starts_in_reasoning: reasoning.is_some_and(|r| r.starts_in_reasoning(&prompt.text)),
        tools: reply.tools,
    };
    let shape = Shape {
        id: request_id("chatcmpl"),
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        top_logprobs: logprobs.then(|| req.top_logprobs.unwrap_or(0) as usize),
        return_token_ids: req.return_token_ids.unwrap_or(false),
        tokenizer: Arc::clone(&state.tokenizer),
        parsing,
        cut_special_end,
    };
    let mut generation = Generation::start(&state, shape.id.clone(), vec![prompt.ids], &sampling)?;
    if stream {
        let num_choices = generation.choices.len();
        return Ok(sse::respond(generation, stream::ChatStream::new(shape, include_usage, num_choices)));
    }
    generation.run_to_end().await?;
    // Text and logprobs of every choice, decoded, parsed and serialized: off the async threads.
    state.work.run(move || Ok(json_response(to_json(&shape.response(&generation))?))).await
}

/// `tool_calls` when the message carries calls (unless the server aborted it).
fn finish_reason(reason: Option<FinishReason>, has_tool_calls: bool) -> Option<&'static str> {
    match reason {
        Some(FinishReason::Stop | FinishReason::Length) if has_tool_calls => Some("tool_calls"),
        other => client_finish_reason(other),
    }
}

impl Shape {
    fn logprobs(&self, lps: &[ferrolm_sampling::TokenLogprobs]) -> Option<ChatLogprobs> {
        self.top_logprobs.map(|num_top| ChatLogprobs {
            content: lps.iter().map(|lp| chat_token_logprob(&self.tokenizer, lp, num_top)).collect(),
        })
    }

    /// The reply's text for the parsers: with special tokens kept for them, a reply that ended
    /// on an end-of-sequence token would show it; it is cut off.
    fn visible<'t>(&self, text: &'t str, token_ids: &[u32], finish: Option<FinishReason>) -> &'t str {
        let last = token_ids.last().copied().filter(|&id| self.tokenizer.is_special(id));
        match last {
            Some(id) if self.cut_special_end && finish == Some(FinishReason::Stop) => {
                let special = self.tokenizer.decode(&[id], false).unwrap_or_default();
                text.strip_suffix(special.as_str()).unwrap_or(text)
            }
            _ => text,
        }
    }

    fn response(&self, g: &Generation) -> ChatCompletionResponse {
        let choices = g
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let parsed = parse_message(self.visible(&c.text, &c.token_ids, c.finish), &self.parsing);
                let tool_calls: Vec<ToolCallMessage> = parsed
                    .tool_calls
                    .into_iter()
                    .map(|call| ToolCallMessage {
                        id: tool_call_id(),
                        kind: "function",
                        function: FunctionCall { name: call.name, arguments: call.arguments },
                    })
                    .collect();
                ChatChoice {
                    index,
                    finish_reason: finish_reason(c.finish, !tool_calls.is_empty()),
                    message: ChatResponseMessage {
                        role: "assistant",
                        content: parsed.content,
                        reasoning_content: parsed.reasoning_content,
                        tool_calls,
                    },
                    logprobs: self.logprobs(&c.logprobs),
                    prompt_token_ids: self.return_token_ids.then(|| g.prompts[g.prompt_of(index)].clone()),
                    token_ids: self.return_token_ids.then(|| c.token_ids.clone()),
                }
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
