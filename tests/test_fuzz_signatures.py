"""Property-based misuse tests (issue 36): for every public function and constructor in ``tests/signatures.py``,
one argument at a time is replaced by an invalid value of its kind (everything else valid), and the call must
raise TypeError or ValueError whose one-line message starts with that argument's name -- never an
AttributeError, a NumPy-internal message, a ZeroDivisionError, or a silent result.

Two tests: every labelled invalid value of every argument, exhaustively (the table's cases, deterministic), and
hypothesis drawing further invalid numbers, strings and sizes (derandomized, a few hundred examples)."""
from __future__ import annotations

import math
import os
import re
import warnings

import numpy as np
import pytest

import signatures as SIG

NAN, INF = float("nan"), float("inf")


def _arr(fn):
    return lambda valid: fn(valid) if hasattr(valid, "astype") else None


def _under_a_file(valid):
    blocker = os.path.join(SIG.tmpdir(), "a-file")
    with open(blocker, "w") as fh:
        fh.write("x")
    return os.path.join(blocker, "x.bin")


# kind -> [(label, value or callable(valid value) -> value; None from a callable: not applicable)]
BAD = {
    "farr": [("None", None), ("list", [1.0, 2.0]), ("str", "x"), ("num", 3.0),
             ("f64", _arr(lambda v: v.astype(np.float64))), ("int", _arr(lambda v: v.astype(np.int32)))],
    "oarr": [("list", [1.0]), ("str", "x"), ("num", 3.0), ("f64", _arr(lambda v: v.astype(np.float64)))],
    "iarr": [("None", None), ("float", _arr(lambda v: v.astype(np.float32) + 0.5)), ("flist", [0.5]),
             ("str", "x"), ("big", _arr(lambda v: v.astype(np.int64) + 2**32)),
             ("ubig", _arr(lambda v: v.astype(np.uint64) + np.uint64(2**63)))],
    "oiarr": [("float", _arr(lambda v: v.astype(np.float32) + 0.5)), ("str", "x"),
              ("big", _arr(lambda v: v.astype(np.int64) + 2**32))],
    "pos_int": [("zero", 0), ("neg", -1), ("float", 1.5), ("str", "3"), ("bool", True), ("big", 2**70),
                ("nan", NAN)],
    "nn_int": [("neg", -1), ("float", 1.5), ("str", "3"), ("bool", True), ("big", 2**70)],
    "int": [("float", 1.5), ("str", "3"), ("bool", True), ("big", 2**70), ("None", None)],
    "pos": [("zero", 0), ("neg", -1.0), ("nan", NAN), ("inf", INF), ("str", "1"), ("None", None), ("bool", True)],
    "nn": [("neg", -1.0), ("nan", NAN), ("inf", INF), ("str", "1"), ("None", None), ("bool", True)],
    "real": [("nan", NAN), ("inf", INF), ("str", "1"), ("None", None), ("bool", True)],
    "prob": [("neg", -0.1), ("big", 1.5), ("nan", NAN), ("str", "0.1"), ("None", None)],
    "p1": [("neg", -0.1), ("one", 1.0), ("nan", NAN), ("str", "0.1"), ("None", None)],
    "bool": [("str", "yes"), ("int", 1), ("None", None), ("float", 2.0)],
    "dtype": [("f64", np.float64), ("garbage", "fp33"), ("int8", np.int8), ("str", "bf16")],
    "seed": [("neg", -1), ("big", 2**64), ("float", 1.5), ("str", "1"), ("None", None)],
    "choice": [("bogus", "bogus"), ("int", 3), ("None", None)],
    "path": [("None", None), ("int", 3), ("under-a-file", _under_a_file)],
    "amap": [("None", None), ("list", [1.0]), ("str", "x"), ("not-array", {"w": [1, 2]}), ("int-key", {1: "x"}),
             ("object", {"w": np.array([None], object)})],
    "meta": [("list", [1]), ("set", {"a": {1, 2}}), ("array", {"a": np.zeros(2)})],
    "smeta": [("list", [1]), ("int-value", {"a": 1}), ("nested", {"a": {"b": "c"}})],
}


def _kind(spec):
    """(base kind, excluded labels, choices) of a table kind: "pos!None", ("choice", (...))."""
    if isinstance(spec, tuple):
        return "choice", set(), spec[1]
    base, *skip = spec.split("!")
    return base, set(skip), None


def _bad_values(spec, valid):
    base, skip, choices = _kind(spec)
    for label, v in BAD[base]:
        if label in skip:
            continue
        if callable(v) and not isinstance(v, type):
            v = v(valid)
            if v is None:
                continue
        if choices is not None and v in choices:
            continue
        yield label, v


