//! Golden tests: every fixture model in `testdata/fixtures` (tiny HF checkpoints with outputs of
//! HF transformers) against its reference: teacher-forced prompt logprobs, greedy continuations
//! and top-5 logprobs, all within 1e-4.
//!
//! The batch is built the way the engine builds it: blocks handed out in a scrambled order, the
//! prompt read in chunks, decodes one token per step, so the paged paths are what is checked.

use std::path::PathBuf;

mod common;

use common::{block_table, ids, log_softmax, prompt_logprobs};
use ferrolm_backend::cpu::Cpu;
use ferrolm_model::{Model, ModelConfig, ModelInput, WeightSource};
use serde_json::Value;

const TOL: f64 = 1e-4;
const BLOCK_SIZE: usize = 4;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures"))
}

fn load(name: &str) -> (Model, Value) {
    load_dir(&fixtures().join(name))
}

fn load_dir(dir: &std::path::Path) -> (Model, Value) {
    let config = ModelConfig::from_dir(dir).expect("config");
    let src = WeightSource::open_dir(dir).expect("weights");
    let model = Model::load(&Cpu::default(), config, &src).expect("model");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("reference")).expect("json");
    (model, reference)
}

fn check_fixture(name: &str) {
    check_dir(&fixtures().join(name), name);
}

/// The golden checks of the fixture in `dir` (`name` in messages).
fn check_dir(dir: &std::path::Path, name: &str) {
    let (model, reference) = load_dir(dir);
    let vocab = model.config.vocab_size;
    for (case_idx, case) in reference["cases"].as_array().expect("cases").iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let greedy = ids(&case["greedy_ids"]);
        let total = prompt.len() + greedy.len();
        let num_blocks = total.div_ceil(BLOCK_SIZE);
        let pool = 2 * num_blocks + 3;
        let table = block_table(num_blocks, pool);

        // Teacher-forced prompt logprobs, read in chunks of 7 tokens.
        let mut kv = model.new_kv_cache(pool, BLOCK_SIZE);
        let got = prompt_logprobs(&model, &mut kv, &table, BLOCK_SIZE, &prompt, 7);
        let want: Vec<f64> =
            case["prompt_logprobs"].as_array().expect("lp")[1..].iter().map(|v| v.as_f64().expect("f")).collect();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < TOL, "{name} case {case_idx} prompt logprob {i}: got {g}, want {w}");
        }

        // Greedy decoding: whole prompt in one step, then one token per step.
        let mut kv = model.new_kv_cache(pool, BLOCK_SIZE);
        let mut input = ModelInput::default();
        input.push_request(&prompt, 0, &table, BLOCK_SIZE, true, false);
        let mut logits = model.forward(&input, &mut kv);
        for (step, (want_id, step_ref)) in greedy.iter().zip(case["steps"].as_array().expect("steps")).enumerate() {
            let lp = log_softmax(&logits[..vocab]);
            let top5 = step_ref["top5"].as_array().expect("top5");
            for entry in top5 {
                let (id, want) = (entry[0].as_u64().expect("id") as usize, entry[1].as_f64().expect("lp"));
                assert!(
                    (lp[id] - want).abs() < TOL,
                    "{name} case {case_idx} step {step} token {id}: got {}, want {want}",
                    lp[id]
                );
            }
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
            let margin = step_ref["margin"].as_f64().expect("margin");
            if margin > 10.0 * TOL {
                let top: Vec<usize> = top5.iter().map(|e| e[0].as_u64().expect("id") as usize).collect();
                assert_eq!(&order[..5], &top[..], "{name} case {case_idx} step {step}: top-5 order");
            }
            // Teacher-force the reference token so that later steps stay comparable.
            let next = *want_id;
            assert_eq!(order[0] as u32, next, "{name} case {case_idx} step {step}: greedy token (margin {margin})");
            let mut input = ModelInput::default();
            input.push_request(&[next], prompt.len() + step, &table, BLOCK_SIZE, true, false);
            logits = model.forward(&input, &mut kv);
        }
    }
}

macro_rules! fixtures {
    ($($name:ident),*) => {$(
        #[test]
        fn $name() {
            check_fixture(stringify!($name));
        }
    )*};
}

include!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures/names.rs"));

/// AutoFP8's layout, `quant_method: "fp8"` without a block size (per-tensor `weight_scale`,
/// static `input_scale`), names the tensors of compressed-tensors' `FP8` preset alike: the same
/// fixture under that config gives the same reference.
#[test]
fn autofp8_per_tensor_layout() {
    let source = fixtures().join("qwen3_qknorm_fp8_static");
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(&source).expect("fixture") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
    }
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    config["quantization_config"] = serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"});
    std::fs::write(&path, config.to_string()).expect("write");
    check_dir(dir.path(), "qwen3_qknorm_fp8_static as AutoFP8");
}

/// All four prompts of a fixture in one flattened batch give the same logits as each alone.
#[test]
fn batched_prefill_equals_single() {
    let (model, reference) = load("llama3_gqa");
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> =
        reference["cases"].as_array().expect("cases").iter().map(|c| ids(&c["prompt_ids"])).collect();
    let pool = 64;
    let mut tables = Vec::new();
    let mut next_block = 0u32;
    for p in &prompts {
        let n = p.len().div_ceil(BLOCK_SIZE) as u32;
        tables.push((next_block..next_block + n).collect::<Vec<u32>>());
        next_block += n;
    }
    let mut kv = model.new_kv_cache(pool, BLOCK_SIZE);
    let mut input = ModelInput::default();
    for (p, t) in prompts.iter().zip(&tables) {
        input.push_request(p, 0, t, BLOCK_SIZE, true, false);
    }
    let batched = model.forward(&input, &mut kv);
    for (i, (p, t)) in prompts.iter().zip(&tables).enumerate() {
        let mut kv = model.new_kv_cache(pool, BLOCK_SIZE);
        let mut input = ModelInput::default();
        input.push_request(p, 0, t, BLOCK_SIZE, true, false);
        let single = model.forward(&input, &mut kv);
        for (a, b) in single.iter().zip(&batched[i * vocab..(i + 1) * vocab]) {
            assert!((a - b).abs() < 1e-4, "prompt {i}: {a} vs {b}");
        }
    }
}
