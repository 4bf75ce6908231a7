//! The engine end to end on fixture models: continuous batching, chunked prefill, preemption,
//! prefix caching, aborts and sampling give the reference tokens and leak nothing.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::collect;
use ferrolm_engine::{
    EngineConfig, EngineError, EngineHandle, FinishReason, GenerateRequest, Load, RequestOutput, SchedulerConfig,
};
use ferrolm_model::Model;
use ferrolm_sampling::SamplingParams;
use ferrolm_tokenizer::Tokenizer;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

struct Setup {
    num_blocks: usize,
    block_size: usize,
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
    max_prompt_logprob_rows: usize,
    max_pending: Load,
    overlap_steps: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            num_blocks: 256,
            block_size: 16,
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_prompt_logprob_rows: 256,
            max_pending: Load { sequences: 1024, prompt_tokens: 1 << 20 },
            overlap_steps: true,
        }
    }
}

fn start(name: &str, setup: Setup) -> (EngineHandle, Arc<Tokenizer>) {
    let dir = fixture(name);
    start_model(Model::from_dir(&dir).expect("model"), name, setup)
}

/// [`start`] on `model`, which has fixture `name`'s tokenizer. The KV cache groups are the
/// model's, the first with `setup.num_blocks` blocks.
fn start_model(model: Model, name: &str, setup: Setup) -> (EngineHandle, Arc<Tokenizer>) {
    let tokenizer = Arc::new(Tokenizer::from_dir(&fixture(name)).expect("tokenizer"));
    let scheduler = SchedulerConfig {
        max_num_seqs: setup.max_num_seqs,
        max_num_batched_tokens: setup.max_num_batched_tokens,
        block_size: setup.block_size,
        kv_cache_groups: Vec::new(),
        max_model_len: 512,
        long_prefill_token_threshold: None,
        max_prompt_logprob_rows: setup.max_prompt_logprob_rows,
        enable_prefix_caching: true,
    }
    .with_kv_cache_groups(&model.config.kv_cache_windows(), setup.num_blocks);
    let config = EngineConfig {
        scheduler,
        max_pending: setup.max_pending,
        eos_token_ids: vec![1],
        overlap_steps: setup.overlap_steps,
    };
    (EngineHandle::start(model, Arc::clone(&tokenizer), config).expect("engine"), tokenizer)
}

fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).expect("read")).expect("json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// (prompt ids, reference greedy ids) of every case.
fn cases(name: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    reference(name)["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| (ids(&c["prompt_ids"]), ids(&c["greedy_ids"])))
        .collect()
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ignore_eos: true, ..SamplingParams::default() }
}

fn tokens(outputs: &[RequestOutput]) -> Vec<u32> {
    outputs.iter().flat_map(|o| o.token_ids.iter().copied()).collect()
}

fn wait_idle(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = engine.stats();
        if s.num_running == 0 && s.num_waiting == 0 && s.kv_usage == 0.0 && engine.pending() == Load::default() {
            return;
        }
        assert!(Instant::now() < deadline, "engine did not go idle: {s:?}, pending {:?}", engine.pending());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Submits every case at once and checks each against its greedy reference.
fn check_concurrent_greedy(name: &str, setup: Setup) -> EngineHandle {
    let (engine, _) = start(name, setup);
    let cases = cases(name);
    let streams: Vec<_> = cases
        .iter()
        .map(|(prompt, want)| {
            let req =
                GenerateRequest { prompt_token_ids: prompt.clone(), params: greedy(want.len() as u32), grammar: None };
            engine.submit(req).expect("submit")
        })
        .collect();
    for (i, (stream, (_, want))) in streams.into_iter().zip(&cases).enumerate() {
        let out = collect(stream);
        assert_eq!(out.len(), 1);
        assert_eq!(&tokens(&out[0]), want, "{name} case {i}");
        assert_eq!(out[0].last().and_then(|o| o.finish_reason), Some(FinishReason::Length));
    }
    wait_idle(&engine);
    engine
}

macro_rules! fixtures {
    ($($name:ident),*) => {
        /// Every fixture model.
        const FIXTURES: &[&str] = &[$(stringify!($name)),*];
    };
}
include!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures/names.rs"));

/// The fixtures whose MLPs route through experts.
fn moe_fixtures() -> Vec<&'static str> {
    let moe: Vec<&str> = FIXTURES.iter().copied().filter(|name| name.ends_with("_moe")).collect();
    assert_eq!(moe, ["qwen2_moe", "qwen3_moe", "mixtral_moe"], "the MoE fixtures are named *_moe");
    moe
}

#[test]
fn concurrent_requests_match_reference_on_every_fixture() {
    for &name in FIXTURES {
        check_concurrent_greedy(name, Setup::default());
    }
}

/// Every reference case of `name`, `copies` times over, submitted at once (or one request at a
/// time); returns each request's tokens, in case order per copy, and the run's preemptions.
fn run_cases(name: &str, setup: Setup, copies: usize, together: bool) -> (Vec<Vec<u32>>, u64) {
    let prompts: Vec<(Vec<u32>, u32)> =
        (0..copies).flat_map(|_| cases(name)).map(|(prompt, want)| (prompt, want.len() as u32)).collect();
    run_batch(name, setup, &prompts, together)
}

/// A MoE model's routing depends on nothing but each token's own hidden state: every case
/// alone, 64 requests at once, prefill in chunks of 7 tokens beside other requests' decodes,
/// and a pool so small that requests are preempted and recomputed all give the reference.
#[test]
fn moe_fixtures_match_reference_alone_batched_chunked_and_preempted() {
    for name in moe_fixtures() {
        let want: Vec<Vec<u32>> = cases(name).into_iter().map(|(_, greedy)| greedy).collect();
        let (alone, _) = run_cases(name, Setup::default(), 1, false);
        assert_eq!(alone, want, "{name}: one request at a time");

        let copies = want.len() * 16;
        let want_64: Vec<Vec<u32>> = want.iter().cycle().take(copies).cloned().collect();
        assert_eq!(copies, 64);
        let (together, _) = run_cases(name, Setup::default(), 16, true);
        assert_eq!(together, want_64, "{name}: 64 at once");

        let chunked = Setup { max_num_batched_tokens: 7, block_size: 4, ..Setup::default() };
        let (chunked, _) = run_cases(name, chunked, 1, true);
        assert_eq!(chunked, want, "{name}: chunked prefill, 7 tokens a step");

        // 28 blocks of 4 tokens: the longest case (77 + 12 tokens, 23 blocks) fits alone, the
        // 64 requests do not.
        let tiny = Setup { num_blocks: 28, block_size: 4, ..Setup::default() };
        let (tiny, preemptions) = run_cases(name, tiny, 16, true);
        assert!(preemptions > 0, "{name}: the tiny pool should force preemption");
        assert_eq!(tiny, want_64, "{name}: tiny pool with preemption");
    }
}

#[test]
fn chunked_prefill_gives_the_same_tokens() {
    // A budget of 8 tokens a step splits the longer prompts (33 and 50 tokens; 40 and 77 for the
    // Gemma fixtures) into many chunks that share steps with the other requests' decodes, and
    // that cross the sliding windows (24; 12 and 10 on Gemma's local layers).
    for name in ["mistral_swa", "gemma2_softcap", "gemma3_text"] {
        check_concurrent_greedy(name, Setup { max_num_batched_tokens: 8, block_size: 4, ..Setup::default() });
    }
}

/// Every case four times at once (the copies share their prompts through the prefix cache)
/// with `setup`: each request's tokens and finish, and the engine's preemptions.
fn run_cases_four_times(engine: &EngineHandle, cases: &[(Vec<u32>, Vec<u32>)]) -> Vec<Vec<u32>> {
    let streams: Vec<_> = (0..4)
        .flat_map(|_| cases.iter())
        .map(|(prompt, want)| {
            let request =
                GenerateRequest { prompt_token_ids: prompt.clone(), params: greedy(want.len() as u32), grammar: None };
            engine.submit(request).expect("submit")
        })
        .collect();
    streams
        .into_iter()
        .map(|s| {
            let out = collect(s);
            assert_eq!(out[0].last().and_then(|o| o.finish_reason), Some(FinishReason::Length));
            tokens(&out[0])
        })
        .collect()
}

/// Every layer of `mistral_swa` slides (window 24): its one KV cache group keeps a request's
/// blocks of the last 24 positions and the step's chunk, so a request of 61 positions (16 blocks
/// of 4) runs in a pool of 12, and 16 requests in chunks of 8 tokens a step preempt each other
/// there. Every one gives HF's greedy tokens.
#[test]
fn a_sliding_window_model_runs_in_a_pool_smaller_than_its_sequences() {
    let setup = Setup { num_blocks: 12, block_size: 4, max_num_batched_tokens: 8, ..Setup::default() };
    let (engine, _) = start("mistral_swa", setup);
    let cases = cases("mistral_swa");
    assert!(cases.iter().any(|(p, g)| (p.len() + g.len() - 1).div_ceil(4) > 12), "a case longer than the pool");
    let outs = run_cases_four_times(&engine, &cases);
    for (i, (out, (_, want))) in outs.iter().zip(cases.iter().cycle()).enumerate() {
        assert_eq!(out, want, "request {i}");
    }
    wait_idle(&engine);
    let stats = engine.stats();
    assert!(stats.num_preemptions > 0, "the pool should have forced a preemption");
    assert!(stats.prefix_cache_hits > 0, "the copies should have hit the cache");
    assert_eq!(stats.num_blocks, 12);
}

/// `mistral_swa` with its middle layer made global: a full-attention group (layer 1) and a
/// sliding one (layers 0 and 2). With small blocks, chunks of 8 tokens, a pool that forces
/// preemption and prefix hits, the engine gives the tokens of the model run over each whole
/// sequence on a fresh cache, without paging: no layer ever lost a block it reads.
#[test]
fn a_hybrid_model_gives_the_tokens_of_the_unpaged_model() {
    let dir = fixture("mistral_swa");
    let load = || {
        let mut config = ferrolm_model::ModelConfig::from_dir(&dir).expect("config");
        config.sliding_layers = vec![true, false, true];
        let weights = ferrolm_model::WeightSource::open_dir(&dir).expect("weights");
        Model::load(&ferrolm_backend::cpu::Cpu::default(), config, &weights).expect("model")
    };
    let mut model = load();
    assert_eq!(model.config.kv_cache_windows(), vec![None, Some(24)]);
    // As the engine does: no logits for ids the tokenizer cannot decode.
    model.config.limit_output_vocab(Tokenizer::from_dir(&dir).expect("tokenizer").vocab_size());
    let all_sliding = cases("mistral_swa");
    let cases: Vec<(Vec<u32>, Vec<u32>)> =
        all_sliding.iter().map(|(p, g)| (p.clone(), greedy_unpaged(&model, p, g.len()))).collect();
    let setup = Setup { num_blocks: 24, block_size: 4, max_num_batched_tokens: 8, ..Setup::default() };
    let (engine, _) = start_model(load(), "mistral_swa", setup);
    let outs = run_cases_four_times(&engine, &cases);
    for (i, (out, (_, want))) in outs.iter().zip(cases.iter().cycle()).enumerate() {
        assert_eq!(out, want, "request {i}");
    }
    wait_idle(&engine);
    let stats = engine.stats();
    assert!(stats.num_preemptions > 0 && stats.prefix_cache_hits > 0, "{stats:?}");
    // Past 24 tokens the global layer sees more than the model whose layers all slide.
    assert_ne!(cases, all_sliding, "the middle layer's window should change some tokens");
}

/// Greedy tokens of `model` after `prompt`, each from a forward pass over the whole sequence on
/// a fresh cache, one block table for every group.
fn greedy_unpaged(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let num_blocks = seq.len().div_ceil(16);
        let mut kv = model.new_kv_cache(num_blocks, 16);
        let table: Vec<u32> = (0..num_blocks as u32).collect();
        let mut input = ferrolm_model::ModelInput::default();
        input.push_request(&seq, 0, &table, 16, true, false);
        let logits = model.forward(&input, &mut kv);
        let argmax = (0..logits.len()).fold(0, |best, i| if logits[i] > logits[best] { i } else { best });
        seq.push(argmax as u32);
    }
    seq.split_off(prompt.len())
}

