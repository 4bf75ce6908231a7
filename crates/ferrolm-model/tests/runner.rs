//! The `ModelRunner` contract on every backend of this build, against the HF reference outputs
//! of the fixture models: the CPU runner always; with the `cuda` feature and a GPU present, the
//! CUDA runner in f32 and in bf16 too (without a GPU those are skipped with a message).
//!
//! Rules per backend: CPU within 1e-4 and GPU f32 within 1e-3 of the reference logprobs with
//! equal greedy tokens; GPU bf16 with mean absolute logprob error at most 0.02 and equal greedy
//! tokens wherever the reference margin exceeds 0.1.

use std::path::{Path, PathBuf};

// Shared with the golden tests; not every helper is used here.
#[allow(dead_code)]
mod common;

use common::{block_table, ids, log_softmax};
use ferrolm_model::{CpuRunner, Model, ModelConfig, ModelInput, ModelRunner, RowLogits, WeightSource};
use serde_json::Value;

const BLOCK_SIZE: usize = 4;

#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Rule {
    /// Every logprob within this much; greedy tokens always equal.
    Close(f64),
    /// Mean absolute logprob error at most 0.02; greedy equal where the margin exceeds 0.1.
    Bf16,
}

const BF16_MEAN_ERR: f64 = 0.02;
const BF16_MARGIN: f64 = 0.1;

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

fn load_model(dir: &Path) -> Model {
    let config = ModelConfig::from_dir(dir).expect("config");
    let src = WeightSource::open_dir(dir).expect("weights");
    Model::load(config, &src).expect("model")
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
        use ferrolm_model::cuda::CudaRunner;
        for (dtype, rule) in [(DType::F32, Rule::Close(1e-3)), (DType::BF16, Rule::Bf16)] {
            match Gpu::new(0) {
                Ok(gpu) => {
                    let runner = CudaRunner::new(&load_model(dir), gpu, dtype).expect("upload");
                    all.push((format!("cuda {dtype:?}"), Box::new(runner), rule));
                }
                Err(err) => eprintln!("skipping the CUDA runner: no GPU ({err})"),
            }
        }
    }
    all
}

/// One full row of logits, as log-softmax in f64.
fn full_row(logits: &ferrolm_model::StepLogits, i: usize) -> Vec<f64> {
    match logits.row(i) {
        RowLogits::Full(row) => log_softmax(row),
        other => panic!("row {i}: expected full logits, got {other:?}"),
    }
}

fn check_fixture(name: &str) {
    let reference = reference(name);
    for (backend, mut runner, rule) in backends(&fixture(name)) {
        let what = format!("{name} on {backend}");
        let (mut errors, mut max_err) = (Vec::new(), 0.0f64);
        for (case_idx, case) in reference["cases"].as_array().expect("cases").iter().enumerate() {
            let prompt = ids(&case["prompt_ids"]);
            let greedy = ids(&case["greedy_ids"]);
            let num_blocks = (prompt.len() + greedy.len()).div_ceil(BLOCK_SIZE);
            let pool = 2 * num_blocks + 3;
            let table = block_table(num_blocks, pool);

            // Teacher-forced prompt logprobs, read in chunks of 7 tokens, every row in full.
            runner.allocate_kv_cache(pool, BLOCK_SIZE).expect("kv cache");
            let want: Vec<f64> =
                case["prompt_logprobs"].as_array().expect("lp")[1..].iter().map(|v| v.as_f64().expect("f")).collect();
            let mut start = 0;
            while start < prompt.len() {
                let end = (start + 7).min(prompt.len());
                let mut input = ModelInput::default();
                input.push_request(&prompt[start..end], start, &table, BLOCK_SIZE, true, true);
                let logits = runner.execute(&input, &vec![false; end - start]).expect("execute");
                for (row, pos) in (start..end).enumerate() {
                    if pos + 1 < prompt.len() {
                        let got = full_row(&logits, row)[prompt[pos + 1] as usize];
                        let err = (got - want[pos]).abs();
                        assert!(got.is_finite(), "{what} case {case_idx} prompt logprob {pos}: {got}");
                        errors.push(err);
                        max_err = max_err.max(err);
                    }
                }
                start = end;
            }

            // Greedy decoding with the argmax picked by the runner, teacher-forced on the
            // reference tokens so that later steps stay comparable.
            runner.allocate_kv_cache(pool, BLOCK_SIZE).expect("kv cache");
            let mut input = ModelInput::default();
            input.push_request(&prompt, 0, &table, BLOCK_SIZE, true, false);
            let mut logits = runner.execute(&input, &[true]).expect("execute");
            for (step, (&want_id, step_ref)) in greedy.iter().zip(case["steps"].as_array().expect("steps")).enumerate()
            {
                let (token, logprob) = match logits.row(0) {
                    RowLogits::Argmax { token: Some(t), logprob } => (t, logprob as f64),
                    RowLogits::Full(row) => {
                        let lp = log_softmax(row);
                        let best = (0..lp.len()).max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a))).expect("row");
                        (best as u32, lp[best])
                    }
                    other => panic!("{what}: no argmax: {other:?}"),
                };
                let margin = step_ref["margin"].as_f64().expect("margin");
                let want_lp = step_ref["top5"][0][1].as_f64().expect("top1 logprob");
                let must_match = match rule {
                    Rule::Close(_) => true,
                    Rule::Bf16 => margin > BF16_MARGIN,
                };
                if must_match {
                    assert_eq!(token, want_id, "{what} case {case_idx} step {step}: greedy token (margin {margin})");
                }
                if token == want_id {
                    let err = (logprob - want_lp).abs();
                    errors.push(err);
                    max_err = max_err.max(err);
                }
                let mut input = ModelInput::default();
                input.push_request(&[want_id], prompt.len() + step, &table, BLOCK_SIZE, true, false);
                logits = runner.execute(&input, &[true]).expect("execute");
            }
        }
        let mean = errors.iter().sum::<f64>() / errors.len().max(1) as f64;
        eprintln!("{what}: {} logprobs, max abs error {max_err:.2e}, mean {mean:.2e}", errors.len());
        match rule {
            Rule::Close(tol) => assert!(max_err < tol, "{what}: max logprob error {max_err} over {tol}"),
            Rule::Bf16 => assert!(mean <= BF16_MEAN_ERR, "{what}: mean logprob error {mean} over {BF16_MEAN_ERR}"),
        }
    }
}

