//! FP8 on real weights: the bundled demo model quantized at load (`--quantization fp8`), with an
//! FP8 KV cache (`--kv-cache-dtype fp8`), and with both, keeps its mean log-likelihood of held-out
//! Python source within 1 % of its bf16 weights' with an f32 cache.
//!
//! The held-out text is ferrolm's own `tools/train_demo_model.py`: Python the model never saw
//! (it was trained on the standard library and installed packages). Its first windows of the
//! model's 512-token context are scored teacher-forced, each window on its own, on the CPU, where
//! FP8 weights are computed exactly (dequantized to f32) and an FP8 cache holds the e4m3 values
//! of K and V, so the difference is the quantization's alone; and with the FP8 products' inputs
//! quantized per token as the GPU quantizes them in bf16 (W8A8: [`Fp8Inputs::GPU`]; the windows
//! are read in steps of 128 tokens, so every product quantizes its input). The figures are
//! printed (`--nocapture`) and recorded in docs/PERFORMANCE.md.

// Shared with the golden tests; not every helper is used here.
#[allow(dead_code)]
mod common;

use std::path::PathBuf;

use common::block_table;
use ferrolm_backend::cpu::{Cpu, Fp8Inputs};
use ferrolm_backend::KvCacheDtype;
use ferrolm_model::{CpuRunner, Model, ModelConfig, ModelInput, ModelRunner, WeightSource};
use ferrolm_sampling::RowRequest;
use ferrolm_tokenizer::Tokenizer;

const BLOCK_SIZE: usize = 16;
/// Windows of the model's context scored (the first ones of the file).
const WINDOWS: usize = 3;
/// Tokens of a window read in one step.
const CHUNK: usize = 128;
/// The most the FP8 mean log-likelihood may differ from bf16's, relative.
const MAX_RELATIVE_CHANGE: f64 = 0.01;

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The demo model's directory, its config, and the held-out windows of its context.
fn held_out() -> (PathBuf, ModelConfig, Vec<Vec<u32>>) {
    let dir = repo().join("models/ferrolm-demo-py");
    let text = std::fs::read_to_string(repo().join("tools/train_demo_model.py")).expect("held-out text");
    let tokens = Tokenizer::from_dir(&dir).expect("tokenizer").encode(&text, false).expect("encode");
    let config = ModelConfig::from_dir(&dir).expect("config");
    let context = config.max_position_embeddings;
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(context).take(WINDOWS).map(<[u32]>::to_vec).collect();
    assert_eq!(windows.len(), WINDOWS, "{} tokens of held-out text", tokens.len());
    (dir, config, windows)
}

/// `config` with FP8 weights (quantized at load) or not, and a KV cache of `cache`.
fn variant(config: &ModelConfig, weights_fp8: bool, cache: KvCacheDtype) -> ModelConfig {
    let mut config = config.clone();
    if weights_fp8 {
        config.quantize_at_load().expect("a bf16 checkpoint");
    }
    config.kv_cache_dtype = cache;
    config
}

/// Mean log p(token | the window's tokens before it) over the held-out windows, each window
/// read on its own in steps of [`CHUNK`] tokens.
fn mean_log_likelihood(runner: &mut dyn ModelRunner, windows: &[Vec<u32>]) -> f64 {
    let (mut sum, mut count) = (0.0, 0);
    for window in windows {
        let num_blocks = window.len().div_ceil(BLOCK_SIZE);
        let pool = 2 * num_blocks;
        runner.allocate_kv_cache(&[pool], BLOCK_SIZE).expect("kv cache");
        let table = block_table(num_blocks, pool);
        for start in (0..window.len()).step_by(CHUNK) {
            let end = (start + CHUNK).min(window.len());
            let mut input = ModelInput::default();
            input.push_request(&window[start..end], start, &table, BLOCK_SIZE, true, true);
            // The window's last token has no next one to score (token 0 stands in).
            let rows: Vec<RowRequest> = (start..end)
                .map(|pos| RowRequest::Logprobs { token: window.get(pos + 1).copied().unwrap_or(0), num_top: 0 })
                .collect();
            let results = runner.execute(&input, &rows).expect("execute");
            for (pos, result) in (start..end).zip(results) {
                if pos + 1 < window.len() {
                    sum += f64::from(result.expect("a logprob").logprob);
                    count += 1;
                }
            }
        }
    }
    sum / count as f64
}

