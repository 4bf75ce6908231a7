//! `RequestSampler` end to end: exact choices for the deterministic paths, fixed-seed
//! statistics for the random ones.

use ferrolm_sampling::{log_softmax, FinishReason, RequestSampler, SamplingError, SamplingParams};

const EOS: u32 = 3;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams::default();
    f(&mut p);
    p
}

fn greedy() -> SamplingParams {
    params(|p| p.temperature = 0.0)
}

/// Samples `steps` tokens from the same logits row.
fn run(p: &SamplingParams, prompt: &[u32], seed: u64, logits: &[f32], steps: usize) -> Result<Vec<u32>, SamplingError> {
    let mut s = RequestSampler::new(p, prompt, seed)?;
    (0..steps).map(|_| s.sample(logits, &[EOS]).map(|o| o.token)).collect()
}

/// A logits row with pseudo-random values, different per `salt`.
fn row(vocab: usize, salt: u64) -> Vec<f32> {
    (0..vocab as u64)
        .map(|i| {
            let h = (i ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
            (h % 10_000) as f32 / 1000.0
        })
        .collect()
}

/// Pearson's chi-square statistic of observed counts against probabilities.
fn chi_square(counts: &[u32], probs: &[f64]) -> f64 {
    let n: f64 = counts.iter().map(|&c| f64::from(c)).sum();
    counts.iter().zip(probs).map(|(&c, &p)| (f64::from(c) - n * p).powi(2) / (n * p)).sum()
}

fn histogram(tokens: &[u32], vocab: usize) -> Vec<u32> {
    let mut h = vec![0; vocab];
    for &t in tokens {
        h[t as usize] += 1;
    }
    h
}

#[test]
fn greedy_picks_the_argmax_and_the_lowest_id_on_ties() -> Result<(), SamplingError> {
    assert_eq!(run(&greedy(), &[], 0, &[0.1, 2.0, -1.0, 1.9], 1)?, vec![1]);
    assert_eq!(run(&greedy(), &[], 0, &[0.1, 2.0, 2.0, 2.0], 3)?, vec![1, 1, 1]);
    // greedy ignores the seed
    let logits = row(1000, 5);
    assert_eq!(run(&greedy(), &[], 1, &logits, 5)?, run(&greedy(), &[], 2, &logits, 5)?);
    Ok(())
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() -> Result<(), SamplingError> {
    for salt in 0..20 {
        let logits = row(5000, salt);
        let expected = run(&greedy(), &[], 0, &logits, 1)?;
        let top_k = params(|p| p.top_k = 1);
        let top_p = params(|p| p.top_p = 1e-6);
        assert_eq!(run(&top_k, &[], salt, &logits, 1)?, expected);
        assert_eq!(run(&top_p, &[], salt, &logits, 1)?, expected);
    }
    // ties: the lowest id is the one kept
    let tied = [0.0, 5.0, 5.0, 1.0];
    assert_eq!(run(&params(|p| p.top_k = 1), &[], 9, &tied, 4)?, vec![1; 4]);
    assert_eq!(run(&params(|p| p.top_p = 1e-6), &[], 9, &tied, 4)?, vec![1; 4]);
    Ok(())
}

#[test]
fn min_p_never_samples_tokens_below_the_threshold() -> Result<(), SamplingError> {
    // probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.2 keeps tokens with p >= 0.1
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let p = params(|p| p.min_p = 0.2);
    let h = histogram(&run(&p, &[], 11, &logits, 4000)?, 4);
    assert_eq!(h[3], 0);
    assert!(h[0] > 0 && h[1] > 0 && h[2] > 0, "{h:?}");
    // renormalized: 0.5/0.95, 0.3/0.95, 0.15/0.95
    assert!(chi_square(&h[..3], &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]) < 13.8);
    Ok(())
}

#[test]
fn penalties_change_greedy_choices_as_computed_by_hand() -> Result<(), SamplingError> {
    // repetition 2 on prompt token 0: 2.0 / 2 = 1.0 < 1.5
    let rep = params(|p| {
        p.temperature = 0.0;
        p.repetition_penalty = 2.0;
    });
    assert_eq!(run(&rep, &[0], 0, &[2.0, 1.5, 0.0], 1)?, vec![1]);
    // negative logit: -1 * 2 = -2 < -1.5
    assert_eq!(run(&rep, &[0], 0, &[-1.0, -1.5, -9.0], 1)?, vec![1]);
    // then the output token is penalized too: 1.5 / 2 = 0.75 < 1.0
    assert_eq!(run(&rep, &[0], 0, &[2.0, 1.5, 0.0], 2)?, vec![1, 0]);

    // frequency 0.15: token 0 sits at 1.0 - 0.15 * count, token 1 at 0.9 - 0.15 * count
    let freq = params(|p| {
        p.temperature = 0.0;
        p.frequency_penalty = 0.15;
    });
    assert_eq!(run(&freq, &[], 0, &[1.0, 0.9, 0.0], 4)?, vec![0, 1, 0, 1]);

    // presence 0.5 applies once, whatever the count: 1.0 - 0.5 < 0.6, then 0.6 - 0.5 < 0.5
    let pres = params(|p| {
        p.temperature = 0.0;
        p.presence_penalty = 0.5;
    });
    assert_eq!(run(&pres, &[0], 0, &[1.0, 0.6, 0.2], 4)?, vec![0, 1, 0, 0]);
    Ok(())
}

#[test]
fn min_tokens_masks_eos_and_stop_token_ids() -> Result<(), SamplingError> {
    // EOS (3) is the argmax, stop token 2 the runner-up.
    let logits = [0.0, 1.0, 4.0, 5.0];
    let p = params(|p| {
        p.temperature = 0.0;
        p.min_tokens = 2;
        p.stop_token_ids = vec![2];
    });
    let mut s = RequestSampler::new(&p, &[], 0)?;
    let mut got = Vec::new();
    for _ in 0..3 {
        let t = s.sample(&logits, &[EOS])?.token;
        got.push((t, s.finish_reason(t, &[EOS])));
    }
    assert_eq!(got, vec![(1, None), (1, None), (EOS, Some(FinishReason::Stop))]);

    // with ignore_eos, EOS is neither masked nor a stop; the stop token id still is both
    let p = params(|p| {
        p.temperature = 0.0;
        p.min_tokens = 1;
        p.ignore_eos = true;
        p.stop_token_ids = vec![2];
    });
    let mut s = RequestSampler::new(&p, &[], 0)?;
    let t = s.sample(&logits, &[EOS])?.token;
    assert_eq!((t, s.finish_reason(t, &[EOS])), (EOS, None));
    assert_eq!(s.finish_reason(2, &[EOS]), Some(FinishReason::Stop));
    Ok(())
}

#[test]
fn max_tokens_finishes_with_length() -> Result<(), SamplingError> {
    let p = params(|p| p.max_tokens = Some(2));
    let mut s = RequestSampler::new(&p, &[], 0)?;
    let logits = [1.0, 1.0, 1.0];
    let t = s.sample(&logits, &[])?.token;
    assert_eq!(s.finish_reason(t, &[]), None);
    let t = s.sample(&logits, &[])?.token;
    assert_eq!(s.finish_reason(t, &[]), Some(FinishReason::Length));
    assert_eq!(s.num_output_tokens(), 2);
    Ok(())
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() -> Result<(), SamplingError> {
    let flat = vec![0.0; 1000];
    let p = params(|p| p.seed = Some(1234));
    let a = run(&p, &[], 0, &flat, 50)?;
    // the fallback seed is not used when the request has one
    assert_eq!(a, run(&p, &[], 99, &flat, 50)?);
    let b = run(&params(|p| p.seed = Some(1235)), &[], 0, &flat, 50)?;
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(same < 5, "{same} of 50 draws agree");
    // without a seed the fallback decides
    let unseeded = SamplingParams::default();
    assert_eq!(run(&unseeded, &[], 7, &flat, 50)?, run(&unseeded, &[], 7, &flat, 50)?);
    assert_ne!(run(&unseeded, &[], 7, &flat, 50)?, run(&unseeded, &[], 8, &flat, 50)?);
    Ok(())
}

#[test]
fn tokens_do_not_depend_on_other_requests_in_the_batch() -> Result<(), SamplingError> {
    let p = params(|p| {
        p.seed = Some(42);
        p.top_p = 0.9;
        p.presence_penalty = 0.3;
    });
    let rows: Vec<Vec<f32>> = (0..30).map(|i| row(2000, i)).collect();
    let mut alone = RequestSampler::new(&p, &[5, 6], 0)?;
    let solo: Vec<u32> = rows.iter().map(|r| alone.sample(r, &[EOS]).map(|o| o.token)).collect::<Result<_, _>>()?;

    // Same request, now sharing every step with others that come and go.
    let mut ours = RequestSampler::new(&p, &[5, 6], 0)?;
    let mut others: Vec<RequestSampler> = Vec::new();
    let mut batched = Vec::new();
    for (step, r) in rows.iter().enumerate() {
        if step % 3 == 0 {
            others.push(RequestSampler::new(&p, &[1], step as u64)?);
        }
        if step % 7 == 6 {
            others.remove(0);
        }
        for o in &mut others {
            o.sample(&row(2000, 1000 + step as u64), &[EOS])?;
        }
        batched.push(ours.sample(r, &[EOS])?.token);
    }
    assert_eq!(solo, batched);
    Ok(())
}

#[test]
fn sequences_of_one_request_get_their_own_streams() -> Result<(), SamplingError> {
    let p = params(|p| p.seed = Some(3));
    let flat = vec![0.0; 1000];
    let mut s0 = RequestSampler::for_sequence(&p, &[], 0, 0)?;
    let mut s1 = RequestSampler::for_sequence(&p, &[], 0, 1)?;
    let mut first = RequestSampler::new(&p, &[], 0)?;
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..20 {
        a.push(s0.sample(&flat, &[])?.token);
        b.push(s1.sample(&flat, &[])?.token);
        c.push(first.sample(&flat, &[])?.token);
    }
    assert_eq!(a, c);
    assert_ne!(a, b);
    Ok(())
}

#[test]
fn empirical_frequencies_match_the_distribution() -> Result<(), SamplingError> {
    // chi-square critical values at p = 0.001: 4 dof 18.47, 2 dof 13.82, 1 dof 10.83
    let probs = [0.5, 0.25, 0.125, 0.0625, 0.0625];
    let logits: Vec<f32> = probs.iter().map(|&p: &f64| (p as f32).ln() + 3.0).collect();
    let h = histogram(&run(&SamplingParams::default(), &[], 2024, &logits, 20_000)?, 5);
    let x2 = chi_square(&h, &probs);
    assert!(x2 < 18.47, "T=1: chi-square {x2} for {h:?}");

    // T = 2 flattens to p^(1/2), renormalized
    let sqrt: Vec<f64> = probs.iter().map(|p| p.sqrt()).collect();
    let z: f64 = sqrt.iter().sum();
    let tempered: Vec<f64> = sqrt.iter().map(|s| s / z).collect();
    let h = histogram(&run(&params(|p| p.temperature = 2.0), &[], 7, &logits, 20_000)?, 5);
    let x2 = chi_square(&h, &tempered);
    assert!(x2 < 18.47, "T=2: chi-square {x2} for {h:?}");

    // top_k 3 renormalizes the three best
    let h = histogram(&run(&params(|p| p.top_k = 3), &[], 8, &logits, 20_000)?, 5);
    assert_eq!(&h[3..], &[0, 0]);
    let x2 = chi_square(&h[..3], &[4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0]);
    assert!(x2 < 13.82, "top_k: chi-square {x2} for {h:?}");

    // top_p 0.7 keeps 0.5 + 0.25 (mass 0.75 >= 0.7)
    let h = histogram(&run(&params(|p| p.top_p = 0.7), &[], 9, &logits, 20_000)?, 5);
    assert_eq!(&h[2..], &[0, 0, 0]);
    let x2 = chi_square(&h[..2], &[2.0 / 3.0, 1.0 / 3.0]);
    assert!(x2 < 10.83, "top_p: chi-square {x2} for {h:?}");
    Ok(())
}

#[test]
fn logprobs_are_those_of_the_raw_logits() -> Result<(), SamplingError> {
    let logits = row(3000, 77);
    let raw = log_softmax(&logits);
    let p = params(|p| {
        p.temperature = 0.3;
        p.top_k = 50;
        p.repetition_penalty = 1.3;
        p.logprobs = Some(5);
    });
    let mut s = RequestSampler::new(&p, &[10, 20, 30], 5)?;
    for _ in 0..10 {
        let out = s.sample(&logits, &[EOS])?;
        assert_eq!(out.logprob, raw[out.token as usize]);
        assert_eq!(out.top_logprobs.len(), 5);
        assert!(out.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
        let best = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(out.top_logprobs[0].1, best);
        for &(id, lp) in &out.top_logprobs {
            assert_eq!(lp, raw[id as usize]);
        }
    }
    // without `logprobs` the chosen token's logprob still comes back, alone
    let out = RequestSampler::new(&greedy(), &[], 0)?.sample(&logits, &[])?;
    assert!(out.top_logprobs.is_empty());
    assert_eq!(out.logprob, raw[out.token as usize]);
    Ok(())
}

#[test]
fn large_vocab_with_all_filters_samples_a_kept_token() -> Result<(), SamplingError> {
    let logits = row(150_000, 3);
    let p = params(|p| {
        p.temperature = 0.7;
        p.top_k = 1000;
        p.top_p = 0.95;
        p.min_p = 0.05;
        p.seed = Some(1);
    });
    let mut ranked: Vec<u32> = (0..150_000).collect();
    ranked.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    let top: std::collections::HashSet<u32> = ranked[..1000].iter().copied().collect();
    for t in run(&p, &[], 0, &logits, 20)? {
        assert!(top.contains(&t));
    }
    // the nucleus of a flat 150k row is wide: top_p has to widen its window many times
    let flat = vec![0.0; 150_000];
    let t = run(&params(|p| p.top_p = 0.99), &[], 4, &flat, 3)?;
    assert_eq!(t.len(), 3);
    Ok(())
}

#[test]
fn bad_inputs_are_errors_not_panics() -> Result<(), String> {
    let bad = params(|p| p.top_p = 0.0);
    assert!(matches!(RequestSampler::new(&bad, &[], 0), Err(SamplingError::InvalidParam { param: "top_p", .. })));
    let mut s = RequestSampler::new(&SamplingParams::default(), &[], 0).map_err(|e| e.to_string())?;
    assert_eq!(s.sample(&[], &[]).err(), Some(SamplingError::EmptyLogits));
    let masked = [f32::NEG_INFINITY, f32::NAN];
    assert_eq!(s.sample(&masked, &[]).err(), Some(SamplingError::NoCandidates));
    // min_tokens masking the whole row, and ids beyond the row, are handled
    let p = params(|p| {
        p.min_tokens = 1;
        p.temperature = 0.0;
        p.stop_token_ids = vec![0, 1, 1_000_000];
    });
    let mut s = RequestSampler::new(&p, &[1_000_000], 0).map_err(|e| e.to_string())?;
    assert_eq!(s.sample(&[1.0, 2.0], &[EOS]).err(), Some(SamplingError::NoCandidates));
    // NaN and +inf logits from a broken model still give a token
    let mut s = RequestSampler::new(&SamplingParams::default(), &[], 0).map_err(|e| e.to_string())?;
    let out = s.sample(&[f32::NAN, f32::INFINITY, 0.0], &[]).map_err(|e| e.to_string())?;
    assert_eq!(out.token, 1);
    Ok(())
}

#[test]
fn plans_list_only_what_changes_the_row() -> Result<(), SamplingError> {
    let plan = |p: &SamplingParams| RequestSampler::new(p, &[1], 0).map(|mut s| s.plan(&[7]));
    let g = plan(&greedy())?;
    assert!(g.greedy && g.adjusts.is_empty() && g.u == 0.0);
    let t = plan(&params(|p| p.temperature = 0.7))?;
    assert!(!t.greedy && (0.0..1.0).contains(&t.u));
    let rep = plan(&params(|p| {
        p.temperature = 0.0;
        p.repetition_penalty = 1.1;
    }))?;
    assert_eq!(rep.adjusts.len(), 1);
    assert!(rep.adjusts[0].token == 1 && rep.adjusts[0].repetition && !rep.adjusts[0].mask);
    // Below min_tokens EOS is masked; after it, nothing is.
    let mut s = RequestSampler::new(
        &params(|p| {
            p.temperature = 0.0;
            p.min_tokens = 1;
        }),
        &[],
        0,
    )?;
    let first = s.plan(&[7]);
    assert!(first.adjusts.len() == 1 && first.adjusts[0].token == 7 && first.adjusts[0].mask);
    let logits = row(50, 3);
    let out = first.apply(&logits).ok_or(SamplingError::NoCandidates)?;
    s.record(out.token);
    assert!(s.plan(&[7]).adjusts.is_empty());
    Ok(())
}

#[test]
fn recording_a_device_choice_equals_sampling_it() -> Result<(), SamplingError> {
    let p = params(|p| {
        p.seed = Some(5);
        p.top_p = 0.8;
        p.presence_penalty = 0.5;
        p.logprobs = Some(2);
    });
    let (mut host, mut device) = (RequestSampler::new(&p, &[1, 2], 0)?, RequestSampler::new(&p, &[1, 2], 0)?);
    for salt in 0..20 {
        let logits = row(40, salt);
        let want = host.sample(&logits, &[])?;
        // What a device does: apply the plan where the row is, send the token back.
        let got = device.plan(&[]).apply(&logits).ok_or(SamplingError::NoCandidates)?;
        device.record(got.token);
        assert_eq!(got, want);
        assert_eq!(device.finish_reason(got.token, &[]), host.finish_reason(want.token, &[]));
    }
    Ok(())
}
