//! The device handle: its context, the one stream every op runs on, a cuBLAS handle, the
//! compiled kernels and the helpers that launch them, the device's attributes and the
//! [`GpuOptions`] it was opened with. State of one op family lives with that family (the decode
//! attention's workspace in `PagedAttention`, the tuned GEMM plans in `Gemms`), so this module
//! imports no op module.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::sys::{
    cuLaunchKernelEx, CUfunction, CUgraphInstantiate_flags, CUlaunchAttribute, CUlaunchAttributeID,
    CUlaunchAttributeValue, CUlaunchConfig, CUstreamCaptureMode,
};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
};

use super::compile::{self, entry_name, Compiled, Output, Target, Unit};
use super::GpuError;
use crate::DType;

/// cuBLAS's workspace, set once so that GEMMs inside a captured graph allocate nothing.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Timed runs of [`Gpu::time_us`] (after one untimed run).
const TIMED_REPS: usize = 5;

/// Oldest driver API the cudarc bindings were generated for (`cuda-13000`).
const MIN_DRIVER_VERSION: i32 = 13000;

/// Lets `f` take all the shared memory a block may opt into: `max_shared_per_block` less what the
/// kernel declares statically (asking for more than that is `CUDA_ERROR_INVALID_VALUE`).
fn allow_dynamic_shared(f: &CudaFunction, max_shared_per_block: i32) -> Result<(), GpuError> {
    let static_bytes = f.shared_size_bytes()?;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        max_shared_per_block - static_bytes,
    )?;
    Ok(())
}

/// How a [`Gpu`] compiles and launches its kernels. `Default` is what a server runs with; the
/// switches exist to compare variants on one binary. Filled in one place (the command line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuOptions {
    /// Launch kernels with programmatic dependent launch on compute capability 9.0 and later
    /// (see [`Launch`]); off launches plainly.
    pub programmatic_launch: bool,
    /// Unsplit tensor-core decodes may take the kernel with a head block per warp; off keeps the
    /// block-per-head-block kernel.
    pub decode_warp_items: bool,
    /// The per-warp decode kernel copies its K/V tiles as tensor-map boxes where it can
    /// (compute capability 9.0 and later).
    pub decode_tensor_copies: bool,
    /// `NAME=VALUE` preprocessor definitions every kernel module is compiled with (kernel
    /// variants for experiments; part of the compile cache's key).
    pub kernel_defines: Vec<String>,
    /// FP8 GEMMs take cuBLASLt's fast accumulation where it has it: the tensor cores' running
    /// sums are never promoted to f32 along k (see `gemm_tune`'s module note); off keeps the
    /// promotions. GEMMs over 128 x 128 weight blocks promote either way.
    pub fp8_fast_accumulation: bool,
    /// FP8 matrices in 128 x 128 blocks take cuBLASLt's block-scaled FP8 GEMM beyond the FP8
    /// GEMV's rows (their inputs quantized per token and 128 columns; the default); off, they
    /// take a copy dequantized to the compute dtype on every call.
    pub fp8_block_gemm: bool,
}

impl Default for GpuOptions {
    fn default() -> GpuOptions {
        GpuOptions {
            programmatic_launch: true,
            decode_warp_items: true,
            decode_tensor_copies: false,
            kernel_defines: Vec::new(),
            fp8_fast_accumulation: true,
            fp8_block_gemm: true,
        }
    }
}

/// The priority of a [`Gpu`]'s stream among the device's streams (benchmarks and tests ask for
/// another than the default: `bench-internals`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "bench-internals"), allow(dead_code))]
pub enum StreamPriority {
    /// What a stream gets unless asked otherwise.
    Default,
    /// The highest the device offers.
    Highest,
}

