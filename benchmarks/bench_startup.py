"""Start-up: how long a user waits for the first kernel, the first training step and the first tokens.

    PYTHONPATH=. python benchmarks/bench_startup.py [--wheel dist/cukernels-*.whl] [--json FILE] [--quick]

Every measurement is a fresh Python process timed from its launch, with its own CuPy kernel cache: *cold* starts
with the cache empty, *warm* is a second process on the cache the cold one left. Two installs:

* ``checkout``: this source tree with ``CUKERNELS_PREBUILT=0``, the JIT path (each entry point compiled by NVRTC on
  first use);
* ``wheel`` (with ``--wheel``): the wheel installed into an empty folder and imported from another directory, its
  prebuilt binaries loaded. Each wheel row asserts that no kernel went through NVRTC (``_loader.stats["jit"]``).

Rows: the first ``ck.rms_norm`` (import included), one representative op of every family, the first step of
``examples/configs/small.yaml`` (``python -m cukernels.train ... max_steps=1``), the first tokens of the
LLaMA-3.2-1B shape (random bf16 weights; ``generate(..., 2)``: the prefill and one captured decode step), and
``_loader.precompile()`` of every entry point (checkout only). One table on stdout, and ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A child prints one JSON line: its own timings (seconds since its launch, read from the parent's clock) and the
# loader's counters.
PRELUDE = """
import json, os, sys, time
T0 = float(os.environ["BENCH_T0"])
def done(**kw):
    from cukernels import _loader
    import cupy
    cupy.cuda.Device().synchronize()
    kw.update(total=time.time() - T0, jit=_loader.stats["jit"], prebuilt=_loader.stats["prebuilt"])
    print("BENCH " + json.dumps(kw), flush=True)
"""
# Uninitialised inputs: filling them would time CuPy's own kernels (compiled by CuPy on first use), not ours.
RMS = """
import cupy as cp
t = time.time(); import cukernels as ck; t_imp = time.time() - t
x = cp.empty((4096, 2048), dtype=ck.bfloat16); w = cp.empty(2048, dtype=cp.float32)
t = time.time(); ck.rms_norm(x, w); cp.cuda.Device().synchronize()
done(import_s=t_imp, call_s=time.time() - t)
"""
# One call per family, the op a user is likeliest to call first (bf16 where the op takes it).
FAMILY_OPS = {
    "rms_norm": "ck.rms_norm(xb, cp.ones(1024, cp.float32))",
    "layer_norm": "ck.layer_norm(xb, cp.ones(1024, cp.float32), cp.zeros(1024, cp.float32))",
    "softmax": "ck.softmax(xb)",
    "cross_entropy": "ck.cross_entropy(xb, cp.zeros(512, cp.int32))",
    "embedding": "ck.embedding(cp.zeros(64, cp.int32), xb)",
    "rope": "ck.rope(q, *ck.rope_cache(64, 64, xp=cp))",
    "activations": "ck.swiglu(xb, xb)",
    "elementwise": "ck.add(xb, xb)",
    "adam": "ck.adam_step(p, g, m, v, lr=1e-3, step=1)",
    "dropout": "ck.dropout(xb, 0.1, seed=0)",
    "attention": "ck.flash_attention(q, q, q, causal=True)",
    "attention_sm90": "ck.flash_attention_sm90(q, q, q, causal=True)",
    "decode_attention": "ck.decode_attention(q[:, -1:], q, q, cache_len=64)",
    "gemv": "ck.gemv(xb[:1], xb)",
    "sampling": "ck.sample_tokens(xb[:4], temperature=1.0, seed=0)",
}
FAMILY = """
import cupy as cp
import cukernels as ck
xb = cp.random.standard_normal((512, 1024), dtype=cp.float32).astype(ck.bfloat16)
q = cp.random.standard_normal((2, 64, 8, 64), dtype=cp.float32).astype(ck.bfloat16)
p = cp.zeros(1 << 20, cp.float32); g = cp.ones(1 << 20, cp.float32); m = cp.zeros_like(p); v = cp.zeros_like(p)
t = time.time(); {op}; cp.cuda.Device().synchronize()
done(call_s=time.time() - t)
"""
GENERATE = """
import numpy as np, cupy as cp
import cukernels as ck
cfg = ck.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True,
                     max_position_embeddings=131072)
