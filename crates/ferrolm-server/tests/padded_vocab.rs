//! A served model whose embedding is padded past its tokenizer (as Qwen2.5's is): a prompt id
//! in the padding is a 400 naming the id and the tokenizer's size on `/v1/completions` (plain
//! and streaming) and on `/detokenize`, never a 500; completions never hold a padded id and
//! give the unpadded model's tokens.

mod common;

#[path = "../../ferrolm-model/tests/common/padded_vocab.rs"]
mod padded_vocab;

use common::{cases, error_of, ids, start, Options, MODEL_NAME};
use padded_vocab::padded_copy;
use serde_json::json;

const FIXTURE: &str = "llama3_gqa";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn padded_ids_are_refused_in_prompts_and_never_generated() {
    let padded = padded_copy(&common::fixture(FIXTURE)).expect("padded copy of the fixture");
    let server = start(Options { model_dir: Some(padded.path().to_path_buf()), ..Options::default() }).await;
    let num_tokens = padded.num_tokens;
    let padded_id = num_tokens + 7;
    let message = format!("token id {padded_id} is out of vocabulary: the tokenizer has {num_tokens} tokens");

    // In a prompt of ids, first or second of several prompts, streaming or not: a 400.
    let prompt = json!([5, padded_id, 10, 11, 12, 13, 14, 15, 16]);
    for body in [
        json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}),
        json!({"model": MODEL_NAME, "prompt": [[5, 6, 7], prompt], "max_tokens": 4}),
        json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "stream": true}),
        json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "echo": true, "logprobs": 2}),
    ] {
        let (status, resp) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {resp}");
        let e = error_of(&resp);
        assert_eq!(e["type"], "invalid_request_error", "{resp}");
        assert_eq!(e["message"], message, "{resp}");
        assert_eq!(e["param"], "prompt", "{resp}");
    }
    let (status, resp) = server.post("/detokenize", &json!({"tokens": [5, padded_id]})).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(error_of(&resp)["message"], message, "{resp}");
    assert_eq!(error_of(&resp)["param"], "tokens", "{resp}");

    // Ordinary prompts: the reference (the unpadded model's) greedy tokens, though every
    // padded row would win the argmax; sampled tokens and top logprobs stay in the tokenizer.
    for (i, (prompt, want)) in cases(FIXTURE).into_iter().enumerate() {
        let body = json!({"prompt": prompt, "max_tokens": want.len(), "temperature": 0, "ignore_eos": true,
            "return_token_ids": true});
        let (status, resp) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(ids(&resp["choices"][0]["token_ids"]), want, "case {i}");
        let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": 3, "n": 3,
            "ignore_eos": true, "return_token_ids": true, "logprobs": 5});
        let (status, resp) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        for choice in resp["choices"].as_array().expect("choices") {
            let tokens = ids(&choice["token_ids"]);
            assert_eq!(tokens.len(), 16);
            assert!(tokens.iter().all(|&t| (t as usize) < num_tokens), "case {i}: {tokens:?}");
            assert!(choice["text"].as_str().is_some_and(|t| !t.is_empty()), "case {i}: {choice}");
            // A padded id would have no text: every top logprob's text is a token's.
            for top in choice["logprobs"]["top_logprobs"].as_array().expect("top logprobs") {
                let texts = top.as_object().expect("text -> logprob");
                assert!(!texts.is_empty() && texts.keys().all(|t| !t.is_empty()), "case {i}: {top}");
            }
        }
    }
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    server.wait_idle().await;
}
