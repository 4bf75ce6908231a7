//! Weight loading: safetensors checkpoints (one file, or shards listed in
//! `model.safetensors.index.json`), memory-mapped, kept in their file dtype; and random weights
//! of any config for benchmarks.
//!
//! Tensors come out as [`HostTensor`]s: borrowed from the mapped file where they are aligned
//! for their dtype, copied otherwise. FP8 (F8_E4M3) tensors, the codes of a quantized
//! checkpoint's projections, come out as bytes ([`WeightSource::get_fp8_codes`]); their scales are
//! ordinary tensors.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrolm_backend::{DType, HostTensor, SharedBytes};
use half::{bf16, f16};
use memmap2::Mmap;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::ModelError;

/// A tensor's element type in a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stored {
    Float(DType),
    F8E4M3,
}

impl Stored {
    fn size_in_bytes(self) -> usize {
        match self {
            Stored::Float(dtype) => dtype.size_in_bytes(),
            Stored::F8E4M3 => 1,
        }
    }
}

#[derive(Debug, Clone)]
struct TensorLocation {
    file: usize,
    dtype: Stored,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A source of named tensors.
pub struct WeightSource(Source);

enum Source {
    /// Memory-mapped safetensors files.
    SafeTensors { maps: Vec<Arc<Mmap>>, files: Vec<PathBuf>, index: HashMap<String, TensorLocation> },
    /// Random values of the requested shape, deterministic per (seed, name).
    Random { dtype: DType, seed: u64 },
}

fn map_dtype(dtype: StDtype) -> Option<Stored> {
    match dtype {
        StDtype::F32 => Some(Stored::Float(DType::F32)),
        StDtype::F16 => Some(Stored::Float(DType::F16)),
        StDtype::BF16 => Some(Stored::Float(DType::BF16)),
        StDtype::F8_E4M3 => Some(Stored::F8E4M3),
        _ => None,
    }
}

impl WeightSource {
    /// Opens `dir/model.safetensors`, or the shards named by `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<WeightSource, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let index = crate::config::read_json(&index_path)?;
            let map = index.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::InvalidJson {
                path: index_path.clone(),
                message: "no `weight_map` object".into(),
            })?;
            let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
            names.sort();
            names.dedup();
            names.iter().map(|n| dir.join(n)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(ModelError::NoWeights(dir.to_owned()));
            }
            vec![single]
        };
        Self::open_files(files)
    }

    pub fn open_files(files: Vec<PathBuf>) -> Result<WeightSource, ModelError> {
        let mut maps = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (file_idx, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
            // SAFETY: the file is opened read-only; ferrolm does not modify checkpoint files while
            // serving them (as every mmap-based loader assumes).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
            let corrupt = |message: String| ModelError::CorruptWeights { path: path.clone(), message };
            let st = SafeTensors::deserialize(&map).map_err(|e| corrupt(e.to_string()))?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.iter() {
                let dtype = map_dtype(view.dtype())
                    .ok_or_else(|| corrupt(format!("tensor `{name}` has unsupported dtype {:?}", view.dtype())))?;
                let data = view.data();
                let start = data.as_ptr() as usize - base;
                index.insert(
                    name.to_owned(),
                    TensorLocation {
                        file: file_idx,
                        dtype,
                        shape: view.shape().to_vec(),
                        start,
                        end: start + data.len(),
                    },
                );
            }
            maps.push(Arc::new(map));
        }
        Ok(WeightSource(Source::SafeTensors { maps, files, index }))
    }

    pub fn random(dtype: DType, seed: u64) -> WeightSource {
        WeightSource(Source::Random { dtype, seed })
    }

    pub fn contains(&self, name: &str) -> bool {
        match &self.0 {
            Source::SafeTensors { index, .. } => index.contains_key(name),
            Source::Random { .. } => true,
        }
    }

    /// Whether `name` is stored as FP8 (e4m3) codes.
    pub fn is_fp8(&self, name: &str) -> bool {
        match &self.0 {
            Source::SafeTensors { index, .. } => index.get(name).is_some_and(|loc| loc.dtype == Stored::F8E4M3),
            Source::Random { .. } => false,
        }
    }

    /// The shape `name` is stored with, if the checkpoint has it (random weights have none).
    pub fn shape_of(&self, name: &str) -> Option<&[usize]> {
        match &self.0 {
            Source::SafeTensors { index, .. } => index.get(name).map(|loc| loc.shape.as_slice()),
            Source::Random { .. } => None,
        }
    }

    /// The bytes of `name`, checked to be exactly `shape` of its stored dtype.
    fn bytes(&self, name: &str, shape: &[usize]) -> Result<(&Arc<Mmap>, &TensorLocation), ModelError> {
        let Source::SafeTensors { maps, files, index } = &self.0 else { unreachable!("random weights have no bytes") };
        let loc = index.get(name).ok_or_else(|| ModelError::MissingTensor(name.to_owned()))?;
        if loc.shape != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.to_owned(),
                expected: shape.to_vec(),
                found: loc.shape.clone(),
            });
        }
        let expected_bytes = shape.iter().product::<usize>() * loc.dtype.size_in_bytes();
        if loc.end - loc.start != expected_bytes {
            return Err(ModelError::CorruptWeights {
                path: files[loc.file].clone(),
                message: format!(
                    "tensor `{name}` holds {} bytes, its shape needs {expected_bytes}",
                    loc.end - loc.start
                ),
            });
        }
        Ok((&maps[loc.file], loc))
    }

    /// Loads `name`, checking that it has exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<HostTensor, ModelError> {
        if let Source::Random { dtype, seed } = &self.0 {
            return Ok(random_tensor(name, shape, *dtype, *seed));
        }
        let (map, loc) = self.bytes(name, shape)?;
        let Stored::Float(dtype) = loc.dtype else {
            return Err(ModelError::UnsupportedQuantization(format!(
                "tensor `{name}` is stored in FP8 (F8_E4M3), which is read only as the weight of a projection \
                 in an FP8 checkpoint (one whose config.json has a quantization_config)"
            )));
        };
        let map: SharedBytes = Arc::clone(map) as SharedBytes;
        Ok(HostTensor::from_bytes(map, loc.start, loc.end, dtype, shape.to_vec()))
    }

    /// A one-element tensor (a scale, stored with shape `[]`, `[1]` or `[1, 1]`) as f32.
    pub fn get_scalar(&self, name: &str) -> Result<f32, ModelError> {
        let shape = self.shape_of(name).ok_or_else(|| ModelError::MissingTensor(name.to_owned()))?.to_vec();
        if shape.iter().product::<usize>() != 1 {
            return Err(ModelError::ShapeMismatch { name: name.to_owned(), expected: vec![1], found: shape });
        }
        Ok(self.get_f32(name, &shape)?[0])
    }

    /// The e4m3 codes of FP8 tensor `name`, checking that it has exactly `shape`.
    pub fn get_fp8_codes(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>, ModelError> {
        let (map, loc) = self.bytes(name, shape)?;
        if loc.dtype != Stored::F8E4M3 {
            return Err(ModelError::Config(format!(
                "tensor `{name}` is {:?}, expected FP8 (F8_E4M3) codes",
                loc.dtype
            )));
        }
        Ok(map[loc.start..loc.end].to_vec())
    }

    /// Loads a small tensor (norm weights, biases) as f32 values.
    pub fn get_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(self.get(name, shape)?.to_f32_vec())
    }
}

