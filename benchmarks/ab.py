"""A/B settings of module attributes for the benchmarks' ``--ab`` option.

A spec is ``"mod.ATTR=v[,mod.ATTR=v...][;...]"``: ``;`` between rows, ``,`` between the settings of one row; ``mod``
is a module of ``cukernels.ops``, ``cukernels.nn``, ``cukernels.optim`` or ``cukernels`` (``gemv.DEPTH=2``,
``decode.FUSED_ATTENTION=0``, ``zero.ADAM_OCCUPANCY=8``), or ``__main__`` (the benchmark script's own module
constants); ``v`` an integer or a float.
"""
from __future__ import annotations

import contextlib
import importlib
import sys

PACKAGES = ("cukernels.ops", "cukernels.nn", "cukernels.optim", "cukernels")


def rows(spec):
    """The rows of a spec, each a string of settings."""
    return [t.strip() for t in (spec or "").split(";") if t.strip()]


def _module(name):
    if name == "__main__":  # the benchmark's own switches (bench_train.py: __main__.ZERO_OVERLAP_GATHER=0)
        return sys.modules["__main__"]
    for pkg in PACKAGES:
        try:
            return importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError:
            continue
    raise ValueError(f"--ab: no module {name!r} in {', '.join(PACKAGES)}")


def _number(text):
    """An int, else a float, else the text itself (a string setting: ``attention_sm90.VARIANT=_wg3``)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


@contextlib.contextmanager
def applied(row):
    """Set every ``mod.ATTR=v`` of one row, restore them on exit."""
    olds = []
    try:
        for one in row.split(","):
            name, val = one.split("=")
            modname, attr = name.strip().rsplit(".", 1)
            mod = _module(modname)
            if not hasattr(mod, attr):
                raise ValueError(f"--ab: {mod.__name__} has no attribute {attr!r}")
            olds.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, _number(val.strip()))
        yield
    finally:
        for mod, attr, old in reversed(olds):
            setattr(mod, attr, old)
