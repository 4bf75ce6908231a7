//! Reasoning split out of a reply (vLLM's `--reasoning-parser`): the text inside
//! `<think>...</think>` becomes `reasoning_content`, the rest `content`.
//!
//! - `deepseek_r1`: the reply starts inside the thinking block (DeepSeek-R1's and
//!   Qwen3-Thinking-2507's templates open `<think>` in the prompt), so text before `</think>` is
//!   reasoning whether or not the reply repeats `<think>`, and a reply without `</think>` is all
//!   reasoning.
//! - `qwen3`: reasoning only where the thinking block is opened: by the reply itself starting
//!   with `<think>`, or by the prompt ending inside one. Otherwise (`enable_thinking: false`
//!   renders an empty block into the prompt) the whole reply is content.
//!
//! Whitespace right after `<think>` and right after `</think>` is dropped. The whole-reply split
//! is the stream's, fed the reply in one piece, so a stream always adds up to it; a marker cut
//! over several tokens is held back until it is complete.

use crate::tool_calls::partial_marker;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    DeepSeekR1,
    Qwen3,
}

impl ReasoningParser {
    pub const NAMES: [&'static str; 2] = ["deepseek_r1", "qwen3"];

    pub fn from_name(name: &str) -> Result<ReasoningParser, String> {
        match name {
            "deepseek_r1" => Ok(ReasoningParser::DeepSeekR1),
            "qwen3" => Ok(ReasoningParser::Qwen3),
            other => Err(format!("unknown reasoning parser {other:?}: known ones are {}", Self::NAMES.join(", "))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ReasoningParser::DeepSeekR1 => "deepseek_r1",
            ReasoningParser::Qwen3 => "qwen3",
        }
    }

    /// Whether a reply to `prompt` starts inside the thinking block.
    pub fn starts_in_reasoning(self, prompt: &str) -> bool {
        match self {
            ReasoningParser::DeepSeekR1 => true,
            ReasoningParser::Qwen3 => prompt.rfind(OPEN).is_some_and(|open| prompt[open..].find(CLOSE).is_none()),
        }
    }

    pub fn markers(self) -> &'static [&'static str] {
        &[OPEN, CLOSE]
    }
}

/// A reply split in two.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningSplit {
    pub reasoning: String,
    pub content: String,
}

/// Splits a whole reply.
pub fn split(text: &str, starts_in_reasoning: bool) -> ReasoningSplit {
    let mut stream = ReasoningStream::new(starts_in_reasoning);
    let mut out = stream.push(text);
    let rest = stream.finish();
    out.reasoning.push_str(&rest.reasoning);
    out.content.push_str(&rest.content);
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the reply's first non-whitespace text: `<think>` may open it. `inside`: the
    /// prompt already opened the block, so the tag is optional.
    Opening { inside: bool },
    /// Inside the block; `leading` until its first non-whitespace text.
    Reasoning { leading: bool },
    /// After the block (`leading` until the first non-whitespace text), or a reply without one.
    Content { leading: bool },
}

/// Splits a reply delta by delta.
#[derive(Debug)]
pub struct ReasoningStream {
    state: State,
    /// Text not decided yet: the reply's start, or what may be the beginning of `</think>`.
    held: String,
}

impl ReasoningStream {
    pub fn new(starts_in_reasoning: bool) -> ReasoningStream {
        ReasoningStream { state: State::Opening { inside: starts_in_reasoning }, held: String::new() }
    }

    pub fn push(&mut self, delta: &str) -> ReasoningSplit {
        self.held.push_str(delta);
        let mut out = ReasoningSplit::default();
        self.step(&mut out, false);
        out
    }

    pub fn finish(&mut self) -> ReasoningSplit {
        let mut out = ReasoningSplit::default();
        self.step(&mut out, true);
        out
    }

