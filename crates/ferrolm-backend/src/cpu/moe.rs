//! A mixture-of-experts MLP step on the CPU: route every token to its top-k experts, run each
//! expert once over the rows routed to it (gathered so that they are contiguous: an expert's
//! weights are read once per step, whatever its number of tokens), then sum each token's
//! expert outputs.
//!
//! Invariants:
//! - Routing is Hugging Face's: `p = softmax(logits)` in f32; the `top_k` experts by `p`, ties
//!   to the lower expert id; weights `p[e]`, divided by their sum when `norm_topk_prob`.
//! - A token's output is summed over its choices in rank order (`j = 0..top_k`) from zero, in
//!   f32: what else the step holds changes no addition (only `linear`'s own path, GEMV or GEMM,
//!   which depends on how many rows an expert gets, as for every projection).
//! - The scratch is sized for `tokens * top_k` routed rows; a step uses its first `T * top_k`.

use rayon::prelude::*;

use super::{gelu_tanh_and_mul, linear, silu_and_mul, PARALLEL_MIN_ELEMS};
use crate::device::{GatedActivation, MoeShape};
use crate::WeightView;

/// The buffers of [`moe`] for steps of up to `tokens` tokens.
#[derive(Clone, Debug)]
pub struct CpuMoeScratch {
    tokens: usize,
    shape: MoeShape,
    /// `[tokens, num_experts]`: the router's probabilities (consumed by the top-k search).
    probs: Vec<f32>,
    /// `[tokens * top_k]`: token `t`'s `j`-th choice, `(expert, weight)`, at `t * top_k + j`.
    choices: Vec<(u32, f32)>,
    /// `[num_experts + 1]`: where each expert's rows start in the grouped order.
    expert_start: Vec<usize>,
    /// `[tokens * top_k]`: the grouped row holding each choice.
    choice_row: Vec<u32>,
    /// `[tokens * top_k, hidden]`: the rows of `x`, grouped by expert.
    x: Vec<f32>,
    /// `[tokens * top_k, 2 * inter]`
    gate_up: Vec<f32>,
    /// `[tokens * top_k, inter]`
    act: Vec<f32>,
    /// `[tokens * top_k, hidden]`: each grouped row's expert output.
    y: Vec<f32>,
}

impl CpuMoeScratch {
    pub fn new(tokens: usize, shape: MoeShape) -> CpuMoeScratch {
        let rows = tokens * shape.top_k;
        CpuMoeScratch {
            tokens,
            shape,
            probs: vec![0.0; tokens * shape.num_experts],
            choices: vec![(0, 0.0); rows],
            expert_start: vec![0; shape.num_experts + 1],
            choice_row: vec![0; rows],
            x: vec![0.0; rows * shape.hidden],
            gate_up: vec![0.0; rows * 2 * shape.inter],
            act: vec![0.0; rows * shape.inter],
            y: vec![0.0; rows * shape.hidden],
        }
    }

    /// Bytes [`Self::new`] allocates.
    pub fn bytes(tokens: usize, shape: MoeShape) -> usize {
        let rows = tokens * shape.top_k;
        let floats = tokens * shape.num_experts + rows * (2 * shape.hidden + 3 * shape.inter);
        rows * (std::mem::size_of::<(u32, f32)>() + std::mem::size_of::<u32>())
            + (shape.num_experts + 1) * std::mem::size_of::<usize>()
            + floats * std::mem::size_of::<f32>()
    }
}

/// The routed experts as [`moe`] reads them, in their storage dtype.
#[derive(Clone, Copy, Debug)]
pub struct MoeWeights<'a> {
    /// `[num_experts * 2 * inter, hidden]`: expert `e`'s gate rows, then its up rows.
    pub gate_up: WeightView<'a>,
    /// `[num_experts * hidden, inter]`
    pub down: WeightView<'a>,
    pub shape: MoeShape,
    pub norm_topk_prob: bool,
    pub activation: GatedActivation,
}

