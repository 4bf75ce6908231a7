//! The HTTP side of `bench serve`: one streaming `/v1/completions` request timed chunk by chunk,
//! as vLLM's `benchmark_serving.py` times it.
//!
//! Every server-sent event that carries a non-empty `choices` list counts as one output chunk
//! (its text may be empty while a detokenizer holds back half a character); the final `usage`
//! event, asked for with `stream_options.include_usage`, gives the exact output token count.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use reqwest::header::CONTENT_TYPE;
use serde_json::{json, Value};

use super::metrics::RequestTiming;
use super::workload::BenchRequest;

/// An OpenAI-compatible server.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    completions_url: String,
    api_key: Option<String>,
}

impl Client {
    /// `base_url` like `http://127.0.0.1:8000`; `endpoint` like `/v1/completions`.
    pub fn new(base_url: &str, endpoint: &str, api_key: Option<String>, timeout: Duration) -> Result<Client> {
        let base_url = base_url.trim_end_matches('/').to_owned();
        if base_url.starts_with("https://") {
            bail!("--url {base_url}: https is not supported; benchmark a server over plain http");
        }
        if !base_url.starts_with("http://") {
            bail!("--url {base_url}: expected http://HOST:PORT");
        }
        let http = reqwest::Client::builder().timeout(timeout).build().context("cannot build the HTTP client")?;
        let completions_url = format!("{base_url}/{}", endpoint.trim_start_matches('/'));
        Ok(Client { http, base_url, completions_url, api_key })
    }

    fn with_auth(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }

    /// The id of the first model that `GET /v1/models` lists.
    pub async fn first_model(&self) -> Result<String> {
        let url = format!("{}/v1/models", self.base_url);
        let resp = self.with_auth(self.http.get(&url)).send().await.with_context(|| format!("GET {url}"))?;
        let status = resp.status();
        let text = resp.text().await.with_context(|| format!("GET {url}: reading the body"))?;
        if !status.is_success() {
            bail!("GET {url}: HTTP {status}: {text}");
        }
        let body: Value = serde_json::from_str(&text).with_context(|| format!("GET {url}: not JSON: {text}"))?;
        body["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("GET {url}: no model listed; pass --model NAME"))
    }

    /// Sends one streaming completion with the prompt as token ids and times its chunks. Never
    /// fails: a failed request is a timing with `success == false` and its error.
    pub async fn complete(&self, model: &str, req: &BenchRequest) -> RequestTiming {
        let body = json!({
            "model": model,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let mut timing = RequestTiming { prompt_len: req.prompt_token_ids.len(), ..RequestTiming::default() };
        let sent = Instant::now();
        if let Err(err) = self.stream_into(body, sent, &mut timing).await {
            timing.success = false;
            timing.error = Some(format!("{err:#}"));
        }
        timing
    }

    async fn stream_into(&self, body: Value, sent: Instant, timing: &mut RequestTiming) -> Result<()> {
        let request = self.http.post(&self.completions_url).header(CONTENT_TYPE, "application/json");
        let mut resp = self.with_auth(request).body(body.to_string()).send().await.context("sending the request")?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            bail!("HTTP {status}: {}", text.chars().take(500).collect::<String>());
        }
        let mut parser = SseParser::default();
        let mut last: Option<Instant> = None;
        let mut chunks = 0usize;
        let mut usage_tokens = None;
        while let Some(bytes) = resp.chunk().await.context("reading the stream")? {
            let now = Instant::now();
            for data in parser.push(&bytes) {
                if data == "[DONE]" {
                    continue;
                }
                let event: Value = serde_json::from_str(&data).with_context(|| format!("bad event: {data}"))?;
                if let Some(err) = event.get("error").filter(|e| !e.is_null()) {
                    bail!("server error: {}", err.get("message").and_then(Value::as_str).unwrap_or(&err.to_string()));
                }
                if event["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                    match last {
                        None => timing.ttft = (now - sent).as_secs_f64(),
                        Some(prev) => timing.itl.push((now - prev).as_secs_f64()),
                    }
                    last = Some(now);
                    chunks += 1;
                }
                if let Some(n) = event["usage"]["completion_tokens"].as_u64() {
                    usage_tokens = Some(n as usize);
                }
            }
        }
        let Some(last) = last else { bail!("the stream ended without any output") };
        timing.latency = (last - sent).as_secs_f64();
        timing.output_len = usage_tokens.unwrap_or(chunks);
        timing.success = true;
        Ok(())
    }
}

/// Splits a server-sent-event byte stream into its `data:` payloads, across chunk boundaries.
#[derive(Default)]
pub struct SseParser {
    /// Bytes after the last complete line.
    pending: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.pending[start..].iter().position(|&b| b == b'\n') {
            let line = &self.pending[start..start + nl];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(data) = line.strip_prefix(b"data:") {
                let data = data.strip_prefix(b" ").unwrap_or(data);
                out.push(String::from_utf8_lossy(data).into_owned());
            }
            start += nl + 1;
        }
        self.pending.drain(..start);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_payloads_split_across_chunks() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b": 1}\r\n\r\n: comment\nevent: x\ndata:[DONE]\n"), vec!["{\"a\": 1}", "[DONE]"]);
        assert_eq!(p.push(b"data: x\n\ndata: y\n\n"), vec!["x", "y"]);
        assert!(p.pending.is_empty());
    }

    #[test]
    fn only_plain_http_urls() {
        let t = Duration::from_secs(1);
        assert!(Client::new("https://example.invalid", "/v1/completions", None, t).is_err());
        assert!(Client::new("localhost:8000", "/v1/completions", None, t).is_err());
        let c = Client::new("http://127.0.0.1:8000/", "v1/completions", None, t).map_err(|e| e.to_string());
        assert_eq!(c.map(|c| c.completions_url), Ok("http://127.0.0.1:8000/v1/completions".to_owned()));
    }
}