/// The engine refuses KV cache groups that are not the model's.
#[test]
fn kv_cache_groups_must_be_the_models() {
    let model = Model::from_dir(&fixture("mistral_swa")).expect("model");
    let config = EngineConfig {
        scheduler: SchedulerConfig::new(64, 512),
        max_pending: Load { sequences: 8, prompt_tokens: 1024 },
        eos_token_ids: vec![1],
        overlap_steps: true,
    };
    let err =
        EngineHandle::start(model, None::<Arc<Tokenizer>>, config).err().expect("a full group for a sliding model");
    assert!(err.to_string().contains("[None]") && err.to_string().contains("[Some(24)]"), "{err}");
}

#[test]
fn preemption_under_a_tiny_pool_gives_the_same_tokens() {
    // Two 30-token prompts that each grow to 60 tokens (15 blocks of 4): both fit at admission
    // (8 + 8 of 20 blocks) but not at full length, so the newer one must be preempted.
    let long = cases("llama")[3].0.clone();
    let prompts = [long[..30].to_vec(), long[20..50].to_vec()];
    let run = |num_blocks: usize| {
        let (engine, _) = start("llama", Setup { num_blocks, block_size: 4, ..Setup::default() });
        let streams: Vec<_> = prompts
            .iter()
            .map(|p| {
                engine
                    .submit(GenerateRequest { prompt_token_ids: p.clone(), params: greedy(30), grammar: None })
                    .expect("submit")
            })
            .collect();
        let outs: Vec<Vec<u32>> = streams.into_iter().map(|s| tokens(&collect(s)[0])).collect();
        wait_idle(&engine);
        (outs, engine.stats().num_preemptions)
    };
    let (roomy, no_preemptions) = run(256);
    let (tight, preemptions) = run(20);
    assert_eq!(no_preemptions, 0);
    assert!(preemptions > 0, "the pool should have forced a preemption");
    assert_eq!(roomy, tight);
    assert!(roomy.iter().all(|t| t.len() == 30));
}

/// Prompt logprobs read in chunks of the token budget (16) and of a prompt-logprob row budget of
/// 3 rows a step both match the reference.
#[test]
fn prompt_logprobs_match_reference() {
    for rows in [16, 3] {
        check_prompt_logprobs(Setup { max_num_batched_tokens: 16, max_prompt_logprob_rows: rows, ..Setup::default() });
    }
}

fn check_prompt_logprobs(setup: Setup) {
    let (engine, _) = start("qwen3_qknorm", setup);
    let reference = reference("qwen3_qknorm");
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_ids"]);
        let params = SamplingParams { prompt_logprobs: Some(2), logprobs: Some(5), ..greedy(3) };
        let out = collect(
            engine.submit(GenerateRequest { prompt_token_ids: prompt.clone(), params, grammar: None }).expect("submit"),
        );
        let first = &out[0][0];
        let got = first.prompt_logprobs.as_ref().expect("prompt logprobs");
        assert_eq!(got.len(), prompt.len());
        assert!(got[0].is_none());
        for (i, want) in case["prompt_logprobs"].as_array().expect("lp").iter().enumerate().skip(1) {
            let lp = got[i].as_ref().expect("logprob");
            assert_eq!(lp.token, prompt[i]);
            assert!((lp.logprob as f64 - want.as_f64().expect("f")).abs() < 1e-4, "position {i}");
            assert_eq!(lp.top_logprobs.len(), 2);
        }
        // Top-5 logprobs of the first generated token.
        let step0 = &case["steps"][0]["top5"];
        let top = &first.logprobs[0].top_logprobs;
        for (j, (id, lp)) in top.iter().enumerate() {
            assert_eq!(*id as u64, step0[j][0].as_u64().expect("id"));
            assert!((*lp as f64 - step0[j][1].as_f64().expect("lp")).abs() < 1e-4);
        }
    }
}

#[test]
fn shared_prefix_hits_the_cache_and_n_samples_share_it() {
    let (engine, _) = start("llama3_gqa", Setup { block_size: 4, ..Setup::default() });
    let (prompt, want) = cases("llama3_gqa")[3].clone();
    let first = collect(
        engine
            .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params: greedy(4), grammar: None })
            .expect("submit"),
    );
    assert_eq!(first[0][0].num_cached_tokens, 0);
    let again = collect(
        engine
            .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params: greedy(4), grammar: None })
            .expect("submit"),
    );
    assert!(again[0][0].num_cached_tokens >= 4 * ((prompt.len() - 1) / 4), "cached {}", again[0][0].num_cached_tokens);
    assert_eq!(tokens(&again[0]), want[..4]);
    assert!(engine.stats().prefix_cache_hits > 0);

    // n = 3 seeded samples: three sequences, each finishing once.
    let params = SamplingParams { n: 3, temperature: 1.0, seed: Some(7), ..greedy(6) };
    let out =
        collect(engine.submit(GenerateRequest { prompt_token_ids: prompt, params, grammar: None }).expect("submit"));
    assert_eq!(out.len(), 3);
    for seq in &out {
        assert_eq!(tokens(seq).len(), 6);
        assert_eq!(seq.iter().filter(|o| o.finish_reason.is_some()).count(), 1);
    }
    wait_idle(&engine);
}

