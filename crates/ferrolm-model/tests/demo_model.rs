//! Golden test of the demo model that ships in `models/ferrolm-demo-py`: ferrolm's decoder and
//! tokenizer against what HF transformers computed for the same directory (`reference.json`,
//! written by `tools/train_demo_model.py`).
//!
//! Both sides run the bf16 weights in f32, so logprobs agree within 1e-3. Greedy tokens are
//! compared wherever the best two logprobs are further apart than that, and the reference token
//! is fed back at every step, so one near-tie cannot derail the steps after it.

mod common;

use std::path::PathBuf;

use common::{block_table, ids, log_softmax, prompt_logprobs};
use ferrolm_model::{GenerationConfig, Model, ModelInput};
use ferrolm_tokenizer::Tokenizer;
use serde_json::Value;

const TOL: f64 = 1e-3;
const BLOCK_SIZE: usize = 16;

fn demo_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/ferrolm-demo-py"))
}

fn reference() -> Value {
    let text = std::fs::read_to_string(demo_dir().join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference.json is JSON")
}

fn cases(reference: &Value) -> &Vec<Value> {
    reference["cases"].as_array().expect("cases")
}

#[test]
fn demo_model_matches_reference() {
    let model = Model::from_dir(&demo_dir()).expect("load the demo model");
    let reference = reference();
    let vocab = model.config.vocab_size;
    for (case_idx, case) in cases(&reference).iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let greedy = ids(&case["greedy_ids"]);
        let num_blocks = (prompt.len() + greedy.len()).div_ceil(BLOCK_SIZE);
        let pool = 2 * num_blocks + 3;
        let table = block_table(num_blocks, pool);

        // Teacher-forced prompt logprobs, read in chunks of 5 tokens.
        let mut kv = model.new_kv_cache(pool, BLOCK_SIZE);
        let got = prompt_logprobs(&model, &mut kv, &table, BLOCK_SIZE, &prompt, 5);
        let want: Vec<f64> =
            case["prompt_logprobs"].as_array().expect("lp")[1..].iter().map(|v| v.as_f64().expect("f")).collect();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < TOL, "case {case_idx} prompt logprob {i}: got {g}, want {w}");
        }

        // Greedy decoding: the whole prompt in one step, then one token per step.
        let mut kv = model.new_kv_cache(pool, BLOCK_SIZE);
        let mut input = ModelInput::default();
        input.push_request(&prompt, 0, &table, BLOCK_SIZE, true, false);
        let mut logits = model.forward(&input, &mut kv);
        let steps = case["steps"].as_array().expect("steps");
        assert_eq!(steps.len(), greedy.len());
        for (step, (&want_id, step_ref)) in greedy.iter().zip(steps).enumerate() {
            let lp = log_softmax(&logits[..vocab]);
            for entry in step_ref["top5"].as_array().expect("top5") {
                let (id, want) = (entry[0].as_u64().expect("id") as usize, entry[1].as_f64().expect("lp"));
                assert!(
                    (lp[id] - want).abs() < TOL,
                    "case {case_idx} step {step} token {id}: got {}, want {want}",
                    lp[id]
                );
            }
            let margin = step_ref["margin"].as_f64().expect("margin");
            if margin > TOL {
                let best = (0..vocab).max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a))).expect("vocab");
                assert_eq!(best as u32, want_id, "case {case_idx} step {step}: greedy token (margin {margin})");
            }
            let mut input = ModelInput::default();
            input.push_request(&[want_id], prompt.len() + step, &table, BLOCK_SIZE, true, false);
            logits = model.forward(&input, &mut kv);
        }
    }
}

/// ferrolm encodes prompts as HF did for the reference (no BOS is added) and decodes the greedy
/// tokens to the same text.
#[test]
fn demo_tokenizer_matches_reference() {
    let tokenizer = Tokenizer::from_dir(&demo_dir()).expect("load the demo tokenizer");
    let reference = reference();
    for entry in reference["tokenize"].as_array().expect("tokenize") {
        let text = entry["text"].as_str().expect("text");
        assert_eq!(tokenizer.encode(text, false).expect("encode"), ids(&entry["ids"]), "{text:?}");
    }
    for case in cases(&reference) {
        let prompt = case["prompt"].as_str().expect("prompt");
        assert_eq!(tokenizer.encode(prompt, true).expect("encode"), ids(&case["prompt_ids"]), "{prompt:?}");
        let text = tokenizer.decode(&ids(&case["greedy_ids"]), false).expect("decode");
        assert_eq!(text, case["greedy_text"].as_str().expect("greedy_text"), "{prompt:?}");
    }
    assert_eq!((tokenizer.bos_token_id(), tokenizer.eos_token_id()), (Some(0), Some(1)));
    assert!(tokenizer.chat_template().is_some());
    let generation = GenerationConfig::from_dir(&demo_dir()).expect("generation_config.json");
    assert_eq!(generation.eos_token_ids, vec![1]);
}
