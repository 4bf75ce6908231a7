//! vLLM's `POST /tokenize` (text or chat messages to ids) and `POST /detokenize`, both on the
//! tokenizer threads. A text too long for the model's context by its bytes alone is refused
//! before it is tokenized.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;

use crate::chat_prompt::{self, ChatPromptOptions};
use crate::error::ApiError;
use crate::json::ApiJson;
use crate::limits::check_text_fits;
use crate::logprobs::token_text;
use crate::protocol::check_model;
use crate::protocol::tokenize::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse};
use crate::state::SharedState;

pub async fn tokenize(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    check_model(req.model.as_deref(), &state.config.served_model_name)?;
    let max_model_len = state.engine.max_model_len();
    let tokenizer = Arc::clone(&state.tokenizer);
    let response = state.work.run(move || tokenize_request(&tokenizer, &req, max_model_len)).await?;
    Ok(Json(response))
}

fn tokenize_request(
    tokenizer: &ferrolm_tokenizer::Tokenizer,
    req: &TokenizeRequest,
    max_model_len: usize,
) -> Result<TokenizeResponse, ApiError> {
    let tokens = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => {
            check_text_fits(tokenizer, prompt, max_model_len, "prompt")?;
            tokenizer.encode(prompt, req.add_special_tokens.unwrap_or(true))?
        }
        (None, Some(messages)) => {
            let options = ChatPromptOptions {
                add_generation_prompt: req.add_generation_prompt,
                continue_final_message: req.continue_final_message,
                tools: req.tools.as_ref(),
                chat_template_kwargs: req.chat_template_kwargs.as_ref(),
            };
            let text = chat_prompt::render(tokenizer, messages, options)?;
            check_text_fits(tokenizer, &text, max_model_len, "messages")?;
            tokenizer.encode(&text, req.add_special_tokens.unwrap_or(false))?
        }
        _ => return Err(ApiError::invalid("give exactly one of `prompt` and `messages`", Some("prompt"))),
    };
    let token_strs = req.return_token_strs.then(|| tokens.iter().map(|&id| token_text(tokenizer, id)).collect());
    Ok(TokenizeResponse { count: tokens.len(), max_model_len, tokens, token_strs })
}

pub async fn detokenize(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    check_model(req.model.as_deref(), &state.config.served_model_name)?;
    let tokenizer = Arc::clone(&state.tokenizer);
    let prompt = state.work.run(move || Ok(tokenizer.decode(&req.tokens, false)?)).await?;
    Ok(Json(DetokenizeResponse { prompt }))
}
