//! How a chat request's replies are read: the tool calls they may hold (from `tools`,
//! `tool_choice`, `parallel_tool_calls` and the server's tool-call format), the reasoning split
//! off them, and what that asks of the request: the schema a call must be decoded under, and
//! whether special tokens must stay in the text for the markers to be seen.

use ferrolm_structured::StructuredOutput;
use ferrolm_tokenizer::Tokenizer;
use serde_json::Value;

use crate::chat_output::ToolOutput;
use crate::error::ApiError;
use crate::protocol::chat::ChatCompletionRequest;
use crate::state::AppState;
use crate::structured::Requested;
use crate::tool_calls::request::{parse_tool_choice, parse_tools};
use crate::tool_calls::schema::tool_choice_schema;
use crate::tool_calls::ToolChoice;

pub(super) struct ReplyReading {
    pub tools: ToolOutput,
    /// The schema that `tool_choice` `required` or a named function decodes the reply under.
    pub schema: Option<Value>,
    /// A marker of the tool-call format or of the reasoning parser is a special token of this
    /// tokenizer: the reply must be detokenized with special tokens kept.
    pub keep_special_tokens: bool,
}

pub(super) fn reply_reading(req: &ChatCompletionRequest, state: &AppState) -> Result<ReplyReading, ApiError> {
    let tools = parse_tools(req.tools.as_ref())?;
    let choice = parse_tool_choice(req.tool_choice.as_ref(), &tools)?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let schema = tool_choice_schema(&tools, &choice, parallel)?;
    let max_calls = (!parallel).then_some(1);
    let tools = match choice {
        ToolChoice::None => ToolOutput::Text,
        ToolChoice::Auto => match state.tool_call_parser {
            Some(parser) if !tools.is_empty() => ToolOutput::Auto { parser, max_calls },
            _ => ToolOutput::Text,
        },
        ToolChoice::Required => ToolOutput::Required { max_calls },
        ToolChoice::Named(name) => ToolOutput::Named(name),
    };
    let mut markers: Vec<&str> = match &tools {
        ToolOutput::Auto { parser, .. } => parser.markers().to_vec(),
        _ => Vec::new(),
    };
    if let Some(reasoning) = state.config.reasoning_parser {
        markers.extend(reasoning.markers());
    }
    let keep_special_tokens = markers.iter().any(|m| is_special_token(&state.tokenizer, m));
    Ok(ReplyReading { tools, schema, keep_special_tokens })
}

fn is_special_token(tokenizer: &Tokenizer, text: &str) -> bool {
    tokenizer.token_to_id(text).is_some_and(|id| tokenizer.is_special(id))
}

/// The constraint a request's reply is decoded under: `tool_choice` `required` or a named
/// function wins over `response_format` and `structured_outputs` (the reply must parse as the
/// calls), as in vLLM.
pub(super) fn constraint(tool_schema: Option<Value>, requested: Option<Requested>) -> Option<Requested> {
    match tool_schema {
        Some(schema) => Some(Requested { output: StructuredOutput::JsonSchema(schema), param: "tools" }),
        None => requested,
    }
}
