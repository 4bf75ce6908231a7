//! Operating the server: clients that go away, metrics, tokenize/detokenize, health, models,
//! and graceful shutdown.

mod common;

use std::time::{Duration, Instant};

use common::{cases, ids, reference, sse_data, start, Options, MODEL_NAME};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

/// 64 sequences of 480 tokens: long enough that a request cut off after its first chunk is
/// far from done.
const N: usize = 64;
const MAX_TOKENS: usize = 480;

fn long_request(stream: bool) -> Value {
    let (prompt, _) = cases("llama")[0].clone();
    json!({"prompt": prompt, "n": N, "max_tokens": MAX_TOKENS, "ignore_eos": true, "stream": stream})
}

async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_frees_its_request() {
    let server = start(Options::default()).await;
    let before = server.engine.stats().generation_tokens;
    let client = reqwest::Client::new();
    let mut resp =
        client.post(server.url("/v1/completions")).body(long_request(true).to_string()).send().await.expect("send");
    assert_eq!(resp.status().as_u16(), 200);
    let first = resp.chunk().await.expect("read").expect("a first chunk");
    assert!(String::from_utf8_lossy(&first).starts_with("data: {"), "{first:?}");
    assert!(server.engine.pending().sequences > 0, "the request is in flight");
    drop(resp);
    drop(client);

    let after = server.wait_idle().await;
    let generated = after.generation_tokens - before;
    assert!(generated < (N * MAX_TOKENS) as u64, "the request ran to its end ({generated} tokens): not aborted");

    // The server still serves.
    let (status, body) = server.post("/v1/completions", &json!({"prompt": "fn", "max_tokens": 3})).await;
    assert_eq!(status, 200, "{body}");
    server.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_a_non_streamed_answer_frees_its_request() {
    let server = start(Options::default()).await;
    let before = server.engine.stats().generation_tokens;
    let body = long_request(false).to_string();
    let mut socket = tokio::net::TcpStream::connect(server.addr).await.expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        server.addr,
        body.len()
    );
    socket.write_all(head.as_bytes()).await.expect("write");
    socket.write_all(body.as_bytes()).await.expect("write");
    let engine = server.engine.clone();
    wait_until("the request to start", || engine.stats().generation_tokens > before).await;
    drop(socket);

    let after = server.wait_idle().await;
    let generated = after.generation_tokens - before;
    assert!(generated < (N * MAX_TOKENS) as u64, "the request ran to its end ({generated} tokens): not aborted");
    let (status, _) = server.post("/v1/completions", &json!({"prompt": "fn", "max_tokens": 3})).await;
    assert_eq!(status, 200);
}

