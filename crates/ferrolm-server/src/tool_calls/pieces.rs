//! A reply cut into pieces (text, blocks of calls, a held-back tail) by one format, and the
//! content and calls those pieces make: for the whole reply ([`parse`]) and for the text so far
//! of a streaming one ([`view`]).
//!
//! Only a complete, well-formed block makes calls; a block that goes wrong is text from its
//! marker on, and one not complete yet is held back, so the text so far never decides anything
//! that more text could undo.
//!
//! Content rules (the same for both, so that a stream adds up to the whole): text that goes
//! before a block loses its trailing whitespace; text after the last block is kept only if it
//! is more than whitespace; a reply without blocks is kept as it is. While streaming, the
//! trailing whitespace of the open text is held back, since a block may still follow it.

use std::ops::Range;

use super::call_object::CallSpan;
use super::{BlockEnd, Start, ToolCall, ToolCallFormat};

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Piece {
    Text(Range<usize>),
    /// A complete, well-formed block of calls.
    Calls(Vec<CallSpan>),
    /// From here to the end: undecided (a marker's beginning, or a block not complete yet).
    Held(usize),
}

/// Cuts `text` into pieces; `at_end` when the text is final (then nothing is held).
pub(crate) fn scan(format: &dyn ToolCallFormat, text: &str, at_end: bool) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut pos = 0;
    while pos < text.len() {
        let (at, body) = match format.find_start(text, pos) {
            Start::None => break,
            Start::Partial(_) if at_end => break,
            Start::Partial(at) => {
                pieces.push(Piece::Text(pos..at));
                pieces.push(Piece::Held(at));
                return pieces;
            }
            Start::Found { at, body } => (at, body),
        };
        pieces.push(Piece::Text(pos..at));
        let block = format.scan_block(text, body, at_end);
        match block.end {
            BlockEnd::Complete(end) => {
                pieces.push(Piece::Calls(block.calls));
                pos = end;
            }
            BlockEnd::Partial => {
                pieces.push(Piece::Held(at));
                return pieces;
            }
            BlockEnd::Invalid(_) => {
                // Not a call: its marker is text, and the search goes on after it.
                let next = text[at..].chars().next().map_or(at, |c| at + c.len_utf8());
                let after = body.max(next);
                pieces.push(Piece::Text(at..after));
                pos = after;
            }
        }
    }
    if pos < text.len() {
        pieces.push(Piece::Text(pos..text.len()));
    }
    pieces
}

/// A parsed call, borrowing from the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CallView<'t> {
    pub name: &'t str,
    pub arguments: &'t str,
}

/// The content and the calls that the pieces make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct View<'t> {
    pub content: String,
    pub calls: Vec<CallView<'t>>,
}

/// The content and calls of `pieces`; `at_end`: they cover the final text.
pub(crate) fn view<'t>(text: &'t str, pieces: &'t [Piece], at_end: bool) -> View<'t> {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut segment = String::new();
    let mut blocks = 0;
    for piece in pieces {
        match piece {
            Piece::Text(range) => segment.push_str(&text[range.clone()]),
            Piece::Calls(block) => {
                content.push_str(segment.trim_end());
                segment.clear();
                blocks += 1;
                calls.extend(
                    block.iter().map(|c| CallView {
                        name: c.name.as_deref().unwrap_or_default(),
                        arguments: c.arguments(text),
                    }),
                );
            }
            Piece::Held(_) => break,
        }
    }
    if !at_end {
        content.push_str(segment.trim_end());
    } else if blocks == 0 || !segment.trim().is_empty() {
        content.push_str(&segment);
    }
    View { content, calls }
}

/// What a whole reply holds: its content (empty when there is none) and its calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedCalls {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// Parses a whole reply. `max_calls` (1 when parallel tool calls are off) keeps the first
/// calls only.
pub fn parse(format: &dyn ToolCallFormat, text: &str, max_calls: Option<usize>) -> ParsedCalls {
    let pieces = scan(format, text, true);
    let view = view(text, &pieces, true);
    let calls = view
        .calls
        .iter()
        .take(max_calls.unwrap_or(usize::MAX))
        .map(|c| ToolCall { name: c.name.to_string(), arguments: c.arguments.to_string() })
        .collect();
    ParsedCalls { content: view.content, calls }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::tool_calls::stream::ToolCallStream;

    pub(crate) fn calls(parsed: &ParsedCalls) -> Vec<(&str, &str)> {
        parsed.calls.iter().map(|c| (c.name.as_str(), c.arguments.as_str())).collect()
    }

    /// Streams `text` cut in two at every byte (and in one-character chunks), and checks that
    /// the deltas add up to the whole-text parse: the same content, the same calls in order.
    pub(crate) fn assert_streams_as_parsed(format: &'static dyn ToolCallFormat, text: &str) {
        let want = parse(format, text, None);
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &cut in &cuts {
            let got = stream_in(format, &[&text[..cut], &text[cut..]]);
            assert_eq!(got, want, "cut at byte {cut} of {text:?}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(stream_in(format, &pieces), want, "char by char: {text:?}");
    }

    /// What a client assembles from streaming `chunks`.
    pub(crate) fn stream_in(format: &'static dyn ToolCallFormat, chunks: &[&str]) -> ParsedCalls {
        let mut stream = ToolCallStream::new(format, None);
        let mut got = ParsedCalls::default();
        let mut deltas: Vec<_> = chunks.iter().map(|c| stream.push(c)).collect();
        deltas.push(stream.finish());
        for delta in deltas {
            got.content.push_str(&delta.content);
            for call in delta.calls {
                if let Some(name) = call.name {
                    assert_eq!(call.index, got.calls.len(), "calls are announced in order");
                    assert!(call.arguments.is_empty(), "a call's first delta carries no arguments");
                    got.calls.push(ToolCall { name, arguments: String::new() });
                }
                got.calls[call.index].arguments.push_str(&call.arguments);
            }
        }
        got
    }

    #[test]
    fn held_text_is_a_marker_beginning() {
        let hermes = crate::tool_calls::ToolCallParser::Hermes.format();
        assert_eq!(scan(hermes, "Hi <tool_", false), [Piece::Text(0..3), Piece::Held(3)]);
        assert_eq!(scan(hermes, "Hi <tool_", true), [Piece::Text(0..9)]);
        let pieces = scan(hermes, "Hi <tool_", false);
        assert_eq!(view("Hi <tool_", &pieces, false).content, "Hi");
    }
}
