//! A tool-calling template in the style of Qwen's, rendered by ferrolm and compared with the
//! output of Python's Jinja2 set up as HF sets it up (tests/data/render_reference.py made
//! tests/data/qwen_like.expected.jsonl). It exercises namespaces, loop variables, Python
//! string and dict methods, `tojson` with and without indent, tools, extra variables, and
//! how `{{ }}` prints None, booleans, floats and lists.

use std::fs;
use std::path::Path;

use ferrolm_tokenizer::{ChatTemplate, RenderOptions, SpecialTokens, TokenizerError};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

fn special_tokens() -> SpecialTokens {
    SpecialTokens { bos_token: Some("<s>".into()), eos_token: Some("</s>".into()), ..Default::default() }
}

#[test]
fn renders_like_jinja2_with_hf_settings() -> TestResult {
    let source = fs::read_to_string(Path::new(DATA).join("qwen_like.jinja"))?;
    let ctx: serde_json::Value = serde_json::from_str(&fs::read_to_string(Path::new(DATA).join("ctx.json"))?)?;
    let expected: Vec<String> = fs::read_to_string(Path::new(DATA).join("qwen_like.expected.jsonl"))?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(expected.len(), 4);

    let template = ChatTemplate::new(&source, special_tokens())?;
    let messages = ctx["messages"].as_array().ok_or("ctx.json: messages is not a list")?;
    let extra = ctx["extra"].as_object();
    let mut want = expected.iter();
    for add_generation_prompt in [false, true] {
        for tools in [None, Some(&ctx["tools"])] {
            let options = RenderOptions { add_generation_prompt, tools, extra_context: extra, ..Default::default() };
            let got = template.render_with(messages, &options)?;
            assert_eq!(Some(&got), want.next(), "add_generation_prompt={add_generation_prompt} tools={tools:?}");
        }
    }
    Ok(())
}

#[test]
fn unknown_role_raises_the_templates_message() -> TestResult {
    let source = fs::read_to_string(Path::new(DATA).join("qwen_like.jinja"))?;
    let template = ChatTemplate::new(&source, special_tokens())?;
    let messages = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]);
    let messages = messages.as_array().ok_or("not a list")?;
    match template.render(messages, true, None) {
        Err(TokenizerError::ChatTemplateRaised(msg)) => assert_eq!(msg, "Unknown role: robot"),
        other => return Err(format!("expected ChatTemplateRaised, got {other:?}").into()),
    }
    Ok(())
}
