//! Models of ferrolm: configuration, weights and the decoder that runs every supported family
//! over a flattened, paged batch.

pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod input;
pub mod model;
pub mod rope;
pub mod runner;
pub mod weights;

use std::path::{Path, PathBuf};

pub use config::{Activation, Architecture, GenerationConfig, ModelConfig};
pub use input::{KvCache, ModelInput};
pub use model::Model;
pub use runner::{apply_rows, sampled_tokens, CpuRunner, ModelRunner};
pub use weights::{Tensor, WeightSource};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid JSON: {message}")]
    InvalidJson { path: PathBuf, message: String },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("unsupported architecture `{name}`; supported: {supported}")]
    UnsupportedArchitecture { name: String, supported: String },
    #[error("no weights in {0}: expected model.safetensors or model.safetensors.index.json")]
    NoWeights(PathBuf),
    #[error("corrupt or truncated safetensors file {path}: {message}")]
    CorruptWeights { path: PathBuf, message: String },
    #[error("missing tensor `{0}` in the checkpoint")]
    MissingTensor(String),
    #[error("device error: {0}")]
    Device(String),
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch { name: String, expected: Vec<usize>, found: Vec<usize> },
}

impl ModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> ModelError {
        ModelError::Io { path: path.to_owned(), source }
    }
}