#[test]
fn seeded_sampling_does_not_depend_on_the_batch() {
    let (engine, _) = start("qwen2_tied", Setup::default());
    let cases = cases("qwen2_tied");
    let params = SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(1234), ..greedy(16) };
    let alone = collect(
        engine
            .submit(GenerateRequest { prompt_token_ids: cases[1].0.clone(), params: params.clone(), grammar: None })
            .expect("s"),
    );
    // The same request again, now beside three others with different seeds.
    let mut streams = Vec::new();
    for (i, (prompt, _)) in cases.iter().enumerate() {
        let p = if i == 1 { params.clone() } else { SamplingParams { seed: Some(i as u64), ..params.clone() } };
        streams.push(
            engine
                .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params: p, grammar: None })
                .expect("submit"),
        );
    }
    let outs: Vec<_> = streams.into_iter().map(collect).collect();
    assert_eq!(tokens(&outs[1][0]), tokens(&alone[0]));
    let other_seed = SamplingParams { seed: Some(99), ..params };
    let different = collect(
        engine
            .submit(GenerateRequest { prompt_token_ids: cases[1].0.clone(), params: other_seed, grammar: None })
            .expect("s"),
    );
    assert_ne!(tokens(&different[0]), tokens(&alone[0]), "a different seed should change 16 sampled tokens");
}

#[test]
fn stop_string_cuts_text_and_finishes() {
    let (engine, tokenizer) = start("llama", Setup::default());
    let (prompt, want) = cases("llama")[0].clone();
    let full = collect(
        engine
            .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params: greedy(12), grammar: None })
            .expect("s"),
    );
    let text: String = full[0].iter().map(|o| o.text.as_str()).collect();
    assert_eq!(text, tokenizer.decode(&want, true).expect("decode"));
    // Stop at a piece of the text that starts after the first character.
    let chars: Vec<char> = text.chars().collect();
    let start = chars.len() / 2;
    let stop: String = chars[start..start + 2].iter().collect();
    let expected: String = text[..text.find(&stop).expect("stop occurs")].to_string();
    let params = SamplingParams { stop: vec![stop.clone()], ..greedy(12) };
    let out = collect(engine.submit(GenerateRequest { prompt_token_ids: prompt, params, grammar: None }).expect("s"));
    let got: String = out[0].iter().map(|o| o.text.as_str()).collect();
    assert_eq!(got, expected);
    assert_eq!(out[0].last().and_then(|o| o.finish_reason), Some(FinishReason::Stop));
    // The tokens shown end with the one that completed the stop string; any the engine sampled
    // before it heard of the stop are not.
    let shown = tokens(&out[0]);
    assert_eq!(shown, want[..shown.len()]);
    let decode = |ids: &[u32]| tokenizer.decode(ids, true).expect("decode");
    assert!(decode(&shown).contains(&stop) && !decode(&shown[..shown.len() - 1]).contains(&stop));
    wait_idle(&engine);
}

#[test]
fn eos_finishes_with_stop_unless_ignored() {
    let (engine, _) = start("llama", Setup::default());
    let (prompt, want) = cases("llama")[0].clone();
    // Make the model's 3rd greedy token count as a stop token.
    let params = SamplingParams { stop_token_ids: vec![want[2]], ignore_eos: false, ..greedy(12) };
    let out = collect(engine.submit(GenerateRequest { prompt_token_ids: prompt, params, grammar: None }).expect("s"));
    let got = tokens(&out[0]);
    let first_stop = want.iter().position(|&t| t == want[2]).expect("present");
    assert_eq!(got, want[..=first_stop]);
    assert_eq!(out[0].last().and_then(|o| o.finish_reason), Some(FinishReason::Stop));
}

#[test]
fn dropping_a_stream_aborts_and_frees_blocks() {
    let (engine, _) = start("llama", Setup::default());
    let (prompt, _) = cases("llama")[3].clone();
    let mut stream = engine
        .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params: greedy(400), grammar: None })
        .expect("s");
    assert!(stream.blocking_recv().is_some());
    drop(stream);
    wait_idle(&engine);
    // The engine still serves.
    let out = collect(
        engine.submit(GenerateRequest { prompt_token_ids: prompt, params: greedy(2), grammar: None }).expect("s"),
    );
    assert_eq!(tokens(&out[0]).len(), 2);
    wait_idle(&engine);
}

#[test]
fn bad_requests_are_refused_with_clear_errors() {
    let (engine, _) = start("llama", Setup { num_blocks: 8, ..Setup::default() });
    let submit = |prompt: Vec<u32>, params: SamplingParams| {
        engine.submit(GenerateRequest { prompt_token_ids: prompt, params, grammar: None })
    };
    assert!(matches!(submit(vec![], greedy(4)), Err(EngineError::EmptyPrompt)));
    let err = submit(vec![5, 320], greedy(4)).err().expect("out of vocab");
    assert!(err.to_string().contains("320"), "{err}");
    let err = submit(vec![5; 500], greedy(20)).err().expect("too long");
    assert!(err.to_string().contains("500") && err.to_string().contains("512"), "{err}");
    assert!(matches!(submit(vec![5; 512], greedy(1)), Err(EngineError::PromptTooLong { .. })));
    let err = submit(vec![5], SamplingParams { top_p: 0.0, ..greedy(4) }).err().expect("bad top_p");
    assert!(err.to_string().contains("top_p"), "{err}");
    // 8 blocks of 16 hold 128 tokens: 200 can never fit.
    let err = submit(vec![5; 100], greedy(100)).err().expect("never fits");
    assert!(err.to_string().contains("blocks"), "{err}");
}

