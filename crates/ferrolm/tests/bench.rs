//! `ferrolm bench` end to end: the built binary on the fixture model and on random weights of a
//! tiny config, and `bench serve` against `ferrolm serve` and against a minimal OpenAI-compatible
//! streaming server (which can fail on purpose). Checks that every documented field is there and
//! that the figures agree with each other; never how fast anything is.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

fn ferrolm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .env_remove("FERROLM_MODEL")
        .env_remove("OPENAI_API_KEY")
        .output()
        .expect("run ferrolm")
}

/// Runs `ferrolm bench ARGS --json FILE` (ARGS split on spaces: the paths here have none),
/// checks it succeeded and returns the JSON.
fn bench_json(dir: &Path, args: &str) -> Value {
    let path = dir.join("result.json");
    let path_str = path.to_str().expect("utf-8 path");
    let mut all = vec!["bench"];
    all.extend(args.split_whitespace());
    all.extend_from_slice(&["--json", path_str]);
    let out = ferrolm(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ferrolm {all:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("Result"), "no table printed:\n{stdout}");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("read result")).expect("result is JSON")
}

/// A 2-layer GQA Llama config: random weights of it build in milliseconds.
fn tiny_config(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-config.json");
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    });
    std::fs::write(&path, config.to_string()).expect("write config");
    path
}

fn num(v: &Value, key: &str) -> f64 {
    let x = v.get(key).and_then(Value::as_f64).unwrap_or_else(|| panic!("`{key}` missing or not a number in {v:#}"));
    assert!(x.is_finite(), "{key} = {x}");
    x
}

fn assert_close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{what}: {a} != {b}");
}

/// The machine, revision and flags every result carries; the model shape for in-process runs.
fn check_header(v: &Value, in_process: bool) {
    for key in ["bench", "date", "ferrolm_version", "git_revision", "flags", "command"] {
        assert!(v.get(key).is_some(), "`{key}` missing");
    }
    for key in ["hostname", "cpu_model", "num_cpus", "memory_bytes"] {
        assert!(v["machine"].get(key).is_some(), "machine.{key} missing");
    }
    if in_process {
        assert_eq!(v["device"], "cpu");
        assert!(v["dtype"].is_string());
        for key in ["num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size", "num_parameters"] {
            assert!(num(&v["model"], key) > 0.0, "model.{key}");
        }
    }
}

/// mean > 0 and median <= p90 <= p99 for `metric` (ttft, tpot, itl, e2el).
fn check_percentiles(v: &Value, metric: &str) {
    let get = |stat: &str| num(v, &format!("{stat}_{metric}_ms"));
    assert!(get("mean") > 0.0, "mean_{metric}_ms");
    let (p50, p90, p99) = (get("median"), get("p90"), get("p99"));
    assert!(p50 <= p90 && p90 <= p99, "{metric}: median {p50}, p90 {p90}, p99 {p99}");
}

fn check_throughput(v: &Value) {
    check_header(v, true);
    let elapsed = num(v, "elapsed_time");
    assert!(elapsed > 0.0);
    let (n, input, output) = (num(v, "num_prompts"), num(v, "total_input_tokens"), num(v, "total_output_tokens"));
    assert_close(num(v, "request_throughput") * elapsed, n, "request_throughput x elapsed");
    assert_close(num(v, "output_throughput") * elapsed, output, "output_throughput x elapsed");
    assert_close(num(v, "total_token_throughput") * elapsed, input + output, "total_token_throughput x elapsed");
    assert_eq!(num(v, "failed"), 0.0);
    // The limits: the run's work at the ceilings measured after it.
    let rate = num(v, "output_throughput");
    let (in_sequence, overlapped) =
        (num(v, "limit_in_sequence_output_throughput"), num(v, "limit_overlapped_output_throughput"));
    assert!(num(v, "gemm_tflops") > 0.0 && num(v, "memory_bandwidth_gbps") > 0.0);
    assert!(in_sequence > 0.0 && in_sequence <= overlapped, "in sequence {in_sequence}, overlapped {overlapped}");
    assert_close(num(v, "fraction_of_limit_in_sequence") * in_sequence, rate, "fraction x limit in sequence");
    assert_close(num(v, "fraction_of_limit_overlapped") * overlapped, rate, "fraction x limit overlapped");
    // Overlapped, the run takes the longer of its arithmetic and its reads at the ceilings (the
    // projections at the GEMM rate, the rest at the compute dtype's: the same rate here).
    let in_dtype = num(v, "compute_dtype_gemm_flops");
    let compute = (num(v, "gemm_flops") - in_dtype) / (num(v, "gemm_tflops") * 1e12)
        + (in_dtype + num(v, "attention_flops")) / (num(v, "compute_dtype_gemm_tflops") * 1e12);
    let memory = (num(v, "kv_read_bytes") + num(v, "weight_read_bytes")) / (num(v, "memory_bandwidth_gbps") * 1e9);
    assert_close(overlapped, output / compute.max(memory), "overlapped limit");
}

