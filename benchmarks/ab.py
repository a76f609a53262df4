"""A/B rows for the benchmarks' ``--ab`` option: ``ck.settings`` values (and the module constants not yet moved there).

A spec is ``"name=v[,name=v...][;...]"``: ``;`` between rows, ``,`` between the settings of one row. ``name`` is
a ``ck.settings`` name (``pdl=0``, ``decode_fused_attention=0``, ``gemv_depth=4``; ``python -c "import cukernels as
ck; print(ck.settings.describe())"`` lists them) with ``v`` in the environment's text form (``0 / 1``, a number,
``none``, a choice); or ``mod.ATTR``: a module constant of ``cukernels.ops``, ``cukernels.nn``, ``cukernels.optim``
or ``cukernels`` (``zero.ADAM_OCCUPANCY=8``), or ``__main__`` (the benchmark script's own constants:
``__main__.GRAD_BF16=1``), ``v`` an integer, a float or a string. The old module names of the switches that moved
to ``ck.settings`` (``_launch.PDL=0``, ``decode.FUSED_ATTENTION=0``: the commands in benchmarks/NOTES.md) still
work: :data:`MOVED` maps them.
"""
from __future__ import annotations

import contextlib
import importlib
import sys

PACKAGES = ("cukernels.ops", "cukernels.nn", "cukernels.optim", "cukernels")

# The module constants that became ck.settings fields: old ``module.NAME`` (as the NOTES commands write it, and with
# the package path) -> the setting's name.
MOVED = {
    "_launch.PDL": "pdl", "_launch.CARVEOUT": "pdl_carveout",
    "zero.ADAM_OCCUPANCY": "zero_adam_occupancy", "zero.EAGER_GATHERS": "zero_eager_gathers",
    "zero.CAST_ON_COMPUTE_STREAM": "zero_cast_on_compute_stream", "zero.SIDE_PRIORITY": "zero_side_priority",
    "attention.WGMMA": "attention_wgmma",
    "attention_sm90.VARIANT": "attention_sm90_variant", "attention_sm90.BWD_VARIANT": "attention_sm90_bwd_variant",
    "attention_sm90.BWD_DQ": "attention_sm90_bwd_dq", "attention_sm90.PERSISTENT": "attention_sm90_persistent",
    "attention_sm90.GRID_CAP": "attention_sm90_grid_cap",
    "kernel_ops.ROPE_IN_ATTENTION_BACKWARD": "rope_in_attention_backward",
    "decode.FUSED_ATTENTION": "decode_fused_attention", "decode.MAX_ROWS": "decode_max_rows",
    "layers.PACK_PROJECTIONS": "pack_projections",
    "autograd.FAST_CAST": "fast_cast",
    "loss_ops.HEAD_WORKSPACE": "head_workspace",
    "cross_entropy.CACHE_HINTS": "ce_cache_hints",
    "linear_cross_entropy.STAGE_WEIGHT": "lce_stage_weight",
    "graph.MEMSET_NODES": "graph_memset_nodes",
    "gemv.PREFETCH_KB": "gemv_prefetch_kb", "gemv.DEPTH": "gemv_depth", "gemv.DEPTH_LONG": "gemv_depth_long",
    "gemv.PAIR_MIN_NB": "gemv_pair_min_nb",
    "rope.HEAD_ROUND": "rope_head_round",
    "sampling.GREEDY_SPLIT": "greedy_split", "sampling.GREEDY_SLICE_BYTES": "greedy_slice_bytes",
    "softmax.CLUSTER": "softmax_cluster", "softmax.CLUSTER_THREADS": "softmax_cluster_threads",
    "softmax.CLUSTER_FWD_FROM_F32": "softmax_cluster_fwd_from_f32",
    "softmax.CLUSTER_FWD_FROM_BF16": "softmax_cluster_fwd_from_bf16",
    "softmax.CLUSTER_MAX_GRID": "softmax_cluster_max_grid",
    "layer_norm.TARGET_VPT": "layer_norm_target_vpt", "layer_norm.FWD_TARGET_VPT": "layer_norm_fwd_target_vpt",
    "layer_norm.FWD_TARGET_VPT_BF16": "layer_norm_fwd_target_vpt_bf16",
    "layer_norm.PIPE_THREADS": "layer_norm_pipe_threads", "layer_norm.PIPE_STAGES": "layer_norm_pipe_stages",
    "layer_norm.PIPE_MIN_TPR": "layer_norm_pipe_min_tpr", "layer_norm.BWD_KERNEL": "layer_norm_bwd_kernel",
    "layer_norm.WARP_ROWS": "layer_norm_warp_rows",
}


def rows(spec):
    """The rows of a spec, each a string of settings."""
    return [t.strip() for t in (spec or "").split(";") if t.strip()]


def setting_name(name):
    """The ``ck.settings`` name ``name`` stands for (itself, or a moved module constant's), or None."""
    from cukernels import settings

    if name in settings:
        return name
    parts = name.split(".")
    for i in range(len(parts) - 1):  # "functional.kernel_ops.X", "cukernels.ops._launch.PDL" -> "kernel_ops.X"
        short = ".".join(parts[i:])
        if short in MOVED:
            return MOVED[short]
    return None


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
    """An int, else a float, else the text itself (a string constant)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse(row):
    """``(settings, constants)`` of one row: ``{setting: value}`` (checked) and ``[(module, attr, value)]``."""
    from cukernels import settings

    values, consts = {}, []
    for one in row.split(","):
        if "=" not in one:
            raise ValueError(f"--ab: expected name=value; got {one.strip()!r}")
        name, val = (t.strip() for t in one.split("=", 1))
        s = setting_name(name)
        if s is not None:
            values[s] = settings.field(s).parse(val, what=f"--ab {name}")
            continue
        if "." not in name:
            settings.field(name)  # an unknown setting: refused with a did-you-mean
        modname, attr = name.rsplit(".", 1)
        mod = _module(modname)
        if not hasattr(mod, attr):
            raise ValueError(f"--ab: {mod.__name__} has no attribute {attr!r} (nor is {name!r} a ck.settings name)")
        consts.append((mod, attr, _number(val)))
    return values, consts


@contextlib.contextmanager
def applied(row):
    """Set every ``name=v`` of one row (settings and module constants), restore them on exit."""
    from cukernels import settings

    values, consts = parse(row)
    olds = []
    with settings(**values):
        try:
            for mod, attr, val in consts:
                olds.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, val)
            yield
        finally:
            for mod, attr, old in reversed(olds):
                setattr(mod, attr, old)
