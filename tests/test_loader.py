"""The loader: which binary serves which GPU, the prebuilt binaries' keys, the JIT of one entry point.

CPU tests check the choice (a pure function of the files present, the device's compute capability and the
environment); the GPU tests load kernels both ways and compare them.
"""
import numpy as np
import pytest

import cukernels as ck
from cukernels import _loader

gpu = pytest.mark.gpu


@pytest.mark.parametrize("cc,want", [(80, "sm_80"), (86, "sm_80"), (89, "sm_80"), (90, "sm_90"), (75, None),
                                     (100, None), (120, None)])
def test_binary_arch(cc, want):
    assert _loader.binary_arch("rms_norm", cc) == want


def test_binary_arch_of_an_arch_specific_family():
    assert _loader.binary_arch("attention_sm90", 90) == "sm_90a"
    assert _loader.binary_arch("attention_sm90", 80) is None
    assert _loader.binary_arch("attention_sm90", 100) is None  # sm_90a code runs on 9.0 only


def test_source_selects_entries():
    src = _loader.source("adam", ["adam_f32_v", "sumsq_final"])
    head = src.split("// cukernels: adam.cu")[0]
    assert head == "#define CK_ONE_ENTRY\n#define CK_WANT_adam_f32_v ~, 1\n#define CK_WANT_sumsq_final ~, 1\n"
    assert _loader.source("adam").startswith("// cukernels: adam.cu")
    assert _loader.source("adam", listing=True).startswith("#define CK_LIST_ENTRIES\n")


def test_prebuilt_key_depends_on_source_options_and_arch(monkeypatch):
    k = _loader.prebuilt_key("adam", "sm_90")
    assert len(k) == 16 and k == _loader.prebuilt_key("adam", "sm_90")
    assert _loader.prebuilt_key("adam", "sm_80") != k
    assert _loader.prebuilt_key("rms_norm", "sm_90") != k
    monkeypatch.setattr(_loader, "OPTIONS", _loader.OPTIONS + ("-DSOMETHING",))
    assert _loader.prebuilt_key("adam", "sm_90") != k


@pytest.fixture
def prebuilt_dir(monkeypatch, tmp_path):
    d = tmp_path / "_prebuilt"
    monkeypatch.setattr(_loader, "PREBUILT_DIR", d)
    monkeypatch.delenv("CUKERNELS_PREBUILT", raising=False)
    return d


def test_prebuilt_choice(prebuilt_dir, monkeypatch):
    path, why = _loader.prebuilt_choice("adam", 90)
    assert path is None and "no prebuilt binaries" in why
    prebuilt_dir.mkdir()
    assert "no prebuilt adam binary for sm_90" in _loader.prebuilt_choice("adam", 90)[1]
    (prebuilt_dir / "adam.sm_90.0123456789abcdef.cubin").write_bytes(b"old")
    assert "built from other source" in _loader.prebuilt_choice("adam", 90)[1]
    good = _loader.prebuilt_path("adam", "sm_90")
    good.write_bytes(b"\x7fELF")
    assert _loader.prebuilt_choice("adam", 90) == (good, None)
    assert _loader.prebuilt_choice("adam", 86)[0] is None  # sm_80's binary, not there
    assert _loader.prebuilt_choice("adam", 100) == (None, "no prebuilt binaries for sm_100")
    monkeypatch.setenv("CUKERNELS_PREBUILT", "0")
    assert _loader.prebuilt_choice("adam", 90) == (None, "CUKERNELS_PREBUILT=0")


def test_jit_note_is_printed_once(monkeypatch, capsys):
    monkeypatch.setattr(_loader, "_noted", [])
    _loader._note("adam", "no prebuilt binaries for sm_100")
    _loader._note("rms_norm", "no prebuilt binaries for sm_100")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no prebuilt binaries for sm_100" in err[0] and "python -m cukernels.build" in err[0]


# ------------------------------------------------------------------------------------------------------- GPU
@gpu
def test_jit_entry_matches_what_get_function_serves():
    """One entry point through the JIT (its one-entry source) and through get_function (the prebuilt binary when
    this install has one) computes the same bits, on misaligned views too."""
    import cupy as cp

    rng = np.random.default_rng(0)
    n = 4099
    a = cp.asarray(rng.standard_normal(n + 1).astype(np.float32))[1:]  # misaligned: the scalar entry
    b = cp.asarray(rng.standard_normal(n + 1).astype(np.float32))[1:]
    name = "binary_f32_f32_f32_s"
    jit = _loader._jit("elementwise", name, cp.cuda.Device().id).get_function(name)
    outs = []
    for k in (_loader.get_function("elementwise", name), jit):
        y = cp.full(n, np.nan, np.float32)
        k((8,), (256, 1, 1), (a, b, y, np.int64(n), np.float32(0.5), np.bool_(False)))
        outs.append(y.get())
    want = a.get() + np.float32(0.5) * b.get()
    np.testing.assert_array_equal(outs[0], want)
    np.testing.assert_array_equal(outs[1], want)


@gpu
def test_get_function_is_cached_and_names_a_missing_entry():
    k1 = _loader.get_function("adam", "sumsq_final")
    assert _loader.get_function("adam", "sumsq_final") is k1
    with pytest.raises(ck.KernelCompileError, match=r"adam\.cu has no kernel 'no_such_kernel'"):
        _loader.get_function("adam", "no_such_kernel")


@gpu
def test_precompile_lists_and_loads_a_family():
    """The family ready without a compile on first use: its prebuilt binary loaded, or its entries JIT-compiled."""
    dev = __import__("cupy").cuda.Device().id
    assert _loader.precompile(["graph_fill"]) == ["graph_fill"]
    assert (_loader._modules.get(("graph_fill", dev)) is not None
            or ("graph_fill", "graph_fill", dev) in _loader._functions)
