//! The steps from a penalized, masked logits row to one token: argmax for greedy;
//! otherwise temperature, top-k, top-p, min-p, then one inverse-CDF draw.
//!
//! Candidates are `(token id, value)` pairs: the value is a logit until
//! [`apply_temperature`] turns it into an unnormalized probability
//! `exp((l - max) / T)` (the top token weighs exactly 1). Subtracting the max before
//! dividing keeps any positive temperature finite. Rankings break ties by the lower id.
//!
//! Invariant of [`draw`]: candidates are in ascending id order, so the token chosen for
//! a given uniform depends only on the row, never on how a filter reordered it.

use crate::logprobs::rank_desc;

/// First window of top-p's partial sort; grows by [`TOP_P_WINDOW_GROWTH`] when the
/// nucleus is wider, so a peaked distribution never sorts the whole vocabulary.
const TOP_P_FIRST_WINDOW: usize = 64;
const TOP_P_WINDOW_GROWTH: usize = 8;

/// Index of the largest score, the lowest id among equals; `None` if all are `-inf`.
// scores: [vocab], NaN already replaced by -inf
pub(crate) fn argmax(scores: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (id, &s) in (0u32..).zip(scores) {
        if s == f32::NEG_INFINITY {
            continue;
        }
        if best.is_none_or(|(_, b)| s > b) {
            best = Some((id, s));
        }
    }
    best.map(|(id, _)| id)
}

/// Fills `out` with every token whose score is above `-inf`, in id order.
pub(crate) fn collect_candidates(scores: &[f32], out: &mut Vec<(u32, f32)>) {
    out.clear();
    out.extend((0u32..).zip(scores.iter().copied()).filter(|&(_, s)| s > f32::NEG_INFINITY));
}

/// Keeps the `k` highest-scoring candidates (all when `k` is 0 or not smaller than the
/// count). Returns whether the order was disturbed.
pub(crate) fn top_k(cands: &mut Vec<(u32, f32)>, k: usize) -> bool {
    if k == 0 || k >= cands.len() {
        return false;
    }
    cands.select_nth_unstable_by(k - 1, rank_desc);
    cands.truncate(k);
    true
}

/// Turns logits into weights `exp((l - max) / temperature)`, `temperature > 0`.
pub(crate) fn apply_temperature(cands: &mut [(u32, f32)], temperature: f32) {
    let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    for c in cands.iter_mut() {
        c.1 = ((c.1 - max) / temperature).exp();
    }
}

/// Keeps the smallest set of heaviest candidates whose weight reaches `top_p` of the
/// total (at least one). Returns whether the order was disturbed.
pub(crate) fn top_p(cands: &mut Vec<(u32, f32)>, top_p: f32) -> bool {
    if top_p >= 1.0 || cands.len() <= 1 {
        return false;
    }
    let total: f64 = cands.iter().map(|c| f64::from(c.1)).sum();
    let target = f64::from(top_p) * total;
    let mut window = TOP_P_FIRST_WINDOW.min(cands.len());
    loop {
        if window < cands.len() {
            cands.select_nth_unstable_by(window - 1, rank_desc);
        }
        cands[..window].sort_unstable_by(rank_desc);
        let mut cum = 0.0f64;
        for (i, c) in cands[..window].iter().enumerate() {
            cum += f64::from(c.1);
            if cum >= target {
                cands.truncate(i + 1);
                return true;
            }
        }
        if window == cands.len() {
            // Rounding left the total a hair short of the target: keep everything.
            return true;
        }
        window = (window * TOP_P_WINDOW_GROWTH).min(cands.len());
    }
}

/// Drops candidates lighter than `min_p` times the heaviest. Order is kept.
pub(crate) fn min_p(cands: &mut Vec<(u32, f32)>, min_p: f32) {
    if min_p <= 0.0 {
        return;
    }
    let max = cands.iter().map(|c| c.1).fold(0.0f32, f32::max);
    let threshold = min_p * max;
    cands.retain(|c| c.1 >= threshold);
}

