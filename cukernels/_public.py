"""The public names of a package built from its modules' ``__all__``: ``cukernels/__init__.py`` re-exports every
``ops/<family>.py`` this way (``ck.rms_norm``) and ``functional/__init__.py`` every ``functional/<family>.py``
(``ck.functional.rms_norm``), so adding a family module adds its names with no edit to either ``__init__``.
"""
from __future__ import annotations

import importlib
import pkgutil


def reexport(package: str, namespace: dict) -> list:
    """Import every public module of ``package`` (its modules not starting with ``_``, in name order) and bind each
    name of its ``__all__`` in ``namespace``; returns the names, in that order. A module without ``__all__``, or a
    name in the ``__all__`` of two modules, is an ImportError."""
    pkg = importlib.import_module(package)
    names, home = [], {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        if not isinstance(getattr(mod, "__all__", None), (list, tuple)):
            raise ImportError(f"{mod.__name__}: a family module declares its public names in __all__")
        for n in mod.__all__:
            if n in home:
                raise ImportError(f"{package}: {n!r} is in the __all__ of both {home[n]} and {info.name}")
            home[n] = info.name
            namespace[n] = getattr(mod, n)
            names.append(n)
    return names
