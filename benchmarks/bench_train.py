"""Whole training step: LLaMA-3.2-1B shape, bf16 autocast, fp32 master weights, AdamW, gradient clipping.

    PYTHONPATH=. python benchmarks/bench_train.py [--model llama|gpt2|qwen3] [--configs b4t64,b8t1024] [--ablation]
        [--vs-torch eager,compile]
        [--data synthetic|shakespeare] [--nproc N] [--recompute none,attention,full] [--max-t none,full]

``--nproc N`` (N > 1) re-runs this script under ``python -m cukernels.run --nproc-per-node N``: every rank builds
the same step with ``ck.optim.ZeroAdamW`` (bf16 reduce-scatter in 2**25-element buckets started by the autograd's
gradient-ready hooks, fp32 gathered only for 1-D parameters, the bf16 shadows all-gathered under the next forward
(``overlap_gather``), the step with its collectives in one CUDA graph) on
its own batch of B x T tokens (B and T per GPU); rank 0 prints ms/step, tok/s over all ranks and its own peak
memory. The ablation and --vs-torch rows run on one GPU only.

Model: vocab 128256, 16 layers, hidden 2048, 32 heads, 8 KV heads, FFN 8192, untied embeddings (1.50e9
parameters). Tokens: ``--data synthetic`` (default; uniform random ids and targets) or ``--data shakespeare``
(tinyshakespeare byte tokens); a fresh batch is copied into the step's input buffers before every step.
Prints ms/step (median of steady-state steps), tok/s, model TFLOP/s ((6 N + 12 L H D T) per token,
N = parameters in matmuls) and peak memory with its breakdown measured from CuPy's allocator (see
:class:`MemoryBudget`; also in ``--json`` under ``rows[i].memory``), and with ``--ablation`` the seed report's
ablation table at
B4xT64: the unfused baseline, then each optimisation switched on, with its gain. ``--vs-torch`` runs the same
model (Hugging Face ``transformers.LlamaForCausalLM`` when importable) through PyTorch in the same process:
eager, ``torch.compile`` and ``torch.compile(mode="reduce-overhead")`` as asked.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                tie_word_embeddings=False, max_position_embeddings=131072)
# Llama-3.1-8B shape (--model llama8b; issue 39's ZeRO-1 vs FSDP2 row on 8 GPUs): 8.03e9 parameters, untied
LLAMA_8B = dict(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                rope_scaling=dict(LLAMA_1B["rope_scaling"], factor=8.0))
GPT2_124M = dict(type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# Qwen3-0.6B shape (--model qwen3): 16 heads of 128 on a 1024-wide model, per-head q / k norm, tied (5.96e8 params)
QWEN3_06B = dict(type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                 tie_word_embeddings=True, max_position_embeddings=40960)
CONFIGS = {"b4t64": (4, 64), "b8t1024": (8, 1024), "b16t1024": (16, 1024),
           # long sequences at B1 (--recompute none,attention,full); any bBtT parses (config_shape)
           "b1t2048": (1, 2048), "b1t4096": (1, 4096), "b1t8192": (1, 8192), "b1t16384": (1, 16384)}
RECOMPUTE = {"mode": "none"}  # the row's model.set_recompute() mode (--recompute)
# --fp8: the row's ck.Float8Recipe (the Linear GEMMs in FP8), None: bf16 autocast; "shadow": the optimizer writes
# the weights' FP8 copies (AdamW(fp8_shadows=True), trainer fp8_shadow: true; the "-shadow" rows), else each step
# casts them (the trainer's default)
FP8 = {"recipe": None, "shadow": False}
MAX_T_STEP = 1024  # --max-t: T is searched in multiples of this


def config_shape(c):
    """(B, T) of a config name: one of CONFIGS, or any ``b<B>t<T>`` (b1t24576)."""
    import re

    if c in CONFIGS:
        return CONFIGS[c]
    m = re.fullmatch(r"b(\d+)t(\d+)", c)
    if not m:
        raise SystemExit(f"--configs: {c!r} is not one of {sorted(CONFIGS)} nor b<B>t<T>")
    return int(m.group(1)), int(m.group(2))


def is_oom(e):
    """The device ran out of memory: CuPy's allocator (OutOfMemoryError) or a CUDA call reporting it."""
    import cupy as cp

    return isinstance(e, cp.cuda.memory.OutOfMemoryError) or (
        isinstance(e, cp.cuda.runtime.CUDARuntimeError) and "memory" in str(e).lower())


MODEL = {"name": "llama"}  # --model


def model_cfg():
    """The --model's config dict (LLAMA_1B, LLAMA_8B, GPT2_124M or QWEN3_06B; --smoke shrinks them)."""
    return {"gpt2": GPT2_124M, "qwen3": QWEN3_06B, "llama8b": LLAMA_8B}.get(MODEL["name"], LLAMA_1B)
DIST = {"group": None}  # under the launcher (--nproc): the process group; the step uses ZeroAdamW
ZERO_BUCKET = 1 << 25
QUEUED = 6  # steps queued back to back for the "queued" figure (OurStep.run)
ZERO_OVERLAP_GATHER = 1  # --nproc: the shadows' all-gathers under the next forward (ZeroAdamW overlap_gather)
SPARSE_EXCHANGE = 1  # --nproc: the sparse embedding's rows exchanged + lazy update (0: dense reduce-scatter + update)
GRAD_BF16 = 0  # (Zero)AdamW's gradient buffers in bf16 (the bf16 GEMMs write them); --ab "__main__.GRAD_BF16=1"

# GPT-2: the fused-softmax/LayerNorm write-up's switch, with everything else on (fused AdamW, shadows, graph).
GPT2_ROWS = [("unfused: composite LayerNorm / attention softmax / GELU / cross-entropy", ["adam", "shadow", "graph"]),
             ("fused kernels (LayerNorm, attn_softmax, GELU, embedding, CE), scores materialised",
              ["adam", "shadow", "graph", "fused"]),
             ("fused kernels + flash attention", ["adam", "shadow", "graph", "fused", "flash"]),
             ("+ fused LM head + loss (ck.linear_cross_entropy, no [N, V] logits)",
              ["adam", "shadow", "graph", "fused", "flash", "fused_head"])]

