//! The throughput limit of an offline run: the work its requests need whatever the schedule,
//! and the time that work takes at this machine's ceilings, measured in the same run.
//!
//! A run's work has two kinds. The projections and the LM head are matrix products, bound by
//! the GEMM rate (at a step of many rows, reading the weights once per step takes less time
//! than the arithmetic). Decode attention reads each request's K and V once per output token
//! and does little arithmetic per byte: it is bound by memory bandwidth. Two limits follow:
//! - *in sequence*: each step's GEMMs, then its attention, as an engine that runs them one
//!   after another can at best do;
//! - *overlapped*: all arithmetic and all reads at once, each at its ceiling, the physical limit
//!   of the machine for these requests.
//!
//! The GEMM rate is measured on the model's own projections at the engine's largest step
//! (`--max-num-batched-tokens` rows): on a GPU through the backend's GEMMs with the fastest
//! cuBLASLt algorithm for each shape, on the CPU through the CPU backend's `linear`. Where a GPU
//! run's projections take FP8 GEMMs (FP8 weights with a scale per row or per 128 x 128 block),
//! the layers' projections are priced at the FP8 GEMMs' rate, measured on them (one that the FP8 GEMM does not take at
//! its time in the compute dtype, as the engine dequantizes it), and the rest at the compute
//! dtype's (bf16/f16) rate: the attention's arithmetic (its kernels compute in bf16/f16
//! whatever the cache holds), the LM head, and a MoE model's routers and routed experts (placed
//! dequantized).
//!
//! A mixture-of-experts model's tokens multiply with their `top_k` routed experts only (plus
//! the router and any shared expert), and a step reads only the experts its tokens pick. How
//! many that is depends on the routing, which the run does not record: the limit takes the
//! number expected under uniform routing, `E (1 - (1 - k / E)^B)` distinct experts per sparse
//! layer for a step of `B` tokens (exactly `k` at `B = 1`, at most `min(E, B k)`), at the run's
//! mean step (its tokens over its fewest steps). Skewed routing reads fewer experts.

use std::time::Instant;

use anyhow::Result;
use ferrolm_backend::{DType, WeightView};
use ferrolm_model::config::quant::WeightScaling;
use ferrolm_model::config::{ModelConfig, MoeConfig};
use half::{bf16, f16};
use serde_json::{Map, Value};

use super::bandwidth::{Bandwidth, Device};
use super::report::Table;
use crate::loader::GpuArgs;

/// Rows of the CPU's GEMM probe at most (the rate is flat beyond a few hundred rows, and a CPU
/// takes seconds per projection of a 7B model there).
const CPU_PROBE_ROWS: usize = 256;
/// Timed passes over the projections on the CPU, at least; the fastest counts.
const CPU_PROBE_PASSES: usize = 3;
/// Seconds the CPU's timed passes take together, at least: the demo model's pass at a few dozen
/// rows takes about a millisecond, and the rate from the fastest of three such passes on a busy
/// machine came out well below the rate the model then reached, putting a run above its limit.
const CPU_PROBE_SECONDS: f64 = 0.2;
/// Timed passes on the CPU at most, however short each.
const CPU_PROBE_MAX_PASSES: usize = 1000;

/// One request as the run served it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    pub prompt_len: usize,
    pub output_len: usize,
}

/// What the engine allows per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCaps {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

/// The work a run needs, whatever its schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunWork {
    /// Every projection of every token through the model, and the LM head of every row whose
    /// logits are sampled (2 FLOP per multiply-add).
    pub gemm_flops: f64,
    /// The part of `gemm_flops` computed in the compute dtype even where the projections are
    /// FP8: the LM head, and a MoE model's routers and routed experts.
    pub compute_dtype_gemm_flops: f64,
    /// Attention's two products (Q K^T and P V) over each token's causal context.
    pub attention_flops: f64,
    /// K and V read by decode tokens (one pass over the request's context each).
    pub kv_read_bytes: f64,
    /// The weights, read once per step, over the fewest steps the caps allow (of a MoE
    /// model's routed experts, those expected at the mean step: see [`StepWeights`]).
    pub weight_read_bytes: f64,
    /// The fewest steps the caps allow.
    pub min_steps: usize,
    /// Tokens per step at the fewest steps.
    pub mean_step_tokens: f64,
    /// Routed experts read per sparse layer by a step of `mean_step_tokens`, expected under
    /// uniform routing; 0 for a dense model.
    pub experts_per_step: f64,
}