/// A throughput run of 4 requests (16 in, 8 out), 2 at a time in steps of 32 tokens, on the
/// model of `config` with random weights.
fn small_throughput_args(config: &std::path::Path) -> String {
    format!(
        "throughput --model-config {} --dummy-weights --num-prompts 4 --input-len 16 --output-len 8 \
         --max-num-seqs 2 --max-num-batched-tokens 32 --bandwidth-buffer-mb 32 --bandwidth-repetitions 2",
        config.display()
    )
}

#[test]
fn throughput_limit_counts_the_work_of_the_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(dir.path());
    let args = small_throughput_args(&config);
    let v = bench_json(dir.path(), &args);
    check_throughput(&v);
    // A layer's projections: (q 64 + k 32 + v 32) x 64 + 64 x 64 + 2 x 128 x 64 + 64 x 128 =
    // 36864 elements. Each request feeds 16 + 8 - 1 = 23 tokens through 2 layers and samples 8
    // rows of the 512 x 64 LM head.
    assert_eq!(num(&v, "gemm_flops"), 4.0 * (23.0 * 2.0 * 2.0 * 36864.0 + 8.0 * 2.0 * 512.0 * 64.0));
    // 1 + ... + 23 causal pairs per request, 4 FLOP per pair and query element, 2 layers.
    assert_eq!(num(&v, "attention_flops"), 4.0 * 276.0 * 4.0 * 64.0 * 2.0);
    // Decode tokens 17..=23 read 17 + ... + 23 = 140 tokens of K and V: 2 layers x 2 x 32 f32.
    assert_eq!(num(&v, "kv_read_bytes"), 4.0 * 140.0 * 512.0);
    // Two requests a step, each a prompt step and 7 decodes: 16 steps, each reading the bf16
    // weights but the embedding table (one row gathered).
    assert_eq!(num(&v, "min_steps"), 16.0);
    let per_step = 2.0 * (2.0 * 36864.0 + 512.0 * 64.0 + 64.0);
    assert_eq!(num(&v, "weight_read_bytes"), 16.0 * per_step);
    assert_eq!(num(&v, "gemm_probe_rows"), 32.0);
}

#[test]
fn throughput_on_fixture_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = format!(
        "throughput --model {} --num-prompts 6 --input-len 20 --output-len 7 --seed 3 \
         --bandwidth-buffer-mb 32 --bandwidth-repetitions 2",
        fixture("llama").display()
    );
    let v = bench_json(dir.path(), &args);
    check_throughput(&v);
    assert_eq!(num(&v, "num_prompts"), 6.0);
    assert_eq!(num(&v, "total_input_tokens"), 6.0 * 20.0);
    // EOS is ignored: every request gives exactly --output-len tokens.
    assert_eq!(num(&v, "total_output_tokens"), 6.0 * 7.0);
    assert_eq!(v["model"]["architecture"], "LlamaForCausalLM");
    assert_eq!(v["dtype"], "bfloat16");
    assert_eq!(v["flags"]["workload"]["num_prompts"], 6);
}