/// `out[t] = sum_j w[t, j] * down_e(act(gate_e x[t]) * up_e x[t])` over token `t`'s top-k
/// experts `e` by the softmax of `router_logits[t]`. `x`, `out`: `[T, hidden]`;
/// `router_logits`: `[T, num_experts]`.
pub fn moe(x: &[f32], router_logits: &[f32], w: &MoeWeights<'_>, scratch: &mut CpuMoeScratch, out: &mut [f32]) {
    let MoeShape { num_experts, top_k, inter, hidden } = w.shape;
    assert!(top_k >= 1 && top_k <= num_experts, "moe: top_k {top_k} of {num_experts} experts");
    assert_eq!(x.len() % hidden, 0, "moe: x has {} elements, not rows of {hidden}", x.len());
    let tokens = x.len() / hidden;
    assert_eq!(router_logits.len(), tokens * num_experts, "moe: router_logits is not [{tokens}, {num_experts}]");
    assert_eq!(out.len(), tokens * hidden, "moe: out has {} elements, expected [{tokens}, {hidden}]", out.len());
    assert_eq!(w.gate_up.len(), num_experts * 2 * inter * hidden, "moe: gate_up is not [E * 2 * inter, hidden]");
    assert_eq!(w.down.len(), num_experts * hidden * inter, "moe: down is not [E * hidden, inter]");
    assert_eq!(scratch.shape, w.shape, "moe: scratch made for {:?}", scratch.shape);
    assert!(tokens <= scratch.tokens, "moe: {tokens} tokens, scratch for {}", scratch.tokens);
    if tokens == 0 {
        return;
    }
    let rows = tokens * top_k;
    let s = scratch;

    // Route.
    let (probs, choices) = (&mut s.probs[..tokens * num_experts], &mut s.choices[..rows]);
    let route_row = |((logits, probs), choices): TokenRoute<'_>| route(logits, w.norm_topk_prob, probs, choices);
    if router_logits.len() < PARALLEL_MIN_ELEMS {
        router_logits
            .chunks(num_experts)
            .zip(probs.chunks_mut(num_experts))
            .zip(choices.chunks_mut(top_k))
            .for_each(route_row);
    } else {
        router_logits
            .par_chunks(num_experts)
            .zip(probs.par_chunks_mut(num_experts))
            .zip(choices.par_chunks_mut(top_k))
            .for_each(route_row);
    }

    // Group the choices by expert (a counting sort, stable in token order).
    let starts = &mut s.expert_start;
    starts.fill(0);
    for &(e, _) in choices.iter() {
        starts[e as usize + 1] += 1;
    }
    for e in 0..num_experts {
        starts[e + 1] += starts[e];
    }
    let mut next = starts[..num_experts].to_vec();
    for (c, &(e, _)) in choices.iter().enumerate() {
        s.choice_row[c] = next[e as usize] as u32;
        next[e as usize] += 1;
    }
    let choice_row = &s.choice_row[..rows];
    let gathered = &mut s.x[..rows * hidden];
    for (c, &row) in choice_row.iter().enumerate() {
        let (t, row) = (c / top_k, row as usize);
        gathered[row * hidden..(row + 1) * hidden].copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
    }

    // Each expert over its rows: gate/up, activation, down.
    let (gathered, gate_up, act, y) = (
        &s.x[..rows * hidden],
        &mut s.gate_up[..rows * 2 * inter],
        &mut s.act[..rows * inter],
        &mut s.y[..rows * hidden],
    );
    let experts = per_expert(starts, gathered, gate_up, act, y, hidden, inter);
    experts.into_par_iter().for_each(|part| {
        let n = part.rows;
        let gate_up_w = w.gate_up.slice(part.expert * 2 * inter * hidden, 2 * inter * hidden);
        let down_w = w.down.slice(part.expert * hidden * inter, hidden * inter);
        linear(part.x, n, hidden, gate_up_w, 2 * inter, None, part.gate_up);
        match w.activation {
            GatedActivation::Silu => silu_and_mul(part.gate_up, inter, part.act),
            GatedActivation::GeluTanh => gelu_tanh_and_mul(part.gate_up, inter, part.act),
        }
        linear(part.act, n, inter, down_w, hidden, None, part.y);
    });

    // Each token's weighted sum, in rank order.
    let y = &s.y[..rows * hidden];
    let combine = |(t, o): (usize, &mut [f32])| {
        o.fill(0.0);
        for j in 0..top_k {
            let c = t * top_k + j;
            let (weight, row) = (choices[c].1, choice_row[c] as usize);
            for (o, &v) in o.iter_mut().zip(&y[row * hidden..(row + 1) * hidden]) {
                *o += weight * v;
            }
        }
    };
    if out.len() < PARALLEL_MIN_ELEMS {
        out.chunks_mut(hidden).enumerate().for_each(combine);
    } else {
        out.par_chunks_mut(hidden).enumerate().for_each(combine);
    }
}

