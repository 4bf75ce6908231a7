//! Token embedding lookup from a table kept in its storage dtype.

use rayon::prelude::*;

use super::PARALLEL_MIN_ELEMS;
use crate::WeightView;

/// `out[t, :] = table[ids[t], :] * scale`; `table` is `[vocab, hidden]`, `out` is `[ids.len(), hidden]`.
pub fn embedding(ids: &[u32], table: WeightView<'_>, hidden: usize, scale: f32, out: &mut [f32]) {
    assert!(hidden > 0, "embedding: hidden is 0");
    assert_eq!(table.len() % hidden, 0, "embedding: table has {} elements, not rows of {hidden}", table.len());
    let vocab = table.len() / hidden;
    assert_eq!(
        out.len(),
        ids.len() * hidden,
        "embedding: out has {} elements, expected [{}, {hidden}]",
        out.len(),
        ids.len()
    );
    let lookup = |(o, &id): (&mut [f32], &u32)| {
        let id = id as usize;
        assert!(id < vocab, "embedding: token id {id} outside the vocabulary of {vocab}");
        table.slice(id * hidden, hidden).to_f32_into(o);
        if scale != 1.0 {
            o.iter_mut().for_each(|v| *v *= scale);
        }
    };
    if out.len() < PARALLEL_MIN_ELEMS {
        out.chunks_mut(hidden).zip(ids).for_each(lookup);
    } else {
        out.par_chunks_mut(hidden).zip(ids).for_each(lookup);
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::cpu::testutil::{nan_vec, random_vec, rng};

    #[test]
    fn looks_up_and_scales_rows_of_every_dtype() {
        let mut rng = rng(7);
        let (vocab, hidden) = (50, 24);
        let table = random_vec(&mut rng, vocab * hidden, 1.0);
        let table_bf16: Vec<bf16> = table.iter().map(|&v| bf16::from_f32(v)).collect();
        let table_f16: Vec<f16> = table.iter().map(|&v| f16::from_f32(v)).collect();
        let views = [WeightView::F32(&table), WeightView::BF16(&table_bf16), WeightView::F16(&table_f16)];
        // The long batch takes the parallel path.
        let short: Vec<u32> = vec![3, 0, 49, 3];
        let long: Vec<u32> = (0..2000u32).map(|i| (i * 7) % vocab as u32).collect();
        for view in views {
            let stored = view.to_f32_vec();
            for ids in [&short, &long] {
                for scale in [1.0f32, 29.9] {
                    let mut out = nan_vec(ids.len() * hidden);
                    embedding(ids, view, hidden, scale, &mut out);
                    for (t, &id) in ids.iter().enumerate() {
                        for h in 0..hidden {
                            let want = stored[id as usize * hidden + h] * scale;
                            assert_eq!(out[t * hidden + h], want, "{:?} token {t} dim {h}", view.dtype());
                        }
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside the vocabulary")]
    fn rejects_out_of_vocabulary_ids() {
        embedding(&[4], WeightView::F32(&[0.0; 8]), 2, 1.0, &mut [0.0; 2]);
    }
}
