//! The `ModelRunner` contract on every backend of this build, against the HF reference outputs
//! of the fixture models: the CPU runner always; with the `cuda` feature and a GPU present, the
//! CUDA runner in f32 and in bf16 too (without a GPU those are skipped with a message).
//!
//! Rules per backend: CPU within 1e-4 and GPU f32 within 1e-3 of the reference logprobs with
//! equal greedy tokens; GPU bf16 with mean absolute logprob error at most 0.02 and equal greedy
//! tokens wherever the reference margin exceeds 0.1. Where a MoE fixture records that HF's own
//! bf16 run leaves its f32 token (`bf16_argmax`: a router near a tie swaps experts under bf16
//! rounding, moving the logits by more than any margin), the bf16 token must be one of the two.
//! An FP8 fixture's bf16 run quantizes its FP8 products' inputs per token (W8A8, beyond 4 rows):
//! its reference is the CPU quantizing them the same way, and its bounds are widened by what
//! that quantization changes on the CPU ([`Bf16Bounds::widened_by`]).
//! Seeded sampling (temperature, top-p, min-p, penalties) gives the host sampler's tokens on the
//! CPU and in GPU f32.

use std::f64::consts::SQRT_2;
use std::path::{Path, PathBuf};

// Shared with the golden tests; not every helper is used here.
#[allow(dead_code)]
mod common;

use common::{block_table, ids};
use ferrolm_backend::cpu::{Cpu, Fp8Inputs};
use ferrolm_model::{CpuRunner, Model, ModelConfig, ModelInput, ModelRunner, WeightSource};
use ferrolm_sampling::mask::{allow, allows};
use ferrolm_sampling::{RequestSampler, RowRequest, SamplePlan, SamplingParams, TokenLogprobs, TokenMasks};
use serde_json::Value;

const BLOCK_SIZE: usize = 4;

#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Rule {
    /// Every logprob within this much; greedy tokens always equal.
    Close(f64),
    /// Mean absolute logprob error at most 0.02; greedy equal where the margin exceeds 0.1 and
    /// HF's bf16 run keeps its f32 token, else HF's f32 or bf16 token (the bounds widened where
    /// FP8 products quantize their inputs: [`Bf16Bounds::widened_by`]).
    Bf16,
}

const BF16_MEAN_ERR: f64 = 0.02;
/// How far apart a GPU f32 run's logprobs may be from the CPU's where both compute the same
/// values in f32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const F32_LOGPROB: f64 = 0.02;
const BF16_MARGIN: f64 = 0.1;

/// The bounds of a bf16 run: its mean absolute logprob error, and the reference margin above
/// which its greedy tokens must agree.
#[derive(Clone, Copy, Debug)]
struct Bf16Bounds {
    mean: f64,
    margin: f64,
}

const BF16: Bf16Bounds = Bf16Bounds { mean: BF16_MEAN_ERR, margin: BF16_MARGIN };

impl Bf16Bounds {
    /// The bounds of a run whose FP8 products quantize their inputs per token (the GPU's in bf16
    /// and f16), against the CPU quantizing them the same way. A quantizer turns a bf16-sized
    /// difference in its input into a step of the e4m3 grid, and the differences grow layer by
    /// layer, so the two runs may end up as far apart as two independent draws of the
    /// quantization's noise: √2 times its own effect, between an exact run (HF's reference, or
    /// the CPU's) and the CPU's quantizing one ([`QuantizationEffect`]).
    fn widened_by(self, effect: QuantizationEffect) -> Bf16Bounds {
        Bf16Bounds { mean: self.mean + SQRT_2 * effect.mean, margin: self.margin + SQRT_2 * effect.swing }
    }
}

/// What a quantization changes between two CPU runs, one without it: the mean and the largest
/// absolute change of the logprobs both runs score alike, and the largest change of a step's
/// margin (where the greedy tokens differ, the two margins together: how far apart the top two
/// moved).
#[derive(Clone, Copy, Debug, Default)]
struct QuantizationEffect {
    mean: f64,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    largest: f64,
    swing: f64,
}

impl QuantizationEffect {
    /// From the exact and the quantizing runs' teacher-forced logprobs (`scored`, compared
    /// alike) and `(logprob, margin, token)` of each greedy step.
    fn of(
        scored: impl IntoIterator<Item = (f64, f64)>,
        steps: impl IntoIterator<Item = ((f64, f64, u32), (f64, f64, u32))>,
    ) -> QuantizationEffect {
        let (mut sum, mut count, mut largest, mut swing) = (0.0, 0usize, 0.0f64, 0.0f64);
        for (lp_a, lp_b) in scored {
            sum += (lp_a - lp_b).abs();
            count += 1;
            largest = largest.max((lp_a - lp_b).abs());
        }
        for ((lp_a, margin_a, a), (lp_b, margin_b, b)) in steps {
            if a == b {
                sum += (lp_a - lp_b).abs();
                count += 1;
                largest = largest.max((lp_a - lp_b).abs());
                swing = swing.max((margin_a - margin_b).abs());
            } else {
                swing = swing.max(margin_a + margin_b);
            }
        }
        QuantizationEffect { mean: sum / count.max(1) as f64, largest, swing }
    }

    /// Between two greedy decodes of the same prompts ([`decode`]): each request's steps up to
    /// its first difference (the later ones decode another text).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn between(a: &[Vec<Decoded>], b: &[Vec<Decoded>]) -> QuantizationEffect {
        let steps = a.iter().zip(b).flat_map(|(a, b)| {
            let same = a.iter().zip(b).take_while(|(a, b)| a.token == b.token).count();
            let step = |d: &Decoded| (f64::from(d.logprob), f64::from(d.margin), d.token);
            a.iter().zip(b).take(same + 1).map(move |(a, b)| (step(a), step(b)))
        });
        QuantizationEffect::of([], steps)
    }
}

/// `path` (from the repository root) in the source tree this test was built from, else under the
/// current directory (a test binary carried to another machine and run from a checkout there).
fn repo_path(path: &str) -> PathBuf {
    let built = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join(path);
    if built.exists() {
        built
    } else {
        PathBuf::from(path)
    }
}

fn fixture(name: &str) -> PathBuf {
    repo_path("testdata/fixtures").join(name)
}

#[cfg(feature = "cuda")]
fn load_cuda(
    dir: &Path,
    gpu: ferrolm_backend::cuda::Gpu,
    dtype: ferrolm_backend::DType,
) -> ferrolm_model::cuda::CudaRunner {
    let config = ModelConfig::from_dir(dir).expect("config");
    let src = WeightSource::open_dir(dir).expect("weights");
    ferrolm_model::cuda::CudaRunner::load(gpu, dtype, config, &src).expect("upload")
}

fn load_model(dir: &Path) -> Model {
    load_model_with(dir, Cpu::default())
}

fn load_model_with(dir: &Path, cpu: Cpu) -> Model {
    let config = ModelConfig::from_dir(dir).expect("config");
    let src = WeightSource::open_dir(dir).expect("weights");
    Model::load(&cpu, config, &src).expect("model")
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).expect("reference");
    serde_json::from_str(&text).expect("json")
}

