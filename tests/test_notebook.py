"""examples/quickstart.ipynb runs top to bottom on a CPU (nbclient, kernel python3) and is stored without outputs."""
import json
import os
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB = os.path.join(ROOT, "examples", "quickstart.ipynb")


def test_notebook_is_stored_without_outputs():
    nb = json.load(open(NB))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 6
    for c in code:
        assert c.get("outputs") == [] and c.get("execution_count") is None, \
            "clear the outputs before committing (Jupyter: Edit > Clear outputs of all cells)"
    src = "\n".join("".join(c["source"]) for c in code)
    for what in ("ck.rms_norm", "ck.gpu_available()", ".backward()", "ck.Llama", "ck.optim.AdamW", "ck.generate"):
        assert what in src, what


def test_notebook_runs_on_the_cpu(monkeypatch):
    for mod in ("nbformat", "nbclient", "ipykernel"):
        pytest.importorskip(mod, reason=f"{mod} is not installed (pip install -e \".[test]\" brings it)")
    import nbclient
    import nbformat
    nb = nbformat.read(NB, as_version=4)
    # the kernel imports this checkout, on the CPU path
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.join(ROOT, "examples")}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"a notebook cell failed:\n{e}")
    took = time.perf_counter() - t0
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "rms_norm == its formula: True" in text
    assert "matches rms_norm_backward: True True" in text
    assert "ROMEO:" in text
    print(f"notebook: {took:.1f} s")
