//! `tools`, `tool_choice` and reasoning on `POST /v1/chat/completions`, end to end: the model
//! writes a recorded reply (a scripted runner overrides its choices with the reply's tokens),
//! and the server must return it as OpenAI's tool calls and reasoning, streamed or not; every
//! invalid request is a 400 that names its field.

mod common;

use std::sync::Arc;

use async_openai::types::chat::{CreateChatCompletionResponse, CreateChatCompletionStreamResponse};
use common::scripted::Script;
use common::{error_of, start, Options, TestServer};
use ferrolm_server::reasoning::ReasoningParser;
use ferrolm_server::tool_calls::ToolCallParser;
use serde_json::{json, Value};

const QWEN_REPLY: &str = "I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"Europe/Paris\"}}\n</tool_call>";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
    ])
}

fn messages() -> Value {
    json!([{"role": "user", "content": "Weather and time in Paris?"}])
}

async fn scripted_server(
    parser: Option<ToolCallParser>,
    reasoning: Option<ReasoningParser>,
) -> (TestServer, Arc<Script>) {
    let script = Arc::new(Script::default());
    let opts = Options {
        script: Some(Arc::clone(&script)),
        tool_call_parser: parser,
        reasoning_parser: reasoning,
        ..Options::default()
    };
    (start(opts).await, script)
}

/// Makes the model write `reply` (then EOS) to the conversation of `body`.
async fn script_reply(server: &TestServer, script: &Script, body: &Value, reply: &str) {
    let tokenize = json!({"messages": body["messages"], "tools": body["tools"]});
    let (status, resp) = server.post("/tokenize", &tokenize).await;
    assert_eq!(status, 200, "{resp}");
    let mut tokens = server.tokenizer.encode(reply, false).expect("encode");
    assert_eq!(server.tokenizer.decode(&tokens, false).expect("decode"), reply, "the reply survives tokenizing");
    tokens.push(server.tokenizer.eos_token_id().expect("an EOS token"));
    script.set(resp["count"].as_u64().expect("count") as usize, tokens);
}

/// A chat body with the tools and greedy sampling.
fn body(extra: Value) -> Value {
    let mut body = json!({"messages": messages(), "tools": tools(), "max_tokens": 200, "temperature": 0});
    for (k, v) in extra.as_object().expect("an object") {
        body[k] = v.clone();
    }
    body
}

fn body_with(body: &Value, key: &str, value: Value) -> Value {
    let mut body = body.clone();
    body[key] = value;
    body
}

fn streaming(body: &Value) -> Value {
    body_with(body, "stream", json!(true))
}

/// What a client assembles from a choice's chunks.
#[derive(Debug, Default)]
struct Assembled {
    content: String,
    reasoning: String,
    calls: Vec<(String, String, String)>,
    finish: Option<String>,
    logprobs: usize,
}

fn assemble(chunks: &[String], num_choices: usize) -> Vec<Assembled> {
    let mut out: Vec<Assembled> = (0..num_choices).map(|_| Assembled::default()).collect();
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    for chunk in &chunks[..chunks.len() - 1] {
        let _: CreateChatCompletionStreamResponse = serde_json::from_str(chunk).expect("an OpenAI chunk");
        let chunk: Value = serde_json::from_str(chunk).expect("json");
        for c in chunk["choices"].as_array().expect("choices") {
            let a = &mut out[c["index"].as_u64().expect("index") as usize];
            assert!(a.finish.is_none(), "nothing after the finish reason");
            let delta = &c["delta"];
            a.content.push_str(delta["content"].as_str().unwrap_or_default());
            a.reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                let index = call["index"].as_u64().expect("index") as usize;
                let keys: Vec<&str> = call.as_object().expect("object").keys().map(String::as_str).collect();
                if let Some(id) = call["id"].as_str() {
                    assert_eq!(keys, ["index", "id", "type", "function"], "{call}");
                    assert_eq!((index, call["type"].as_str()), (a.calls.len(), Some("function")));
                    assert_eq!(call["function"]["arguments"], "", "{call}");
                    let name = call["function"]["name"].as_str().expect("name");
                    a.calls.push((id.to_string(), name.to_string(), String::new()));
                } else {
                    assert_eq!(keys, ["index", "function"], "{call}");
                    assert_eq!(call["function"].as_object().map(|f| f.len()), Some(1), "{call}");
                    a.calls[index].2.push_str(call["function"]["arguments"].as_str().expect("arguments"));
                }
            }
            a.logprobs += c["logprobs"]["content"].as_array().map_or(0, Vec::len);
            a.finish = c["finish_reason"].as_str().map(str::to_string);
        }
    }
    out
}

