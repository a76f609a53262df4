"""benchmarks/bench_generate.py's transformers harness times transformers as a competent user runs it: every
generate() call -- the warm-up ones too -- at exactly the timed batch, prompt and new-token lengths (a warm-up at
other lengths rebuilds the static cache and recompiles inside the timed call), the median of several timed calls,
the docs' compile arguments; and the side-by-side table goes on when a mode fails. Fake torch / transformers
modules stand in for the real ones (no GPU, no torch here)."""
import importlib.util
import os
import subprocess
import sys
import types

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "benchmarks", "bench_generate.py")


def _load():
    spec = importlib.util.spec_from_file_location("bench_generate_under_test", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Ctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _fakes(calls):
    torch = types.ModuleType("torch")
    torch.bfloat16 = "bf16"
    torch.manual_seed = lambda s: None
    torch.no_grad = _Ctx
    torch.cuda = types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None)
    torch.randint = lambda lo, hi, shape, device=None: np.random.default_rng(0).integers(lo, hi, shape)
    torch.ones_like = np.ones_like

    def compile_(fn, **kw):
        calls.append(("compile", kw))
        return fn
    torch.compile = compile_

    tf = types.ModuleType("transformers")

    class Config:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Model:
        def __init__(self, cfg):
            self.cfg = cfg

        def to(self, *a):
            return self

        def eval(self):
            return self

        def forward(self, *a, **k):
            pass

        def generate(self, ids, attention_mask=None, **kw):
            calls.append(("generate", ids.shape, dict(kw)))
            return np.zeros((ids.shape[0], ids.shape[1] + kw["max_new_tokens"]), np.int64)

    tf.LlamaConfig = tf.GPT2Config = Config
    tf.LlamaForCausalLM = tf.GPT2LMHeadModel = Model
    tf.CompileConfig = lambda **kw: ("CompileConfig", tuple(sorted(kw.items())))
    return torch, tf


@pytest.mark.parametrize("mode", ["eager", "static-compile", "static-compile-forward"])
def test_hf_warms_up_at_the_timed_lengths_and_takes_the_median(monkeypatch, mode):
    calls = []
    torch, tf = _fakes(calls)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "transformers", tf)
    bg = _load()
    med, runs = bg.hf("llama", 1, 128, 256, mode, reps=3)
    gens = [c for c in calls if c[0] == "generate"]
    assert len(gens) == bg.HF_WARMUP + 3 and bg.HF_WARMUP >= 2
    for _, shape, kw in gens:  # every call, warm-up included, at the timed lengths
        assert shape == (1, 128)
        assert kw["max_new_tokens"] == kw["min_new_tokens"] == 256
        assert kw["do_sample"] is False
        assert kw.get("cache_implementation") == (None if mode == "eager" else "static")
    if mode == "static-compile":
        assert dict(gens[0][2]["compile_config"][1]) == {"fullgraph": True, "mode": "reduce-overhead"}
    compiles = [c for c in calls if c[0] == "compile"]
    if mode == "static-compile-forward":  # the docs' recipe; generate's own compile off
        assert compiles == [("compile", {"mode": "reduce-overhead", "fullgraph": True})]
        assert gens[0][2]["disable_compile"] is True
    else:
        assert compiles == []
    assert len(runs) == 3 and med == float(np.median(runs)) and med > 0
    with pytest.raises(ValueError, match="mode"):
        bg.hf("llama", 1, 128, 256, "compile-everything")


def test_vs_hf_prints_both_side_by_side_and_reports_a_failed_mode(monkeypatch, capsys):
    bg = _load()
    gen_calls = []

    def fake_generate(model, prompt, new, temperature=0):
        gen_calls.append((prompt.shape, new))
        return np.zeros((prompt.shape[0], prompt.shape[1] + new), np.int64)

    import cukernels.generation as G
    monkeypatch.setattr(G, "generate", fake_generate)
    sync = types.SimpleNamespace(synchronize=lambda: None)
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: sync),
                               get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", cp)

    class P:
        data = np.zeros(8, np.float32)

    class M:
        config = types.SimpleNamespace(vocab_size=50)

        def parameters(self):
            return [P()]

        def num_parameters(self):
            return 8

    monkeypatch.setattr(bg, "build", lambda name, cp: M())
    monkeypatch.setattr(bg, "ours", lambda *a, **k: (1.0, 1000.0))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # (bench_generate imports ab.py beside it)

    def run(cmd, **kw):  # each transformers mode is a child process: here one that fails
        assert cmd[0] == sys.executable and "--hf-worker" in cmd and cmd[cmd.index("--hf-prompt") + 1] == "64"
        return types.SimpleNamespace(returncode=1, stdout="", stderr="ModuleNotFoundError: No module named 'torch'")
    monkeypatch.setattr(subprocess, "run", run)
    bg.main(["--batches", "1", "--prompts", "64", "--new", "16", "--vs-hf", "--hf-modes", "eager"])
    out = capsys.readouterr().out
    assert "side by side: batch 1, prompt 64, 16 new tokens" in out
    assert "cukernels (static engine)" in out
    assert "transformers eager" in out and "failed: ModuleNotFoundError" in out
    assert gen_calls and all(c == ((1, 64), 16) for c in gen_calls)  # ours: warmed at the timed lengths too
    assert len(gen_calls) == bg.HF_WARMUP + bg.REPS


def test_hf_modes_are_checked():
    r = subprocess.run([sys.executable, PATH, "--hf-modes", "eager,bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "--hf-modes" in r.stderr and "bogus" in r.stderr