/// One token's router logits and probabilities (`[num_experts]` each) and its choices
/// (`[top_k]`), as the routing loop hands them out.
type TokenRoute<'a> = ((&'a [f32], &'a mut [f32]), &'a mut [(u32, f32)]);

/// One token's top-k choices from its router logits: `choices[j] = (expert, weight)` by
/// descending probability, ties to the lower expert id. `probs`: `[num_experts]` scratch.
fn route(logits: &[f32], norm_topk_prob: bool, probs: &mut [f32], choices: &mut [(u32, f32)]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for (p, &l) in probs.iter_mut().zip(logits) {
        *p = (l - max).exp();
    }
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    let mut total = 0.0f32;
    for choice in choices.iter_mut() {
        let (mut best, mut best_p) = (0, f32::NEG_INFINITY);
        for (e, &p) in probs.iter().enumerate() {
            // Strictly greater: an equal probability keeps the lower id found first.
            if p > best_p {
                (best, best_p) = (e, p);
            }
        }
        *choice = (best as u32, best_p);
        total += best_p;
        // Below every probability: never chosen again.
        probs[best] = f32::NEG_INFINITY;
    }
    if norm_topk_prob {
        choices.iter_mut().for_each(|(_, w)| *w /= total);
    }
}

/// One expert's share of a step: its rows of each grouped buffer.
struct ExpertRows<'a> {
    expert: usize,
    rows: usize,
    /// `[rows, hidden]`
    x: &'a [f32],
    /// `[rows, 2 * inter]`
    gate_up: &'a mut [f32],
    /// `[rows, inter]`
    act: &'a mut [f32],
    /// `[rows, hidden]`
    y: &'a mut [f32],
}

/// The grouped buffers cut at `starts` (`[num_experts + 1]` row offsets), for the experts that
/// have rows.
fn per_expert<'a>(
    starts: &[usize],
    mut x: &'a [f32],
    mut gate_up: &'a mut [f32],
    mut act: &'a mut [f32],
    mut y: &'a mut [f32],
    hidden: usize,
    inter: usize,
) -> Vec<ExpertRows<'a>> {
    let mut parts = Vec::new();
    for (expert, bounds) in starts.windows(2).enumerate() {
        let rows = bounds[1] - bounds[0];
        let (x_e, x_rest) = x.split_at(rows * hidden);
        let (gate_up_e, gate_up_rest) = std::mem::take(&mut gate_up).split_at_mut(rows * 2 * inter);
        let (act_e, act_rest) = std::mem::take(&mut act).split_at_mut(rows * inter);
        let (y_e, y_rest) = std::mem::take(&mut y).split_at_mut(rows * hidden);
        (x, gate_up, act, y) = (x_rest, gate_up_rest, act_rest, y_rest);
        if rows > 0 {
            parts.push(ExpertRows { expert, rows, x: x_e, gate_up: gate_up_e, act: act_e, y: y_e });
        }
    }
    parts
}

