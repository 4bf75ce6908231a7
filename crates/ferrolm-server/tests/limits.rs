//! What one request may ask of the server: sequences, prompt tokens, echoed logprob rows, huge
//! texts refused by their bytes before tokenizing; malformed chat messages; a dead engine on
//! `/health`.

mod common;

use std::time::{Duration, Instant};

use common::{cases, start, Options};
use ferrolm_engine::Load;
use ferrolm_server::limits::RequestLimits;
use serde_json::{json, Value};

fn error_message(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_too_many_sequences_is_refused_before_any_work() {
    let limits = RequestLimits { max_sequences: 8, ..RequestLimits::default() };
    let server = start(Options { limits, ..Options::default() }).await;
    let started = Instant::now();
    // 100,000 prompts x n 2: refused on the shape alone, without tokenizing one of them.
    let prompts: Vec<String> = (0..100_000).map(|i| format!("prompt {i}")).collect();
    let (status, body) = server.post("/v1/completions", &json!({"prompt": prompts, "n": 2, "max_tokens": 1})).await;
    assert_eq!(status, 400, "{body}");
    assert!(error_message(&body).contains("200000 sequences"), "{body}");
    assert!(error_message(&body).contains("--max-request-sequences"), "{body}");
    assert_eq!(body["error"]["param"], "prompt");
    assert!(started.elapsed() < Duration::from_secs(5), "refused cheaply: {:?}", started.elapsed());
    let (status, body) =
        server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "n": 9})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("n")), "{body}");
    let (status, body) = server.post("/v1/completions", &json!({"prompt": ["a", "b"], "n": 4, "max_tokens": 1})).await;
    assert_eq!(status, 200, "exactly at the cap: {body}");
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(8));
    assert_eq!(server.wait_idle().await.num_running, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_texts_are_refused_by_their_bytes_before_tokenizing() {
    let server = start(Options::default()).await;
    let huge = "word ".repeat(4 << 20); // 20 MiB
    let started = Instant::now();
    let (status, body) = server.post("/v1/completions", &json!({"prompt": huge, "max_tokens": 1})).await;
    assert_eq!(status, 400, "{body}");
    assert!(error_message(&body).contains("at least"), "{body}");
    assert!(error_message(&body).contains("maximum context length is 512"), "{body}");
    let chat = json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 1});
    let (status, body) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("messages")), "{body}");
    let (status, body) = server.post("/tokenize", &json!({"prompt": huge})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("prompt")), "{body}");
    // Tokenizing 20 MiB takes many seconds on this machine; the bound takes none.
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    let (status, body) = server.post("/tokenize", &json!({"prompt": "word ".repeat(50)})).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["count"].as_u64().is_some_and(|c| c >= 50), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_tokens_and_echoed_logprob_rows_are_capped_per_request() {
    let limits = RequestLimits { max_prompt_tokens: 40, max_prompt_logprob_rows: 60, ..RequestLimits::default() };
    let server = start(Options { limits, ..Options::default() }).await;
    let prompt: Vec<u32> = (10..30).collect();
    let (status, body) =
        server.post("/v1/completions", &json!({"prompt": [prompt, prompt, [5]], "max_tokens": 1})).await;
    assert_eq!(status, 400, "41 tokens: {body}");
    assert!(error_message(&body).contains("--max-request-prompt-tokens"), "{body}");
    let echo = json!({"prompt": prompt, "max_tokens": 1, "echo": true, "logprobs": 2, "n": 3});
    let (status, body) = server.post("/v1/completions", &echo).await;
    assert_eq!(status, 200, "20 tokens x n 3 = 60 rows: {body}");
    let echo = json!({"prompt": prompt, "max_tokens": 1, "echo": true, "logprobs": 2, "n": 4});
    let (status, body) = server.post("/v1/completions", &echo).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("logprobs")), "80 rows: {body}");
    assert!(error_message(&body).contains("80 prompt logprob rows"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_request_of_many_prompts_is_queued_whole_or_not_at_all() {
    let max_pending = Load { sequences: 6, prompt_tokens: 1 << 20 };
    let server = start(Options { max_pending, ..Options::default() }).await;
    let (prompt, _) = cases("llama")[0].clone();
    let (status, body) = server
        .post("/v1/completions", &json!({"prompt": [prompt, prompt, prompt, prompt], "n": 2, "max_tokens": 1}))
        .await;
    assert_eq!((status, body["error"]["code"].as_str()), (503, Some("overloaded")), "8 sequences: {body}");
    assert_eq!(server.engine.pending(), Load::default(), "nothing of it was queued");
    let (status, body) =
        server.post("/v1/completions", &json!({"prompt": [prompt, prompt, prompt], "n": 2, "max_tokens": 1})).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_messages_need_a_known_role_and_content() {
    let server = start(Options { fixture: "qwen3_qknorm", ..Options::default() }).await;
    let cases = [
        (json!([{"role": "hacker", "content": "hi"}]), "messages[0].role"),
        (json!([{"role": "user", "content": null}]), "messages[0].content"),
        (json!([{"role": "system", "content": "be brief"}, {"role": "user"}]), "messages[1].content"),
    ];
    for (messages, param) in cases {
        let (status, body) = server.post("/v1/chat/completions", &json!({"messages": messages})).await;
        assert_eq!((status, body["error"]["param"].as_str()), (400, Some(param)), "{messages}: {body}");
    }
    let ok = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}], "max_tokens": 2});
    let (status, body) = server.post("/v1/chat/completions", &ok).await;
    assert_eq!(status, 200, "an assistant message may leave content null: {body}");
    let top = json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21});
    let (status, body) = server.post("/v1/chat/completions", &top).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("top_logprobs")), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_an_engine_that_died() {
    let server = start(Options { panic_at_step: Some(1), ..Options::default() }).await;
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    let (status, _) = server.post("/v1/completions", &json!({"prompt": [5, 6], "max_tokens": 2})).await;
    assert_eq!(status, 500, "the step that panics fails its request");
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.engine.is_running() {
        assert!(Instant::now() < deadline, "the engine thread should have died");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, body) = server.get("/health").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("the engine has stopped"), "{body}");
}
