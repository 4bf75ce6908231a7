//! Tool calls parsed while a reply streams: each text delta in, the content and call deltas
//! that it decides out.
//!
//! [`ToolCallStream`] re-reads the reply so far at every delta (a format's scan is a linear
//! pass, and replies are short next to the model's time per token) and sends what that reading
//! adds to what was already sent. The rules of `pieces` make every reading's content a prefix
//! of the next one's, and its calls a prefix of the next one's calls.

use super::pieces::{scan, view};
use super::ToolCallFormat;

/// One step's output: new content, and new calls or argument fragments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamDelta {
    pub content: String,
    pub calls: Vec<CallDelta>,
}

/// A call's first delta has its `name` (and no arguments); later ones extend its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallDelta {
    /// The call's position in the reply's calls.
    pub index: usize,
    pub name: Option<String>,
    pub arguments: String,
}

pub struct ToolCallStream {
    format: &'static dyn ToolCallFormat,
    text: String,
    /// The content sent so far.
    content: String,
    /// Bytes of each sent call's arguments sent so far.
    args_sent: Vec<usize>,
    max_calls: usize,
}

impl ToolCallStream {
    /// `max_calls` (1 when parallel tool calls are off) sends the first calls only.
    pub fn new(format: &'static dyn ToolCallFormat, max_calls: Option<usize>) -> ToolCallStream {
        ToolCallStream {
            format,
            text: String::new(),
            content: String::new(),
            args_sent: Vec::new(),
            max_calls: max_calls.unwrap_or(usize::MAX),
        }
    }

    pub fn push(&mut self, delta: &str) -> StreamDelta {
        if delta.is_empty() {
            return StreamDelta::default();
        }
        self.text.push_str(delta);
        self.step(false)
    }

    /// The reply ended: what was held back is decided.
    pub fn finish(&mut self) -> StreamDelta {
        self.step(true)
    }

    /// Whether a call was sent.
    pub fn has_calls(&self) -> bool {
        !self.args_sent.is_empty()
    }

    fn step(&mut self, at_end: bool) -> StreamDelta {
        let pieces = scan(self.format, &self.text, at_end);
        let view = view(&self.text, &pieces, at_end);
        let mut out = StreamDelta::default();
        if let Some(new) = view.content.strip_prefix(self.content.as_str()) {
            out.content = new.to_string();
            self.content.push_str(new);
        } else {
            // NOTE: cannot happen by the content rules; sending nothing beats resending text.
            tracing::error!(sent = %self.content, now = %view.content, "tool call stream: content went back");
        }
        for (index, call) in view.calls.iter().enumerate().take(self.max_calls) {
            if index == self.args_sent.len() {
                out.calls.push(CallDelta { index, name: Some(call.name.to_string()), arguments: String::new() });
                self.args_sent.push(0);
            }
            let sent = self.args_sent[index];
            match call.arguments.get(sent..) {
                Some("") => {}
                Some(more) => {
                    out.calls.push(CallDelta { index, name: None, arguments: more.to_string() });
                    self.args_sent[index] = call.arguments.len();
                }
                None => tracing::error!(index, "tool call stream: arguments went back"),
            }
        }
        out
    }
}

/// The reply to a named `tool_choice`: the whole reply is the arguments of that one call.
pub struct NamedCallStream {
    name: String,
    text: String,
    sent: usize,
    announced: bool,
}

impl NamedCallStream {
    pub fn new(name: String) -> NamedCallStream {
        NamedCallStream { name, text: String::new(), sent: 0, announced: false }
    }

    pub fn push(&mut self, delta: &str) -> StreamDelta {
        self.text.push_str(delta);
        self.step()
    }

    pub fn finish(&mut self) -> StreamDelta {
        self.step()
    }

    /// The arguments of the whole reply: its text without surrounding whitespace.
    pub fn arguments(text: &str) -> &str {
        text.trim()
    }

    fn step(&mut self) -> StreamDelta {
        let mut out = StreamDelta::default();
        if !self.announced {
            self.announced = true;
            out.calls.push(CallDelta { index: 0, name: Some(self.name.clone()), arguments: String::new() });
        }
        // Trailing whitespace waits: it is kept only if more arguments follow it.
        let args = self.text.trim();
        let start = self.text.len() - self.text.trim_start().len();
        let end = start + args.len();
        if end > start + self.sent {
            out.calls.push(CallDelta {
                index: 0,
                name: None,
                arguments: self.text[start + self.sent..end].to_string(),
            });
            self.sent = args.len();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_calls::ToolCallParser;

    #[test]
    fn a_call_is_sent_once_its_block_is_complete() {
        let mut stream = ToolCallStream::new(ToolCallParser::Hermes.format(), None);
        let mut out = Vec::new();
        for piece in ["Sure.\n<tool_", "call>\n{\"name\": \"f\", \"argu", "ments\": {\"a\": ", "[1, 2]}}\n</tool_call>"]
        {
            out.push(stream.push(piece));
        }
        out.push(stream.finish());
        let content: Vec<&str> = out.iter().map(|d| d.content.as_str()).collect();
        assert_eq!(content, ["Sure.", "", "", "", ""]);
        assert!(out[..3].iter().all(|d| d.calls.is_empty()));
        assert_eq!(
            out[3].calls,
            [
                CallDelta { index: 0, name: Some("f".into()), arguments: String::new() },
                CallDelta { index: 0, name: None, arguments: "{\"a\": [1, 2]}".into() },
            ]
        );
        assert_eq!(out[4], StreamDelta::default());
        assert!(stream.has_calls());
    }

    #[test]
    fn a_second_call_is_not_sent_without_parallel_calls() {
        let mut stream = ToolCallStream::new(ToolCallParser::Hermes.format(), Some(1));
        let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
        let mut deltas = stream.push(text).calls;
        deltas.extend(stream.finish().calls);
        let names: Vec<_> = deltas.iter().filter_map(|d| d.name.as_deref()).collect();
        assert_eq!(names, ["a"]);
    }

    #[test]
    fn a_named_call_is_the_whole_reply() {
        let mut stream = NamedCallStream::new("f".into());
        let mut args = String::new();
        let mut names = Vec::new();
        for piece in [" ", "{\"a\"", ": 1", "}", "\n", ""] {
            for d in stream.push(piece).calls.into_iter().chain(stream.finish().calls) {
                names.extend(d.name);
                args.push_str(&d.arguments);
            }
        }
        assert_eq!(names, ["f"]);
        assert_eq!(args, NamedCallStream::arguments(" {\"a\": 1}\n"));
    }
}
