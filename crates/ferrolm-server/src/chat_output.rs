//! From a chat choice's generated text to the assistant's message: reasoning split off first
//! (when a reasoning parser is set), then tool calls parsed out of the rest, the content.
//!
//! [`parse_message`] does it for a finished choice, [`ChoiceParser`] delta by delta for a
//! stream; fed the same text, the stream's deltas add up to the whole message.

use rand::distr::{Alphanumeric, SampleString};

use crate::reasoning::{self, ReasoningParser, ReasoningStream};
use crate::tool_calls::{self, CallDelta, NamedCallStream, ToolCall, ToolCallParser, ToolCallStream};

/// How a request's replies are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputParsing {
    pub reasoning: Option<ReasoningParser>,
    /// The prompt left the thinking block open (see [`ReasoningParser::starts_in_reasoning`]).
    pub starts_in_reasoning: bool,
    pub tools: ToolOutput,
}

impl OutputParsing {
    /// Plain text: no reasoning split, no tool calls.
    pub fn text() -> OutputParsing {
        OutputParsing { reasoning: None, starts_in_reasoning: false, tools: ToolOutput::Text }
    }
}

/// What tool calls a reply may hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolOutput {
    /// None: the content is the text.
    Text,
    /// Calls in the model's own format (`tool_choice: "auto"`).
    Auto { parser: ToolCallParser, max_calls: Option<usize> },
    /// The JSON array `tool_choice: "required"` is decoded into.
    Required { max_calls: Option<usize> },
    /// The whole reply is the arguments of this function.
    Named(String),
}

/// An assistant message, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedMessage {
    pub reasoning_content: Option<String>,
    /// `None` when there is no text besides reasoning or calls.
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

/// A fresh tool call id: `call_` and 24 random letters and digits.
pub fn tool_call_id() -> String {
    format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

/// The message a finished choice's text makes.
pub fn parse_message(text: &str, parsing: &OutputParsing) -> ParsedMessage {
    let (reasoning, text) = match parsing.reasoning {
        Some(_) => {
            let split = reasoning::split(text, parsing.starts_in_reasoning);
            (Some(split.reasoning), split.content)
        }
        None => (None, text.to_string()),
    };
    let (content, tool_calls) = match &parsing.tools {
        ToolOutput::Text => (text, Vec::new()),
        ToolOutput::Auto { parser, max_calls } => {
            let parsed = tool_calls::parse(parser.format(), &text, *max_calls);
            (parsed.content, parsed.calls)
        }
        ToolOutput::Required { max_calls } => {
            let parsed = tool_calls::parse(tool_calls::required_format(), &text, *max_calls);
            (parsed.content, parsed.calls)
        }
        ToolOutput::Named(name) => {
            let arguments = NamedCallStream::arguments(&text).to_string();
            (String::new(), vec![ToolCall { name: name.clone(), arguments }])
        }
    };
    let reasoning_content = reasoning.filter(|r| !r.is_empty());
    let content = (!content.is_empty() || (tool_calls.is_empty() && reasoning_content.is_none())).then_some(content);
    ParsedMessage { reasoning_content, content, tool_calls }
}

/// One step of a streamed choice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChoiceDelta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<CallDelta>,
}

impl ChoiceDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
}

enum ToolStream {
    Text,
    Calls(ToolCallStream),
    Named(NamedCallStream),
}

/// A streamed choice's parser state: each choice of a request has its own.
pub struct ChoiceParser {
    reasoning: Option<ReasoningStream>,
    tools: ToolStream,
}

impl ChoiceParser {
    pub fn new(parsing: &OutputParsing) -> ChoiceParser {
        let tools = match &parsing.tools {
            ToolOutput::Text => ToolStream::Text,
            ToolOutput::Auto { parser, max_calls } => {
                ToolStream::Calls(ToolCallStream::new(parser.format(), *max_calls))
            }
            ToolOutput::Required { max_calls } => {
                ToolStream::Calls(ToolCallStream::new(tool_calls::required_format(), *max_calls))
            }
            ToolOutput::Named(name) => ToolStream::Named(NamedCallStream::new(name.clone())),
        };
        let reasoning = parsing.reasoning.map(|_| ReasoningStream::new(parsing.starts_in_reasoning));
        ChoiceParser { reasoning, tools }
    }

