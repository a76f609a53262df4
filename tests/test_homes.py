"""Each op has one home per layer: ``ops/<family>.py`` and ``functional/<family>.py`` (the same names), each with
``__all__``; ``ck.*`` and ``ck.functional.*`` are built from those ``__all__`` (cukernels/_public.py), so a new
family module needs no edit to either ``__init__``."""
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

import cukernels as ck
from cukernels import _public

PKG = Path(ck.__file__).parent


def _family_modules(package):
    pkg = importlib.import_module(package)
    return {i.name: importlib.import_module(f"{package}.{i.name}") for i in pkgutil.iter_modules(pkg.__path__)
            if not i.name.startswith("_") and not i.ispkg}


def test_functional_modules_mirror_ops():
    ops, fn = _family_modules("cukernels.ops"), _family_modules("cukernels.functional")
    # (array_ops: the plain array Functions; recompute: activation recompute, a tape mechanism over any Functions)
    assert set(fn) - {"array_ops", "recompute"} <= set(ops), \
        f"functional modules without an ops family: {set(fn) - set(ops)}"
    for name in ("rms_norm", "layer_norm", "softmax", "attention", "cross_entropy", "linear_cross_entropy",
                 "embedding", "rope", "activations", "dropout"):
        assert name in fn, f"functional/{name}.py missing"


@pytest.mark.parametrize("package, namespace", [("cukernels.ops", "cukernels"),
                                                ("cukernels.functional", "cukernels.functional")])
def test_public_names_are_each_modules_all(package, namespace):
    ns = sys.modules[namespace]
    for name, mod in _family_modules(package).items():
        assert isinstance(mod.__all__, list) and mod.__all__, name
        for n in mod.__all__:
            assert getattr(ns, n) is getattr(mod, n), f"{namespace}.{n} is not {mod.__name__}.{n}"
        if package == "cukernels.functional":  # every public function / class defined there is exported
            own = {n for n, o in vars(mod).items() if not n.startswith("_") and getattr(o, "__module__", None) ==
                   mod.__name__ and (inspect.isfunction(o) or inspect.isclass(o))}
            assert own <= set(mod.__all__), (mod.__name__, own - set(mod.__all__))
    if package == "cukernels.functional":
        names = [n for m in _family_modules(package).values() for n in m.__all__]
        assert sorted(ns.__all__) == sorted(names + ["Tensor"])


def test_the_function_and_its_module_share_a_name():
    """F.rms_norm is the function; the module stays reachable by its import path."""
    from cukernels.functional.rms_norm import RMSNormF
    assert inspect.isfunction(ck.functional.rms_norm) and RMSNormF is ck.functional.RMSNormF
    assert inspect.ismodule(sys.modules["cukernels.functional.rms_norm"])
    assert inspect.ismodule(ck.ops.rms_norm) and inspect.isfunction(ck.rms_norm)


def test_reexport_refuses_a_name_in_two_modules_and_a_module_without_all(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("__all__ = ['f']\ndef f(): pass\n")
    (pkg / "b.py").write_text("__all__ = ['f']\ndef f(): pass\n")
    (pkg / "_private.py").write_text("raise RuntimeError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="'f' is in the __all__ of both a and b"):
        _public.reexport("fakepkg", {})
    (pkg / "b.py").write_text("def g(): pass\n")
    for m in [m for m in sys.modules if m.startswith("fakepkg")]:
        monkeypatch.delitem(sys.modules, m)
    with pytest.raises(ImportError, match="fakepkg.b: a family module declares its public names in __all__"):
        _public.reexport("fakepkg", {})
    (pkg / "b.py").write_text("__all__ = ['g']\ndef g(): pass\n")
    for m in [m for m in sys.modules if m.startswith("fakepkg")]:
        monkeypatch.delitem(sys.modules, m)
    ns = {}
    assert _public.reexport("fakepkg", ns) == ["f", "g"] and set(ns) == {"f", "g"}
