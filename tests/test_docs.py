"""docs/: every page the index lists exists, every relative link resolves (anchors into api.md included), the
generated API reference and config-key table are current and no public name lacks a docstring
(docs/gen_api.py --check), ops.md names every kernel op, the marked examples run on the CPU; the README's pictures
are drawn from committed result tables (real numbers only); LICENSE and CHANGELOG are there."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _pages():
    return sorted(DOCS.glob("*.md"))


def test_gen_api_check_passes():
    r = subprocess.run([sys.executable, str(DOCS / "gen_api.py"), "--check"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gen_api_fails_on_a_missing_docstring(monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_api_under_test", DOCS / "gen_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    import cukernels as ck

    def undocumented(x):
        return x
    undocumented.__module__ = "cukernels"
    monkeypatch.setattr(ck, "undocumented_probe", undocumented, raising=False)
    api, missing = gen.render()
    assert "cukernels.undocumented_probe" in missing
    assert gen.own_doc(ck.rms_norm) and "### `ck.rms_norm(" in api
    assert not re.search(r" at 0x[0-9a-f]+|/site-packages/|" + re.escape(str(ROOT)), api)  # stable across machines


def test_index_lists_every_page():
    index = (DOCS / "index.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    on_disk = {p.name for p in _pages()} - {"index.md"}
    assert on_disk <= listed, f"pages missing from docs/index.md: {sorted(on_disk - listed)}"
    for page in ("ops.md", "autograd-and-nn.md", "training.md", "checkpoints-and-hf.md", "generation.md",
                 "multi-gpu.md", "performance.md", "development.md", "interop.md", "api.md", "errors.md"):
        assert page in listed and (DOCS / page).exists(), page


def _anchors(md: str) -> set:
    ids = set(re.findall(r'<a id="([^"]+)"></a>', md))
    for h in re.findall(r"^#+ (.+)$", md, re.M):  # GitHub's heading slugs
        ids.add(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-"))
    return ids


def test_every_relative_link_resolves():
    api_anchors = _anchors((DOCS / "api.md").read_text())
    bad = []
    for page in _pages():
        text = page.read_text()
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.name}: {link}")
            elif anchor and target.suffix == ".md":
                anchors = api_anchors if target.name == "api.md" else _anchors(target.read_text())
                if anchor not in anchors:
                    bad.append(f"{page.name}: {link} (no such anchor)")
    assert not bad, bad


def test_docs_cite_commands_not_sessions():
    for page in _pages():
        if page.name == "api.md":  # (docstrings: checked where they are written)
            continue
        text = page.read_text()
        assert not re.search(r"\bsession\s*\d+|\brun [A-H]\b", text, re.I), page.name


def test_ops_page_names_every_kernel_op():
    import cukernels as ck
    text = (DOCS / "ops.md").read_text()
    ops = [n for n, o in vars(ck).items() if callable(o) and not n.startswith("_")
           and getattr(o, "__module__", "").startswith(("cukernels.ops.", "cukernels.blas"))]
    assert len(ops) > 50
    missing = [n for n in ops if f"[`{n}`](api.md#cukernels-{n.lower()})" not in text]
    assert not missing, f"ops.md: add a line for {missing}"


def test_training_page_holds_every_config_key():
    from cukernels.train import config
    text = (DOCS / "training.md").read_text()
    assert config.describe().rstrip() in text


def _examples(page):
    text = (DOCS / page).read_text()
    return re.findall(r"<!-- docs-example:[^>]*-->\n```python\n(.*?)```", text, re.S)


def test_autograd_page_example_runs():
    (code,) = _examples("autograd-and-nn.md")
    exec(compile(code, "docs/autograd-and-nn.md", "exec"), {})


def test_run_folder_to_hugging_face_example_runs(tmp_path):
    from cukernels.train import load_config, train
    run = tmp_path / "run"
    cfg = load_config(None, ["device=cpu", "model.vocab_size=256", "model.hidden_size=32",
                             "model.intermediate_size=64", "model.num_hidden_layers=1",
                             "model.num_attention_heads=2", "model.max_position_embeddings=64", "batch_size=2",
                             "seq_len=16", "max_steps=2", "eval_every=0", "log_every=1", "plot=false",
                             "sample_chars=0", "progress=lines", f"out_dir={run}"])
    train(cfg, quiet=True)
    (code,) = _examples("checkpoints-and-hf.md")
    exec(compile(code, "docs/checkpoints-and-hf.md", "exec"), {"RUN_DIR": str(run), "HF_DIR": str(tmp_path / "hf")})
    assert (tmp_path / "hf" / "config.json").exists()


def _plots():
    import importlib.util
    spec = importlib.util.spec_from_file_location("plots_under_test", ROOT / "benchmarks" / "plots.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_speed_chart_takes_real_rows_of_one_run():
    plots = _plots()
    runs = json.loads((ROOT / "benchmarks" / "results" / "bench_train.json").read_text())["runs"]
    rows = plots.speed_rows()
    assert {(r["model"], r["config"]) for r in rows} >= {("llama", "b8t1024"), ("llama", "b4t64"), ("gpt2", "b8t1024")}
    for r in rows:
        run = next(x for x in runs if x["command"] == r["command"] and x["date"] == r["date"])
        assert r["ours_ms"] in [x["ms"] for x in run["rows"] if x["config"] == r["config"]]
        assert r["torch"] and all(any(t["mode"] == m and t["ms"] == ms and t["config"] == r["config"]
                                      for t in run["torch"]) for m, ms in r["torch"].items())
        newer = [x for x in runs if x["date"] > r["date"] and plots._model_of(x["command"]) == r["model"]
                 and any(t["config"] == r["config"] for t in x.get("torch", []))]
        assert not newer, "the chart must take the newest run with PyTorch rows"


def test_loss_curve_is_the_committed_tiny_run():
    plots = _plots()
    d = plots.loss_rows()
    assert "examples/configs/tiny.yaml" in d["command"] and "CPU" in d["machine"]
    steps = [s for s, _ in d["train"]]
    assert steps == sorted(steps) and len(steps) >= 100
    assert d["train"][-1][1] < d["train"][0][1] - 2 and d["val"][-1][1] < d["val"][0][1] - 2


def test_plots_script_draws_both_pictures(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e \".[train]\")")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plots.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("loss_tiny.png", "speed_vs_pytorch.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (DOCS / "images" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_license_and_changelog():
    lic = (ROOT / "LICENSE").read_text()
    assert lic.startswith("MIT License") and "Copyright (c) 2026 the cukernels authors" in lic
    assert "license = MIT" in (ROOT / "setup.cfg").read_text()
    log = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## .*front door", log, re.M | re.I)
