//! The errors of the CUDA backend: each displays as one readable line.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("CUDA driver library libcuda.so not found: is an NVIDIA driver installed?")]
    NoDriver,
    #[error("CUDA library lib{0}.so not found: is the CUDA toolkit's lib64 directory on LD_LIBRARY_PATH?")]
    MissingLibrary(&'static str),
    #[error("the NVIDIA driver supports CUDA {found_major}.{found_minor}, ferrolm needs CUDA 13.0 or newer")]
    DriverTooOld { found_major: i32, found_minor: i32 },
    #[error("no CUDA device {ordinal}: this machine has {count}")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("CUDA setup failed: {0}")]
    Setup(String),
    #[error("NVRTC failed to compile kernel module {module} for {arch}: {log}")]
    Compile { module: String, arch: String, log: String },
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    #[error("cuBLAS call failed: {0}")]
    Blas(#[from] CublasError),
    #[error("cuBLASLt call failed: {0}")]
    BlasLt(#[from] cudarc::cublaslt::result::CublasError),
    #[error("{op}: {reason}")]
    Unsupported { op: &'static str, reason: String },
}

impl GpuError {
    /// Whether the error says this machine has no usable GPU (no driver, no CUDA libraries, no
    /// device, or a driver too old), as opposed to a GPU that is there and failed. GPU tests skip
    /// on the first kind only.
    pub fn means_no_gpu(&self) -> bool {
        use cudarc::driver::sys::CUresult;
        match self {
            GpuError::NoDriver | GpuError::MissingLibrary(_) | GpuError::DriverTooOld { .. } => true,
            GpuError::NoDevice { .. } => true,
            GpuError::Driver(DriverError(code)) => {
                matches!(code, CUresult::CUDA_ERROR_NO_DEVICE | CUresult::CUDA_ERROR_STUB_LIBRARY)
            }
            _ => false,
        }
    }
}