# Ablation rows in the seed report's order; each row switches one more optimisation on.
FEATURES = ["shadow", "adam", "memset", "rmsnorm", "sparse_emb", "fused_ce", "fused_rest", "flash", "lazy_zero",
            "graph", "fused_head"]
ROW_NAMES = {
    None: "unfused baseline (composite ops, per-use weight casts)",
    "shadow": "+ bf16 shadow weights (no per-use casts)",
    "adam": "+ fused vectorised AdamW (shadow in the same pass)",
    "memset": "+ memset gradient zeroing",
    "rmsnorm": "+ fused RMSNorm",
    "sparse_emb": "+ sparse-row embedding grad + Adam",
    "fused_ce": "+ fused cross-entropy",
    "fused_rest": "+ fused RoPE / SwiGLU / attention softmax",
    "flash": "+ flash attention (no [B, H, T, T] scores)",
    "lazy_zero": "+ first backward write overwrites (GEMM beta=0), no zeroing",
    "graph": "+ CUDA graph of the whole step",
    "fused_head": "+ fused LM head + loss (no [N, V] logits)",
}


def model_flops_per_token(cfg, T):
    if cfg.get("type") == "gpt2":
        L, H, d, V = cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["vocab_size"]
        return 6 * (L * 12 * d * d + V * d) + 12 * L * H * (d // H) * T
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H  # (Qwen3: 128 with hidden / heads = 64)
    d, f, V, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_key_value_heads"]
    n_mm = L * (2 * d * H * hd + 2 * d * kv * hd + 3 * d * f) + V * d  # matmul parameters (lm_head, not the gather)
    return 6 * n_mm + 12 * L * H * hd * T


def make_batches(kind, B, T, accum, vocab_size, seed=0):
    """A function returning the next (ids, targets), int32 [accum, B, T] NumPy arrays.

    ``synthetic``: independent uniform ids and targets over the whole vocabulary (every batch touches ~B*T
    distinct embedding rows). ``shakespeare``: tinyshakespeare as UTF-8 byte tokens (ids < 256 of the 128256
    vocabulary, the trainer's ``ByteTokenizer``), read sequentially with targets = ids shifted by one -- real text
    statistics, and only ~65 distinct embedding rows per batch."""
    if kind == "synthetic":
        rng = np.random.default_rng(seed)
        shape = (accum, B, T)
        return lambda: (rng.integers(0, vocab_size, shape, dtype=np.int32),
                        rng.integers(0, vocab_size, shape, dtype=np.int32))
    if kind == "shakespeare":
        from cukernels.data import TokenLoader, load_text_tokens

        loader = TokenLoader(load_text_tokens()[0], B * accum, T)

        def nxt():
            x, y = loader.next_batch()
            return x.reshape(accum, B, T), y.reshape(accum, B, T)
        return nxt
    raise ValueError(f"data: expected 'synthetic' or 'shakespeare'; got {kind!r}")

GiB = 2**30


class MemoryBudget:
    """Where one configuration's device memory goes, read from CuPy's allocator at fixed points (issue 17).

    Snapshots (``used_bytes`` / ``total_bytes`` of the default pool, of the step's private graph pool, and the
    device's used bytes from ``cudaMemGetInfo``): after the model is built, after the optimizer (before and after
    ``free_all_blocks``), after the first (eager) step, after the capture. CuPy's pools never give memory back by
    themselves, so a pool's ``total_bytes`` is its high-water mark: the default pool's before the release is the
    build transient (the model's own parameters and the optimizer's flat copies at once), the graph pool's is
    the step's peak. The table splits the steady footprint into:

    - weights (fp32 master), gradients, bf16 shadows: the parameters' ``data`` / ``grad`` / ``shadow`` arrays (plus
      a sparse-row gradient's row list and stamps);
    - optimizer moments: the default pool's used bytes after the optimizer minus the three above (AdamW: exactly
      exp_avg + exp_avg_sq + 256-byte alignment padding);
    - freed blocks the default pool held after the optimizer was built (what ``free_all_blocks`` gave back; no
      longer part of the footprint) and what it still holds free afterwards;
    - the model's build pool (the model is built in a pool of its own, released after the optimizer copied the
      parameters): what it still holds, the model's non-parameter arrays;
    - activations + workspaces: the graph pool's peak minus what stays allocated in it between steps;
    - graph pool, held between steps: the step's outputs, caches made during the warm-up (padded head weights,
      the bias-gradient ones row, rope tables, ...);
    - cuBLAS workspace (``ck.matmul``'s handle, one per device, made by ``main`` in the default pool: a part of the
      moments row, which is the default pool's remainder);
    - outside the pools: device used minus both pools (CUDA context, kernel modules, cuBLAS handles, the graph's
      own memory; other processes on the GPU would land here too).
    """

    def __init__(self, cp):
        self.cp = cp
        self.pool = cp.get_default_memory_pool()
        self.build_pool = None  # the pool the model was built in (OurStep sets it)
        self.snaps = {}

    def snap(self, name, graph_pool=None):
        self.cp.cuda.Device().synchronize()
        free, total = self.cp.cuda.runtime.memGetInfo()
        d = dict(default_used=self.pool.used_bytes(), default_total=self.pool.total_bytes(), device_used=total - free,
                 build_total=self.build_pool.total_bytes() if self.build_pool is not None else 0)
        if graph_pool is not None:
            d.update(graph_used=graph_pool.used_bytes(), graph_total=graph_pool.total_bytes())
        self.snaps[name] = d
        return d

    @staticmethod
    def tensors(params):
        """Bytes of the parameters' weights, gradients (dense + sparse-row bookkeeping) and shadows."""
        w = sum(p.data.nbytes for p in params)
        g = sum(p.grad.nbytes for p in params if p.grad is not None)
        for p in params:
            sg = getattr(p, "sparse_grad", None)
            if sg is not None:
                g += sg.rows.nbytes + sg.stamps.nbytes + (0 if p.grad is not None and sg.grad is p.grad
                                                           else sg.grad.nbytes)
        sh = sum(p.shadow.nbytes for p in params if getattr(p, "shadow", None) is not None)
        return w, g, sh

    def table(self, params):
        """``[(row, bytes)]`` of the breakdown (see the class docstring) and the totals."""
        from cukernels import blas

        s = self.snaps
        w, g, sh = self.tensors(params)
        opt = s["optimizer (released)"]
        moments = opt["default_used"] - w - g - sh
        cap = s.get("after capture") or s["first step"]
        first = s["first step"]
        act = cap["graph_total"] - cap["graph_used"]
        rows = [("weights (fp32 master)", w), ("gradients", g),
                ("optimizer moments (+ other optimizer state)", moments), ("bf16 shadows", sh),
                ("freed blocks released after the optimizer (default + build pools)",
                 s["optimizer"]["default_total"] + s["optimizer"]["build_total"] - opt["default_total"]
                 - opt["build_total"]),
                ("freed blocks still in the default pool", opt["default_total"] - opt["default_used"]),
                ("activations + workspaces (graph pool peak - held)", act),
                ("graph pool, held between steps", cap["graph_used"]),
                ("the model's build pool, still held (its non-parameter arrays)", cap["build_total"]),
                ("  (in the default pool) cuBLAS workspace of ck.matmul", blas.WORKSPACE_BYTES * len(blas._handles)),
                ("outside the pools (context, modules, handles, graph)",
                 cap["device_used"] - cap["default_total"] - cap["graph_total"] - cap["build_total"])]
        extra = dict(
            build_transient=s["optimizer"]["default_total"] + s["optimizer"]["build_total"],  # params + flat copies
            first_step_graph_pool=first["graph_total"], capture_graph_pool=cap["graph_total"],
            steady=cap["default_total"] + cap["graph_total"] + cap["build_total"], device_used=cap["device_used"])
        return rows, extra

    @staticmethod
    def report(rows, extra, label):
        """Print the table; return it as a JSON-ready dict."""
        print(f"  memory, {label} (GiB; from CuPy's pools):")
        for name, b in rows:
            print(f"    {name:<58} {b / GiB:8.3f}")
        print(f"    {'= pools total (the peak of the row)':<58} {extra['steady'] / GiB:8.3f}")
        print(f"    {'build transient (default pool before the release)':<58} {extra['build_transient'] / GiB:8.3f}")
        print(f"    {'graph pool after the 1st eager step / after capture':<58} "
              f"{extra['first_step_graph_pool'] / GiB:8.3f} / {extra['capture_graph_pool'] / GiB:.3f}")
        print(f"    {'device used (cudaMemGetInfo)':<58} {extra['device_used'] / GiB:8.3f}", flush=True)
        return dict(rows={n.strip(): b for n, b in rows}, **extra)


class OurStep:
    """One cukernels training step with features switched on or off (see FEATURES)."""

    def __init__(self, B, T, feats, *, accum=1, seed=0, mcfg=None):
        import cupy as cp

        import cukernels as ck
        from cukernels.nn import Attention, Embedding, Linear, RMSNorm
        from cukernels.optim import CompositeAdamW

        self.cp, self.ck = cp, ck
        self.mem = MemoryBudget(cp)
        mcfg = dict(mcfg or model_cfg())
        self.mcfg, self.B, self.T, self.accum = mcfg, B, T, accum
        f = set(feats)
        # The model is built in a pool of its own (as the trainer does): the optimizer copies its parameters into
        # flat buffers in the default pool, and the model's arrays are then released whole. Built in the default
        # pool, the small allocations made after the copy were carved out of the freed parameter blocks, and
        # ~1 GiB of them could never be released (session 4: "freed blocks still in the default pool" 0.99 GiB).
        self.build_pool = self.mem.build_pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(self.build_pool.malloc):
            if mcfg.get("type") == "gpt2":
                cfg = {k: v for k, v in mcfg.items() if k != "type"}
                model = ck.GPT2(ck.GPT2Config(**cfg), xp=cp, seed=seed, fused="fused" in f)
                f |= {"memset", "lazy_zero"} if "adam" in f else set()
            else:  # LLaMA, or a LLaMA-style family by its "type" (qwen3)
                cls = ck.models.model_class(mcfg.get("type", "llama"))
                if mcfg.get("tie_word_embeddings"):
                    f.discard("sparse_emb")  # (a tied table gets the head's dense gradient)
                model = cls(cls.config_class.from_dict(mcfg), xp=cp, seed=seed, fused=False,
                            sparse_embedding="sparse_emb" in f)
        # Which modules run their kernels: Linear's "fused" means "read the shadow weight" (no per-use cast).
        for m in model.modules():
            if mcfg.get("type") == "gpt2":
                if isinstance(m, Linear):
                    m.fused = "shadow" in f
                if isinstance(m, Attention):
                    m.flash = "flash" in f
                continue
            if isinstance(m, Linear) or isinstance(m, Embedding):
                m.fused = "shadow" in f
            elif isinstance(m, RMSNorm):
                m.fused = "rmsnorm" in f
            elif m is model:
                m.fused = "fused_ce" in f
            else:
                m.fused = "fused_rest" in f
            if isinstance(m, Attention):
                m.flash = "flash" in f
        # The head and the loss in one chunked op (ck.linear_cross_entropy) only from its own ablation row on:
        # the rows before it keep their session-2 meaning (logits, then the fused cross-entropy in place).
        model.fused_head_loss = "fused_head" in f
        model.set_recompute(RECOMPUTE["mode"])  # (--recompute; every block of the training forward)
        self.mem.snap("model")
        params = model.parameters()
        no_decay = [p for p in params if p.ndim < 2]
        group = DIST["group"]
        if "adam" in f and group is not None:  # data parallel: ZeRO-1 over the launcher's ranks
            emb = model.input_embedding().weight
            opt = ck.optim.ZeroAdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, group=group,
                                     no_decay={p.name for p in no_decay}, gather_fp32=lambda n, a: a.ndim < 2,
                                     sparse={emb.name} if "sparse_emb" in f else None,
                                     wire_dtype=ck.bfloat16 if DIST.get("wire", "bf16") == "bf16" else np.float32,
                                     bucket_elems=ZERO_BUCKET, sm_margin=DIST.get("sm_margin", 0),
                                     overlap_gather=bool(ZERO_OVERLAP_GATHER),
                                     grad_dtype=ck.bfloat16 if GRAD_BF16 and accum == 1 else np.float32,
                                     sparse_rows=B * T * accum if "sparse_emb" in f and SPARSE_EXCHANGE else None)
            if "sparse_emb" in f:
                opt.attach_sparse(emb)
            opt.broadcast_params(0)
            opt.attach_grad_hooks()
        elif "adam" in f:
            emb = model.input_embedding().weight
            opt = ck.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                 shadow_dtype=ck.bfloat16, no_decay={p.name for p in no_decay},
                                 sparse={emb.name} if "sparse_emb" in f else None,
                                 grad_dtype=ck.bfloat16 if GRAD_BF16 else np.float32,
                                 fp8_shadows=FP8["recipe"] is not None and FP8["shadow"])
            if "sparse_emb" in f:
                opt.attach_sparse(emb)
        else:
            opt = CompositeAdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                 no_decay=no_decay, shadow_dtype=ck.bfloat16 if "shadow" in f else None)
        if "shadow" in f:
            ck.amp.attach_shadows(params, opt)
        self.mem.snap("optimizer")
        # The optimizer copied every parameter into its flat buffers and repointed p.data: the model's own arrays
        # (5.99 GB at the 1B shape) and the init temporaries are free blocks of the default pool now, which CuPy
        # keeps, and the step allocates only from its graph's private pool, so nothing would ever reuse them
        # (issue 17: most of the unexplained ~6 GiB at B4xT64). Hand them back to the device.
        gc.collect()
        self.build_pool.free_all_blocks()
        cp.get_default_memory_pool().free_all_blocks()
        self.mem.snap("optimizer (released)")
        self.model, self.opt, self.feats = model, opt, f
        self.ids = cp.zeros((accum, B, T), dtype=cp.int32)
        self.tgt = cp.zeros((accum, B, T), dtype=cp.int32)
        self.params = params
        self.nparams = sum(p.data.size for p in params)
        self.step = ck.graph.CapturedStep(self._step, warmup=2, graph="graph" in f)

    def _zero(self):
        if "lazy_zero" in self.feats:
            self.opt.zero_grad(lazy=True)  # clip_grad_norm / step flush anything left stale
        elif "memset" in self.feats:
            self.opt.zero_grad()
        else:  # a fill kernel per parameter gradient, as the seed's baseline did
            for p in self.params:
                if p.grad is not None:
                    p.grad.fill(0)
            sg = getattr(self.model.input_embedding().weight, "sparse_grad", None)
            if sg is not None:
                sg.zero()

    def _step(self):
        ck = self.ck
        self._zero()
        total = None
        zero = isinstance(self.opt, ck.optim.ZeroAdamW)
        for i in range(self.accum):
            with ck.autocast(FP8["recipe"] or ck.bfloat16):
                loss = self.model(self.ids[i], self.tgt[i])
            if zero and i < self.accum - 1:
                with self.opt.no_sync():  # one reduction per step
                    loss.backward()
            else:
                loss.backward()
            total = loss.data if total is None else total + loss.data
        if "adam" in self.feats:
            norm, scale = self.opt.clip_grad_norm(1.0)
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            sq = sum((g.astype(np.float32) ** 2).sum() for g in grads)
            norm = self.cp.sqrt(sq)
            scale = self.cp.minimum(1.0, 1.0 / (norm + 1e-6)).astype(np.float32)
        self.opt.step(grad_scale=scale * (1.0 / self.accum) if self.accum > 1 else scale)
        return total, norm

    def new_batch(self, batches):
        """Copy the next (ids, targets) from ``batches`` (see :func:`make_batches`) into the step's buffers."""
        x, y = batches()
        self.ids.set(x)
        self.tgt.set(y)

    def run(self, steps, warm=3, data="synthetic"):
        """(median ms/step, losses); also the queued and the single-replay figures (``queued_ms``, ``gpu_ms``)."""
        cp = self.cp
        g = DIST["group"]
        batches = make_batches(data, self.B, self.T, self.accum, self.mcfg["vocab_size"],
                               seed=g.rank if g is not None else 0)
        times, losses = [], []
        for i in range(warm + steps):
            self.new_batch(batches)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            loss, _ = self.step()
            self.step.synchronize()
            dt = time.perf_counter() - t0
            if i == 0:
                self.mem.snap("first step", self.step.pool)
            elif self.step.graph is not None and "after capture" not in self.mem.snaps:
                self.mem.snap("after capture", self.step.pool)
            if i >= warm:
                times.append(dt * 1e3)
                losses.append(float(loss))
        # The same step queued QUEUED times back to back (no host sync between them, the batch unchanged), as a
        # training loop that reads its loss only every few steps runs: the next replay's launch hides behind the
        # running one. ms per step of that, kept apart from the synced median above.
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(QUEUED):
            self.step()
        self.step.synchronize()
        self.queued_ms = (time.perf_counter() - t0) * 1e3 / QUEUED
        # GPU time of single replays (events on the step's stream around each) and the host time of the call:
        # tells a slow GPU step from a late start.
        gpu, host = [], []
        for _ in range(4):
            cp.cuda.Device().synchronize()
            st = getattr(self.step, "stream", None) or cp.cuda.get_current_stream()
            e0 = cp.cuda.Event()
            e0.record(st)
            h0 = time.perf_counter()
            self.step()
            host.append((time.perf_counter() - h0) * 1e3)
            e1 = cp.cuda.Event()
            e1.record(st)
            e1.synchronize()
            gpu.append(cp.cuda.get_elapsed_time(e0, e1))
        self.gpu_ms, self.host_ms = statistics.median(gpu), statistics.median(host)
        return statistics.median(times), losses


