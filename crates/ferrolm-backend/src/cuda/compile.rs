//! Compiling the kernels with NVRTC straight to the device's machine code (CUBIN), one module per
//! (kernel file, dtype) so that the modules compile on as many threads as the machine has, with
//! each binary cached on disk under `$XDG_CACHE_HOME/ferrolm` (or `~/.cache/ferrolm`), keyed by
//! a hash of the module's source, the architecture, the compile options (defines included) and
//! the NVRTC version.
//!
//! Machine code spares the driver its JIT compile of PTX at module load (most of a fresh start's
//! kernel time); PTX remains the fallback where NVRTC cannot emit machine code for the device.
//! The cache is an optimisation only: a directory that cannot be read or written, or a stale
//! file, falls back to compiling, never to an error.

use std::ffi::{c_char, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudarc::nvrtc::{self, sys, Ptx};

use super::GpuError;
use crate::DType;

/// One kernel file: its entry points come in every dtype (`FOR_EACH_DTYPE` in common.cuh) or
/// in the half types only (`FOR_EACH_HALF_DTYPE`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct KernelSource {
    pub(crate) file: &'static str,
    text: &'static str,
    /// Files whose device functions this one calls: compiled ahead of it in its modules, with
    /// no entry points of their own.
    uses: &'static [&'static KernelSource],
    half_only: bool,
}

const COMMON: &str = include_str!("kernels/common.cuh");

macro_rules! kernel_source {
    ($file:literal, $uses:expr, $half_only:expr) => {
        KernelSource { file: $file, text: include_str!(concat!("kernels/", $file)), uses: $uses, half_only: $half_only }
    };
}

pub(crate) const NORM: KernelSource = kernel_source!("norm.cu", &[], false);
pub(crate) const ELEMENTWISE: KernelSource = kernel_source!("elementwise.cu", &[], false);
pub(crate) const ROPE: KernelSource = kernel_source!("rope.cu", &[], false);
pub(crate) const ATTENTION: KernelSource = kernel_source!("attention.cu", &[], false);
pub(crate) const FLASH_ATTENTION: KernelSource = kernel_source!("flash_attention.cu", &[], true);
pub(crate) const DECODE_ATTENTION: KernelSource =
    kernel_source!("decode_attention.cu", &[&ATTENTION, &FLASH_ATTENTION], true);
pub(crate) const SAMPLING: KernelSource = kernel_source!("sampling.cu", &[], false);
pub(crate) const GEMV: KernelSource = kernel_source!("gemv.cu", &[&ELEMENTWISE, &ROPE], false);
pub(crate) const FP8: KernelSource = kernel_source!("fp8.cu", &[], false);
pub(crate) const FP8_GEMV: KernelSource = kernel_source!("fp8_gemv.cu", &[&ELEMENTWISE, &ROPE, &GEMV], true);
pub(crate) const MOE: KernelSource = kernel_source!("moe.cu", &[&ELEMENTWISE, &FLASH_ATTENTION], false);

/// Every kernel file, the slowest to compile first (so that they start first).
pub(crate) const SOURCES: [&KernelSource; 11] = [
    &ATTENTION,
    &DECODE_ATTENTION,
    &GEMV,
    &MOE,
    &SAMPLING,
    &FLASH_ATTENTION,
    &FP8_GEMV,
    &NORM,
    &ROPE,
    &FP8,
    &ELEMENTWISE,
];

/// The entry points an op family loads from one kernel file: `{name}_{dtype}` for each name and
/// each dtype the file has.
#[derive(Debug)]
pub(crate) struct KernelFamilies {
    pub(crate) source: &'static KernelSource,
    pub(crate) names: &'static [&'static str],
    /// Whether they may take more than the default 48 KiB of dynamic shared memory.
    pub(crate) large_shared: bool,
}

/// One module: a kernel file's entry points in one dtype.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unit {
    pub(crate) source: &'static KernelSource,
    pub(crate) dtype: DType,
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}]", self.source.file, dtype_suffix(self.dtype))
    }
}

impl Unit {
    /// Every module: each file in each of its dtypes, in [`SOURCES`]' order.
    pub(crate) fn all() -> Vec<Unit> {
        SOURCES.iter().flat_map(|&source| source.dtypes().iter().map(move |&dtype| Unit { source, dtype })).collect()
    }

