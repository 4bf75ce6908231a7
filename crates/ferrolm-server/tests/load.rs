//! Load: many concurrent streaming clients, some of which drop mid-stream. Every request that
//! stays finishes correctly, nothing fails, and afterwards nothing is running and no KV block is
//! held (as `/metrics` reports).

mod common;

use std::sync::Arc;

use common::{cases, start, Options};
use serde_json::{json, Value};

/// The value of an unlabelled-or-labelled series named `name` in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing from:\n{text}"))
}

/// Text and token ids of one streamed completion.
fn streamed(events: &[String]) -> (String, Vec<u64>, Option<String>) {
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut finish = None;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).expect("chunk json");
        assert!(v.get("error").is_none(), "error chunk: {e}");
        for c in v["choices"].as_array().into_iter().flatten() {
            text.push_str(c["text"].as_str().unwrap_or(""));
            token_ids.extend(c["token_ids"].as_array().into_iter().flatten().filter_map(Value::as_u64));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, token_ids, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_all_finish_correctly() {
    let server = Arc::new(
        start(Options {
            max_num_seqs: 256,
            max_pending: ferrolm_engine::Load { sequences: 512, prompt_tokens: 1 << 20 },
            num_blocks: 2048,
            ..Options::default()
        })
        .await,
    );
    let cases = cases("llama");
    let mut tasks = Vec::new();
    for i in 0..200usize {
        let server = Arc::clone(&server);
        let (prompt, greedy) = cases[i % cases.len()].clone();
        let max_tokens = 1 + i % greedy.len();
        tasks.push(tokio::spawn(async move {
            let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
                              "stream": true, "return_token_ids": true});
            let (status, events) = server.post_stream("/v1/completions", &body).await;
            (status, events, greedy[..max_tokens].to_vec())
        }));
    }
    for task in tasks {
        let (status, events, want) = task.await.expect("task");
        assert_eq!(status, 200);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let (_, token_ids, finish) = streamed(&events);
        let want: Vec<u64> = want.iter().map(|&t| t as u64).collect();
        assert_eq!(token_ids, want);
        assert_eq!(finish.as_deref(), Some("length"));
    }
    server.wait_idle().await;
    let (_, text) = server.get("/metrics").await;
    let successes: f64 = text
        .lines()
        .filter(|l| l.starts_with("ferrolm:request_success_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(successes, 200.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_dropping_mid_stream_leave_nothing_behind() {
    let server = start(Options {
        max_num_seqs: 128,
        max_pending: ferrolm_engine::Load { sequences: 256, prompt_tokens: 1 << 20 },
        num_blocks: 4096,
        ..Options::default()
    })
    .await;
    let (prompt, _) = cases("llama")[2].clone();
    let mut responses = Vec::new();
    for _ in 0..32 {
        // 4 samples of 400 tokens each: far more work than can finish before the hang-up.
        let body = json!({"prompt": prompt, "n": 4, "max_tokens": 400, "ignore_eos": true, "stream": true});
        let resp = server.http.post(server.url("/v1/completions")).body(body.to_string()).send().await.expect("send");
        assert_eq!(resp.status().as_u16(), 200);
        responses.push(resp);
    }
    // Read each stream until its first event (queued ones get keep-alive lines first), then hang
    // up on all of them.
    for resp in &mut responses {
        loop {
            let chunk = resp.chunk().await.expect("read").expect("the stream ended before any event");
            if String::from_utf8_lossy(&chunk).contains("data: ") {
                break;
            }
        }
    }
    drop(responses);
    server.wait_idle().await;
    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(metric(&text, "ferrolm:num_requests_running"), 0.0);
    assert_eq!(metric(&text, "ferrolm:num_requests_waiting"), 0.0);
    assert_eq!(metric(&text, "ferrolm:kv_cache_usage_perc"), 0.0);
    // 32 x 4 x 400 tokens were asked for; the hang-ups cut that short.
    assert!(metric(&text, "ferrolm:generation_tokens_total") < 32.0 * 4.0 * 400.0);
    // And the server still answers.
    let (status, events) =
        server.post_stream("/v1/completions", &json!({"prompt": prompt, "max_tokens": 3, "stream": true})).await;
    assert_eq!(status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}
