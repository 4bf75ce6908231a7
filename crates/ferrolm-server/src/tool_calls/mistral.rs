//! Mistral's format: `[TOOL_CALLS]` and a JSON array of calls (Mistral 7B v0.3, Nemo, Small),
//!
//! ```text
//! [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
//! ```
//!
//! or, in newer models, one call per marker as `name[ARGS]{...}`:
//!
//! ```text
//! [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
//! ```
//!
//! `[TOOL_CALLS]` is a special token in Mistral's tokenizers: the reply must be detokenized with
//! special tokens kept for it to be seen.

use super::call_object::{scan_call_array, CallKeys, CallSpan};
use super::json_scan::{self, skip_ws, Scan};
use super::{find_marker, Block, BlockEnd, Start, ToolCallFormat};

pub const MARKER: &str = "[TOOL_CALLS]";
pub const ARGS: &str = "[ARGS]";

/// Mistral's templates write a call's `id` into earlier turns; models may repeat it.
const KEYS: CallKeys = CallKeys { arguments: &["arguments"], ignored: &["id"] };

pub struct Mistral;

impl ToolCallFormat for Mistral {
    fn find_start(&self, text: &str, from: usize) -> Start {
        find_marker(text, from, MARKER)
    }

    fn scan_block(&self, text: &str, body: usize, at_end: bool) -> Block {
        let i = skip_ws(text, body);
        match text.as_bytes().get(i) {
            Some(b'[') => scan_call_array(text, i, &KEYS, at_end),
            Some(&c) if is_name_byte(c) => name_and_args(text, i, at_end),
            Some(_) => Block { calls: Vec::new(), end: BlockEnd::Invalid(i) },
            None if at_end => Block { calls: Vec::new(), end: BlockEnd::Invalid(i) },
            None => Block { calls: Vec::new(), end: BlockEnd::Partial },
        }
    }
}

fn is_name_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

/// `name[ARGS]{...}`, from the name's first byte at `start`.
fn name_and_args(text: &str, start: usize, at_end: bool) -> Block {
    let partial = |call: CallSpan| Block {
        calls: vec![call],
        end: if at_end { BlockEnd::Invalid(text.len()) } else { BlockEnd::Partial },
    };
    let invalid = |call: CallSpan, at: usize| Block { calls: vec![call], end: BlockEnd::Invalid(at) };
    let b = text.as_bytes();
    let mut n = start;
    while n < b.len() && is_name_byte(b[n]) {
        n += 1;
    }
    let rest = &text[n..];
    if !rest.starts_with(ARGS) {
        return if ARGS.starts_with(rest) { partial(CallSpan::default()) } else { invalid(CallSpan::default(), n) };
    }
    let mut call = CallSpan { name: Some(text[start..n].to_string()), ..CallSpan::default() };
    let args = skip_ws(text, n + ARGS.len());
    match b.get(args) {
        None => return partial(call),
        Some(b'{') => call.args_start = Some(args),
        Some(_) => return invalid(call, args),
    }
    match json_scan::value(text, args) {
        Scan::Complete(end) => {
            call.args_end = Some(end);
            call.complete = true;
            Block { calls: vec![call], end: BlockEnd::Complete(end) }
        }
        Scan::Partial => partial(call),
        Scan::Invalid(at) => invalid(call, at),
    }
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::pieces::tests::{assert_streams_as_parsed, calls};
    use crate::tool_calls::{parse, ToolCallParser};

    fn format() -> &'static dyn crate::tool_calls::ToolCallFormat {
        ToolCallParser::Mistral.format()
    }

    #[test]
    fn an_array_of_calls() {
        let text = r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "gHiJkLmNo"}, {"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}]"#;
        let parsed = parse(format(), text, None);
        assert_eq!(parsed.content, "");
        assert_eq!(
            calls(&parsed),
            [("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#), ("get_time", r#"{"zone": "Asia/Tokyo"}"#)]
        );
        assert_streams_as_parsed(format(), text);
    }

    #[test]
    fn name_and_args_calls() {
        let text = r#"Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}"#;
        let parsed = parse(format(), text, None);
        assert_eq!(parsed.content, "Checking.");
        assert_eq!(calls(&parsed), [("get_weather", r#"{"city": "Paris"}"#), ("get_time", "{}")]);
        assert_streams_as_parsed(format(), text);
    }

    #[test]
    fn malformed_calls_stay_text() {
        for text in ["[TOOL_CALLS] hello", "[TOOL_CALLS] [1, 2]", "[TOOL_CALLS]f(x)", "[TOOL_CALLS]", "[TOOL_CALLS] []"]
        {
            let parsed = parse(format(), text, None);
            assert_eq!(parsed.content, text);
            assert!(parsed.calls.is_empty(), "{text}");
            assert_streams_as_parsed(format(), text);
        }
    }
}
