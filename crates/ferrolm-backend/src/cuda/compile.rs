//! Compiling the kernels with NVRTC for the device's own architecture, with the PTX cached on
//! disk under `$XDG_CACHE_HOME/ferrolm` (or `~/.cache/ferrolm`), keyed by a hash of the source,
//! the architecture, the compile options and the NVRTC version.
//!
//! The cache is an optimisation only: a directory that cannot be read or written, or a stale
//! file, falls back to compiling, never to an error.

use std::path::{Path, PathBuf};

use cudarc::nvrtc::{self, CompileError, CompileOptions};

use super::GpuError;

/// The kernel sources, concatenated in this order into one module.
const SOURCES: [(&str, &str); 9] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("rope.cu", include_str!("kernels/rope.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("flash_attention.cu", include_str!("kernels/flash_attention.cu")),
    ("decode_attention.cu", include_str!("kernels/decode_attention.cu")),
    ("sampling.cu", include_str!("kernels/sampling.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
];

/// The module's PTX text and whether it came from the disk cache.
pub(crate) struct KernelPtx {
    pub(crate) text: String,
    pub(crate) from_cache: bool,
}

/// Returns the PTX of every kernel for `arch` (`compute_XY`): from the cache when `use_cache`
/// and a file is there, else compiled (and then stored in the cache).
pub(crate) fn kernels_ptx(arch: &str, use_cache: bool) -> Result<KernelPtx, GpuError> {
    let source = module_source();
    let options = compile_options(arch);
    let (major, minor) = nvrtc_version();
    let mut key_text = format!("{source}\n{arch}\n{major}.{minor}\n");
    for o in &options {
        key_text.push_str(o);
        key_text.push('\n');
    }
    let cache_file = cache_dir().map(|d| d.join(format!("kernels-{:016x}.ptx", fnv1a(key_text.as_bytes()))));
    if use_cache {
        if let Some(text) = cache_file.as_deref().and_then(|p| std::fs::read_to_string(p).ok()) {
            return Ok(KernelPtx { text, from_cache: true });
        }
    }
    let opts = CompileOptions { options, ..Default::default() };
    let ptx = nvrtc::compile_ptx_with_opts(&source, opts).map_err(|e| compile_error(arch, e))?;
    let text = ptx.to_src();
    if let Some(path) = &cache_file {
        store(path, &text);
    }
    Ok(KernelPtx { text, from_cache: false })
}

/// All kernel files in one translation unit, each preceded by a `#line` directive so that
/// compiler messages name the file.
fn module_source() -> String {
    let mut source = String::new();
    for (name, text) in SOURCES {
        source.push_str(&format!("#line 1 \"{name}\"\n"));
        source.push_str(text);
        source.push('\n');
    }
    source
}

fn compile_options(arch: &str) -> Vec<String> {
    let mut options = vec!["--std=c++17".to_string(), format!("--gpu-architecture={arch}")];
    if let Some(dir) = cuda_include_dir() {
        options.push(format!("--include-path={}", dir.display()));
    }
    // Kernel variants for experiments: `FERROLM_KERNEL_DEFINES="NAME=VALUE ..."` (part of the
    // cache key, as every option is).
    if let Ok(defines) = std::env::var("FERROLM_KERNEL_DEFINES") {
        options.extend(defines.split_whitespace().map(|d| format!("-D{d}")));
    }
    options
}

/// Where `cuda_bf16.h` lives: /usr/local/cuda/include, else under `$CUDA_HOME` or `$CUDA_PATH`.
/// `None` leaves NVRTC to its built-in headers.
fn cuda_include_dir() -> Option<PathBuf> {
    let candidates = std::iter::once(PathBuf::from("/usr/local/cuda"))
        .chain(["CUDA_HOME", "CUDA_PATH"].into_iter().filter_map(std::env::var_os).map(PathBuf::from));
    candidates.map(|root| root.join("include")).find(|dir| dir.join("cuda_bf16.h").is_file())
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes; the library was checked present (by `Gpu::new`
    // or the caller).
    let status = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return (0, 0);
    }
    (major, minor)
}

fn compile_error(arch: &str, e: CompileError) -> GpuError {
    let log = match e {
        CompileError::CompileError { log, .. } => log.to_string_lossy().trim().replace('\n', " | "),
        other => format!("{other:?}"),
    };
    GpuError::Compile { arch: arch.to_string(), log }
}

fn cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir,
        _ => PathBuf::from(std::env::var_os("HOME")?).join(".cache"),
    };
    Some(base.join("ferrolm"))
}

/// Writes the cache file through a temporary file and a rename, so that a reader never sees a
/// partial file; any failure leaves the cache as it was.
fn store(path: &Path, text: &str) {
    let Some(dir) = path.parent() else { return };
    let tmp = dir.join(format!(".kernels-{}.tmp", std::process::id()));
    let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&tmp, text));
    if written.and_then(|()| std::fs::rename(&tmp, path)).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// 64-bit FNV-1a: stable across Rust releases, unlike `DefaultHasher`.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gpu::{entry_name, kernel_entries};

    /// Every kernel compiles for Ampere (cp.async paths) and Hopper (bulk and tensor copies)
    /// wherever NVRTC can be loaded, and the PTX assembles with ptxas for sm_80 and sm_90 where
    /// `$CUDA_HOME/bin/ptxas` is (inline assembly is checked there only): CI installs both from
    /// PyPI (`.ci/run`), so kernel source errors show there, not first on a GPU machine. Without
    /// NVRTC it says so and passes.
    #[test]
    fn kernels_compile_for_ampere_and_hopper() {
        // SAFETY: only tries to dlopen NVRTC's candidate file names.
        if !unsafe { nvrtc::sys::is_culib_present() } {
            eprintln!("skipping: NVRTC not found (LD_LIBRARY_PATH); CI installs it");
            return;
        }
        let ptxas = std::env::var_os("CUDA_HOME").map(|home| PathBuf::from(home).join("bin/ptxas"));
        let ptxas = ptxas.filter(|p| p.is_file());
        let mut assembling = Vec::new();
        for arch in ["compute_80", "compute_90"] {
            let ptx = kernels_ptx(arch, false).unwrap_or_else(|e| panic!("{arch}: {e}"));
            // Every entry point a `Gpu` loads, so that a missing or misnamed kernel fails here.
            for (family, dtype, _) in kernel_entries() {
                let kernel = entry_name(family, dtype);
                assert!(ptx.text.contains(&format!(".entry {kernel}(")), "{arch}: no {kernel}");
            }
            // The decode kernel's bulk and tensor copies are Hopper's alone.
            assert_eq!(ptx.text.contains("cp.async.bulk.shared"), arch == "compute_90", "{arch}");
            assert_eq!(ptx.text.contains("cp.async.bulk.tensor.3d"), arch == "compute_90", "{arch}");
            if let Some(ptxas) = &ptxas {
                let sm = arch.replace("compute_", "sm_");
                let file = std::env::temp_dir().join(format!("ferrolm-kernels-{sm}-{}.ptx", std::process::id()));
                std::fs::write(&file, &ptx.text).expect("the PTX is written");
                let child = std::process::Command::new(ptxas)
                    .arg(format!("-arch={sm}"))
                    .arg(&file)
                    .args(["-o", "/dev/null"])
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("ptxas starts");
                assembling.push((sm, file, child));
            }
        }
        if ptxas.is_none() {
            eprintln!("ptxas not found under CUDA_HOME: the PTX was not assembled (CI installs it)");
        }
        for (sm, file, child) in assembling {
            let out = child.wait_with_output().expect("ptxas runs");
            let _ = std::fs::remove_file(&file);
            assert!(out.status.success(), "ptxas -arch={sm}: {}", String::from_utf8_lossy(&out.stderr));
        }
    }

    #[test]
    fn every_source_is_in_the_module() {
        let source = module_source();
        for (name, text) in SOURCES {
            assert!(source.contains(&format!("#line 1 \"{name}\"")), "{name}");
            assert!(source.contains(text), "{name}");
        }
    }

    #[test]
    fn cache_keys_differ_with_their_input() {
        assert_ne!(fnv1a(b"compute_90"), fnv1a(b"compute_80"));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
