//! Every kind of bad request gets its 4xx status and an OpenAI-shaped body; the server keeps
//! serving afterwards.

mod common;

use common::{cases, error_of, start, Options, MODEL_NAME};
use serde_json::{json, Value};

async fn raw(server: &common::TestServer, method: reqwest::Method, path: &str, body: Vec<u8>) -> (u16, Value) {
    let resp = server
        .http
        .request(method, server.url(path))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

async fn assert_still_serves(server: &common::TestServer) {
    let (status, body) = server.post("/v1/completions", &json!({"prompt": "fn", "max_tokens": 2})).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_400s() {
    let server = start(Options::default()).await;
    let post = reqwest::Method::POST;
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        ("/v1/completions", b"{\"prompt\": \"a\", ".to_vec(), None),
        ("/v1/completions", b"".to_vec(), None),
        ("/v1/completions", b"[1, 2]".to_vec(), None),
        ("/v1/completions", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), None),
        ("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3\"}]}".to_vec(), None),
        ("/v1/completions", br#"{"prompt": "a", "max_tokens": "x"}"#.to_vec(), Some("max_tokens")),
        ("/v1/completions", br#"{"prompt": "a", "n": -1}"#.to_vec(), Some("n")),
        ("/v1/completions", br#"{"prompt": {"text": "a"}}"#.to_vec(), Some("prompt")),
        ("/v1/completions", br#"{"prompt": []}"#.to_vec(), Some("prompt")),
        ("/v1/completions", br#"{"max_tokens": 3}"#.to_vec(), None),
        ("/v1/completions", br#"{"prompt": "a", "stop": 7}"#.to_vec(), Some("stop")),
        ("/v1/completions", br#"{"prompt": "a", "logprobs": true}"#.to_vec(), Some("logprobs")),
        ("/v1/chat/completions", br#"{"messages": "hi"}"#.to_vec(), Some("messages")),
        ("/tokenize", br#"{"prompt": 5}"#.to_vec(), Some("prompt")),
        ("/detokenize", br#"{"tokens": ["a"]}"#.to_vec(), Some("tokens[0]")),
    ];
    for (path, body, param) in cases {
        let (status, resp) = raw(&server, post.clone(), path, body.clone()).await;
        assert_eq!(status, 400, "{path} {:?}: {resp}", String::from_utf8_lossy(&body));
        let e = error_of(&resp);
        assert_eq!(e["type"], "invalid_request_error");
        if let Some(param) = param {
            assert_eq!(e["param"], param, "{resp}");
        }
    }
    assert_still_serves(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_out_of_range_are_400s_naming_the_field() {
    let server = start(Options::default()).await;
    let cases = [
        (json!({"prompt": "a", "temperature": -0.5}), "temperature"),
        (json!({"prompt": "a", "top_p": 0}), "top_p"),
        (json!({"prompt": "a", "top_k": -3}), "top_k"),
        (json!({"prompt": "a", "n": 0}), "n"),
        (json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "a", "presence_penalty": 3}), "presence_penalty"),
        (json!({"prompt": "a", "stop": ["x", ""]}), "stop"),
        (json!({"prompt": [5, 320]}), "prompt"),
        (json!({"prompt": "a", "logit_bias": {"5": 10}}), "logit_bias"),
        (json!({"prompt": "a", "stream_options": {"include_usage": true}}), "stream_options"),
    ];
    for (body, param) in cases {
        let (status, resp) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {resp}");
        assert_eq!(error_of(&resp)["param"], param, "{resp}");
    }
    let chat = [
        (json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}), "top_logprobs"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"content": "hi"}]}), "messages[0].role"),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "messages[0].content[0]"),
        (json!({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}), "temperature"),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}), "tool_choice"),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": false, "stream_options": {}}),
            "stream_options",
        ),
    ];
    for (body, param) in chat {
        let (status, resp) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{body}: {resp}");
        assert_eq!(error_of(&resp)["param"], param, "{resp}");
    }
    assert_still_serves(&server).await;
}

