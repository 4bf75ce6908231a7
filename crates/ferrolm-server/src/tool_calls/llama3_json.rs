//! Llama 3.x's JSON tool calls: the reply is a call object, or several separated by `;`,
//! optionally after `<|python_tag|>`:
//!
//! ```text
//! {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
//! ```
//!
//! Without the tag a block starts only where the reply does (after whitespace): a `{` further
//! into a reply is text. Text before `<|python_tag|>` is content.

use super::call_object::{scan_call, CallKeys};
use super::json_scan::skip_ws;
use super::{find_marker, Block, BlockEnd, Start, ToolCallFormat};

pub const PYTHON_TAG: &str = "<|python_tag|>";

const KEYS: CallKeys = CallKeys { arguments: &["parameters", "arguments"], ignored: &["type"] };

pub struct Llama3Json;

impl ToolCallFormat for Llama3Json {
    fn find_start(&self, text: &str, from: usize) -> Start {
        if from == 0 {
            let i = skip_ws(text, 0);
            if text.as_bytes().get(i) == Some(&b'{') {
                return Start::Found { at: i, body: i };
            }
        }
        find_marker(text, from, PYTHON_TAG)
    }

    fn scan_block(&self, text: &str, body: usize, at_end: bool) -> Block {
        let mut calls = Vec::new();
        let mut i = skip_ws(text, body);
        loop {
            let (call, end) = scan_call(text, i, &KEYS);
            calls.push(call);
            let after = match end {
                BlockEnd::Complete(after) => after,
                BlockEnd::Partial if at_end => return Block { calls, end: BlockEnd::Invalid(text.len()) },
                other => return Block { calls, end: other },
            };
            match next_call(text, after, at_end) {
                Next::Call(at) => i = at,
                Next::End(end) => return Block { calls, end },
            }
        }
    }
}

enum Next {
    Call(usize),
    End(BlockEnd),
}

/// After a call: `;` and another call, or the end of the block (a trailing `;` at the end of
/// the reply is allowed).
fn next_call(text: &str, after: usize, at_end: bool) -> Next {
    let j = skip_ws(text, after);
    match text.as_bytes().get(j) {
        Some(b';') => {
            let k = skip_ws(text, j + 1);
            if k == text.len() && at_end {
                Next::End(BlockEnd::Complete(text.len()))
            } else {
                Next::Call(k)
            }
        }
        None if !at_end => Next::End(BlockEnd::Partial),
        _ => Next::End(BlockEnd::Complete(after)),
    }
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::pieces::tests::{assert_streams_as_parsed, calls};
    use crate::tool_calls::{parse, ToolCallParser};

    fn format() -> &'static dyn crate::tool_calls::ToolCallFormat {
        ToolCallParser::Llama3Json.format()
    }

    #[test]
    fn one_call() {
        let text = r#"{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "days": 2}}"#;
        let parsed = parse(format(), text, None);
        assert_eq!(parsed.content, "");
        assert_eq!(calls(&parsed), [("get_weather", r#"{"city": "San Francisco, CA", "days": 2}"#)]);
        assert_streams_as_parsed(format(), text);
    }

    #[test]
    fn several_calls_after_the_python_tag() {
        let text = "<|python_tag|>{\"type\": \"function\", \"name\": \"a\", \"parameters\": {\"x\": [1, 2]}}; {\"name\": \"b\", \"arguments\": {}};";
        let parsed = parse(format(), text, None);
        assert_eq!(parsed.content, "");
        assert_eq!(calls(&parsed), [("a", r#"{"x": [1, 2]}"#), ("b", "{}")]);
        assert_streams_as_parsed(format(), text);
        let text = "Let me look that up.<|python_tag|>{\"name\": \"a\", \"parameters\": {}}";
        let parsed = parse(format(), text, None);
        assert_eq!((parsed.content.as_str(), calls(&parsed)), ("Let me look that up.", vec![("a", "{}")]));
        assert_streams_as_parsed(format(), text);
    }

    #[test]
    fn json_that_is_not_a_call_stays_text() {
        for text in [
            r#"{"result": 42}"#,
            r#"{"name": "Ada", "age": 36}"#,
            r#"The call would be {"name": "f", "parameters": {}}"#,
            r#"{"name": "f", "parameters": {"a": 1}} ; nonsense"#,
            "{\"name\": \"f\", \"parameters\": {\"a\": 1}",
        ] {
            let parsed = parse(format(), text, None);
            assert_eq!(parsed.content, text);
            assert!(parsed.calls.is_empty(), "{text}");
            assert_streams_as_parsed(format(), text);
        }
    }

    #[test]
    fn text_after_a_call_is_content() {
        let text = "{\"name\": \"f\", \"parameters\": {}}\n\nDone.";
        let parsed = parse(format(), text, None);
        assert_eq!((parsed.content.as_str(), calls(&parsed)), ("\n\nDone.", vec![("f", "{}")]));
        assert_streams_as_parsed(format(), text);
    }
}