/// What one step reads of a model's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct StepWeights {
    /// Bytes every step reads whatever its tokens route to: attention, dense MLPs, routers,
    /// shared experts, the LM head, an embedding row.
    pub fixed_bytes: f64,
    /// Bytes of one routed expert (gate, up, down) of one sparse layer.
    pub expert_bytes: f64,
    pub sparse_layers: usize,
    /// The routed experts; `None` for a dense model.
    pub moe: Option<MoeConfig>,
}

impl StepWeights {
    /// The routed experts a step of `tokens` tokens reads per sparse layer, expected under
    /// uniform routing (`MoeConfig::expected_distinct_experts`).
    pub fn experts(&self, tokens: f64) -> f64 {
        self.moe.as_ref().map_or(0.0, |m| m.expected_distinct_experts(tokens))
    }

    /// Bytes a step of `tokens` tokens reads.
    pub fn bytes(&self, tokens: f64) -> f64 {
        self.fixed_bytes + self.sparse_layers as f64 * self.experts(tokens) * self.expert_bytes
    }
}

impl RunWork {
    /// The work of `served` on a model of shape `config` whose steps read `weights` and whose
    /// cache holds `kv_bytes_per_token` per token of context. A token's GEMMs are those of the
    /// matrices it multiplies with: a MoE layer's `top_k` routed experts, not all of them.
    pub fn of(
        config: &ModelConfig,
        served: &[Served],
        caps: StepCaps,
        weights: &StepWeights,
        kv_bytes_per_token: usize,
    ) -> RunWork {
        let layers = config.num_hidden_layers as f64;
        let active: usize = (0..config.num_hidden_layers).map(|i| config.layer_active_matrix_elements(i)).sum();
        let flops_per_token = 2.0 * active as f64;
        let head_flops_per_row = 2.0 * (config.output_vocab_size * config.hidden_size) as f64;
        let compute_dtype_elements: usize =
            (0..config.num_hidden_layers).map(|i| layer_compute_dtype_elements(config, i)).sum();
        let compute_dtype_flops_per_token = 2.0 * compute_dtype_elements as f64;
        // Per token of context one layer attends to: Q K^T and P V over every query head.
        let attention_flops_per_pair = 4.0 * config.q_size() as f64;
        // One layer's share of a token's K and V.
        let kv_bytes_per_layer_token = kv_bytes_per_token as f64 / layers.max(1.0);
        let windows = layer_windows(config);

        // Pairs and decode context are summed over the layers, each within its own window.
        let (mut gemm_flops, mut compute_dtype_gemm_flops) = (0.0, 0.0);
        let (mut pairs, mut decode_context) = (0.0, 0.0);
        let (mut tokens, mut request_steps, mut longest) = (0usize, 0usize, 0usize);
        let budget = caps.max_num_batched_tokens.max(1);
        for s in served.iter().filter(|s| s.output_len > 0) {
            // The last output token is sampled, never fed back.
            let fed = s.prompt_len + s.output_len - 1;
            let head_flops = s.output_len as f64 * head_flops_per_row;
            gemm_flops += fed as f64 * flops_per_token + head_flops;
            compute_dtype_gemm_flops += fed as f64 * compute_dtype_flops_per_token + head_flops;
            // Token i (1-based) of the sequence attends over min(i, window) tokens; the decode
            // tokens are those past the prompt.
            for &(window, count) in &windows {
                pairs += count * attended(fed, window);
                decode_context += count * (attended(fed, window) - attended(s.prompt_len, window));
            }
            tokens += fed;
            let steps = s.prompt_len.div_ceil(budget).max(1) + s.output_len - 1;
            request_steps += steps;
            longest = longest.max(steps);
        }
        let min_steps = tokens.div_ceil(budget).max(request_steps.div_ceil(caps.max_num_seqs.max(1))).max(longest);
        let mean_step_tokens = tokens as f64 / min_steps.max(1) as f64;
        RunWork {
            gemm_flops,
            compute_dtype_gemm_flops,
            attention_flops: pairs * attention_flops_per_pair,
            kv_read_bytes: decode_context * kv_bytes_per_layer_token,
            weight_read_bytes: min_steps as f64 * weights.bytes(mean_step_tokens),
            min_steps,
            mean_step_tokens,
            experts_per_step: weights.experts(mean_step_tokens),
        }
    }
}

/// Elements of layer `layer`'s active matrices that stay in the compute dtype where the
/// projections are FP8: a sparse layer's router and the `top_k` routed experts a token takes.
fn layer_compute_dtype_elements(c: &ModelConfig, layer: usize) -> usize {
    match &c.moe {
        Some(m) if m.layer_is_sparse(layer) => {
            m.num_experts_per_tok * m.expert_matrix_elements(c.hidden_size) + m.num_experts * c.hidden_size
        }
        _ => 0,
    }
}

