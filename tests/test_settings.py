"""ck.settings (cukernels/settings.py): typed fields, attribute access, the context manager, environment overrides,
the table, and benchmarks/ab.py's rows (new names and the old module.NAME form)."""
import re
import sys
import threading
from pathlib import Path

import pytest

import cukernels as ck

ROOT = Path(__file__).resolve().parents[1]
Settings, Field = type(ck.settings), sys.modules["cukernels.settings"].Field
FIELDS = sys.modules["cukernels.settings"].FIELDS


def fresh(environ=None):
    return Settings(FIELDS, environ={} if environ is None else environ)


def test_defaults_and_types():
    s = fresh()
    assert s.as_dict() == {f.name: f.default for f in FIELDS} and s.changed() == {}
    assert s.pdl is True and s.attention_sm90_grid_cap is None and s.head_workspace == 1 << 30
    for f in FIELDS:
        assert isinstance(f.doc, str) and f.doc and f.where
        assert f.default is None or type(f.default) is f.type


def test_attribute_access_is_type_checked():
    s = fresh()
    s.pdl = False
    assert s.pdl is False and s.changed() == {"pdl": False}
    with pytest.raises(TypeError, match=r"settings\.pdl: expected a bool; got int 0"):
        s.pdl = 0
    with pytest.raises(TypeError, match="settings.gemv_depth: expected an integer"):
        s.gemv_depth = 3.0
    with pytest.raises(TypeError, match="gemv_depth"):
        s.gemv_depth = True  # a bool is no integer here
    with pytest.raises(ValueError, match=r"settings\.pdl_carveout: expected a value >= -1 and <= 100; got 101"):
        s.pdl_carveout = 101
    with pytest.raises(ValueError, match="attention_sm90_bwd_dq: expected one of 'fused', 'kernel'; got 'bogus'"):
        s.attention_sm90_bwd_dq = "bogus"
    with pytest.raises(TypeError, match="got None"):
        s.gemv_depth = None
    s.attention_sm90_grid_cap = 3
    s.attention_sm90_grid_cap = None  # optional
    assert s.changed() == {"pdl": False}
    s.reset()
    assert s.changed() == {}


def test_unknown_names_are_refused_with_a_suggestion():
    s = fresh()
    with pytest.raises(AttributeError, match=r"no setting 'pdll'; did you mean 'pdl'\?"):
        s.pdll = False
    with pytest.raises(AttributeError, match="did you mean 'gemv_depth'"):
        s.gemv_dept
    with pytest.raises(TypeError, match="did you mean 'fast_cast'"):
        s(fastcast=False)
    with pytest.raises(AttributeError, match="no setting 'zzz' .*describe"):
        s.zzz
    assert not hasattr(s, "nope") and hasattr(s, "pdl")
    with pytest.raises(AttributeError, match="reset"):
        del s.pdl


def test_context_manager_restores_and_checks_first():
    s = fresh()
    s.gemv_depth = 2
    with s(gemv_depth=4, pdl=False) as t:
        assert t is s and s.gemv_depth == 4 and s.pdl is False
        with s(gemv_depth=1):
            assert s.gemv_depth == 1
        assert s.gemv_depth == 4
    assert s.gemv_depth == 2 and s.pdl is True
    with pytest.raises(RuntimeError):
        with s(pdl=False):
            raise RuntimeError("boom")
    assert s.pdl is True
    with pytest.raises(TypeError):  # nothing applied when one value is bad
        with s(pdl=False, gemv_depth="3"):
            pass
    assert s.pdl is True

    @s(fast_cast=False)
    def f():
        return s.fast_cast

    assert f() is False and f() is False and s.fast_cast is True


def test_context_manager_from_threads():
    s = fresh()
    errors = []

    def work(i):
        try:
            for _ in range(200):
                with s(gemv_depth=i + 1):
                    s.as_dict()
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and s.gemv_depth == 3  # every block restored (LIFO per thread; the default at the end)


def test_environment_overrides():
    s = fresh({"CUKERNELS_PDL": "0", "CUKERNELS_GEMV_DEPTH": "4", "CUKERNELS_ATTENTION_SM90_GRID_CAP": "none",
               "CUKERNELS_LAYER_NORM_BWD_KERNEL": "pipe", "CUKERNELS_PREBUILT": "0", "OTHER": "x"})
    assert s.pdl is False and s.gemv_depth == 4 and s.attention_sm90_grid_cap is None
    assert s.layer_norm_bwd_kernel == "pipe"
    assert "[CUKERNELS_PDL=0]" in s.describe()
    s.pdl = True
    s.reset("pdl")  # back to the value at import, the environment's
    assert s.pdl is False
    with pytest.raises(ValueError, match="CUKERNELS_PDL: expected a bool"):
        fresh({"CUKERNELS_PDL": "maybe"})
    with pytest.raises(ValueError, match="CUKERNELS_GEMV_DEPTH: expected an integer; got 'x'"):
        fresh({"CUKERNELS_GEMV_DEPTH": "x"})
    with pytest.raises(ValueError, match="CUKERNELS_GRAPH_MEMSET_NODES: expected one of"):
        fresh({"CUKERNELS_GRAPH_MEMSET_NODES": "nope"})
    with pytest.warns(RuntimeWarning, match="CUKERNELS_GEMV_DEPT: not a cukernels setting; did you mean "
                                            "CUKERNELS_GEMV_DEPTH"):
        fresh({"CUKERNELS_GEMV_DEPT": "4"})


