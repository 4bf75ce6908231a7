//! Logprobs of raw model logits: `log_softmax`, `top_n`, and the per-token summary the
//! API returns.
//!
//! Logprobs are those of the model's raw distribution (no penalties, no temperature, no
//! filtering), which is what vLLM returns by default. Sums are accumulated in f64 so that
//! a 150k-entry vocabulary loses no precision. Rankings break ties by the lower token id,
//! and order NaN below every number, so results never depend on iteration order.

use std::cmp::Ordering;

/// `(max, ln(sum(exp(logits - max))))` over the non-NaN logits, summed in f64.
/// Keeping the two apart lets `log_softmax` compute `(l - max) - ln_sum`, which stays
/// exact where `l - logsumexp` would lose the low bits of large logits.
fn max_and_ln_sum(logits: &[f32]) -> (f32, f64) {
    let max = logits.iter().copied().filter(|l| !l.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return (max, 0.0);
    }
    let sum: f64 = logits.iter().filter(|l| !l.is_nan()).map(|&l| (f64::from(l) - f64::from(max)).exp()).sum();
    (max, sum.ln())
}

fn log_softmax_one(l: f32, max: f32, ln_sum: f64) -> f32 {
    ((f64::from(l) - f64::from(max)) - ln_sum) as f32
}

/// `log(sum(exp(logits)))`, with the max subtracted first and the sum taken in f64.
/// `-inf` when every logit is `-inf` (or the row is empty).
pub fn logsumexp(logits: &[f32]) -> f32 {
    let (max, ln_sum) = max_and_ln_sum(logits);
    (f64::from(max) + ln_sum) as f32
}

/// Log-probabilities of the softmax of `logits`.
// [vocab] -> [vocab]
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let (max, ln_sum) = max_and_ln_sum(logits);
    logits.iter().map(|&l| log_softmax_one(l, max, ln_sum)).collect()
}

/// Orders (id, value) pairs by value descending, then id ascending; NaN ranks last.
pub(crate) fn rank_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    key(b.1).total_cmp(&key(a.1)).then_with(|| a.1.is_nan().cmp(&b.1.is_nan())).then_with(|| a.0.cmp(&b.0))
}

/// The `n` highest entries of `values` as (token id, value), sorted by value descending,
/// ties by the lower id. Linear time in `values.len()` plus `n log n`.
pub fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(values.len());
    if n == 0 {
        return Vec::new();
    }
    let mut pairs: Vec<(u32, f32)> = (0u32..).zip(values.iter().copied()).collect();
    if n < pairs.len() {
        pairs.select_nth_unstable_by(n - 1, rank_desc);
        pairs.truncate(n);
    }
    pairs.sort_unstable_by(rank_desc);
    pairs
}

/// One token's logprob under the raw distribution, with the distribution's top entries.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    /// `log_softmax(logits)[token]`.
    pub logprob: f32,
    /// The `num_top` highest (id, logprob), sorted descending, ties by the lower id.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Logprob of `token` in `logits` and the `num_top` highest logprobs; used for sampled
/// tokens and for prompt logprobs alike. A token outside the row gets `-inf`.
pub fn token_logprobs(logits: &[f32], token: u32, num_top: usize) -> TokenLogprobs {
    let (max, ln_sum) = max_and_ln_sum(logits);
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| log_softmax_one(l, max, ln_sum));
    // log_softmax is monotone, so ranking the raw logits ranks the logprobs.
    let top_logprobs =
        top_n(logits, num_top).into_iter().map(|(id, l)| (id, log_softmax_one(l, max, ln_sum))).collect();
    TokenLogprobs { token, logprob, top_logprobs }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_sums_to_one_in_probability_space() {
        let logits: Vec<f32> = (0..150_000).map(|i| ((i * 7919) % 1000) as f32 / 37.0).collect();
        let lp = log_softmax(&logits);
        let total: f64 = lp.iter().map(|&l| f64::from(l).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "sum of probabilities {total}");
        assert!(lp.iter().all(|&l| l <= 0.0));
    }

    #[test]
    fn log_softmax_matches_hand_computation() {
        // softmax([0, ln 3]) = [1/4, 3/4]
        let lp = log_softmax(&[0.0, 3f32.ln()]);
        assert!((lp[0] - 0.25f32.ln()).abs() < 1e-6);
        assert!((lp[1] - 0.75f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn log_softmax_is_stable_for_large_and_masked_logits() {
        let lp = log_softmax(&[1000.0, 1000.0, f32::NEG_INFINITY]);
        assert!((lp[0] - 0.5f32.ln()).abs() < 1e-6);
        assert!((lp[1] - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(lp[2], f32::NEG_INFINITY);
        assert_eq!(logsumexp(&[]), f32::NEG_INFINITY);
        assert_eq!(logsumexp(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
    }

    #[test]
    fn top_n_is_sorted_descending_with_ties_to_lower_id() {
        let v = [0.5, 2.0, f32::NAN, 2.0, -1.0, 3.0, 2.0];
        assert_eq!(top_n(&v, 4), vec![(5, 3.0), (1, 2.0), (3, 2.0), (6, 2.0)]);
        assert_eq!(top_n(&v, 0), vec![]);
        let all = top_n(&v, 100);
        assert_eq!(all.len(), v.len());
        assert_eq!(all.last().map(|p| p.0), Some(2), "NaN ranks last");
        assert!(all[..6].windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn token_logprobs_reports_the_token_and_the_top() {
        let logits = [1.0, 3.0, 2.0, 3.0];
        let out = token_logprobs(&logits, 2, 2);
        let lp = log_softmax(&logits);
        assert_eq!(out.token, 2);
        assert_eq!(out.logprob, lp[2]);
        assert_eq!(out.top_logprobs, vec![(1, lp[1]), (3, lp[3])]);
        assert_eq!(token_logprobs(&logits, 9, 0).logprob, f32::NEG_INFINITY);
    }
}