/// `out[r, :] += sigmoid(gate[r]) * x[r, :]`; `out`, `x`: `[rows, width]`, `gate`: `[rows]`.
pub fn add_sigmoid_gated(out: &mut [f32], x: &[f32], gate: &[f32]) {
    assert_eq!(out.len(), x.len(), "add_sigmoid_gated: out has {} elements, x {}", out.len(), x.len());
    let rows = gate.len();
    if rows == 0 {
        assert!(out.is_empty(), "add_sigmoid_gated: no gate for {} elements", out.len());
        return;
    }
    assert_eq!(out.len() % rows, 0, "add_sigmoid_gated: {} elements are not {rows} rows", out.len());
    let width = out.len() / rows;
    if width == 0 {
        return;
    }
    let add_row = |((o, x), &g): ((&mut [f32], &[f32]), &f32)| {
        let s = 1.0 / (1.0 + (-g).exp());
        for (o, &x) in o.iter_mut().zip(x) {
            *o += s * x;
        }
    };
    if out.len() < PARALLEL_MIN_ELEMS {
        out.chunks_mut(width).zip(x.chunks(width)).zip(gate).for_each(add_row);
    } else {
        out.par_chunks_mut(width).zip(x.par_chunks(width)).zip(gate.par_iter()).for_each(add_row);
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::cpu::testutil::{nan_vec, random_vec, rng};
    use crate::cpu::{Cpu, CpuMatrix, CpuTensor};
    use crate::device::{Device, Experts, MoeInput, Shaped};
    use crate::HostTensor;

    /// One expert's matrices, f32, in HF layout: gate and up `[inter, hidden]`, down
    /// `[hidden, inter]`.
    struct Expert {
        gate: Vec<f32>,
        up: Vec<f32>,
        down: Vec<f32>,
    }

    fn experts(seed: u64, shape: MoeShape) -> Vec<Expert> {
        let mut rng = rng(seed);
        let (h, i) = (shape.hidden, shape.inter);
        (0..shape.num_experts)
            .map(|_| Expert {
                gate: random_vec(&mut rng, i * h, 0.5),
                up: random_vec(&mut rng, i * h, 0.5),
                down: random_vec(&mut rng, h * i, 0.5),
            })
            .collect()
    }

    fn matvec(w: &[f32], x: &[f64], rows: usize) -> Vec<f64> {
        let cols = x.len();
        (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c]).sum()).collect()
    }

    /// Token by token in f64: softmax, sort by (probability desc, id asc), weighted sum of the
    /// chosen experts' MLPs.
    fn reference(x: &[f32], logits: &[f32], experts: &[Expert], shape: MoeShape, norm: bool) -> Vec<f32> {
        let MoeShape { num_experts, top_k, inter, hidden } = shape;
        let mut out = Vec::new();
        for (x, logits) in x.chunks(hidden).zip(logits.chunks(num_experts)) {
            let max = logits.iter().map(|&l| l as f64).fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            let mut order: Vec<usize> = (0..num_experts).collect();
            order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
            let chosen = &order[..top_k];
            let total: f64 = chosen.iter().map(|&e| exps[e] / sum).sum();
            let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let mut acc = vec![0.0f64; hidden];
            for &e in chosen {
                let weight = exps[e] / sum / if norm { total } else { 1.0 };
                let gate = matvec(&experts[e].gate, &x, inter);
                let up = matvec(&experts[e].up, &x, inter);
                let act: Vec<f64> = gate.iter().zip(&up).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
                let y = matvec(&experts[e].down, &act, hidden);
                for (a, y) in acc.iter_mut().zip(y) {
                    *a += weight * y;
                }
            }
            out.extend(acc.iter().map(|&v| v as f32));
        }
        out
    }

    /// The experts stacked as the decoder stacks them: through `Device::matrix` from
    /// `[gate_0, up_0, gate_1, up_1, ...]` and `[down_0, down_1, ...]`.
    fn stacked(experts: &[Expert], shape: MoeShape, norm: bool) -> Experts<Cpu> {
        let (h, i) = (shape.hidden, shape.inter);
        let t = |rows, cols, v: &Vec<f32>| HostTensor::from_f32(vec![rows, cols], v.clone());
        let gate_up = experts.iter().flat_map(|e| [t(i, h, &e.gate), t(i, h, &e.up)]).collect();
        let down = experts.iter().map(|e| t(h, i, &e.down)).collect();
        let Ok(gate_up) = Cpu::default().matrix(gate_up);
        let Ok(down) = Cpu::default().matrix(down);
        Experts {
            gate_up,
            down,
            num_experts: shape.num_experts,
            top_k: shape.top_k,
            norm_topk_prob: norm,
            inter: i,
            hidden: h,
            activation: GatedActivation::Silu,
        }
    }

    fn tensor(rows: usize, cols: usize, values: &[f32]) -> CpuTensor {
        let mut t = CpuTensor::zeros(rows, cols);
        t.as_mut_slice().copy_from_slice(values);
        t
    }

    /// Runs `Cpu::moe` on `x` and `logits` through a scratch of `capacity` tokens.
    fn run(experts: &Experts<Cpu>, x: &[f32], logits: &[f32], capacity: usize) -> Vec<f32> {
        let shape = experts.shape();
        let tokens = x.len() / shape.hidden;
        let Ok(mut scratch) = Cpu::default().moe_scratch(capacity, shape);
        let x = tensor(tokens, shape.hidden, x);
        let logits = tensor(tokens, shape.num_experts, logits);
        let mut out = tensor(tokens, shape.hidden, &nan_vec(tokens * shape.hidden));
        let batch = crate::cpu::testutil::empty_batch();
        let input = MoeInput { x: &x, router_logits: &logits, experts, scratch: &mut scratch, out: &mut out };
        let Ok(()) = Cpu::default().moe(&batch, input);
        assert_eq!(out.rows(), tokens);
        out.as_slice().to_vec()
    }

    fn assert_matches(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 2e-5 * scale, "{what}: element {i}: got {g}, want {w}");
        }
    }

    const SHAPE: MoeShape = MoeShape { num_experts: 8, top_k: 2, inter: 24, hidden: 32 };

    #[test]
    fn matches_the_per_token_reference() {
        let mut rng = rng(31);
        let all = experts(1, SHAPE);
        for tokens in [1, 3, 17, 70] {
            let x = random_vec(&mut rng, tokens * SHAPE.hidden, 1.0);
            let logits = random_vec(&mut rng, tokens * SHAPE.num_experts, 2.0);
            for norm in [false, true] {
                let got = run(&stacked(&all, SHAPE, norm), &x, &logits, tokens + 5);
                let want = reference(&x, &logits, &all, SHAPE, norm);
                assert_matches(&got, &want, &format!("{tokens} tokens, norm {norm}"));
            }
        }
    }

    #[test]
    fn one_token_leaves_most_experts_unpicked() {
        let mut rng = rng(32);
        let shape = MoeShape { num_experts: 16, ..SHAPE };
        let all = experts(2, shape);
        let x = random_vec(&mut rng, shape.hidden, 1.0);
        let logits = random_vec(&mut rng, shape.num_experts, 2.0);
        let got = run(&stacked(&all, shape, true), &x, &logits, 1);
        assert_matches(&got, &reference(&x, &logits, &all, shape, true), "one token");
    }

    #[test]
    fn an_expert_every_token_picks() {
        let mut rng = rng(33);
        let all = experts(3, SHAPE);
        let tokens = 40;
        let x = random_vec(&mut rng, tokens * SHAPE.hidden, 1.0);
        let mut logits = random_vec(&mut rng, tokens * SHAPE.num_experts, 1.0);
        for row in logits.chunks_mut(SHAPE.num_experts) {
            row[5] += 8.0;
        }
        for norm in [false, true] {
            let got = run(&stacked(&all, SHAPE, norm), &x, &logits, tokens);
            assert_matches(&got, &reference(&x, &logits, &all, SHAPE, norm), &format!("biased, norm {norm}"));
        }
    }

    #[test]
    fn top_one_and_every_expert() {
        let mut rng = rng(34);
        for top_k in [1, SHAPE.num_experts] {
            let shape = MoeShape { top_k, ..SHAPE };
            let all = experts(4, shape);
            let tokens = 9;
            let x = random_vec(&mut rng, tokens * shape.hidden, 1.0);
            let logits = random_vec(&mut rng, tokens * shape.num_experts, 2.0);
            for norm in [false, true] {
                let got = run(&stacked(&all, shape, norm), &x, &logits, tokens);
                let want = reference(&x, &logits, &all, shape, norm);
                assert_matches(&got, &want, &format!("top_k {top_k}, norm {norm}"));
            }
        }
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let (mut choices, mut probs) = ([(9, 9.0); 3], [0.0; 8]);
        // Experts 1, 3 and 6 tie for the top; 0 and 4 tie below them.
        let logits = [0.5, 2.0, -1.0, 2.0, 0.5, -3.0, 2.0, 0.0];
        route(&logits, false, &mut probs, &mut choices[..2]);
        assert_eq!([choices[0].0, choices[1].0], [1, 3]);
        assert_eq!(choices[0].1, choices[1].1);
        route(&logits, false, &mut probs, &mut choices);
        assert_eq!(choices.map(|c| c.0), [1, 3, 6]);
        let mut five = [(9, 9.0); 5];
        route(&logits, false, &mut probs, &mut five);
        assert_eq!(five.map(|c| c.0), [1, 3, 6, 0, 4]);
        route(&[1.0, 1.0, 1.0, 1.0], true, &mut probs[..4], &mut choices);
        assert_eq!(choices.map(|c| c.0), [0, 1, 2]);
        assert!(choices.iter().all(|c| (c.1 - 1.0 / 3.0).abs() < 1e-7), "{choices:?}");

        // Through the whole op: equal logits everywhere pick experts 0 and 1.
        let mut rng = rng(35);
        let all = experts(5, SHAPE);
        let x = random_vec(&mut rng, 3 * SHAPE.hidden, 1.0);
        let logits = vec![0.25; 3 * SHAPE.num_experts];
        let got = run(&stacked(&all, SHAPE, false), &x, &logits, 3);
        assert_matches(&got, &reference(&x, &logits, &all, SHAPE, false), "ties");
    }

    #[test]
    fn weights_are_the_probabilities_unless_renormalized() {
        let (mut choices, mut probs) = ([(0, 0.0); 2], [0.0; 3]);
        let logits = [0.0f32, 1.0, 2.0];
        route(&logits, false, &mut probs, &mut choices);
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64).exp()).collect();
        let sum: f64 = e.iter().sum();
        assert_eq!([choices[0].0, choices[1].0], [2, 1]);
        assert!((choices[0].1 as f64 - e[2] / sum).abs() < 1e-7 && (choices[1].1 as f64 - e[1] / sum).abs() < 1e-7);
        route(&logits, true, &mut probs, &mut choices);
        assert!((choices[0].1 as f64 - e[2] / (e[1] + e[2])).abs() < 1e-7);
        assert!((choices[0].1 + choices[1].1 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn bf16_experts_read_in_their_dtype() {
        let mut rng = rng(36);
        let mut all = experts(6, SHAPE);
        let round = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
        for e in &mut all {
            round(&mut e.gate);
            round(&mut e.up);
            round(&mut e.down);
        }
        let f32_experts = stacked(&all, SHAPE, true);
        let to_bf16 = |m: CpuMatrix| {
            let values = HostTensor::from_f32(m.values().shape().to_vec(), m.values().to_f32_vec());
            let Ok(m) = Cpu::default().matrix(vec![values.into_dtype(crate::DType::BF16)]);
            m
        };
        let bf16_experts =
            Experts::<Cpu> { gate_up: to_bf16(f32_experts.gate_up), down: to_bf16(f32_experts.down), ..f32_experts };
        let tokens = 12;
        let x = random_vec(&mut rng, tokens * SHAPE.hidden, 1.0);
        let logits = random_vec(&mut rng, tokens * SHAPE.num_experts, 2.0);
        let got = run(&bf16_experts, &x, &logits, tokens);
        assert_matches(&got, &reference(&x, &logits, &all, SHAPE, true), "bf16");
    }

    #[test]
    fn a_smaller_step_reuses_the_scratch() {
        let mut rng = rng(37);
        let all = experts(7, SHAPE);
        let e = stacked(&all, SHAPE, true);
        let Ok(mut scratch) = Cpu::default().moe_scratch(20, SHAPE);
        let batch = crate::cpu::testutil::empty_batch();
        for tokens in [20, 4, 0, 11] {
            let xv = random_vec(&mut rng, tokens * SHAPE.hidden, 1.0);
            let lv = random_vec(&mut rng, tokens * SHAPE.num_experts, 2.0);
            let (x, logits) = (tensor(tokens, SHAPE.hidden, &xv), tensor(tokens, SHAPE.num_experts, &lv));
            let mut out = tensor(tokens, SHAPE.hidden, &nan_vec(tokens * SHAPE.hidden));
            let input = MoeInput { x: &x, router_logits: &logits, experts: &e, scratch: &mut scratch, out: &mut out };
            let Ok(()) = Cpu::default().moe(&batch, input);
            assert_matches(out.as_slice(), &reference(&xv, &lv, &all, SHAPE, true), &format!("{tokens} tokens"));
        }
        assert_eq!(Cpu::default().moe_scratch_bytes(20, SHAPE), CpuMoeScratch::bytes(20, SHAPE));
    }

    #[test]
    #[should_panic(expected = "moe: 5 tokens, scratch for 4")]
    fn refuses_a_step_past_the_scratch() {
        let e = stacked(&experts(8, SHAPE), SHAPE, true);
        run(&e, &[0.0; 5 * 32], &[0.0; 5 * 8], 4);
    }

    #[test]
    fn sigmoid_gate_adds_the_scaled_rows() {
        let mut out = vec![1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
        let x = [2.0, 2.0, 2.0, 4.0, -4.0, 8.0];
        add_sigmoid_gated(&mut out, &x, &[0.0, f32::NEG_INFINITY]);
        assert_eq!(out, [2.0, 3.0, 4.0, -1.0, 0.0, 1.0]);
        let mut out = vec![0.0; 2];
        add_sigmoid_gated(&mut out, &[1.0, -1.0], &[2.0]);
        let s = 1.0 / (1.0 + (-2.0f32).exp());
        assert_eq!(out, [s, -s]);
    }
}
