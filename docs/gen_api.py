"""Generate the API reference (docs/api.md) from the docstrings, and the config-key table of docs/training.md.

    python docs/gen_api.py            # rewrite docs/api.md and the table in docs/training.md
    python docs/gen_api.py --check    # exit 1 if either is out of date or a public name has no docstring (CI)

Public names: everything ``cukernels/__init__.py`` exports (``ck.<name>``), and the ``__all__`` of the packages
beside it (``ck.nn``, ``ck.functional``, ``ck.optim``, ``ck.io`` and its file formats, ``ck.models``,
``ck.generation``, ``ck.graph``, ``ck.distributed``; a module without ``__all__``: the names it defines that do
not start with ``_``). Each entry is the signature and the docstring as written; a class adds its public methods
with their first docstring line. A name exported twice is documented once and linked from the other place.

A function, class or module without a docstring of its own fails the check, except the names in
``KNOWN_UNDOCUMENTED`` (what lacked one when this check began); the list only shrinks: a listed name that has a
docstring now fails too, until it is taken off the list. Plain values (constants) and names re-exported from
other packages (``ck.bfloat16`` is ml_dtypes') need none.

The table of docs/training.md, between ``<!-- config-keys:begin -->`` and ``<!-- config-keys:end -->``, is
``cukernels.train.config.describe()`` (every trainer config key with its default and meaning).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
API = ROOT / "docs" / "api.md"
TRAINING = ROOT / "docs" / "training.md"
BEGIN, END = "<!-- config-keys:begin -->", "<!-- config-keys:end -->"

SECTIONS = [
    ("cukernels", "the array ops (CuPy kernels, NumPy references), autograd, models, generation; `import cukernels as ck`"),
    ("cukernels.nn", "layers"),
    ("cukernels.functional", "differentiable Functions over `ck.Tensor`: one per kernel family, and the array ops"),
    ("cukernels.optim", "AdamW over flat buffers, the composite baseline, ZeRO-1, the schedule"),
    ("cukernels.io", "files: atomic writes, safetensors, Hugging Face folders, checkpoints"),
    ("cukernels.io.checkpoint", "single-file training checkpoints"),
    ("cukernels.io.safetensors", "the safetensors format, streamed and validated"),
    ("cukernels.io.hf_folder", "Hugging Face model folders"),
    ("cukernels.io.peft", "PEFT LoRA adapter folders"),
    ("cukernels.io.atomic", "atomic file writes"),
    ("cukernels.models", "the model registry and the families"),
    ("cukernels.generation", "sampling and decoding for any registered model"),
    ("cukernels.export", "a run or checkpoint as a Hugging Face folder (python -m cukernels.export)"),
    ("cukernels.graph", "CUDA-graph capture of a whole step"),
    ("cukernels.distributed", "process groups and NCCL collectives"),
]

# Public names without a docstring when this check began (docs/gen_api.py --check fails on any other, and on any of
# these once it has one: take it off the list then).
KNOWN_UNDOCUMENTED = {
    "cukernels.nn.ModuleList", "cukernels.nn.Parameter", "cukernels.nn.RMSNorm", "cukernels.nn.LayerNorm",
    "cukernels.models.model_class", "cukernels.io.checkpoint.train_arrays", "cukernels.io.hf_folder.folder_of",
    "cukernels.io.hf_folder.is_hf_folder",
    "cukernels.distributed.is_initialized", "cukernels.distributed.reduce_scatter", "cukernels.distributed.all_gather",
    "cukernels.distributed.broadcast", "cukernels.distributed.barrier",
    *(f"cukernels.functional.{n}" for n in (
        "Add", "Cast", "Concat", "Contiguous", "Div", "Exp", "GetItem", "LayerNormF", "Log", "Mul", "PowScalar",
        "RMSNormF", "Reshape", "RopeF", "Rsqrt", "Sigmoid", "SoftmaxF", "Sub", "Sum", "SwiGLUF", "SwiGLUPackedF",
        "Tanh", "Transpose", "add", "cast", "concat", "contiguous", "div", "erf", "exp", "getitem", "layer_norm",
        "log", "masked_fill", "matmul", "mean", "mul", "reshape", "rotate_half", "rsqrt", "sigmoid", "silu", "sub",
        "sum", "tanh", "transpose")),
}

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")
_MODULE = re.compile(r"<module '([\w.]+)'(?: from '[^']*')?>")
_CLASS = re.compile(r"<class '([\w.]+)'>")


def _clean(text: str) -> str:
    """A repr without what changes between machines and runs (addresses, file paths)."""
    return _CLASS.sub(r"\1", _MODULE.sub(r"\1", _ADDR.sub("", text)))


def _sig(obj) -> str:
    try:
        return _clean(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def own_doc(obj) -> str | None:
    """The object's own docstring (not inherited; not the one dataclasses write from the fields)."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        if doc and dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("):
            return None
    else:
        doc = getattr(obj, "__doc__", None)
    doc = inspect.cleandoc(doc) if isinstance(doc, str) else None
    return doc or None