/// Every backend this build and machine have, with the rule its results must meet.
fn backends(dir: &Path) -> Vec<(String, Box<dyn ModelRunner>, Rule)> {
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut all: Vec<(String, Box<dyn ModelRunner>, Rule)> =
        vec![("cpu".into(), Box::new(CpuRunner::new(load_model(dir))), Rule::Close(1e-4))];
    #[cfg(feature = "cuda")]
    {
        use ferrolm_backend::cuda::Gpu;
        use ferrolm_backend::DType;
        for (dtype, rule) in [(DType::F32, Rule::Close(1e-3)), (DType::BF16, Rule::Bf16)] {
            match Gpu::new(0, &Default::default()) {
                Ok(gpu) => {
                    let runner = load_cuda(dir, gpu, dtype);
                    all.push((format!("cuda {dtype:?}"), Box::new(runner), rule));
                }
                Err(err) if err.means_no_gpu() => eprintln!("skipping the CUDA runner: no GPU ({err})"),
                Err(err) => panic!("the GPU is there but could not be opened: {err}"),
            }
        }
    }
    all
}

/// The plan of a greedy step with `num_top` top logprobs.
fn greedy_plan(num_top: u32) -> SamplePlan {
    let params = SamplingParams { temperature: 0.0, logprobs: Some(num_top), ..SamplingParams::default() };
    RequestSampler::new(&params, &[], 0).expect("valid params").plan(&[])
}