#[test]
fn throughput_with_dummy_weights_and_length_ranges() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(dir.path());
    let args = format!(
        "throughput --model-config {} --dummy-weights --num-prompts 10 --input-len 16 --output-len 8 \
         --random-range-ratio 0.5 --temperature 1.0 --bandwidth-buffer-mb 32 --bandwidth-repetitions 2",
        config.display()
    );
    let v = bench_json(dir.path(), &args);
    check_throughput(&v);
    let (input, output) = (num(&v, "total_input_tokens"), num(&v, "total_output_tokens"));
    // Each prompt in [8, 24], each output in [4, 12] tokens.
    assert!((80.0..=240.0).contains(&input), "input {input}");
    assert!((40.0..=120.0).contains(&output), "output {output}");
    assert_eq!(v["model"]["num_layers"], 2);
    assert_eq!(v["model"]["num_kv_heads"], 2);
}

#[test]
fn latency_on_fixture_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = format!(
        "latency --model {} --input-len 24 --output-len 10 --num-iters 4 --num-iters-warmup 1 \
         --bandwidth-buffer-mb 32 --bandwidth-repetitions 2",
        fixture("llama").display()
    );
    let v = bench_json(dir.path(), &args);
    check_latency(&v);
    assert_eq!(v["latencies"].as_array().map(Vec::len), Some(4));
}

#[test]
fn latency_with_dummy_weights() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(dir.path());
    let args = format!(
        "latency --model-config {} --dummy-weights --dtype float32 --input-len 16 --output-len 6 --num-iters 3 \
         --bandwidth-buffer-mb 32 --bandwidth-repetitions 2 --temperature 0.6 --top-p 0.9",
        config.display()
    );
    let v = bench_json(dir.path(), &args);
    check_latency(&v);
    assert_eq!(v["dtype"], "float32");
    assert_close(num(&v["flags"], "top_p"), 0.9, "top_p flag");
    assert_close(num(&v["flags"], "temperature"), 0.6, "temperature flag");
    // 2 layers x ((q 64 + k 32 + v 32 + o 64) x 64 + 3 x 64 x 128) + embedding and LM head
    // 2 x 512 x 64, in f32.
    let weight_bytes = 4.0 * (2.0 * (192.0 * 64.0 + 3.0 * 64.0 * 128.0) + 2.0 * 512.0 * 64.0);
    assert_eq!(num(&v["model"], "weight_bytes"), weight_bytes);
}

/// An FP8 checkpoint's config stands, with random weights, for its projections quantized at load
/// in the checkpoint's own blocks.
#[test]
fn dummy_weights_of_a_block_fp8_config_are_quantized_in_its_blocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny_config(dir.path());
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("JSON");
    config["quantization_config"] = json!({"quant_method": "fp8", "weight_block_size": [32, 32]});
    std::fs::write(&path, config.to_string()).expect("write config");
    let v = dummy_latency(dir.path(), &path, 16);
    assert_eq!(v["model"]["quantization"], "fp8 at load in 32 x 32 blocks");
}

/// `bench latency` of `input_len` + 4 tokens (two iterations) over random weights of `config`,
/// its result checked as every latency result is.
fn dummy_latency(dir: &Path, config: &Path, input_len: usize) -> Value {
    let args = format!(
        "latency --model-config {} --dummy-weights --input-len {input_len} --output-len 4 --num-iters 2 \
         --bandwidth-buffer-mb 32 --bandwidth-repetitions 2",
        config.display()
    );
    let v = bench_json(dir, &args);
    check_latency(&v);
    v
}

/// `bench-configs/NAME` cut down to 2 layers of hidden 64 (4 heads of 16 over 2 KV heads), 8
/// experts of 32 with 2 a token, a 512-token vocabulary, its other keys (the family, the
/// routing flags, RoPE) kept: random weights of it build in milliseconds.
fn cut_down_moe(dir: &Path, name: &str) -> PathBuf {
    let real = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench-configs")).join(name);
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(real).expect("read")).expect("json");
    let experts_key = if config.get("num_local_experts").is_some() { "num_local_experts" } else { "num_experts" };
    let small = json!({
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts_per_tok": 2,
        // Mixtral's experts are `intermediate_size` wide, Qwen's `moe_intermediate_size`.
        "intermediate_size": 32, "moe_intermediate_size": 32, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 1024,
    });
    let object = config.as_object_mut().expect("object");
    object.extend(small.as_object().expect("object").clone());
    object.insert(experts_key.into(), json!(8));
    let path = dir.join(name);
    std::fs::write(&path, config.to_string()).expect("write config");
    path
}

