//! `POST /v1/chat/completions` end to end with the llama fixture's chat template.

mod common;

use async_openai::types::chat::{
    ChatCompletionRequestMessage, ChatCompletionRequestSystemMessage, ChatCompletionRequestUserMessage,
    ChatCompletionStreamOptions, CreateChatCompletionRequestArgs, FinishReason, Role,
};
use common::{error_of, ids, start, Options, MODEL_NAME};
use ferrolm_engine::GenerateRequest;
use ferrolm_sampling::SamplingParams;
use ferrolm_tokenizer::ChatMessage;
use futures_util::StreamExt;
use serde_json::{json, Value};

fn conversation() -> Vec<ChatMessage> {
    vec![ChatMessage::new("system", "You write Rust."), ChatMessage::new("user", "fn main() {")]
}

fn openai_messages() -> Vec<ChatCompletionRequestMessage> {
    vec![
        ChatCompletionRequestSystemMessage::from("You write Rust.").into(),
        ChatCompletionRequestUserMessage::from("fn main() {").into(),
    ]
}

/// The prompt ids the template gives, tokenized without special tokens (the template wrote them).
fn rendered_ids(server: &common::TestServer, messages: &[ChatMessage], add_generation_prompt: bool) -> Vec<u32> {
    let template = server.tokenizer.chat_template().expect("the llama fixture has a chat template");
    let text = template.render(messages, add_generation_prompt, None).expect("render");
    server.tokenizer.encode(&text, false).expect("encode")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_renders_the_template_and_matches_the_engine() {
    let server = start(Options::default()).await;
    let client = server.openai();
    let request = CreateChatCompletionRequestArgs::default()
        .model(MODEL_NAME)
        .messages(openai_messages())
        .max_completion_tokens(10u32)
        .temperature(0.0)
        .build()
        .expect("request");
    let resp = client.chat().create(request).await.expect("chat");
    let prompt = rendered_ids(&server, &conversation(), true);
    let usage = resp.usage.expect("usage");
    assert_eq!(usage.prompt_tokens as usize, prompt.len());
    assert_eq!(resp.object, "chat.completion");
    assert!(resp.id.starts_with("chatcmpl-"));
    let choice = &resp.choices[0];
    assert_eq!(choice.message.role, Role::Assistant);

    // The engine on the rendered prompt says the same (EOS may end it before 10 tokens).
    let params = SamplingParams { temperature: 0.0, max_tokens: Some(10), ..SamplingParams::default() };
    let mut stream = server
        .engine
        .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params, grammar: None })
        .expect("submit");
    let (mut tokens, mut text) = (Vec::new(), String::new());
    while let Some(out) = stream.recv().await {
        tokens.extend(out.token_ids);
        text.push_str(&out.text);
    }
    assert_eq!(choice.message.content.as_deref(), Some(text.as_str()));
    assert_eq!(usage.completion_tokens as usize, tokens.len());

    // vLLM's return_token_ids shows the exact prompt.
    let body = json!({
        "messages": [{"role": "system", "content": "You write Rust."}, {"role": "user", "content": "fn main() {"}],
        "max_tokens": 10, "temperature": 0, "return_token_ids": true,
    });
    let (status, raw) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{raw}");
    assert_eq!(ids(&raw["choices"][0]["prompt_token_ids"]), prompt);
    assert_eq!(ids(&raw["choices"][0]["token_ids"]), tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_deltas_concatenate_to_the_message() {
    let server = start(Options::default()).await;
    let client = server.openai();
    let mut args = CreateChatCompletionRequestArgs::default();
    args.model(MODEL_NAME).messages(openai_messages()).max_completion_tokens(24u32).temperature(0.0).n(2u8);
    let full = client.chat().create(args.build().expect("request")).await.expect("chat");
    assert_eq!(full.choices.len(), 2);
    assert_eq!(full.choices[0].message.content, full.choices[1].message.content, "greedy samples agree");

    args.stream_options(ChatCompletionStreamOptions { include_usage: Some(true), ..Default::default() });
    let mut stream = client.chat().create_stream(args.build().expect("request")).await.expect("stream");
    let mut texts = [String::new(), String::new()];
    let mut roles = [0, 0];
    let mut finishes: [Option<FinishReason>; 2] = [None, None];
    let mut usage = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("chunk");
        assert_eq!(chunk.object, "chat.completion.chunk");
        if let Some(u) = chunk.usage {
            assert!(chunk.choices.is_empty());
            usage = Some(u);
        }
        for c in chunk.choices {
            let i = c.index as usize;
            if c.delta.role.is_some() {
                assert_eq!(c.delta.role, Some(Role::Assistant));
                assert!(texts[i].is_empty(), "the role comes first");
                roles[i] += 1;
            }
            assert!(finishes[i].is_none(), "nothing after the finish reason");
            texts[i].push_str(c.delta.content.as_deref().unwrap_or_default());
            finishes[i] = c.finish_reason;
        }
    }
    assert_eq!(roles, [1, 1]);
    for i in 0..2 {
        assert_eq!(Some(texts[i].as_str()), full.choices[i].message.content.as_deref());
        assert_eq!(finishes[i], full.choices[i].finish_reason);
    }
    // Counts agree; the second run may find the prompt in the prefix cache.
    let (usage, want) = (usage.expect("a usage chunk"), full.usage.expect("usage"));
    assert_eq!(
        (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens),
        (want.prompt_tokens, want.completion_tokens, want.total_tokens)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_have_the_chat_shape() {
    let server = start(Options::default()).await;
    let body = json!({
        "messages": [{"role": "user", "content": "fn main() {"}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3,
    });
    let (status, resp) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let content = resp["choices"][0]["logprobs"]["content"].as_array().expect("content");
    assert_eq!(content.len(), 6);
    let mut text = String::new();
    for entry in content {
        let token = entry["token"].as_str().expect("token");
        text.push_str(token);
        assert_eq!(entry["bytes"], json!(token.as_bytes()));
        let top = entry["top_logprobs"].as_array().expect("top");
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        let best = top[0]["logprob"].as_f64().expect("f");
        assert!((entry["logprob"].as_f64().expect("f") - best).abs() < 1e-6, "{entry}");
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
    }
    // Valid UTF-8 text decodes token by token into the message (when no character is split).
    if !text.contains('\u{fffd}') {
        assert_eq!(resp["choices"][0]["message"]["content"], text);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_parts_and_generation_prompt_options() {
    let server = start(Options::default()).await;
    let tokens = |resp: &Value| resp["usage"]["prompt_tokens"].as_u64().expect("prompt tokens") as usize;
    let plain = json!({"messages": [{"role": "user", "content": "a\nb"}], "max_tokens": 1});
    let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_tokens": 1});
    let (_, a) = server.post("/v1/chat/completions", &plain).await;
    let (_, b) = server.post("/v1/chat/completions", &parts).await;
    assert_eq!(tokens(&a), tokens(&b));
    assert_eq!(tokens(&a), rendered_ids(&server, &[ChatMessage::new("user", "a\nb")], true).len());

    let no_prompt =
        json!({"messages": [{"role": "user", "content": "a\nb"}], "max_tokens": 1, "add_generation_prompt": false});
    let (_, c) = server.post("/v1/chat/completions", &no_prompt).await;
    assert_eq!(tokens(&c), rendered_ids(&server, &[ChatMessage::new("user", "a\nb")], false).len());
    assert!(tokens(&c) < tokens(&a));

    // Continuing the assistant's message: the prompt ends with its text, not an end of turn.
    let cont = json!({
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fn main"}],
        "continue_final_message": true, "add_generation_prompt": false, "max_tokens": 1, "return_token_ids": true,
    });
    let (status, d) = server.post("/v1/chat/completions", &cont).await;
    assert_eq!(status, 200, "{d}");
    let prompt = ids(&d["choices"][0]["prompt_token_ids"]);
    let text = server.tokenizer.decode(&prompt, false).expect("decode");
    assert!(text.ends_with("assistant\nfn main"), "{text:?}");

    let both = json!({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true, "add_generation_prompt": true});
    let (status, resp) = server.post("/v1/chat/completions", &both).await;
    assert_eq!(status, 400);
    error_of(&resp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_a_chat_template_refuses_chat_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = common::fixture("llama");
    for entry in std::fs::read_dir(&src).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.path().join(path.file_name().expect("name"))).expect("copy");
    }
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).expect("read")).expect("json");
    config.as_object_mut().expect("object").remove("chat_template");
    std::fs::write(&config_path, config.to_string()).expect("write");

    let server = start(Options { model_dir: Some(dir.path().to_path_buf()), ..Options::default() }).await;
    let (status, resp) =
        server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 400, "{resp}");
    assert!(error_of(&resp)["message"].as_str().is_some_and(|m| m.contains("chat template")), "{resp}");
    // Completions still work.
    let (status, _) = server.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(status, 200);
}
