//! A model whose embedding is padded past its tokenizer: with the runner's output vocabulary
//! limited to the tokenizer's, the padded ids are never sampled nor among the top logprobs,
//! even where they would win the argmax, and the tokens are the unpadded model's. On the CPU
//! runner always; with the `cuda` feature and a GPU present, on the CUDA runner in f32 too.

use std::path::{Path, PathBuf};

#[path = "common/padded_vocab.rs"]
mod padded_vocab;

use ferrolm_backend::cpu::Cpu;
use ferrolm_model::{CpuRunner, Model, ModelConfig, ModelInput, ModelRunner, WeightSource};
use ferrolm_sampling::{RequestSampler, RowRequest, SamplingParams, TokenLogprobs};
use ferrolm_tokenizer::Tokenizer;
use padded_vocab::{padded_copy, PaddedModel};
use serde_json::Value;

type BoxError = Box<dyn std::error::Error>;
type TestResult = Result<(), BoxError>;
/// A runner with the name of its backend.
type Named = (String, Box<dyn ModelRunner>);

const BLOCK_SIZE: usize = 4;
/// Tokens decoded per reference prompt.
const STEPS: usize = 8;
/// Top logprobs asked for at each step.
const NUM_TOP: u32 = 5;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

fn prompts(name: &str) -> Result<Vec<Vec<u32>>, BoxError> {
    let text = std::fs::read_to_string(fixture(name).join("reference.json"))?;
    let reference: Value = serde_json::from_str(&text)?;
    let cases = reference["cases"].as_array().ok_or("reference.json has no cases")?;
    cases.iter().map(|c| Ok(serde_json::from_value(c["prompt_ids"].clone())?)).collect()
}

/// The runners of this build and machine for the model in `dir`, by name.
fn runners(dir: &Path) -> Result<Vec<Named>, BoxError> {
    let config = ModelConfig::from_dir(dir)?;
    let src = WeightSource::open_dir(dir)?;
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut all: Vec<Named> =
        vec![("cpu".into(), Box::new(CpuRunner::new(Model::load(&Cpu::default(), config.clone(), &src)?)))];
    #[cfg(feature = "cuda")]
    match ferrolm_backend::cuda::Gpu::new(0, &Default::default()) {
        Ok(gpu) => {
            let runner = ferrolm_model::cuda::CudaRunner::load(gpu, ferrolm_backend::DType::F32, config, &src)?;
            all.push(("cuda F32".into(), Box::new(runner)));
        }
        Err(err) if err.means_no_gpu() => eprintln!("skipping the CUDA runner: no GPU ({err})"),
        Err(err) => return Err(format!("the GPU is there but could not be opened: {err}").into()),
    }
    Ok(all)
}

/// Greedy decoding of `prompt` for `steps` tokens, each with its top logprobs.
fn greedy(runner: &mut dyn ModelRunner, prompt: &[u32], steps: usize) -> Result<Vec<TokenLogprobs>, String> {
    let params = SamplingParams { temperature: 0.0, logprobs: Some(NUM_TOP), ..SamplingParams::default() };
    let plan = RequestSampler::new(&params, &[], 0).map_err(|e| e.to_string())?.plan(&[]);
    let num_blocks = (prompt.len() + steps).div_ceil(BLOCK_SIZE);
    let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
    runner.allocate_kv_cache(&[num_blocks], BLOCK_SIZE).map_err(|e| e.to_string())?;
    let mut out: Vec<TokenLogprobs> = Vec::new();
    for step in 0..steps {
        let mut input = ModelInput::default();
        match out.last() {
            None => input.push_request(prompt, 0, &table, BLOCK_SIZE, true, false),
            Some(last) => input.push_request(&[last.token], prompt.len() + step - 1, &table, BLOCK_SIZE, true, false),
        }
        let mut results = runner.execute(&input, &[RowRequest::Sample(&plan)]).map_err(|e| e.to_string())?;
        out.push(results.pop().flatten().ok_or(format!("step {step}: no token"))?);
    }
    Ok(out)
}

