//! Rotary position embeddings: the inverse frequencies of every RoPE variant HF defines for the
//! families ferrolm runs (default, linear, llama3, yarn, longrope), computed in f32 as HF does so
//! that angles match the reference to the last bit the arithmetic allows.

use ferrolm_backend::RopeFrequencies;
use serde_json::Value;

use crate::ModelError;

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// YaRN (static).
    Yarn {
        factor: f32,
        original_max_position_embeddings: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
    /// Phi-3's LongRoPE: per-dimension factors, the long ones for positions past the original context.
    LongRope {
        short_factor: Vec<f32>,
        long_factor: Vec<f32>,
        original_max_position_embeddings: usize,
        attention_factor: f32,
    },
}

/// One RoPE of a model: its base and its scaling (a model whose layers rotate differently has
/// more than one: Gemma 3's local layers).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub theta: f32,
    pub scaling: RopeScaling,
}

/// The tables the RoPE op needs: one set of inverse frequencies, or two (LongRoPE) with the
/// position from which the second applies.
#[derive(Clone, Debug)]
pub struct RopeTables {
    pub inv_freq: Vec<f32>,
    /// `(first position, inverse frequencies)` for positions at or past it.
    pub long: Option<(u32, Vec<f32>)>,
    pub attention_scaling: f32,
}

impl RopeTables {
    /// The tables as a device is given them.
    pub fn frequencies(&self) -> RopeFrequencies<'_> {
        RopeFrequencies {
            inv_freq: &self.inv_freq,
            long: self.long.as_ref().map(|(start, table)| (*start, table.as_slice())),
            attention_scaling: self.attention_scaling,
        }
    }

    /// The inverse frequencies for a token at `position`.
    pub fn inv_freq_for(&self, position: u32) -> &[f32] {
        self.frequencies().for_position(position)
    }
}

fn f(params: &Value, key: &str) -> Option<f32> {
    params.get(key).and_then(Value::as_f64).map(|v| v as f32)
}

fn float_list(params: &Value, key: &str) -> Result<Vec<f32>, ModelError> {
    params
        .get(key)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_f64).map(|v| v as f32).collect())
        .ok_or_else(|| ModelError::Config(format!("longrope scaling needs `{key}`")))
}

