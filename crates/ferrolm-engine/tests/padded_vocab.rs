//! An engine over a model whose embedding is padded past its tokenizer (as Qwen2.5's is): the
//! padded ids are never generated nor among the logprobs, even though they would win every
//! argmax; ordinary prompts give the unpadded model's tokens; a prompt holding a padded id is
//! refused by the handle, naming the id and the tokenizer's size; and a request's own masks
//! cannot leave the engine nothing to sample.

use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;

#[path = "../../ferrolm-model/tests/common/padded_vocab.rs"]
mod padded_vocab;

use common::collect;
use ferrolm_engine::{EngineConfig, EngineError, EngineHandle, GenerateRequest, RequestOutput, SchedulerConfig};
use ferrolm_model::Model;
use ferrolm_sampling::SamplingParams;
use ferrolm_tokenizer::Tokenizer;
use padded_vocab::padded_copy;
use serde_json::Value;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

/// An engine over the model in `dir` with its tokenizer, loaded as a test would (no limit set
/// before: the engine sets it).
fn start(dir: &Path) -> Result<EngineHandle, Box<dyn std::error::Error>> {
    let model = Model::from_dir(dir)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(dir)?);
    let scheduler = SchedulerConfig { max_num_seqs: 64, ..SchedulerConfig::new(256, 512) };
    let config = EngineConfig {
        scheduler,
        max_pending: ferrolm_engine::Load { sequences: 64, prompt_tokens: 1 << 20 },
        eos_token_ids: vec![1],
        overlap_steps: true,
    };
    Ok(EngineHandle::start(model, tokenizer, config)?)
}

fn prompts(name: &str) -> Result<Vec<Vec<u32>>, Box<dyn std::error::Error>> {
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json"))?)?;
    let cases = reference["cases"].as_array().ok_or("reference.json has no cases")?;
    cases.iter().map(|c| Ok(serde_json::from_value(c["prompt_ids"].clone())?)).collect()
}

/// Every output of one request, per sequence index, in order.
fn run(engine: &EngineHandle, prompt: &[u32], params: SamplingParams) -> Result<Vec<Vec<RequestOutput>>, EngineError> {
    let stream = engine.submit(GenerateRequest { prompt_token_ids: prompt.to_vec(), params, grammar: None })?;
    Ok(collect(stream))
}

fn with_logprobs(temperature: f32, n: u32) -> SamplingParams {
    SamplingParams {
        temperature,
        n,
        seed: Some(7),
        max_tokens: Some(12),
        ignore_eos: true,
        logprobs: Some(5),
        prompt_logprobs: Some(5),
        ..SamplingParams::default()
    }
}

#[test]
fn padded_ids_are_never_generated_and_ordinary_prompts_match_the_unpadded_model() -> TestResult {
    let padded = padded_copy(&fixture("llama3_gqa"))?;
    let num_tokens = padded.num_tokens;
    let (plain, engine) = (start(&fixture("llama3_gqa"))?, start(padded.path())?);
    for (i, prompt) in prompts("llama3_gqa")?.iter().enumerate() {
        for (temperature, n) in [(0.0, 1), (1.0, 4)] {
            let what = format!("prompt {i} at temperature {temperature}");
            let got = run(&engine, prompt, with_logprobs(temperature, n))?;
            let want = run(&plain, prompt, with_logprobs(temperature, n))?;
            assert_eq!(got.len(), n as usize, "{what}");
            for (seq, outputs) in got.iter().enumerate() {
                let ids: Vec<u32> = outputs.iter().flat_map(|o| o.token_ids.iter().copied()).collect();
                assert_eq!(ids.len(), 12, "{what} sequence {seq}");
                assert!(ids.iter().all(|&t| (t as usize) < num_tokens), "{what} sequence {seq}: {ids:?}");
                let text: String = outputs.iter().map(|o| o.text.as_str()).collect();
                assert!(!text.is_empty(), "{what} sequence {seq}: generated ids have text");
                let top =
                    outputs.iter().flat_map(|o| &o.logprobs).flat_map(|lp| lp.top_logprobs.iter().map(|&(t, _)| t));
                let prompt_top = outputs
                    .iter()
                    .filter_map(|o| o.prompt_logprobs.as_ref())
                    .flatten()
                    .flatten()
                    .flat_map(|lp| lp.top_logprobs.iter().map(|&(t, _)| t));
                let mut top: Vec<u32> = top.chain(prompt_top).collect();
                assert!(!top.is_empty(), "{what}: logprobs were asked for");
                top.retain(|&t| t as usize >= num_tokens);
                assert!(top.is_empty(), "{what} sequence {seq}: padded ids among the top logprobs: {top:?}");
            }
            let ids = |outs: &[Vec<RequestOutput>]| -> Vec<Vec<u32>> {
                outs.iter().map(|o| o.iter().flat_map(|o| o.token_ids.iter().copied()).collect()).collect()
            };
            assert_eq!(ids(&got), ids(&want), "{what}: the unpadded model's tokens");
        }
    }
    Ok(())
}

#[test]
fn a_prompt_with_an_id_the_tokenizer_does_not_know_is_refused() -> TestResult {
    let padded = padded_copy(&fixture("qwen2_tied"))?;
    let engine = start(padded.path())?;
    let padded_id = padded.num_tokens as u32 + 3;
    // Anywhere in the prompt, not only among the last ids the detokenizer reads.
    let prompt = [vec![5, padded_id], (10..20).collect()].concat();
    let err = run(&engine, &prompt, with_logprobs(0.0, 1)).err().ok_or("a padded id was accepted")?;
    assert!(
        matches!(err, EngineError::UnknownToken { token_id, num_tokens } if token_id == padded_id && num_tokens == 320),
        "{err:?}"
    );
    assert_eq!(err.to_string(), format!("token id {padded_id} is out of vocabulary: the tokenizer has 320 tokens"));
    // Past the model's rows too: the tokenizer's bound speaks first.
    let beyond = padded.vocab_size as u32;
    let err = run(&engine, &[5, beyond], with_logprobs(0.0, 1)).err().ok_or("an id past the model was accepted")?;
    assert!(matches!(err, EngineError::UnknownToken { token_id, .. } if token_id == beyond), "{err:?}");
    // The engine goes on serving.
    let ok = run(&engine, &[5, 6, 7], with_logprobs(0.0, 1))?;
    assert_eq!(ok[0].iter().map(|o| o.token_ids.len()).sum::<usize>(), 12);
    Ok(())
}