macro_rules! fixture {
    ($($name:ident),*) => {$(
        #[test]
        fn $name() {
            check_fixture(stringify!($name));
        }
    )*};
}

fixture!(llama, llama3_gqa, mistral_swa, qwen2_tied, qwen3_qknorm, phi3_fused, gemma_geglu);

/// Greedy tokens of `prompts`, decoded `steps` tokens each in one shared batch (argmax picked by
/// the runner), and the margin (top-1 minus top-2 logprob) of each step when run alone.
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
        runner.allocate_kv_cache(pool, BLOCK_SIZE).expect("kv cache");
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
            // Alone: full rows, for the margins; together: the runner's own argmax.
            let logits = runner.execute(&input, &vec![together; group.len()]).expect("execute");
            next.clear();
            for (j, &i) in group.iter().enumerate() {
                let (token, margin) = match logits.row(j) {
                    RowLogits::Argmax { token: Some(t), .. } => (t, f64::NAN),
                    RowLogits::Full(row) => {
                        let lp = log_softmax(row);
                        let mut order: Vec<usize> = (0..lp.len()).collect();
                        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
                        (order[0] as u32, lp[order[0]] - lp[order[1]])
                    }
                    other => panic!("no argmax: {other:?}"),
                };
                next.push(token);
                out[i].push((token, margin));
            }
        }
    }
    out
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

#[cfg(feature = "cuda")]
#[test]
fn cuda_graph_decode_steps_equal_eager_steps() {
    use ferrolm_backend::cuda::Gpu;
    use ferrolm_backend::DType;
    use ferrolm_model::cuda::CudaRunner;
    let dir = repo_path("models/ferrolm-demo-py");
    for (dtype, rule) in [(DType::F32, Rule::Close(1e-3)), (DType::BF16, Rule::Bf16)] {
        let mut runs: Vec<Vec<Vec<f64>>> = Vec::new();
        let mut fed: Vec<u32> = Vec::new();
        for graphs in [false, true] {
            let gpu = match Gpu::new(0) {
                Ok(gpu) => gpu,
                Err(err) => return eprintln!("skipping: no GPU ({err})"),
            };
            let mut runner = CudaRunner::new(&load_model(&dir), gpu, dtype).expect("upload");
            runner.set_cuda_graphs(graphs);
            let mut rows = Vec::new();
            let mut next_fed = 0;
            for n in [1usize, 3, 17] {
                let prompts: Vec<Vec<u32>> =
                    (0..n as u32).map(|i| (0..5 + 3 * i).map(|j| 1 + (i * 131 + j * 17) % 500).collect()).collect();
                let steps = 40;
                let blocks_each = (5 + 3 * n + steps).div_ceil(BLOCK_SIZE);
                runner.allocate_kv_cache(blocks_each * n + 1, BLOCK_SIZE).expect("kv cache");
                let tables: Vec<Vec<u32>> =
                    (0..n).map(|i| (0..blocks_each).map(|b| (1 + b * n + i) as u32).collect()).collect();
                let mut input = ModelInput::default();
                for (i, p) in prompts.iter().enumerate() {
                    input.push_request(p, 0, &tables[i], BLOCK_SIZE, true, false);
                }
                let mut logits = runner.execute(&input, &vec![false; n]).expect("prefill");
                for step in 0..steps {
                    let mut input = ModelInput::default();
                    for (i, p) in prompts.iter().enumerate() {
                        let lp = full_row(&logits, i);
                        let token = if graphs {
                            next_fed += 1;
                            fed[next_fed - 1]
                        } else {
                            let best = (0..lp.len()).max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a)));
                            fed.push(best.expect("row") as u32);
                            *fed.last().expect("pushed")
                        };
                        rows.push(lp);
                        input.push_request(&[token], p.len() + step, &tables[i], BLOCK_SIZE, true, false);
                    }
                    logits = runner.execute(&input, &vec![false; n]).expect("decode");
                }
            }
            runs.push(rows);
        }
        let (mut max_err, mut sum_err, mut count) = (0.0f64, 0.0f64, 0usize);
        for (i, (eager, graph)) in runs[0].iter().zip(&runs[1]).enumerate() {
            let best =
                |lp: &[f64]| (0..lp.len()).max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a))).expect("row");
            let mut sorted = eager.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if matches!(rule, Rule::Close(_)) || sorted[0] - sorted[1] > BF16_MARGIN {
                assert_eq!(best(graph), best(eager), "{dtype:?}: row {i}: greedy token eager vs graph");
            }
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