def peak_gib():
    import cupy as cp

    return cp.get_default_memory_pool().total_bytes() / 2**30


def run_ours(B, T, feats, steps, accum=1, data="synthetic", budget=None, timeline=None):
    """(ms/step, losses, peak GiB, parameters); with ``budget`` the memory breakdown ``(rows, extra)`` of
    :meth:`MemoryBudget.table` is left in ``run_ours.last_budget``; with ``timeline`` (a path prefix) two more
    steps are recorded by :mod:`timeline` after the timed ones (``run_ours.last_timeline``: its summary)."""
    import cupy as cp

    s = OurStep(B, T, feats, accum=accum)
    ms, losses = s.run(steps, data=data)
    run_ours.last_queued = s.queued_ms
    run_ours.last_gpu = [s.gpu_ms, s.host_ms]
    g = DIST["group"]
    if g is not None:  # every rank's (GPU ms a replay, host ms of the call), to rank 0
        mine = cp.asarray(np.array(run_ours.last_gpu, np.float32))
        every = cp.zeros(2 * g.world_size, np.float32)
        g.all_gather(mine, every)
        run_ours.last_gpu = every.get().tolist()
    run_ours.last_timeline = None
    if timeline:
        import timeline as tl

        run_ours.last_timeline = tl.record(s.step, s.step.synchronize, steps=2, path=timeline)
    mem = peak_gib() + (s.step.pool.total_bytes() + s.build_pool.total_bytes()) / 2**30
    n = s.nparams
    run_ours.last_budget = s.mem.table(s.params) if budget else None  # numbers only: no reference kept
    del s
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    return ms, losses, mem, n