    /// common.cuh, the files this one uses with their entry points left out, then this file
    /// with its entry points in `dtype` alone; each preceded by a `#line` directive so that
    /// compiler messages name the file.
    pub(crate) fn text(&self) -> String {
        let mut text = format!("#line 1 \"common.cuh\"\n{COMMON}\n");
        for used in self.source.uses {
            text.push_str(&instantiate(""));
            text.push_str(&format!("#line 1 \"{}\"\n{}\n", used.file, used.text));
        }
        let suffix = dtype_suffix(self.dtype);
        let ty = match self.dtype {
            DType::F32 => "float",
            DType::BF16 => "__nv_bfloat16",
            DType::F16 => "__half",
        };
        text.push_str(&instantiate(&format!("M({ty}, {suffix})")));
        text.push_str(&format!("#line 1 \"{}\"\n{}\n", self.source.file, self.source.text));
        text
    }
}

/// Redefines the instantiation macros of common.cuh to `entries` (the half-only one to nothing
/// for f32).
fn instantiate(entries: &str) -> String {
    let half = if entries.contains("float,") { "" } else { entries };
    format!(
        "#undef FOR_EACH_DTYPE\n#undef FOR_EACH_HALF_DTYPE\n#define FOR_EACH_DTYPE(M) {entries}\n\
         #define FOR_EACH_HALF_DTYPE(M) {half}\n"
    )
}

impl KernelSource {
    pub(crate) fn dtypes(&self) -> &'static [DType] {
        if self.half_only {
            &[DType::BF16, DType::F16]
        } else {
            &[DType::F32, DType::BF16, DType::F16]
        }
    }
}

/// What NVRTC is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    /// Machine code for `sm_XY`, loaded as it is.
    Cubin,
    /// PTX for `compute_XY`, which the driver compiles at module load.
    Ptx,
}

/// The device a compile is for and the options that change the code.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    /// Compute capability, e.g. `(9, 0)`.
    pub(crate) capability: (u32, u32),
    /// `NAME=VALUE` preprocessor definitions, for kernel variants.
    pub(crate) defines: Vec<String>,
}

impl Target {
    pub(crate) fn arch(&self, output: Output) -> String {
        let (major, minor) = self.capability;
        match output {
            Output::Cubin => format!("sm_{major}{minor}"),
            Output::Ptx => format!("compute_{major}{minor}"),
        }
    }
}

/// A compiled module, ready for `CudaContext::load_module`.
pub(crate) enum Image {
    Cubin(Vec<u8>),
    Ptx(String),
}

impl Image {
    pub(crate) fn into_ptx(self) -> Ptx {
        match self {
            Image::Cubin(bytes) => Ptx::from_binary(bytes),
            Image::Ptx(text) => Ptx::from_src(text),
        }
    }
}

pub(crate) struct Compiled {
    pub(crate) image: Image,
    pub(crate) from_cache: bool,
    /// Time spent compiling or reading the cache.
    pub(crate) took: Duration,
}

/// Compiles `unit` for `target` (from the cache when `use_cache` and a file is there; a fresh
/// compile is stored in the cache).
pub(crate) fn compile(unit: Unit, target: &Target, output: Output, use_cache: bool) -> Result<Compiled, GpuError> {
    let start = Instant::now();
    let source = unit.text();
    let arch = target.arch(output);
    let options = compile_options(&arch, &target.defines);
    let (major, minor) = nvrtc_version();
    let mut key_text = format!("{source}\n{arch}\n{major}.{minor}\n");
    for o in &options {
        key_text.push_str(o);
        key_text.push('\n');
    }
    let extension = match output {
        Output::Cubin => "cubin",
        Output::Ptx => "ptx",
    };
    let file_name = format!(
        "{}-{}-{:016x}.{extension}",
        unit.source.file.trim_end_matches(".cu"),
        dtype_suffix(unit.dtype),
        fnv1a(key_text.as_bytes())
    );
    let cache_file = cache_dir().map(|d| d.join(file_name));
    if use_cache {
        let cached = cache_file.as_deref().and_then(|p| std::fs::read(p).ok()).filter(|b| !b.is_empty());
        let image = cached.and_then(|bytes| match output {
            Output::Cubin => Some(Image::Cubin(bytes)),
            Output::Ptx => String::from_utf8(bytes).ok().map(Image::Ptx),
        });
        if let Some(image) = image {
            return Ok(Compiled { image, from_cache: true, took: start.elapsed() });
        }
    }
    let bytes = run_nvrtc(&unit.to_string(), &source, &options, output).map_err(|log| GpuError::Compile {
        module: unit.to_string(),
        arch: arch.clone(),
        log,
    })?;
    if let Some(path) = &cache_file {
        store(path, &bytes);
    }
    let image = match output {
        Output::Cubin => Image::Cubin(bytes),
        Output::Ptx => Image::Ptx(String::from_utf8_lossy(&bytes).into_owned()),
    };
    Ok(Compiled { image, from_cache: false, took: start.elapsed() })
}

