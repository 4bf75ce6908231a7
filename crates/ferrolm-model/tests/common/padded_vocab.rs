//! A fixture model whose vocabulary is padded past its tokenizer, as many checkpoints are
//! (Qwen2.5: 152,064 embedding rows for 151,665 tokens). Shared by the model, engine and server
//! tests (the latter two include this file by path).
//!
//! The padded rows are built to win: row `2j` of the appended ones is `+PAD_SCALE * e_j` and row
//! `2j + 1` is `-PAD_SCALE * e_j` (`e_j` the `j`-th unit vector of the hidden size), so for any
//! final hidden state one of them has a logit of `PAD_SCALE * max_j |h_j|`, far above the real
//! rows' logits: a greedy step would always pick a padded id if it could.

#![allow(dead_code)]

use std::error::Error;
use std::fs;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

/// Large next to the fixtures' logits (a few units), and exact in bf16.
pub const PAD_SCALE: f32 = 64.0;

/// The tensors whose rows are ids: the embedding and an untied LM head.
const VOCAB_TENSORS: [&str; 2] = ["model.embed_tokens.weight", "lm_head.weight"];

/// A padded copy of a fixture in a temporary directory, removed when dropped.
pub struct PaddedModel {
    pub dir: tempfile::TempDir,
    /// Ids the tokenizer knows: the fixture's vocabulary.
    pub num_tokens: usize,
    /// Rows of the padded embedding (`vocab_size` in its config.json).
    pub vocab_size: usize,
}

impl PaddedModel {
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Copies the fixture directory `src` with `2 * hidden_size` rows appended to every tensor of
/// [`VOCAB_TENSORS`] it holds, and `vocab_size` raised to match; the tokenizer is unchanged.
pub fn padded_copy(src: &Path) -> Result<PaddedModel, Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let config_text = fs::read_to_string(src.join("config.json"))?;
    let mut config: serde_json::Value = serde_json::from_str(&config_text)?;
    let num_tokens = config["vocab_size"].as_u64().ok_or("config.json has no vocab_size")? as usize;
    let hidden = config["hidden_size"].as_u64().ok_or("config.json has no hidden_size")? as usize;
    let vocab_size = num_tokens + 2 * hidden;
    config["vocab_size"] = vocab_size.into();
    fs::write(dir.path().join("config.json"), serde_json::to_string_pretty(&config)?)?;
    for entry in fs::read_dir(src)? {
        let path = entry?.path();
        let name = path.file_name().ok_or("a directory entry without a name")?;
        if name == "config.json" {
            continue;
        }
        if path.extension().is_some_and(|e| e == "safetensors") {
            fs::write(dir.path().join(name), pad_file(&fs::read(&path)?, hidden)?)?;
        } else {
            fs::copy(&path, dir.path().join(name))?;
        }
    }
    Ok(PaddedModel { dir, num_tokens, vocab_size })
}

/// One safetensors file with the padded rows appended to its vocabulary tensors.
fn pad_file(bytes: &[u8], hidden: usize) -> Result<Vec<u8>, Box<dyn Error>> {
    let file = SafeTensors::deserialize(bytes)?;
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        let (dtype, mut shape, mut data) = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
        if VOCAB_TENSORS.contains(&name.as_str()) {
            if shape.get(1) != Some(&hidden) {
                return Err(format!("{name} has shape {shape:?}, expected [vocab, {hidden}]").into());
            }
            for j in 0..hidden {
                for sign in [1.0f32, -1.0] {
                    for k in 0..hidden {
                        data.extend(encode(dtype, if k == j { sign * PAD_SCALE } else { 0.0 })?);
                    }
                }
            }
            shape[0] += 2 * hidden;
        }
        tensors.push((name, dtype, shape, data));
    }
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            Ok((name.as_str(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    Ok(safetensors::serialize(views, None)?)
}

/// `value`'s little-endian bytes in `dtype` (exact for the values used here).
fn encode(dtype: Dtype, value: f32) -> Result<Vec<u8>, Box<dyn Error>> {
    match dtype {
        Dtype::F32 => Ok(value.to_le_bytes().to_vec()),
        // bf16 is the top half of an f32; 0 and powers of two lose nothing.
        Dtype::BF16 => Ok(((value.to_bits() >> 16) as u16).to_le_bytes().to_vec()),
        other => Err(format!("padding a {other:?} tensor is not supported").into()),
    }
}
