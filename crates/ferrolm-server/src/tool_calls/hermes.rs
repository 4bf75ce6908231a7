//! Hermes' format, also Qwen2.5's and Qwen3's: each call is a JSON object between
//! `<tool_call>` and `</tool_call>`, any number of them, text around them being content:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! A reply that ends after a complete object without the closing tag is accepted (as vLLM's
//! parser accepts it).

use super::call_object::{scan_call, CallKeys};
use super::json_scan::skip_ws;
use super::{find_marker, Block, BlockEnd, Start, ToolCallFormat};

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

/// Some models write `parameters` for the arguments.
const KEYS: CallKeys = CallKeys { arguments: &["arguments", "parameters"], ignored: &[] };

pub struct Hermes;

impl ToolCallFormat for Hermes {
    fn find_start(&self, text: &str, from: usize) -> Start {
        find_marker(text, from, START)
    }

    fn scan_block(&self, text: &str, body: usize, at_end: bool) -> Block {
        let (call, end) = scan_call(text, skip_ws(text, body), &KEYS);
        let end = match end {
            BlockEnd::Complete(after) => closing_tag(text, after, at_end),
            BlockEnd::Partial if at_end => BlockEnd::Invalid(text.len()),
            other => other,
        };
        Block { calls: vec![call], end }
    }
}

/// After the object: whitespace, then `</tool_call>` (or the end of the reply).
fn closing_tag(text: &str, after: usize, at_end: bool) -> BlockEnd {
    let j = skip_ws(text, after);
    let rest = &text[j..];
    if rest.starts_with(END) {
        BlockEnd::Complete(j + END.len())
    } else if END.starts_with(rest) {
        if at_end {
            BlockEnd::Complete(text.len())
        } else {
            BlockEnd::Partial
        }
    } else {
        BlockEnd::Invalid(j)
    }
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::pieces::tests::{assert_streams_as_parsed, calls};
    use crate::tool_calls::{parse, ToolCallParser};

    const QWEN: &str = "I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"Europe/Zurich\"}}\n</tool_call>";

    #[test]
    fn several_calls_after_text() {
        let parsed = parse(ToolCallParser::Hermes.format(), QWEN, None);
        assert_eq!(parsed.content, "I'll check both.");
        assert_eq!(
            calls(&parsed),
            [("get_weather", r#"{"city": "Zürich", "unit": "celsius"}"#), ("get_time", r#"{"zone": "Europe/Zurich"}"#)]
        );
        assert_streams_as_parsed(ToolCallParser::Hermes.format(), QWEN);
    }

    #[test]
    fn one_call_without_closing_tag_or_text() {
        let text = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n";
        let parsed = parse(ToolCallParser::Hermes.format(), text, None);
        assert_eq!(parsed.content, "");
        assert_eq!(calls(&parsed), [("get_time", "{}")]);
        assert_streams_as_parsed(ToolCallParser::Hermes.format(), text);
    }

    #[test]
    fn malformed_calls_stay_text() {
        for text in [
            "Sure <tool_call>{\"name\": get_time}</tool_call> done",
            "<tool_call>\n{\"function\": \"get_time\"}\n</tool_call>",
            "<tool_call>not json</tool_call>",
            "a <tool_call> b",
        ] {
            let parsed = parse(ToolCallParser::Hermes.format(), text, None);
            assert_eq!(parsed.content, text);
            assert!(parsed.calls.is_empty());
            assert_streams_as_parsed(ToolCallParser::Hermes.format(), text);
        }
    }

    #[test]
    fn a_good_call_after_a_bad_one_is_kept() {
        let text = "<tool_call>oops</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>";
        let parsed = parse(ToolCallParser::Hermes.format(), text, None);
        assert_eq!(parsed.content, "<tool_call>oops</tool_call>");
        assert_eq!(calls(&parsed), [("f", r#"{"a": 1}"#)]);
        assert_streams_as_parsed(ToolCallParser::Hermes.format(), text);
    }
}