/// [`compile`] of every unit, on up to one thread per core; the results in the units' order.
pub(crate) fn compile_all(
    units: &[Unit],
    target: &Target,
    output: Output,
    use_cache: bool,
) -> Vec<Result<Compiled, GpuError>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, units.len().max(1));
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<Result<Compiled, GpuError>>> = units.iter().map(|_| None).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&unit) = units.get(i) else { break };
                        done.push((i, compile(unit, target, output, use_cache)));
                    }
                    done
                })
            })
            .collect();
        for worker in workers {
            // A panic inside NVRTC's bindings (a missing symbol) goes on to `Gpu::new`, which
            // reports it as an error.
            let done = worker.join().unwrap_or_else(|payload| std::panic::resume_unwind(payload));
            for (i, result) in done {
                results[i] = Some(result);
            }
        }
    });
    results.into_iter().map(|r| r.expect("every unit was taken by a worker")).collect()
}

/// Compiles `source` and returns the CUBIN or the PTX, or the compiler's log.
fn run_nvrtc(name: &str, source: &str, options: &[String], output: Output) -> Result<Vec<u8>, String> {
    let c_source = CString::new(source).map_err(|e| e.to_string())?;
    let c_name = CString::new(name).map_err(|e| e.to_string())?;
    let prog = nvrtc::result::create_program(&c_source, Some(&c_name)).map_err(|e| format!("{e:?}"))?;
    // SAFETY: `prog` was created above and is destroyed once, below; the buffers are sized by
    // NVRTC's own size calls.
    let result = unsafe {
        let compiled = nvrtc::result::compile_program(prog, options);
        match compiled {
            Err(e) => {
                let log = nvrtc::result::get_program_log(prog).map(|l| c_text(&l)).unwrap_or_default();
                Err(format!("{e:?}: {}", log.trim().replace('\n', " | ")))
            }
            Ok(()) => match output {
                Output::Ptx => {
                    nvrtc::result::get_ptx(prog).map(|p| c_text(&p).into_bytes()).map_err(|e| format!("{e:?}"))
                }
                Output::Cubin => {
                    let mut size = 0usize;
                    let got = sys::nvrtcGetCUBINSize(prog, &mut size).result().and_then(|()| {
                        let mut bytes = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast()).result().map(|()| bytes)
                    });
                    got.map_err(|e| format!("no CUBIN: {e:?}"))
                }
            },
        }
    };
    // SAFETY: created above, used no more.
    let _ = unsafe { nvrtc::result::destroy_program(prog) };
    result
}

/// A NUL-terminated C string from NVRTC as text.
fn c_text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn compile_options(arch: &str, defines: &[String]) -> Vec<String> {
    let mut options = vec!["--std=c++17".to_string(), format!("--gpu-architecture={arch}")];
    if let Some(dir) = cuda_include_dir() {
        options.push(format!("--include-path={}", dir.display()));
    }
    options.extend(defines.iter().map(|d| format!("-D{d}")));
    options
}

/// A module's entry point of a kernel family in `dtype`, e.g. `rms_norm_bf16`.
pub(crate) fn entry_name(family: &str, dtype: DType) -> String {
    format!("{family}_{}", dtype_suffix(dtype))
}