/// Inverse-CDF draw: the first candidate (in id order) whose cumulative weight exceeds
/// `u * total`, `u` in [0, 1). `None` if no candidate has weight.
pub(crate) fn draw(cands: &[(u32, f32)], u: f64) -> Option<u32> {
    let total: f64 = cands.iter().map(|c| f64::from(c.1)).sum();
    let target = u * total;
    let mut cum = 0.0f64;
    let mut last_with_weight = None;
    for &(id, w) in cands {
        if w <= 0.0 {
            continue;
        }
        cum += f64::from(w);
        if cum > target {
            return Some(id);
        }
        last_with_weight = Some(id);
    }
    // Only reached when rounding puts u * total at the very end.
    last_with_weight
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEG_INF: f32 = f32::NEG_INFINITY;

    #[test]
    fn argmax_takes_the_lowest_id_among_ties_and_skips_masked() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), Some(1));
        assert_eq!(argmax(&[NEG_INF, -5.0, NEG_INF]), Some(1));
        assert_eq!(argmax(&[NEG_INF, NEG_INF]), None);
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn top_k_keeps_the_k_best_with_ties_to_lower_ids() {
        let mut c = vec![(0, 1.0), (1, 5.0), (2, 3.0), (3, 5.0), (4, 3.0)];
        assert!(top_k(&mut c, 3));
        c.sort_unstable_by_key(|c| c.0);
        assert_eq!(c, vec![(1, 5.0), (2, 3.0), (3, 5.0)]);
        let mut all = vec![(0, 1.0), (1, 2.0)];
        assert!(!top_k(&mut all, 0));
        assert!(!top_k(&mut all, 2));
        assert_eq!(all.len(), 2);
    }

    #[test]
    fn temperature_makes_the_top_weigh_one() {
        let mut c = vec![(0, 2.0), (1, 0.0), (2, 1.0)];
        apply_temperature(&mut c, 0.5);
        assert_eq!(c[0].1, 1.0);
        assert!((c[1].1 - (-4.0f32).exp()).abs() < 1e-7);
        assert!((c[2].1 - (-2.0f32).exp()).abs() < 1e-7);
        let mut tiny = vec![(0, 1e30), (1, -1e30)];
        apply_temperature(&mut tiny, 1e-30);
        assert_eq!(tiny, vec![(0, 1.0), (1, 0.0)]);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus_reaching_p() {
        // weights 8, 4, 3, 1 of 16 (shuffled ids); exact in binary floating point
        let base = vec![(3, 3.0), (0, 1.0), (2, 8.0), (1, 4.0)];
        let kept = |p: f32| {
            let mut c = base.clone();
            top_p(&mut c, p);
            c.into_iter().map(|c| c.0).collect::<Vec<_>>()
        };
        assert_eq!(kept(0.01), vec![2]);
        assert_eq!(kept(0.5), vec![2]);
        assert_eq!(kept(0.51), vec![2, 1]);
        assert_eq!(kept(0.75), vec![2, 1]);
        assert_eq!(kept(0.76), vec![2, 1, 3]);
        assert_eq!(kept(0.9375), vec![2, 1, 3]);
        assert_eq!(kept(0.94), vec![2, 1, 3, 0]);
    }

    #[test]
    fn top_p_grows_its_window_past_the_first() {
        // 1000 equal weights: p = 0.5 needs 500 of them, several windows.
        let mut c: Vec<(u32, f32)> = (0..1000).map(|i| (i, 1.0)).collect();
        assert!(top_p(&mut c, 0.5));
        assert_eq!(c.len(), 500);
        // ties go to the lower ids
        assert!(c.iter().all(|c| c.0 < 500));
    }

    #[test]
    fn min_p_drops_tokens_below_the_scaled_top() {
        let mut c = vec![(0, 1.0), (1, 0.1), (2, 0.09), (3, 0.5)];
        min_p(&mut c, 0.1);
        assert_eq!(c, vec![(0, 1.0), (1, 0.1), (3, 0.5)]);
        min_p(&mut c, 1.0);
        assert_eq!(c, vec![(0, 1.0)]);
    }

    #[test]
    fn draw_walks_the_cdf_in_id_order() {
        let c = [(2, 1.0), (5, 0.0), (7, 3.0)];
        assert_eq!(draw(&c, 0.0), Some(2));
        assert_eq!(draw(&c, 0.2499), Some(2));
        assert_eq!(draw(&c, 0.25), Some(7));
        assert_eq!(draw(&c, 0.999_999_999), Some(7));
        assert_eq!(draw(&[(1, 0.0)], 0.5), None);
    }
}
