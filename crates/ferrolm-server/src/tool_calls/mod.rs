//! Tool calls in a model's output: the formats models write them in, parsed out of the whole
//! text of a reply and incrementally while it streams, and the request side (`tools`,
//! `tool_choice`, the schema that `required` and a named function are decoded under).
//!
//! Formats (vLLM's `--tool-call-parser` names), one file each, all behind [`ToolCallFormat`]:
//! - `llama3_json`: `{"name": ..., "parameters": {...}}` at the start of the reply or after
//!   `<|python_tag|>`, several separated by `;`;
//! - `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
//!   (Hermes, Qwen2.5, Qwen3);
//! - `mistral`: `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`, or
//!   `[TOOL_CALLS]name[ARGS]{...}`;
//! - and the JSON array that `tool_choice: "required"` is decoded into (`required.rs`).
//!
//! What holds for every format:
//! - A call is `{name, arguments}`, the arguments the JSON text the model wrote for them.
//! - Text outside calls is content. Whitespace between content and a call is dropped, and so
//!   is text after a call that is only whitespace; a reply without calls is left as it is.
//! - A call that is not well formed (bad JSON, an unknown key, no name) stays in the content as
//!   the text it was: nothing is lost and no error is raised.
//! - Streaming ([`ToolCallStream`]) gives, chunk by chunk, exactly what the whole text gives
//!   ([`parse`]), for any reply and any split: text that might still become a call is held back
//!   until that is decided, so no markup leaks into content and a call that turns out malformed
//!   (or is cut off) is sent as the text it was. A call is sent once its block is complete: its
//!   name, then its arguments.

mod call_object;
mod hermes;
pub mod json_scan;
mod llama3_json;
mod mistral;
mod pieces;
pub mod request;
mod required;
pub mod schema;
mod stream;

pub use pieces::{parse, ParsedCalls};
pub use request::{Tool, ToolChoice};
pub use stream::{CallDelta, NamedCallStream, StreamDelta, ToolCallStream};

use call_object::CallSpan;

/// A tool call parsed out of a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (an object).
    pub arguments: String,
}

/// The tool-call formats a server can parse, by vLLM's `--tool-call-parser` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallParser {
    Llama3Json,
    Hermes,
    Mistral,
}

impl ToolCallParser {
    pub const NAMES: [&'static str; 3] = ["llama3_json", "hermes", "mistral"];

    /// The parser of a `--tool-call-parser` name.
    pub fn from_name(name: &str) -> Result<ToolCallParser, String> {
        match name {
            "llama3_json" => Ok(ToolCallParser::Llama3Json),
            "hermes" => Ok(ToolCallParser::Hermes),
            "mistral" => Ok(ToolCallParser::Mistral),
            other => Err(format!("unknown tool call parser {other:?}: known ones are {}", Self::NAMES.join(", "))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolCallParser::Llama3Json => "llama3_json",
            ToolCallParser::Hermes => "hermes",
            ToolCallParser::Mistral => "mistral",
        }
    }

    /// The format a chat template teaches its model, read from the template's text: `<tool_call>`
    /// is Hermes', `[TOOL_CALLS]` Mistral's, `<|python_tag|>` or Llama 3.1's JSON instructions
    /// Llama's.
    pub fn detect(template: &str) -> Option<ToolCallParser> {
        if template.contains("<tool_call>") {
            Some(ToolCallParser::Hermes)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolCallParser::Mistral)
        } else if template.contains("<|python_tag|>")
            || template.contains("\"parameters\": dictionary of argument name")
        {
            Some(ToolCallParser::Llama3Json)
        } else {
            None
        }
    }

    /// The strings that mark calls in this format: when the tokenizer has them as special
    /// tokens, the reply must be detokenized with special tokens kept, or they vanish.
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolCallParser::Llama3Json => &[llama3_json::PYTHON_TAG],
            ToolCallParser::Hermes => &[hermes::START, hermes::END],
            ToolCallParser::Mistral => &[mistral::MARKER, mistral::ARGS],
        }
    }

    pub(crate) fn format(self) -> &'static dyn ToolCallFormat {
        match self {
            ToolCallParser::Llama3Json => &llama3_json::Llama3Json,
            ToolCallParser::Hermes => &hermes::Hermes,
            ToolCallParser::Mistral => &mistral::Mistral,
        }
    }
}

