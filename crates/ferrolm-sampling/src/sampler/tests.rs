//! `plan` + `apply` + `record` against a frozen copy of the single-pass `sample` it replaced:
//! same tokens and bit-identical logprobs on random rows and parameters, and exactly one uniform
//! taken from the stream per non-greedy step (none per greedy step).

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::RequestSampler;
use crate::filters;
use crate::logprobs::{token_logprobs, TokenLogprobs};
use crate::params::SamplingParams;
use crate::plan::{SamplePlan, TokenAdjust};

/// The sampler as it was before plans, kept verbatim (penalties included) as the reference.
struct Reference {
    greedy: bool,
    params: SamplingParams,
    prompt_tokens: HashSet<u32>,
    output_counts: HashMap<u32, u32>,
    num_output_tokens: u32,
    rng: ChaCha8Rng,
}

impl Reference {
    fn new(params: &SamplingParams, prompt: &[u32], seed_fallback: u64, seq_index: u64) -> Reference {
        let mut rng = ChaCha8Rng::seed_from_u64(params.seed.unwrap_or(seed_fallback));
        rng.set_stream(seq_index);
        let prompt_tokens =
            if params.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Reference {
            greedy: params.is_greedy(),
            params: params.clone(),
            prompt_tokens,
            output_counts: HashMap::new(),
            num_output_tokens: 0,
            rng,
        }
    }

    fn penalize(&self, scores: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            let penalize = |l: f32| if l > 0.0 { l / r } else { l * r };
            for &t in &self.prompt_tokens {
                if let Some(l) = scores.get_mut(t as usize) {
                    *l = penalize(*l);
                }
            }
            for &t in self.output_counts.keys() {
                if self.prompt_tokens.contains(&t) {
                    continue;
                }
                if let Some(l) = scores.get_mut(t as usize) {
                    *l = penalize(*l);
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &count) in &self.output_counts {
                if let Some(l) = scores.get_mut(t as usize) {
                    *l -= p.frequency_penalty * count as f32;
                    *l -= p.presence_penalty;
                }
            }
        }
    }

