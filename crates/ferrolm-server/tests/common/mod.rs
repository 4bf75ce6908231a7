//! Starts the real server on a free port with a fixture model, in-process, and speaks HTTP to it.

#![allow(dead_code)]

pub mod scripted;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrolm_engine::{EngineConfig, EngineHandle, EngineStatsSnapshot, Load, SchedulerConfig};
use ferrolm_model::{CpuRunner, GenerationConfig, Model, ModelConfig, ModelError, ModelInput, ModelRunner};
use ferrolm_sampling::GenerationDefaults;
use ferrolm_sampling::{RowRequest, TokenLogprobs, TokenMasks};
use ferrolm_server::limits::RequestLimits;
use ferrolm_server::reasoning::ReasoningParser;
use ferrolm_server::tool_calls::ToolCallParser;
use ferrolm_server::{ConnectionLimits, Server, ServerConfig, ServerError};
use ferrolm_tokenizer::Tokenizer;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const MODEL_NAME: &str = "tiny";

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

pub fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).expect("read reference.json");
    serde_json::from_str(&text).expect("reference.json is JSON")
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("a list of ids").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// (prompt ids, greedy ids) of each reference case.
pub fn cases(name: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let r = reference(name);
    r["cases"].as_array().expect("cases").iter().map(|c| (ids(&c["prompt_ids"]), ids(&c["greedy_ids"]))).collect()
}

pub struct Options {
    pub fixture: &'static str,
    pub model_dir: Option<PathBuf>,
    pub max_model_len: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub max_pending: Load,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub shutdown_grace_period: Duration,
    pub connections: ConnectionLimits,
    pub limits: RequestLimits,
    /// The engine thread panics in this step (1 is the first), to check how a dead engine shows.
    pub panic_at_step: Option<usize>,
    /// The model writes this script instead of its own choices.
    pub script: Option<Arc<scripted::Script>>,
    pub tool_call_parser: Option<ToolCallParser>,
    pub reasoning_parser: Option<ReasoningParser>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            fixture: "llama",
            model_dir: None,
            max_model_len: 512,
            num_blocks: 1024,
            max_num_seqs: 64,
            max_pending: Load { sequences: 64, prompt_tokens: 1 << 20 },
            api_key: None,
            max_body_bytes: 32 << 20,
            shutdown_grace_period: Duration::from_secs(30),
            connections: ConnectionLimits::default(),
            limits: RequestLimits::default(),
            panic_at_step: None,
            script: None,
            tool_call_parser: None,
            reasoning_parser: None,
        }
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub base: String,
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub http: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    pub join: Option<JoinHandle<Result<(), ServerError>>>,
}

/// Loads a model directory the way `ferrolm serve` does: model, tokenizer, EOS ids and sampling
/// defaults from generation_config.json.
pub fn load(dir: &Path, opts: &Options) -> (EngineHandle, Arc<Tokenizer>, GenerationDefaults) {
    let model = Model::from_dir(dir).expect("model");
    let tokenizer = Arc::new(Tokenizer::from_dir(dir).expect("tokenizer"));
    let generation = GenerationConfig::from_dir(dir).expect("generation config");
    let mut eos_token_ids = generation.eos_token_ids.clone();
    if eos_token_ids.is_empty() {
        eos_token_ids.extend(tokenizer.eos_token_id());
    }
    let scheduler = SchedulerConfig {
        max_num_seqs: opts.max_num_seqs,
        max_num_batched_tokens: 2048,
        block_size: 16,
        kv_cache_groups: Vec::new(),
        max_model_len: opts.max_model_len,
        long_prefill_token_threshold: None,
        max_prompt_logprob_rows: 256,
        enable_prefix_caching: true,
    }
    .with_kv_cache_groups(&model.config.kv_cache_windows(), opts.num_blocks);
    let config = EngineConfig { scheduler, max_pending: opts.max_pending, eos_token_ids, overlap_steps: true };
    let runner: Box<dyn ModelRunner> = match (opts.panic_at_step, &opts.script) {
        (Some(at), _) => Box::new(PanickingRunner { inner: CpuRunner::new(model), steps: 0, at }),
        (None, Some(script)) => Box::new(scripted::ScriptedRunner::new(CpuRunner::new(model), Arc::clone(script))),
        (None, None) => model.into(),
    };
    let engine = EngineHandle::start(runner, Arc::clone(&tokenizer), config).expect("engine");
    (engine, tokenizer, generation.defaults)
}