fn assert_call_id(id: &str) {
    assert!(id.len() == 29 && id.starts_with("call_"), "{id}");
    assert!(id[5..].chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hermes_reply_becomes_tool_calls() {
    let (server, script) = scripted_server(Some(ToolCallParser::Hermes), None).await;
    let body = body(json!({"n": 2, "logprobs": true}));
    script_reply(&server, &script, &body, QWEN_REPLY).await;
    let want_calls =
        [("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#), ("get_time", r#"{"zone": "Europe/Paris"}"#)];

    let (status, resp) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let _: CreateChatCompletionResponse = serde_json::from_value(resp.clone()).expect("an OpenAI response");
    let completion_tokens = resp["usage"]["completion_tokens"].as_u64().expect("usage") as usize;
    for choice in resp["choices"].as_array().expect("choices") {
        let message = &choice["message"];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(message["content"], "I'll check both.");
        let calls = message["tool_calls"].as_array().expect("tool_calls");
        let got: Vec<(&str, &str)> = calls
            .iter()
            .map(|c| {
                assert_eq!(c["type"], "function");
                assert_call_id(c["id"].as_str().expect("id"));
                (c["function"]["name"].as_str().expect("name"), c["function"]["arguments"].as_str().expect("args"))
            })
            .collect();
        assert_eq!(got, want_calls);
        assert_eq!(choice["logprobs"]["content"].as_array().map(Vec::len), Some(completion_tokens / 2));
    }

    let (status, chunks) = server.post_stream("/v1/chat/completions", &streaming(&body)).await;
    assert_eq!(status, 200);
    for choice in assemble(&chunks, 2) {
        assert_eq!(choice.content, "I'll check both.");
        assert_eq!(choice.finish.as_deref(), Some("tool_calls"));
        let got: Vec<(&str, &str)> = choice.calls.iter().map(|(_, n, a)| (n.as_str(), a.as_str())).collect();
        assert_eq!(got, want_calls);
        choice.calls.iter().for_each(|(id, _, _)| assert_call_id(id));
        assert_eq!(choice.logprobs, completion_tokens / 2, "one logprob per token, streamed or not");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_split_before_tool_calls_are_parsed() {
    let (server, script) = scripted_server(Some(ToolCallParser::Hermes), Some(ReasoningParser::DeepSeekR1)).await;
    let body = body(json!({}));
    let reply = format!("The user wants <tool_call> data.\n</think>\n\n{QWEN_REPLY}");
    script_reply(&server, &script, &body, &reply).await;
    let (status, resp) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let message = &resp["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "The user wants <tool_call> data.\n");
    assert_eq!(message["content"], "I'll check both.");
    assert_eq!(message["tool_calls"].as_array().map(Vec::len), Some(2));

    let (status, chunks) = server.post_stream("/v1/chat/completions", &streaming(&body)).await;
    assert_eq!(status, 200);
    let choice = &assemble(&chunks, 1)[0];
    assert_eq!(choice.reasoning, "The user wants <tool_call> data.\n");
    assert_eq!(choice.content, "I'll check both.");
    assert_eq!(choice.calls.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_without_thinking_is_all_content() {
    let (server, script) = scripted_server(None, Some(ReasoningParser::Qwen3)).await;
    let body = json!({"messages": messages(), "max_tokens": 50, "chat_template_kwargs": {"enable_thinking": false}});
    script_reply(&server, &script, &body, "Paris is sunny.").await;
    let (status, resp) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let message = &resp["choices"][0]["message"];
    assert_eq!((&message["content"], message.get("reasoning_content")), (&json!("Paris is sunny."), None));
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_parsing_the_reply_is_text() {
    // tool_choice "none", or a server that knows no tool-call format (the fixture's template
    // teaches none): the markup is the content.
    for (parser, choice) in [(Some(ToolCallParser::Hermes), json!("none")), (None, json!("auto"))] {
        let (server, script) = scripted_server(parser, None).await;
        let body = body(json!({"tool_choice": choice}));
        script_reply(&server, &script, &body, QWEN_REPLY).await;
        let (status, resp) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        let choice = &resp["choices"][0];
        assert_eq!((&choice["message"]["content"], &choice["finish_reason"]), (&json!(QWEN_REPLY), &json!("stop")));
        assert_eq!(choice["message"].get("tool_calls"), None);
    }
}

/// The llama fixture with `[TOOL_CALLS]` a special token (in place of `<pad>`), as in Mistral's
/// tokenizers.
fn fixture_with_special_marker() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for entry in std::fs::read_dir(common::fixture("llama")).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.path().join(path.file_name().expect("name"))).expect("copy");
    }
    let edit = |name: &str, f: &dyn Fn(&mut Value)| {
        let path = dir.path().join(name);
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        f(&mut v);
        std::fs::write(&path, v.to_string()).expect("write");
    };
    edit("tokenizer.json", &|t| {
        assert_eq!(t["added_tokens"][2]["content"], "<pad>");
        t["added_tokens"][2]["content"] = json!("[TOOL_CALLS]");
        let vocab = t["model"]["vocab"].as_object_mut().expect("vocab");
        let id = vocab.remove("<pad>").expect("<pad> in the vocab");
        vocab.insert("[TOOL_CALLS]".into(), id);
    });
    edit("tokenizer_config.json", &|c| {
        c.as_object_mut().expect("object").remove("pad_token");
    });
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_special_marker_is_kept_and_the_end_token_cut() {
    let dir = fixture_with_special_marker();
    let script = Arc::new(Script::default());
    let opts = Options {
        model_dir: Some(dir.path().to_path_buf()),
        script: Some(Arc::clone(&script)),
        tool_call_parser: Some(ToolCallParser::Mistral),
        ..Options::default()
    };
    let server = start(opts).await;
    let marker = server.tokenizer.token_to_id("[TOOL_CALLS]").expect("the marker is a token");
    assert!(server.tokenizer.is_special(marker));
    let reply = r#"[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]"#;
    let body = body(json!({}));
    script_reply(&server, &script, &body, reply).await;
    let (status, resp) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let choice = &resp["choices"][0];
    assert_eq!((&choice["message"]["content"], &choice["finish_reason"]), (&Value::Null, &json!("tool_calls")));
    assert_eq!(choice["message"]["tool_calls"][0]["function"]["arguments"], r#"{"zone": "UTC"}"#);
    let (status, chunks) = server.post_stream("/v1/chat/completions", &streaming(&body)).await;
    assert_eq!(status, 200);
    let streamed = &assemble(&chunks, 1)[0];
    assert_eq!((streamed.content.as_str(), streamed.calls.len()), ("", 1));

    let body = body_with(&body, "skip_special_tokens", json!(true));
    let (status, resp) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let content = resp["choices"][0]["message"]["content"].as_str().expect("content");
    assert_eq!(content, reply.trim_start_matches("[TOOL_CALLS]"), "the client chose to drop special tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_with_tool_calls_and_results_is_accepted() {
    let server = start(Options::default()).await;
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_q3Xk9PzL0aBcDeFgHiJkLmNo",
                "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_q3Xk9PzL0aBcDeFgHiJkLmNo", "content": "18 C"},
        ],
        "tools": tools(), "max_tokens": 3,
    });
    let (status, resp) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_tools_and_tool_choices_are_400s_naming_the_field() {
    let server = start(Options { tool_call_parser: Some(ToolCallParser::Hermes), ..Options::default() }).await;
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    let bad_call = json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
    ]);
    let cases = [
        (json!({"tools": {"type": "function"}}), "tools"),
        (json!({"tools": [{"type": "function", "function": {"description": "x"}}]}), "tools[0].function.name"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tool_choice": named("get_stock")}), "tool_choice"),
        (json!({"tools": null, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": bad_call}), "messages[1].tool_calls[0].function.arguments"),
    ];
    for (extra, param) in cases {
        let body = body(extra.clone());
        let (status, resp) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{extra}: {resp}");
        let err = error_of(&resp);
        assert_eq!(err["param"], param, "{extra}: {resp}");
        assert!(err["message"].as_str().is_some_and(|m| m.contains(param)), "{resp}");
    }
}

/// Tools whose arguments a random model fills in within a few tokens.
fn bounded_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": false}}},
    ])
}

/// A call's arguments as its tool's schema allows them.
fn check_arguments(name: &str, arguments: &str) {
    let args: Value = serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments:?}: {e}"));
    match name {
        "get_weather" => {
            assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 6), "{arguments}");
            assert!(["c", "f"].contains(&args["unit"].as_str().unwrap_or_default()), "{arguments}");
        }
        "get_time" => assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap_or_default()), "{arguments}"),
        other => panic!("a call of {other:?}, which is not a tool"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_choices_are_decoded_into_calls() {
    // The fixture's free text is never a call: whatever comes back as calls came from the schema.
    let server = start(Options::default()).await;
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let cases = [
        (json!({"tool_choice": "required", "parallel_tool_calls": false, "n": 2}), Some(1)),
        (json!({"tool_choice": "required", "seed": 7}), None),
        (json!({"tool_choice": named, "n": 2}), Some(1)),
        // tool_choice wins over response_format.
        (json!({"tool_choice": named, "response_format": {"type": "json_object"}}), Some(1)),
    ];
    for (extra, num_calls) in cases {
        let mut body = body(json!({"temperature": 1, "seed": 3, "max_tokens": 400}));
        body["tools"] = bounded_tools();
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let (status, resp) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{extra}: {resp}");
        for choice in resp["choices"].as_array().expect("choices") {
            assert_eq!(choice["finish_reason"], "tool_calls", "{extra}: {resp}");
            assert_eq!(choice["message"]["content"], Value::Null, "{resp}");
            let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
            assert!(!calls.is_empty() && num_calls.is_none_or(|n| calls.len() == n), "{extra}: {resp}");
            for call in calls {
                assert_call_id(call["id"].as_str().expect("id"));
                let name = call["function"]["name"].as_str().expect("name");
                if extra["tool_choice"].is_object() {
                    assert_eq!(name, "get_time");
                }
                check_arguments(name, call["function"]["arguments"].as_str().expect("arguments"));
            }
        }
        let (status, chunks) = server.post_stream("/v1/chat/completions", &streaming(&body)).await;
        assert_eq!(status, 200);
        let n = body["n"].as_u64().unwrap_or(1) as usize;
        for (choice, full) in assemble(&chunks, n).iter().zip(resp["choices"].as_array().expect("choices")) {
            assert_eq!((choice.content.as_str(), choice.finish.as_deref()), ("", Some("tool_calls")), "{extra}");
            let want: Vec<(&str, &str)> = full["message"]["tool_calls"]
                .as_array()
                .expect("calls")
                .iter()
                .map(|c| {
                    (c["function"]["name"].as_str().unwrap_or(""), c["function"]["arguments"].as_str().unwrap_or(""))
                })
                .collect();
            let got: Vec<(&str, &str)> = choice.calls.iter().map(|(_, n, a)| (n.as_str(), a.as_str())).collect();
            assert_eq!(got, want, "the same seed streams the same calls: {extra}");
        }
    }
}