    fn sample(&mut self, logits: &[f32], eos_token_ids: &[u32]) -> Option<TokenLogprobs> {
        let mut scores = logits.to_vec();
        self.penalize(&mut scores);
        if self.num_output_tokens < self.params.min_tokens {
            let eos = if self.params.ignore_eos { &[][..] } else { eos_token_ids };
            for &t in eos.iter().chain(&self.params.stop_token_ids) {
                if let Some(s) = scores.get_mut(t as usize) {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        for s in &mut scores {
            if s.is_nan() {
                *s = f32::NEG_INFINITY;
            } else if *s == f32::INFINITY {
                *s = f32::MAX;
            }
        }
        let token = if self.greedy { filters::argmax(&scores) } else { self.sample_random(&scores) }?;
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.num_output_tokens += 1;
        Some(token_logprobs(logits, token, self.params.logprobs.unwrap_or(0) as usize))
    }

    fn sample_random(&mut self, scores: &[f32]) -> Option<u32> {
        let mut cands = Vec::new();
        filters::collect_candidates(scores, &mut cands);
        if cands.is_empty() {
            return None;
        }
        let mut reordered = filters::top_k(&mut cands, usize::try_from(self.params.top_k).unwrap_or(0));
        filters::apply_temperature(&mut cands, self.params.temperature);
        reordered |= filters::top_p(&mut cands, self.params.top_p);
        filters::min_p(&mut cands, self.params.min_p);
        if reordered {
            cands.sort_unstable_by_key(|c| c.0);
        }
        let u: f64 = self.rng.random();
        filters::draw(&cands, u)
    }
}

/// Bit-for-bit equality, NaN included.
fn same(a: &Option<TokenLogprobs>, b: &Option<TokenLogprobs>) -> bool {
    let bits = |t: &TokenLogprobs| {
        (t.token, t.logprob.to_bits(), t.top_logprobs.iter().map(|&(i, l)| (i, l.to_bits())).collect::<Vec<_>>())
    };
    a.as_ref().map(bits) == b.as_ref().map(bits)
}

/// Random parameters over every knob, each often at its off value.
fn random_params(rng: &mut ChaCha8Rng, vocab: usize) -> SamplingParams {
    let pick = |rng: &mut ChaCha8Rng, values: &[f32]| values[rng.random_range(0..values.len())];
    let mut p = SamplingParams {
        temperature: pick(rng, &[0.0, 0.3, 1.0, 1.7]),
        top_k: [0, -1, 1, 3, 50, vocab as i32, vocab as i32 + 7][rng.random_range(0..7)],
        top_p: pick(rng, &[1.0, 0.95, 0.5, 1e-6]),
        min_p: pick(rng, &[0.0, 0.05, 0.4]),
        repetition_penalty: pick(rng, &[1.0, 1.3, 0.7]),
        presence_penalty: pick(rng, &[0.0, 0.4, -0.5]),
        frequency_penalty: pick(rng, &[0.0, 0.25, -0.3]),
        seed: rng.random_bool(0.5).then(|| rng.random()),
        min_tokens: [0, 0, 3][rng.random_range(0..3)],
        ignore_eos: rng.random_bool(0.3),
        stop_token_ids: (0..rng.random_range(0..3)).map(|_| rng.random_range(0..vocab as u32 + 3)).collect(),
        logprobs: [None, Some(0), Some(3), Some(20)][rng.random_range(0..4)],
        ..SamplingParams::default()
    };
    p.max_tokens = None;
    p
}

/// A row with repeated values (ties), and now and then NaN, +inf, -inf and masked stretches.
fn random_row(rng: &mut ChaCha8Rng, vocab: usize) -> Vec<f32> {
    let quantized = rng.random_bool(0.3);
    let mut row: Vec<f32> = (0..vocab)
        .map(|_| {
            let v: f32 = rng.random_range(-8.0..8.0);
            if quantized {
                v.round()
            } else {
                v
            }
        })
        .collect();
    for _ in 0..rng.random_range(0..4) {
        let i = rng.random_range(0..vocab);
        row[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30][rng.random_range(0..4)];
    }
    if rng.random_bool(0.05) {
        row.fill(f32::NEG_INFINITY);
    }
    row
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn plan_apply_record_equals_the_single_pass_sampler(seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let vocab = [1, 2, 7, 64, 1000][rng.random_range(0..5)];
        let params = random_params(&mut rng, vocab);
        let prompt: Vec<u32> = (0..rng.random_range(0..20)).map(|_| rng.random_range(0..vocab as u32 + 2)).collect();
        let eos: Vec<u32> = (0..rng.random_range(0..3)).map(|_| rng.random_range(0..vocab as u32)).collect();
        let seq_index = rng.random_range(0..3);
        let mut ours = RequestSampler::for_sequence(&params, &prompt, seed, seq_index).expect("valid params");
        let mut reference = Reference::new(&params, &prompt, seed, seq_index);
        let mut draws = 0u128;
        for step in 0..12 {
            let row = random_row(&mut rng, vocab);
            let want = reference.sample(&row, &eos);
            let plan = ours.plan(&eos);
            draws += u128::from(!plan.greedy);
            let got = plan.apply(&row);
            prop_assert!(same(&got, &want), "step {step}: {got:?} vs {want:?} ({params:?})");
            let Some(out) = got else { break };
            ours.record(out.token);
            // One uniform (one u64, two 32-bit words) per non-greedy plan, none per greedy one.
            let mut fresh = ChaCha8Rng::seed_from_u64(params.seed.unwrap_or(seed));
            fresh.set_stream(seq_index);
            prop_assert_eq!(ours.rng.get_word_pos(), fresh.get_word_pos() + 2 * draws);
            prop_assert_eq!(ours.num_output_tokens(), reference.num_output_tokens);
        }
    }
}

#[test]
fn each_token_has_at_most_one_adjustment() {
    let params = SamplingParams {
        repetition_penalty: 1.2,
        frequency_penalty: 0.5,
        min_tokens: 4,
        stop_token_ids: vec![2, 5, 2, 9],
        ..SamplingParams::default()
    };
    let mut s = RequestSampler::new(&params, &[1, 2, 2, 3], 0).expect("valid");
    s.record(5);
    s.record(1);
    let plan = s.plan(&[9, 7, 7]);
    let mut tokens: Vec<u32> = plan.adjusts.iter().map(|a| a.token).collect();
    tokens.sort_unstable();
    assert_eq!(tokens, vec![1, 2, 3, 5, 7, 9]);
    let by_token = |t: u32| plan.adjusts.iter().find(|a| a.token == t).copied().expect("entry");
    assert!(by_token(2).repetition && by_token(2).mask && by_token(2).output_count == 0);
    assert!(by_token(5).repetition && by_token(5).mask && by_token(5).output_count == 1);
    assert!(!by_token(7).repetition && by_token(7).mask);
    // Past min_tokens nothing is masked any more.
    s.record(1);
    s.record(1);
    assert!(s.plan(&[9]).adjusts.iter().all(|a| !a.mask));
}

/// A plan made ahead of the token in flight is the plan made once it is recorded: the same mask
/// around `min_tokens` and the same uniform, drawn in stream order.
#[test]
fn a_plan_made_ahead_equals_the_plan_made_after_the_token() {
    let params = SamplingParams { temperature: 0.7, min_tokens: 3, seed: Some(11), ..SamplingParams::default() };
    let mut ahead = RequestSampler::new(&params, &[1, 2], 0).expect("valid");
    let mut after = ahead.clone();
    for step in 0..6u32 {
        // `ahead` plans step `step + 1` before recording step `step`'s token; `after` plans in order.
        let first = ahead.plan(&[9]);
        assert_eq!(first, after.plan(&[9]), "step {step}");
        let next = ahead.plan_ahead(&[9]);
        ahead.record(step);
        after.record(step);
        assert_eq!(next, after.plan(&[9]), "step {} planned ahead", step + 1);
        ahead.record(step + 100);
        after.record(step + 100);
    }
    let penalized = SamplingParams { presence_penalty: 0.5, ..params };
    assert!(!RequestSampler::new(&penalized, &[1], 0).expect("valid").plans_ahead());
}

/// A mask is applied before everything else: a disallowed token never wins, however high its
/// logit or its penalties, while logprobs stay those of the raw row; nothing allowed is `None`.
#[test]
fn a_token_mask_comes_first_and_logprobs_stay_raw() {
    let logits = [9.0, 1.0, 2.0, 3.0, 0.5];
    let mut mask = vec![0u32; 1];
    crate::mask::allow(&mut mask, 1);
    crate::mask::allow(&mut mask, 4);
    let plan = SamplePlan { masked: true, ..SamplePlan::greedy(2) };
    let out = plan.apply_masked(&logits, Some(&mask)).expect("a token");
    assert_eq!(out.token, 1);
    assert_eq!(out, crate::token_logprobs(&logits, 1, 2), "raw logprobs");
    let penalized = SamplePlan {
        masked: true,
        repetition_penalty: 100.0,
        adjusts: vec![TokenAdjust { token: 1, repetition: true, ..TokenAdjust::default() }],
        ..SamplePlan::greedy(0)
    };
    assert_eq!(penalized.apply_masked(&logits, Some(&mask)).map(|o| o.token), Some(4));
    assert_eq!(plan.apply_masked(&logits, Some(&[0])), None, "nothing allowed");
    assert_eq!(plan.apply_masked(&logits, Some(&[])), None, "a short mask allows no id past it");
}

/// Under a grammar `min_tokens` masks nothing: the grammar decides where the output may end.
#[test]
fn a_constrained_sampler_leaves_min_tokens_to_the_grammar() {
    let params = SamplingParams { min_tokens: 5, stop_token_ids: vec![3], ..SamplingParams::default() };
    let mut free = RequestSampler::new(&params, &[], 1).expect("sampler");
    let mut constrained = free.clone();
    constrained.constrain();
    assert!(free.plan(&[2]).adjusts.iter().any(|a| a.mask), "EOS and stop ids masked");
    let plan = constrained.plan(&[2]);
    assert!(plan.masked && plan.adjusts.iter().all(|a| !a.mask), "{plan:?}");
}