/// The value of the series whose line starts with `series` (name and labels).
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_happened() {
    let server = start(Options::default()).await;
    let (prompt, _) = cases("llama")[1].clone();
    let body = json!({"prompt": prompt, "max_tokens": 7, "ignore_eos": true});
    let (status, _) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200);
    let stop =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": true, "stream": true});
    let (status, _) = server.post_stream("/v1/chat/completions", &stop).await;
    assert_eq!(status, 200);
    server.wait_idle().await;

    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    let label = format!("{{model_name=\"{MODEL_NAME}\"}}");
    let get =
        |name: &str| sample(&text, &format!("{name}{label}")).unwrap_or_else(|| panic!("{name} missing:\n{text}"));
    assert_eq!(get("ferrolm:num_requests_running"), 0.0);
    assert_eq!(get("ferrolm:num_requests_waiting"), 0.0);
    assert_eq!(get("ferrolm:kv_cache_usage_perc"), 0.0);
    assert_eq!(get("ferrolm:generation_tokens_total"), 11.0);
    assert!(get("ferrolm:prompt_tokens_total") >= prompt.len() as f64);
    assert!(get("ferrolm:prefix_cache_queries_total") >= prompt.len() as f64);
    assert!(get("ferrolm:prefix_cache_hits_total") >= 0.0);
    assert_eq!(get("ferrolm:num_preemptions_total"), 0.0);
    for histogram in ["time_to_first_token_seconds", "e2e_request_latency_seconds"] {
        assert_eq!(get(&format!("ferrolm:{histogram}_count")), 2.0, "{histogram}");
        let sum = get(&format!("ferrolm:{histogram}_sum"));
        assert!(sum > 0.0 && sum < 60.0, "{histogram} sum {sum}");
    }
    // 6 + 3 gaps between the tokens of the two requests.
    assert_eq!(get("ferrolm:inter_token_latency_seconds_count"), 9.0);
    let length = format!("ferrolm:request_success_total{{model_name=\"{MODEL_NAME}\",finished_reason=\"length\"}}");
    assert_eq!(sample(&text, &length), Some(2.0), "{text}");
    assert!(text.contains("# TYPE ferrolm:time_to_first_token_seconds histogram"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip() {
    let server = start(Options::default()).await;
    for case in reference("llama")["tokenize"].as_array().expect("tokenize cases") {
        let text = case["text"].as_str().expect("text");
        let body = json!({"model": MODEL_NAME, "prompt": text, "add_special_tokens": false, "return_token_strs": true});
        let (status, resp) = server.post("/tokenize", &body).await;
        assert_eq!(status, 200, "{resp}");
        let tokens = ids(&resp["tokens"]);
        assert_eq!(tokens, ids(&case["ids"]), "{text:?}");
        assert_eq!(resp["count"], tokens.len());
        assert_eq!(resp["max_model_len"], 512);
        assert_eq!(resp["token_strs"].as_array().map(Vec::len), Some(tokens.len()));
        let (status, back) = server.post("/detokenize", &json!({"tokens": tokens})).await;
        assert_eq!(status, 200, "{back}");
        assert_eq!(back["prompt"], text);
    }
    // Messages are rendered with the chat template.
    let messages = json!([{"role": "user", "content": "hi"}]);
    let (_, resp) = server.post("/tokenize", &json!({"messages": messages})).await;
    let template = server.tokenizer.chat_template().expect("template");
    let rendered = template.render(&[ferrolm_tokenizer::ChatMessage::new("user", "hi")], true, None).expect("render");
    assert_eq!(ids(&resp["tokens"]), server.tokenizer.encode(&rendered, false).expect("encode"));
    // Ids outside the vocabulary are the client's fault.
    let (status, resp) = server.post("/detokenize", &json!({"tokens": [1, 100000]})).await;
    assert_eq!(status, 400, "{resp}");
    let (status, _) = server.post("/tokenize", &json!({"prompt": "a", "messages": messages})).await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_models() {
    let server = start(Options { max_model_len: 256, ..Options::default() }).await;
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    let (status, body) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let list: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["id"], MODEL_NAME);
    assert_eq!(list["data"][0]["object"], "model");
    assert_eq!(list["data"][0]["max_model_len"], 256);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_requests_in_flight_finish() {
    let mut server = start(Options::default()).await;
    let (prompt, _) = cases("llama")[0].clone();
    let body = json!({"prompt": prompt, "n": 8, "max_tokens": 200, "ignore_eos": true, "stream": true});
    let mut resp = server.http.post(server.url("/v1/completions")).body(body.to_string()).send().await.expect("send");
    let mut text = String::from_utf8_lossy(&resp.chunk().await.expect("read").expect("chunk")).into_owned();
    server.trigger_shutdown();
    while let Some(bytes) = resp.chunk().await.expect("the stream goes on") {
        text.push_str(&String::from_utf8_lossy(&bytes));
    }
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let finished = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|c| c["choices"][0]["finish_reason"] == "length")
        .count();
    assert_eq!(finished, 8, "every sequence ran to its end");
    let addr = server.addr;
    server.shutdown().await.expect("a clean shutdown");
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "no new connections after shutdown");
}

/// Past the grace period every choice still going ends with `finish_reason: "abort"`, and the
/// usage chunk the client asked for still comes, before `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_aborts_requests_past_the_grace_period() {
    let mut server = start(Options { shutdown_grace_period: Duration::from_millis(50), ..Options::default() }).await;
    let before = server.engine.stats().generation_tokens;
    let mut request = long_request(true);
    request["stream_options"] = json!({"include_usage": true});
    let mut resp =
        server.http.post(server.url("/v1/completions")).body(request.to_string()).send().await.expect("send");
    let mut text = String::from_utf8_lossy(&resp.chunk().await.expect("read").expect("chunk")).into_owned();
    server.trigger_shutdown();
    while let Ok(Some(bytes)) = resp.chunk().await {
        text.push_str(&String::from_utf8_lossy(&bytes));
    }
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data.iter().filter_map(|d| serde_json::from_str(d).ok()).collect();
    let mut finishes = vec![None; N];
    for choice in chunks.iter().flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default()) {
        if let (Some(i), Some(reason)) = (choice["index"].as_u64(), choice["finish_reason"].as_str()) {
            finishes[i as usize] = Some(reason.to_string());
        }
    }
    assert!(finishes.iter().all(|f| f.is_some()), "every choice ends: {finishes:?}");
    assert!(finishes.iter().any(|f| f.as_deref() == Some("abort")), "{finishes:?}");
    let usage = chunks.last().map(|c| c["usage"].clone()).unwrap_or_default();
    assert!(usage["completion_tokens"].as_u64().is_some_and(|t| t > 0), "usage comes last: {usage}");
    let engine = server.engine.clone();
    server.shutdown().await.expect("a clean shutdown");
    let after = common::wait_idle(&engine).await;
    assert!(after.generation_tokens - before < (N * MAX_TOKENS) as u64);
}
