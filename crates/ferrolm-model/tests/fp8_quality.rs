//! FP8 on real weights: the bundled demo model quantized at load (`--quantization fp8`), with an
//! FP8 KV cache (`--kv-cache-dtype fp8`), and with both, keeps its mean log-likelihood of held-out
//! Python source within 1 % of its bf16 weights' with an f32 cache.
//!
//! The held-out text is ferrolm's own `tools/train_demo_model.py`: Python the model never saw
//! (it was trained on the standard library and installed packages). Its first windows of the
//! model's 512-token context are scored teacher-forced, each window on its own, on the CPU, where
//! FP8 weights are computed exactly (dequantized to f32) and an FP8 cache holds the e4m3 values
//! of K and V, so the difference is the quantization's alone. The figures are printed
//! (`--nocapture`) and recorded in docs/PERFORMANCE.md.

// Shared with the golden tests; not every helper is used here.
#[allow(dead_code)]
mod common;

use std::path::PathBuf;

use common::{block_table, prompt_logprobs};
use ferrolm_backend::cpu::Cpu;
use ferrolm_backend::KvCacheDtype;
use ferrolm_model::{Model, ModelConfig, WeightSource};
use ferrolm_tokenizer::Tokenizer;

const BLOCK_SIZE: usize = 16;
/// Windows of the model's context scored (the first ones of the file).
const WINDOWS: usize = 3;
/// The most the FP8 mean log-likelihood may differ from bf16's, relative.
const MAX_RELATIVE_CHANGE: f64 = 0.01;

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// Mean log p(token | the window's tokens before it) over the held-out windows.
fn mean_log_likelihood(model: &Model, windows: &[Vec<u32>]) -> f64 {
    let (mut sum, mut count) = (0.0, 0);
    for window in windows {
        let num_blocks = window.len().div_ceil(BLOCK_SIZE);
        let pool = 2 * num_blocks;
        let mut kv = model.new_kv_cache(pool, BLOCK_SIZE);
        let table = block_table(num_blocks, pool);
        let lps = prompt_logprobs(model, &mut kv, &table, BLOCK_SIZE, window, 128);
        sum += lps.iter().sum::<f64>();
        count += lps.len();
    }
    sum / count as f64
}

#[test]
fn demo_model_in_fp8_keeps_its_held_out_log_likelihood() {
    let dir = repo().join("models/ferrolm-demo-py");
    let text = std::fs::read_to_string(repo().join("tools/train_demo_model.py")).expect("held-out text");
    let tokens = Tokenizer::from_dir(&dir).expect("tokenizer").encode(&text, false).expect("encode");
    let config = ModelConfig::from_dir(&dir).expect("config");
    let context = config.max_position_embeddings;
    let windows: Vec<Vec<u32>> = tokens.chunks_exact(context).take(WINDOWS).map(<[u32]>::to_vec).collect();
    assert_eq!(windows.len(), WINDOWS, "{} tokens of held-out text", tokens.len());
    let src = WeightSource::open_dir(&dir).expect("weights");
    let score = |weights_fp8: bool, cache: KvCacheDtype| {
        let mut config = config.clone();
        if weights_fp8 {
            config.quantize_at_load().expect("a bf16 checkpoint");
        }
        config.kv_cache_dtype = cache;
        mean_log_likelihood(&Model::load(&Cpu::default(), config, &src).expect("model"), &windows)
    };

    let base = score(false, KvCacheDtype::Auto);
    println!("held-out mean log-likelihood over {} tokens: bf16 weights, f32 cache {base:.5}", WINDOWS * (context - 1));
    for (what, weights_fp8, cache) in [
        ("fp8 weights", true, KvCacheDtype::Auto),
        ("fp8 KV cache", false, KvCacheDtype::Fp8),
        ("fp8 weights and KV cache", true, KvCacheDtype::Fp8),
    ] {
        let quantized = score(weights_fp8, cache);
        let change = (quantized - base) / base.abs();
        println!("  {what}: {quantized:.5} ({:+.3} %)", 100.0 * change);
        // Something was quantized (a run that quantized nothing would pass the bound trivially).
        assert_ne!(base, quantized, "{what}");
        assert!(change.abs() <= MAX_RELATIVE_CHANGE, "{what} moved the mean log-likelihood by {:.3} %", 100.0 * change);
    }
}
