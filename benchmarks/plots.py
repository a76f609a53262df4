"""The README's two pictures, drawn from the committed result tables (nothing here is measured):

    python benchmarks/plots.py [--out docs/images]

- ``loss_tiny.png``: the tiny CPU run's train and validation loss (``benchmarks/results/loss_tiny.json``, whose
  ``command`` reproduces it);
- ``speed_vs_pytorch.png``: the training step against PyTorch + transformers in the same process
  (``benchmarks/results/bench_train.json``): for each model and batch shape, the newest run that has PyTorch rows,
  and our row of that same run -- never a figure of ours from one run beside PyTorch's from another.

Needs matplotlib (``pip install -e ".[train]"``); ``speed_rows()`` and ``loss_rows()`` do not.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "images"
MODEL = {"llama": "LLaMA-3.2-1B shape", "gpt2": "GPT-2 124M", "qwen3": "Qwen3-0.6B shape"}
SHAPE = {"b4t64": "B4×T64", "b8t1024": "B8×T1024"}
TORCH_MODE = {"eager": "PyTorch eager", "compile": "torch.compile", "reduce-overhead": "compile, reduce-overhead"}


def _model_of(command: str) -> str:
    for m in ("gpt2", "qwen3"):
        if f"--model {m}" in command:
            return m
    return "llama"


def speed_rows(path: Path = RESULTS / "bench_train.json") -> list[dict]:
    """One dict per (model, batch shape): ``ours_ms`` and ``torch`` ({mode: ms}) of the newest run of bench_train
    with PyTorch rows at that shape (one GPU), with that run's ``command``, ``date`` and ``machine``."""
    runs = json.loads(Path(path).read_text())["runs"]
    best = {}
    for run in runs:
        torch = [t for t in run.get("torch", [])]
        for cfg in sorted({t["config"] for t in torch}):
            ours = [r for r in run["rows"] if r["config"] == cfg and r.get("world_size", 1) == 1
                    and not ({"setting", "fp8", "recompute", "oom"} & set(r))]  # (the plain bf16 step)
            if not ours:
                continue
            key = (_model_of(run["command"]), cfg)
            if key in best and best[key]["date"] >= run["date"]:
                continue
            best[key] = dict(model=key[0], config=cfg, ours_ms=ours[0]["ms"],
                             torch={t["mode"]: t["ms"] for t in torch if t["config"] == cfg},
                             command=run["command"], date=run["date"], machine=run["machine"])
    order = [("llama", "b8t1024"), ("llama", "b4t64"), ("gpt2", "b8t1024"), ("qwen3", "b8t1024")]
    return [best[k] for k in sorted(best, key=lambda k: order.index(k) if k in order else len(order))]


def loss_rows(path: Path = RESULTS / "loss_tiny.json") -> dict:
    """The tiny run: ``train`` and ``val`` as lists of (step, loss), with its ``command`` and ``machine``."""
    run = json.loads(Path(path).read_text())["runs"][0]
    return dict(train=[(r["step"], r["loss"]) for r in run["train"]],
                val=[(r["step"], r["loss"]) for r in run["val"]],
                command=run["command"], machine=run["machine"], wall_s=run.get("wall_s"))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _save(fig, path: Path):
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version string: the bytes follow the data


def plot_loss(out: Path) -> Path:
    plt = _plt()
    d = loss_rows()
    fig, ax = plt.subplots(figsize=(6.0, 3.0), constrained_layout=True)
    ax.plot(*zip(*d["train"]), label="train (one step's batch)", color="#1f77b4", lw=1.4)
    ax.plot(*zip(*d["val"]), "o-", label="validation (held-out bytes)", color="#d62728", ms=4, lw=1.2)
    ax.set_xlabel("optimizer step (1,024 tokens each)")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(f"tiny LLaMA on tinyshakespeare, CPU (NumPy path), {d['wall_s']} s on 2 cores", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    path = out / "loss_tiny.png"
    _save(fig, path)
    plt.close(fig)
    return path


def plot_speed(out: Path) -> Path:
    plt = _plt()
    rows = speed_rows()
    fig, axes = plt.subplots(1, len(rows), figsize=(2.6 * len(rows), 3.1), constrained_layout=True)
    colors = {"cukernels": "#2ca02c", "eager": "#7f7f7f", "compile": "#1f77b4", "reduce-overhead": "#9467bd"}
    for ax, r in zip(axes, rows):
        names = ["cukernels"] + [m for m in TORCH_MODE if m in r["torch"]]
        ms = [r["ours_ms"]] + [r["torch"][m] for m in names[1:]]
        bars = ax.bar(range(len(ms)), ms, color=[colors[n] for n in names])
        for b, v in zip(bars, ms):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(ms)), ["cukernels"] + [TORCH_MODE[n] for n in names[1:]], rotation=30,
                      ha="right", fontsize=8)
        ax.set_title(f"{MODEL[r['model']]}\n{SHAPE.get(r['config'], r['config'])}, bf16, AdamW", fontsize=9)
        ax.set_ylim(0, max(ms) * 1.15)
    axes[0].set_ylabel("ms per training step (lower is better)")
    fig.suptitle("One training step on one H200: cukernels vs PyTorch + transformers, same process", fontsize=9)
    path = out / "speed_vs_pytorch.png"
    _save(fig, path)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    for p in (plot_loss(a.out), plot_speed(a.out)):
        print(p)


if __name__ == "__main__":
    main()