/// A parameter a route does not take is refused by name (a misspelt `max_tokens` must not pass
/// as the default), on every route that takes a body; OpenAI's `user` is taken and ignored, and
/// a chat may ask for a text reply and automatic tools explicitly.
/// Stop strings are capped in count and length, stop token ids in count (see
/// `ferrolm_sampling::MAX_STOP_STRINGS` and its neighbours); up to the caps they are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_ids_past_their_caps_are_400s_naming_the_field() {
    let server = start(Options::default()).await;
    let many: Vec<String> = (0..10_000).map(|i| format!("{i:0>100}")).collect();
    let user = json!([{"role": "user", "content": "hi"}]);
    let (too_many_ids, most_ids) = (vec![5u32; 257], vec![5u32; 256]);
    let cases = [
        ("/v1/completions", json!({"prompt": "a", "stop": many}), "stop", "at most 32 strings, got 10000"),
        ("/v1/chat/completions", json!({"messages": user, "stop": many}), "stop", "at most 32 strings"),
        ("/v1/completions", json!({"prompt": "a", "stop": "x".repeat(257)}), "stop", "at most 256 bytes, got 257"),
        (
            "/v1/completions",
            json!({"prompt": "a", "stop_token_ids": too_many_ids}),
            "stop_token_ids",
            "at most 256 ids",
        ),
    ];
    for (path, body, param, needle) in cases {
        let (status, resp) = server.post(path, &body).await;
        assert_eq!(status, 400, "{path}: {resp}");
        let e = error_of(&resp);
        assert_eq!(e["param"], param, "{resp}");
        assert!(e["message"].as_str().is_some_and(|m| m.contains(needle)), "{resp} lacks {needle:?}");
    }
    let at_the_caps: Vec<String> = (0..32).map(|i| format!("{i:é>128}")).collect();
    let body = json!({"prompt": "fn", "max_tokens": 2, "n": 2, "stop": at_the_caps, "stop_token_ids": most_ids});
    let (status, resp) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_still_serves(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_parameters_are_400s_naming_them() {
    let server = start(Options::default()).await;
    let cases = [
        ("/v1/completions", json!({"prompt": "a", "max_token": 3}), "max_token"),
        ("/v1/completions", json!({"prompt": "a", "max_tokens": 2, "guided_json": {}}), "guided_json"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "temprature": 0}),
            "temprature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": {"usage": true}}),
            "stream_options.usage",
        ),
        ("/tokenize", json!({"prompt": "a", "add_special_token": true}), "add_special_token"),
        ("/detokenize", json!({"tokens": [1], "skip_special_tokens": true}), "skip_special_tokens"),
    ];
    for (path, body, param) in cases {
        let (status, resp) = server.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {resp}");
        let e = error_of(&resp);
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], param, "{resp}");
        let message = e["message"].as_str().unwrap_or_default();
        assert!(message.contains("unrecognized request argument") && message.contains(param), "{resp}");
    }
    let (status, resp) = server.post("/v1/completions", &json!({"prompt": "a", "max_tokens": 2, "user": "u-1"})).await;
    assert_eq!(status, 200, "{resp}");
    let chat = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "user": "u-1",
        "response_format": {"type": "text"},
        "tool_choice": "auto",
        "parallel_tool_calls": false,
    });
    let (status, resp) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{resp}");
    assert_still_serves(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_long_requests_are_400s_with_the_numbers() {
    let server = start(Options { max_model_len: 64, ..Options::default() }).await;
    let (prompt, _) = cases("llama")[1].clone();
    let n = prompt.len();
    let (status, resp) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 60})).await;
    assert_eq!(status, 400, "{resp}");
    let e = error_of(&resp);
    let message = e["message"].as_str().unwrap_or_default();
    for number in ["64".to_string(), n.to_string(), "60".to_string(), (n + 60).to_string()] {
        assert!(message.contains(&number), "{message:?} lacks {number}");
    }
    assert_eq!(e["code"], "context_length_exceeded");
    // A prompt alone longer than the context.
    let (status, resp) = server.post("/v1/completions", &json!({"prompt": vec![5u32; 70], "max_tokens": 1})).await;
    assert_eq!(status, 400);
    assert!(error_of(&resp)["message"].as_str().is_some_and(|m| m.contains("70") && m.contains("64")), "{resp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_models_routes_and_methods() {
    let server = start(Options::default()).await;
    let (status, resp) = server.post("/v1/completions", &json!({"model": "gpt-9", "prompt": "a"})).await;
    assert_eq!(status, 404);
    let e = error_of(&resp);
    assert_eq!((e["code"].clone(), e["param"].clone()), (json!("model_not_found"), json!("model")));
    let (status, resp) = server
        .post("/v1/chat/completions", &json!({"model": "x", "messages": [{"role": "user", "content": "a"}]}))
        .await;
    assert_eq!((status, error_of(&resp)["code"].clone()), (404, json!("model_not_found")));
    // The served name is accepted; leaving `model` out is too.
    let (status, _) =
        server.post("/v1/completions", &json!({"model": MODEL_NAME, "prompt": "a", "max_tokens": 1})).await;
    assert_eq!(status, 200);

    let (status, resp) = server.post("/v1/nothing", &json!({})).await;
    assert_eq!(status, 404);
    assert_eq!(error_of(&resp)["code"], "unknown_url");
    let (status, body) = server.get("/v2/models").await;
    assert_eq!(status, 404, "{body}");

    let (status, body) = server.get("/v1/completions").await;
    assert_eq!(status, 405);
    let body: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(error_of(&body)["code"], "method_not_allowed");
    let (status, _) = raw(&server, reqwest::Method::DELETE, "/v1/models", Vec::new()).await;
    assert_eq!(status, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_413s() {
    let limit = 64 << 10;
    let server = start(Options { max_body_bytes: limit, ..Options::default() }).await;
    let prompt = "x".repeat(limit);
    let body = json!({"prompt": prompt}).to_string().into_bytes();
    let (status, resp) = raw(&server, reqwest::Method::POST, "/v1/completions", body).await;
    assert_eq!(status, 413, "{resp}");
    assert_eq!(error_of(&resp)["code"], "request_too_large");
    assert_still_serves(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_required_where_set() {
    let server = start(Options { api_key: Some("sesame".into()), ..Options::default() }).await;
    let body = json!({"prompt": "fn", "max_tokens": 1}).to_string();
    let send = |auth: Option<&'static str>, path: &'static str| {
        let mut req = server.http.post(server.url(path)).body(body.clone());
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        req.send()
    };
    for auth in [None, Some("Bearer wrong"), Some("sesame"), Some("Bearer sesame2"), Some("Basic sesame")] {
        let resp = send(auth, "/v1/completions").await.expect("send");
        assert_eq!(resp.status().as_u16(), 401, "{auth:?}");
        let body = json_of(resp).await;
        assert_eq!(error_of(&body)["code"], "invalid_api_key");
    }
    let resp = send(None, "/tokenize").await.expect("send");
    assert_eq!(resp.status().as_u16(), 401);
    let resp = send(Some("Bearer sesame"), "/v1/completions").await.expect("send");
    assert_eq!(resp.status().as_u16(), 200);
    // The OpenAI client sends the key it was given.
    let config =
        async_openai::config::OpenAIConfig::new().with_api_base(format!("{}/v1", server.base)).with_api_key("sesame");
    let request = async_openai::types::completions::CreateCompletionRequestArgs::default()
        .model(MODEL_NAME)
        .prompt("fn")
        .max_tokens(2u32)
        .build()
        .expect("request");
    let done = async_openai::Client::with_config(config).completions().create(request).await.expect("with the key");
    assert_eq!(done.choices.len(), 1);
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(server.get("/health").await.0, 200);
    assert_eq!(server.get("/metrics").await.0, 200);
    assert_eq!(server.get("/v1/models").await.0, 401);
}

async fn json_of(resp: reqwest::Response) -> Value {
    serde_json::from_str(&resp.text().await.expect("body")).unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_pushes_back_with_503() {
    let server = start(Options {
        max_pending: ferrolm_engine::Load { sequences: 64, prompt_tokens: 1 << 20 },
        ..Options::default()
    })
    .await;
    let (prompt, _) = cases("llama")[0].clone();
    // A long request holds the only slot: 64 sequences of 480 tokens, streamed and unread.
    let long = json!({"prompt": prompt, "n": 64, "max_tokens": 480, "ignore_eos": true, "stream": true});
    let held = server.http.post(server.url("/v1/completions")).body(long.to_string()).send().await.expect("send");
    assert_eq!(held.status().as_u16(), 200);
    let (status, resp) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 2})).await;
    assert_eq!(status, 503, "{resp}");
    assert_eq!(error_of(&resp)["code"], "overloaded");
    assert_eq!(error_of(&resp)["type"], "server_error");
    drop(held);
    server.wait_idle().await;
    assert_still_serves(&server).await;
}
