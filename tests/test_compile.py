"""Kernels compile through NVRTC without a GPU, one entry point at a time as the loader compiles them.

Every family, for every architecture the wheel ships: its entry points are listed (macro-generated ones included),
one of them compiles alone to machine code with no stack frame or spill, and the one-entry build is the same code
as the whole family's. The whole sweep -- every entry of every family for every shipped architecture, with ptxas's
spill check -- is ``python -m cukernels.build``, which the wheel build runs (.ci/run); it takes minutes, so the
default suite checks one entry a family.
"""
import json
import re

import pytest

from cukernels import _loader, _nvrtc, build

pytestmark = pytest.mark.skipif(not _nvrtc.available(), reason="libnvrtc not installed (pip install '.[test]')")
PAIRS = [(f, a) for f in _loader.families() for a in _loader.archs(f)]


@pytest.mark.parametrize("family,arch", PAIRS)
def test_entries_are_listed(family, arch):
    entries = _loader.list_entries(family, arch)
    assert entries, f"{family}.cu defines no entry points for {arch}"
    missing = set(_loader.literal_entries(family)) - set(entries)
    assert not missing, f"{family}.cu: entry points written out in the source but not listed: {sorted(missing)}"


@pytest.mark.parametrize("family,arch", PAIRS)
def test_one_entry_compiles_alone(family, arch):
    """The middle entry of the sorted list, alone: ptxas sees that kernel and no other, with no local memory."""
    entries = _loader.list_entries(family, arch)
    name = entries[len(entries) // 2]
    cubin, log = _loader.compile_cubin(family, arch, [name], verbose=True)
    usage = _nvrtc.parse_usage(log)
    assert set(usage) == {name}, f"{family}.cu: compiling {name} alone generated {sorted(usage)}"
    assert build.local_bytes(usage[name]) <= build.KNOWN_LOCAL.get((family, arch), {}).get(name, 0), usage
    assert cubin[:4] == b"\x7fELF"


def _entry_ptx(ptx: str, name: str) -> str:
    i = ptx.index(f".entry {name}(")
    j = ptx.find("\n}\n", i)
    body = re.sub(r"//[^\n]*", "", ptx[i:j])  # comments number the call sites across the file
    return re.sub(r"\$L__BB\d+_", "$L__BB_", body)  # block labels carry the kernel's index in the file


def test_one_entry_is_the_code_of_the_family_build():
    """Selecting an entry changes which kernels get code, not the code: the PTX of two adam entries built alone
    equals their PTX in the whole-family build."""
    whole = _loader.compile_ptx("adam", "sm_90")
    for name in ("adam_bf16_v", "sumsq_final"):
        alone = _loader.compile_ptx("adam", "sm_90", entries=[name])
        assert re.findall(r"\.entry\s+(\w+)", alone) == [name]
        assert _entry_ptx(alone, name) == _entry_ptx(whole, name)


def _fake_kernels(monkeypatch, tmp_path, files: dict):
    root = tmp_path / "kernels_cu"
    (root / "common").mkdir(parents=True)
    (root / "common" / "entry.cuh").write_text((_loader.kernel_dir() / "common" / "entry.cuh").read_text())
    for name, text in files.items():
        (root / name).write_text(text)
    monkeypatch.setattr(_loader, "kernel_dir", lambda: root)
    _loader.load_source.cache_clear()
    return root


@pytest.fixture
def fake_kernels(monkeypatch, tmp_path):
    yield lambda files: _fake_kernels(monkeypatch, tmp_path, files)
    _loader.load_source.cache_clear()


def test_compile_error_names_the_file_and_carries_the_log(fake_kernels):
    fake_kernels({"broken.cu": 'extern "C" __global__ void k() { this is not C++; }\n'})
    with pytest.raises(RuntimeError, match=r"broken\.cu failed to compile[\s\S]*error"):
        _loader.compile_ptx("broken", "sm_90")


TOY = """#include "common/entry.cuh"
template <int N> __device__ void body(float* o) { o[N] = N; }
#define TOY(N) CK_ENTRY(__launch_bounds__(32), toy_##N)(float* o) { body<N>(o); }
TOY(1) TOY(2)
CK_ENTRY(, toy_plain)(float* o) { o[0] = 0; }
"""
# A register array indexed at run time lives in local memory: ptxas reports a stack frame.
SPILL = """#include "common/entry.cuh"
CK_ENTRY(, spill)(const int* i, float* o) {
  float a[64];
  for (int j = 0; j < 64; ++j) a[j] = o[j];
  for (int k = 0; k < i[0]; ++k) a[i[k + 1] & 63] += a[i[k + 2] & 63];  // run-time indices, in a loop
  o[0] = a[i[1] & 63];
}
"""


def test_selection_listing_and_keys(fake_kernels):
    fake_kernels({"toy.cu": TOY})
    assert _loader.list_entries("toy", "sm_80") == ["toy_1", "toy_2", "toy_plain"]
    assert _loader.literal_entries("toy") == ["toy_plain"]
    ptx = _loader.compile_ptx("toy", "sm_80", entries=["toy_2"])
    assert re.findall(r"\.entry\s+(\w+)", ptx) == ["toy_2"]
    both = _loader.compile_ptx("toy", "sm_80", entries=["toy_2", "toy_plain"])
    assert re.findall(r"\.entry\s+(\w+)", both) == ["toy_2", "toy_plain"]
    keys = {_loader.prebuilt_key("toy", a) for a in ("sm_80", "sm_90")}
    assert len(keys) == 2, "the architecture is part of the key"


def test_key_follows_headers(fake_kernels):
    root = fake_kernels({"toy.cu": TOY})
    k0 = _loader.prebuilt_key("toy", "sm_90")
    (root / "common" / "entry.cuh").write_text((root / "common" / "entry.cuh").read_text() + "\n// edited\n")
    _loader.load_source.cache_clear()
    assert _loader.prebuilt_key("toy", "sm_90") != k0, "a header edit must change the key of every family using it"


def test_build_writes_keyed_binaries_and_refuses_spills(fake_kernels, tmp_path):
    root = fake_kernels({"toy.cu": TOY, "spill.cu": SPILL})
    out = tmp_path / "prebuilt"
    (out).mkdir()
    (out / "toy.sm_80.0000000000000000.cubin").write_bytes(b"stale")
    index = build.build(out, ["sm_80"], ["toy", "spill"], jobs=2, log=lambda *_: None)
    toy = index["toy"]["sm_80"]
    assert not toy["errors"] and toy["entries"] == 3
    assert (out / toy["file"]).read_bytes()[:4] == b"\x7fELF"
    assert toy["file"] == _loader.prebuilt_path("toy", "sm_80", out).name
    assert not (out / "toy.sm_80.0000000000000000.cubin").exists(), "a stale binary must be removed"
    assert any("stack frame or spills" in e for e in index["spill"]["sm_80"]["errors"])
    assert not list(out.glob("spill.*.cubin")), "a kernel with local memory must not be shipped"
    assert json.loads((out / "index.json").read_text())["families"]["toy"]["sm_80"]["key"] == toy["key"]
    again = build.build(out, ["sm_80"], ["toy"], log=lambda *_: None)
    assert again["toy"]["sm_80"].get("cached"), "an up-to-date binary is kept"
    (root / "toy.cu").write_text(TOY + "// changed\n")
    _loader.load_source.cache_clear()
    rebuilt = build.build(out, ["sm_80"], ["toy"], log=lambda *_: None)["toy"]["sm_80"]
    assert not rebuilt.get("cached") and rebuilt["file"] != toy["file"]
    assert sorted(p.name for p in out.glob("toy.*.cubin")) == [rebuilt["file"]]


def test_headers_are_inlined():
    src = _loader.load_source("rms_norm")
    assert "#include \"common/" not in src
    assert "struct __align__(2) bf16" in src  # from common/vec.cuh