/// The throughput limit of a MoE model counts each token's 2 experts of 8 in its GEMMs, and a
/// step's expected distinct experts in its weight reads; latency's batch-1 decode reads 2.
#[test]
fn moe_work_counts_the_experts_tokens_pick() {
    for name in ["qwen3-30b-a3b.json", "mixtral-8x7b.json"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = cut_down_moe(dir.path(), name);
        let args = small_throughput_args(&config);
        let v = bench_json(dir.path(), &args);
        check_throughput(&v);
        assert_eq!(v["model"]["moe"]["num_experts"], 8, "{name}");
        // A layer: attention 64 x (64 + 2 x 32) + 64 x 64 = 12288, router 8 x 64 = 512, and 8
        // experts of 3 x 64 x 32 = 6144, of which a token multiplies with 2.
        let (layer, active) = (12288.0 + 512.0 + 8.0 * 6144.0, 12288.0 + 512.0 + 2.0 * 6144.0);
        assert_eq!(num(&v, "gemm_flops"), 4.0 * (23.0 * 2.0 * 2.0 * active + 8.0 * 2.0 * 512.0 * 64.0), "{name}");
        // bf16: both layers, the embedding table and the LM head.
        assert_eq!(num(&v["model"], "weight_bytes"), 2.0 * (2.0 * layer + 2.0 * 512.0 * 64.0), "{name}");
        // 16 steps at fewest (as for the dense config) for 92 tokens: 5.75 a step, which read
        // 8 (1 - (3/4)^5.75) experts of each layer, expected.
        assert_eq!((num(&v, "min_steps"), num(&v, "mean_step_tokens")), (16.0, 5.75), "{name}");
        let experts = 8.0 * (1.0 - 0.75f64.powf(5.75));
        assert_close(num(&v, "expected_experts_per_step"), experts, "expected experts");
        // Each step reads every matrix but the embedding table (one row) and the experts it
        // does not pick.
        let per_step = 2.0 * (2.0 * (12288.0 + 512.0 + experts * 6144.0) + 512.0 * 64.0 + 64.0);
        assert_close(num(&v, "weight_read_bytes"), 16.0 * per_step, "weight read bytes");

        let v = dummy_latency(dir.path(), &config, 8);
        let per_token = 2.0 * (2.0 * active + 512.0 * 64.0 + 64.0);
        assert_eq!(num(&v, "weight_bytes_per_token"), per_token, "{name}");
        assert_eq!(num(&v["model"], "active_matrix_elements_per_token") * 2.0, per_token, "{name}");
    }
}

fn check_latency(v: &Value) {
    check_header(v, true);
    for metric in ["ttft", "tpot", "itl", "e2el"] {
        check_percentiles(v, metric);
    }
    for key in [
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p90_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
    ] {
        assert!(num(v, key) > 0.0, "{key}");
    }
    let rate = num(v, "output_throughput");
    let (bw, limit, fraction) =
        (num(v, "memory_bandwidth_gbps"), num(v, "decode_limit_tokens_per_s"), num(v, "fraction_of_limit"));
    assert!(rate > 0.0 && bw > 0.0 && limit > 0.0 && fraction > 0.0);
    assert_close(limit, bw * 1e9 / num(v, "bytes_per_decode_token"), "decode limit = bandwidth / bytes per token");
    assert_close(fraction, rate / limit, "fraction = decode rate / limit");
    // The decode rate is the inverse of the time per output token when every request has the
    // same length (to within the spread of the iterations).
    assert!(rate > 0.5 * 1000.0 / num(v, "p99_tpot_ms") && rate < 2.0 * 1000.0 / num(v, "median_tpot_ms") + 1.0);
    // The first token's limit: the prompt's arithmetic at the GEMM rate measured in the run (no
    // FP8 GEMM on the CPU), or its weights at the bandwidth, whichever takes longer, then its
    // attention.
    let (ttft_limit, ttft_fraction) = (num(v, "ttft_limit_ms"), num(v, "ttft_fraction_of_limit"));
    assert_eq!(v["gemm_fp8"], false);
    let rate = num(v, "gemm_tflops") * 1e12;
    assert_close(num(v, "compute_dtype_gemm_tflops") * 1e12, rate, "one GEMM rate without FP8");
    let gemms = (num(v, "prefill_gemm_flops") / rate).max(num(v, "prefill_weight_read_bytes") / (bw * 1e9));
    let seconds = gemms + num(v, "prefill_attention_flops") / rate;
    assert_close(ttft_limit, seconds * 1e3, "TTFT limit = prefill work at the measured ceilings");
    assert_close(ttft_fraction, ttft_limit / num(v, "median_ttft_ms"), "fraction = TTFT limit / median TTFT");
    // The probe's rows are the prompt's (one step: the default budget holds it).
    assert_eq!(num(v, "gemm_probe_rows"), num(v, "input_len"));
}