t = time.time(); model = ck.Llama(cfg, xp=cp, dtype=ck.bfloat16); cp.cuda.Device().synchronize(); t_build = time.time() - t
t = time.time(); ck.generate(model, np.arange(16) + 1, 2, temperature=0); t_gen = time.time() - t
done(build_s=t_build, generate_s=t_gen)
"""
PRECOMPILE = """
from cukernels import _loader
t = time.time(); _loader.precompile(); done(precompile_s=time.time() - t)
"""


def child(code: str, env: dict, cwd: Path, args=None, timeout=900) -> dict:
    """Run ``code`` (or the command ``args``) in a fresh process; its BENCH line, plus ``wall`` from launch."""
    env = dict(env, BENCH_T0=repr(time.time()), PYTHONUNBUFFERED="1")
    cmd = args or [sys.executable, "-c", PRELUDE + code]
    t = time.time()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")]
    out = json.loads(lines[-1][6:]) if lines else {}
    out["wall"] = wall
    # The loader's one-line note: some kernel took the JIT path (the only signal from a child that prints no
    # BENCH line, such as the trainer).
    out["jit_note"] = "compiling each kernel on its first use" in r.stderr
    return out


def train_cmd(out_dir: Path) -> list[str]:
    cfg = ROOT / "examples" / "configs" / "small.yaml"
    data = ROOT / "examples" / "data" / "tinyshakespeare.txt"
    # The child prints no BENCH line: its wall time (launch to exit) is the figure; stats come from the log.
    return [sys.executable, "-m", "cukernels.train", "--config", str(cfg), "max_steps=1", "eval_every=0",
            "sample_chars=0", "plot=false", "ckpt_final=false", "progress=lines", f"data.path={data}",
            f"out_dir={out_dir}"]


def measure(label: str, env: dict, cwd: Path, families, quick: bool, precompile: bool) -> list[dict]:
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="ck-startup-"))

    def row(what, metric, code=None, args=None):
        """A cold and a warm process on one fresh cache folder; ``metric``: the child's figure to print (``wall``:
        launch to exit)."""
        cache = Path(tempfile.mkdtemp(prefix="ck-cache-", dir=tmp))
        e = dict(env, CUPY_CACHE_DIR=str(cache))
        res = {kind: child(code, e, cwd, args(kind) if args else None) for kind in ("cold", "warm")}
        rec = {"install": label, "what": what, "metric": metric, "cold_s": res["cold"][metric],
               "warm_s": res["warm"][metric], "cold": res["cold"], "warm": res["warm"]}
        jit = res["cold"].get("jit", "note" if res["cold"]["jit_note"] else 0)
        print(f"{label:9s} {what:40s} cold {rec['cold_s']:7.2f} s  warm {rec['warm_s']:6.2f} s  "
              f"({metric}; JIT entries {jit})", flush=True)
        rows.append(rec)

    row("first ck.rms_norm, import included", "total", RMS)
    for fam in families:
        row(f"first call: {fam}", "call_s", FAMILY.format(op=FAMILY_OPS[fam]))
    row("small: launch to the end of step 1", "wall", args=lambda kind: train_cmd(tmp / f"run-{kind}"))
    if not quick:
        row("1B shape: launch to 2 tokens", "total", GENERATE)
    if precompile:
        row("precompile() of every entry point", "precompile_s", PRECOMPILE)
    shutil.rmtree(tmp, ignore_errors=True)
    return rows


def install_wheel(wheel: Path, into: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(into),
                    str(wheel)], check=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, default=None, help="also measure this wheel, installed into a temp folder")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--families", default=",".join(FAMILY_OPS), help="comma list (default: all)")
    ap.add_argument("--quick", action="store_true", help="no 1B-shape generation row")
    ap.add_argument("--no-checkout", action="store_true", help="only the wheel rows")
    ap.add_argument("--no-precompile", action="store_true", help="skip the precompile() row")
    a = ap.parse_args(argv)
    import cupy

    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    fams = [f for f in a.families.split(",") if f]
    if dev.compute_capability != "90":
        fams = [f for f in fams if f != "attention_sm90"]
    print(f"device: {name} (sm_{dev.compute_capability}), {os.cpu_count()} CPU cores; CuPy {cupy.__version__}")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUKERNELS_PREBUILT")}
    rows = []
    if not a.no_checkout:
        env = dict(base, PYTHONPATH=str(ROOT), CUKERNELS_PREBUILT="0")
        rows += measure("checkout", env, ROOT, fams, a.quick, not a.no_precompile)
    if a.wheel:
        with tempfile.TemporaryDirectory() as site, tempfile.TemporaryDirectory() as cwd:
            install_wheel(a.wheel, Path(site))
            env = dict(base, PYTHONPATH=site)
            got = child("import cukernels; print('BENCH', json.dumps({'file': cukernels.__file__}))", env, Path(cwd))
            assert got["file"].startswith(site), f"the wheel's package was not the one imported: {got['file']}"
            wrows = measure("wheel", env, Path(cwd), fams, a.quick, False)
            for r in wrows:
                for kind in ("cold", "warm"):
                    jit, note = r[kind].get("jit"), r[kind]["jit_note"]
                    assert jit in (None, 0) and not note, f"wheel: {r['what']} ({kind}) compiled kernels with NVRTC"
            rows += wrows
    if a.json:
        a.json.write_text(json.dumps({"device": name, "cpus": os.cpu_count(), "command": " ".join(sys.argv),
                                      "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