/// The JSON array of `{"name", "parameters"}` that `tool_choice: "required"` is decoded into.
pub(crate) fn required_format() -> &'static dyn ToolCallFormat {
    &required::Required
}

/// Where the next block of calls starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// No block from here on, whatever text follows.
    None,
    /// The text from this byte on may be the beginning of a marker.
    Partial(usize),
    /// A block's marker begins at `at`, its calls at `body`.
    Found { at: usize, body: usize },
}

/// How far a block of calls got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockEnd {
    /// The block ends right before this byte.
    Complete(usize),
    /// The text ends inside the block (never returned once the text is final).
    Partial,
    /// Not well formed, certain from this byte on.
    Invalid(usize),
}

/// The calls of one block (one marker and what follows it), as far as the text goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub calls: Vec<CallSpan>,
    pub end: BlockEnd,
}

/// One tool-call format.
pub trait ToolCallFormat: Sync {
    /// Where the next block starts, looking from byte `from` on.
    fn find_start(&self, text: &str, from: usize) -> Start;

    /// The block whose calls begin at `body`; `at_end` when no more text will come.
    fn scan_block(&self, text: &str, body: usize, at_end: bool) -> Block;
}

/// Finds `marker` from `from` on; else whether the text ends with a beginning of it.
pub(crate) fn find_marker(text: &str, from: usize, marker: &str) -> Start {
    if let Some(k) = text.get(from..).and_then(|t| t.find(marker)) {
        return Start::Found { at: from + k, body: from + k + marker.len() };
    }
    partial_marker(text, from, marker).map_or(Start::None, Start::Partial)
}

/// The byte at which a proper beginning of `marker` ends the text, at or after `from`.
pub(crate) fn partial_marker(text: &str, from: usize, marker: &str) -> Option<usize> {
    (1..marker.len()).rev().find_map(|k| {
        let at = text.len().checked_sub(k)?;
        (at >= from && text.ends_with(&marker[..k])).then_some(at)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for name in ToolCallParser::NAMES {
            assert_eq!(ToolCallParser::from_name(name).map(ToolCallParser::name), Ok(name));
        }
        let err = ToolCallParser::from_name("pythonic").expect_err("unknown");
        assert!(err.contains("llama3_json, hermes, mistral"), "{err}");
    }

    #[test]
    fn templates_tell_their_format() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/chat_templates/");
        let cases = [
            ("tool_chat_template_llama3.1_json.jinja", Some(ToolCallParser::Llama3Json)),
            ("tool_chat_template_hermes.jinja", Some(ToolCallParser::Hermes)),
            ("qwen3_thinking_2507.jinja", Some(ToolCallParser::Hermes)),
            ("tool_chat_template_mistral_parallel.jinja", Some(ToolCallParser::Mistral)),
        ];
        for (file, want) in cases {
            let source = std::fs::read_to_string(format!("{dir}{file}")).expect("template");
            assert_eq!(ToolCallParser::detect(&source), want, "{file}");
        }
        assert_eq!(ToolCallParser::detect("{{ messages[0].content }}"), None);
    }

    #[test]
    fn a_marker_cut_at_the_end_is_partial() {
        assert_eq!(find_marker("ab<tool_call>x", 0, "<tool_call>"), Start::Found { at: 2, body: 13 });
        assert_eq!(find_marker("ab<tool_c", 0, "<tool_call>"), Start::Partial(2));
        assert_eq!(find_marker("ab<", 0, "<tool_call>"), Start::Partial(2));
        assert_eq!(find_marker("ab<", 3, "<tool_call>"), Start::None);
        assert_eq!(find_marker("ab<x", 0, "<tool_call>"), Start::None);
    }
}
