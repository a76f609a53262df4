"""Compile a kernel family to PTX through NVRTC directly (ctypes), with no GPU and no CUDA toolkit.

CuPy's own compile path asks the driver for the device's architecture; NVRTC itself does not need a device.
pip's ``nvidia-cuda-nvrtc-cu12`` provides ``libnvrtc.so.12``; this is what the CPU-only CI uses to prove every
kernel instantiation compiles for sm_80 and sm_90.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import re
import sys

from ._loader import OPTIONS, load_source


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    cands = []
    for base in sys.path:
        cands += glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))
        cands += glob.glob(os.path.join(base, "nvidia", "cu13", "lib", "libnvrtc.so*"))
    cands = [c for c in cands if "builtins" not in c and ".alt." not in c]
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    cands += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    errors = []
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError as e:
            errors.append(f"{c}: {e}")
    raise OSError("libnvrtc not found; install nvidia-cuda-nvrtc-cu12 (the 'test' extra). Tried:\n" + "\n".join(errors))


def available() -> bool:
    try:
        _lib()
        return True
    except OSError:
        return False


def version() -> tuple[int, int]:
    lib = _lib()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_ptx(family: str, arch: str = "sm_90", extra: tuple[str, ...] = ()) -> str:
    """PTX of ``kernels_cu/<family>.cu`` for ``arch`` (``sm_80``, ``sm_90``); raises RuntimeError with the log."""
    return _compile(family, f"--gpu-architecture=compute_{arch.split('_')[1]}", extra)[0]


def resource_usage(family: str, arch: str = "sm_90") -> dict[str, dict[str, int]]:
    """ptxas's report per kernel (machine code for ``arch``): registers, stack frame and spill bytes.

    A stack frame or spill means a register array went to local memory (run-time indexing, or a
    ``__launch_bounds__`` register cap too tight for the kernel's live values): slow, and caught by
    tests/test_compile.py.
    """
    _, log = _compile(family, f"--gpu-architecture={arch}", ("--ptxas-options=-v",))
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = out.setdefault(m.group(1), dict(registers=0, stack=0, spill_stores=0, spill_loads=0))
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes cumulative stack size", line)
        if m:
            cur["stack"] = max(cur["stack"], int(m.group(1)))
    return out


def _compile(family: str, arch_opt: str, extra: tuple[str, ...]) -> tuple[str, str]:
    lib = _lib()
    src = load_source(family).encode()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{family}.cu".encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed ({rc}) for {family}.cu")
    try:
        # -ftz=true: what CuPy adds to every NVRTC compile (cupy/cuda/compiler.py), so the PTX and ptxas's report
        # here are those of the kernels that run (flush-to-zero float math: session 5 found a float compare of
        # a subnormal with 0 true on the device).
        opts = [o.encode() for o in (*OPTIONS, "-ftz=true", arch_opt, *extra)]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError(f"kernels_cu/{family}.cu failed to compile ({arch_opt}):\n{log.value.decode(errors='replace')}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode(), log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
