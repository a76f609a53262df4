"""Every kernel instantiation of every kernels_cu/*.cu compiles to PTX through NVRTC, without a GPU."""
import re

import pytest

from cukernels import _loader, _nvrtc

pytestmark = pytest.mark.skipif(not _nvrtc.available(), reason="libnvrtc not installed (pip install '.[test]')")


@pytest.mark.parametrize("family,arch", [(f, a) for f in _loader.families() for a in _loader.archs(f)])
def test_family_compiles(family, arch):
    ptx = _nvrtc.compile_ptx(family, arch)
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert entries, f"{family}.cu defines no extern \"C\" kernels"
    # Entry points written out by hand must all be there (macro-generated ones are only visible in the PTX).
    missing = set(_loader.entry_points(family)) - entries
    assert not missing, f"{family}.cu: entry points missing from the PTX: {sorted(missing)}"
    # No stack frames: an indexed register array that spilled to local memory would show here.
    assert ".local" not in ptx, f"{family}.cu uses local memory (a register array indexed at run time?)"


def test_compile_error_names_the_file_and_carries_the_log(monkeypatch, tmp_path):
    bad = tmp_path / "kernels_cu"
    (bad / "common").mkdir(parents=True)
    (bad / "broken.cu").write_text('extern "C" __global__ void k() { this is not C++; }\n')
    monkeypatch.setattr(_loader, "kernel_dir", lambda: bad)
    _loader.load_source.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"broken\.cu failed to compile[\s\S]*error"):
            _nvrtc.compile_ptx("broken", "sm_90")
    finally:
        _loader.load_source.cache_clear()


def test_headers_are_inlined_into_the_cache_key():
    src = _loader.load_source("rms_norm")
    assert "#include \"common/" not in src
    assert "struct __align__(2) bf16" in src  # from common/vec.cuh


@pytest.mark.parametrize("family", _loader.families())
def test_no_spills_or_stack_frames(family):
    """ptxas for sm_90: no kernel may spill or keep a stack frame (a register cap set by __launch_bounds__
    that is too tight, or a register array indexed at run time, puts values in slow local memory)."""
    usage = _nvrtc.resource_usage(family, _loader.archs(family)[-1])
    assert usage, f"no ptxas report for {family}.cu"
    bad = {k: v for k, v in usage.items() if v["stack"] or v["spill_stores"] or v["spill_loads"]}
    assert not bad, f"{family}.cu: kernels with local memory: {bad}"