    fn step(&mut self, out: &mut ReasoningSplit, at_end: bool) {
        loop {
            match self.state {
                State::Opening { inside } => {
                    let text = self.held.trim_start();
                    if let Some(rest) = text.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning { leading: true };
                    } else if OPEN.starts_with(text) && !at_end {
                        return;
                    } else if inside {
                        self.state = State::Reasoning { leading: true };
                    } else {
                        self.state = State::Content { leading: false };
                    }
                }
                State::Reasoning { leading } => {
                    let (text, closed) = match self.held.find(CLOSE) {
                        Some(at) => (self.held[..at].to_string(), Some(at)),
                        None if at_end => (std::mem::take(&mut self.held), None),
                        None => {
                            let keep = partial_marker(&self.held, 0, CLOSE).unwrap_or(self.held.len());
                            let text = self.held[..keep].to_string();
                            self.held.drain(..keep);
                            (text, None)
                        }
                    };
                    let leading = emit(&mut out.reasoning, &text, leading);
                    self.state = State::Reasoning { leading };
                    let Some(at) = closed else { return };
                    self.held.drain(..at + CLOSE.len());
                    self.state = State::Content { leading: true };
                }
                State::Content { leading } => {
                    let text = std::mem::take(&mut self.held);
                    self.state = State::Content { leading: emit(&mut out.content, &text, leading) };
                    return;
                }
            }
        }
    }
}

/// Appends `text`, without its leading whitespace while `leading`; returns whether still leading.
fn emit(out: &mut String, text: &str, leading: bool) -> bool {
    let text = if leading { text.trim_start() } else { text };
    out.push_str(text);
    leading && text.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both(text: &str, inside: bool) -> (String, String) {
        let s = split(text, inside);
        (s.reasoning, s.content)
    }

    fn pair(r: &str, c: &str) -> (String, String) {
        (r.to_string(), c.to_string())
    }

    #[test]
    fn deepseek_r1_starts_inside_the_block() {
        assert_eq!(both("<think>\nStep 1.\n</think>\n\nAnswer.", true), pair("Step 1.\n", "Answer."));
        assert_eq!(both("Step 1.\n</think>\n\nAnswer.", true), pair("Step 1.\n", "Answer."));
        assert_eq!(both("Still thinking", true), pair("Still thinking", ""));
        assert_eq!(both("", true), pair("", ""));
    }

    #[test]
    fn qwen3_reasons_only_inside_an_opened_block() {
        let qwen3 = ReasoningParser::Qwen3;
        assert!(!qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!qwen3.starts_in_reasoning("<|im_start|>assistant\n"));
        assert_eq!(both("<think>\nHmm.\n</think>\n\nHi!", false), pair("Hmm.\n", "Hi!"));
        assert_eq!(both("Hi! <think>x</think>", false), pair("", "Hi! <think>x</think>"));
        assert_eq!(both("\n\nHi!", false), pair("", "\n\nHi!"));
        assert_eq!(both("<thinking", false), pair("", "<thinking"));
        assert_eq!(both("<think", false), pair("", "<think"));
    }

    #[test]
    fn a_close_tag_split_over_tokens_splits_in_the_right_place() {
        let text = "<think>\nabc </thi nk\n</think>\n\n  Done </think> x";
        for inside in [false, true] {
            let want = split(text, inside);
            assert_eq!(want, ReasoningSplit { reasoning: "abc </thi nk\n".into(), content: "Done </think> x".into() });
            let cuts: Vec<usize> = (0..=text.len()).collect();
            for (&a, &b) in cuts.iter().zip(cuts.iter().skip(3)) {
                let mut stream = ReasoningStream::new(inside);
                let mut got = ReasoningSplit::default();
                for piece in [&text[..a], &text[a..b], &text[b..]] {
                    let d = stream.push(piece);
                    got.reasoning.push_str(&d.reasoning);
                    got.content.push_str(&d.content);
                }
                let d = stream.finish();
                got.reasoning.push_str(&d.reasoning);
                got.content.push_str(&d.content);
                assert_eq!(got, want, "cuts {a}, {b}");
            }
        }
    }

    #[test]
    fn names() {
        assert_eq!(ReasoningParser::from_name("qwen3"), Ok(ReasoningParser::Qwen3));
        assert_eq!(ReasoningParser::from_name("deepseek_r1").map(ReasoningParser::name), Ok("deepseek_r1"));
        assert!(ReasoningParser::from_name("r1").is_err());
    }
}