pub async fn start(opts: Options) -> TestServer {
    let dir = opts.model_dir.clone().unwrap_or_else(|| fixture(opts.fixture));
    let (engine, tokenizer, defaults) = load(&dir, &opts);
    let config = ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        api_key: opts.api_key.clone(),
        served_model_name: MODEL_NAME.into(),
        max_body_bytes: opts.max_body_bytes,
        shutdown_grace_period: opts.shutdown_grace_period,
        connections: opts.connections.clone(),
        limits: opts.limits,
        tool_call_parser: opts.tool_call_parser,
        reasoning_parser: opts.reasoning_parser,
        ..ServerConfig::new(MODEL_NAME)
    };
    let server = Server::bind(engine.clone(), Arc::clone(&tokenizer), defaults, config).await.expect("bind");
    let addr = server.local_addr().expect("local address");
    let (tx, rx) = oneshot::channel::<()>();
    let join = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    TestServer {
        addr,
        base: format!("http://{addr}"),
        engine,
        tokenizer,
        http: reqwest::Client::new(),
        shutdown: Some(tx),
        join: Some(join),
    }
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// An async-openai client pointed at this server.
    pub fn openai(&self) -> async_openai::Client<async_openai::config::OpenAIConfig> {
        let config =
            async_openai::config::OpenAIConfig::new().with_api_base(format!("{}/v1", self.base)).with_api_key("unused");
        async_openai::Client::with_config(config)
    }

    /// POSTs JSON; returns the status and the body parsed as JSON (`Null` when it is not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.http.post(self.url(path)).body(body.to_string()).send().await.expect("send");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// POSTs a streaming request and returns the `data:` payloads, `[DONE]` included.
    pub async fn post_stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let resp = self.http.post(self.url(path)).body(body.to_string()).send().await.expect("send");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        (status, sse_data(&text))
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self.http.get(self.url(path)).send().await.expect("send");
        (resp.status().as_u16(), resp.text().await.expect("body"))
    }

    /// Waits (polling, bounded) until the engine holds no request and no KV block.
    pub async fn wait_idle(&self) -> EngineStatsSnapshot {
        wait_idle(&self.engine).await
    }

    /// Signals shutdown and waits for `run` to return.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.join.take() {
            Some(join) => join.await.expect("server task"),
            None => Ok(()),
        }
    }

    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

pub async fn wait_idle(engine: &EngineHandle) -> EngineStatsSnapshot {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = engine.stats();
        if s.num_running == 0 && s.num_waiting == 0 && s.kv_usage == 0.0 && engine.pending() == Load::default() {
            return s;
        }
        assert!(Instant::now() < deadline, "engine did not go idle: {s:?}, pending {:?}", engine.pending());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.trim_start().to_string()).collect()
}

/// Asserts the OpenAI error shape and returns the error object.
pub fn error_of(body: &Value) -> &Value {
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "no error message in {body}");
    assert!(e["type"].is_string(), "no error type in {body}");
    assert!(e.as_object().is_some_and(|o| o.contains_key("param") && o.contains_key("code")), "{body}");
    e
}

pub fn u32s(v: &Value) -> Vec<u32> {
    ids(v)
}

/// A CPU runner whose step `at` panics, killing the engine thread.
struct PanickingRunner {
    inner: CpuRunner,
    steps: usize,
    at: usize,
}

impl ModelRunner for PanickingRunner {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn device(&self) -> String {
        "a runner that panics".into()
    }

    fn allocate_kv_cache(&mut self, num_blocks: &[usize], block_size: usize) -> Result<(), ModelError> {
        self.inner.allocate_kv_cache(num_blocks, block_size)
    }

    fn limit_output_vocab(&mut self, num_ids: usize) {
        self.inner.limit_output_vocab(num_ids);
    }

    fn launch(&mut self, input: &ModelInput, rows: &[RowRequest<'_>]) -> Result<(), ModelError> {
        self.steps += 1;
        assert!(self.steps != self.at, "step {} panics on purpose", self.at);
        self.inner.launch(input, rows)
    }

    fn set_token_masks(&mut self, masks: &TokenMasks) -> Result<(), ModelError> {
        self.inner.set_token_masks(masks)
    }

    fn collect(&mut self) -> Result<Vec<Option<TokenLogprobs>>, ModelError> {
        self.inner.collect()
    }
}