fn check(name: &str) -> TestResult {
    let padded: PaddedModel = padded_copy(&fixture(name))?;
    let num_tokens = Tokenizer::from_dir(padded.path())?.vocab_size();
    assert_eq!(num_tokens, padded.num_tokens, "the tokenizer is the fixture's");
    assert!(padded.vocab_size > num_tokens);
    let prompts = prompts(name)?;
    let plain = runners(&fixture(name))?;
    for ((backend, mut plain), (_, mut runner)) in plain.into_iter().zip(runners(padded.path())?) {
        let what = format!("{name} on {backend}");
        assert_eq!(runner.config().output_vocab_size, padded.vocab_size, "{what}: unlimited, logits cover the padding");
        // The fixture is what it claims: unlimited, a padded id wins the first step of every prompt.
        for prompt in &prompts {
            let first = greedy(runner.as_mut(), prompt, 1)?;
            assert!(first[0].token as usize >= num_tokens, "{what}: padding does not win: {first:?}");
        }
        // Limited after steps ran: the logits (and graphs) follow the new width.
        runner.limit_output_vocab(num_tokens);
        assert_eq!(runner.config().output_vocab_size, num_tokens);
        assert_eq!(runner.config().vocab_size, padded.vocab_size, "{what}: the embedding keeps its rows");
        for (i, prompt) in prompts.iter().enumerate() {
            let got = greedy(runner.as_mut(), prompt, STEPS)?;
            let want = greedy(plain.as_mut(), prompt, STEPS)?;
            for (step, lp) in got.iter().enumerate() {
                assert!((lp.token as usize) < num_tokens, "{what} prompt {i} step {step}: sampled {}", lp.token);
                assert_eq!(lp.top_logprobs.len(), NUM_TOP as usize);
                let top: Vec<u32> = lp.top_logprobs.iter().map(|&(t, _)| t).collect();
                assert!(top.iter().all(|&t| (t as usize) < num_tokens), "{what} prompt {i} step {step}: top {top:?}");
            }
            let tokens = |v: &[TokenLogprobs]| v.iter().map(|lp| lp.token).collect::<Vec<_>>();
            assert_eq!(tokens(&got), tokens(&want), "{what} prompt {i}: tokens differ from the unpadded model's");
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                let err = (g.logprob - w.logprob).abs();
                assert!(err < 1e-4, "{what} prompt {i} step {step}: logprob {} vs {}", g.logprob, w.logprob);
            }
        }
    }
    Ok(())
}

/// Untied: the LM head has rows of its own past the tokenizer.
#[test]
fn padded_ids_are_never_sampled_untied() -> TestResult {
    check("llama3_gqa")
}

/// Tied: the LM head is the embedding, padded rows and all.
#[test]
fn padded_ids_are_never_sampled_tied() -> TestResult {
    check("qwen2_tied")
}

/// A config limited before loading (as `ferrolm serve` does) gives logits rows of the
/// tokenizer's width.
#[test]
fn a_limited_config_gives_logits_of_the_tokenizer_width() -> TestResult {
    let padded = padded_copy(&fixture("llama3_gqa"))?;
    let mut config = ModelConfig::from_dir(padded.path())?;
    config.limit_output_vocab(padded.num_tokens);
    let model = Model::load(&Cpu::default(), config, &WeightSource::open_dir(padded.path())?)?;
    let mut kv = model.new_kv_cache(4, BLOCK_SIZE);
    let mut input = ModelInput::default();
    input.push_request(&[5, 6, 7], 0, &[0], BLOCK_SIZE, true, true);
    let logits = model.forward(&input, &mut kv);
    assert_eq!(logits.len(), 3 * padded.num_tokens, "[rows, output_vocab_size]");
    assert!(logits.iter().all(|l| l.is_finite()));
    Ok(())
}