#[test]
fn sampling_flags_out_of_range_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(dir.path());
    let config = config.to_str().expect("path");
    for (name, flag) in [("top_p", "--top-p=0"), ("top_p", "--top-p=1.5"), ("temperature", "--temperature=-1")] {
        for mode in ["latency", "throughput"] {
            let out = ferrolm(&["bench", mode, "--model-config", config, "--dummy-weights", flag]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{mode} {flag} succeeded");
            assert!(stderr.contains("invalid sampling flags") && stderr.contains(name), "{mode} {flag}: {stderr}");
        }
    }
}

#[test]
fn model_config_needs_dummy_weights() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(dir.path());
    let out = ferrolm(&["bench", "throughput", "--model-config", config.to_str().expect("path")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dummy-weights"));
}

/// A minimal OpenAI-compatible server: `GET /v1/models` and streaming `POST /v1/completions`
/// that answers `max_tokens` chunks then a usage event. With `fail_odd`, every odd-numbered
/// completion (the first is number 0) gets an HTTP 500. It records each completion body, and
/// stops accepting after `max_connections`.
struct FakeServer {
    port: u16,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl FakeServer {
    fn start(fail_odd: bool, max_connections: usize) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&bodies);
        std::thread::spawn(move || {
            for conn in listener.incoming().take(max_connections) {
                let Ok(conn) = conn else { continue };
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || {
                    let _ = serve_one(conn, &seen, fail_odd);
                });
            }
        });
        FakeServer { port, bodies }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

fn serve_one(conn: TcpStream, seen: &Mutex<Vec<Value>>, fail_odd: bool) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut content_length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                content_length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0; content_length];
    reader.read_exact(&mut body)?;
    let mut conn = conn;
    if request_line.starts_with("GET /v1/models") {
        let body = json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).to_string();
        return write!(conn, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    }
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let number = {
        let mut seen = seen.lock().expect("lock");
        seen.push(request.clone());
        seen.len() - 1
    };
    if fail_odd && number % 2 == 1 {
        let body = r#"{"error": {"message": "injected failure", "type": "server_error"}}"#;
        return write!(conn, "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    }
    let max_tokens = request["max_tokens"].as_u64().unwrap_or(1);
    let prompt_len = request["prompt"].as_array().map_or(0, Vec::len);
    write!(
        conn,
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n"
    )?;
    for i in 0..max_tokens {
        std::thread::sleep(Duration::from_millis(2));
        let finish = if i + 1 == max_tokens { json!("length") } else { Value::Null };
        let chunk = json!({"object": "text_completion", "model": "fake-model",
                           "choices": [{"index": 0, "text": "t", "finish_reason": finish}]});
        write!(conn, "data: {chunk}\n\n")?;
        conn.flush()?;
    }
    let usage = json!({"choices": [], "usage": {"prompt_tokens": prompt_len, "completion_tokens": max_tokens,
                                                "total_tokens": prompt_len as u64 + max_tokens}});
    write!(conn, "data: {usage}\n\ndata: [DONE]\n\n")?;
    conn.flush()
}

fn bench_serve(server: &FakeServer, dir: &Path, extra: &str) -> Value {
    let plot = dir.join("latency.svg");
    let args = format!(
        "serve --url {} --vocab-size 320 --num-prompts 12 --input-len 9 --output-len 5 --plot {} {extra}",
        server.url(),
        plot.display()
    );
    let v = bench_json(dir, &args);
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    assert!(svg.starts_with("<svg") && svg.contains("TTFT") && svg.contains("ITL"));
    v
}

#[test]
fn serve_against_openai_compatible_server() {
    let server = FakeServer::start(false, 100);
    let dir = tempfile::tempdir().expect("tempdir");
    let v = bench_serve(&server, dir.path(), "--request-rate 200 --max-concurrency 4 --seed 5");
    check_header(&v, false);
    for key in [
        "completed",
        "failed",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
        "duration",
    ] {
        num(&v, key);
    }
    assert_eq!(num(&v, "completed"), 12.0);
    assert_eq!(num(&v, "failed"), 0.0);
    assert_eq!(num(&v, "total_input_tokens"), 12.0 * 9.0);
    assert_eq!(num(&v, "total_output_tokens"), 12.0 * 5.0);
    assert_eq!(v["served_model_name"], "fake-model");
    assert_eq!(v["max_concurrency"], 4);
    let duration = num(&v, "duration");
    assert_close(num(&v, "request_throughput") * duration, 12.0, "request_throughput x duration");
    assert_close(num(&v, "output_throughput") * duration, 60.0, "output_throughput x duration");
    for metric in ["ttft", "tpot", "itl", "e2el"] {
        check_percentiles(&v, metric);
    }

    // The test request, then the 12 of the run, each as the OpenAI API expects it.
    let bodies = server.bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 13);
    for body in &bodies {
        assert_eq!(body["model"], "fake-model");
        assert_eq!(body["stream"], true);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        let prompt = body["prompt"].as_array().expect("prompt as token ids");
        assert_eq!(prompt.len(), 9);
        assert!(prompt.iter().all(|id| id.as_u64().is_some_and(|id| id < 320)));
    }
    assert!(bodies[1..].iter().all(|b| b["max_tokens"] == 5));
}

