#!/usr/bin/env python3
"""Compiles ferrolm's CUDA kernels without a GPU: the same single module that the backend builds
at start-up (the files in the order of `SOURCES` in cuda/compile.rs), through NVRTC to PTX, then
through ptxas for the resource report (registers, shared memory, stack frame and spills) of each
kernel.

Needs NVRTC, the CUDA headers and ptxas, e.g. from the PyPI wheels nvidia-cuda-nvrtc,
nvidia-cuda-runtime, nvidia-cuda-cccl and nvidia-cuda-nvcc (13.0) unpacked under one folder:

    tools/check_kernels.py [--cuda DIR] [--arch compute_90] [--filter NAME] [--ptx OUT.ptx]

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


def module_source():
    compile_rs = open(os.path.join(ROOT, "compile.rs")).read()
    names = re.findall(r'\("([\w.]+)", include_str!\("kernels/([\w.]+)"\)\)', compile_rs)
    if not names:
        sys.exit("no SOURCES found in compile.rs")
    parts = []
    for name, file in names:
        parts.append(f'#line 1 "{name}"\n')
        parts.append(open(os.path.join(ROOT, "kernels", file)).read())
        parts.append("\n")
    return "".join(parts)


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
    ap.add_argument("--filter", default="", help="only report kernels whose name contains this")
    ap.add_argument("--ptx", help="also write the PTX here")
    args = ap.parse_args()
    lib_dir = next(d for d in ["lib", "lib64"] if os.path.isdir(os.path.join(args.cuda, d)))
    # NVRTC dlopens its builtins library by name: load it first so that no search path is needed.
    for builtins in sorted(os.listdir(os.path.join(args.cuda, lib_dir))):
        if builtins.startswith("libnvrtc-builtins.so"):
            ctypes.CDLL(os.path.join(args.cuda, lib_dir, builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(os.path.join(args.cuda, lib_dir, "libnvrtc.so.13"))
    options = ["--std=c++17", f"--gpu-architecture={args.arch}", f"--include-path={args.cuda}/include"]
    ptx = nvrtc_compile(lib, module_source(), options)
    if args.ptx:
        open(args.ptx, "w").write(ptx)
    sm = args.arch.replace("compute_", "sm_")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = tempfile.mktemp(suffix=".cubin")
    res = subprocess.run([os.path.join(args.cuda, "bin", "ptxas"), "-v", f"--gpu-name={sm}", f.name, "-o", out],
                         capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr)
        sys.exit("ptxas failed")
    spills, kernel = [], None
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
    print(f"{len(re.findall(r'.entry', ptx))} kernels compiled for {sm}")
    if spills:
        sys.exit(f"kernels that spill: {', '.join(sorted(set(spills)))}")


if __name__ == "__main__":
    main()
