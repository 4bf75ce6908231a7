//! `POST /v1/completions` end to end on fixture models: greedy ids against the reference and the
//! engine, streaming against non-streaming, usage, logprobs, echo, n, several prompts, stop.

mod common;

use async_openai::types::chat::{Prompt, StopConfiguration};
use async_openai::types::completions::CreateCompletionRequestArgs;
use common::{cases, error_of, ids, reference, start, Options, MODEL_NAME};
use ferrolm_engine::GenerateRequest;
use ferrolm_sampling::SamplingParams;
use futures_util::StreamExt;
use serde_json::{json, Value};

fn greedy_body(prompt: &[u32], max_tokens: usize) -> Value {
    json!({
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
        // OpenAI's end-user id is taken (and not used).
        "user": "tests",
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_ids_match_the_reference_and_the_engine() {
    for fixture in ["llama", "qwen2_tied"] {
        let server = start(Options { fixture, ..Options::default() }).await;
        for (i, (prompt, want)) in cases(fixture).into_iter().enumerate() {
            let (status, body) = server.post("/v1/completions", &greedy_body(&prompt, want.len())).await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["object"], "text_completion");
            assert_eq!(body["model"], MODEL_NAME);
            assert!(body["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")));
            let choice = &body["choices"][0];
            assert_eq!(ids(&choice["token_ids"]), want, "{fixture} case {i}");
            assert_eq!(ids(&choice["prompt_token_ids"]), prompt);
            assert_eq!(choice["finish_reason"], "length");
            assert_eq!(choice["index"], 0);
            let usage = &body["usage"];
            assert_eq!(usage["prompt_tokens"], prompt.len());
            assert_eq!(usage["completion_tokens"], want.len());
            assert_eq!(usage["total_tokens"], prompt.len() + want.len());

            // The engine alone, with the same parameters, says the same.
            let params = SamplingParams {
                temperature: 0.0,
                max_tokens: Some(want.len() as u32),
                ignore_eos: true,
                ..SamplingParams::default()
            };
            let mut stream = server
                .engine
                .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params, grammar: None })
                .expect("submit");
            let (mut tokens, mut text) = (Vec::new(), String::new());
            while let Some(out) = stream.recv().await {
                tokens.extend(out.token_ids);
                text.push_str(&out.text);
            }
            assert_eq!(tokens, want);
            assert_eq!(choice["text"], text);
        }
        server.wait_idle().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_concatenates_to_the_non_streamed_text() {
    let server = start(Options::default()).await;
    let client = server.openai();
    let (prompt, _) = cases("llama")[1].clone();
    for prompt in [Prompt::IntegerArray(prompt), Prompt::String("fn main() {".into())] {
        let request = CreateCompletionRequestArgs::default()
            .model(MODEL_NAME)
            .prompt(prompt)
            .max_tokens(20u32)
            .temperature(0.0)
            .build()
            .expect("request");
        let full = client.completions().create(request.clone()).await.expect("completion");
        assert_eq!(full.choices.len(), 1);
        let usage = full.usage.clone().expect("usage");
        assert_eq!(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);

        let mut streamed = request;
        streamed.stream_options = Some(async_openai::types::chat::ChatCompletionStreamOptions {
            include_usage: Some(true),
            ..Default::default()
        });
        let mut stream = client.completions().create_stream(streamed).await.expect("stream");
        let (mut text, mut finish, mut stream_usage, mut id) = (String::new(), None, None, None);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("chunk");
            assert_eq!(id.get_or_insert_with(|| chunk.id.clone()), &chunk.id, "one id for every chunk");
            for c in &chunk.choices {
                text.push_str(&c.text);
                finish = c.finish_reason.or(finish);
            }
            if let Some(u) = chunk.usage {
                assert!(chunk.choices.is_empty(), "the usage chunk has no choices");
                stream_usage = Some(u);
            }
        }
        assert_eq!(text, full.choices[0].text);
        assert_eq!(finish, full.choices[0].finish_reason);
        assert_eq!(stream_usage, Some(usage));
    }
    server.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_share_one_id_and_end_with_done() {
    let server = start(Options::default()).await;
    let (prompt, want) = cases("llama")[0].clone();
    let mut body = greedy_body(&prompt, want.len());
    body["stream"] = json!(true);
    let (status, data) = server.post_stream("/v1/completions", &body).await;
    assert_eq!(status, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("json")).collect();
    let id = chunks[0]["id"].clone();
    let mut token_ids = Vec::new();
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "text_completion");
        assert!(c.get("usage").is_none(), "usage only when asked for: {c}");
        token_ids.extend(ids(&c["choices"][0]["token_ids"]));
    }
    assert_eq!(token_ids, want, "streamed token_ids");
    assert_eq!(ids(&chunks[0]["choices"][0]["prompt_token_ids"]), prompt);
    assert_eq!(chunks.last().map(|c| c["choices"][0]["finish_reason"].clone()), Some(json!("length")));
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-4
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_match_the_reference_top5() {
    let server = start(Options::default()).await;
    let reference = reference("llama");
    for case in reference["cases"].as_array().expect("cases") {
        let (prompt, greedy) = (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]));
        let mut body = greedy_body(&prompt, greedy.len());
        body["logprobs"] = json!(5);
        let (status, resp) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        let lp = &resp["choices"][0]["logprobs"];
        let tokens = lp["tokens"].as_array().expect("tokens");
        assert_eq!(tokens.len(), greedy.len());
        let mut offset = 0;
        for (j, step) in case["steps"].as_array().expect("steps").iter().enumerate() {
            let top5 = step["top5"].as_array().expect("top5");
            let text = server.tokenizer.decode(&[greedy[j]], false).expect("decode");
            assert_eq!(tokens[j], text);
            assert_eq!(lp["text_offset"][j], offset);
            offset += text.chars().count();
            // Greedy picks the top entry.
            let chosen = lp["token_logprobs"][j].as_f64().expect("logprob");
            assert!(close(chosen, top5[0][1].as_f64().expect("f")), "step {j}: {chosen} vs {}", top5[0][1]);
            let top = lp["top_logprobs"][j].as_object().expect("top map");
            assert!(top.len() <= 6);
            let texts: Vec<String> = top5
                .iter()
                .map(|e| server.tokenizer.decode(&[e[0].as_u64().expect("id") as u32], false).expect("decode"))
                .collect();
            for (e, t) in top5.iter().zip(&texts) {
                // Tokens that decode to the same text share one key; check the unambiguous ones.
                if texts.iter().filter(|u| *u == t).count() == 1 {
                    let got = top.get(t).and_then(Value::as_f64).unwrap_or(f64::NAN);
                    assert!(close(got, e[1].as_f64().expect("f")), "step {j} token {t:?}: {got} vs {}", e[1]);
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_logprobs_gives_the_prompt_logprobs() {
    let server = start(Options::default()).await;
    let reference = reference("llama");
    let case = &reference["cases"][1];
    let prompt = ids(&case["prompt_ids"]);
    let mut body = greedy_body(&prompt, 3);
    body["echo"] = json!(true);
    body["logprobs"] = json!(2);
    let (status, resp) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let choice = &resp["choices"][0];
    let prompt_text = server.tokenizer.decode(&prompt, true).expect("decode");
    let text = choice["text"].as_str().expect("text");
    assert!(text.starts_with(&prompt_text) && text.len() > prompt_text.len(), "{text:?} vs {prompt_text:?}");
    let lp = &choice["logprobs"];
    let token_logprobs = lp["token_logprobs"].as_array().expect("list");
    assert_eq!(token_logprobs.len(), prompt.len() + 3);
    assert!(token_logprobs[0].is_null() && lp["top_logprobs"][0].is_null(), "nothing predicts the first token");
    for (i, want) in case["prompt_logprobs"].as_array().expect("prompt logprobs").iter().enumerate().skip(1) {
        let got = token_logprobs[i].as_f64().expect("logprob");
        assert!(close(got, want.as_f64().expect("f")), "prompt position {i}: {got} vs {want}");
    }

    // The stream says the same, the echo first.
    body["stream"] = json!(true);
    let (_, data) = server.post_stream("/v1/completions", &body).await;
    let chunks: Vec<Value> =
        data.iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("json")).collect();
    assert_eq!(chunks[0]["choices"][0]["text"], prompt_text);
    let streamed: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap_or_default()).collect();
    assert_eq!(streamed, text);
    let streamed_lps: Vec<Value> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(&streamed_lps, token_logprobs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_prompts_and_n_samples_give_indexed_choices() {
    let server = start(Options::default()).await;
    let all = cases("llama");
    let (a, b) = (all[0].clone(), all[2].clone());
    let body = json!({
        "prompt": [a.0, b.0],
        "n": 2,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
    });
    let (status, resp) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let choices = resp["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let (prompt, want) = if i < 2 { &a } else { &b };
        assert_eq!(&ids(&c["prompt_token_ids"]), prompt, "choice {i}");
        assert_eq!(&ids(&c["token_ids"]), want, "greedy samples all equal the reference (choice {i})");
    }
    assert_eq!(resp["usage"]["prompt_tokens"], a.0.len() + b.0.len());
    assert_eq!(resp["usage"]["completion_tokens"], 4 * 12);

    // Seeded sampling: n = 2 samples differ from each other but repeat with the same seed.
    let sampled = json!({"prompt": a.0, "n": 2, "max_tokens": 16, "temperature": 1.0, "seed": 11, "ignore_eos": true, "return_token_ids": true});
    let (_, first) = server.post("/v1/completions", &sampled).await;
    let (_, again) = server.post("/v1/completions", &sampled).await;
    let toks = |r: &Value, i: usize| ids(&r["choices"][i]["token_ids"]);
    assert_eq!(toks(&first, 0), toks(&again, 0));
    assert_eq!(toks(&first, 1), toks(&again, 1));
    assert_ne!(toks(&first, 0), toks(&first, 1), "two samples of 16 tokens at temperature 1");
    server.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_text() {
    let server = start(Options::default()).await;
    let client = server.openai();
    let (prompt, want) = cases("llama")[0].clone();
    let request = |stop: Option<StopConfiguration>| {
        let mut args = CreateCompletionRequestArgs::default();
        args.model(MODEL_NAME).prompt(prompt.clone()).max_tokens(want.len() as u32).temperature(0.0);
        if let Some(stop) = stop {
            args.stop(stop);
        }
        args.build().expect("request")
    };
    let full = client.completions().create(request(None)).await.expect("full");
    let text = full.choices[0].text.clone();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "{text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let expected = text[..text.find(&stop).expect("the stop string occurs")].to_string();
    for stop in
        [StopConfiguration::String(stop.clone()), StopConfiguration::StringArray(vec!["\u{1}".into(), stop.clone()])]
    {
        let cut = client.completions().create(request(Some(stop))).await.expect("cut");
        assert_eq!(cut.choices[0].text, expected);
        assert_eq!(cut.choices[0].finish_reason, Some(async_openai::types::chat::CompletionFinishReason::Stop));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_defaults_apply_only_where_the_client_is_silent() {
    // A copy of the llama fixture whose generation_config.json asks for greedy decoding and 5 tokens.
    let dir = tempfile::tempdir().expect("tempdir");
    let src = common::fixture("llama");
    for entry in std::fs::read_dir(&src).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.path().join(path.file_name().expect("name"))).expect("copy");
    }
    let config = json!({"eos_token_id": 1, "bos_token_id": 0, "temperature": 0.0, "max_new_tokens": 5});
    std::fs::write(dir.path().join("generation_config.json"), config.to_string()).expect("write");
    let server = start(Options { model_dir: Some(dir.path().to_path_buf()), ..Options::default() }).await;
    let (prompt, want) = cases("llama")[2].clone();

    let silent = json!({"prompt": prompt, "ignore_eos": true, "return_token_ids": true});
    let (status, resp) = server.post("/v1/completions", &silent).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(ids(&resp["choices"][0]["token_ids"]), want[..5], "greedy and 5 tokens from generation_config");

    let explicit = json!({"prompt": prompt, "ignore_eos": true, "return_token_ids": true, "max_tokens": 9,
                          "temperature": 1.0, "seed": 3});
    let (_, resp) = server.post("/v1/completions", &explicit).await;
    let got = ids(&resp["choices"][0]["token_ids"]);
    assert_eq!(got.len(), 9, "the client's max_tokens wins");
    let (_, resp2) = server.post("/v1/completions", &json!({"prompt": prompt, "ignore_eos": true, "return_token_ids": true, "max_tokens": 9, "temperature": 1.0, "seed": 4})).await;
    assert_ne!(got, ids(&resp2["choices"][0]["token_ids"]), "the client's temperature wins: seeds matter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_length_fits_a_long_prompt() {
    let server = start(Options { max_model_len: 40, ..Options::default() }).await;
    let (prompt, _) = cases("llama")[2].clone();
    assert_eq!(prompt.len(), 33);
    // No max_tokens: the route's default of 16 would overflow 40; it shrinks to the 7 left.
    let (status, resp) = server.post("/v1/completions", &json!({"prompt": prompt, "ignore_eos": true})).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["usage"]["completion_tokens"], 7);
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    // Asked for explicitly, the same length is refused with the numbers.
    let (status, resp) = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 16})).await;
    assert_eq!(status, 400);
    let message = error_of(&resp)["message"].as_str().unwrap_or_default().to_string();
    for n in ["40", "33", "16", "49"] {
        assert!(message.contains(n), "{message:?} lacks {n}");
    }
}
