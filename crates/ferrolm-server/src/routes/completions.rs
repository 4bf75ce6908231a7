//! `POST /v1/completions`: prompts as text or token ids (one or several), `n` samples each,
//! optional echo of the prompt, logprobs in the legacy list shape, streaming.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use ferrolm_engine::RequestOutput;
use ferrolm_tokenizer::Tokenizer;

use super::{request_id, unix_now};
use crate::error::ApiError;
use crate::generation::{client_finish_reason, Generation};
use crate::json::ApiJson;
use crate::limits::{check_text_fits, encode_within, PromptShape};
use crate::logprobs::CompletionLogprobsBuilder;
use crate::protocol::completions::{
    CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse, UsageField,
};
use crate::protocol::{check_model, PromptInput, StreamOptions, Usage};
use crate::sse::{self, json_response, to_json, ChunkFormat};
use crate::state::SharedState;
use crate::structured;

/// OpenAI's default length for this route, when neither the client nor the model chose one.
const DEFAULT_MAX_TOKENS: u32 = 16;

/// What shapes the choices of one request besides the engine's outputs.
struct Shape {
    id: String,
    created: u64,
    model: String,
    echo: bool,
    /// The text echoed for each prompt (the prompt's own text, or its ids decoded).
    prompt_texts: Vec<String>,
    logprobs: bool,
    return_token_ids: bool,
    tokenizer: Arc<Tokenizer>,
}

pub async fn create(
    State(state): State<SharedState>,
    ApiJson(mut req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    check_model(req.model.as_deref(), &state.config.served_model_name)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix is not supported", Some("suffix")));
    }
    if req.best_of.is_some_and(|b| b != req.n.unwrap_or(1)) {
        return Err(ApiError::invalid("best_of is not supported (other than equal to n)", Some("best_of")));
    }
    let echo = req.echo.unwrap_or(false);
    let stream = req.stream.unwrap_or(false);
    let include_usage = StreamOptions::include_usage(req.stream_options.as_ref(), stream)?;
    let mut sampling = req.take_sampling();
    let structured = sampling.take_structured()?;
    sampling.logprobs = req.logprobs;
    sampling.prompt_logprobs = if echo { req.logprobs } else { None };
    let mut sampling = sampling.resolve(&state.defaults, Some(DEFAULT_MAX_TOKENS))?;

    let limits = &state.config.limits;
    let request_shape = PromptShape {
        num_prompts: req.prompt.0.len(),
        n: sampling.params.n as usize,
        echo_logprobs: sampling.params.prompt_logprobs.is_some(),
    };
    limits.check_sequences(request_shape)?;
    let tokenizer = Arc::clone(&state.tokenizer);
    let max_model_len = state.engine.max_model_len();
    let at_least = req
        .prompt
        .0
        .iter()
        .map(|prompt| match prompt {
            PromptInput::Text(text) => check_text_fits(&tokenizer, text, max_model_len, "prompt"),
            PromptInput::Ids(ids) => Ok(ids.len()),
        })
        .collect::<Result<Vec<_>, _>>()?;
    limits.check_prompt_tokens(request_shape, &at_least, false)?;
    // NOTE: after the checks that cost nothing: compiling a constraint can take milliseconds.
    sampling.grammar = structured::compile(&state, structured).await?;
    let skip_special_tokens = sampling.params.skip_special_tokens;
    let (prompts, prompt_texts) = state
        .work
        .run({
            let tokenizer = Arc::clone(&tokenizer);
            move || tokenize_prompts(&tokenizer, req.prompt.0, echo.then_some(skip_special_tokens), max_model_len)
        })
        .await?;
    limits.check_prompt_tokens(request_shape, &prompts.iter().map(Vec::len).collect::<Vec<_>>(), true)?;
    let shape = Shape {
        id: request_id("cmpl"),
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        echo,
        prompt_texts,
        logprobs: req.logprobs.is_some(),
        return_token_ids: req.return_token_ids.unwrap_or(false),
        tokenizer,
    };
    let mut generation = Generation::start(&state, shape.id.clone(), prompts, &sampling)?;
    if stream {
        let builders = (0..generation.choices.len()).map(|_| CompletionLogprobsBuilder::new()).collect();
        return Ok(sse::respond(generation, CompletionStream { shape, include_usage, builders }));
    }
    generation.run_to_end().await?;
    // Text and logprobs of every choice, decoded and serialized: off the async threads.
    state.work.run(move || Ok(json_response(to_json(&shape.response(&generation))?))).await
}