/// One CUDA device: the handle every op is issued through.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Held for the handle's lifetime (see [`BLAS_WORKSPACE_BYTES`]).
    _blas_workspace: CudaSlice<u8>,
    kernels: HashMap<(&'static str, DType), CudaFunction>,
    name: String,
    compute_capability: (u32, u32),
    /// Dynamic shared memory a block may opt into, in bytes.
    max_shared_per_block: usize,
    /// Kernels are launched with programmatic stream serialization (compute capability 9.0 and
    /// later, unless [`GpuOptions::programmatic_launch`] is off); see [`Launch`].
    programmatic_launch: bool,
    /// The cuBLAS workspace's address (see [`BLAS_WORKSPACE_BYTES`]), which cuBLASLt shares.
    blas_workspace_ptr: u64,
    /// Streaming multiprocessors, and the shared memory each has for blocks.
    multiprocessors: usize,
    max_shared_per_multiprocessor: usize,
    /// What the `Gpu` was opened with; op families read their switches here.
    options: GpuOptions,
}

impl Gpu {
    /// Opens device `ordinal`: checks that the driver, NVRTC and cuBLAS libraries can be loaded
    /// before any CUDA call (so that a machine without them gets an error, not a panic), then
    /// creates the context, the stream and the cuBLAS handle, and compiles (or loads from the
    /// disk cache) the kernels for the device's architecture.
    pub fn new(ordinal: usize, options: &GpuOptions) -> Result<Gpu, GpuError> {
        Gpu::open_checked(ordinal, StreamPriority::Default, options)
    }

    /// [`Gpu::new`] with its stream at `priority`. Two `Gpu`s of one device share its primary
    /// context, so each may read the other's buffers; where both have work queued, the block
    /// scheduler starts the blocks of the higher-priority stream first.
    #[cfg(feature = "bench-internals")]
    pub fn new_with_priority(ordinal: usize, priority: StreamPriority, options: &GpuOptions) -> Result<Gpu, GpuError> {
        Gpu::open_checked(ordinal, priority, options)
    }

    /// [`Gpu::open`] once the libraries are known to load, with cudarc's panics as errors.
    fn open_checked(ordinal: usize, priority: StreamPriority, options: &GpuOptions) -> Result<Gpu, GpuError> {
        check_libraries()?;
        // cudarc panics when a library lacks a symbol it binds (an older driver, say): report
        // that as an error too.
        std::panic::catch_unwind(|| Gpu::open(ordinal, priority, options)).unwrap_or_else(|payload| {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(GpuError::Setup(msg))
        })
    }

