//! The reply of `tool_choice: "required"`: decoded under [`super::schema`]'s schema, it is a
//! JSON array of `{"name": ..., "parameters": {...}}`, as vLLM has it, and nothing else.

use super::call_object::{scan_call_array, CallKeys};
use super::json_scan::skip_ws;
use super::{Block, BlockEnd, Start, ToolCallFormat};

const KEYS: CallKeys = CallKeys { arguments: &["parameters"], ignored: &[] };

pub struct Required;

impl ToolCallFormat for Required {
    fn find_start(&self, text: &str, from: usize) -> Start {
        let i = skip_ws(text, 0);
        match text.as_bytes().get(i) {
            Some(b'[') if from == 0 => Start::Found { at: i, body: i },
            _ => Start::None,
        }
    }

    fn scan_block(&self, text: &str, body: usize, at_end: bool) -> Block {
        let block = scan_call_array(text, body, &KEYS, at_end);
        match block.end {
            // The array is the whole reply.
            BlockEnd::Complete(end) if skip_ws(text, end) < text.len() => {
                Block { end: BlockEnd::Invalid(skip_ws(text, end)), ..block }
            }
            _ => block,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::pieces::tests::{assert_streams_as_parsed, calls};
    use crate::tool_calls::{parse, required_format};

    #[test]
    fn the_array_is_the_reply() {
        let text =
            r#"[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]"#;
        let parsed = parse(required_format(), text, None);
        assert_eq!(parsed.content, "");
        assert_eq!(calls(&parsed), [("get_weather", r#"{"city": "Paris"}"#), ("get_time", "{}")]);
        assert_streams_as_parsed(required_format(), text);
        let parsed = parse(required_format(), text, Some(1));
        assert_eq!(calls(&parsed), [("get_weather", r#"{"city": "Paris"}"#)]);
    }
}