/// Each prompt's ids (a text surely longer than the context is refused with work bounded by
/// the context) and the text an echo shows (decoded from ids with `decode_echo`'s
/// `skip_special_tokens`; empty without an echo).
fn tokenize_prompts(
    tokenizer: &Tokenizer,
    prompts: Vec<PromptInput>,
    decode_echo: Option<bool>,
    max_model_len: usize,
) -> Result<(Vec<Vec<u32>>, Vec<String>), ApiError> {
    let mut ids = Vec::with_capacity(prompts.len());
    let mut texts = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        match prompt {
            PromptInput::Text(text) => {
                ids.push(encode_within(tokenizer, &text, true, max_model_len, "prompt")?);
                texts.push(text);
            }
            PromptInput::Ids(prompt_ids) => {
                let text = match decode_echo {
                    Some(skip_special_tokens) => tokenizer.decode(&prompt_ids, skip_special_tokens)?,
                    None => String::new(),
                };
                ids.push(prompt_ids);
                texts.push(text);
            }
        }
    }
    Ok((ids, texts))
}

impl Shape {
    fn response(&self, g: &Generation) -> CompletionResponse {
        let choices = g
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let p = g.prompt_of(index);
                let mut text = if self.echo { self.prompt_texts[p].clone() } else { String::new() };
                text.push_str(&c.text);
                let logprobs = self.logprobs.then(|| {
                    let mut b = CompletionLogprobsBuilder::new();
                    if self.echo {
                        let prompt_logprobs = g.prompt_logprobs[p].as_deref().unwrap_or_default();
                        b.push_prompt(&self.tokenizer, &g.prompts[p], prompt_logprobs);
                    }
                    for lp in &c.logprobs {
                        b.push(&self.tokenizer, lp);
                    }
                    b.take()
                });
                CompletionChoice {
                    index,
                    text,
                    logprobs,
                    finish_reason: client_finish_reason(c.finish),
                    prompt_token_ids: self.return_token_ids.then(|| g.prompts[p].clone()),
                    token_ids: self.return_token_ids.then(|| c.token_ids.clone()),
                }
            })
            .collect();
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: g.usage(),
        }
    }

    fn chunk(&self, choices: Vec<CompletionChoice>, usage: UsageField) -> CompletionChunk {
        CompletionChunk {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

struct CompletionStream {
    shape: Shape,
    include_usage: bool,
    /// Per choice: logprobs with their running text offset.
    builders: Vec<CompletionLogprobsBuilder>,
}

impl CompletionStream {
    fn usage_field(&self) -> UsageField {
        UsageField::of_content_chunk(self.include_usage)
    }
}

impl ChunkFormat for CompletionStream {
    fn needs_prompt_logprobs(&self) -> bool {
        self.shape.echo && self.shape.logprobs
    }

    fn chunks(
        &mut self,
        g: &Generation,
        choice: usize,
        out: &RequestOutput,
        first: bool,
    ) -> Result<Vec<String>, ApiError> {
        let shape = &self.shape;
        let p = g.prompt_of(choice);
        let mut chunks = Vec::new();
        if first && (shape.echo || shape.return_token_ids) {
            // The echoed prompt is a chunk of its own, ahead of the first generated text.
            let logprobs = (shape.echo && shape.logprobs).then(|| {
                let b = &mut self.builders[choice];
                b.push_prompt(&shape.tokenizer, &g.prompts[p], g.prompt_logprobs[p].as_deref().unwrap_or_default());
                b.take()
            });
            let text = if shape.echo { shape.prompt_texts[p].clone() } else { String::new() };
            let c = CompletionChoice {
                index: choice,
                text,
                logprobs,
                finish_reason: None,
                prompt_token_ids: shape.return_token_ids.then(|| g.prompts[p].clone()),
                token_ids: shape.return_token_ids.then(Vec::new),
            };
            chunks.push(to_json(&shape.chunk(vec![c], self.usage_field()))?);
        }
        let finish_reason = client_finish_reason(out.finish_reason);
        if out.text.is_empty() && finish_reason.is_none() && !shape.logprobs && !shape.return_token_ids {
            return Ok(chunks);
        }
        let logprobs = shape.logprobs.then(|| {
            let b = &mut self.builders[choice];
            for lp in &out.logprobs {
                b.push(&shape.tokenizer, lp);
            }
            b.take()
        });
        let c = CompletionChoice {
            index: choice,
            text: out.text.clone(),
            logprobs,
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