pub(crate) fn dtype_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
    }
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
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        return (0, 0);
    }
    (major, minor)
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
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    static TMP: AtomicUsize = AtomicUsize::new(0);
    let tmp = dir.join(format!(".kernels-{}-{}.tmp", std::process::id(), TMP.fetch_add(1, Ordering::Relaxed)));
    let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&tmp, bytes));
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
    use crate::cuda::KERNELS;

    fn families() -> impl Iterator<Item = &'static KernelFamilies> {
        KERNELS.iter().flat_map(|f| f.iter())
    }

    /// Every module compiles to machine code for Ampere (cp.async paths) and Hopper (bulk and
    /// tensor copies) wherever NVRTC can be loaded, and holds every entry point its op families
    /// load, so that a missing or misnamed kernel fails here: CI installs NVRTC from PyPI
    /// (`.ci/run`), so kernel source errors show there, not first on a GPU machine. Without
    /// NVRTC it says so and passes.
    #[test]
    fn kernels_compile_for_ampere_and_hopper() {
        // SAFETY: only tries to dlopen NVRTC's candidate file names.
        if !unsafe { sys::is_culib_present() } {
            eprintln!("skipping: NVRTC not found (LD_LIBRARY_PATH); CI installs it");
            return;
        }
        let units = Unit::all();
        for capability in [(8, 0), (9, 0)] {
            let target = Target { capability, defines: Vec::new() };
            let compiled = compile_all(&units, &target, Output::Cubin, false);
            for (unit, c) in units.iter().zip(compiled) {
                let Image::Cubin(bytes) = c.unwrap_or_else(|e| panic!("{e}")).image else {
                    panic!("{unit}: not a CUBIN")
                };
                for family in families().filter(|f| f.source == unit.source) {
                    for name in family.names {
                        // A symbol name, NUL-terminated in the ELF string table.
                        let symbol = format!("\0{}\0", entry_name(name, unit.dtype));
                        let found = bytes.windows(symbol.len()).any(|w| w == symbol.as_bytes());
                        assert!(found, "{unit} for {capability:?}: no entry point {}", symbol.trim_matches('\0'));
                    }
                }
            }
            // The decode kernel's bulk and tensor copies are Hopper's alone.
            let unit = Unit { source: &DECODE_ATTENTION, dtype: DType::BF16 };
            let Image::Ptx(ptx) = compile(unit, &target, Output::Ptx, false).expect("PTX").image else {
                panic!("{unit}: not PTX")
            };
            let hopper = capability.0 >= 9;
            assert_eq!(ptx.contains("cp.async.bulk.shared"), hopper, "{capability:?}");
            assert_eq!(ptx.contains("cp.async.bulk.tensor.3d"), hopper, "{capability:?}");
            // FP8 codes are converted by the hardware's instruction from sm_89 on, by moving bits
            // before.
            let unit = Unit { source: &GEMV, dtype: DType::BF16 };
            let Image::Ptx(ptx) = compile(unit, &target, Output::Ptx, false).expect("PTX").image else {
                panic!("{unit}: not PTX")
            };
            assert_eq!(ptx.contains("cvt.rn.f16x2.e4m3x2"), hopper, "{capability:?}");
            // The GEMV's experiments compile where asked for (the L2 prefetch shows), and only there.
            let both = vec!["GEMV_L2_PREFETCH=1".to_string(), "GEMV_TAIL_ROUND=1".to_string()];
            for (defines, prefetches) in [(Vec::new(), false), (both, true)] {
                for dtype in [DType::BF16, DType::F32] {
                    let unit = Unit { source: &GEMV, dtype };
                    let target = Target { capability, defines: defines.clone() };
                    let Image::Ptx(ptx) = compile(unit, &target, Output::Ptx, false).expect("PTX").image else {
                        panic!("{unit}: not PTX")
                    };
                    assert_eq!(ptx.contains("prefetch.global.L2"), prefetches, "{unit} {defines:?}");
                }
            }
        }
    }

    #[test]
    fn every_family_is_loaded_from_a_module_once() {
        let mut seen = std::collections::HashSet::new();
        for family in families() {
            assert!(SOURCES.contains(&family.source), "{}", family.source.file);
            for name in family.names {
                assert!(seen.insert(*name), "{name} is listed twice");
            }
        }
        // Every file has entry points someone loads.
        for source in SOURCES {
            assert!(families().any(|f| f.source == source), "{}", source.file);
        }
    }

    #[test]
    fn a_module_has_its_files_and_one_dtypes_entries() {
        let unit = Unit { source: &GEMV, dtype: DType::F16 };
        let text = unit.text();
        let at = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("no {needle}"));
        assert!(at("#line 1 \"common.cuh\"") < at("#line 1 \"elementwise.cu\""));
        assert!(at("#line 1 \"elementwise.cu\"") < at("#line 1 \"rope.cu\""));
        assert!(at("#line 1 \"rope.cu\"") < at("#line 1 \"gemv.cu\""));
        for file in [&ELEMENTWISE, &ROPE, &GEMV] {
            assert!(text.contains(file.text), "{}", file.file);
        }
        // The used files instantiate nothing; gemv.cu its f16 entries only.
        let last = text.rfind("#define FOR_EACH_DTYPE(M)").expect("redefined");
        assert!(last < at("#line 1 \"gemv.cu\""));
        assert!(text[last..].starts_with("#define FOR_EACH_DTYPE(M) M(__half, f16)\n"));
        assert_eq!(text.matches("#define FOR_EACH_DTYPE(M) \n").count(), 2);
        assert!(instantiate("M(float, f32)").contains("#define FOR_EACH_HALF_DTYPE(M) \n"));
        assert_eq!(Unit::all().len(), 3 * SOURCES.len() - 3);
    }

    #[test]
    fn cache_keys_differ_with_their_input() {
        assert_ne!(fnv1a(b"sm_90"), fnv1a(b"sm_80"));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
