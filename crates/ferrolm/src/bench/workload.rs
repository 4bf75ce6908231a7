//! Synthetic workloads: random prompts of given lengths (vLLM's "random" dataset) and Poisson
//! arrival times. Everything is drawn from one seeded ChaCha8 stream, so a seed gives the same
//! workload on every machine.

use anyhow::{bail, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// The request mix shared by `bench throughput` and `bench serve`.
#[derive(Args, Clone, Debug, Serialize)]
pub struct WorkloadArgs {
    /// Number of requests.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Output length in tokens (EOS is ignored, so every request produces exactly this many).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Lengths drawn uniformly from [len * (1 - R), len * (1 + R)]; 0 keeps them fixed.
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Seed of prompts, lengths, arrivals and sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// One request of a workload.
#[derive(Clone, Debug)]
pub struct BenchRequest {
    pub prompt_token_ids: Vec<u32>,
    pub output_len: usize,
}

/// Draws prompt token ids uniformly from the vocabulary, never a special id.
#[derive(Clone, Debug)]
pub struct PromptSampler {
    vocab_size: usize,
    /// Sorted, deduplicated, all `< vocab_size`.
    excluded: Vec<u32>,
}

impl PromptSampler {
    pub fn new(vocab_size: usize, excluded: impl IntoIterator<Item = u32>) -> Result<PromptSampler> {
        let mut excluded: Vec<u32> = excluded.into_iter().filter(|&id| (id as usize) < vocab_size).collect();
        excluded.sort_unstable();
        excluded.dedup();
        if excluded.len() >= vocab_size {
            bail!("no ordinary token ids to draw prompts from (vocabulary of {vocab_size})");
        }
        Ok(PromptSampler { vocab_size, excluded })
    }

    pub fn sample(&self, len: usize, rng: &mut ChaCha8Rng) -> Vec<u32> {
        let choices = (self.vocab_size - self.excluded.len()) as u32;
        (0..len)
            .map(|_| {
                // Rank among the allowed ids -> id: step over every excluded id at or below it.
                let mut id = rng.random_range(0..choices);
                for &e in &self.excluded {
                    if e <= id {
                        id += 1;
                    } else {
                        break;
                    }
                }
                id
            })
            .collect()
    }
}

/// `n` lengths uniform over the integers in `[floor(len * (1 - ratio)), floor(len * (1 + ratio))]`
/// (as vLLM's random dataset draws them), never below 1.
pub fn sample_lengths(n: usize, len: usize, ratio: f64, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let lo = ((len as f64 * (1.0 - ratio)).floor() as usize).max(1);
    let hi = ((len as f64 * (1.0 + ratio)).floor() as usize).max(lo);
    (0..n).map(|_| if lo == hi { lo } else { rng.random_range(lo..=hi) }).collect()
}

impl WorkloadArgs {
    pub fn validate(&self) -> Result<()> {
        if self.num_prompts == 0 || self.input_len == 0 || self.output_len == 0 {
            bail!("--num-prompts, --input-len and --output-len must be positive");
        }
        if !(0.0..1.0).contains(&self.random_range_ratio) {
            bail!("--random-range-ratio must be in [0, 1), got {}", self.random_range_ratio);
        }
        Ok(())
    }

    /// Prompt + output tokens of the longest request the workload can hold.
    pub fn longest_request(&self) -> usize {
        let most = |len: usize| ((len as f64 * (1.0 + self.random_range_ratio)).floor() as usize).max(1);
        most(self.input_len) + most(self.output_len)
    }

    /// The workload's requests: lengths first, then each prompt, from one stream seeded by `--seed`.
    pub fn requests(&self, sampler: &PromptSampler) -> Result<Vec<BenchRequest>> {
        self.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let input_lens = sample_lengths(self.num_prompts, self.input_len, self.random_range_ratio, &mut rng);
        let output_lens = sample_lengths(self.num_prompts, self.output_len, self.random_range_ratio, &mut rng);
        Ok(input_lens
            .into_iter()
            .zip(output_lens)
            .map(|(input_len, output_len)| BenchRequest {
                prompt_token_ids: sampler.sample(input_len, &mut rng),
                output_len,
            })
            .collect())
    }
}

/// Send times, in seconds from the start, of `n` requests arriving as a Poisson process of
/// `rate` requests per second (exponential gaps of mean `1 / rate`); all 0 when `rate` is
/// infinite. The first request is sent at its first gap, as vLLM does.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    if rate.is_infinite() {
        return vec![0.0; n];
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            // 1 - u lies in (0, 1]: its logarithm is finite.
            let u: f64 = rng.random();
            t += -(1.0 - u).ln() / rate;
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_gaps_have_mean_one_over_rate() {
        let rate = 4.0;
        let times = poisson_arrivals(20_000, rate, 7);
        let mean_gap = times.last().copied().unwrap_or(0.0) / times.len() as f64;
        assert!((mean_gap - 1.0 / rate).abs() < 0.01, "mean gap {mean_gap}");
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        // An exponential's standard deviation equals its mean.
        let gaps: Vec<f64> = std::iter::once(times[0]).chain(times.windows(2).map(|w| w[1] - w[0])).collect();
        let var = gaps.iter().map(|g| (g - mean_gap).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((var.sqrt() - 1.0 / rate).abs() < 0.01, "std {}", var.sqrt());
        assert_eq!(poisson_arrivals(3, rate, 7), times[..3].to_vec(), "same seed, same arrivals");
    }

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        assert_eq!(poisson_arrivals(4, f64::INFINITY, 0), vec![0.0; 4]);
    }

    #[test]
    fn lengths_stay_in_range_and_cover_it() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let lens = sample_lengths(2000, 100, 0.25, &mut rng);
        assert!(lens.iter().all(|&l| (75..=125).contains(&l)));
        assert!(lens.contains(&75) && lens.contains(&125));
        assert_eq!(sample_lengths(3, 10, 0.0, &mut rng), vec![10, 10, 10]);
        assert_eq!(sample_lengths(2, 1, 0.9, &mut rng).iter().min(), Some(&1));
    }

    #[test]
    fn prompts_avoid_special_ids_and_stay_in_vocab() -> Result<()> {
        let sampler = PromptSampler::new(8, [0, 1, 2, 7, 99])?;
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let ids = sampler.sample(4000, &mut rng);
        assert!(ids.iter().all(|&id| (3..7).contains(&id)), "{ids:?}");
        for id in 3..7 {
            assert!(ids.contains(&id), "{id} never drawn");
        }
        assert!(PromptSampler::new(2, [0, 1]).is_err());
        Ok(())
    }

    #[test]
    fn workload_is_reproducible() -> Result<()> {
        let args = WorkloadArgs { num_prompts: 5, input_len: 20, output_len: 8, random_range_ratio: 0.5, seed: 11 };
        let sampler = PromptSampler::new(1000, [])?;
        let (a, b) = (args.requests(&sampler)?, args.requests(&sampler)?);
        assert_eq!(a.len(), 5);
        assert_eq!(args.longest_request(), 30 + 12);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.prompt_token_ids, y.prompt_token_ids);
            assert_eq!(x.output_len, y.output_len);
            assert!((10..=30).contains(&x.prompt_token_ids.len()));
            assert!((4..=12).contains(&x.output_len));
        }
        Ok(())
    }
}