def kind_of(obj) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "value"


def public_names(modname: str) -> list[str]:
    mod = importlib.import_module(modname)
    if modname == "cukernels":
        return [n for n, o in vars(mod).items() if not n.startswith("_") and not isinstance(o, types.ModuleType)
                and n != "annotations"]
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
    return [n for n, o in vars(mod).items() if not n.startswith("_") and getattr(o, "__module__", None) == modname
            and not isinstance(o, types.ModuleType)]


def _short(modname: str) -> str:
    return "ck" + modname[len("cukernels"):]


def _anchor(qual: str) -> str:
    return qual.replace(".", "-").lower()


def collect():
    """[(section, blurb, [entry])] and the names missing a docstring. An entry: dict(qual, name, kind, obj, alias)."""
    seen, out, missing = {}, [], []
    for modname, blurb in SECTIONS:
        mod = importlib.import_module(modname)
        entries = []
        for name in public_names(modname):
            obj = getattr(mod, name)
            qual = f"{modname}.{name}"
            kind = kind_of(obj)
            e = dict(qual=qual, name=name, kind=kind, obj=obj, alias=None, external=None)
            if kind != "value":
                if id(obj) in seen:
                    e["alias"] = seen[id(obj)]
                else:
                    seen[id(obj)] = qual
                    home = getattr(obj, "__name__" if kind == "module" else "__module__", "") or ""
                    if not home.startswith("cukernels"):
                        e["external"] = home.split(".")[0]
                    elif own_doc(obj) is None:
                        missing.append(qual)
            elif isinstance(obj, type) or type(obj).__module__.split(".")[0] not in ("builtins", "cukernels"):
                e["external"] = type(obj).__module__.split(".")[0]
            entries.append(e)
        out.append((modname, blurb, entries))
    return out, missing


def _methods(cls) -> list[str]:
    rows = []
    for n, f in vars(cls).items():
        if n.startswith("_") and n != "__call__":
            continue
        if isinstance(f, (staticmethod, classmethod)):
            f = f.__func__
        if isinstance(f, property):
            doc = own_doc(f.fget) if f.fget else None
            rows.append(f"- `.{n}` (property){': ' + doc.splitlines()[0] if doc else ''}")
        elif inspect.isfunction(f):
            doc = own_doc(f)
            rows.append(f"- `.{n}{_sig(f)}`{': ' + doc.splitlines()[0] if doc else ''}")
    return rows