/// Each window the layers attend within (`usize::MAX` for global layers) and how many layers
/// have it.
fn layer_windows(config: &ModelConfig) -> Vec<(usize, f64)> {
    let mut windows: Vec<(usize, f64)> = Vec::new();
    for layer in 0..config.num_hidden_layers {
        let window = config.layer_window(layer).unwrap_or(usize::MAX);
        match windows.iter_mut().find(|(w, _)| *w == window) {
            Some((_, count)) => *count += 1.0,
            None => windows.push((window, 1.0)),
        }
    }
    windows
}

/// Σ_{i=1..=n} min(i, window): the (query, key) pairs of n tokens of causal attention.
fn attended(n: usize, window: usize) -> f64 {
    let full = n.min(window) as f64;
    full * (full + 1.0) / 2.0 + n.saturating_sub(window) as f64 * window as f64
}

/// One layer's projections as `(out, in)`: qkv, o, gate and up, down (together
/// `ModelConfig::layer_matrix_elements` of a dense layer). A MoE model's MLP stands in as one
/// routed expert, each at the full rows (no step gives one expert all of its tokens, so the
/// rate is one the experts' smaller products approach from below), and its shared expert.
fn layer_projections(c: &ModelConfig) -> Vec<(usize, usize)> {
    projections(c, true)
}

/// [`layer_projections`] but a MoE model's routed expert: the projections that are FP8 where the
/// weights are (the device places experts dequantized).
fn fp8_projections(c: &ModelConfig) -> Vec<(usize, usize)> {
    projections(c, false)
}

fn projections(c: &ModelConfig, routed_expert: bool) -> Vec<(usize, usize)> {
    let h = c.hidden_size;
    let mlp = |inter: usize| [(2 * inter, h), (h, inter)];
    let mut all = vec![(c.q_size() + 2 * c.kv_size(), h), (h, c.q_size())];
    match &c.moe {
        Some(m) => {
            if routed_expert {
                all.extend(mlp(m.moe_intermediate_size));
            }
            all.extend(m.shared_expert_intermediate_size.into_iter().flat_map(mlp));
        }
        None => all.extend(mlp(c.intermediate_size)),
    }
    all
}

/// The machine's GEMM rate on a model's projections.
#[derive(Clone, Copy, Debug)]
pub struct GemmRate {
    /// The layers' projections' rate, in the run's weight format.
    pub flops_per_s: f64,
    /// The compute dtype's GEMM rate, for the attention's arithmetic and the GEMMs that stay in
    /// the compute dtype (the same as `flops_per_s` unless the projections run in FP8).
    pub compute_dtype_flops_per_s: f64,
    /// Whether `flops_per_s` is the FP8 GEMMs'.
    pub fp8: bool,
    /// Rows of the products timed.
    pub rows: usize,
}

impl GemmRate {
    pub fn tflops(&self) -> f64 {
        self.flops_per_s / 1e12
    }

    pub fn compute_dtype_tflops(&self) -> f64 {
        self.compute_dtype_flops_per_s / 1e12
    }

    /// The rate's rows of a result table: the FP8 rate and the compute dtype's where the
    /// projections are FP8 (the LM head, experts and attention stay in the compute dtype).
    pub fn add_to(&self, table: &mut Table) {
        let rows = self.rows;
        if self.fp8 {
            table
                .num(&format!("FP8 GEMM rate at {rows} rows (TFLOP/s)"), self.tflops())
                .num(&format!("GEMM rate at {rows} rows, compute dtype (TFLOP/s)"), self.compute_dtype_tflops());
        } else {
            table.num(&format!("GEMM rate at {rows} rows (TFLOP/s)"), self.tflops());
        }
    }

    /// The rate's keys of a result's JSON.
    pub fn insert_into(&self, r: &mut Map<String, Value>) {
        r.insert("gemm_tflops".into(), self.tflops().into());
        r.insert("compute_dtype_gemm_tflops".into(), self.compute_dtype_tflops().into());
        r.insert("gemm_fp8".into(), self.fp8.into());
        r.insert("gemm_probe_rows".into(), self.rows.into());
    }
}