fn executed(runner: &mut dyn ModelRunner, input: &ModelInput, rows: &[RowRequest<'_>]) -> Vec<TokenLogprobs> {
    let out = runner.execute(input, rows).expect("execute");
    assert_eq!(out.len(), rows.len(), "one result per row");
    out.into_iter().enumerate().map(|(i, r)| r.unwrap_or_else(|| panic!("row {i}: no token"))).collect()
}

/// What a fixture's run must give, case by case: HF's reference outputs, or a CPU run's.
struct Case {
    prompt: Vec<u32>,
    /// The token fed back after each greedy step: HF's greedy tokens, so that every backend and
    /// every reference decode the same sequence.
    fed: Vec<u32>,
    /// The teacher-forced logprob of each prompt token after the first.
    prompt_logprobs: Vec<f64>,
    steps: Vec<Step>,
}

/// One greedy step of a [`Case`].
struct Step {
    token: u32,
    logprob: f64,
    /// Top-1 minus top-2 logprob.
    margin: f64,
    /// HF's bf16 token where it leaves its f32 one (a MoE router near a tie).
    bf16_argmax: Option<u32>,
}

/// The cases of a fixture's `reference.json`.
fn hf_cases(reference: &Value) -> Vec<Case> {
    let cases = reference["cases"].as_array().expect("cases");
    let case = |case: &Value| {
        let fed = ids(&case["greedy_ids"]);
        let steps = fed
            .iter()
            .zip(case["steps"].as_array().expect("steps"))
            .map(|(&token, step)| Step {
                token,
                logprob: step["top5"][0][1].as_f64().expect("top1 logprob"),
                margin: step["margin"].as_f64().expect("margin"),
                bf16_argmax: step.get("bf16_argmax").map(|v| v.as_u64().expect("bf16_argmax") as u32),
            })
            .collect();
        let lps = case["prompt_logprobs"].as_array().expect("lp")[1..].iter().map(|v| v.as_f64().expect("f")).collect();
        Case { prompt: ids(&case["prompt_ids"]), fed, prompt_logprobs: lps, steps }
    };
    cases.iter().map(case).collect()
}

/// A case run on `runner`: the prompt read in chunks of 7 tokens, every row's logprob of the
/// next prompt token; then greedy steps (the top `num_top` logprobs each), teacher-forced on
/// `case.fed`. Returns the prompt logprobs and each step's result.
fn run_case(runner: &mut dyn ModelRunner, case: &Case, num_top: u32) -> (Vec<f64>, Vec<TokenLogprobs>) {
    let (prompt, fed) = (&case.prompt, &case.fed);
    let num_blocks = (prompt.len() + fed.len()).div_ceil(BLOCK_SIZE);
    let pool = 2 * num_blocks + 3;
    let table = block_table(num_blocks, pool);
    runner.allocate_kv_cache(&[pool], BLOCK_SIZE).expect("kv cache");
    let mut prompt_logprobs = Vec::new();
    let mut start = 0;
    while start < prompt.len() {
        let end = (start + 7).min(prompt.len());
        let mut input = ModelInput::default();
        input.push_request(&prompt[start..end], start, &table, BLOCK_SIZE, true, true);
        let rows: Vec<RowRequest> = (start..end)
            .map(|pos| RowRequest::Logprobs { token: prompt.get(pos + 1).copied().unwrap_or(0), num_top: 0 })
            .collect();
        let results = executed(runner, &input, &rows);
        // The last prompt token has no next one to score.
        let scored = (start..end).filter(|pos| pos + 1 < prompt.len());
        prompt_logprobs.extend(scored.zip(&results).map(|(_, r)| f64::from(r.logprob)));
        start = end;
    }

    runner.allocate_kv_cache(&[pool], BLOCK_SIZE).expect("kv cache");
    let plan = greedy_plan(num_top);
    let mut input = ModelInput::default();
    input.push_request(prompt, 0, &table, BLOCK_SIZE, true, false);
    let mut steps = Vec::new();
    for (step, &token) in fed.iter().enumerate() {
        let result = executed(runner, &input, &[RowRequest::Sample(&plan)]);
        steps.push(result.into_iter().next().expect("one row"));
        input = ModelInput::default();
        input.push_request(&[token], prompt.len() + step, &table, BLOCK_SIZE, true, false);
    }
    (prompt_logprobs, steps)
}

/// `hf`'s cases as `runner` computes them: its logprobs, greedy tokens and margins, HF's bf16
/// tokens kept.
fn cases_on(runner: &mut dyn ModelRunner, hf: &[Case]) -> Vec<Case> {
    let case = |case: &Case| {
        let (prompt_logprobs, results) = run_case(runner, case, 2);
        let steps = results
            .iter()
            .zip(&case.steps)
            .map(|(r, hf)| Step {
                token: r.token,
                logprob: f64::from(r.logprob),
                margin: f64::from(r.top_logprobs[0].1 - r.top_logprobs[1].1),
                bf16_argmax: hf.bf16_argmax,
            })
            .collect();
        Case { prompt: case.prompt.clone(), fed: case.fed.clone(), prompt_logprobs, steps }
    };
    hf.iter().map(case).collect()
}

fn check_fixture(name: &str) {
    let dir = fixture(name);
    let hf = hf_cases(&reference(name));
    // Where the GPU quantizes the inputs of FP8 projections (bf16 and f16, beyond its GEMV's
    // rows), the reference is the CPU quantizing them the same way; else HF's.
    let fp8 = ModelConfig::from_dir(&dir).expect("config").quantization.is_some();
    let mut quantized_inputs: Option<(Vec<Case>, Bf16Bounds)> = None;
    for (backend, mut runner, rule) in backends(&dir) {
        let what = format!("{name} on {backend}");
        let (want, bounds) = match rule {
            Rule::Bf16 if fp8 => {
                let (cases, bounds) = quantized_inputs.get_or_insert_with(|| {
                    let mut cpu = CpuRunner::new(load_model_with(&dir, Cpu::with_fp8_inputs(Fp8Inputs::GPU)));
                    let cases = cases_on(&mut cpu, &hf);
                    let pairs = || hf.iter().zip(&cases);
                    let scored = pairs()
                        .flat_map(|(a, b)| a.prompt_logprobs.iter().copied().zip(b.prompt_logprobs.iter().copied()));
                    let step = |s: &Step| (s.logprob, s.margin, s.token);
                    let steps =
                        pairs().flat_map(|(a, b)| a.steps.iter().zip(&b.steps).map(move |(a, b)| (step(a), step(b))));
                    let effect = QuantizationEffect::of(scored, steps);
                    eprintln!("{name}: quantizing the FP8 inputs on the CPU: {effect:?}");
                    (cases, BF16.widened_by(effect))
                });
                (&*cases, *bounds)
            }
            _ => (&hf, BF16),
        };
        let (mut errors, mut max_err, mut flips) = (Vec::new(), 0.0f64, Vec::new());
        // The quantization's signature: steps where the quantizing CPU leaves HF's token, both
        // margins above BF16_MARGIN, which a GPU that quantized nothing would not leave.
        let (mut signature, mut followed) = (0usize, 0usize);
        for (case_idx, case) in want.iter().enumerate() {
            let (prompt_logprobs, results) = run_case(runner.as_mut(), case, 0);
            for (pos, (&got, &want)) in prompt_logprobs.iter().zip(&case.prompt_logprobs).enumerate() {
                assert!(got.is_finite(), "{what} case {case_idx} prompt logprob {pos}: {got}");
                let err = (got - want).abs();
                errors.push(err);
                max_err = max_err.max(err);
            }
            for (step, (r, want)) in results.iter().zip(&case.steps).enumerate() {
                let (token, logprob) = (r.token, f64::from(r.logprob));
                let hf_step = &hf[case_idx].steps[step];
                if hf_step.token != want.token && hf_step.margin > BF16_MARGIN && want.margin > BF16_MARGIN {
                    signature += 1;
                    followed += usize::from(token == want.token);
                }
                let (want_id, margin, want_lp) = (want.token, want.margin, want.logprob);
                match rule {
                    Rule::Close(_) => {
                        assert_eq!(token, want_id, "{what} case {case_idx} step {step}: greedy token (margin {margin})")
                    }
                    // Every differing token is reported before the test fails.
                    Rule::Bf16 => match want.bf16_argmax {
                        Some(hf) if hf != want_id && token != want_id && token != hf => flips.push(format!(
                            "case {case_idx} step {step}: greedy token {token}, neither the reference's {want_id} \
                             nor HF's bf16 {hf}"
                        )),
                        Some(hf) if hf != want_id => {}
                        _ if margin > bounds.margin && token != want_id => flips.push(format!(
                            "case {case_idx} step {step}: greedy token {token}, not {want_id} (margin {margin:.3}, \
                             logprob {logprob:.3} against {want_lp:.3})"
                        )),
                        _ => {}
                    },
                }
                if token == want_id {
                    let err = (logprob - want_lp).abs();
                    errors.push(err);
                    max_err = max_err.max(err);
                }
            }
        }
        let mean = errors.iter().sum::<f64>() / errors.len().max(1) as f64;
        let against = if std::ptr::eq(want, &hf) { "HF" } else { "the CPU quantizing FP8 inputs as the GPU" };
        eprintln!(
            "{what}: {} logprobs against {against}'s, max abs error {max_err:.2e}, mean {mean:.2e} ({bounds:?})",
            errors.len()
        );
        assert!(flips.is_empty(), "{what}: {} greedy tokens differ:\n{}", flips.len(), flips.join("\n"));
        if signature > 0 {
            eprintln!("{what}: takes the quantizing CPU's token at {followed} of its {signature} departures from HF's");
            assert!(2 * followed >= signature, "{what}: does not quantize as the CPU does ({followed} of {signature})");
        }
        match rule {
            Rule::Close(tol) => assert!(max_err < tol, "{what}: max logprob error {max_err} over {tol}"),
            Rule::Bf16 => assert!(mean <= bounds.mean, "{what}: mean logprob error {mean} over {}", bounds.mean),
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

/// One token of [`decode`].
#[derive(Clone, Copy, Debug, PartialEq)]
struct Decoded {
    token: u32,
    logprob: f32,
    /// Top-1 minus top-2 logprob.
    margin: f32,
}

/// Greedy tokens of `prompts`, decoded `steps` tokens each, in one shared batch (`together`) or
/// one by one, and the margin (top-1 minus top-2 logprob) of each step when run alone.
fn greedy_batch(
    runner: &mut dyn ModelRunner,
    prompts: &[Vec<u32>],
    steps: usize,
    together: bool,
) -> Vec<Vec<(u32, f64)>> {
    let blocks_each = (prompts.iter().map(Vec::len).max().unwrap_or(0) + steps).div_ceil(BLOCK_SIZE);
    let tables: Vec<Vec<u32>> =
        (0..prompts.len()).map(|i| (0..blocks_each).map(|b| (b * prompts.len() + i) as u32).rev().collect()).collect();
    let pool = blocks_each * prompts.len();
    let groups: Vec<Vec<usize>> =
        if together { vec![(0..prompts.len()).collect()] } else { (0..prompts.len()).map(|i| vec![i]).collect() };
    let mut out = vec![Vec::new(); prompts.len()];
    for group in groups {
        runner.allocate_kv_cache(&[pool], BLOCK_SIZE).expect("kv cache");
        let mut next: Vec<u32> = Vec::new();
        for step in 0..=steps {
            let mut input = ModelInput::default();
            for (j, &i) in group.iter().enumerate() {
                if step == 0 {
                    input.push_request(&prompts[i], 0, &tables[i], BLOCK_SIZE, true, false);
                } else {
                    input.push_request(&[next[j]], prompts[i].len() + step - 1, &tables[i], BLOCK_SIZE, true, false);
                }
            }
            if step == steps {
                break;
            }
            // Alone: with the top two logprobs, for the margins; together: the token only.
            let plan = greedy_plan(if together { 0 } else { 2 });
            let results = executed(runner, &input, &vec![RowRequest::Sample(&plan); group.len()]);
            next.clear();
            for (j, &i) in group.iter().enumerate() {
                let r = &results[j];
                let margin = match r.top_logprobs[..] {
                    [(_, a), (_, b)] => f64::from(a) - f64::from(b),
                    _ => f64::NAN,
                };
                let token = r.token;
                next.push(token);
                out[i].push((token, margin));
            }
        }
    }
    out
}

/// Greedy decoding of `prompts`, request `i` to `lens[i]` tokens, each step's batch holding the
/// requests still going. With `ahead`, each step is launched before the one before it is
/// collected and takes its tokens from that step's sampled rows on the device
/// (`ModelInput::previous_tokens`); otherwise each step is collected before the next is built.
/// Per request: each token with its logprob and its margin (top-1 minus top-2 logprob).
fn decode(runner: &mut dyn ModelRunner, prompts: &[Vec<u32>], lens: &[usize], ahead: bool) -> Vec<Vec<Decoded>> {
    let n = prompts.len();
    let blocks_each =
        (prompts.iter().map(Vec::len).max().unwrap_or(0) + lens.iter().max().unwrap_or(&0)).div_ceil(BLOCK_SIZE);
    let tables: Vec<Vec<u32>> = (0..n).map(|i| (0..blocks_each).map(|b| (b * n + i) as u32).collect()).collect();
    runner.allocate_kv_cache(&[blocks_each * n], BLOCK_SIZE).expect("kv cache");
    let plan = greedy_plan(2);
    let rows = |k: usize| vec![RowRequest::Sample(&plan); k];
    let mut out: Vec<Vec<Decoded>> = vec![Vec::new(); n];
    let record = |runner: &mut dyn ModelRunner, in_flight: &[usize], out: &mut Vec<Vec<Decoded>>| {
        let answers = runner.collect().expect("collect");
        assert_eq!(answers.len(), in_flight.len());
        for (&i, a) in in_flight.iter().zip(answers) {
            let a = a.expect("a token");
            let margin = a.top_logprobs[0].1 - a.top_logprobs[1].1;
            out[i].push(Decoded { token: a.token, logprob: a.logprob, margin });
        }
    };
    let mut input = ModelInput::default();
    for i in 0..n {
        input.push_request(&prompts[i], 0, &tables[i], BLOCK_SIZE, true, false);
    }
    runner.launch(&input, &rows(n)).expect("launch");
    // Tokens sampled per request, the step in flight's included.
    let mut count = vec![1usize; n];
    let mut in_flight: Vec<usize> = (0..n).collect();
    loop {
        let next: Vec<usize> = in_flight.iter().copied().filter(|&i| count[i] < lens[i]).collect();
        let mut input = ModelInput::default();
        if ahead && !next.is_empty() {
            for (j, &i) in next.iter().enumerate() {
                input.push_request(&[u32::MAX], prompts[i].len() + count[i] - 1, &tables[i], BLOCK_SIZE, true, false);
                let row = in_flight.iter().position(|&r| r == i).expect("in flight") as u32;
                input.previous_tokens.push((j as u32, row));
            }
            runner.launch(&input, &rows(next.len())).expect("launch ahead");
            record(runner, &in_flight, &mut out);
        } else {
            record(runner, &in_flight, &mut out);
            if next.is_empty() {
                break;
            }
            for &i in &next {
                let last = out[i].last().expect("a token").token;
                input.push_request(&[last], prompts[i].len() + count[i] - 1, &tables[i], BLOCK_SIZE, true, false);
            }
            runner.launch(&input, &rows(next.len())).expect("launch");
        }
        for &i in &next {
            count[i] += 1;
        }
        in_flight = next;
    }
    out
}

/// Steps launched ahead, their tokens taken from the step before on the device, give the very
/// tokens and logprobs of steps run one at a time on the same backend, while requests leave the
/// batch at different steps (so a step's rows are not the rows of the step before).
#[test]
fn steps_launched_ahead_equal_steps_run_one_at_a_time() {
    let dir = repo_path("models/ferrolm-demo-py");
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|i| (0..4 + 3 * i).map(|j| 1 + (i * 131 + j * 17) % 500).collect()).collect();
    let lens: Vec<usize> = (0..6).map(|i| 3 + (i * 7) % 20).collect();
    for (backend, mut runner, _) in backends(&dir) {
        let one_at_a_time = decode(runner.as_mut(), &prompts, &lens, false);
        let ahead = decode(runner.as_mut(), &prompts, &lens, true);
        for (i, (a, b)) in ahead.iter().zip(&one_at_a_time).enumerate() {
            assert_eq!(a.len(), lens[i]);
            assert_eq!(a, b, "{backend}: request {i}");
        }
    }
}

/// 64 requests of mixed lengths decoded together give the tokens each gives alone (on bf16,
/// up to the first step whose margin alone is within 0.1, where rounding may flip the choice).
/// The bundled demo model is trained, so its choices mostly have clear margins.
#[test]
fn sixty_four_requests_together_equal_each_alone() {
    let dir = repo_path("models/ferrolm-demo-py");
    let vocab = load_model(&dir).config.vocab_size as u64;
    let prompts: Vec<Vec<u32>> = (0..64u64)
        .map(|i| (0..3 + (i * 7) % 37).map(|j| ((i * 1_000_003 + j * 7919) % (vocab - 1) + 1) as u32).collect())
        .collect();
    let steps = 6;
    for (backend, mut runner, rule) in backends(&dir) {
        let alone = greedy_batch(runner.as_mut(), &prompts, steps, false);
        let together = greedy_batch(runner.as_mut(), &prompts, steps, true);
        let mut compared = 0;
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            for (step, (&(want, margin), &(got, _))) in a.iter().zip(t).enumerate() {
                if matches!(rule, Rule::Bf16) && margin <= BF16_MARGIN {
                    break;
                }
                assert_eq!(got, want, "{backend}: request {i} step {step} (margin alone {margin})");
                compared += 1;
            }
        }
        eprintln!("{backend}: {compared} of {} tokens compared", 64 * steps);
        assert!(compared >= 64 * steps / 2, "{backend}: too few tokens with a clear margin ({compared})");
    }
}

/// A decode step replayed from a captured CUDA graph computes what the same step computes
/// eagerly: batches of several sizes (so several buckets, padding included) and growing contexts
/// (so wider block tables and recaptures), in f32 and bf16. The graph runs the padded batch, so
/// GEMM shapes and the attention split can differ from the eager step: results agree within the
/// dtype's rule, not bit for bit. Both runs feed the eager run's greedy tokens.
#[cfg(feature = "cuda")]
#[test]
fn cuda_graph_decode_steps_equal_eager_steps() {
    use ferrolm_backend::cuda::Gpu;
    use ferrolm_backend::DType;
    let dir = repo_path("models/ferrolm-demo-py");
    for (dtype, rule) in [(DType::F32, Rule::Close(1e-3)), (DType::BF16, Rule::Bf16)] {
        // Per run, per row: the greedy token and the top logprobs.
        let mut runs: Vec<Vec<(u32, Vec<f64>)>> = Vec::new();
        let mut fed: Vec<u32> = Vec::new();
        for graphs in [false, true] {
            let gpu = match Gpu::new(0, &Default::default()) {
                Ok(gpu) => gpu,
                Err(err) if err.means_no_gpu() => return eprintln!("skipping: no GPU ({err})"),
                Err(err) => panic!("the GPU is there but could not be opened: {err}"),
            };
            let mut runner = load_cuda(&dir, gpu, dtype);
            runner.set_cuda_graphs(graphs);
            let mut rows = Vec::new();
            let mut next_fed = 0;
            for n in [1usize, 3, 17] {
                let prompts: Vec<Vec<u32>> =
                    (0..n as u32).map(|i| (0..5 + 3 * i).map(|j| 1 + (i * 131 + j * 17) % 500).collect()).collect();
                let steps = 40;
                let blocks_each = (5 + 3 * n + steps).div_ceil(BLOCK_SIZE);
                runner.allocate_kv_cache(&[blocks_each * n + 1], BLOCK_SIZE).expect("kv cache");
                let tables: Vec<Vec<u32>> =
                    (0..n).map(|i| (0..blocks_each).map(|b| (1 + b * n + i) as u32).collect()).collect();
                let mut input = ModelInput::default();
                for (i, p) in prompts.iter().enumerate() {
                    input.push_request(p, 0, &tables[i], BLOCK_SIZE, true, false);
                }
                // The top logprobs of each row (as many as a row request returns), highest first.
                let top = RowRequest::Logprobs { token: 0, num_top: ferrolm_sampling::MAX_LOGPROBS as usize };
                let mut logits = executed(&mut runner, &input, &vec![top; n]);
                for step in 0..steps {
                    let mut input = ModelInput::default();
                    for (i, p) in prompts.iter().enumerate() {
                        let lp: Vec<f64> = logits[i].top_logprobs.iter().map(|&(_, l)| f64::from(l)).collect();
                        let token = if graphs {
                            next_fed += 1;
                            fed[next_fed - 1]
                        } else {
                            fed.push(logits[i].top_logprobs[0].0);
                            *fed.last().expect("pushed")
                        };
                        rows.push((logits[i].top_logprobs[0].0, lp));
                        input.push_request(&[token], p.len() + step, &tables[i], BLOCK_SIZE, true, false);
                    }
                    logits = executed(&mut runner, &input, &vec![top; n]);
                }
            }
            runs.push(rows);
        }
        assert_eq!(runs[0].len(), runs[1].len());
        let (mut max_err, mut sum_err, mut count) = (0.0f64, 0.0f64, 0usize);
        for (i, ((eager_best, eager), (graph_best, graph))) in runs[0].iter().zip(&runs[1]).enumerate() {
            if matches!(rule, Rule::Close(_)) || eager[0] - eager[1] > BF16_MARGIN {
                assert_eq!(graph_best, eager_best, "{dtype:?}: row {i}: greedy token eager vs graph");
            }
            // Highest first on both sides, so near ties that swap places still line up.
            for (g, e) in graph.iter().zip(eager) {
                let err = (g - e).abs();
                max_err = max_err.max(err);
                sum_err += err;
                count += 1;
            }
        }
        let mean = sum_err / count as f64;
        eprintln!(
            "{dtype:?}: {} decode rows, eager vs graph max abs error {max_err:.2e}, mean {mean:.2e}",
            runs[0].len()
        );
        match rule {
            Rule::Close(tol) => assert!(max_err < tol, "{dtype:?}: eager vs graph error {max_err}"),
            Rule::Bf16 => assert!(mean <= BF16_MEAN_ERR, "{dtype:?}: eager vs graph mean error {mean}"),
        }
    }
}

/// Greedy decoding of 6 requests that join one per step, each to 8 tokens: every step holds the
/// decodes of the requests already in (first, as the scheduler orders them) and the prompt of
/// the one joining, so every step but the first is a mixed step. With `ahead`, each step is
/// launched before the one before it is collected and its decodes take their tokens from that
/// step's rows on the device. Per request: each token, its logprob and its margin (top-1 minus
/// top-2 logprob).
fn staggered(runner: &mut dyn ModelRunner, ahead: bool) -> Vec<Vec<(u32, f64, f64)>> {
    let (n, len) = (6usize, 8usize);
    let prompts: Vec<Vec<u32>> =
        (0..n as u32).map(|i| (0..5 + 3 * i).map(|j| 1 + (i * 131 + j * 17) % 500).collect()).collect();
    let blocks_each = (5 + 3 * n + len).div_ceil(BLOCK_SIZE);
    let tables: Vec<Vec<u32>> = (0..n).map(|i| (0..blocks_each).map(|b| (b * n + i) as u32).collect()).collect();
    runner.allocate_kv_cache(&[blocks_each * n], BLOCK_SIZE).expect("kv cache");
    let plan = greedy_plan(2);
    let mut out: Vec<Vec<(u32, f64, f64)>> = vec![Vec::new(); n];
    let record = |runner: &mut dyn ModelRunner, in_flight: &[usize], out: &mut Vec<Vec<(u32, f64, f64)>>| {
        let answers = runner.collect().expect("collect");
        assert_eq!(answers.len(), in_flight.len());
        for (&i, a) in in_flight.iter().zip(answers) {
            let a = a.expect("a token");
            let margin = f64::from(a.top_logprobs[0].1) - f64::from(a.top_logprobs[1].1);
            out[i].push((a.token, f64::from(a.logprob), margin));
        }
    };
    // Tokens sampled per request, the step in flight's included, and the requests of that step's rows.
    let mut count = vec![0usize; n];
    let mut in_flight: Vec<usize> = Vec::new();
    for step in 0.. {
        let decoding: Vec<usize> = (0..n.min(step)).filter(|&i| count[i] < len).collect();
        if decoding.is_empty() && step >= n {
            break;
        }
        let device_tokens = ahead && !decoding.is_empty();
        if !device_tokens && !in_flight.is_empty() {
            record(runner, &in_flight, &mut out);
            in_flight.clear();
        }
        let mut input = ModelInput::default();
        for (t, &i) in decoding.iter().enumerate() {
            let position = prompts[i].len() + count[i] - 1;
            if device_tokens {
                input.push_request(&[u32::MAX], position, &tables[i], BLOCK_SIZE, true, false);
                let row = in_flight.iter().position(|&r| r == i).expect("sampled in the step before");
                input.previous_tokens.push((t as u32, row as u32));
            } else {
                let last = out[i].last().expect("a token").0;
                input.push_request(&[last], position, &tables[i], BLOCK_SIZE, true, false);
            }
        }
        let mut rows_for = decoding;
        if step < n {
            input.push_request(&prompts[step], 0, &tables[step], BLOCK_SIZE, true, false);
            rows_for.push(step);
        }
        runner.launch(&input, &vec![RowRequest::Sample(&plan); rows_for.len()]).expect("launch");
        if !in_flight.is_empty() {
            record(runner, &in_flight, &mut out);
        }
        for &i in &rows_for {
            count[i] += 1;
        }
        in_flight = rows_for;
    }
    if !in_flight.is_empty() {
        record(runner, &in_flight, &mut out);
    }
    out
}

/// Requests that join one per step, so that steps mix decodes and a prompt, give the same
/// tokens launched ahead as one step at a time, on every backend.
#[test]
fn mixed_steps_launched_ahead_equal_steps_run_one_at_a_time() {
    for (backend, mut runner, _) in backends(&repo_path("models/ferrolm-demo-py")) {
        let one_at_a_time = staggered(runner.as_mut(), false);
        let ahead = staggered(runner.as_mut(), true);
        assert!(one_at_a_time.iter().all(|r| r.len() == 8), "{backend}: 8 tokens each");
        assert_eq!(ahead, one_at_a_time, "{backend}");
    }
}

/// The token mask a grammar could give request `i` at `step`, knowing the token `known` it
/// sampled at the step before the last (the last one may still be in flight: a step is launched
/// ahead of the one before it being collected): about one id in eight, or, at every fourth
/// step, one id alone (a forced token). `words` may be fewer than the vocabulary needs.
fn grammar_mask(vocab: usize, words: usize, i: usize, step: usize, known: u32) -> Vec<u32> {
    let mut mask = vec![0u32; words];
    let covered = vocab.min(32 * words) as u32;
    let seed = (i as u64) << 48 ^ (step as u64) << 32 ^ u64::from(known);
    let hash = |t: u32| (seed ^ u64::from(t)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    if step % 4 == 3 {
        allow(&mut mask, (hash(covered) % u64::from(covered)) as u32);
    } else {
        (0..covered).filter(|&t| hash(t) % 8 == 0).for_each(|t| allow(&mut mask, t));
    }
    mask
}

/// Greedy decoding of 5 requests for 12 steps, requests 0, 1 and 3 constrained by
/// `grammar_mask` (masked rows) but at every fifth step, 2 and 4 never; at odd steps the masks
/// are shorter than the vocabulary (the last quarter of the ids disallowed). Each token is
/// checked against its mask. With `ahead`, every step after the first is launched once the
/// step before has its masks and before it is collected, and takes its tokens from that step's
/// rows on the device; otherwise each step runs alone (`execute_masked`, or `execute` without
/// masked rows). Per request: each token and its logprob.
fn constrained(runner: &mut dyn ModelRunner, ahead: bool) -> Vec<Vec<(u32, f32)>> {
    let (n, steps) = (5usize, 12usize);
    let vocab = runner.config().output_vocab_size;
    let prompts: Vec<Vec<u32>> =
        (0..n as u32).map(|i| (0..4 + 3 * i).map(|j| 1 + (i * 131 + j * 17) % 500).collect()).collect();
    let blocks_each = (4 + 3 * n + steps).div_ceil(BLOCK_SIZE);
    let tables: Vec<Vec<u32>> = (0..n).map(|i| (0..blocks_each).map(|b| (b * n + i) as u32).collect()).collect();
    runner.allocate_kv_cache(&[blocks_each * n], BLOCK_SIZE).expect("kv cache");
    let greedy = greedy_plan(1);
    let masked = SamplePlan { masked: true, ..greedy.clone() };
    let is_masked = |i: usize, step: usize| [0, 1, 3].contains(&i) && step % 5 != 4;
    let rows = |step: usize| -> Vec<RowRequest<'_>> {
        (0..n).map(|i| RowRequest::Sample(if is_masked(i, step) { &masked } else { &greedy })).collect()
    };
    // The step's masks from the tokens sampled two steps before (0 before the second step).
    let masks_for = |step: usize, out: &[Vec<(u32, f32)>]| -> TokenMasks {
        let full = TokenMasks::words_for(vocab);
        let words = if step % 2 == 1 { full - full / 4 } else { full };
        let mut masks = TokenMasks { words, data: Vec::new() };
        for i in (0..n).filter(|&i| is_masked(i, step)) {
            let known = if step >= 2 { out[i][step - 2].0 } else { 0 };
            masks.data.extend(grammar_mask(vocab, words, i, step, known));
        }
        masks
    };
    // With `last`, the tokens from the host; without, from the step before on the device.
    let input = |step: usize, last: Option<&[u32]>| -> ModelInput {
        let mut input = ModelInput::default();
        for (i, prompt) in prompts.iter().enumerate() {
            if step == 0 {
                input.push_request(prompt, 0, &tables[i], BLOCK_SIZE, true, false);
                continue;
            }
            let position = prompt.len() + step - 1;
            match last {
                Some(last) => input.push_request(&last[i..=i], position, &tables[i], BLOCK_SIZE, true, false),
                None => {
                    input.push_request(&[u32::MAX], position, &tables[i], BLOCK_SIZE, true, false);
                    input.previous_tokens.push((i as u32, i as u32));
                }
            }
        }
        input
    };
    let mut out: Vec<Vec<(u32, f32)>> = vec![Vec::new(); n];
    let mut step_masks = Vec::new();
    let record = |step: usize, answers: Vec<Option<TokenLogprobs>>, masks: &TokenMasks, out: &mut Vec<Vec<_>>| {
        assert_eq!(answers.len(), n);
        let mut next_mask = 0;
        for (i, a) in answers.into_iter().enumerate() {
            let a = a.unwrap_or_else(|| panic!("request {i} step {step}: no token"));
            if is_masked(i, step) {
                let mask = masks.row(next_mask);
                next_mask += 1;
                assert!(allows(mask, a.token), "request {i} step {step}: token {} is not allowed", a.token);
            }
            out[i].push((a.token, a.logprob));
        }
    };
    for step in 0..steps {
        let has_masks = (0..n).any(|i| is_masked(i, step));
        if !ahead {
            let last: Vec<u32> = out.iter().map(|o| o.last().map_or(0, |t| t.0)).collect();
            let masks = masks_for(step, &out);
            let answers = if has_masks {
                runner.execute_masked(&input(step, Some(&last)), &rows(step), &masks)
            } else {
                runner.execute(&input(step, Some(&last)), &rows(step))
            };
            record(step, answers.expect("execute"), &masks, &mut out);
            continue;
        }
        runner.launch(&input(step, None), &rows(step)).expect("launch");
        let masks = masks_for(step, &out);
        if has_masks {
            runner.set_token_masks(&masks).expect("set_token_masks");
        }
        step_masks.push(masks);
        if step > 0 {
            record(step - 1, runner.collect().expect("collect"), &step_masks[step - 1], &mut out);
        }
    }
    if ahead {
        record(steps - 1, runner.collect().expect("collect"), &step_masks[steps - 1], &mut out);
    }
    out
}

/// Steps with masked rows (structured output) give the same tokens launched ahead as run one at
/// a time, on every backend, and the CUDA runner in f32 gives the CPU runner's tokens and
/// logprobs (within 1e-3).
#[test]
fn masked_steps_give_the_cpu_runners_tokens() {
    let mut cpu: Option<Vec<Vec<(u32, f32)>>> = None;
    for (backend, mut runner, rule) in backends(&repo_path("models/ferrolm-demo-py")) {
        let one_at_a_time = constrained(runner.as_mut(), false);
        let ahead = constrained(runner.as_mut(), true);
        assert_eq!(ahead, one_at_a_time, "{backend}: launched ahead vs one at a time");
        let Some(want) = &cpu else {
            cpu = Some(one_at_a_time);
            continue;
        };
        if matches!(rule, Rule::Bf16) {
            continue; // bf16 logits may flip a close choice
        }
        for (i, (got, want)) in one_at_a_time.iter().zip(want).enumerate() {
            for (step, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g.0, w.0, "{backend}: request {i} step {step}: the CPU runner's token");
                let err = (g.1 - w.1).abs();
                assert!(err < 1e-3, "{backend}: request {i} step {step}: logprob {} vs the CPU's {}", g.1, w.1);
            }
        }
    }
}

/// How far u, top_p and min_p are nudged to call a host choice fragile: well above the CPU/GPU
/// f32 logprob differences (under 1e-3), so a choice that survives the nudges cannot flip.
const FRAGILE: f64 = 5e-3;

/// Whether a nudge of the plan's u, top_p or min_p changes the host's choice for `logits`.
fn fragile(plan: &SamplePlan, logits: &[f32]) -> bool {
    let token = plan.apply(logits).map(|t| t.token);
    let mut nudged = Vec::new();
    for sign in [-1.0, 1.0] {
        nudged.push(SamplePlan { u: (plan.u + sign * FRAGILE).clamp(0.0, 1.0 - 1e-12), ..plan.clone() });
        if plan.top_p < 1.0 {
            let top_p = (f64::from(plan.top_p) * (1.0 + sign * FRAGILE)).min(1.0) as f32;
            nudged.push(SamplePlan { top_p, ..plan.clone() });
        }
        if plan.min_p > 0.0 {
            let min_p = (f64::from(plan.min_p) * (1.0 + sign * FRAGILE)).min(1.0) as f32;
            nudged.push(SamplePlan { min_p, ..plan.clone() });
        }
    }
    nudged.iter().any(|p| p.apply(logits).map(|t| t.token) != token)
}

/// Seeded sampling with temperature, top-p, min-p and penalties (different per request, several
/// requests per step) gives on each backend the tokens of the host sampler applied to the CPU
/// model's logits: exactly on the CPU runner; in GPU f32 (sampled on the device) everywhere
/// except at steps where the host's choice is fragile. Every backend is fed the host's tokens,
/// so one differing draw does not change the steps after it.
#[test]
fn seeded_sampling_gives_the_host_tokens() {
    let dir = repo_path("models/ferrolm-demo-py");
    let model = load_model(&dir);
    let vocab = model.config.vocab_size as u32;
    let n = 8usize;
    let steps = 16usize;
    let prompts: Vec<Vec<u32>> =
        (0..n as u32).map(|i| (0..4 + 5 * i).map(|j| 1 + (i * 7919 + j * 104_729) % (vocab - 1)).collect()).collect();
    let params: Vec<SamplingParams> = (0..n)
        .map(|i| SamplingParams {
            temperature: [0.7, 1.0, 1.3][i % 3],
            top_p: [1.0, 0.9, 0.6][i % 3],
            min_p: [0.0, 0.05][i % 2],
            repetition_penalty: [1.0, 1.2][(i / 2) % 2],
            presence_penalty: [0.0, 0.5][(i / 4) % 2],
            frequency_penalty: [0.0, 0.3][(i / 3) % 2],
            seed: Some(1000 + i as u64),
            logprobs: Some(3),
            ..SamplingParams::default()
        })
        .collect();
    let samplers = || -> Vec<RequestSampler> {
        params.iter().zip(&prompts).map(|(p, prompt)| RequestSampler::new(p, prompt, 0).expect("valid")).collect()
    };
    let blocks_each = (prompts.iter().map(Vec::len).max().unwrap_or(0) + steps).div_ceil(BLOCK_SIZE);
    let tables: Vec<Vec<u32>> = (0..n).map(|i| (0..blocks_each).map(|b| (b * n + i) as u32).collect()).collect();
    let step_input = |step: usize, fed: &[u32]| {
        let mut input = ModelInput::default();
        for (i, p) in prompts.iter().enumerate() {
            if step == 0 {
                input.push_request(p, 0, &tables[i], BLOCK_SIZE, true, false);
            } else {
                input.push_request(&fed[i..=i], p.len() + step - 1, &tables[i], BLOCK_SIZE, true, false);
            }
        }
        input
    };

    // The host: the CPU model's logits, each request's plan applied on the host.
    let mut kv = model.new_kv_cache(blocks_each * n, BLOCK_SIZE);
    let mut host = samplers();
    let mut want: Vec<Vec<(SamplePlan, Vec<f32>, TokenLogprobs)>> = Vec::new();
    let mut fed = vec![0u32; n];
    for step in 0..steps {
        let logits = model.forward(&step_input(step, &fed), &mut kv);
        let mut this_step = Vec::new();
        for (i, sampler) in host.iter_mut().enumerate() {
            let row = logits[i * vocab as usize..(i + 1) * vocab as usize].to_vec();
            let plan = sampler.plan(&[]);
            let out = plan.apply(&row).expect("a token");
            sampler.record(out.token);
            fed[i] = out.token;
            this_step.push((plan, row, out));
        }
        want.push(this_step);
    }

    for (backend, mut runner, rule) in backends(&dir) {
        if matches!(rule, Rule::Bf16) {
            continue; // bf16 logits move probability mass by more than any fragility margin
        }
        runner.allocate_kv_cache(&[blocks_each * n], BLOCK_SIZE).expect("kv cache");
        let mut ours = samplers();
        let (mut compared, mut fragile_misses) = (0, 0);
        for (step, wanted) in want.iter().enumerate() {
            let fed: Vec<u32> = if step == 0 { vec![0; n] } else { want[step - 1].iter().map(|w| w.2.token).collect() };
            let plans: Vec<SamplePlan> = ours.iter_mut().map(|s| s.plan(&[])).collect();
            let rows: Vec<RowRequest> = plans.iter().map(RowRequest::Sample).collect();
            let got = executed(runner.as_mut(), &step_input(step, &fed), &rows);
            for (i, ((plan, row, w), g)) in wanted.iter().zip(&got).enumerate() {
                assert_eq!(&plans[i], plan, "{backend}: request {i} step {step}: the plans agree");
                ours[i].record(w.token);
                if matches!(rule, Rule::Close(tol) if tol <= 1e-4) {
                    assert_eq!(g, w, "{backend}: request {i} step {step}");
                    compared += 1;
                    continue;
                }
                if g.token != w.token {
                    assert!(
                        fragile(plan, row),
                        "{backend}: request {i} step {step}: {} instead of {}",
                        g.token,
                        w.token
                    );
                    fragile_misses += 1;
                    continue;
                }
                compared += 1;
                let err = (f64::from(g.logprob) - f64::from(w.logprob)).abs();
                assert!(err < 1e-3, "{backend}: request {i} step {step}: logprob {} vs {}", g.logprob, w.logprob);
                assert_eq!(g.top_logprobs.len(), 3);
            }
        }
        eprintln!("{backend}: {compared} of {} sampled tokens equal the host's, {fragile_misses} fragile", n * steps);
        assert!(fragile_misses * 20 <= n * steps, "{backend}: too many fragile steps differ ({fragile_misses})");
    }
}

/// FP8 on the GPU gives the tokens of FP8 on the CPU, for an FP8 KV cache (its cache write and
/// attention kernels), weights quantized at load (`--quantization fp8`: the FP8 GEMV, and steps
/// of more rows through the FP8 GEMM) and both: the demo model decoded greedily, steps launched
/// ahead as graphs. In f32, against the exact CPU: every token, logprobs within 0.02, and with
/// an FP8 cache one in 20 of them within 0.02 more than the cache's quantization moves any on
/// the CPU (a value a hair from a midpoint may round to either code: one such step moved a
/// logprob by 0.061 on an H100). In bf16, each request's tokens equal up to its first
/// difference, which must come where the CPU's margin is at most [`BF16_MARGIN`] (a near tie),
/// with a mean logprob difference of at most 0.05 over those tokens and at least a quarter of
/// all tokens agreeing; finite logprobs throughout.
/// Where the weights are FP8, the bf16 run's reference is the CPU quantizing the FP8 products'
/// inputs as the GPU does ([`Fp8Inputs::GPU`]), its bounds widened by what that quantization
/// changes on the CPU ([`Bf16Bounds::widened_by`]).
#[cfg(feature = "cuda")]
#[test]
fn fp8_on_the_gpu_gives_the_cpus_tokens() {
    use ferrolm_backend::cuda::Gpu;
    use ferrolm_backend::{DType, KvCacheDtype};
    use ferrolm_model::config::Quantization;
    let dir = repo_path("models/ferrolm-demo-py");
    let src = WeightSource::open_dir(&dir).expect("weights");
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|i| (0..5 + 9 * i).map(|j| 1 + (i * 131 + j * 17) % 500).collect()).collect();
    let lens: Vec<usize> = (0..6).map(|i| 4 + (i * 5) % 17).collect();
    let variants = [
        ("FP8 KV cache", KvCacheDtype::Fp8, None),
        ("FP8 weights", KvCacheDtype::Auto, Some(Quantization::FP8_AT_LOAD)),
        ("both", KvCacheDtype::Fp8, Some(Quantization::FP8_AT_LOAD)),
    ];
    let mut failures = Vec::new();
    for (variant, kv_cache_dtype, quantization) in variants {
        let config_with = |kv_cache_dtype| {
            let mut config = ModelConfig::from_dir(&dir).expect("config");
            config.kv_cache_dtype = kv_cache_dtype;
            config.quantization = quantization;
            config
        };
        let config = || config_with(kv_cache_dtype);
        let cpu = |inputs, kv_cache_dtype| {
            let model = Model::load(&Cpu::with_fp8_inputs(inputs), config_with(kv_cache_dtype), &src);
            decode(&mut CpuRunner::new(model.expect("model")), &prompts, &lens, false)
        };
        let exact = cpu(Fp8Inputs::Exact, kv_cache_dtype);
        // In f32 the runs differ in rounding only, but a cached value a hair from the midpoint
        // of two e4m3 codes may round to either. A few tokens (one in 20) may then move by more
        // than F32_LOGPROB, as far as the largest move quantizing the whole cache makes on the
        // CPU (a heuristic ceiling: one code's step moves less than every code's rounding, as a
        // rule, not by proof).
        let f32_outlier = if kv_cache_dtype == KvCacheDtype::Fp8 {
            let effect = QuantizationEffect::between(&cpu(Fp8Inputs::Exact, KvCacheDtype::Auto), &exact);
            eprintln!("{variant}: the FP8 cache on the CPU: {effect:?}");
            F32_LOGPROB + effect.largest
        } else {
            F32_LOGPROB
        };
        let demo_bounds = Bf16Bounds { mean: 0.05, margin: BF16_MARGIN };
        let quantized = quantization.is_some().then(|| cpu(Fp8Inputs::GPU, kv_cache_dtype));
        let (bf16_want, bf16_bounds) = match &quantized {
            Some(quantized) => {
                let effect = QuantizationEffect::between(&exact, quantized);
                eprintln!("{variant}: quantizing the FP8 inputs on the CPU: {effect:?}");
                (quantized, demo_bounds.widened_by(effect))
            }
            None => (&exact, demo_bounds),
        };
        for (dtype, want) in [(DType::F32, &exact), (DType::BF16, bf16_want)] {
            let gpu = match Gpu::new(0, &Default::default()) {
                Ok(gpu) => gpu,
                Err(err) if err.means_no_gpu() => {
                    eprintln!("skipping the CUDA runner: no GPU ({err})");
                    return;
                }
                Err(err) => panic!("the GPU is there but could not be opened: {err}"),
            };
            let mut runner = ferrolm_model::cuda::CudaRunner::load(gpu, dtype, config(), &src).expect("upload");
            let got = decode(&mut runner, &prompts, &lens, true);
            let what = format!("{variant} {dtype:?}");
            let (mut agreed, mut diff, mut outliers) = (0usize, 0.0f64, 0usize);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g.len(), lens[i], "{what}: request {i}");
                assert!(g.iter().all(|d| d.logprob.is_finite()), "{what}: request {i}: {g:?}");
                if dtype == DType::F32 {
                    for (step, (g, w)) in g.iter().zip(w).enumerate() {
                        assert_eq!(g.token, w.token, "{what}: request {i} step {step}");
                        let err = f64::from((g.logprob - w.logprob).abs());
                        let (got, want) = (g.logprob, w.logprob);
                        assert!(err <= f32_outlier, "{what}: request {i} step {step}: {got} against {want}");
                        if err > F32_LOGPROB {
                            eprintln!("{what}: request {i} step {step}: {got} against {want}");
                            outliers += 1;
                        }
                    }
                    continue;
                }
                let same = g.iter().zip(w).take_while(|(g, w)| g.token == w.token).count();
                agreed += same;
                diff += g.iter().zip(w).take(same).map(|(g, w)| f64::from((g.logprob - w.logprob).abs())).sum::<f64>();
                if let (Some(g), Some(w)) = (g.get(same), w.get(same)) {
                    let line = format!("{what}: request {i} step {same}: {g:?} against {w:?}");
                    eprintln!("{line}");
                    if f64::from(w.margin) > bf16_bounds.margin {
                        failures.push(line);
                    }
                }
            }
            let total: usize = lens.iter().sum();
            assert!(20 * outliers <= total, "{what}: {outliers} of {total} logprobs beyond {F32_LOGPROB}");
            if dtype == DType::BF16 {
                let mean = diff / agreed.max(1) as f64;
                eprintln!(
                    "{what}: {agreed} of {total} tokens agree, mean logprob difference {mean:.3e} ({bf16_bounds:?})"
                );
                if mean > bf16_bounds.mean {
                    failures.push(format!("{what}: mean logprob difference {mean}"));
                }
                // Not every request may part at once: the exact and the quantizing CPU runs agree
                // on 30 of 65 tokens.
                if 4 * agreed < total {
                    failures.push(format!("{what}: {agreed} of {total} tokens agree"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} differences beyond near ties:\n{}", failures.len(), failures.join("\n"));
}