def render() -> tuple[str, list[str]]:
    sections, missing = collect()
    lines = ["# API reference", "",
             "Generated from the docstrings by `python docs/gen_api.py` (CI runs `python docs/gen_api.py --check`, "
             "which fails when this page is out of date or a public name has no docstring). The topic pages are in "
             "[the docs index](index.md).", ""]
    lines.append("Contents: " + " · ".join(f"[`{_short(m)}`](#{_anchor(m)})" for m, _, _ in sections))
    lines.append("")
    for modname, blurb, entries in sections:
        lines += [f'<a id="{_anchor(modname)}"></a>', "", f"## `{_short(modname)}`: {blurb}", ""]
        moddoc = own_doc(importlib.import_module(modname))
        if moddoc and modname != "cukernels":
            lines += [moddoc.split("\n\n")[0].replace("\n", " "), ""]
        for e in entries:
            q, short = e["qual"], _short(e["qual"])
            obj = e["obj"]
            if e["alias"]:
                lines += [f"- `{short}`: the same object as [`{_short(e['alias'])}`](#{_anchor(e['alias'])})", ""]
                continue
            if e["kind"] == "value":
                lines += [f'<a id="{_anchor(q)}"></a>', "",
                          f"### `{short}` = `{_clean(repr(obj))[:120]}`"
                          + (f" (from {e['external']})" if e["external"] else ""), ""]
                continue
            head = {"module": f"### module `{short}`", "class": f"### class `{short}{_sig(obj)}`",
                    "function": f"### `{short}{_sig(obj)}`"}[e["kind"]]
            lines += [f'<a id="{_anchor(q)}"></a>', "", head, ""]
            if e["external"]:
                lines += [f"Re-exported from `{e['external']}`.", ""]
                continue
            doc = own_doc(obj)
            if e["kind"] == "module":
                lines += [(doc.split("\n\n")[0].replace("\n", " ") if doc else "(no docstring yet)"), ""]
                continue
            lines += (["```text", doc, "```"] if doc else ["(no docstring yet)"]) + [""]
            if e["kind"] == "class":
                ms = _methods(obj)
                if ms:
                    lines += ["Methods:", ""] + ms + [""]
    return "\n".join(lines).rstrip() + "\n", missing


def config_block() -> str:
    from cukernels.train import config
    return "\n".join([BEGIN, "```text", config.describe().rstrip(), "```", END])


def training_page(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{TRAINING.relative_to(ROOT)}: the markers {BEGIN} / {END} are missing")
    i, j = text.index(BEGIN), text.index(END) + len(END)
    return text[:i] + config_block() + text[j:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale or a docstring "
                                                         "is missing")
    a = ap.parse_args(argv)
    api, missing = render()
    training_old = TRAINING.read_text()
    training_new = training_page(training_old)
    problems = []
    new_missing = sorted(set(missing) - KNOWN_UNDOCUMENTED)
    if new_missing:
        problems.append("public names without a docstring (write one):\n  " + "\n  ".join(new_missing))
    documented = sorted(KNOWN_UNDOCUMENTED - set(missing))
    if documented:
        problems.append("docs/gen_api.py: these have a docstring now (or are gone): take them off "
                        "KNOWN_UNDOCUMENTED:\n  " + "\n  ".join(documented))
    if a.check:
        for path, new in ((API, api), (TRAINING, training_new)):
            old = path.read_text() if path.exists() else ""
            if old != new:
                diff = "".join(list(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                         str(path.relative_to(ROOT)), "generated", n=1))[:40])
                problems.append(f"{path.relative_to(ROOT)} is out of date: run python docs/gen_api.py\n{diff}")
    else:
        API.write_text(api)
        if training_new != training_old:
            TRAINING.write_text(training_new)
        print(f"wrote {API.relative_to(ROOT)} and the config table of {TRAINING.relative_to(ROOT)}")
    n = sum(1 for _ in re.finditer(r"^### ", api, re.M))
    print(f"{n} public names documented; {len(set(missing) & KNOWN_UNDOCUMENTED)} known without a docstring "
          f"(KNOWN_UNDOCUMENTED)")
    for p in problems:
        print("error: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