/// The handle and the scheduler admit by one rule: a request whose longest run fills its last
/// block exactly (the last sampled token is never run) is taken, runs alone to the end and
/// frees its blocks; one more token is refused by both.
#[test]
fn a_request_at_a_block_boundary_is_admitted_by_the_handle_and_the_scheduler() {
    let (engine, _) = start("llama", Setup { num_blocks: 2, ..Setup::default() });
    // 16 + 17 tokens, the last never run: 32 tokens fill 2 blocks of 16.
    let stream = engine.submit(GenerateRequest { prompt_token_ids: vec![5; 16], params: greedy(17), grammar: None });
    let out = collect(stream.expect("fits 2 blocks exactly"));
    assert_eq!(tokens(&out[0]).len(), 17);
    assert_eq!(out[0].last().and_then(|o| o.finish_reason), Some(FinishReason::Length));
    let err = engine.submit(GenerateRequest { prompt_token_ids: vec![5; 16], params: greedy(18), grammar: None }).err();
    let err = err.expect("one token more needs a 3rd block").to_string();
    assert!(err.contains("may need 3 KV cache blocks but the pool has only 2"), "{err}");
    wait_idle(&engine);
}

#[test]
fn a_full_queue_pushes_back() {
    let limit = Load { sequences: 4, prompt_tokens: 8 };
    let (engine, _) = start("llama", Setup { max_pending: limit, ..Setup::default() });
    let request = |prompt: Vec<u32>, n: u32| GenerateRequest {
        prompt_token_ids: prompt,
        params: SamplingParams { n, temperature: 1.0, ..greedy(300) },
        grammar: None,
    };
    let a = engine.submit(request(vec![5, 6], 3)).expect("a: 3 sequences, 2 tokens");
    assert_eq!(engine.pending(), Load { sequences: 3, prompt_tokens: 2 });
    let b = engine.submit(request(vec![5, 7], 2));
    assert!(matches!(b, Err(EngineError::Overloaded { .. })), "5 sequences are past 4");
    let c = engine.submit(request(vec![5; 7], 1));
    assert!(matches!(c, Err(EngineError::Overloaded { .. })), "9 prompt tokens are past 8");
    let d = engine.submit_all(vec![request(vec![5, 8], 1), request(vec![5, 9], 1)]);
    assert!(matches!(d, Err(EngineError::Overloaded { .. })), "all or none: 5 sequences in all");
    assert_eq!(engine.pending(), Load { sequences: 3, prompt_tokens: 2 }, "refusals reserve nothing");
    let e = engine.submit(request(vec![5; 6], 1)).expect("exactly at both limits");
    drop((a, e));
    wait_idle(&engine);
    let f = engine.submit_all(vec![request(vec![5, 8], 2), request(vec![5, 9], 2)]).expect("room again");
    assert_eq!(f.len(), 2);
    assert_eq!(engine.pending(), Load { sequences: 4, prompt_tokens: 4 });
    drop(f);
    wait_idle(&engine);
}

/// `count` greedy requests of mixed lengths (deterministic pseudo-random prompts of 1 to 60
/// tokens below 320, 1 to 24 tokens out); the first 32 are the same for any count.
fn mixed_prompts(count: usize) -> Vec<(Vec<u32>, u32)> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    (0..count).map(|_| ((0..1 + next(60)).map(|_| 3 + next(317) as u32).collect(), 1 + next(24) as u32)).collect()
}

fn run_batch(name: &str, setup: Setup, prompts: &[(Vec<u32>, u32)], together: bool) -> (Vec<Vec<u32>>, u64) {
    let (engine, _) = start(name, setup);
    let submit = |(p, n): &(Vec<u32>, u32)| {
        engine
            .submit(GenerateRequest { prompt_token_ids: p.clone(), params: greedy(*n), grammar: None })
            .expect("submit")
    };
    let outs = if together {
        let streams: Vec<_> = prompts.iter().map(submit).collect();
        streams.into_iter().map(|s| tokens(&collect(s)[0])).collect()
    } else {
        prompts.iter().map(|p| tokens(&collect(submit(p))[0])).collect()
    };
    wait_idle(&engine);
    let preemptions = engine.stats().num_preemptions;
    (outs, preemptions)
}

#[test]
fn batch_invariance_of_32_mixed_requests() {
    let prompts = mixed_prompts(32);
    let name = "llama3_gqa";
    let (alone, _) = run_batch(name, Setup::default(), &prompts, false);
    for (i, (out, (_, n))) in alone.iter().zip(&prompts).enumerate() {
        assert_eq!(out.len(), *n as usize, "request {i}");
    }
    let (together, _) = run_batch(name, Setup::default(), &prompts, true);
    assert_eq!(together, alone, "all at once");
    let chunked = Setup { max_num_batched_tokens: 7, block_size: 4, ..Setup::default() };
    let (chunked, _) = run_batch(name, chunked, &prompts, true);
    assert_eq!(chunked, alone, "chunked prefill, 7 tokens a step");
    // 24 blocks of 4 tokens: the longest request (84 tokens) fits alone, the batch does not.
    let tiny = Setup { num_blocks: 24, block_size: 4, ..Setup::default() };
    let (tiny, preemptions) = run_batch(name, tiny, &prompts, true);
    assert!(preemptions > 0, "the tiny pool should force preemption");
    assert_eq!(tiny, alone, "tiny pool with preemption");
}

/// Gemma 2 and 3 mix sliding-window layers (windows of 12 and 10) with global ones. Each
/// reference case alone gives the reference tokens; 64 requests of 1 to 60 prompt tokens (most
/// cross the windows) give the tokens each gives alone when all 64 run at once, when read in
/// chunks of 7 tokens over blocks of 4, and when a pool of 24 blocks of 4 preempts them.
#[test]
fn sliding_and_global_layers_give_the_same_tokens_however_batched() {
    for name in ["gemma2_softcap", "gemma3_text"] {
        let (engine, _) = start(name, Setup::default());
        for (i, (prompt, want)) in cases(name).into_iter().enumerate() {
            let params = greedy(want.len() as u32);
            let stream = engine.submit(GenerateRequest { prompt_token_ids: prompt, params, grammar: None });
            assert_eq!(tokens(&collect(stream.expect("submit"))[0]), want, "{name} case {i} alone");
        }
        wait_idle(&engine);

        let prompts = mixed_prompts(64);
        let (alone, _) = run_batch(name, Setup::default(), &prompts, false);
        for (i, (out, (_, n))) in alone.iter().zip(&prompts).enumerate() {
            assert_eq!(out.len(), *n as usize, "{name} request {i}");
        }
        let roomy = Setup { num_blocks: 512, ..Setup::default() };
        let (together, preemptions) = run_batch(name, roomy, &prompts, true);
        assert_eq!(preemptions, 0, "{name}: 64 requests fit the pool at once");
        assert_eq!(together, alone, "{name}: 64 at once");
        let chunked = Setup { max_num_batched_tokens: 7, block_size: 4, ..Setup::default() };
        assert_eq!(run_batch(name, chunked, &prompts, true).0, alone, "{name}: chunked prefill, 7 tokens a step");
        // The longest request (84 tokens, 21 blocks of 4) fits alone; the batch does not.
        let tiny = Setup { num_blocks: 24, block_size: 4, ..Setup::default() };
        let (tiny, preemptions) = run_batch(name, tiny, &prompts, true);
        assert!(preemptions > 0, "{name}: the tiny pool should force preemption");
        assert_eq!(tiny, alone, "{name}: tiny pool with preemption");
    }
}

