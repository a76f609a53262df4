"""The one AdamW (issue 34: world size 1 the plain optimizer, ZeRO-1 on N ranks) gives, bit for bit, the numbers of
the two optimizers it replaced (``ck.optim.AdamW`` and ``ZeroAdamW`` of before): fixed scenarios on the NumPy path
(FakeGroup ranks), their every parameter, shadow, moment, clip norm, step and lr hashed, against the digests those
optimizers produced (recorded by running this same function on the code of commit 8125252). The scenarios avoid the
cosine (np.cos may round differently on another machine); every other operation is IEEE-exact per element or a
fixed-order sum."""
import contextlib
import hashlib

import numpy as np
import pytest

import cukernels as ck


class _Hook:
    def __init__(self, hooks, fn):
        self.hooks, self.fn = hooks, fn

    def remove(self):
        self.hooks.remove(self.fn)


class P:
    """An autograd Tensor as the optimizer sees it, with the gradient-ready hook (fired by the scenario)."""

    def __init__(self, name, data):
        self.name, self.data, self.grad, self.grad_stale, self.hooks = name, data, None, False, []

    def register_grad_ready_hook(self, fn):
        self.hooks.append(fn)
        return _Hook(self.hooks, fn)


def pinned_run(ck, scenario):
    """One fixed optimizer scenario on the NumPy path; returns the sha256 of every number it produced (parameters,
    shadows, consolidated moments, clip norms, step, lr), rank by rank. Written against the API both the
    optimizer before issue 34 and the one after offer, so the digests recorded from the first pin the second."""
    shapes = {"emb": (40, 16), "w1": (16, 24), "norm": (16,), "w2": (24, 16), "b": (7,), "head": (33, 16)}
    rng = np.random.default_rng(7)
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    world, steps, micro = scenario["world"], 3, scenario.get("micro", 1)
    grads = [[[{n: (rng.standard_normal(s) * 0.5).astype(np.float32) for n, s in shapes.items()}
               for _ in range(world)] for _ in range(micro)] for _ in range(steps)]
    ids = [[rng.integers(0, 40, (2, 3)).astype(np.int32) for _ in range(world)] for _ in range(steps)]
    douts = [[rng.standard_normal((2, 3, 16)).astype(np.float32) for _ in range(world)] for _ in range(steps)]

    def body(g):
        ps = [P(n, values[n].copy()) for n in shapes]
        named = {"bf16": ck.bfloat16, "1-D": lambda n, a: a.ndim < 2}
        kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, no_decay=lambda n, a: a.ndim < 2,
                  sparse={"emb"}, **{k: named.get(v, v) if isinstance(v, str) else v
                                     for k, v in scenario.get("kw", {}).items()})
        opt = ck.optim.AdamW(ps, **kw) if g is None else ck.optim.ZeroAdamW(ps, group=g, **kw)
        sg = opt.attach_sparse("emb")
        opt.set_schedule(ck.optim.WarmupCosine(1e-2, total_steps=steps, warmup_steps=steps))  # (linear: no cos)
        if scenario.get("hooks"):
            opt.attach_grad_hooks()
        r, h, norms = 0 if g is None else g.rank, hashlib.sha256(), []
        for t in range(steps):
            opt.zero_grad(lazy=True)
            for m in range(micro):
                with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    if m == 0:
                        sg.accumulate(ids[t][r], douts[t][r])
                    for p in reversed(ps):
                        if p.name != "emb":
                            if p.grad_stale:
                                p.grad[...] = grads[t][m][r][p.name]
                                p.grad_stale = False
                            else:
                                p.grad += grads[t][m][r][p.name]
                        for fn in list(p.hooks):
                            fn(p)
            clip = scenario.get("clip")
            norm, scale = (opt.clip_grad_norm(clip, prescale=1.0 / micro) if g is not None else
                           opt.clip_grad_norm(clip))
            norms.append(np.float32(norm))
            opt.step(grad_scale=scale)
        if g is not None:
            opt.gather_params()
        for p in ps:
            h.update(np.ascontiguousarray(p.data).tobytes())
            if opt.shadow_dtype is not None:
                h.update(np.ascontiguousarray(opt.shadow(p)).view(np.uint16).tobytes())
        h.update(np.array(norms, np.float32).tobytes())
        h.update(f"{opt.step_count} {opt.get_lr()!r}".encode())
        return h, opt.state_dict()

    outs = [body(None)] if scenario["world"] == 1 else ck.distributed.FakeGroup(world).run(body)
    sds = [o[1] for o in outs]
    full = ck.optim.consolidate_state(sds)[0] if str(sds[0].get("kind")).endswith("shard") else sds[0]
    digests = []
    for h, _ in outs:
        for n in shapes:
            for k in ("exp_avg", "exp_avg_sq"):
                h.update(np.ascontiguousarray(np.asarray(full["state"][n][k]).reshape(shapes[n])).tobytes())
        digests.append(h.hexdigest()[:16])
    return digests


SCENARIOS = {
    "one rank, sparse rows, clipped": dict(world=1, clip=0.5),
    "one rank, bf16 gradients, no shadows": dict(world=1, clip=0.5, kw=dict(grad_dtype="bf16", shadow_dtype=None)),
    "2 ranks, bf16 wire, buckets, 1-D fp32 gathered, deferred gathers, hooks, accumulation, exchanged rows": dict(
        world=2, micro=2, clip=0.3, hooks=True, kw=dict(wire_dtype="bf16", bucket_elems=300, gather_fp32="1-D",
                                                       overlap_gather=True, sparse_rows=6)),
    "3 ranks, fp32 wire, buckets, sum, the table reduced densely": dict(
        world=3, clip=0.3, kw=dict(bucket_elems=200, average=False)),
    "2 ranks, bf16 gradients, exchanged rows": dict(world=2, clip=0.3, kw=dict(grad_dtype="bf16", wire_dtype="bf16",
                                                                             sparse_rows=6, bucket_elems=300)),
}

RECORDED = {  # scenario -> per-rank digests of the optimizers before issue 34
    "one rank, sparse rows, clipped": ["ec785b8d486530df"],
    "one rank, bf16 gradients, no shadows": ["a00885bb55061cba"],
    "2 ranks, bf16 wire, buckets, 1-D fp32 gathered, deferred gathers, hooks, accumulation, exchanged rows":
        ["d7f388f7768db216"] * 2,
    "3 ranks, fp32 wire, buckets, sum, the table reduced densely": ["28373bff8f43d87b"] * 3,
    "2 ranks, bf16 gradients, exchanged rows": ["5c56b312fced3cc5"] * 2,
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bit_identical_to_the_optimizers_before_issue_34(name):
    assert pinned_run(ck, SCENARIOS[name]) == RECORDED[name]