#[test]
fn serve_counts_failed_requests() {
    let server = FakeServer::start(true, 100);
    let dir = tempfile::tempdir().expect("tempdir");
    let v = bench_serve(&server, dir.path(), "--model fake-model");
    // Completions 1, 3, ..., 11 fail (0 was the test request): 6 of the 12 in the run.
    assert_eq!(num(&v, "completed"), 6.0);
    assert_eq!(num(&v, "failed"), 6.0);
    assert_eq!(num(&v, "total_output_tokens"), 6.0 * 5.0);
    let errors: Vec<&str> = v["errors"].as_array().expect("errors").iter().filter_map(Value::as_str).collect();
    assert_eq!(errors.iter().filter(|e| e.contains("500") && e.contains("injected failure")).count(), 6);
}

#[test]
fn serve_reports_an_unreachable_server() {
    // A port that was free a moment ago: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let url = format!("http://127.0.0.1:{port}");
    let out = ferrolm(&["bench", "serve", "--url", &url, "--model", "m", "--vocab-size", "100", "--num-prompts", "2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("test request"));
}

/// Kills `ferrolm serve` when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_against_ferrolm_serve() {
    let model = fixture("llama");
    let model = model.to_str().expect("path");
    let child = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(["serve", "--model", model, "--port", "0", "--max-model-len", "128"])
        .env_remove("FERROLM_MODEL")
        .env_remove("FERROLM_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferrolm serve");
    let mut server = Server(child);
    let stdout = server.0.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // The server prints the address it listens on once it is ready.
    let line = rx.recv_timeout(Duration::from_secs(60)).expect("the address line");
    let url = format!("http://{}", line.rsplit("http://").next().expect("an address").trim());

    let dir = tempfile::tempdir().expect("tempdir");
    let args = format!(
        "serve --url {url} --tokenizer {model} --num-prompts 8 --input-len 16 --output-len 6 --max-concurrency 4"
    );
    let v = bench_json(dir.path(), &args);
    assert_eq!(num(&v, "completed"), 8.0, "errors: {}", v["errors"]);
    assert_eq!(num(&v, "failed"), 0.0);
    assert_eq!(num(&v, "total_input_tokens"), 8.0 * 16.0);
    // The server honours ignore_eos and reports usage: exactly --output-len tokens each.
    assert_eq!(num(&v, "total_output_tokens"), 8.0 * 6.0);
    for metric in ["ttft", "tpot", "itl", "e2el"] {
        check_percentiles(&v, metric);
    }
    drop(server);
}