/// A CPU runner that can fail one step, to drive the engine's device paths without a GPU.
struct DeviceLikeRunner {
    inner: ferrolm_model::CpuRunner,
    calls: usize,
    fail_at_call: Option<usize>,
    /// Set when the runner (the "device memory") is freed.
    freed: Arc<AtomicBool>,
}

impl Drop for DeviceLikeRunner {
    fn drop(&mut self) {
        self.freed.store(true, Ordering::SeqCst);
    }
}

impl ferrolm_model::ModelRunner for DeviceLikeRunner {
    fn config(&self) -> &ferrolm_model::ModelConfig {
        self.inner.config()
    }

    fn device(&self) -> String {
        "test device".into()
    }

    fn allocate_kv_cache(&mut self, num_blocks: &[usize], block_size: usize) -> Result<(), ferrolm_model::ModelError> {
        self.inner.allocate_kv_cache(num_blocks, block_size)
    }

    fn limit_output_vocab(&mut self, num_ids: usize) {
        self.inner.limit_output_vocab(num_ids);
    }

    fn launch(
        &mut self,
        input: &ferrolm_model::ModelInput,
        rows: &[ferrolm_sampling::RowRequest<'_>],
    ) -> Result<(), ferrolm_model::ModelError> {
        self.calls += 1;
        if self.fail_at_call == Some(self.calls) {
            return Err(ferrolm_model::ModelError::Config("injected failure".into()));
        }
        self.inner.launch(input, rows)
    }

    fn set_token_masks(&mut self, masks: &ferrolm_sampling::TokenMasks) -> Result<(), ferrolm_model::ModelError> {
        self.inner.set_token_masks(masks)
    }

    fn collect(&mut self) -> Result<Vec<Option<ferrolm_sampling::TokenLogprobs>>, ferrolm_model::ModelError> {
        self.inner.collect()
    }
}

fn start_device_like(name: &str, fail_at_call: Option<usize>) -> EngineHandle {
    start_watched(name, fail_at_call).0
}

/// [`start_device_like`], with the flag its runner sets when it is freed.
fn start_watched(name: &str, fail_at_call: Option<usize>) -> (EngineHandle, Arc<AtomicBool>) {
    let model = Model::from_dir(&fixture(name)).expect("model");
    let windows = model.config.kv_cache_windows();
    let freed = Arc::new(AtomicBool::new(false));
    let inner = ferrolm_model::CpuRunner::new(model);
    let runner = DeviceLikeRunner { inner, calls: 0, fail_at_call, freed: Arc::clone(&freed) };
    let scheduler = SchedulerConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 2048,
        block_size: 16,
        kv_cache_groups: Vec::new(),
        max_model_len: 512,
        long_prefill_token_threshold: None,
        max_prompt_logprob_rows: 256,
        enable_prefix_caching: true,
    }
    .with_kv_cache_groups(&windows, 256);
    let config = EngineConfig {
        scheduler,
        max_pending: Load { sequences: 1024, prompt_tokens: 1 << 20 },
        eos_token_ids: vec![1],
        overlap_steps: true,
    };
    let runner: Box<dyn ferrolm_model::ModelRunner> = Box::new(runner);
    (EngineHandle::start(runner, None::<Arc<Tokenizer>>, config).expect("engine"), freed)
}

/// `shutdown` returns once the engine thread has freed the runner; not while another handle or
/// a stream keeps the engine alive.
#[test]
fn shutdown_waits_until_the_runner_is_freed() {
    let (engine, freed) = start_watched("llama", None);
    let prompt = cases("llama")[0].0.clone();
    let out = collect(
        engine
            .submit(GenerateRequest { prompt_token_ids: prompt.clone(), params: greedy(4), grammar: None })
            .expect("s"),
    );
    assert_eq!(tokens(&out[0]).len(), 4);
    let other = engine.clone();
    assert!(!engine.shutdown(Duration::from_secs(5)), "another handle keeps the engine");
    let stream =
        other.submit(GenerateRequest { prompt_token_ids: prompt, params: greedy(4), grammar: None }).expect("s");
    assert!(!other.shutdown(Duration::from_millis(50)), "a live stream keeps the engine");
    assert!(!freed.load(Ordering::SeqCst));
    // The stream still gets its tokens; once it is gone, the engine ends and frees the runner.
    assert_eq!(tokens(&collect(stream)[0]).len(), 4);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !freed.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the engine did not end after its last stream");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn shutdown_of_the_last_handle_frees_the_runner_before_returning() {
    let (engine, freed) = start_watched("llama", None);
    let prompt = cases("llama")[0].0.clone();
    let out = collect(
        engine.submit(GenerateRequest { prompt_token_ids: prompt, params: greedy(4), grammar: None }).expect("s"),
    );
    assert_eq!(tokens(&out[0]).len(), 4);
    assert!(engine.shutdown(Duration::from_secs(10)));
    assert!(freed.load(Ordering::SeqCst), "shutdown returned before the runner was freed");
}