/// Times one layer's projections of `config` at `rows` rows on `device` (`weights` the dtype
/// of the weights: on the GPU also of the activations; on the CPU activations are f32), and on
/// the GPU in FP8 too where the run's projections take FP8 GEMMs (as the run's `switches` say).
pub fn measure_gemm_rate(
    device: Device,
    config: &ModelConfig,
    weights: DType,
    rows: usize,
    switches: Fp8Switches,
) -> Result<GemmRate> {
    let rows = rows.max(1);
    let (seconds, rows) = match device {
        Device::Cpu => {
            let rows = rows.min(CPU_PROBE_ROWS);
            (cpu_projection_seconds(config, weights, rows), rows)
        }
        Device::Cuda => (gpu_projection_seconds(&layer_projections(config), weights, rows)?, rows),
    };
    let flops = |projections: &[(usize, usize)]| {
        2.0 * rows as f64 * projections.iter().map(|&(n, k)| n * k).sum::<usize>() as f64
    };
    let compute_dtype_rate = flops(&layer_projections(config)) / seconds;
    // The FP8 GEMMs take bf16/f16 activations, and weights scaled as the run's are (a projection
    // whose scales they do not take priced in the compute dtype, below).
    let quantized = config.quantization.filter(|_| device == Device::Cuda && weights != DType::F32);
    let (projection_rate, fp8) = match quantized {
        Some(q) => {
            let projections = fp8_projections(config);
            let probe = Fp8Probe { dtype: weights, rows, switches, scaling: q.weights() };
            let (seconds, fp8) = gpu_fp8_projection_seconds(&projections, probe)?;
            (flops(&projections) / seconds, fp8)
        }
        None => (compute_dtype_rate, false),
    };
    Ok(GemmRate { flops_per_s: projection_rate, compute_dtype_flops_per_s: compute_dtype_rate, fp8, rows })
}

/// Values in [-1, 1), spread (zeros multiply faster than data, on some hardware).
fn probe_values(len: usize, seed: usize) -> impl Iterator<Item = f32> {
    (0..len).map(move |i| ((i.wrapping_add(seed).wrapping_mul(2_654_435_761) % 2001) as f32 - 1000.0) * 1e-3)
}

fn cpu_projection_seconds(config: &ModelConfig, weights: DType, rows: usize) -> f64 {
    let projections = layer_projections(config);
    let stored: Vec<Stored> = projections
        .iter()
        .enumerate()
        .map(|(i, &(n, k))| Stored::new(weights, probe_values(n * k, i).collect()))
        .collect();
    let widest_in = projections.iter().map(|&(_, k)| k).max().unwrap_or(0);
    let widest_out = projections.iter().map(|&(n, _)| n).max().unwrap_or(0);
    let x: Vec<f32> = probe_values(rows * widest_in, 7).collect();
    let mut y = vec![0.0f32; rows * widest_out];
    let mut pass = || {
        let start = Instant::now();
        for (w, &(n, k)) in stored.iter().zip(&projections) {
            ferrolm_backend::cpu::linear_gemm(&x[..rows * k], rows, k, w.view(), n, None, &mut y[..rows * n]);
        }
        start.elapsed().as_secs_f64()
    };
    // One untimed pass (page faults, thread start-up), then timed ones until there are enough.
    pass();
    let (mut best, mut passes, mut total) = (f64::INFINITY, 0, 0.0);
    while passes < CPU_PROBE_PASSES || (total < CPU_PROBE_SECONDS && passes < CPU_PROBE_MAX_PASSES) {
        let seconds = pass();
        best = best.min(seconds);
        passes += 1;
        total += seconds;
    }
    std::hint::black_box(&y);
    best
}

/// Host weights in a storage dtype.
enum Stored {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Stored {
    fn new(dtype: DType, values: Vec<f32>) -> Stored {
        match dtype {
            DType::F32 => Stored::F32(values),
            DType::F16 => Stored::F16(values.into_iter().map(f16::from_f32).collect()),
            DType::BF16 => Stored::BF16(values.into_iter().map(bf16::from_f32).collect()),
        }
    }

