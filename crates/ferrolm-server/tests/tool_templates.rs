//! Tool-calling conversations (tools, an assistant's tool calls, tool results) rendered with
//! real chat templates of each tool-call family render exactly as HF transformers'
//! `apply_chat_template` renders them.
//!
//! The expected texts come from `testdata/chat_templates/make_expected.py` (HF transformers,
//! the llama3_gqa fixture's tokenizer with each template swapped in); the templates' sources are
//! in that folder's README. The messages are given as an OpenAI client sends them (each call's
//! `arguments` JSON text) and go through the server's own message handling before rendering.

use std::path::PathBuf;

use ferrolm_server::chat_prompt::{render_with, ChatPromptOptions};
use ferrolm_tokenizer::{ChatTemplate, Tokenizer};
use serde_json::Value;

fn templates_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/chat_templates"))
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(templates_dir().join("expected.json")).expect("read expected.json");
    let cases: Value = serde_json::from_str(&text).expect("expected.json is JSON");
    cases.as_array().expect("a list of cases").clone()
}

#[test]
fn tool_conversations_render_as_transformers_renders_them() {
    let fixture = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures/llama3_gqa"));
    let special_tokens = Tokenizer::from_dir(&fixture).expect("fixture tokenizer").config().special_tokens.clone();
    let cases = cases();
    let names: Vec<&str> = cases.iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(names, ["llama3.1_json", "hermes", "mistral_parallel", "qwen3_thinking_2507"]);
    for case in &cases {
        let name = case["name"].as_str().expect("name");
        let file = case["template"].as_str().expect("template file");
        let source = std::fs::read_to_string(templates_dir().join(file)).expect("read template");
        let template = ChatTemplate::new(&source, special_tokens.clone()).expect("template compiles");
        let messages = case["messages"].as_array().expect("messages");
        let options = ChatPromptOptions {
            add_generation_prompt: Some(true),
            continue_final_message: None,
            tools: Some(&case["tools"]),
            chat_template_kwargs: case["kwargs"].as_object(),
        };
        let rendered = render_with(&template, messages, options).unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = case["expected"].as_str().expect("expected text");
        assert_eq!(rendered, expected, "{name}");
    }
}

#[test]
fn the_conversations_hold_tool_calls_as_openai_sends_them() {
    // The check above is only as good as its data: arguments as JSON text, tool results, ids.
    for case in cases() {
        let messages = case["messages"].as_array().expect("messages");
        let calls: Vec<&Value> = messages.iter().filter_map(|m| m.get("tool_calls")).collect();
        assert!(!calls.is_empty(), "{}", case["name"]);
        for call in calls.iter().flat_map(|c| c.as_array().expect("a list")) {
            assert!(call["function"]["arguments"].is_string(), "{call}");
            assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
        }
        assert!(messages.iter().any(|m| m["role"] == "tool" && m["tool_call_id"].is_string()));
    }
}
