//! Models of ferrolm: configuration, weights and the one decoder that runs every supported
//! family over a flattened, paged batch, on any [`ferrolm_backend::Device`].

pub mod activations;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decoder;
pub mod input;
pub mod kv_groups;
pub mod model;
pub mod rope;
pub mod runner;
pub mod weights;

use std::path::{Path, PathBuf};

pub use activations::Activations;
pub use config::{Architecture, GenerationConfig, ModelConfig};
pub use decoder::{Decoder, StepRows};
pub use ferrolm_backend::{GatedActivation, HostTensor};
pub use input::{KvCache, ModelInput};
pub use kv_groups::KvCacheGroup;
pub use model::Model;
pub use runner::{apply_rows, sampled_tokens, CpuRunner, ModelRunner};
pub use weights::WeightSource;

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
    #[error("unsupported quantization: {0}")]
    UnsupportedQuantization(String),
    #[error("missing tensor `{0}` in the checkpoint")]
    MissingTensor(String),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Gpu(#[from] ferrolm_backend::cuda::GpuError),
    #[error("a step was launched before the KV cache was allocated")]
    NoKvCache,
    #[error("collect with no step launched")]
    NothingLaunched,
    #[error("previous token {what} {index} is outside the step's {len}")]
    PreviousToken { what: &'static str, index: u32, len: usize },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch { name: String, expected: Vec<usize>, found: Vec<usize> },
}

/// The CPU device cannot fail.
impl From<std::convert::Infallible> for ModelError {
    fn from(never: std::convert::Infallible) -> ModelError {
        match never {}
    }
}

impl ModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> ModelError {
        ModelError::Io { path: path.to_owned(), source }
    }
}
