"""Kernels for the launchers: find ``kernels_cu/``, and hand out a compiled entry point in about a second.

``get_function(family, name)`` finds kernel ``name`` of ``kernels_cu/<family>.cu`` on the current device, from
the first of these that has it:

1. a module this process already loaded;
2. a **prebuilt binary** of the whole family: ``cukernels/_prebuilt/<family>.<arch>.<key>.cubin``. The wheel ships
   them (``python -m cukernels.build`` writes them, in a checkout too); ``key`` hashes the family's source with its
   headers inlined, the NVRTC options and the architecture, so a binary built from other source is never loaded.
   sm_80 binaries serve every 8.x GPU, sm_90 (sm_90a for the wgmma family) the H100 / H200;
3. the **JIT**: NVRTC compiles this one entry point, not its family (the family's source with ``CK_ONE_ENTRY`` and
   ``CK_WANT_<name>`` defined ahead of it: kernels_cu/common/entry.cuh), through ``cupy.RawModule``, whose disk
   cache (``~/.cupy/kernel_cache``, or ``$CUPY_CACHE_DIR``) keys on the source and options -- so on the entry
   too -- and makes every later process start warm. The first fallback of a process prints one line saying why.

``CUKERNELS_PREBUILT=0`` in the environment skips step 2 (the GPU suite runs once that way, once from a wheel).

Why per entry: NVRTC's time goes into generating code, and a family is up to 186 instantiations of a few
templates. Whole families, sm_90 cubin, one core of the CPU machine: gemv 128 s (96 entries), rms_norm 45 s
(186); one entry of either 0.3-1.5 s. (``python -m cukernels.build --report``; benchmarks/NOTES.md, "Start-up".)

Source handling: ``#include "common/x.cuh"`` lines are replaced by the header text, so the source handed to NVRTC
is self-contained and a header edit changes every key that depends on it. Entry points are plain ``extern "C"``
functions, never ``name_expressions`` lookups (those are reported never to load from CuPy's disk cache,
cupy/cupy#9667).
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import threading
from pathlib import Path

from . import _nvrtc

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
# A CK_ENTRY(attributes, name) head whose name is written out (macro-generated names are pasted with ##).
_LITERAL_ENTRY = re.compile(r"\bCK_ENTRY\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*?,\s*(\w+)\)\s*\(")
OPTIONS = ("--std=c++17",)
# What CuPy adds to every NVRTC compile (cupy/cuda/compiler.py); the prebuilt binaries are built with it too, so
# they are the code the JIT would make.
CUPY_OPTIONS = ("-ftz=true",)
# Families that only compile for an architecture-specific target (wgmma, setmaxnreg: sm_90a). CuPy appends its
# own -arch=sm_XX after the user's options; NVRTC given both -arch=sm_90a and -arch=sm_90 (either order) compiles
# for sm_90a (checked with NVRTC 12.9 and 13.5), so the extra option is all the runtime path needs.
ARCH = {"attention_sm90": "sm_90a"}
# The architectures the wheel ships binaries for (an ARCH family: its own target only). sm_80 code runs on every
# 8.x GPU (A100, A10, L4, RTX 30 / 40); sm_90 on the H100 / H200. Other GPUs take the JIT path.
SHIPPED = ("sm_80", "sm_90")
PREBUILT_DIR = Path(__file__).resolve().parent / "_prebuilt"


def options(family: str) -> tuple[str, ...]:
    """NVRTC options for a family: OPTIONS, plus -arch=<target> for the families in ARCH."""
    return OPTIONS + ((f"-arch={ARCH[family]}",) if family in ARCH else ())


def archs(family: str) -> tuple[str, ...]:
    """The architectures a family is built for (the wheel's binaries, tests/test_compile.py)."""
    return (ARCH[family],) if family in ARCH else SHIPPED


def binary_arch(family: str, cc: int) -> str | None:
    """The shipped architecture whose binary runs ``family`` on a GPU of compute capability ``cc`` (80, 86, 90
    ...), or None (the JIT path)."""
    if family in ARCH:
        return ARCH[family] if int(ARCH[family][3:].rstrip("a")) == cc else None
    if 80 <= cc < 90:
        return "sm_80"
    return "sm_90" if cc == 90 else None


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


def source(family: str, entries=None, *, listing: bool = False) -> str:
    """What NVRTC compiles: the whole family (``entries`` None), only the named entry points, or (``listing``)
    nothing but an empty marker kernel per entry point (kernels_cu/common/entry.cuh)."""
    if listing:
        return "#define CK_LIST_ENTRIES\n" + load_source(family)
    if entries is None:
        return load_source(family)
    head = "#define CK_ONE_ENTRY\n" + "".join(f"#define CK_WANT_{e} ~, 1\n" for e in entries)
    return head + load_source(family)


def literal_entries(family: str) -> list[str]:
    """The entry points whose names are written out in the source (macro-generated ones are listed by
    ``list_entries``, which preprocesses). Comments are skipped."""
    text = re.sub(r"//[^\n]*", "", (kernel_dir() / f"{family}.cu").read_text())
    return _LITERAL_ENTRY.findall(text)


def prebuilt_key(family: str, arch: str) -> str:
    """The key of a family's prebuilt binary: a hash of its inlined source, the compile options and the
    architecture (16 hex digits)."""
    opts = " ".join((*options(family), *CUPY_OPTIONS, f"-arch={arch}"))
    h = hashlib.sha256(f"{load_source(family)}\0{opts}\0{arch}".encode())
    return h.hexdigest()[:16]


def prebuilt_path(family: str, arch: str, root: Path | None = None) -> Path:
    return (root or PREBUILT_DIR) / f"{family}.{arch}.{prebuilt_key(family, arch)}.cubin"


# --------------------------------------------------------------------- NVRTC, no GPU: checks, the build, listing
def arch_options(family: str, arch: str, real: bool) -> tuple[str, ...]:
    """The options the loader's JIT compiles ``family`` with for ``arch`` (``sm_80``, ``sm_90``, ``sm_90a``):
    ``real`` for machine code (cubin), else PTX for the virtual architecture."""
    target = arch if real else "compute_" + arch.split("_")[1]
    return (*OPTIONS, *CUPY_OPTIONS, f"--gpu-architecture={target}")


def compile_ptx(family: str, arch: str = "sm_90", extra: tuple[str, ...] = (), entries=None) -> str:
    """PTX of ``kernels_cu/<family>.cu`` (only the named ``entries`` when given) for ``arch``; raises
    RuntimeError with the NVRTC log."""
    return _nvrtc.compile(source(family, entries), family, arch_options(family, arch, False) + tuple(extra))[0]


def compile_cubin(family: str, arch: str = "sm_90", entries=None, verbose: bool = False) -> tuple[bytes, str]:
    """Machine code of the family (only ``entries`` when given) for ``arch``, and the compile log (with
    ``verbose``, ptxas's per-kernel report: see ``parse_usage``)."""
    extra = ("--ptxas-options=-v",) if verbose else ()
    return _nvrtc.compile(source(family, entries), family, arch_options(family, arch, True) + extra, cubin=True)


def list_entries(family: str, arch: str = "sm_90") -> list[str]:
    """Every entry point the family defines for ``arch`` (sorted), macro-generated ones included: a PTX compile of
    the family in CK_LIST_ENTRIES mode, which generates no kernel code (a fraction of a second)."""
    ptx = _nvrtc.compile(source(family, listing=True), family, arch_options(family, arch, False))[0]
    return sorted(set(re.findall(r"\.entry\s+(\w+)__ck_entry\b", ptx)))


def resource_usage(family: str, arch: str = "sm_90", entries=None) -> dict[str, dict[str, int]]:
    """ptxas's report per kernel (machine code for ``arch``): registers, stack frame and spill bytes.

    A stack frame or spill means a register array went to local memory (run-time indexing, or a
    ``__launch_bounds__`` register cap too tight for the kernel's live values): slow, and refused by
    tests/test_compile.py and ``python -m cukernels.build``.
    """
    return _nvrtc.parse_usage(compile_cubin(family, arch, entries, verbose=True)[1])


# ------------------------------------------------------------------------------------------- the runtime path
_lock = threading.Lock()
_locks: dict = {}
_functions: dict = {}   # (family, name, device) -> cupy RawKernel
_modules: dict = {}     # (family, device) -> cupy RawModule of the prebuilt binary, or None when there is none
stats = {"prebuilt": 0, "jit": 0}  # family binaries loaded, entries compiled (or read from CuPy's cache) by the JIT
_noted: list = []


def _key_lock(key) -> threading.Lock:
    with _lock:
        return _locks.setdefault(key, threading.Lock())


def _capability(dev: int) -> int:
    import cupy

    return int(cupy.cuda.Device(dev).compute_capability)


def _prebuilt_enabled() -> bool:
    return os.environ.get("CUKERNELS_PREBUILT", "1").strip().lower() not in ("0", "false", "no", "off")


def _note(family: str, why: str) -> None:
    """One line on stderr, the first time a process falls back to the JIT."""
    if _noted:
        return
    _noted.append(family)
    print(f"cukernels: compiling each kernel on its first use ({why}): about a second each, once; later runs load "
          f"them from CuPy's kernel cache. `python -m cukernels.build` prebuilds them all.", file=sys.stderr)


def prebuilt_choice(family: str, cc: int) -> tuple[Path | None, str | None]:
    """(the prebuilt binary to load for ``family`` on a GPU of compute capability ``cc``, None) or (None, why the
    JIT path is taken)."""
    arch = binary_arch(family, cc)
    if not _prebuilt_enabled():
        return None, "CUKERNELS_PREBUILT=0"
    if arch is None:
        return None, f"no prebuilt binaries for sm_{cc}"
    path = prebuilt_path(family, arch)
    if path.is_file():
        return path, None
    if not PREBUILT_DIR.is_dir():
        return None, "this install has no prebuilt binaries"
    if any(PREBUILT_DIR.glob(f"{family}.{arch}.*.cubin")):
        return None, f"the prebuilt {family} binary was built from other source"
    return None, f"no prebuilt {family} binary for {arch}"


def _family_module(family: str, dev: int, cc: int):
    """The prebuilt binary of ``family`` for this device, loaded once per device; None when there is none."""
    key = (family, dev)
    if key in _modules:
        return _modules[key]
    with _key_lock(key):
        if key not in _modules:
            import cupy

            path, why = prebuilt_choice(family, cc)
            mod = None
            if path is not None:
                with cupy.cuda.Device(dev):
                    mod = cupy.RawModule(path=str(path))
                stats["prebuilt"] += 1
            else:
                _note(family, why)
            _modules[key] = mod
    return _modules[key]


def _jit(family: str, name: str, dev: int):
    import cupy

    with cupy.cuda.Device(dev):
        mod = cupy.RawModule(code=source(family, [name]), options=options(family))
        try:
            mod.compile()
        except cupy.cuda.compiler.CompileException as e:  # carries the NVRTC log
            raise KernelCompileError(f"kernels_cu/{family}.cu ({name}) failed to compile:\n{e}") from None
        stats["jit"] += 1
        return mod


def get_function(family: str, name: str):
    """The compiled kernel ``name`` of ``kernels_cu/<family>.cu`` on the current device (a ``cupy.RawKernel``)."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (family, name, dev)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _key_lock(key):
        fn = _functions.get(key)
        if fn is None:
            mod = _family_module(family, dev, _capability(dev))
            if mod is None:
                mod = _jit(family, name, dev)
            try:
                fn = mod.get_function(name)
            except Exception as e:
                raise KernelCompileError(f"kernels_cu/{family}.cu has no kernel {name!r}: {e}") from None
            _functions[key] = fn
    return fn


def precompile(names=None, workers: int | None = None) -> list[str]:
    """Make every kernel of the named families (default: all) ready now, so that no op call waits for NVRTC:
    families with a prebuilt binary for this GPU are loaded; the others have each entry point compiled (or read
    from CuPy's disk cache) in parallel threads (NVRTC releases the GIL). Returns the families made ready (an
    ARCH family is skipped on GPUs it does not build for)."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy

    dev = cupy.cuda.Device().id
    cc = _capability(dev)
    fams = [f for f in (list(names) if names else families())
            if f not in ARCH or int(ARCH[f][3:].rstrip("a")) == cc]
    todo = []
    for f in fams:
        if _family_module(f, dev, cc) is None:
            arch = binary_arch(f, cc) or f"sm_{cc}"
            todo += [(f, e) for e in list_entries(f, arch)]
    # Longest compiles first (gemv's entries take ~1.3 s each, most others 0.1-0.5 s): the pool ends together.
    todo.sort(key=lambda fe: -len(load_source(fe[0])) * (4 if fe[0] in ("gemv", "sampling") else 1))

    def one(fe):
        import cupy

        with cupy.cuda.Device(dev):
            get_function(*fe)

    if todo:
        with ThreadPoolExecutor(workers or max(1, os.cpu_count() or 1)) as ex:
            list(ex.map(one, todo))
    return fams
