//! Gemma 3's 262,144-token vocabulary end to end on the CPU: a Gemma 3-shaped model of random
//! weights with that vocabulary (and a final soft-cap, as Gemma 2 has) embeds prompt ids past
//! 2^16 and 2^17, computes a logit for every id, keeps each under the cap, and the runner's
//! greedy token and top logprobs are the argmax and the top of those logits, ids past 2^16
//! included.

use ferrolm_backend::cpu::Cpu;
use ferrolm_backend::DType;
use ferrolm_model::{CpuRunner, Model, ModelConfig, ModelInput, ModelRunner, WeightSource};
use ferrolm_sampling::{RequestSampler, RowRequest, SamplingParams};
use serde_json::json;

type BoxError = Box<dyn std::error::Error>;

const VOCAB: usize = 262_144;
const CAP: f32 = 5.0;
const BLOCK_SIZE: usize = 4;

fn model() -> Result<Model, BoxError> {
    let config = ModelConfig::from_value(json!({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 4, "final_logit_softcapping": CAP,
    }))?;
    Ok(Model::load(&Cpu::default(), config, &WeightSource::random(DType::BF16, 3))?)
}

/// Ids at both ends of the vocabulary and past 2^16 and 2^17.
const PROMPT: [u32; 6] = [262_143, 70_000, 3, 131_072, 200_001, 65_536];

#[test]
fn every_id_of_a_262144_token_vocabulary_gets_a_capped_logit() -> Result<(), BoxError> {
    let model = model()?;
    let table: Vec<u32> = (0..4).rev().collect();
    let mut kv = model.new_kv_cache(4, BLOCK_SIZE);
    let mut input = ModelInput::default();
    input.push_request(&PROMPT, 0, &table, BLOCK_SIZE, true, true);
    let logits = model.forward(&input, &mut kv);
    assert_eq!(logits.len(), PROMPT.len() * VOCAB, "one row of every id per prompt token");
    assert!(logits.iter().all(|l| l.is_finite() && l.abs() < CAP), "a logit past the cap");
    // The rows differ from one another and spread over the cap's range.
    let (first, last) = (&logits[..VOCAB], &logits[(PROMPT.len() - 1) * VOCAB..]);
    assert_ne!(first, last);
    let spread =
        last.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) - last.iter().fold(f32::INFINITY, |m, &l| m.min(l));
    assert!(spread > 1.0, "logits spread over {spread} only");

    // The last row's argmax and top 5, by the logits themselves (ties by the lower id).
    let mut order: Vec<usize> = (0..VOCAB).collect();
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]).then(a.cmp(&b)));
    assert!(order[..5].iter().any(|&id| id >= 1 << 16), "this seed's top 5 {:?} stay below 2^16", &order[..5]);

    let mut runner = CpuRunner::new(model);
    runner.allocate_kv_cache(&[4], BLOCK_SIZE)?;
    let params = SamplingParams { temperature: 0.0, logprobs: Some(5), ..SamplingParams::default() };
    let plan = RequestSampler::new(&params, &[], 0)?.plan(&[]);
    let mut input = ModelInput::default();
    input.push_request(&PROMPT, 0, &table, BLOCK_SIZE, true, false);
    let result = runner.execute(&input, &[RowRequest::Sample(&plan)])?.pop().flatten().ok_or("no token")?;
    assert_eq!(result.token as usize, order[0], "greedy token");
    let top: Vec<usize> = result.top_logprobs.iter().map(|&(id, _)| id as usize).collect();
    assert_eq!(top, order[..5], "top logprobs");
    Ok(())
}