    fn view(&self) -> WeightView<'_> {
        match self {
            Stored::F32(w) => WeightView::F32(w),
            Stored::F16(w) => WeightView::F16(w),
            Stored::BF16(w) => WeightView::BF16(w),
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_projection_seconds(_projections: &[(usize, usize)], _dtype: DType, _rows: usize) -> Result<f64> {
    anyhow::bail!("this build of ferrolm has no CUDA backend (build with `--features cuda`)")
}

/// The sum over `projections` (`(out, in)`) of the fastest of `cublasGemmEx` and the cuBLASLt
/// candidates (`Gemms::tune`, mean of its timed runs), in seconds.
#[cfg(feature = "cuda")]
fn gpu_projection_seconds(projections: &[(usize, usize)], dtype: DType, rows: usize) -> Result<f64> {
    use anyhow::Context;
    use ferrolm_backend::cuda::{Gemms, Gpu, GpuTensor};

    // `Gemms::tune` times half-precision GEMMs only.
    if dtype == DType::F32 {
        anyhow::bail!("the GPU's GEMM rate is measured in half precision only, and this run computes in float32");
    }
    let gpu = Gpu::new(0, &Default::default()).context("cannot measure the GPU's GEMM rate")?;
    let weights = projections
        .iter()
        .enumerate()
        .map(|(i, &(n, k))| GpuTensor::from_f32(&gpu, &probe_values(n * k, i).collect::<Vec<_>>(), dtype))
        .collect::<Result<Vec<_>, _>>()?;
    let shapes: Vec<_> = weights.iter().zip(projections).map(|(w, &(n, _))| (w.view(), n, dtype)).collect();
    let report = Gemms::new()?.tune(&gpu, &[rows], &shapes)?;
    let micros: f32 = report.iter().map(|t| t.best_us.map_or(t.default_us, |best| best.min(t.default_us))).sum();
    Ok(micros as f64 / 1e6)
}

/// The run's switches of its FP8 GEMMs (`--fp8-fast-accum`, `--fp8-block-gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Switches {
    pub fast_accumulation: bool,
    pub block_gemm: bool,
}

impl Fp8Switches {
    pub fn of(gpu: &GpuArgs) -> Fp8Switches {
        Fp8Switches { fast_accumulation: gpu.fp8_fast_accum, block_gemm: gpu.fp8_block_gemm }
    }
}

/// How the FP8 probe runs: `dtype` activations, `rows` of them, with the run's switches, the
/// weights quantized as the run's are scaled.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Fp8Probe {
    dtype: DType,
    rows: usize,
    switches: Fp8Switches,
    scaling: WeightScaling,
}

#[cfg(not(feature = "cuda"))]
fn gpu_fp8_projection_seconds(_projections: &[(usize, usize)], _probe: Fp8Probe) -> Result<(f64, bool)> {
    anyhow::bail!("this build of ferrolm has no CUDA backend (build with `--features cuda`)")
}

/// The sum over `projections` (`(out, in)`), quantized to e4m3 as `probe.scaling` says (per
/// row for tensor and channel scales, in the run's blocks), of their FP8 GEMMs' time with the
/// fastest cuBLASLt algorithm (`cuda::tune_fp8_gemms`), in seconds; a projection the FP8 GEMM
/// does not take (as the engine then dequantizes it) at its time in the compute dtype. With
/// whether any projection took an FP8 GEMM.
#[cfg(feature = "cuda")]
fn gpu_fp8_projection_seconds(projections: &[(usize, usize)], probe: Fp8Probe) -> Result<(f64, bool)> {
    use anyhow::Context;
    use ferrolm_backend::cuda::{self, Gemms, Gpu, GpuFp8Matrix, GpuOptions};
    use ferrolm_backend::{Fp8Matrix, HostTensor};

    let Fp8Probe { dtype, rows, switches, scaling } = probe;
    let options = GpuOptions {
        fp8_fast_accumulation: switches.fast_accumulation,
        fp8_block_gemm: switches.block_gemm,
        ..Default::default()
    };
    let gpu = Gpu::new(0, &options).context("cannot measure the GPU's FP8 GEMM rate")?;
    let gemms = Gemms::new()?;
    let (mut seconds, mut fp8) = (0.0f64, false);
    for (i, &(n, k)) in projections.iter().enumerate() {
        let values = HostTensor::from_f32(vec![n, k], probe_values(n * k, i).collect());
        let quantized = match scaling {
            WeightScaling::Block { rows: block_rows, cols: block_cols } => {
                Fp8Matrix::quantize_blocks(&values, block_rows, block_cols)
            }
            WeightScaling::Tensor | WeightScaling::Channel => Fp8Matrix::quantize_rows(&values),
        };
        // The GEMMs of `rows` rows (over blocks, up to two: see `cuda::tune_fp8_gemms`); none
        // where any is missing, as the engine then dequantizes the matrix.
        let tuned = match GpuFp8Matrix::new(&gpu, &quantized)? {
            Some(w) => {
                let report = cuda::tune_fp8_gemms(&gpu, &gemms, w.view(), n, &[rows], dtype)?;
                let covered = report.iter().map(|t| t.shape.m).sum::<usize>() >= rows;
                covered.then(|| report.iter().map(|t| t.best_us).sum::<f32>())
            }
            None => None,
        };
        fp8 |= tuned.is_some();
        seconds += match tuned {
            Some(us) => f64::from(us) / 1e6,
            None => gpu_projection_seconds(&[(n, k)], dtype, rows)?,
        };
    }
    Ok((seconds, fp8))
}

/// A run's limits at the measured ceilings, and how close the run came.
#[derive(Clone, Copy, Debug)]
pub struct ThroughputLimit {
    /// Output tokens per second with each step's GEMMs, then its attention.
    pub in_sequence: f64,
    /// Output tokens per second with all arithmetic and all reads overlapped.
    pub overlapped: f64,
    /// Measured output throughput / each limit.
    pub fraction_in_sequence: f64,
    pub fraction_overlapped: f64,
}

impl ThroughputLimit {
    pub fn of(work: &RunWork, rate: &GemmRate, bandwidth: &Bandwidth, output_tokens: usize, measured: f64) -> Self {
        let (flops, dtype_flops, bytes) = (rate.flops_per_s, rate.compute_dtype_flops_per_s, bandwidth.bytes_per_s);
        let in_dtype = work.compute_dtype_gemm_flops;
        let gemm_seconds = (work.gemm_flops - in_dtype) / flops + in_dtype / dtype_flops;
        let gemms = gemm_seconds.max(work.weight_read_bytes / bytes);
        let attention = work.attention_flops / dtype_flops + work.kv_read_bytes / bytes;
        let compute = gemm_seconds + work.attention_flops / dtype_flops;
        let memory = (work.kv_read_bytes + work.weight_read_bytes) / bytes;
        let in_sequence = output_tokens as f64 / (gemms + attention);
        let overlapped = output_tokens as f64 / compute.max(memory);
        ThroughputLimit {
            in_sequence,
            overlapped,
            fraction_in_sequence: measured / in_sequence,
            fraction_overlapped: measured / overlapped,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Hidden 8, 2 query heads of 4 over 1 KV head, MLP 16, 2 layers, vocabulary 100: one
    /// layer's projections hold 16x8 + 8x8 + 32x8 + 8x16 = 576 elements.
    fn config(sliding_window: Option<usize>) -> ModelConfig {
        let arch = if sliding_window.is_some() { "MistralForCausalLM" } else { "LlamaForCausalLM" };
        ModelConfig::from_value(json!({
            "architectures": [arch], "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "sliding_window": sliding_window,
        }))
        .expect("valid config")
    }

    /// A dense model's steps: `bytes` each.
    fn dense(bytes: f64) -> StepWeights {
        StepWeights { fixed_bytes: bytes, expert_bytes: 0.0, sparse_layers: 0, moe: None }
    }

    const SERVED: [Served; 3] = [
        Served { prompt_len: 5, output_len: 3 },
        Served { prompt_len: 2, output_len: 1 },
        // Refused or cancelled before its first token: no work counted.
        Served { prompt_len: 4, output_len: 0 },
    ];

    #[test]
    fn work_counts_every_fed_token_sampled_row_and_attended_pair() {
        let c = config(None);
        assert_eq!(c.layer_matrix_elements(0), 576);
        let caps = StepCaps { max_num_seqs: 1, max_num_batched_tokens: 4 };
        let work = RunWork::of(&c, &SERVED, caps, &dense(1000.0), 10);
        // Fed tokens 7 + 2 at 2 x 576 x 2 layers = 2304 FLOP each; 3 + 1 LM head rows at
        // 2 x 100 x 8 = 1600.
        assert_eq!(work.gemm_flops, 9.0 * 2304.0 + 4.0 * 1600.0);
        // Of which the LM head stays in the compute dtype where the projections are FP8.
        assert_eq!(work.compute_dtype_gemm_flops, 4.0 * 1600.0);
        // Causal pairs 1 + ... + 7 = 28 and 1 + 2 = 3, at 4 x 8 (query width) x 2 layers each.
        assert_eq!(work.attention_flops, 31.0 * 64.0);
        // Decode tokens 6 and 7 of the first request read 6 and 7 tokens of K/V; the second
        // request's only token came from its prompt step.
        assert_eq!(work.kv_read_bytes, 13.0 * 10.0);
        // One request a step: 2 prompt steps + 2 decodes, and 1 prompt step: 5 steps.
        assert_eq!((work.min_steps, work.weight_read_bytes), (5, 5000.0));
    }

    /// The config of `config(None)` with 4 experts of 4 a layer, 2 per token, in both layers.
    fn moe_config() -> ModelConfig {
        ModelConfig::from_value(json!({
            "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 8,
            "intermediate_size": 16, "moe_intermediate_size": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        }))
        .expect("valid config")
    }

    #[test]
    fn a_moe_token_multiplies_with_its_top_k_experts_and_a_step_reads_the_expected_ones() {
        let c = moe_config();
        // Attention 16x8 + 8x8 = 192; router 4x8 = 32; experts of 3 x 8 x 4 = 96.
        assert_eq!(c.layer_matrix_elements(0), 192 + 32 + 4 * 96);
        assert_eq!(c.layer_active_matrix_elements(1), 192 + 32 + 2 * 96);
        let weights = StepWeights { fixed_bytes: 1000.0, expert_bytes: 10.0, sparse_layers: 2, moe: c.moe.clone() };
        // One token reads exactly its 2 experts a layer; many read all 4.
        assert_eq!(weights.bytes(1.0), 1000.0 + 2.0 * 2.0 * 10.0);
        assert!((weights.bytes(100.0) - (1000.0 + 2.0 * 4.0 * 10.0)).abs() < 1e-9);
        let caps = StepCaps { max_num_seqs: 1, max_num_batched_tokens: 4 };
        let work = RunWork::of(&c, &SERVED, caps, &weights, 10);
        // 9 fed tokens at 2 x 416 x 2 layers = 1664 FLOP each; 4 LM head rows at 1600.
        assert_eq!(work.gemm_flops, 9.0 * 1664.0 + 4.0 * 1600.0);
        // The router and the 2 routed experts (2 x (32 + 192) x 2 layers = 896 FLOP a token) and
        // the LM head stay in the compute dtype where the projections are FP8.
        assert_eq!(work.compute_dtype_gemm_flops, 9.0 * 896.0 + 4.0 * 1600.0);
        // 9 tokens over the fewest 5 steps: 1.8 a step, expecting 4 (1 - (1/2)^1.8) experts.
        assert_eq!(work.min_steps, 5);
        assert_eq!(work.mean_step_tokens, 1.8);
        let experts = 4.0 * (1.0 - 0.5f64.powf(1.8));
        assert!((work.experts_per_step - experts).abs() < 1e-12);
        let want = 5.0 * (1000.0 + 2.0 * experts * 10.0);
        assert!((work.weight_read_bytes - want).abs() < 1e-9, "{} vs {want}", work.weight_read_bytes);
    }

    #[test]
    fn the_probe_times_attention_one_expert_and_the_shared_expert() {
        let c = moe_config();
        // qkv, o, then one expert's gate/up and down.
        assert_eq!(layer_projections(&c), [(16, 8), (8, 8), (8, 8), (8, 4)]);
        let shared = ModelConfig::from_value(json!({
            "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 100, "hidden_size": 8,
            "intermediate_size": 16, "moe_intermediate_size": 4, "shared_expert_intermediate_size": 6,
            "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1, "num_attention_heads": 2,
        }))
        .expect("valid config");
        assert_eq!(layer_projections(&shared), [(24, 8), (8, 8), (8, 8), (8, 4), (12, 8), (8, 6)]);
        assert_eq!(layer_projections(&config(None)), [(16, 8), (8, 8), (32, 8), (8, 16)]);
        // In FP8, the routed experts stay dequantized: the FP8 rate is the others'.
        assert_eq!(fp8_projections(&shared), [(24, 8), (8, 8), (12, 8), (8, 6)]);
        assert_eq!(fp8_projections(&config(None)), layer_projections(&config(None)));
    }

    #[test]
    fn fewest_steps_follow_the_tightest_cap() {
        let c = config(None);
        let steps = |max_num_seqs, max_num_batched_tokens| {
            RunWork::of(&c, &SERVED, StepCaps { max_num_seqs, max_num_batched_tokens }, &dense(1.0), 1).min_steps
        };
        // 9 fed tokens at 1 a step.
        assert_eq!(steps(8, 1), 9);
        // The first request alone: 1 prompt step and 2 decodes.
        assert_eq!(steps(8, 64), 3);
        // 3 + 1 request-steps at 1 request a step.
        assert_eq!(steps(1, 64), 4);
    }

    #[test]
    fn a_sliding_window_caps_the_attended_context() {
        assert_eq!(attended(7, usize::MAX), 28.0);
        // Tokens 1..=7 over a window of 3: 1 + 2 + 3 + 3 + 3 + 3 + 3.
        assert_eq!(attended(7, 3), 18.0);
        let caps = StepCaps { max_num_seqs: 8, max_num_batched_tokens: 64 };
        let work = RunWork::of(&config(Some(3)), &SERVED, caps, &dense(1.0), 1);
        // 18 + 3 pairs; decodes: 18 - attended(5) = 18 - 12 = 6 tokens of K/V read.
        assert_eq!(work.attention_flops, 21.0 * 64.0);
        assert_eq!(work.kv_read_bytes, 6.0);
    }

    /// Gemma 2 alternates windowed and global layers: layer 0 attends within 3 tokens, layer 1
    /// over the whole context.
    #[test]
    fn each_layer_attends_within_its_own_window() {
        let c = ModelConfig::from_value(json!({
            "architectures": ["Gemma2ForCausalLM"], "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "max_position_embeddings": 64, "sliding_window": 3,
        }))
        .expect("valid config");
        assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(3), None));
        let caps = StepCaps { max_num_seqs: 8, max_num_batched_tokens: 64 };
        let work = RunWork::of(&c, &SERVED, caps, &dense(1.0), 10);
        // Pairs 18 + 3 in the windowed layer, 28 + 3 in the global one, at 4 x 8 (query
        // width) each.
        assert_eq!(work.attention_flops, (21.0 + 31.0) * 32.0);
        // Decode tokens read 6 tokens of K/V in the windowed layer and 13 in the global one, at
        // 10 / 2 bytes per token and layer.
        assert_eq!(work.kv_read_bytes, (6.0 + 13.0) * 5.0);
    }