/// Rows the runner answers (token and logprobs only, as a device does) give the reference tokens,
/// with top logprobs where they are asked for.
#[test]
fn argmax_rows_from_the_runner_give_the_reference_tokens() {
    let engine = start_device_like("llama", None);
    let cases = cases("llama");
    let plain: Vec<_> = cases
        .iter()
        .map(|(p, _)| {
            engine.submit(GenerateRequest { prompt_token_ids: p.clone(), params: greedy(8), grammar: None }).expect("s")
        })
        .collect();
    let with_top = SamplingParams { logprobs: Some(3), ..greedy(8) };
    let top = engine
        .submit(GenerateRequest { prompt_token_ids: cases[0].0.clone(), params: with_top, grammar: None })
        .expect("s");
    for (stream, (_, want)) in plain.into_iter().zip(&cases) {
        let out = collect(stream);
        assert_eq!(tokens(&out[0]), want[..8]);
        assert_eq!(out[0].last().and_then(|o| o.finish_reason), Some(FinishReason::Length));
    }
    let out = collect(top);
    assert_eq!(tokens(&out[0]), cases[0].1[..8]);
    assert!(out[0].iter().all(|o| o.logprobs.iter().all(|l| l.top_logprobs.len() == 3)));
    wait_idle(&engine);
}

/// A failing step aborts the requests in it, frees their blocks, and the engine serves on.
#[test]
fn a_device_failure_aborts_the_step_and_the_engine_recovers() {
    let engine = start_device_like("llama", Some(3));
    let cases = cases("llama");
    let streams: Vec<_> = cases
        .iter()
        .map(|(p, _)| {
            engine
                .submit(GenerateRequest { prompt_token_ids: p.clone(), params: greedy(20), grammar: None })
                .expect("s")
        })
        .collect();
    for stream in streams {
        let out = collect(stream);
        let last = out[0].last().expect("a final output");
        assert_eq!(last.finish_reason, Some(FinishReason::Abort));
        assert!(tokens(&out[0]).len() < 20);
    }
    wait_idle(&engine);
    let (prompt, want) = cases[1].clone();
    let out = collect(
        engine.submit(GenerateRequest { prompt_token_ids: prompt, params: greedy(5), grammar: None }).expect("s"),
    );
    assert_eq!(tokens(&out[0]), want[..5]);
}

/// What a client sees of one request: per sequence, each output's tokens, text, logprobs (to
/// 1e-4: batches of other sizes round differently) and finish reason.
/// A logprob compared within 1e-4: batches of other shapes may move it by a rounding error.
#[derive(Clone, Copy, Debug)]
struct Logprob(f32);

impl PartialEq for Logprob {
    fn eq(&self, other: &Self) -> bool {
        (self.0 - other.0).abs() <= 1e-4
    }
}

type Seen = Vec<Vec<(Vec<u32>, String, Vec<(u32, Logprob, Vec<u32>)>, Option<FinishReason>)>>;

fn seen(outputs: Vec<Vec<RequestOutput>>) -> Seen {
    let round = Logprob;
    outputs
        .into_iter()
        .map(|seq| {
            seq.into_iter()
                .map(|o| {
                    let logprobs = o
                        .logprobs
                        .iter()
                        .map(|l| (l.token, round(l.logprob), l.top_logprobs.iter().map(|&(t, _)| t).collect()))
                        .collect();
                    (o.token_ids, o.text, logprobs, o.finish_reason)
                })
                .collect()
        })
        .collect()
}

/// Mixed requests with steps launched ahead of the step before and with steps run one at a time:
/// greedy and seeded sampling, EOS stops after `min_tokens`, `n = 2` with logprobs, penalties
/// (which keep steps from going ahead) and stop strings. Clients see the very same outputs.
#[test]
fn steps_launched_ahead_give_the_outputs_of_steps_run_one_at_a_time() {
    let run = |overlap_steps: bool| {
        let (engine, _) = start("llama3_gqa", Setup { overlap_steps, max_num_seqs: 12, ..Setup::default() });
        let streams: Vec<_> = mixed_prompts(32)
            .into_iter()
            .enumerate()
            .map(|(i, (prompt, n))| {
                let seed = Some(i as u64);
                let sampled =
                    SamplingParams { temperature: 1.0, seed, max_tokens: Some(n), ..SamplingParams::default() };
                let params = match i % 5 {
                    0 => greedy(n),
                    1 => SamplingParams { min_tokens: n.min(2), ..sampled },
                    2 => SamplingParams { n: 2, top_p: 0.9, logprobs: Some(2), ..sampled },
                    // Only the first: while it runs, no step goes ahead.
                    3 if i == 3 => SamplingParams { presence_penalty: 0.5, ..sampled },
                    _ => SamplingParams { stop: vec!["a".into()], ..sampled },
                };
                engine.submit(GenerateRequest { prompt_token_ids: prompt, params, grammar: None }).expect("submit")
            })
            .collect();
        let outputs: Vec<Seen> = streams.into_iter().map(|s| seen(collect(s))).collect();
        wait_idle(&engine);
        (outputs, engine.stats().num_steps_ahead)
    };
    let (one_at_a_time, none_ahead) = run(false);
    assert_eq!(none_ahead, 0);
    let (overlapped, ahead) = run(true);
    assert!(ahead > 0, "no step went ahead");
    for (i, (a, b)) in overlapped.iter().zip(&one_at_a_time).enumerate() {
        assert_eq!(a, b, "request {i}");
    }
    let finishes =
        |outs: &[Seen], reason| outs.iter().flatten().filter(|s| s.last().and_then(|o| o.3) == Some(reason)).count();
    // The workload does exercise both ways of ending.
    assert!(finishes(&one_at_a_time, FinishReason::Stop) > 0 && finishes(&one_at_a_time, FinishReason::Length) > 0);
}