def try_run(*a, **k):
    """:func:`run_ours`, or None when the device ran out of memory (``try_run.last_error`` says where); what the
    row held (model, optimizer, the step's pools) is freed before the next row."""
    import cupy as cp

    try:
        return run_ours(*a, **k)
    except Exception as e:
        if not is_oom(e):
            raise
        try_run.last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    # (here, after the except block: its traceback, whose frames held the row's arrays, is gone)
    gc.collect()
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    return None


def probe(B, T, mode, data):
    """One step of B x T with recompute ``mode`` in a fresh process of this script (``--configs bBtT --steps 1``):
    ``(row, why)``, row the JSON row (ms, peak_gib, ...) or None with ``why`` ("OOM" or the failure). A process per
    probe: after an out-of-memory inside one process the next probes failed too, even at T=1024 (memory the failed
    row held was not all returned to the device)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        js = Path(tmp) / "probe.json"
        cmd = [sys.executable, __file__, "--configs", f"b{B}t{T}", "--recompute", mode, "--steps", "1",
               "--data", data, "--model", MODEL["name"], "--json", str(js)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        rows = json.loads(js.read_text())["rows"] if js.exists() else []
    if rows and not rows[0].get("oom"):
        return rows[0], ""
    return None, "OOM" if rows else f"failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-200:]}"


def longest_t(mode, B, cap, data):
    """The longest T (a multiple of MAX_T_STEP, at most ``cap``) whose step runs at batch ``B`` with recompute
    ``mode``: the cap first, then a bisection, each probe a process of its own (:func:`probe`). Returns ``(T or 0,
    [(T, ms or None, peak GiB or None), ...])``."""
    probes = []
    lo, hi = 0, cap // MAX_T_STEP + 1  # lo * MAX_T_STEP runs (0: none yet), hi * MAX_T_STEP does not
    k = hi - 1
    while hi - lo > 1:
        T = k * MAX_T_STEP
        r, why = probe(B, T, mode, data)
        probes.append((T, r["ms"] if r else None, r["peak_gib"] if r else None))
        print(f"  probe B{B}xT{T} recompute {mode}: " + (f"{r['ms']:.1f} ms/step, peak {r['peak_gib']:.1f} GiB"
                                                         if r else why), flush=True)
        lo, hi = (k, hi) if r else (lo, k)
        k = (lo + hi) // 2
    return lo * MAX_T_STEP, probes


def torch_train_step(torch, model, fwd, opt, ids, autocast=True):
    """One PyTorch step as every peer here runs it (bench_torch_dist.py too): ``fwd`` (the model, compiled or
    wrapped) on ``ids`` with ``labels=ids`` under bf16 autocast on CUDA (``autocast=False``: as the parameters are),
    backward, the global norm clipped to 1.0, the optimizer step, gradients set to None."""
    import contextlib

    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        loss = fwd(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def run_torch(B, T, mode, steps, data="synthetic"):
    import torch

    torch.manual_seed(0)
    dev = "cuda"
    try:
        if MODEL["name"] == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(**{k: v for k, v in GPT2_124M.items() if k != "type"})
            cfg._attn_implementation = "sdpa"  # PyTorch's fused attention (cuDNN / FlashAttention kernels)
            model = GPT2LMHeadModel(cfg).to(dev)
            impl = "transformers GPT2LMHeadModel, sdpa"
        elif MODEL["name"] == "qwen3":
            from transformers import Qwen3Config, Qwen3ForCausalLM

            cfg = Qwen3Config(**{k: v for k, v in QWEN3_06B.items() if k != "type"})
            cfg._attn_implementation = "sdpa"  # PyTorch's fused attention (cuDNN / FlashAttention kernels)
            model = Qwen3ForCausalLM(cfg).to(dev)
            impl = "transformers Qwen3ForCausalLM, sdpa"
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(**model_cfg())
            model = LlamaForCausalLM(cfg).to(dev)
            impl = "transformers"
    except Exception as e:  # pragma: no cover - transformers missing
        return None, f"transformers unavailable: {e}"
    if mode.startswith("fp8"):
        if MODEL["name"] == "gpt2":
            return None, "fp8: the LLaMA / Qwen3 Linears only (GPT-2's are Conv1D)"
        torch_fp8_linears(model, torch)
        impl += ", decoder Linears as torch._scaled_mm FP8 (per-tensor dynamic scales)"
        mode = "compile" if mode == "fp8-compile" else "eager"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fwd = model
    if mode == "compile":
        fwd = torch.compile(model)
    elif mode == "reduce-overhead":
        fwd = torch.compile(model, mode="reduce-overhead")
    batches = make_batches(data, B, T, 1, model_cfg()["vocab_size"])

    def step(ids):
        return torch_train_step(torch, model, fwd, opt, ids)

    times = []
    for i in range(5 + steps):
        ids = torch.from_numpy(batches()[0][0].astype(np.int64)).to(dev)  # HF shifts labels=ids itself
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(ids)
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    mem = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, fwd
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return (statistics.median(times), mem), impl


def torch_fp8_linears(model, torch):
    """PyTorch's FP8 training recipe as a competent user writes it with no extra library: every Linear of the decoder
    layers (not the LM head, as ours) becomes one whose three GEMMs are ``torch._scaled_mm`` with per-tensor dynamic
    (current) scales: E4M3 input and weight, E5M2 output gradient (Transformer Engine's format; ours are E4M3 since
    session 19: the GEMMs run at the same rate), fast accumulation in the forward only (as our default recipe), fp32
    weight gradient; the amax / scale / cast / transpose ops are left to torch.compile to fuse
    (``--vs-torch fp8-compile``)."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2

    def quant(t, dt, mx):
        amax = t.abs().amax().float().clamp(min=1e-12)
        s = mx / amax
        return (t.float() * s).clamp(-mx, mx).to(dt), s.reciprocal()

    class ScaledLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            x2 = x.reshape(-1, x.shape[-1])
            xq, sx = quant(x2, e4, 448.0)
            wq, sw = quant(w, e4, 448.0)
            y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
            ctx.save_for_backward(xq, wq, sx, sw)
            ctx.shape = x.shape
            return y.reshape(*x.shape[:-1], w.shape[0])

        @staticmethod
        def backward(ctx, g):
            xq, wq, sx, sw = ctx.saved_tensors
            gq, sg = quant(g.reshape(-1, g.shape[-1]), e5, 57344.0)
            # _scaled_mm wants mat1 row-major and mat2 column-major: the transposed copies
            dx = torch._scaled_mm(gq, wq.t().contiguous().t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16)
            dw = torch._scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(), scale_a=sg, scale_b=sx,
                                  out_dtype=torch.float32)
            return dx.reshape(ctx.shape), dw

    class Fp8Linear(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.weight = lin.weight

        def forward(self, x):
            return ScaledLinear.apply(x, self.weight)

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and child.bias is None:
                    setattr(parent, name, Fp8Linear(child))


def fp8_rows(args, c, B, T, tok, ms, mcfg, out):
    """``--fp8``: the config again with each FP8 recipe (the plain features, ck.autocast(ck.float8)); returns
    {recipe: ms/step}. Printed with the bf16 row's ratio."""
    global GRAD_BF16
    import cukernels as ck

    res = {}
    for rname in [r for r in args.fp8.split(",") if r]:
        scaling, *how = rname.split("-")
        keys = ({"head_grad_dtype": ck.float8_e5m2, "head_fp8_dw": "head" in how}
                if "head" in how or "headdx" in how else {})
        if "fa" in how:  # fast accumulation in the two backward GEMMs too
            keys["fast_accum_grad"] = True
        # "bf16-g16": the bf16 step again (no FP8), to compare a -g16 row with
        FP8["recipe"] = None if scaling == "bf16" else ck.float8.replace(scaling=scaling, **keys)
        FP8["shadow"] = "shadow" in how
        saved_g16, GRAD_BF16 = GRAD_BF16, 1 if "g16" in how else GRAD_BF16
        try:
            r = try_run(B, T, GPT2_ROWS[-1][1] if args.model == "gpt2" else FEATURES, args.steps, data=args.data,
                        budget=True)
        except Exception:
            traceback.print_exc()
            continue
        finally:
            FP8["recipe"], FP8["shadow"], GRAD_BF16 = None, False, saved_g16
        if r is None:
            print(f"cukernels  B{B}xT{T} fp8 ({rname}): OOM ({try_run.last_error})", flush=True)
            continue
        row_ms, losses, mem, n = r
        tf = model_flops_per_token(mcfg, T) * tok / (row_ms * 1e-3) / 1e12
        vs = f"   -> {ms / row_ms:.2f}x the bf16 step" if ms else ""
        print(f"cukernels  B{B}xT{T} fp8 ({rname}): {row_ms:8.2f} ms/step  {tok / row_ms * 1e3:10,.0f} tok/s  "
              f"{tf:6.1f} TFLOP/s  peak {mem:6.1f} GiB  losses {losses[0]:.4f} .. {losses[-1]:.4f}   queued "
              f"{run_ours.last_queued:.2f} ms/step{vs}", flush=True)
        out["rows"].append(dict(config=c, ms=row_ms, tok_s=tok / row_ms * 1e3, tflops=tf, peak_gib=mem,
                                losses=losses, setting=f"fp8 {rname}", fp8=rname, queued_ms=run_ours.last_queued,
                                memory=MemoryBudget.report(*run_ours.last_budget, f"B{B}xT{T} fp8 {rname}")))
        res[rname] = row_ms
    return res


def recompute_table(rows, modes, steps):
    """The memory / time trade of activation recompute: per config, each mode's ms/step, tok/s and peak, and both
    against recompute none at the same shape (benchmarks/NOTES.md, "Activation recompute", has the predictions)."""
    print(f"\nActivation recompute (ms/step: median of {steps}; x: against recompute none at the same B x T):")
    print(f"{'config':<10} {'recompute':<10} {'ms/step':>9} {'tok/s':>10} {'peak GiB':>9} {'x time':>7} {'x peak':>7}")
    for c in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == c and not r.get("setting") and r.get("recompute", "none") in modes]
        base = next((r for r in mine if r.get("recompute", "none") == "none" and not r.get("oom")), None)
        for r in mine:
            if r.get("oom"):
                print(f"{c:<10} {r['recompute']:<10} {'OOM':>9}")
                continue
            xt = f"{r['ms'] / base['ms']:7.2f}" if base else f"{'-':>7}"
            xp = f"{r['peak_gib'] / base['peak_gib']:7.2f}" if base else f"{'-':>7}"
            print(f"{c:<10} {r.get('recompute', 'none'):<10} {r['ms']:9.2f} {r['tok_s']:10,.0f} {r['peak_gib']:9.1f} "
                  f"{xt} {xp}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=["llama", "llama8b", "gpt2", "qwen3"],
                    help="llama: LLaMA-3.2-1B shape; llama8b: Llama-3.1-8B shape (with --nproc: ZeRO-1 over the "
                         "ranks); gpt2: GPT-2 124M (--ablation then prints the fused on/off table); qwen3: the "
                         "Qwen3-0.6B shape (transformers' Qwen3ForCausalLM with --vs-torch)")
    ap.add_argument("--configs", default=None, help="default b4t64,b8t1024 (llama), b8t1024 (gpt2)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ablation", action="store_true", help="the ablation table at B4xT64")
    ap.add_argument("--vs-torch", default="", help="comma list of eager,compile,reduce-overhead; fp8-eager,fp8-compile: "
                    "PyTorch's decoder Linears as torch._scaled_mm FP8 GEMMs with per-tensor dynamic scales")
    ap.add_argument("--fp8", default="", help="comma list of FP8 recipes (current, hybrid, delayed; -shadow: the "
                    "optimizer's FP8 copies of the weights instead of a cast each step; -head: the LM head's gradient "
                    "GEMMs in FP8 too, -headdx: its dx GEMM only; -g16: bf16 gradient buffers, the trainer's "
                    "grad_dtype: bfloat16; -fa: fast accumulation in the backward GEMMs too; bf16-g16: the bf16 step "
                    "with bf16 buffers; e.g. hybrid-shadow-head): each config also runs with the Linear layers' GEMMs "
                    "in FP8 (ck.autocast(ck.float8))")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer, 1024-vocab model: checks every row runs")
    ap.add_argument("--data", default="synthetic", choices=["synthetic", "shakespeare"],
                    help="uniform random tokens, or tinyshakespeare byte tokens (see make_batches)")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs: N > 1 runs N ranks under cukernels.run, ZeroAdamW")
    ap.add_argument("--sm-margin", type=int, default=0,
                    help="with --nproc: SMs left to NCCL while collectives overlap compute (ZeroAdamW sm_margin)")
    ap.add_argument("--wire", default="bf16", choices=["bf16", "fp32"],
                    help="with --nproc: the gradient's dtype in the reduce-scatter (ZeroAdamW wire_dtype)")
    ap.add_argument("--timeline", default="",
                    help="a folder: after each row's timed steps, 2 more are recorded (CUPTI through torch.profiler) "
                         "into <folder>/<config>[_ab<i>]_rank<r>.csv and summarised (benchmarks/timeline.py)")
    ap.add_argument("--ab", default="",
                    help="also run each config with these settings, e.g. 'pack_projections=0' or "
                         "'zero.ADAM_OCCUPANCY=8' (';' between rows, ',' within a row; see benchmarks/ab.py)")
    ap.add_argument("--recompute", default="none",
                    help="comma list of none,attention,full: each config runs with each activation-recompute mode "
                         "(model.set_recompute); a row that runs out of memory prints OOM; with several modes, the "
                         "memory/time table at the end")
    ap.add_argument("--max-t", default="",
                    help="comma list of recompute modes: for each, the longest T at B1 that trains (bisection over "
                         f"multiples of {MAX_T_STEP} up to --max-t-cap)")
    ap.add_argument("--max-t-cap", type=int, default=65536, help="the largest T --max-t tries")
    args = ap.parse_args(argv)
    import os
    if args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        import subprocess
        rest = list(sys.argv[1:] if argv is None else argv)
        cmd = [sys.executable, "-m", "cukernels.run", "--nproc-per-node", str(args.nproc), "--quiet-others",
               str(Path(__file__).resolve()), *rest]
        return subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    world = 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import cukernels.distributed as dist

        DIST["group"] = dist.init_process_group()
        DIST["sm_margin"] = args.sm_margin
        DIST["wire"] = args.wire
        world = DIST["group"].world_size
        if args.ablation or args.vs_torch:
            print("--ablation / --vs-torch run on one GPU only; ignored with --nproc", flush=True)
            args.ablation, args.vs_torch = False, ""
    MODEL["name"] = args.model
    if args.configs is None:  # (with --max-t alone: only the search)
        args.configs = "" if args.max_t else ("b8t1024" if args.model in ("gpt2", "qwen3")
                                                      else "b4t1024" if args.model == "llama8b" else "b4t64,b8t1024")
    global LLAMA_1B, LLAMA_8B, GPT2_124M, QWEN3_06B
    if args.smoke:
        LLAMA_1B = dict(LLAMA_1B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
        LLAMA_8B = dict(LLAMA_1B)
        GPT2_124M = dict(GPT2_124M, vocab_size=1024, n_embd=256, n_layer=2, n_head=4)
        QWEN3_06B = dict(QWEN3_06B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    # ck.matmul's cuBLAS handle and its 32 MiB workspace, made now in the default pool: made inside the first
    # configuration's warm-up they would come from that step's private graph pool, which is dropped with it
    # while the handle (one per device, for the process) keeps using the workspace.
    import cukernels as ck

    ck.matmul(cp.ones((1, 1), cp.float32), cp.ones((1, 1), cp.float32))
    mcfg = model_cfg()
    what = {"gpt2": "GPT-2 124M, tied", "qwen3": "Qwen3-0.6B shape, tied",
            "llama8b": "Llama-3.1-8B shape, untied"}.get(args.model, "LLaMA-3.2-1B shape, untied")
    opt_name = (f"ZeroAdamW on {world} GPUs ({args.wire} reduce-scatter, B x T per GPU, sm_margin {args.sm_margin})"
                if world > 1 else "AdamW")
    print(f"device: {name}; model: {what}, bf16 autocast, fp32 master, {opt_name}, clip 1.0; data: {args.data}")
    out = {"device": name, "world_size": world, "rows": [], "ablation": [], "torch": []}
    import ab
    rank = DIST["group"].rank if DIST["group"] is not None else 0
    if args.timeline:
        Path(args.timeline).mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.recompute.split(",") if m]
    bad = [m for m in modes + [m for m in args.max_t.split(",") if m] if m not in ("none", "attention", "full")]
    if bad:
        raise SystemExit(f"--recompute / --max-t: expected none, attention, full; got {bad}")
    for c in [c for c in args.configs.split(",") if c]:
        B, T = config_shape(c)
        tok = B * T * world  # every rank's tokens
        ms = None  # (the first mode's plain row: what --vs-torch compares with)
        for mode in modes:
            RECOMPUTE["mode"] = mode
            rc = f" recompute {mode}" if len(modes) > 1 or mode != "none" else ""
            for i, setting in enumerate([""] + ab.rows(args.ab)):
                tl = f"{args.timeline}/{c}{f'_ab{i}' if i else ''}_rank{rank}" if args.timeline else None
                per = f" on {world} GPUs" if world > 1 else ""
                try:
                    with ab.applied(setting) if setting else contextlib.nullcontext():
                        r = try_run(B, T, GPT2_ROWS[-1][1] if args.model == "gpt2" else FEATURES,
                                    args.steps, data=args.data, budget=True, timeline=tl)
                except Exception:
                    traceback.print_exc()
                    continue
                if r is None:
                    print(f"cukernels  B{B}xT{T}{per}{rc}: OOM ({try_run.last_error})"
                          f"{f'   ({setting})' if setting else ''}", flush=True)
                    out["rows"].append(dict(config=c, recompute=mode, setting=setting, oom=True))
                    continue
                row_ms, losses, mem, n = r
                ms = ms or row_ms
                tf = model_flops_per_token(mcfg, T) * tok / (row_ms * 1e-3) / 1e12
                print(f"cukernels  B{B}xT{T}{per}{rc}: {row_ms:8.2f} ms/step  {tok / row_ms * 1e3:10,.0f} tok/s  "
                      f"{tf:6.1f} TFLOP/s  peak {mem:6.1f} GiB/GPU  params {n / 1e9:.3f}e9  losses {losses[0]:.4f} .. "
                      f"{losses[-1]:.4f}   queued {run_ours.last_queued:.2f} ms/step"
                      f"{f'   ({setting})' if setting else ''}", flush=True)
                gt = run_ours.last_gpu
                print("    one replay, GPU ms (host ms of the call) by rank: "
                      + ", ".join(f"{gt[2 * r]:.2f} ({gt[2 * r + 1]:.2f})" for r in range(len(gt) // 2)), flush=True)
                if run_ours.last_timeline:
                    import timeline as tlmod

                    tlmod.report(run_ours.last_timeline, f"B{B}xT{T}{per} {setting}".strip())
                row = dict(config=c, ms=row_ms, tok_s=tok / row_ms * 1e3, tflops=tf, peak_gib=mem, losses=losses,
                           setting=setting, timeline=run_ours.last_timeline, queued_ms=run_ours.last_queued,
                           recompute=mode)
                if not setting:
                    row["memory"] = MemoryBudget.report(*run_ours.last_budget, f"B{B}xT{T}{rc}")
                out["rows"].append(row)
        RECOMPUTE["mode"] = "none"
        fp8_ms = fp8_rows(args, c, B, T, tok, ms, mcfg, out)
        if ms is None:
            continue
        for mode in [m for m in args.vs_torch.split(",") if m]:
            try:
                r, impl = run_torch(B, T, mode, args.steps, data=args.data)
            except Exception as e:
                traceback.print_exc()
                r, impl = None, f"failed: {type(e).__name__}"
            if r is None:
                print(f"torch {mode}: {impl}")
                continue
            tms, tmem = r
            print(f"torch {mode:<15s} B{B}xT{T}: {tms:8.2f} ms/step  {tok / tms * 1e3:10,.0f} tok/s  "
                  f"peak {tmem:6.1f} GiB  ({impl}) -> cukernels is {tms / ms:.2f}x faster"
                  + "".join(f", fp8 ({k}) {tms / v:.2f}x" for k, v in fp8_ms.items()), flush=True)
            out["torch"].append(dict(config=c, mode=mode, ms=tms, peak_gib=tmem, ratio=tms / ms))
    if len(modes) > 1:
        recompute_table(out["rows"], modes, args.steps)
    for mode in [m for m in args.max_t.split(",") if m]:
        print(f"\nLongest T at B1 with recompute {mode} (multiples of {MAX_T_STEP}, at most {args.max_t_cap}):",
              flush=True)
        t, probes = longest_t(mode, 1, args.max_t_cap, args.data)
        print(f"  -> B1xT{t}" + ("  (the cap: longer may fit, raise --max-t-cap)" if t == args.max_t_cap else ""),
              flush=True)
        out.setdefault("max_t", []).append(dict(recompute=mode, max_t=t, cap=args.max_t_cap, probes=probes))
    if args.ablation and args.model == "gpt2":
        B, T = CONFIGS[args.configs.split(",")[0]]
        print(f"\nGPT-2 fused on/off (the write-up's use_fused_kernel), B{B}xT{T}, median of {args.steps}:")
        print(f"{'configuration':<82} {'ms/step':>9} {'tok/s':>10}  loss first..last")
        for row, feats in GPT2_ROWS:
            try:
                ms, losses, mem, _ = run_ours(B, T, feats, args.steps, data=args.data)
            except Exception:
                print(f"{row:<82} FAILED")
                traceback.print_exc()
                continue
            print(f"{row:<82} {ms:9.2f} {B * T / ms * 1e3:10,.0f}  {losses[0]:.4f}..{losses[-1]:.4f}", flush=True)
            out["ablation"].append(dict(row=row, ms=ms, losses=losses, peak_gib=mem))
    elif args.ablation:
        B, T = CONFIGS["b4t64"]
        print(f"\nAblation, B{B}xT{T} ({B * T} tokens/step), ms/step median of {args.steps}:")
        print(f"{'configuration':<58} {'ms/step':>9} {'tok/s':>10} {'gain':>7} {'vs baseline':>12}  loss first..last")
        prev = base = None
        feats = []
        for f in [None] + FEATURES:
            if f is not None:
                feats.append(f)
            try:
                ms, losses, mem, _ = run_ours(B, T, feats, args.steps, data=args.data)
            except Exception:
                print(f"{ROW_NAMES[f]:<58} FAILED")
                traceback.print_exc()
                continue
            gain = f"{prev / ms:6.2f}x" if prev else "-"
            base = base or ms
            print(f"{ROW_NAMES[f]:<58} {ms:9.2f} {B * T / ms * 1e3:10,.0f} {gain:>7} {base / ms:11.2f}x  "
                  f"{losses[0]:.4f}..{losses[-1]:.4f}", flush=True)
            out["ablation"].append(dict(row=ROW_NAMES[f], ms=ms, losses=losses, peak_gib=mem))
            prev = ms
    if args.json and (DIST["group"] is None or DIST["group"].rank == 0):  # as in benchmarks/results/bench_train.json
        out["command"] = " ".join(["python benchmarks/bench_train.py", *(sys.argv[1:] if argv is None else argv)])
        out["date"] = time.strftime("%Y-%m-%d")
        Path(args.json).write_text(json.dumps(out, indent=1))
    if DIST["group"] is not None:
        import cukernels.distributed as dist

        gc.collect()  # every captured step (its graph holds collectives) is gone before the communicator
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
