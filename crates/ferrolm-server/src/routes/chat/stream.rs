//! A streamed chat completion's chunks, in OpenAI's shape: a first chunk per choice with the
//! role, then per engine output the deltas its text decides (reasoning and content in one
//! chunk, then one chunk per tool-call delta: a call's header with its id, type and name, then
//! fragments of its arguments), the output's logprobs on the first of them and the finish
//! reason on the last.

use ferrolm_engine::RequestOutput;

use super::{finish_reason, Shape};
use crate::chat_output::{tool_call_id, ChoiceDelta, ChoiceParser};
use crate::error::ApiError;
use crate::generation::Generation;
use crate::protocol::chat::{ChatChunkChoice, ChatDelta, FunctionDelta, ToolCallDelta};
use crate::protocol::completions::UsageField;
use crate::protocol::Usage;
use crate::sse::{to_json, ChunkFormat};

pub(super) struct ChatStream {
    shape: Shape,
    include_usage: bool,
    /// Each choice's parser state.
    parsers: Vec<ChoiceParser>,
}

impl ChatStream {
    pub(super) fn new(shape: Shape, include_usage: bool, num_choices: usize) -> ChatStream {
        let parsers = (0..num_choices).map(|_| ChoiceParser::new(&shape.parsing)).collect();
        ChatStream { shape, include_usage, parsers }
    }

    fn usage_field(&self) -> UsageField {
        UsageField::of_content_chunk(self.include_usage)
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
        let mut choices = Vec::new();
        if first {
            choices.push(ChatChunkChoice {
                index: choice,
                delta: ChatDelta { role: Some("assistant"), content: Some(String::new()), ..ChatDelta::default() },
                logprobs: None,
                finish_reason: None,
                prompt_token_ids: shape.return_token_ids.then(|| g.prompts[g.prompt_of(choice)].clone()),
                token_ids: shape.return_token_ids.then(Vec::new),
            });
        }
        let parser = &mut self.parsers[choice];
        let mut step = parser.push(shape.visible(&out.text, &out.token_ids, out.finish_reason));
        if out.finish_reason.is_some() {
            let rest = parser.finish();
            step.reasoning.push_str(&rest.reasoning);
            step.content.push_str(&rest.content);
            step.tool_calls.extend(rest.tool_calls);
        }
        let reason = finish_reason(out.finish_reason, parser.has_tool_calls());
        let mut deltas = chat_deltas(step);
        let has_logprobs = shape.top_logprobs.is_some() && !out.logprobs.is_empty();
        if deltas.is_empty() && (reason.is_some() || has_logprobs || shape.return_token_ids) {
            deltas.push(ChatDelta::default());
        }
        let last = deltas.len().saturating_sub(1);
        for (k, delta) in deltas.into_iter().enumerate() {
            choices.push(ChatChunkChoice {
                index: choice,
                delta,
                logprobs: if k == 0 { shape.logprobs(&out.logprobs) } else { None },
                finish_reason: if k == last { reason } else { None },
                prompt_token_ids: None,
                token_ids: (shape.return_token_ids && k == 0).then(|| out.token_ids.clone()),
            });
        }
        choices.into_iter().map(|c| to_json(&shape.chunk(vec![c], self.usage_field()))).collect()
    }

    fn usage_chunk(&self, usage: Usage) -> Option<Result<String, ApiError>> {
        self.include_usage.then(|| to_json(&self.shape.chunk(Vec::new(), UsageField::Usage(usage))))
    }
}

/// A step's deltas in OpenAI's shape: reasoning and content together, then each call delta.
fn chat_deltas(step: ChoiceDelta) -> Vec<ChatDelta> {
    let mut deltas = Vec::new();
    if !step.reasoning.is_empty() || !step.content.is_empty() {
        deltas.push(ChatDelta {
            content: (!step.content.is_empty()).then_some(step.content),
            reasoning_content: (!step.reasoning.is_empty()).then_some(step.reasoning),
            ..ChatDelta::default()
        });
    }
    for call in step.tool_calls {
        let header = call.name.is_some();
        let delta = ToolCallDelta {
            index: call.index,
            id: header.then(tool_call_id),
            kind: header.then_some("function"),
            function: FunctionDelta { name: call.name, arguments: call.arguments },
        };
        deltas.push(ChatDelta { tool_calls: Some(vec![delta]), ..ChatDelta::default() });
    }
    deltas
}