/// Steps run back to back are timed by kind: a 40-token prompt in chunks of 16 takes three
/// steps (the first, after idling, is not timed), then each of 5 more tokens one decode step of
/// one sequence.
#[test]
fn back_to_back_steps_are_timed_by_kind_and_batch_size() {
    let (engine, _) = start("llama3_gqa", Setup { max_num_batched_tokens: 16, ..Setup::default() });
    let prompt: Vec<u32> = (0..40).map(|i| 3 + i % 50).collect();
    let out = collect(
        engine.submit(GenerateRequest { prompt_token_ids: prompt, params: greedy(6), grammar: None }).expect("submit"),
    );
    assert_eq!(tokens(&out[0]).len(), 6);
    wait_idle(&engine);
    let stats = engine.stats();
    assert_eq!(stats.num_steps, 8);
    let steps = &stats.step_times;
    assert_eq!(steps.mixed.0, 2, "{steps:?}");
    assert_eq!(steps.decode[0].0, 5, "{steps:?}");
    assert!(steps.decode[1..].iter().all(|&(count, micros)| count == 0 && micros == 0), "{steps:?}");
    assert!(steps.mixed.1 > 0 && steps.decode[0].1 > 0, "{steps:?}");
}

/// Token ids of every sequence of every request, and each sequence's finish reason.
type Outcome = Vec<Vec<(Vec<u32>, Option<FinishReason>)>>;

/// Per fixture case: one greedy request under `grammar`, one seeded `n = 2` request under it at
/// temperature 1, and one greedy request without it, all submitted at once.
fn run_constrained(setup: Setup, grammar: &ferrolm_structured::Grammar) -> (Outcome, Arc<Tokenizer>, u64) {
    let overlap = setup.overlap_steps;
    let (engine, tokenizer) = start("llama3_gqa", setup);
    let free = SamplingParams { ignore_eos: false, ..greedy(64) };
    let mut streams = Vec::new();
    for (prompt, _) in cases("llama3_gqa") {
        let sampled = SamplingParams { n: 2, temperature: 1.0, seed: Some(7), ..free.clone() };
        for (params, grammar) in
            [(free.clone(), Some(grammar.clone())), (sampled, Some(grammar.clone())), (greedy(12), None)]
        {
            let request = GenerateRequest { prompt_token_ids: prompt.clone(), params, grammar };
            streams.push(engine.submit(request).expect("submit"));
        }
    }
    let outcome = streams
        .into_iter()
        .map(|s| collect(s).iter().map(|seq| (tokens(seq), seq.last().and_then(|o| o.finish_reason))).collect())
        .collect();
    wait_idle(&engine);
    let stats = engine.stats();
    assert!(stats.masked_steps > 0, "no step was masked");
    assert_eq!(stats.num_steps_ahead > 0, overlap, "masked steps are launched ahead unless overlap is off: {stats:?}");
    (outcome, tokenizer, stats.num_preemptions)
}

#[test]
fn constrained_requests_follow_their_grammar_however_they_are_batched() {
    let tokenizer = Tokenizer::from_dir(&fixture("llama3_gqa")).expect("tokenizer");
    let compiler = ferrolm_structured::GrammarCompiler::new(&tokenizer, &[1]).expect("compiler");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "owl"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}
        },
        "required": ["kind", "age", "tags"],
        "additionalProperties": false
    });
    let grammar = compiler.compile(&ferrolm_structured::StructuredOutput::JsonSchema(schema)).expect("compile");
    let (want, tokenizer, _) = run_constrained(Setup::default(), &grammar);
    for (i, request) in want.iter().enumerate() {
        for (ids, finish) in request {
            let text = tokenizer.decode(ids, true).expect("decode");
            if i % 3 == 2 {
                let reference = &cases("llama3_gqa")[i / 3].1;
                assert_eq!(ids, reference, "an unconstrained request beside constrained ones");
                continue;
            }
            let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("request {i}: {text:?}: {e}"));
            assert!(["cat", "dog", "owl"].contains(&doc["kind"].as_str().unwrap_or("")), "{text}");
            assert!(doc["age"].as_u64().is_some_and(|a| a < 100), "{text}");
            assert_eq!(*finish, Some(FinishReason::Stop), "request {i} ends at EOS once complete: {text}");
        }
    }
    let setups = [
        ("one step at a time", Setup { overlap_steps: false, ..Setup::default() }),
        ("chunked prefill", Setup { max_num_batched_tokens: 7, block_size: 4, ..Setup::default() }),
        ("preemption", Setup { num_blocks: 32, block_size: 4, ..Setup::default() }),
    ];
    for (what, setup) in setups {
        let (got, _, preemptions) = run_constrained(setup, &grammar);
        assert_eq!(got, want, "{what}");
        assert_eq!(preemptions > 0, what == "preemption", "{what}: {preemptions} preemptions");
    }
}

/// A complete grammar allows only EOS ids; `min_tokens` then waits on EOS tokens rather than
/// leaving nothing to sample, and the text stays the grammar's.
#[test]
fn min_tokens_under_a_grammar_ends_on_eos_with_the_grammar_text() {
    let (engine, tokenizer) = start("llama3_gqa", Setup::default());
    let compiler = ferrolm_structured::GrammarCompiler::new(&tokenizer, &[1]).expect("compiler");
    let choice = ferrolm_structured::StructuredOutput::Choice(vec!["yes".into()]);
    let grammar = compiler.compile(&choice).expect("compile");
    let params = SamplingParams { min_tokens: 8, ignore_eos: false, ..greedy(20) };
    let request = GenerateRequest { prompt_token_ids: vec![5, 6, 7], params, grammar: Some(grammar) };
    let outputs = collect(engine.submit(request).expect("submit"));
    let ids = tokens(&outputs[0]);
    assert_eq!(ids.len(), 8, "{ids:?}");
    assert_eq!(tokenizer.decode(&ids, true).expect("decode"), "yes");
    assert_eq!(outputs[0].last().and_then(|o| o.finish_reason), Some(FinishReason::Stop));
    wait_idle(&engine);
}
