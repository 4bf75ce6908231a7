#!/usr/bin/env python3
"""Compiles ferrolm's CUDA kernels without a GPU: the modules the backend builds at start-up (one
per kernel file and dtype, as `Unit::text` in cuda/compile.rs puts them together: common.cuh, the
files the kernel file uses without their entry points, then the file with its entry points in
one dtype), through NVRTC to PTX, then through ptxas for the resource report (registers, shared
memory, stack frame and spills) of each kernel.

Needs NVRTC, the CUDA headers and ptxas, e.g. from the PyPI wheels nvidia-cuda-nvrtc,
nvidia-cuda-runtime, nvidia-cuda-cccl and nvidia-cuda-nvcc (13.0) unpacked under one folder:

    tools/check_kernels.py [--cuda DIR] [--arch compute_90] [--dtype bf16] [--filter NAME]
                           [--define NAME=VALUE ...] [--ptx-dir DIR]

DIR holds lib/libnvrtc.so.13, include/ and bin/ptxas (default: $CUDA_HOME, else
/usr/local/cuda). Exits non-zero when NVRTC or ptxas fails, or when a kernel spills.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "ferrolm-backend", "src", "cuda")


TYPES = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half"}


def kernel_sources():
    """`{const name: (file, [used const names], half_only)}` from compile.rs's `kernel_source!` lines,
    and the order of `SOURCES`."""
    compile_rs = open(os.path.join(ROOT, "compile.rs")).read()
    found = re.findall(
        r'const (\w+): KernelSource =\s*kernel_source!\("([\w.]+)",\s*&\[([^\]]*)\],\s*(true|false)\)', compile_rs
    )
    if not found:
        sys.exit("no kernel_source! lines found in compile.rs")
    sources = {name: (file, re.findall(r"&(\w+)", uses), half == "true") for name, file, uses, half in found}
    order = re.search(r"SOURCES: \[&KernelSource; \d+\] =\s*\[([^\]]*)\]", compile_rs)
    names = re.findall(r"&(\w+)", order.group(1)) if order else list(sources)
    return sources, names


def instantiate(entries):
    """compile.rs's `instantiate`: the instantiation macros redefined to `entries`."""
    half = "" if "float," in entries else entries
    return (
        "#undef FOR_EACH_DTYPE\n#undef FOR_EACH_HALF_DTYPE\n"
        f"#define FOR_EACH_DTYPE(M) {entries}\n#define FOR_EACH_HALF_DTYPE(M) {half}\n"
    )


def module_source(sources, name, dtype):
    """The module of kernel file `name` in `dtype`, as `Unit::text` builds it."""
    read = lambda file: open(os.path.join(ROOT, "kernels", file)).read()
    file, uses, _ = sources[name]
    text = f'#line 1 "common.cuh"\n{read("common.cuh")}\n'
    for used in uses:
        text += instantiate("") + f'#line 1 "{sources[used][0]}"\n{read(sources[used][0])}\n'
    text += instantiate(f"M({TYPES[dtype]}, {dtype})") + f'#line 1 "{file}"\n{read(file)}\n'
    return text


def nvrtc_compile(lib, source, options):
    prog = ctypes.c_void_p()
    check = lambda r, what: r == 0 or sys.exit(f"nvrtc {what} failed: {r}")
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"ferrolm.cu", 0, None, None), "create")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    status = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if text:
        print(text)
    if status != 0:
        sys.exit(f"NVRTC failed ({status})")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--dtype", default="bf16", choices=sorted(TYPES), help="the modules' dtype")
    ap.add_argument("--filter", default="", help="only report kernels whose name contains this")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, as --kernel-defines")
    ap.add_argument("--ptx-dir", help="also write each module's PTX here")
    args = ap.parse_args()
    lib_dir = next(d for d in ["lib", "lib64"] if os.path.isdir(os.path.join(args.cuda, d)))
    # NVRTC dlopens its builtins library by name: load it first so that no search path is needed.
    for builtins in sorted(os.listdir(os.path.join(args.cuda, lib_dir))):
        if builtins.startswith("libnvrtc-builtins.so"):
            ctypes.CDLL(os.path.join(args.cuda, lib_dir, builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(os.path.join(args.cuda, lib_dir, "libnvrtc.so.13"))
    options = ["--std=c++17", f"--gpu-architecture={args.arch}", f"--include-path={args.cuda}/include"]
    options += [f"-D{d}" for d in args.define]
    sm = args.arch.replace("compute_", "sm_")
    sources, order = kernel_sources()
    spills, kernels = [], 0
    for name in order:
        file, _, half_only = sources[name]
        if half_only and args.dtype == "f32":
            continue
        ptx = nvrtc_compile(lib, module_source(sources, name, args.dtype), options)
        kernels += len(re.findall(r"\.entry", ptx))
        if args.ptx_dir:
            open(os.path.join(args.ptx_dir, f"{file}.{args.dtype}.ptx"), "w").write(ptx)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        out = tempfile.mktemp(suffix=".cubin")
        res = subprocess.run(
            [os.path.join(args.cuda, "bin", "ptxas"), "-v", f"--gpu-name={sm}", f.name, "-o", out],
            capture_output=True,
            text=True,
        )
        os.unlink(f.name)
        if res.returncode != 0:
            print(res.stderr)
            sys.exit(f"ptxas failed on {file} ({args.dtype})")
        os.unlink(out)
        kernel = None
        for line in res.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                kernel = m.group(1)
                continue
            if kernel and args.filter in kernel and ("registers" in line or "spill" in line):
                if "registers" in line:
                    print(f"{kernel:<48} {line.split('info    :')[-1].strip()}")
                if re.search(r"[1-9]\d* bytes spill", line):
                    spills.append(kernel)
    print(f"{kernels} kernels compiled for {sm} ({args.dtype} modules)")
    if spills:
        sys.exit(f"kernels that spill: {', '.join(sorted(set(spills)))}")


if __name__ == "__main__":
    main()
