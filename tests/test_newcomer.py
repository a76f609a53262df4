"""The newcomer's path, end to end, on a CPU: the wheel is built from the working tree, installed into a fresh venv
(not editable), and from another folder the installed package trains the tiny config (no --config, no checkout:
the configs and the text ship in the wheel), samples text from the run, exports it as a Hugging Face folder, and
loads the folder back with the same logits.

The wheel is built with ``CUKERNELS_PREBUILT=0`` (pure Python: the kernels JIT on a GPU; the CPU path needs none)
and ``--no-build-isolation``, and installed with ``--no-deps --no-index``: no network. The venv sees the running
environment's packages (numpy, ml_dtypes, PyYAML, ...) through a ``.pth`` file, after its own site-packages, so
``import cukernels`` there is the installed wheel. About 10-15 s on two cores.
"""
import importlib.util
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.newcomer, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE", "kernels_cu", "cukernels",
           "examples/configs", "examples/data"]


def _can_build_wheels():
    if importlib.util.find_spec("wheel") is not None:
        return True
    try:
        import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1 carries it)
        return True
    except ImportError:
        return False


def _pip_version():
    import pip
    return tuple(int(x) for x in pip.__version__.split(".")[:2])


def _run(args, cwd, env, timeout=120):
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, args))}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


@pytest.mark.skipif(not _can_build_wheels(), reason="building a wheel offline needs the wheel package (pip install "
                                                    "wheel; the test extra has it) or setuptools >= 70.1")
@pytest.mark.skipif(_pip_version() < (22, 3), reason="pip >= 22.3 (pip --python) installs into the fresh venv")
def test_wheel_install_tiny_train_generate_export_load(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env.update(CUKERNELS_PREBUILT="0", PIP_DISABLE_PIP_VERSION_CHECK="1", CUDA_VISIBLE_DEVICES="",
               OPENBLAS_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    # the working tree's packaging inputs (not the checkout itself: its build/ and egg-info stay untouched)
    src = tmp_path / "src"
    for rel in SOURCES:
        a, b = ROOT / rel, src / rel
        if a.is_dir():
            shutil.copytree(a, b, ignore=shutil.ignore_patterns("__pycache__", "_prebuilt", "*.pyc"))
        else:
            b.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(a, b)
    pip = [sys.executable, "-m", "pip"]
    _run(pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
                str(src)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("cukernels-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], tmp_path, env)
    py = venv / "bin" / "python"
    _run(pip + ["--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path, env)
    # the running environment's packages, after the venv's own site-packages (its .pth files are not run there, so
    # an editable checkout installed in it stays out)
    venv_site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                          env).stdout.strip())
    (venv_site / "_running_env.pth").write_text("\n".join(p for p in site.getsitepackages() if os.path.isdir(p)))

    home = tmp_path / "elsewhere"  # not the checkout: nothing here but what the user makes
    home.mkdir()
    r = _run([str(py), "-m", "cukernels.train", "max_steps=2", "eval_every=0", "log_every=1", "sample_chars=0",
              "plot=false", "progress=lines", "out_dir=runs/tiny"], home, env)
    assert "no --config: training the tiny config" in r.stderr and str(venv) in r.stderr, r.stderr
    assert "step     2/2" in r.stdout and (home / "runs/tiny/checkpoints/step_00000002.ckpt").is_file(), r.stdout
    r = _run([str(venv / "bin" / "cukernels-generate"), "--checkpoint", "runs/tiny", "--prompt", "ROMEO:",
              "--max-new-tokens", "20", "--temperature", "0", "--device", "cpu"], home, env)
    assert r.stdout.startswith("ROMEO:") and "# sample 1: 20 tokens" in r.stderr, (r.stdout, r.stderr)
    r = _run([str(py), "-m", "cukernels.export", "runs/tiny", "tiny-hf"], home, env)
    assert (home / "tiny-hf" / "config.json").is_file() and (home / "tiny-hf" / "model.safetensors").is_file()
    check = """
import json, numpy as np, cukernels as ck
assert "site-packages" in ck.__file__ and "{venv}" in ck.__file__, ck.__file__
run, hf = ck.from_pretrained("runs/tiny"), ck.from_pretrained("tiny-hf")
ids = np.array([[82, 79, 77, 69, 79, 58]])
np.testing.assert_array_equal(run(ids).data, hf(ids).data)
assert isinstance(ck.Tokenizer.from_pretrained("tiny-hf"), ck.ByteTokenizer)
cfg = json.load(open("tiny-hf/config.json"))
assert [cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None, None, None], cfg
print("loaded back")
""".format(venv=venv)
    assert "loaded back" in _run([str(py), "-c", check], home, env).stdout
    r = subprocess.run([str(py), "-m", "cukernels.export", "runs/nothing", "x"], cwd=home, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: runs/nothing: no such file or folder"), r.stderr
    assert "Traceback" not in r.stderr
