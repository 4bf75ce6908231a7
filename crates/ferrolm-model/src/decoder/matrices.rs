//! Weight matrices from a checkpoint, as stored or quantized: the one place the loader reads a
//! matrix, so that every projection (attention, dense MLP, experts, shared expert) takes FP8
//! checkpoints and `--quantization fp8` alike ([`crate::config::quant`]).
//!
//! A matrix is the rows of its parts in order (fused q/k/v, gate/up, stacked experts). Its parts
//! are all FP8 or all unquantized; FP8 parts are read with their checkpoint's scales and placed
//! by [`Device::fp8_matrix`], and unquantized parts of a projection are quantized per row first
//! where the model is quantized at load.

use ferrolm_backend::{Device, Fp8Matrix, Fp8Scales, HostTensor, MatrixUse};

use super::Loader;
use crate::config::quant::{Fp8Checkpoint, WeightScaling};
use crate::config::Quantization;
use crate::ModelError;

/// What a matrix is: whether it takes the model's quantization, and which ops read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// A projection of the attention or a dense MLP (a shared expert's too): quantized at load
    /// under `--quantization fp8`.
    Projection,
    /// A mixture's stacked experts: quantized at load as projections are.
    Experts,
    /// The LM head, a router or a gate: loaded as stored, as vLLM leaves them.
    AsStored,
    /// The token embedding (also the LM head where it is tied): loaded as stored.
    Embedding,
}

impl Role {
    fn quantized_at_load(self) -> bool {
        matches!(self, Role::Projection | Role::Experts)
    }

    fn usage(self) -> MatrixUse {
        match self {
            Role::Projection | Role::AsStored => MatrixUse::Linear,
            Role::Experts => MatrixUse::Experts,
            Role::Embedding => MatrixUse::Embedding,
        }
    }
}

/// One part of a matrix: the prefix of its `.weight` (and scales), and its `[rows, cols]`.
pub(super) type Part = (String, [usize; 2]);

impl<D: Device> Loader<'_, D>
where
    ModelError: From<D::Error>,
{
    /// The matrix whose rows are those of `parts` in order.
    pub(super) fn matrix(&self, parts: &[Part], role: Role) -> Result<D::Matrix, ModelError> {
        let names = || parts.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>();
        let fp8 = parts.iter().filter(|(p, _)| self.src.is_fp8(&format!("{p}.weight"))).count();
        if fp8 > 0 {
            if fp8 != parts.len() {
                return Err(ModelError::Config(format!(
                    "the parts {:?} of one matrix mix FP8 and unquantized weights",
                    names()
                )));
            }
            let Some(scheme) = self.cfg.quantization.as_ref().and_then(Quantization::checkpoint) else {
                return Err(ModelError::UnsupportedQuantization(format!(
                    "`{}.weight` is stored in FP8 but config.json has no quantization_config to say how it is scaled",
                    parts[0].0
                )));
            };
            let parts = parts.iter().map(|part| self.fp8_part(part, scheme)).collect::<Result<Vec<_>, _>>()?;
            return Ok(self.dev.fp8_matrix(parts, role.usage())?);
        }
        let weights: Vec<HostTensor> =
            parts.iter().map(|(p, shape)| self.src.get(&format!("{p}.weight"), shape)).collect::<Result<_, _>>()?;
        if weights.iter().any(|w| w.dtype() != weights[0].dtype()) {
            return Err(ModelError::Config(format!(
                "the parts {:?} of one matrix are stored in different dtypes",
                names()
            )));
        }
        if let (true, Some(Quantization::Fp8AtLoad(scaling))) = (role.quantized_at_load(), self.cfg.quantization) {
            let quantize = |w: &HostTensor| match scaling {
                WeightScaling::Channel => Fp8Matrix::quantize_rows(w),
                WeightScaling::Block { rows: block_rows, cols: block_cols } => {
                    Fp8Matrix::quantize_blocks(w, block_rows, block_cols)
                }
                WeightScaling::Tensor => {
                    let [rows, cols] = w.shape() else { unreachable!("a matrix part is 2-D") };
                    Fp8Matrix::quantize_blocks(w, *rows, *cols)
                }
            };
            let parts = weights.iter().map(quantize).collect();
            return Ok(self.dev.fp8_matrix(parts, role.usage())?);
        }
        Ok(self.dev.matrix(weights)?)
    }

    /// The codes and scales of FP8 part `prefix`, by the checkpoint's scheme.
    fn fp8_part(&self, (prefix, [rows, cols]): &Part, scheme: &Fp8Checkpoint) -> Result<Fp8Matrix, ModelError> {
        let (rows, cols) = (*rows, *cols);
        let codes = self.src.get_fp8_codes(&format!("{prefix}.weight"), &[rows, cols])?;
        let name = format!("{prefix}.{}", scheme.scale_suffix);
        // Per-row and block scales as the formats shape them: [rows, 1] (or [rows]) for rows, the
        // block grid for blocks.
        let scales_shaped = |shapes: &[&[usize]]| {
            let stored = self.src.shape_of(&name).ok_or_else(|| ModelError::MissingTensor(name.clone()))?.to_vec();
            if !shapes.contains(&stored.as_slice()) {
                return Err(ModelError::ShapeMismatch {
                    name: name.clone(),
                    expected: shapes[0].to_vec(),
                    found: stored,
                });
            }
            self.src.get_f32(&name, &stored)
        };
        let scales = match scheme.weights {
            WeightScaling::Tensor => Fp8Scales::Tensor(self.src.get_scalar(&name)?),
            WeightScaling::Channel => Fp8Scales::Rows(scales_shaped(&[&[rows, 1], &[rows]])?),
            WeightScaling::Block { rows: br, cols: bc } => {
                let grid = [rows.div_ceil(br), cols.div_ceil(bc)];
                Fp8Scales::Blocks { block_rows: br, block_cols: bc, scales: scales_shaped(&[&grid])? }
            }
        };
        Fp8Matrix::new(rows, cols, codes, scales)
            .map_err(|message| ModelError::Config(format!("`{prefix}`: {message}")))
    }
}