/// The FP8 variants scored against `base`, each printed and within [`MAX_RELATIVE_CHANGE`].
fn check_variants(base: f64, variants: &[(&str, f64)]) {
    for &(what, quantized) in variants {
        let change = (quantized - base) / base.abs();
        println!("  {what}: {quantized:.5} ({:+.3} %)", 100.0 * change);
        // Something was quantized (a run that quantized nothing would pass the bound trivially).
        assert_ne!(base, quantized, "{what}");
        assert!(change.abs() <= MAX_RELATIVE_CHANGE, "{what} moved the mean log-likelihood by {:.3} %", 100.0 * change);
    }
}

#[test]
fn demo_model_in_fp8_keeps_its_held_out_log_likelihood() {
    let (dir, config, windows) = held_out();
    let src = WeightSource::open_dir(&dir).expect("weights");
    let score = |weights_fp8: bool, cache: KvCacheDtype, inputs: Fp8Inputs| {
        let model = Model::load(&Cpu::with_fp8_inputs(inputs), variant(&config, weights_fp8, cache), &src);
        mean_log_likelihood(&mut CpuRunner::new(model.expect("model")), &windows)
    };

    let base = score(false, KvCacheDtype::Auto, Fp8Inputs::Exact);
    let tokens = windows.iter().map(|w| w.len() - 1).sum::<usize>();
    println!("held-out mean log-likelihood over {tokens} tokens: bf16 weights, f32 cache {base:.5}");
    let (exact, w8a8) = (Fp8Inputs::Exact, Fp8Inputs::GPU);
    let (weights, weights_w8a8) = (score(true, KvCacheDtype::Auto, exact), score(true, KvCacheDtype::Auto, w8a8));
    // The inputs were quantized (a mode that quantized nothing would score as exact inputs do).
    assert_ne!(weights, weights_w8a8, "W8A8 inputs");
    check_variants(
        base,
        &[
            ("fp8 weights", weights),
            ("fp8 KV cache", score(false, KvCacheDtype::Fp8, exact)),
            ("fp8 weights and KV cache", score(true, KvCacheDtype::Fp8, exact)),
            ("fp8 weights, inputs per token (W8A8)", weights_w8a8),
            ("fp8 weights (W8A8) and KV cache", score(true, KvCacheDtype::Fp8, w8a8)),
        ],
    );
}

/// The same on the GPU in bf16, where FP8 products beyond 4 rows quantize their inputs per
/// token (W8A8): each FP8 variant within 1 % of the bf16 weights' with a bf16 cache.
#[cfg(feature = "cuda")]
#[test]
fn demo_model_in_fp8_keeps_its_held_out_log_likelihood_on_the_gpu() {
    use ferrolm_backend::cuda::Gpu;
    use ferrolm_backend::DType;
    let (dir, config, windows) = held_out();
    let src = WeightSource::open_dir(&dir).expect("weights");
    let score = |weights_fp8: bool, cache: KvCacheDtype| -> Option<f64> {
        let gpu = match Gpu::new(0, &Default::default()) {
            Ok(gpu) => gpu,
            Err(err) if err.means_no_gpu() => {
                eprintln!("skipping the CUDA runner: no GPU ({err})");
                return None;
            }
            Err(err) => panic!("the GPU is there but could not be opened: {err}"),
        };
        let config = variant(&config, weights_fp8, cache);
        let mut runner = ferrolm_model::cuda::CudaRunner::load(gpu, DType::BF16, config, &src).expect("upload");
        Some(mean_log_likelihood(&mut runner, &windows))
    };
    let Some(base) = score(false, KvCacheDtype::Auto) else { return };
    println!("held-out mean log-likelihood on the GPU in bf16: bf16 weights and cache {base:.5}");
    let scored = |weights_fp8, cache| score(weights_fp8, cache).expect("the GPU opened before");
    check_variants(
        base,
        &[
            ("fp8 weights (W8A8)", scored(true, KvCacheDtype::Auto)),
            ("fp8 KV cache", scored(false, KvCacheDtype::Fp8)),
            ("fp8 weights (W8A8) and KV cache", scored(true, KvCacheDtype::Fp8)),
        ],
    );
}