impl RopeScaling {
    /// Reads `rope_parameters` / `rope_scaling` (whichever the config has).
    pub fn from_params(
        params: Option<&Value>,
        max_position_embeddings: usize,
        top_level_original_max: Option<usize>,
    ) -> Result<RopeScaling, ModelError> {
        let Some(p) = params else { return Ok(RopeScaling::None) };
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        let original_max = p
            .get("original_max_position_embeddings")
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .or(top_level_original_max);
        let need_factor =
            || f(p, "factor").ok_or_else(|| ModelError::Config(format!("{kind} rope scaling needs `factor`")));
        Ok(match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: need_factor()? },
            "llama3" => RopeScaling::Llama3 {
                factor: need_factor()?,
                low_freq_factor: f(p, "low_freq_factor").unwrap_or(1.0),
                high_freq_factor: f(p, "high_freq_factor").unwrap_or(4.0),
                original_max_position_embeddings: original_max.unwrap_or(8192),
            },
            "yarn" => {
                let factor = need_factor()?;
                let mscale = |scale: f32, m: f32| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention_factor = match (f(p, "attention_factor"), f(p, "mscale"), f(p, "mscale_all_dim")) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original_max.unwrap_or(max_position_embeddings),
                    beta_fast: f(p, "beta_fast").unwrap_or(32.0),
                    beta_slow: f(p, "beta_slow").unwrap_or(1.0),
                    attention_factor,
                    truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                }
            }
            "longrope" | "su" => {
                let original = original_max.unwrap_or(max_position_embeddings);
                let factor = f(p, "factor").unwrap_or(max_position_embeddings as f32 / original as f32);
                let attention_factor = f(p, "attention_factor").unwrap_or(if factor <= 1.0 {
                    1.0
                } else {
                    (1.0 + factor.ln() / (original as f32).ln()).sqrt()
                });
                RopeScaling::LongRope {
                    short_factor: float_list(p, "short_factor")?,
                    long_factor: float_list(p, "long_factor")?,
                    original_max_position_embeddings: original,
                    attention_factor,
                }
            }
            other => return Err(ModelError::Config(format!("unsupported rope scaling type `{other}`"))),
        })
    }

    /// Builds the tables for a rotary dimension `dim` (even) and base `theta`.
    pub fn tables(&self, theta: f32, dim: usize) -> Result<RopeTables, ModelError> {
        let half = dim / 2;
        // HF: 1 / base^(arange(0, dim, 2) / dim), all in f32.
        let base: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32)).collect();
        let plain = |inv_freq: Vec<f32>, attention_scaling: f32| RopeTables { inv_freq, long: None, attention_scaling };
        Ok(match self {
            RopeScaling::None => plain(base, 1.0),
            RopeScaling::Linear { factor } => plain(base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = *original_max_position_embeddings as f32;
                let low_freq_wavelen = old / low_freq_factor;
                let high_freq_wavelen = old / high_freq_factor;
                let inv = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_freq_wavelen { f / factor } else { f };
                        // Wavelengths are finite and positive, so plain comparisons are total here.
                        let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                        if is_medium {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect();
                plain(inv, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let d = dim as f32;
                let correction_dim = |rotations: f32| {
                    d * ((*original_max_position_embeddings as f32) / (rotations * 2.0 * std::f32::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(d - 1.0);
                if low == high {
                    high += 0.001;
                }
                let inv = base
                    .iter()
                    .enumerate()
                    .map(|(i, &extrapolation)| {
                        let interpolation = extrapolation / factor;
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                    })
                    .collect();
                plain(inv, *attention_factor)
            }
            RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor } => {
                if short_factor.len() != half || long_factor.len() != half {
                    return Err(ModelError::Config(format!(
                        "longrope factors must have {half} entries (rotary dim / 2), got {} and {}",
                        short_factor.len(),
                        long_factor.len()
                    )));
                }
                let with = |ext: &[f32]| -> Vec<f32> {
                    (0..half).map(|i| 1.0 / (ext[i] * theta.powf((2 * i) as f32 / dim as f32))).collect()
                };
                RopeTables {
                    inv_freq: with(short_factor),
                    long: Some((*original_max_position_embeddings as u32, with(long_factor))),
                    attention_scaling: *attention_factor,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn default_frequencies() -> Result<(), ModelError> {
        let t = RopeScaling::None.tables(10000.0, 8)?;
        assert_eq!(t.inv_freq.len(), 4);
        assert_eq!(t.inv_freq[0], 1.0);
        assert!((t.inv_freq[2] - 0.01).abs() < 1e-7);
        assert_eq!(t.attention_scaling, 1.0);
        Ok(())
    }

    #[test]
    fn linear_divides_frequencies() -> Result<(), ModelError> {
        let p = json!({"rope_type": "linear", "factor": 4.0});
        let s = RopeScaling::from_params(Some(&p), 512, None)?;
        let t = s.tables(10000.0, 8)?;
        assert_eq!(t.inv_freq[0], 0.25);
        Ok(())
    }

    #[test]
    fn llama3_keeps_high_and_scales_low_frequencies() -> Result<(), ModelError> {
        let p = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64, "rope_theta": 500000.0});
        let s = RopeScaling::from_params(Some(&p), 512, None)?;
        let base = RopeScaling::None.tables(500000.0, 16)?;
        let t = s.tables(500000.0, 16)?;
        // wavelength 2*pi < 16 (= 64 / 4): unchanged; the longest wavelengths (> 64): divided by 8.
        assert_eq!(t.inv_freq[0], base.inv_freq[0]);
        assert_eq!(t.inv_freq[7], base.inv_freq[7] / 8.0);
        // Somewhere in between it interpolates strictly.
        let mid: Vec<usize> =
            (0..8).filter(|&i| t.inv_freq[i] < base.inv_freq[i] && t.inv_freq[i] > base.inv_freq[i] / 8.0).collect();
        assert!(!mid.is_empty());
        Ok(())
    }

    #[test]
    fn yarn_attention_factor_and_range() -> Result<(), ModelError> {
        let p = json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
        let s = RopeScaling::from_params(Some(&p), 131072, None)?;
        let t = s.tables(1_000_000.0, 128)?;
        assert!((t.attention_scaling - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        let base = RopeScaling::None.tables(1_000_000.0, 128)?;
        assert_eq!(t.inv_freq[0], base.inv_freq[0]);
        assert!((t.inv_freq[63] - base.inv_freq[63] / 4.0).abs() <= base.inv_freq[63] * 1e-6);
        Ok(())
    }

    #[test]
    fn longrope_switches_past_original_context() -> Result<(), ModelError> {
        let p = json!({"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 4.0]});
        let s = RopeScaling::from_params(Some(&p), 8192, Some(4096))?;
        let t = s.tables(10000.0, 4)?;
        assert_eq!(t.inv_freq_for(10), &[1.0, 0.01][..]);
        assert_eq!(t.inv_freq_for(4096), &[0.5, 0.0025][..]);
        assert!((t.attention_scaling - (1.0 + 2f32.ln() / 4096f32.ln()).sqrt()).abs() < 1e-6);
        let bad = json!({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]});
        assert!(RopeScaling::from_params(Some(&bad), 8192, Some(4096))?.tables(10000.0, 4).is_err());
        Ok(())
    }
}
