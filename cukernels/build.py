"""Build the prebuilt kernel binaries: every entry point of every family, for every shipped architecture.

    python -m cukernels.build [--out DIR] [--arch sm_80,sm_90] [--families rms_norm,gemv] [--jobs N] [--force]
                              [--report FILE.json]

No GPU is needed: NVRTC (pip's ``nvidia-cuda-nvrtc-cu12``) compiles each family to a cubin for each architecture
in ``_loader.SHIPPED`` (an ``_loader.ARCH`` family for its own target only), with the options the loader's JIT
uses, and writes ``<family>.<arch>.<key>.cubin`` (``_loader.prebuilt_key``: source, options, architecture) into
``cukernels/_prebuilt/`` (or ``--out``), which the loader then uses instead of compiling. The wheel build runs it
(setup.py). A binary already there under the same key is kept unless ``--force``.

It is also the full compile check: it fails (exit 1) when a family does not compile, when ptxas reports a stack
frame or spill for any kernel (a register array in local memory), or when the binary lacks an entry point the
source defines. ``index.json`` beside the binaries (and ``--report``) records, per family and architecture, the
entry points, compile seconds, bytes and the most registers any kernel uses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import _loader, _nvrtc

# Local memory ptxas reports for sm_80 today, found when this build began checking every shipped architecture (the
# old test checked sm_90 only, where none of these spill): {(family, arch): {kernel: most stack + spill bytes}}.
# attn_bwd_dkdv_d128*: 255 registers, the hardware's limit; ln_bwd_cols / ce_fused: 64-register caps (256 / 1024
# threads a block), where sm_80's ptxas spills one 8-byte value. No A100 has been lent to measure what a change of
# tiles or occupancy would cost, so they are listed rather than changed: the build fails on any other kernel with
# local memory and on any of these growing. The sliding-window twins of attn_bwd_dkdv_d128* (same tiles, the same
# 255-register limit) spill no more than their plain twins.
KNOWN_LOCAL = {
    ("attention", "sm_80"): {"attn_bwd_dkdv_d128": 24, "attn_bwd_dkdv_d128_km": 76, "attn_bwd_dkdv_d128_sw": 24,
                             "attn_bwd_dkdv_d128_km_sw": 48},
    ("cross_entropy", "sm_80"): {"ce_fused_bf16_i32": 24},
    ("decode_attention", "sm_80"): {"dattn_rope_d64_m4": 16},
    ("layer_norm", "sm_80"): {"ln_bwd_cols_bf16_bf16_v": 24},
}


def local_bytes(u: dict) -> int:
    return u["stack"] + u["spill_stores"] + u["spill_loads"]


def build_one(family: str, arch: str, out: Path, force: bool = False, prev: dict | None = None) -> dict:
    """Compile one family for one architecture into ``out``; returns its index record (``errors`` non-empty when
    the build must fail). A binary already there under the same key is kept (``prev``: its old record, whose
    compile seconds and registers are carried over)."""
    path = _loader.prebuilt_path(family, arch, out)
    rec = {"file": path.name, "key": _loader.prebuilt_key(family, arch), "errors": []}
    want = _loader.list_entries(family, arch)
    rec["entries"] = len(want)
    if path.is_file() and not force:
        old = prev if prev and prev.get("key") == rec["key"] and not prev.get("errors") else {}
        rec.update(seconds=old.get("seconds"), max_registers=old.get("max_registers"), bytes=path.stat().st_size,
                   cached=True)
        return rec
    t0 = time.perf_counter()
    try:
        cubin, log = _loader.compile_cubin(family, arch, verbose=True)
    except RuntimeError as e:
        rec["errors"].append(str(e))
        return rec
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    usage = _nvrtc.parse_usage(log)
    known = KNOWN_LOCAL.get((family, arch), {})
    local = {k: v for k, v in usage.items() if local_bytes(v) > known.get(k, 0)}
    if local:
        rec["errors"].append(f"{family}.cu ({arch}): kernels with a stack frame or spills: {local}")
    missing = sorted(set(want) - set(usage))
    if missing:
        rec["errors"].append(f"{family}.cu ({arch}): entry points missing from the binary: {missing}")
    rec["max_registers"] = max((v["registers"] for v in usage.values()), default=0)
    rec["bytes"] = len(cubin)
    if not rec["errors"]:
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    return rec


def build(out: Path | None = None, archs=None, names=None, jobs: int | None = None, force: bool = False,
          log=print) -> dict:
    """Build every (family, architecture) pair asked for, in parallel threads (NVRTC releases the GIL); returns
    the index ``{family: {arch: record}}`` and writes it to ``out/index.json``. Stale binaries of a family and
    architecture (other keys) are removed."""
    out = Path(out or _loader.PREBUILT_DIR)
    fams = list(names) if names else _loader.families()
    pairs = [(f, a) for f in fams for a in _loader.archs(f) if archs is None or a in archs
             or (f in _loader.ARCH and a.rstrip("a") in archs)]
    index_path = out / "index.json"
    try:
        index = json.loads(index_path.read_text())["families"]
    except (OSError, ValueError, KeyError):
        index = {}
    # Longest compiles first (the last build's seconds, else the source length), so that gemv's two minutes
    # overlap the rest instead of ending the build alone.
    pairs.sort(key=lambda fa: (-(index.get(fa[0], {}).get(fa[1], {}).get("seconds") or 0),
                               -len(_loader.load_source(fa[0]))))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as ex:
        for (f, a), rec in zip(pairs, ex.map(lambda fa: build_one(*fa, out, force, index.get(fa[0], {}).get(fa[1])), pairs)):
            index.setdefault(f, {})[a] = rec
            note = "  kept  " if rec.get("cached") else f"{rec.get('seconds') or 0:6.1f} s"
            log(f"{f:18s} {a:7s} {rec['entries']:4d} entries {note}  {rec.get('bytes', 0) / 1e6:6.2f} MB"
                + ("  FAILED" if rec["errors"] else ""))
            for old in out.glob(f"{f}.{a}.*.cubin"):
                if old.name != rec["file"]:
                    old.unlink()
    errors = [e for recs in index.values() for r in recs.values() for e in r.get("errors", [])]
    if out.is_dir():
        payload = {"nvrtc": ".".join(map(str, _nvrtc.version())), "families": index}
        index_path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    total = sum(r.get("bytes", 0) for recs in index.values() for r in recs.values())
    log(f"{len(pairs)} binaries, {total / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s wall, "
        f"{len(errors)} errors -> {out}")
    return index


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cukernels.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help=f"where the binaries go (default {_loader.PREBUILT_DIR})")
    ap.add_argument("--arch", default=",".join(_loader.SHIPPED),
                    help="comma list of architectures (default: %(default)s; sm_90 brings sm_90a for the wgmma family)")
    ap.add_argument("--families", default=None, help="comma list of families (default: all)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: the CPU count)")
    ap.add_argument("--force", action="store_true", help="recompile binaries that are already there")
    ap.add_argument("--report", type=Path, default=None, help="also write the index to this JSON file")
    a = ap.parse_args(argv)
    if not _nvrtc.available():
        print("python -m cukernels.build: libnvrtc not found; pip install nvidia-cuda-nvrtc-cu12", file=sys.stderr)
        return 2
    archs = [s.strip() for s in a.arch.split(",") if s.strip()]
    bad = [s for s in archs if s not in _loader.SHIPPED]
    if bad:
        print(f"--arch: unknown architecture {bad}; choose from {list(_loader.SHIPPED)}", file=sys.stderr)
        return 2
    names = [s.strip() for s in a.families.split(",")] if a.families else None
    unknown = sorted(set(names or ()) - set(_loader.families()))
    if unknown:
        print(f"--families: no such kernel family {unknown}; choose from {_loader.families()}", file=sys.stderr)
        return 2
    index = build(a.out, archs, names, a.jobs, a.force)
    if a.report:
        a.report.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    errors = [e for recs in index.values() for r in recs.values() for e in r.get("errors", [])]
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
