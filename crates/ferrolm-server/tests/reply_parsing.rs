//! A chat choice's reply read as the chat route reads it (`chat_output`): recorded replies of
//! each family, whole and streamed in every two-piece split and token by token, must give the
//! same message; well-formed calls leave no markup in the content.

use ferrolm_server::chat_output::{parse_message, ChoiceParser, OutputParsing, ParsedMessage, ToolOutput};
use ferrolm_server::reasoning::ReasoningParser;
use ferrolm_server::tool_calls::{ToolCall, ToolCallParser};

fn parsing(tools: ToolCallParser, reasoning: Option<ReasoningParser>, starts_in_reasoning: bool) -> OutputParsing {
    OutputParsing { reasoning, starts_in_reasoning, tools: ToolOutput::Auto { parser: tools, max_calls: None } }
}

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall { name: name.into(), arguments: arguments.into() }
}

/// What a client assembles from the deltas of `pieces`.
fn streamed(parsing: &OutputParsing, pieces: &[&str]) -> ParsedMessage {
    let mut parser = ChoiceParser::new(parsing);
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::<ToolCall>::new());
    let mut deltas: Vec<_> = pieces.iter().map(|p| parser.push(p)).collect();
    deltas.push(parser.finish());
    for d in deltas {
        reasoning.push_str(&d.reasoning);
        content.push_str(&d.content);
        for c in d.tool_calls {
            if let Some(name) = c.name {
                calls.push(call(&name, ""));
            }
            calls[c.index].arguments.push_str(&c.arguments);
        }
    }
    let has_calls = !calls.is_empty();
    let reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
    let content = (!content.is_empty() || (!has_calls && reasoning_content.is_none())).then_some(content);
    ParsedMessage { reasoning_content, content, tool_calls: calls }
}

fn check(parsing: &OutputParsing, text: &str, want: &ParsedMessage) {
    assert_eq!(&parse_message(text, parsing), want, "whole: {text:?}");
    for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        assert_eq!(&streamed(parsing, &[&text[..cut], &text[cut..]]), want, "cut at {cut}: {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(&streamed(parsing, &pieces), want, "char by char: {text:?}");
}

fn message(reasoning: Option<&str>, content: Option<&str>, calls: Vec<ToolCall>) -> ParsedMessage {
    ParsedMessage {
        reasoning_content: reasoning.map(str::to_string),
        content: content.map(str::to_string),
        tool_calls: calls,
    }
}

#[test]
fn qwen3_thinks_then_calls() {
    let text = "<think>\nThe user wants the weather; I should call get_weather.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let want = message(
        Some("The user wants the weather; I should call get_weather.\n"),
        Some("Let me check."),
        vec![call("get_weather", r#"{"city": "Paris"}"#)],
    );
    check(&parsing(ToolCallParser::Hermes, Some(ReasoningParser::Qwen3), false), text, &want);
    check(&parsing(ToolCallParser::Hermes, Some(ReasoningParser::DeepSeekR1), true), text, &want);
}

#[test]
fn a_thinking_2507_reply_opens_no_block() {
    // The template wrote `<think>\n` into the prompt.
    let text = "Two cities.\n</think>\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"Asia/Tokyo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"Europe/Paris\"}}\n</tool_call>";
    let want = message(
        Some("Two cities.\n"),
        None,
        vec![call("get_time", r#"{"zone": "Asia/Tokyo"}"#), call("get_time", r#"{"zone": "Europe/Paris"}"#)],
    );
    let qwen3 = ReasoningParser::Qwen3;
    assert!(qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n"));
    check(&parsing(ToolCallParser::Hermes, Some(qwen3), true), text, &want);
}

#[test]
fn llama_3_1_json_calls() {
    let text =
        r#"{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}"#;
    let want = message(
        None,
        None,
        vec![call("get_current_conditions", r#"{"location": "San Francisco, CA", "unit": "Fahrenheit"}"#)],
    );
    check(&parsing(ToolCallParser::Llama3Json, None, false), text, &want);
    let text =
        "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"q\": \"x; y\"}}; {\"name\": \"b\", \"parameters\": {}}";
    let want = message(None, None, vec![call("a", r#"{"q": "x; y"}"#), call("b", "{}")]);
    check(&parsing(ToolCallParser::Llama3Json, None, false), text, &want);
}

#[test]
fn mistral_calls() {
    let text = r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]"#;
    let want =
        message(None, None, vec![call("get_weather", r#"{"city": "Paris"}"#), call("get_time", r#"{"zone": "CET"}"#)]);
    check(&parsing(ToolCallParser::Mistral, None, false), text, &want);
    let text = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#;
    check(
        &parsing(ToolCallParser::Mistral, None, false),
        text,
        &message(None, None, vec![call("get_weather", r#"{"city": "Paris"}"#)]),
    );
}

#[test]
fn plain_replies_and_malformed_calls_stay_text() {
    let hermes = parsing(ToolCallParser::Hermes, None, false);
    for text in [
        "The capital of France is Paris.",
        "Use <b>bold</b> and a < b.\n",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": Paris}}\n</tool_call>",
        "<tool_call>\n[\"get_weather\", \"Paris\"]\n</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": {}} and more</tool_call>",
        "",
    ] {
        check(&hermes, text, &message(None, Some(text), Vec::new()));
    }
}

#[test]
fn a_reply_cut_inside_a_call_is_text() {
    let hermes = parsing(ToolCallParser::Hermes, None, false);
    let text = "Let me see.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par";
    check(&hermes, text, &message(None, Some(text), Vec::new()));
    let mistral = parsing(ToolCallParser::Mistral, None, false);
    let text = r#"[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "argu"#;
    check(&mistral, text, &message(None, Some(text), Vec::new()));
}