def _expect_named(fn, kw, arg, value):
    """The call raises TypeError / ValueError with one line starting with ``arg`` (``Cls.arg`` for configs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(**kw)
        except (TypeError, ValueError) as e:
            msg = str(e)
            head = re.escape(arg)
            assert re.match(rf"^([\w.]+\.)?{head}\b", msg), f"{arg}={value!r}: the message does not name it: {msg}"
            assert "\n" not in msg, f"{arg}={value!r}: a message of several lines: {msg}"
            return
        except Exception as e:  # noqa: BLE001 - that is what this test is about
            pytest.fail(f"{arg}={value!r}: {type(e).__name__} (expected TypeError / ValueError naming {arg}): {e}")
    pytest.fail(f"{arg}={value!r}: accepted (expected TypeError / ValueError naming {arg})")


@pytest.mark.parametrize("name", list(SIG.TABLE))
def test_every_labelled_bad_value_is_refused_naming_the_argument(name):
    fn, build, kinds = SIG.TABLE[name]
    fn(**build())  # the valid call works
    for arg, spec in kinds.items():
        for label, v in _bad_values(spec, build().get(arg)):
            kw = build()
            kw[arg] = v
            _expect_named(fn, kw, arg, v)


# ------------------------------------------------------------------------------------------ hypothesis
hyp = pytest.importorskip("hypothesis")  # (the GPU machine may not have it: the table test above still runs)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_text = st.text(max_size=4)
_junk = st.one_of(_text, st.none(), st.booleans(), st.lists(st.integers(), max_size=2))
_bigs = st.integers(min_value=2**64, max_value=2**80) | st.integers(min_value=-2**80, max_value=-2**64)


def _strategy(spec):
    """Invalid values of a scalar kind, drawn by hypothesis (None for array kinds: the labelled list covers them)."""
    base, skip, _ = _kind(spec)
    junk = st.one_of(_text, st.booleans(), st.lists(st.integers(), max_size=2),
                     *(() if "None" in skip else (st.none(),)))
    nonfinite = st.sampled_from([NAN, INF, -INF])
    if base == "pos_int":
        floats = st.floats(allow_nan=True)
        if "intfloat" in skip:  # (a float holding a whole number is a valid step: 2.0)
            floats = floats.filter(lambda x: not (math.isfinite(x) and x == int(x) and 1 <= x <= 2**53))
        s = st.integers(max_value=0) | floats | junk
        return s if "big" in skip else s | _bigs.filter(lambda v: v > 0)
    if base == "nn_int":
        s = st.integers(max_value=-1) | st.floats(allow_nan=True) | junk
        return s if "big" in skip else s | _bigs.filter(lambda v: v > 0)
    if base == "int":
        return st.floats(allow_nan=True) | junk | _bigs
    if base == "pos":
        return st.floats(max_value=0.0) | nonfinite | junk
    if base == "nn":
        return st.floats(max_value=-1e-30) | nonfinite | junk
    if base == "real":
        return nonfinite | junk
    if base == "prob":
        return st.floats(max_value=-1e-6) | st.floats(min_value=1.001) | nonfinite | junk
    if base == "p1":
        return st.floats(max_value=-1e-6) | st.floats(min_value=1.0) | nonfinite | junk
    if base == "bool":
        return st.one_of(st.integers(), st.floats(allow_nan=True), _text,
                         *(() if "None" in skip else (st.none(),)))  # (bool!None: None is valid, the default)
    if base == "seed":
        return st.integers(max_value=-1) | st.integers(min_value=2**64, max_value=2**70) | st.floats() | _text
    return None


_PAIRS = [(n, a) for n, (_, _, kinds) in SIG.TABLE.items() for a, k in kinds.items() if _strategy(k) is not None]


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_drawn_bad_values_are_refused_naming_the_argument(data):
    name, arg = data.draw(st.sampled_from(_PAIRS), label="function, argument")
    fn, build, kinds = SIG.TABLE[name]
    v = data.draw(_strategy(kinds[arg]), label=arg)
    kw = build()
    kw[arg] = v
    _expect_named(fn, kw, arg, v)


def test_table_covers_the_public_ops():
    """Every public callable of ``cukernels`` that takes arguments is in the table (or listed as exempt here)."""
    import inspect

    import cukernels as ck

    exempt = {"Function", "Tensor", "KernelCompileError", "adam_error", "autocast", "cross_entropy_error",
              "embedding_error", "flash_attention_sm90_supported", "gpu_available", "no_grad", "sample_workspace",
              "from_pretrained", "GPT2", "Llama", "Qwen2", "Qwen3", "Mistral",
              "decode_attention_workspace",
              "flash_attention_sm90", "flash_attention_backward_sm90",  # (GPU-only / covered by their configs)
              "Tokenizer", "ByteTokenizer", "TextStream",
              "settings"}  # (tests/test_settings.py: names, types, ranges, choices)  # (tests/test_tokenizer.py: their bad input, one by one)
    public = {n for n in dir(ck) if not n.startswith("_") and callable(getattr(ck, n))
              and not inspect.ismodule(getattr(ck, n))}
    missing = sorted(public - exempt - set(SIG.TABLE))
    assert not missing, f"public callables without a signature row: {missing}"
