"""Find ``kernels_cu/``, read a kernel family's source, compile it once per device with ``cupy.RawModule``.

* The source handed to NVRTC is self-contained: ``#include "common/x.cuh"`` lines are replaced by the header
  text. CuPy's disk cache keys on the source string and the options only, so inlining is what makes a header
  edit recompile every family that uses it (and NVRTC needs no include path, on the GPU machine or in the
  CPU-only compile test).
* Each kernel instantiation is a plain ``extern "C"`` entry point (a thin wrapper around a template), never a
  ``name_expressions`` lookup: those are reported never to load from CuPy's disk cache (cupy/cupy#9667).
* CuPy compiles for the current device's architecture (``-arch=sm_XX``, cubin when NVRTC supports it).
"""
from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(?!__launch_bounds__)(\w+)\s*\(')
OPTIONS = ("--std=c++17",)
# Families that only compile for an architecture-specific target (wgmma, setmaxnreg: sm_90a). CuPy appends its
# own -arch=sm_XX after the user's options; NVRTC given both -arch=sm_90a and -arch=sm_90 (either order) compiles
# for sm_90a (checked with NVRTC 12.9 and 13.5), so the extra option is all the runtime path needs.
ARCH = {"attention_sm90": "sm_90a"}


def options(family: str) -> tuple[str, ...]:
    """NVRTC options for a family: OPTIONS, plus -arch=<target> for the families in ARCH."""
    return OPTIONS + ((f"-arch={ARCH[family]}",) if family in ARCH else ())


def archs(family: str) -> tuple[str, ...]:
    """The architectures a family is compiled for in tests/test_compile.py."""
    return (ARCH[family],) if family in ARCH else ("sm_80", "sm_90")


class KernelCompileError(RuntimeError):
    """A kernel file failed to compile; the message carries the file name and the NVRTC log."""


def kernel_dir() -> Path:
    """``kernels_cu`` shipped inside the installed package, else the one beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (cand / "common").is_dir():
            return cand
    raise FileNotFoundError(f"kernels_cu/ not found next to {here} or in {here.parent}")


def families() -> list[str]:
    """Names of every kernel family (``kernels_cu/<family>.cu``)."""
    return sorted(p.stem for p in kernel_dir().glob("*.cu"))


@functools.lru_cache(maxsize=None)
def load_source(family: str) -> str:
    """The family's source with every quoted include inlined (each header once)."""
    root = kernel_dir()
    path = root / f"{family}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel family {family!r}: {path} does not exist")
    seen: set[Path] = set()

    def expand(p: Path) -> str:
        def repl(m: re.Match) -> str:
            inc = (p.parent / m.group(1)).resolve()
            if not inc.is_file():
                inc = (root / m.group(1)).resolve()
            if inc in seen:
                return ""
            seen.add(inc)
            return f"// ---- begin {m.group(1)}\n{expand(inc)}\n// ---- end {m.group(1)}\n"

        return _INCLUDE.sub(repl, p.read_text())

    return f"// cukernels: {family}.cu\n" + expand(path)


def entry_points(family: str) -> list[str]:
    """Every ``extern "C"`` kernel the family defines (macro-generated ones are found in the compiled PTX)."""
    return _ENTRY.findall(load_source(family))


_lock = threading.Lock()
_family_locks: dict[tuple[str, int], threading.Lock] = {}
_modules: dict[tuple[str, int], object] = {}


def get_module(family: str):
    import cupy

    dev = cupy.cuda.Device().id
    key = (family, dev)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            flock = _family_locks.setdefault(key, threading.Lock())
        with flock:  # one compile per family; different families compile concurrently
            mod = _modules.get(key)
            if mod is None:
                src = load_source(family)
                mod = cupy.RawModule(code=src, options=options(family))
                try:
                    mod.compile()
                except cupy.cuda.compiler.CompileException as e:  # carries the NVRTC log
                    raise KernelCompileError(f"kernels_cu/{family}.cu failed to compile:\n{e}") from None
                _modules[key] = mod
    return mod


def precompile(names=None, workers: int | None = None) -> list[str]:
    """Compile (or load from CuPy's disk cache) every kernel family now, in parallel threads (NVRTC releases
    the GIL), so the first op call does not pay for it. Returns the families loaded."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import cupy

    dev = cupy.cuda.Device().id
    cc = cupy.cuda.Device(dev).compute_capability
    # An ARCH family builds only for its own architecture (sm_90a code does not load on other GPUs): skipped on
    # the others, named or not (the list returned says what was loaded).
    fams = [f for f in (list(names) if names else families()) if f not in ARCH or ARCH[f][3:].rstrip("a") == cc]

    def one(f):
        with cupy.cuda.Device(dev):
            get_module(f)

    with ThreadPoolExecutor(workers or max(1, min(len(fams), os.cpu_count() or 1))) as ex:
        list(ex.map(one, fams))
    return fams


@functools.lru_cache(maxsize=None)
def _function(family: str, name: str, dev: int):
    mod = get_module(family)
    try:
        return mod.get_function(name)
    except Exception as e:
        raise KernelCompileError(f"kernels_cu/{family}.cu has no kernel {name!r}: {e}") from None


def get_function(family: str, name: str):
    """The compiled kernel ``name`` of ``kernels_cu/<family>.cu`` on the current device."""
    import cupy

    return _function(family, name, cupy.cuda.Device().id)