    #[test]
    fn limits_put_the_work_at_the_ceilings() {
        let work = RunWork {
            gemm_flops: 1000.0,
            compute_dtype_gemm_flops: 0.0,
            attention_flops: 100.0,
            kv_read_bytes: 200.0,
            weight_read_bytes: 50.0,
            min_steps: 5,
            mean_step_tokens: 2.0,
            experts_per_step: 0.0,
        };
        let rate = GemmRate { flops_per_s: 100.0, compute_dtype_flops_per_s: 100.0, fp8: false, rows: 4 };
        let bandwidth = Bandwidth { bytes_per_s: 10.0, buffer_bytes: 1, repetitions: 1, threads: 1 };
        let limit = ThroughputLimit::of(&work, &rate, &bandwidth, 62, 1.0);
        // In sequence: GEMMs max(10 s of arithmetic, 5 s of weights) + attention 1 s + 20 s.
        assert_eq!(limit.in_sequence, 2.0);
        assert_eq!(limit.fraction_in_sequence, 0.5);
        // Overlapped: max(11 s of arithmetic, 25 s of reads).
        assert_eq!(limit.overlapped, 62.0 / 25.0);
        assert!((limit.fraction_overlapped - 25.0 / 62.0).abs() < 1e-15);
        // Weights read more slowly than they are multiplied: the GEMMs take the read time.
        let slow = ThroughputLimit::of(&work, &rate, &Bandwidth { bytes_per_s: 2.0, ..bandwidth }, 62, 1.0);
        assert_eq!(slow.in_sequence, 62.0 / (25.0 + 1.0 + 100.0));
        // FP8 projections at twice the rate, the attention's arithmetic and the 200 FLOP of
        // compute-dtype GEMMs (a head, say) at the compute dtype's: GEMMs max(4 + 2 s, 5 s)
        // + attention 1 s + 20 s; overlapped max(7 s, 25 s).
        let fp8_rate = GemmRate { flops_per_s: 200.0, fp8: true, ..rate };
        let fp8 =
            ThroughputLimit::of(&RunWork { compute_dtype_gemm_flops: 200.0, ..work }, &fp8_rate, &bandwidth, 62, 1.0);
        assert_eq!(fp8.in_sequence, 62.0 / 27.0);
        assert_eq!(fp8.overlapped, 62.0 / 25.0);
    }

    const SWITCHES: Fp8Switches = Fp8Switches { fast_accumulation: true, block_gemm: false };

    #[test]
    fn cpu_gemm_rate_is_measured_on_the_projections_in_each_dtype() -> Result<()> {
        let c = config(None);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let rate = measure_gemm_rate(Device::Cpu, &c, dtype, 8192, SWITCHES)?;
            assert_eq!(rate.rows, CPU_PROBE_ROWS, "{dtype:?}");
            assert!(rate.flops_per_s.is_finite() && rate.flops_per_s > 0.0, "{dtype:?}: {rate:?}");
        }
        assert_eq!(measure_gemm_rate(Device::Cpu, &c, DType::BF16, 3, SWITCHES)?.rows, 3);
        Ok(())
    }
}