    /// The deltas that `text`, the choice's next piece, decides.
    pub fn push(&mut self, text: &str) -> ChoiceDelta {
        let (reasoning, content) = match &mut self.reasoning {
            Some(stream) => {
                let split = stream.push(text);
                (split.reasoning, split.content)
            }
            None => (String::new(), text.to_string()),
        };
        let mut delta = self.push_content(&content, false);
        delta.reasoning = reasoning;
        delta
    }

    /// The choice ended: whatever was held back.
    pub fn finish(&mut self) -> ChoiceDelta {
        let (reasoning, content) = match &mut self.reasoning {
            Some(stream) => {
                let split = stream.finish();
                (split.reasoning, split.content)
            }
            None => (String::new(), String::new()),
        };
        let mut delta = self.push_content(&content, true);
        delta.reasoning = reasoning;
        delta
    }

    /// Whether a tool call was sent: the choice then finishes with `tool_calls`.
    pub fn has_tool_calls(&self) -> bool {
        match &self.tools {
            ToolStream::Text => false,
            ToolStream::Calls(stream) => stream.has_calls(),
            ToolStream::Named(_) => true,
        }
    }

    fn push_content(&mut self, content: &str, finish: bool) -> ChoiceDelta {
        let step = match &mut self.tools {
            ToolStream::Text => return ChoiceDelta { content: content.to_string(), ..ChoiceDelta::default() },
            ToolStream::Calls(stream) => merge(stream.push(content), finish.then(|| stream.finish())),
            ToolStream::Named(stream) => merge(stream.push(content), finish.then(|| stream.finish())),
        };
        ChoiceDelta { reasoning: String::new(), content: step.content, tool_calls: step.calls }
    }
}

fn merge(mut a: tool_calls::StreamDelta, b: Option<tool_calls::StreamDelta>) -> tool_calls::StreamDelta {
    if let Some(b) = b {
        a.content.push_str(&b.content);
        a.calls.extend(b.calls);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsing(reasoning: Option<ReasoningParser>, tools: ToolOutput) -> OutputParsing {
        OutputParsing { reasoning, starts_in_reasoning: false, tools }
    }

    #[test]
    fn ids_look_like_openai_ids() {
        let id = tool_call_id();
        assert_eq!(id.len(), 29);
        assert!(id.starts_with("call_") && id[5..].chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
        assert_ne!(id, tool_call_id());
    }

    #[test]
    fn content_is_null_only_beside_reasoning_or_calls() {
        let text = OutputParsing::text();
        assert_eq!(parse_message("", &text).content.as_deref(), Some(""));
        let qwen =
            parsing(Some(ReasoningParser::Qwen3), ToolOutput::Auto { parser: ToolCallParser::Hermes, max_calls: None });
        let m = parse_message(
            "<think>\nPlan.\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
            &qwen,
        );
        assert_eq!(m.reasoning_content.as_deref(), Some("Plan.\n"));
        assert_eq!(m.content, None);
        assert_eq!(m.tool_calls, [ToolCall { name: "f".into(), arguments: "{}".into() }]);
        let m = parse_message("Hello", &qwen);
        assert_eq!((m.reasoning_content, m.content.as_deref()), (None, Some("Hello")));
    }

    #[test]
    fn a_named_choice_is_one_call() {
        let named = parsing(None, ToolOutput::Named("get_weather".into()));
        let m = parse_message("{\"city\": \"Paris\"}", &named);
        assert_eq!(m.content, None);
        assert_eq!(m.tool_calls, [ToolCall { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() }]);
        assert!(ChoiceParser::new(&named).has_tool_calls());
    }
}
