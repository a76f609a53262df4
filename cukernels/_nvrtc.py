"""NVRTC called directly (ctypes): PTX or cubin of a source string, and ptxas's resource report, with no GPU.

CuPy's own compile path asks the driver for the device's architecture; NVRTC itself does not need a device. pip's
``nvidia-cuda-nvrtc-cu12`` provides ``libnvrtc.so.12`` (the 'test' extra); on a GPU machine the NVRTC that CuPy
uses serves as well. The family-level helpers built on this (``_loader.compile_ptx``, ``compile_cubin``,
``list_entries``, ``resource_usage``) are what ``python -m cukernels.build`` makes the wheel's binaries with, what
tests/test_compile.py checks every family with, and how ``_loader.precompile`` lists a family's entry points.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import re
import sys


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
    try:  # the NVRTC CuPy 14 finds through cuda-pathfinder (a CUDA toolkit or the nvidia-* wheels)
        from cuda import pathfinder

        return ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception as e:  # noqa: BLE001 - any failure here just means: not found
        errors.append(f"cuda.pathfinder: {e}")
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


def parse_usage(log: str) -> dict[str, dict[str, int]]:
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


def compile(src: str, family: str, opts: tuple[str, ...], cubin: bool = False):
    """(PTX text, or cubin bytes with ``cubin``; the log) of ``src``, named ``<family>.cu`` in messages; raises
    RuntimeError with the NVRTC log when it does not compile."""
    lib = _lib()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{family}.cu".encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed ({rc}) for {family}.cu")
    try:
        enc = [o.encode() for o in opts]
        arr = (ctypes.c_char_p * len(enc))(*enc)
        rc = lib.nvrtcCompileProgram(prog, len(enc), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if rc != 0:
            arch = next((o for o in opts if o.startswith("--gpu-architecture")), "")
            raise RuntimeError(f"kernels_cu/{family}.cu failed to compile ({arch}):\n{text}")
        if cubin:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, buf)
            return buf.raw, text
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode(), text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