    fn open(ordinal: usize, priority: StreamPriority, options: &GpuOptions) -> Result<Gpu, GpuError> {
        let mut version = 0;
        // SAFETY: the pointer is valid for a write; the driver library was found above.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }.result()?;
        if version < MIN_DRIVER_VERSION {
            return Err(GpuError::DriverTooOld { found_major: version / 1000, found_minor: version % 1000 / 10 });
        }
        cudarc::driver::result::init()?;
        let count = CudaContext::device_count()?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: every buffer of this `Gpu` is used on its single stream, so stream order alone
        // keeps reads, writes and frees in sequence.
        unsafe { ctx.disable_event_tracking() };
        let stream = match priority {
            StreamPriority::Default => ctx.new_stream()?,
            StreamPriority::Highest => {
                let (_least, greatest) = cudarc::driver::result::stream::get_priority_range()?;
                ctx.new_stream_with_priority(greatest)?
            }
        };
        let blas = CudaBlas::new(stream.clone())?;
        // Default math (so no TF32 for f32 GEMMs) with every reduction kept in f32: by default
        // cuBLAS may sum split-K partial products in the f16/bf16 output type, which costs bf16
        // and f16 outputs several ulps.
        let mode = blas_sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
        // SAFETY: the handle is live.
        unsafe { blas_sys::cublasSetMathMode(*blas.handle(), mode) }.result()?;
        let blas_workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        let workspace_ptr = {
            let (ptr, _no_event) = blas_workspace.device_ptr(&stream);
            ptr
        };
        // SAFETY: the handle is live and the buffer outlives it (both are fields of the `Gpu`,
        // the workspace declared after the handle so that it is dropped after it).
        unsafe { blas_sys::cublasSetWorkspace_v2(*blas.handle(), workspace_ptr as *mut _, BLAS_WORKSPACE_BYTES) }
            .result()?;

        let (major, minor) = ctx.compute_capability()?;
        let max_shared_per_block =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let target = Target { capability: (major as u32, minor as u32), defines: options.kernel_defines.clone() };
        let kernels = load_kernels(&ctx, &target, max_shared_per_block)?;
        let programmatic_launch = major >= 9 && options.programmatic_launch;
        let multiprocessors = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let max_shared_per_multiprocessor =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?;
        Ok(Gpu {
            programmatic_launch,
            blas_workspace_ptr: workspace_ptr,
            multiprocessors: multiprocessors.max(1) as usize,
            max_shared_per_multiprocessor: max_shared_per_multiprocessor.max(0) as usize,
            options: options.clone(),
            name: ctx.name()?,
            compute_capability: (major as u32, minor as u32),
            max_shared_per_block: max_shared_per_block.max(0) as usize,
            ctx,
            stream,
            blas,
            _blas_workspace: blas_workspace,
            kernels,
        })
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(major, minor)`, e.g. `(9, 0)` for Hopper.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), GpuError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Waits for all work issued so far; surfaces errors of kernels that already ran.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize()?;
        self.ctx.check_err()?;
        Ok(())
    }

    /// The stream every op of this `Gpu` is issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copies `data` into a new device buffer (an index buffer, typically).
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, GpuError> {
        if data.is_empty() {
            return Ok(self.stream.null()?);
        }
        Ok(self.stream.clone_htod(data)?)
    }

    /// Copies `data` into the start of `dst`, a buffer reused from step to step.
    pub fn upload_into<T: DeviceRepr>(&self, data: &[T], dst: &mut CudaSlice<T>) -> Result<(), GpuError> {
        assert!(data.len() <= dst.len(), "upload_into: {} elements do not fit in {}", data.len(), dst.len());
        if data.is_empty() {
            return Ok(());
        }
        Ok(self.stream.memcpy_htod(data, dst)?)
    }

    /// Copies a device buffer back to the host (waits for the work that writes it).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, src: &CudaSlice<T>) -> Result<Vec<T>, GpuError> {
        if src.is_empty() {
            return Ok(Vec::new());
        }
        let out = self.stream.clone_dtoh(src)?;
        self.synchronize()?;
        Ok(out)
    }

    /// Records the launches `issue` makes on this `Gpu`'s stream into a graph instead of running
    /// them, and returns the graph. Nothing may synchronize or copy from host memory inside;
    /// buffers `issue` uses must stay where they are for as long as the graph is replayed. On an
    /// error the capture is ended and nothing is kept.
    pub fn capture(&self, issue: impl FnOnce() -> Result<(), GpuError>) -> Result<GpuGraph, GpuError> {
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let issued = issue();
        let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
        issued?;
        match ended? {
            Some(graph) => Ok(GpuGraph { graph }),
            None => Err(GpuError::Setup("graph capture recorded nothing".into())),
        }
    }

    /// The raw stream, for driver and cuBLAS calls made directly. Makes this `Gpu`'s context
    /// current on the calling thread first, as those calls need (the engine may call from
    /// another thread than the one that opened the device).
    pub(crate) fn raw_stream(&self) -> Result<cudarc::driver::sys::CUstream, GpuError> {
        self.ctx.bind_to_thread()?;
        Ok(self.stream.cu_stream())
    }

    /// The cuBLAS handle, with this `Gpu`'s context made current on the calling thread.
    pub(crate) fn blas_handle(&self) -> Result<blas_sys::cublasHandle_t, GpuError> {
        self.ctx.bind_to_thread()?;
        Ok(*self.blas.handle())
    }

    pub(crate) fn max_shared_per_block(&self) -> usize {
        self.max_shared_per_block
    }

    /// Has `cublasGemmEx` choose kernels for `count` streaming multiprocessors (all of them with
    /// `None`, the default): a GEMM running beside another stream's kernels leaves them the
    /// rest. Tuned cuBLASLt plans keep the kernels they were chosen with.
    #[cfg(feature = "bench-internals")]
    pub fn set_gemm_sm_count_target(&self, count: Option<usize>) -> Result<(), GpuError> {
        let count = count.map_or(0, |c| c.clamp(1, self.multiprocessors)) as i32;
        // SAFETY: the handle is live.
        unsafe { blas_sys::cublasSetSmCountTarget(self.blas_handle()?, count) }.result()?;
        Ok(())
    }

    /// The cuBLAS workspace, `(address, bytes)`, which cuBLASLt GEMMs share in stream order.
    pub(crate) fn blas_workspace(&self) -> (u64, usize) {
        (self.blas_workspace_ptr, BLAS_WORKSPACE_BYTES)
    }

    /// The options this `Gpu` was opened with.
    pub fn options(&self) -> &GpuOptions {
        &self.options
    }

    /// Mean microseconds of `issue` over [`TIMED_REPS`] runs after one untimed run, by device
    /// events (the untimed run keeps the device busy while the host queues the timed ones).
    pub(crate) fn time_us(&self, mut issue: impl FnMut() -> Result<(), GpuError>) -> Result<f32, GpuError> {
        issue()?;
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let ctx = self.stream.context();
        let (start, end) = (ctx.new_event(flags)?, ctx.new_event(flags)?);
        start.record(&self.stream)?;
        for _ in 0..TIMED_REPS {
            issue()?;
        }
        end.record(&self.stream)?;
        Ok(start.elapsed_ms(&end)? * 1000.0 / TIMED_REPS as f32)
    }

    /// Blocks of `shared_bytes` dynamic shared memory that fit on one SM at once, by shared
    /// memory alone (the runtime reserves 1 KiB per block).
    pub(crate) fn blocks_per_multiprocessor(&self, shared_bytes: usize) -> usize {
        (self.max_shared_per_multiprocessor / (shared_bytes + 1024)).max(1)
    }

    /// Streaming multiprocessors (132 on an H200).
    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    /// A launch of kernel `name` for activations of `dtype`, on this `Gpu`'s stream.
    pub(crate) fn launch_builder<'a>(&'a self, name: &'static str, dtype: DType) -> Launch<'a> {
        let f = self.kernels.get(&(name, dtype)).unwrap_or_else(|| panic!("kernel {name} was not loaded"));
        Launch { gpu: self, func: f.cu_function(), args: Vec::new() }
    }

    /// The raw device address of an index buffer, for a kernel argument.
    pub(crate) fn index_ptr<T>(&self, buf: &impl DevicePtr<T>) -> u64 {
        let (ptr, _no_event) = buf.device_ptr(&self.stream);
        ptr
    }
}

/// One kernel launch being built: its arguments, by reference, in the kernel's parameter order.
///
/// On devices that support it (compute capability 9.0 and later) every launch allows
/// programmatic dependent launch: the kernel's blocks may start before the previous kernel on
/// the stream has finished. Every kernel of this crate waits for its predecessor with
/// `pdl_wait` (kernels/common.cuh) before it touches memory an earlier kernel uses, so this only
/// overlaps one kernel's launch and prologue (weight loads, L2 prefetches) with the tail of the
/// one before. Copies, cuBLAS GEMMs and graph launches keep full stream order.
pub(crate) struct Launch<'a> {
    gpu: &'a Gpu,
    func: CUfunction,
    args: Vec<*mut c_void>,
}

impl<'a> Launch<'a> {
    /// Appends one argument; it must stay alive (it is borrowed) until the launch.
    pub(crate) fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Queues the kernel on the `Gpu`'s stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and the
    /// memory they point to must be valid for what the kernel does with it.
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), GpuError> {
        let stream = self.gpu.raw_stream()?;
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: u32::from(self.gpu.programmatic_launch),
        };
        // SAFETY: the caller vouches for the arguments; `config` and `attr` outlive the call.
        unsafe { cuLaunchKernelEx(&config, self.func, self.args.as_mut_ptr(), std::ptr::null_mut()) }.result()?;
        Ok(())
    }
}

/// Launches captured by [`Gpu::capture`], replayed on the same stream as one unit.
pub struct GpuGraph {
    graph: CudaGraph,
}

// SAFETY: a CUDA graph may be used from any thread, one at a time; `launch` takes `&self` but
// the graph is only reachable through its owner, which `&mut`-borrows it per step in practice
// and is itself moved between threads, never shared (the engine's runner is `Send`, not `Sync`).
unsafe impl Send for GpuGraph {}

impl GpuGraph {
    /// Queues one replay of the captured launches.
    pub fn launch(&self) -> Result<(), GpuError> {
        Ok(self.graph.launch()?)
    }
}

/// One block per row with up to 1024 threads striding over `width` columns.
pub(crate) fn rows_config(rows: usize, width: usize) -> LaunchConfig {
    let threads = (width.div_ceil(32) * 32).clamp(32, 1024) as u32;
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Asserts that `value` fits the kernels' 32-bit sizes.
pub(crate) fn to_u32(op: &str, what: &str, value: usize) -> u32 {
    u32::try_from(value).unwrap_or_else(|_| panic!("{op}: {what} {value} exceeds the kernels' 32-bit range"))
}

fn check_libraries() -> Result<(), GpuError> {
    // SAFETY: each call only tries to dlopen the library's candidate file names.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Err(GpuError::NoDriver);
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(GpuError::MissingLibrary("nvrtc"));
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Err(GpuError::MissingLibrary("cublas"));
        }
        if !cudarc::cublaslt::sys::is_culib_present() {
            return Err(GpuError::MissingLibrary("cublasLt"));
        }
    }
    Ok(())
}

/// Compiles (or reads from the disk cache) every kernel module for `target`, loads each, and
/// returns the entry points of every op family by (name, dtype).
fn load_kernels(
    ctx: &Arc<CudaContext>,
    target: &Target,
    max_shared_per_block: i32,
) -> Result<HashMap<(&'static str, DType), CudaFunction>, GpuError> {
    let units = Unit::all();
    let start = Instant::now();
    let compiled = compile::compile_all(&units, target, Output::Cubin, true);
    let compile_time = start.elapsed();
    let cached = compiled.iter().filter(|c| c.as_ref().is_ok_and(|c| c.from_cache)).count();
    for (unit, c) in units.iter().zip(&compiled) {
        if let Some(c) = c.as_ref().ok().filter(|c| !c.from_cache) {
            tracing::info!(module = %unit, seconds = c.took.as_secs_f64(), "kernel module compiled");
        }
    }
    let start = Instant::now();
    let mut kernels = HashMap::new();
    for (&unit, compiled) in units.iter().zip(compiled) {
        let module = load_unit(ctx, unit, target, compiled)?;
        let families = super::KERNELS.iter().flat_map(|f| f.iter()).filter(|f| f.source == unit.source);
        for family in families {
            for &name in family.names {
                let f = module.load_function(&entry_name(name, unit.dtype))?;
                if family.large_shared {
                    allow_dynamic_shared(&f, max_shared_per_block)?;
                }
                kernels.insert((name, unit.dtype), f);
            }
        }
    }
    tracing::info!(
        modules = units.len(),
        from_cache = cached,
        compile_seconds = compile_time.as_secs_f64(),
        load_seconds = start.elapsed().as_secs_f64(),
        arch = %target.arch(Output::Cubin),
        "kernels ready"
    );
    Ok(kernels)
}

/// Loads one module: the CUBIN compiled or read from the cache; a cached one the driver rejects
/// is compiled afresh; where NVRTC made no CUBIN or the driver takes none, PTX, which the driver
/// compiles itself.
fn load_unit(
    ctx: &Arc<CudaContext>,
    unit: Unit,
    target: &Target,
    compiled: Result<Compiled, GpuError>,
) -> Result<Arc<CudaModule>, GpuError> {
    let load = |c: Compiled| ctx.load_module(c.image.into_ptx()).map_err(GpuError::from);
    let failed = match compiled {
        Ok(c) if c.from_cache => {
            load(c).or_else(|_| compile::compile(unit, target, Output::Cubin, false).and_then(load))
        }
        Ok(c) => load(c),
        Err(e) => Err(e),
    };
    let cubin_error = match failed {
        Ok(module) => return Ok(module),
        Err(e) => e,
    };
    tracing::warn!(module = %unit, error = %cubin_error, "no machine code: loading PTX for the driver to compile");
    let ptx = compile::compile(unit, target, Output::Ptx, true)?;
    if ptx.from_cache {
        return load(ptx).or_else(|_| compile::compile(unit, target, Output::Ptx, false).and_then(load));
    }
    load(ptx)
}