fn name_seed(name: &str, seed: u64) -> u64 {
    // FNV-1a: deterministic across runs and platforms.
    name.bytes().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Elements of a random tensor generated per parallel task.
const RANDOM_CHUNK: usize = 1 << 16;

/// Random weights that keep activations in a sane range: norms near 1, matrices uniform with the
/// variance of a fan-in initialisation. Generated in parallel (an 8B model is 16 GB of them).
fn random_tensor(name: &str, shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    let n: usize = shape.iter().product();
    let is_norm = name.contains("norm");
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    let bound = if shape.len() == 1 { 0.02 } else { (3.0 / fan_in).sqrt() };
    let offset = if is_norm { 1.0 } else { 0.0 };
    let rng = ChaCha8Rng::seed_from_u64(name_seed(name, seed));
    let shape = shape.to_vec();
    match dtype {
        DType::F32 => HostTensor::from_f32(shape, uniform(n, &rng, bound, offset, |x| x)),
        DType::F16 => HostTensor::from_f16(shape, uniform(n, &rng, bound, offset, f16::from_f32)),
        DType::BF16 => HostTensor::from_bf16(shape, uniform(n, &rng, bound, offset, bf16::from_f32)),
    }
}

/// `n` values `offset + U(-bound, bound)` from one ChaCha8 stream, converted by `convert`.
///
/// Element `i` is made from word `i` of the stream alone, so each chunk jumps to its first word:
/// the values are those of one sequential draw, whatever the thread count.
fn uniform<T: Copy + Default + Send>(
    n: usize,
    rng: &ChaCha8Rng,
    bound: f32,
    offset: f32,
    convert: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); n];
    out.par_chunks_mut(RANDOM_CHUNK).enumerate().for_each(|(c, chunk)| {
        let mut rng = rng.clone();
        rng.set_word_pos((c * RANDOM_CHUNK) as u128);
        for x in chunk {
            *x = convert(offset + unit_interval(rng.next_u32()) * bound);
        }
    });
    out
}

/// A 32-bit word as a uniform value in [-1, 1) (its top 24 bits: exact in f32).
fn unit_interval(word: u32) -> f32 {
    (word >> 8) as f32 * (2.0 / (1u32 << 24) as f32) - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_random_weights_equal_one_sequential_draw() {
        let shape = [3, RANDOM_CHUNK + 7];
        let t = random_tensor("model.layers.0.mlp.up_proj.weight", &shape, DType::F32, 5);
        let mut rng = ChaCha8Rng::seed_from_u64(name_seed("model.layers.0.mlp.up_proj.weight", 5));
        let bound = (3.0 / shape[1] as f32).sqrt();
        let expected: Vec<f32> = (0..3 * shape[1]).map(|_| unit_interval(rng.next_u32()) * bound).collect();
        assert_eq!(t.to_f32_vec(), expected);

        let norm = random_tensor("model.norm.weight", &[64], DType::BF16, 5).to_f32_vec();
        assert!(norm.iter().all(|&w| (0.97..=1.03).contains(&w)), "{norm:?}");
        assert_eq!((unit_interval(0), unit_interval(u32::MAX)), (-1.0, 1.0 - 2.0 / (1u32 << 24) as f32));
    }
}