def test_parse_text_forms():
    s = fresh()
    assert [s.parse("pdl", t) for t in ("1", "0", "true", "OFF", "yes")] == [True, False, True, False, True]
    assert s.parse("gemv_depth", " 4 ") == 4 and s.parse("attention_sm90_grid_cap", "none") is None
    assert s.parse("attention_sm90_variant", "") == "" and s.parse("attention_sm90_variant", "_wg3") == "_wg3"
    with pytest.raises(ValueError, match="settings.gemv_depth: expected a value >= 1"):
        s.parse("gemv_depth", "0")


def test_describe_lists_every_setting():
    text = ck.settings.describe()
    for f in FIELDS:
        assert re.search(rf"^{f.name} = ", text, re.M) and f.env in text and f.doc in text
    assert repr(ck.settings).startswith("<cukernels settings: ")
    assert set(ck.settings) == {f.name for f in FIELDS} and "pdl" in ck.settings


def test_every_setting_is_read_where_it_says():
    """One hop from a setting to its code: the module named in ``where`` reads ``S.<name>`` (or
    ``settings.<name>``), and the moved module constants are gone (a stale setattr would change nothing)."""
    for f in FIELDS:
        src = (ROOT / "cukernels" / f.where).read_text()
        assert re.search(rf"\b(S|settings)\.{f.name}\b", src), f"{f.name}: not read in {f.where}"
    from cukernels.ops import _launch, attention, attention_sm90, gemv, softmax
    from cukernels.nn import decode, layers
    for mod, names in ((_launch, "PDL CARVEOUT"), (attention, "WGMMA"), (attention_sm90, "VARIANT PERSISTENT BWD_DQ"),
                       (gemv, "DEPTH PREFETCH_KB"), (softmax, "CLUSTER"), (decode, "FUSED_ATTENTION MAX_ROWS"),
                       (layers, "PACK_PROJECTIONS")):
        for n in names.split():
            assert not hasattr(mod, n), f"{mod.__name__}.{n} still exists"


def test_choices_mirror_the_kernel_tables():
    from cukernels.ops import attention_sm90 as A90
    assert ck.settings.field("attention_sm90_variant").choices == ("auto",) + A90.VARIANTS
    assert ck.settings.field("attention_sm90_bwd_variant").choices == A90.BWD_VARIANTS


def test_a_setting_is_read_at_call_time():
    """The NumPy path of a planner reads the setting when called (what a graph capture relies on)."""
    from cukernels.ops import softmax as SM
    assert SM._fwd_route(65536, 2, True, False, 90)[0] == "cluster"
    with ck.settings(softmax_cluster=False):
        assert SM._fwd_route(65536, 2, True, False, 90) == ("wide", 1024)
    assert SM._fwd_route(65536, 2, True, False, 90)[0] == "cluster"


@pytest.fixture
def ab():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ab
        yield ab
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_ab_rows_set_settings_and_accept_the_old_names(ab):
    assert ab.rows("pdl=0; ;gemv_depth=2,gemv_depth_long=2") == ["pdl=0", "gemv_depth=2,gemv_depth_long=2"]
    with ab.applied("pdl=0,gemv_depth=2"):
        assert ck.settings.pdl is False and ck.settings.gemv_depth == 2
    assert ck.settings.pdl is True and ck.settings.gemv_depth == 3
    # the commands in benchmarks/NOTES.md: module.NAME=value of the moved switches
    with ab.applied("_launch.PDL=0,decode.FUSED_ATTENTION=0,functional.kernel_ops.ROPE_IN_ATTENTION_BACKWARD=0,"
                    "graph.MEMSET_NODES=keep,attention_sm90.VARIANT=_wg3,cross_entropy.CACHE_HINTS=0"):
        assert ck.settings.changed() == dict(pdl=False, decode_fused_attention=False, rope_in_attention_backward=False,
                                             graph_memset_nodes="keep", attention_sm90_variant="_wg3",
                                             ce_cache_hints=False)
    assert ck.settings.changed() == {}
    assert set(ab.MOVED.values()) <= set(ck.settings)
    with pytest.raises(TypeError, match="did you mean 'pdl'"):
        ab.parse("pdll=0")
    with pytest.raises(ValueError, match="--ab pdl: expected a bool"):
        ab.parse("pdl=2")
    with pytest.raises(ValueError, match="no attribute 'NOPE'"):
        ab.parse("gemv.NOPE=1")


def test_ab_still_sets_the_constants_not_moved(ab):
    from cukernels.ops import gemv
    old = gemv.LONG_K
    with ab.applied("gemv.LONG_K=8192,pdl=0"):
        assert gemv.LONG_K == 8192 and ck.settings.pdl is False
    assert gemv.LONG_K == old and ck.settings.pdl is True
