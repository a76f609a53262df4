"""The README's CPU quickstart runs exactly as written (NumPy arrays, no GPU), and the commands it names exist."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _block(marker):
    text = open(os.path.join(ROOT, "README.md")).read()
    i = text.index(marker)
    m = re.search(r"```python\n(.*?)```", text[i:], re.S)
    return m.group(1)


def test_cpu_quickstart_runs_as_written(tmp_path):
    code = _block("<!-- cpu-quickstart")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # as on a machine without a GPU
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "(4, 16) (16,)" in r.stdout


def test_readme_names_files_that_exist():
    text = open(os.path.join(ROOT, "README.md")).read()
    for path in sorted(set(re.findall(r"(?:examples|benchmarks)/[\w./-]+\.(?:py|yaml|sh)", text))):
        assert os.path.exists(os.path.join(ROOT, path)), path
