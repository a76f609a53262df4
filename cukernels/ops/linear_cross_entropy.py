"""Fused LM head + loss: ``ck.linear_cross_entropy`` (logits = x @ W^T and softmax cross-entropy, in row chunks).

Per chunk of C rows (never all N x V logits in memory)::

    logits_c  = x_c @ W^T                      ck.matmul, [C, V] in x's dtype, into one workspace reused per chunk
    dlogits_c = cross-entropy fused in place    kernels_cu/cross_entropy.cu (ce_fused), over logits_c
    dx_c      = dlogits_c @ W                   ck.matmul, into dx[c0:c1]
    dW       (+)= dlogits_c^T @ x_c             ck.matmul, bf16 operands -> fp32 gradient, beta = 1 after the first

Kernels: none of its own. The chunks reuse the cross_entropy family's kernels with two pointers the public
``cross_entropy_fused`` does not expose: the divisor of "mean" is the count of valid targets over ALL N rows
(``ce_count`` once, before the loop, on the device: no host sync), and every chunk writes its per-row losses into
one [N] fp32 buffer that one fixed-order ``ce_reduce_loss`` sums after the loop (deterministic, no atomics, no
per-chunk temporaries). The GEMMs run on ck.matmul's own cuBLAS handle, so the whole call is graph-capturable.

Chunk size (numbers for N8192 x H2048 x V128256 bf16, the LLaMA-3.2-1B head at B8 x T1024): the workspace is
C x V x s bytes; C = the largest multiple of 128 with C V s <= 512 MiB (bf16: 2092 -> 2048 rows, 525 MB; fp32:
1024 rows), then balanced over the chunks (N = 8192 -> 4 chunks of 2048; GPT-2's V = 50257 bf16 -> 2 of 4096).
Bigger chunks mean fewer passes of the fp32 dW accumulation (each chunk's dW GEMM reads and writes the whole
V x H fp32 gradient, 2.1 GB at this shape) and taller GEMMs; the budget keeps the extra memory at ~0.56 GB
(workspace + dx) instead of the 2.1 GB of full bf16 logits (13.2 GB in PyTorch's unfused path). At C = 2048
every GEMM has a 2048 dimension: logits 2048 x 128256 (8016 tiles of 128 x 256, ~61 waves on 132 SMs), dx
2048 x 2048 with K = 128256 (128 tiles: one wave), dW 128256 x 2048 with K = 2048. Multiples of 128 rows keep
the dW GEMM's K free of a ragged tail and the logits GEMM's M on whole tiles.

The workspace rows are padded to a multiple of 64 elements (``ck.blas.empty_padded``; 128256 is one already,
GPT-2's 50257 becomes 50304, +0.1 %): V stays the class count, the GEMMs take the row stride as their leading
dimension and the CE kernels as ``ld``. Unpadded 50257-element bf16 rows (100514 B) are not 16-byte aligned and
confine cuBLAS to its align1 kernels for all three GEMMs (measured on the H200: 15.6 ms for GPT-2's head GEMMs
at N = 8192 through an unpadded [N, 50257] buffer).

A padded weight (``num_classes`` V below the weight's row count Vw, e.g. GPT-2's head copied into a zero-padded
[50304, H] buffer, the layout ``functional.linear(pad_rows=True)`` uses): measured on the H200, cuBLAS keeps its
align1 kernels whenever an odd V is the logits GEMM's N or the dx GEMM's K, whatever the leading dimension (GPT-2
step 29.5 -> 19.9 ms once W was padded). So the logits and dx GEMMs run over all Vw rows (workspace [C, Vw]); the
loss kernel reads only the first V columns; the Vw - V padding columns of dlogits are set to 0 per chunk (a
C x 47 fill for GPT-2, ~3 us) so dx ignores whatever finite values the padding rows hold (NaN or inf rows would
give 0 x NaN: on the H200 a NaN-padded test weight made dx NaN); dW is the [V, H] gradient (its GEMM
takes the first V workspace columns, M = V, which cuBLAS runs on an align8 kernel: 1.2 ms at N8192 for GPT-2).
A weight passed unpadded with such a row count (a Hugging Face GPT-2 head, [50257, H]) is staged into a
zero-padded copy first and takes the same path (``ck.settings.lce_stage_weight``).

The weight gradient accumulates in fp32 straight from the GEMM (beta = 1) rather than through a bf16 per-chunk
buffer: a bf16 dW would add 525 MB (over the budget), a cast + add pass over ~2.6 GB per chunk, and a bf16
rounding of the partial sums per chunk.

``grad_fp8`` (an FP8 format): the two gradient GEMMs on FP8 tensor cores, the logits and the loss as before. Per
chunk, the fused kernel writes dlogits straight as FP8 codes into rows of their own (``ce_fused_q8``: 1 byte an
element instead of the 2 of bf16 dlogits), then ``fp8_transpose`` makes their transpose; x_c is cast in E4M3 with
its transpose, and the weight once a call (cuBLASLt's FP8 GEMMs take K-major operands only):

    dx_c   = (s_z s_W)^-1  q(dz_c) @ q(W)^T^T         K = Vw
    dW   (+)= (s_z s_x)^-1 q(dz_c)^T[:V] @ q(x_c)^T^T  K = C, fp32 (beta = 1 after the first chunk)

s_z needs no amax: every dlogit is g (p_j - eps/V - (1 - eps)[j == t]) with |.| <= 1, so s_z is the largest power
of two with s_z |g| <= the format's max (:func:`dlogits_scale`; g = dloss / count, known on the device before the
kernel runs). Against an amax pass and a cast with the transpose over bf16 dlogits (2 + 2 + 4 B an element after
the kernel's 2-byte write) that is 1 + 2 B (the write and the byte transpose): at the 1B head, 1.05 G elements a
step, ~5 GB less traffic. E5M2 keeps 2^15 more range than E4M3 below the bound: softmax probabilities of a 128k
vocabulary reach far below it, and what falls under the format's smallest subnormal becomes 0. A chunk whose row
count is no multiple of 16 (the last of an N that is none) runs the bf16 GEMMs. ``grad_fp8_dw=False`` keeps dW in
bf16: the kernel (``ce_fused_q8b``) writes the bf16 dlogits over the logits as well as the codes, dx reads the codes,
dW the bf16 values (no transpose, x not cast). dW's sum over the chunk cancels as a model learns, and the FP8
rounding of its terms does not (benchmarks/NOTES.md, "FP8": the LM head).
At the LLaMA-3.2-1B head (B8 x T1024) the two GEMMs are 8.6 TFLOP (~11 ms in bf16, NOTES "FP8": the LM head).
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from ..blas import empty_padded, matmul
from . import cross_entropy as _ce
from . import fp8 as _fp8

INTS = (np.int32, np.int64)
REDUCTIONS = ("mean", "sum", "none")
WORKSPACE_BUDGET = 512 << 20  # bytes of logits per chunk (see the module docstring)
ROW_QUANTUM = 128  # chunk rows are a multiple of this (GEMM tile height / dW GEMM K without a ragged tail)


# ck.settings.lce_stage_weight: stage a weight whose row count leaves its logits rows unaligned (V % 8 for bf16, % 4
# for fp32) into a zero-padded copy with rows to a multiple of 64 (False = use it as it is, the A/B row: one H200,
# `python benchmarks/bench_ops.py --quick --only linear_cross_entropy --ab "lce_stage_weight=0"`: 13.6 ms for GPT-2's
# unpadded 8192 x 768 x 50257 against 3.5 ms with a padded weight).


def chunk_rows_for(N: int, V: int, itemsize: int, budget: int | None = None) -> int:
    """The default rows per chunk: <= ``budget`` bytes of logits (default WORKSPACE_BUDGET), multiple of
    ROW_QUANTUM, balanced over chunks.

    ``chunk_rows_for(8192, 128256, 2) == 2048`` (4 chunks, 525 MB workspace); fp32 -> 1024; GPT-2's
    ``(8192, 50257, 2) -> 4096`` (2 chunks, 412 MB). A vocabulary so large that 128 rows exceed the budget still
    gets 128-row chunks (the workspace then exceeds the budget: 128 V s bytes).
    """
    if N <= 0:
        return 0
    budget = WORKSPACE_BUDGET if budget is None else budget
    cmax = max(ROW_QUANTUM, budget // (V * itemsize) // ROW_QUANTUM * ROW_QUANTUM)
    if N <= cmax:
        return N
    n = -(-N // cmax)
    c = -(-N // n)
    return min(cmax, -(-c // ROW_QUANTUM) * ROW_QUANTUM)  # cmax is a multiple of ROW_QUANTUM: the min is a no-op


def _int(name, v):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer; got {type(v).__name__} {v!r}")
    return int(v)


def _flag(name, v):
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False; got {type(v).__name__} {v!r}")
    return bool(v)


def _check_dloss(xp, dloss):
    """dloss: a real number or a 0-d float32 array of the arrays' module -> (scalar, array or None)."""
    if isinstance(dloss, (int, float, np.integer, np.floating)) and not isinstance(dloss, (bool, np.bool_)):
        # finite in float32, as cross_entropy_* take it (a NaN dloss wrote NaN gradients)
        return float(B.check_f32("dloss", dloss)), None
    k = B._kind(dloss)
    if k is None:
        raise TypeError(f"dloss: expected a float or a 0-d float32 array; got {type(dloss).__name__}")
    if k is not xp:
        raise TypeError(f"dloss: is a {k.__name__} array but x is a {xp.__name__} array")
    B.check_dtype("dloss", dloss, (np.float32,))
    B.check_shape("dloss", dloss, ())
    if xp is not np and dloss.device.id != xp.cuda.Device().id:
        raise ValueError(f"dloss: is on device {dloss.device.id}, but the current device is {xp.cuda.Device().id}")
    B.check_finite_host("dloss", dloss)  # (a NumPy value only: a device one is read by the kernel, no sync)
    return 0.0, dloss


def _check_grad_fp8(grad_fp8, x, Vw, compute_grad):
    """None, or the FP8 format of dlogits for the gradient GEMMs (bf16 operands, dimensions multiples of 16)."""
    if grad_fp8 is None:
        return None
    fmt = _fp8.fp8_format("grad_fp8", grad_fp8)
    if not compute_grad:
        raise ValueError("grad_fp8: given, but compute_grad=False computes no gradients")
    if x.dtype != B.bfloat16:
        raise TypeError(f"grad_fp8: the FP8 gradient GEMMs take bfloat16 x and weight; got {x.dtype} (pass "
                        "grad_fp8=None, or bfloat16 operands)")
    if x.shape[1] % 16 or Vw % 16:
        raise ValueError(f"grad_fp8: cuBLASLt's FP8 GEMMs need H and the weight's rows multiples of 16; got H = "
                         f"{x.shape[1]}, {Vw} rows (pad the weight's rows, num_classes=, or pass grad_fp8=None)")
    return fmt


def _validate(x, weight, targets, ignore_index, reduction, label_smoothing, grad_weight, accumulate, compute_grad,
              chunk_rows, grad_input, error, num_classes):
    B.check_dtype("x", x, B.FLOATS)
    if x.ndim != 2:
        raise ValueError(f"x: expected a 2-D array [N, H]; got shape {tuple(x.shape)}")
    N, H = x.shape
    B.check_contiguous("x", x)
    B.check_dtype("weight", weight, (x.dtype,))
    if weight.ndim != 2 or weight.shape[1] != H:
        raise ValueError(f"weight: expected shape [V, {H}] (H = x.shape[1]); got {tuple(weight.shape)}")
    Vw = weight.shape[0]
    if Vw < 1:
        raise ValueError(f"weight: expected at least 1 row (the vocabulary); got shape {tuple(weight.shape)}")
    if Vw >= 2**31:
        raise ValueError(f"weight: at most 2**31 - 1 rows (classes) supported; got {Vw}")
    B.check_contiguous("weight", weight)
    V = Vw
    if num_classes is not None:
        V = _int("num_classes", num_classes)
        if not 1 <= V <= Vw:
            raise ValueError(f"num_classes: expected an integer in [1, {Vw}] (weight.shape[0] = {Vw}: the classes "
                             f"and then padding rows); got {V}")
    B.check_dtype("targets", targets, INTS)
    B.check_shape("targets", targets, (N,), " ([N], N = x.shape[0])")
    B.check_contiguous("targets", targets)
    ig = B.check_int("ignore_index", ignore_index, min=-2**63, max=2**63 - 1)  # (an int64 kernel argument)
    B.check_choice("reduction", reduction, REDUCTIONS)
    eps = float(np.float32(B.check_real("label_smoothing", label_smoothing, min=0, max=1)))
    accumulate = _flag("accumulate", accumulate)
    compute_grad = _flag("compute_grad", compute_grad)
    if chunk_rows is not None:
        chunk_rows = _int("chunk_rows", chunk_rows)
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows: expected a positive integer; got {chunk_rows}")
    if not compute_grad:
        for name, v in (("grad_weight", grad_weight), ("grad_input", grad_input)):
            if v is not None:
                raise ValueError(f"{name}: given, but compute_grad=False computes no gradients")
        if accumulate:
            raise ValueError("accumulate: True, but compute_grad=False computes no gradients")
    if grad_weight is not None:
        B.check_out("grad_weight", grad_weight, (V, H), grad_weight.dtype if grad_weight.dtype == B.bfloat16
                    else np.float32)
    elif accumulate:
        raise ValueError("grad_weight: required when accumulate=True (the weight gradient is added into it)")
    if grad_input is not None:
        B.check_out("grad_input", grad_input, (N, H), x.dtype)
    if error is not None:
        B.check_dtype("error", error, (np.int32,))
        B.check_shape("error", error, ())
    return N, H, V, Vw, ig, eps, accumulate, compute_grad, chunk_rows


@B.interop
def linear_cross_entropy(x, weight, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         grad_weight=None, accumulate=False, compute_grad=True, chunk_rows=None, dloss=1.0,
                         grad_input=None, error=None, num_classes=None, grad_fp8=None, grad_fp8_dw=True):
    """Cross-entropy of ``x @ weight.T`` against ``targets``, with the gradients, without materialising the logits.

    With logits z = x W^T (rounded once to x's dtype, as a GEMM into a bf16 buffer would), per row i with target
    t and eps = label_smoothing::

        loss_i = (1 - eps) (lse_i - z_it) + eps (lse_i - mean_j z_ij)          (0 where t == ignore_index)
        dz_ij  = g (softmax(z_i)_j - eps / V - (1 - eps) [j == t])              (rounded to x's dtype)
        dx     = dz @ W,    dW (+)= dz^T @ x   (fp32)

    exactly as :func:`cukernels.cross_entropy` / ``cross_entropy_fused`` on the full logits followed by the two
    gradient GEMMs, but in chunks of ``chunk_rows`` rows through one [chunk_rows, V] workspace. ``g`` is
    ``dloss / count`` for "mean" (count = non-ignored targets over all N rows, counted on the device; 0 when
    every target is ignored: loss 0, gradients 0), ``dloss`` for "sum" and for "none" (the gradient of
    ``dloss * sum_i loss_i``). No host synchronisation: the call can be captured in a CUDA graph.

    Args:
        x: ``[N, H]`` float32 or bfloat16, C-contiguous (N may be 0).
        weight: ``[V, H]``, the dtype of ``x`` (under bf16 autocast: the bf16 shadow of the master weight).
        targets: ``[N]`` int32 (or int64). On the GPU a target outside ``[0, V)`` that is not ``ignore_index``
            makes its row ignored and ORs 1 into the error word (``error`` or ``ck.cross_entropy_error()``);
            the NumPy path raises ValueError.
        ignore_index, reduction ("mean" | "sum" | "none"), label_smoothing: as in ``ck.cross_entropy``.
        grad_weight: optional ``[V, H]`` float32 C-contiguous buffer for dW (e.g. the master weight's fp32
            gradient): overwritten, or added into with ``accumulate=True``. Default: a new float32 array.
            A bfloat16 buffer (an optimizer's bf16 gradient) takes a single chunk's dW, the GEMM's fp32 sum
            rounded once, without ``accumulate`` (ValueError otherwise: each chunk would round again).
        accumulate: add dW into ``grad_weight`` (GEMM beta = 1) instead of overwriting it.
        compute_grad: False computes the loss only (evaluation): no dlogits, dx or dW, no gradient buffers.
        chunk_rows: rows per chunk (positive int); default :func:`chunk_rows_for` (<= 512 MiB of logits).
        dloss: gradient of the returned loss (a float, or a 0-d float32 array read on the device, e.g. a loss
            scale or 1 / accumulation steps); scales the gradients only.
        grad_input: optional ``[N, H]`` buffer (x's dtype, C-contiguous) for dx.
        error: optional 0-d int32 device error word.
        num_classes: V, when ``weight`` holds V class rows followed by padding rows (``weight.shape[0] >= V``;
            e.g. GPT-2's 50257 classes in a [50304, H] buffer): the GEMMs run over every row (16-byte aligned
            dimensions), the padding logits never enter the loss, their gradient is 0, ``dweight`` is ``[V, H]``.
            The padding rows must be finite (any values; the model's are zeros): the dx GEMM multiplies them by
            those zero gradients, and 0 x NaN is NaN. Default ``weight.shape[0]``.
        grad_fp8: None (default), or ``ck.float8_e5m2`` / ``ck.float8_e4m3fn``: dx and dW from FP8 GEMMs, dlogits
            quantised per chunk in this format (module docstring); bfloat16 x and weight, H and the weight's rows
            multiples of 16. The loss is unchanged.
        grad_fp8_dw: with ``grad_fp8``: True (default) both gradient GEMMs in FP8; False only the dx GEMM, dW from
            the bf16 dlogits (the same kernel writes both; no transpose, x not cast). dW sums dlogits that cancel
            as a model learns, and FP8 rounding of them does not cancel (benchmarks/NOTES.md, "FP8").

    Returns:
        ``(loss, dx, dweight)``: loss a 0-d float32 array ("mean"/"sum") or float32 ``[N]`` ("none"); dx
        ``[N, H]`` in x's dtype; dweight float32 ``[V, H]`` (``grad_weight`` when given, in its dtype). With
        ``compute_grad=False``: ``(loss, None, None)``.

    Example::

        >>> loss, dx, _ = ck.linear_cross_entropy(h_bf16, w_bf16, targets, grad_weight=w_master_grad,
        ...                                       accumulate=True)          # loss.shape == (), no [N, V] buffer
    """
    xp = B.array_module(x=x, weight=weight, targets=targets, grad_weight=grad_weight, grad_input=grad_input,
                        error=error)
    N, H, V, Vw, ig, eps, accumulate, compute_grad, chunk_rows = _validate(
        x, weight, targets, ignore_index, reduction, label_smoothing, grad_weight, accumulate, compute_grad,
        chunk_rows, grad_input, error, num_classes)
    dscalar, darr = _check_dloss(xp, dloss)
    gfmt = _check_grad_fp8(grad_fp8, x, Vw, compute_grad)
    fp8_dw = B.check_bool("grad_fp8_dw", grad_fp8_dw)
    if gfmt is None and not fp8_dw:
        raise ValueError("grad_fp8_dw: False keeps dW out of FP8 when grad_fp8 is given; pass grad_fp8= with it")
    if settings.lce_stage_weight and xp is not np and N and Vw % (16 // x.itemsize):
        # A row count that is no multiple of 16 bytes' elements (GPT-2's unpadded [50257, 768] head) would keep the
        # logits and dx GEMMs on cuBLAS' align1 kernels (above): stage the weight into zero-padded rows and take
        # the padded path. One copy of the weight (77 MB for GPT-2, ~40 us) against 13.6 -> ~3.6 ms at N = 8192.
        Vp = -(-Vw // 64) * 64
        wp = xp.empty((Vp, H), dtype=weight.dtype)
        wp[:Vw] = weight
        B.zero_(wp[Vw:])
        weight, Vw = wp, Vp
    C = min(chunk_rows, N) if chunk_rows is not None else chunk_rows_for(N, Vw, x.itemsize)
    if grad_weight is not None and grad_weight.dtype == B.bfloat16 and (accumulate or N > C):
        # dW is one GEMM's fp32 sum rounded once only when the call is a single chunk and overwrites
        raise ValueError(f"grad_weight: a bfloat16 buffer takes dW from a single chunk (N = {N} rows, chunks of "
                         f"{C}) without accumulate; pass a float32 buffer (or chunk_rows >= N)")
    if xp is np:
        # The padding rows take no part in the math (their logits are not read, their dlogits are 0).
        return _reference(x, weight[:V], targets, N, V, ig, eps, reduction, darr if darr is not None else dscalar,
                          grad_weight, accumulate, compute_grad, C, grad_input, gfmt, fp8_dw)

    err = error if error is not None else _ce.cross_entropy_error()
    loss_rows = xp.empty((N,), dtype=np.float32)
    cnt = None
    if reduction == "mean":  # the divisor over all N rows, before any chunk needs it (device int, no sync)
        cnt = xp.empty((), dtype=np.int32)
        get_function(_ce.FAMILY, f"ce_count_{B.DTYPE_TAG[targets.dtype]}")(
            (1,), (1024, 1, 1), (targets, np.int64(N), np.int64(V), np.int64(ig), cnt))
    cptr = cnt if cnt is not None else B.NULL
    dx = dw = None
    if compute_grad:
        dx = B.empty(xp, (N, H), x.dtype, grad_input, name="grad_input")
        dw = grad_weight if grad_weight is not None else xp.empty((V, H), dtype=np.float32)
        if N == 0 and not accumulate:
            B.zero_(dw)  # no chunk writes it
    if N:
        # Rows padded to a multiple of 64 elements (GPT-2: 50257 -> 50304): the three GEMMs that read or write
        # the workspace get 16-byte-aligned rows (cuBLAS' fast kernels; 50257 bf16 rows would force its align1
        # kernels), and the CE kernel reads it with that row stride. Never more than 63 extra columns.
        # (grad_fp8: rows of exactly Vw, a multiple of 16 -- the casts of dlogits read it as one C-contiguous array)
        ws = empty_padded((C, Vw), x.dtype, xp=xp)
        ldz = ws.strides[0] // ws.itemsize
        tag = f"{B.DTYPE_TAG[x.dtype]}_{B.DTYPE_TAG[targets.dtype]}"
        k = get_function(_ce.FAMILY, f"ce_{'fused' if compute_grad else 'fwd'}_{tag}")
        threads = _ce._threads(V, x.itemsize)
        dptr = darr if darr is not None else B.NULL
        if gfmt is not None:
            # the weight in E4M3 once a call, with the transpose the dx GEMM reads (K = Vw); a chunk's FP8 dlogits
            # (the fused kernel's codes, row stride Vw), their transpose, and 1 / s, the kernel writes them
            _, wqT, sw = _fp8.fp8_quantize(weight, transpose=True)
            q8 = "q8" if fp8_dw else "q8b"  # q8b: the bf16 dlogits in place as well (dW's bf16 GEMM reads them)
            kq = get_function(_ce.FAMILY, f"ce_fused_{q8}_{tag}_{'e5m2' if gfmt == B.float8_e5m2 else 'e4m3'}")
            zq_all = xp.empty((C, Vw), dtype=np.uint8)
            zqT_all = xp.empty((Vw * C,), dtype=np.uint8) if fp8_dw else None
            sz = xp.empty((), dtype=np.float32)
        for i, c0 in enumerate(range(0, N, C)):
            c1 = min(N, c0 + C)
            r = c1 - c0
            zw = ws[:r]  # the workspace's first r rows (row stride ldz), all Vw columns
            z = zw[:, :V] if Vw > V else zw  # the class columns: what the loss and the dW GEMM see
            xc, tc, lr = x[c0:c1], targets[c0:c1], loss_rows[c0:c1]
            matmul(xc, weight, trans_b=True, out=zw)
            beta = 1.0 if (accumulate or i) else 0.0
            if gfmt is not None and r % 16 == 0:
                # dlogits straight to FP8 codes (the scale from |dz| <= |g|, no amax pass); q8b: the bf16 ones too
                zq = zq_all[:r]
                args = (z, tc, zq, lr, err, cptr, dptr, np.float32(dscalar), np.int64(r), np.int32(V), np.int64(ldz),
                        np.int64(Vw), np.int64(ig), np.float32(eps), np.bool_(True),
                        np.bool_(settings.ce_cache_hints), sz)
                kq((_ce._grid(kq, r, threads),), (threads, 1, 1), args if fp8_dw else args + (z, np.int64(ldz)))
                if Vw > V:
                    zq[:, V:].fill(0)  # code 0: the padding columns add nothing to dx (K = Vw)
                e4 = B.float8_e4m3fn
                matmul(zq, wqT, trans_b=True, a_scale=sz, b_scale=sw, a_dtype=gfmt, b_dtype=e4, out=dx[c0:c1])
                if fp8_dw:  # dW from the codes' transpose and x in E4M3
                    zqT = _fp8.fp8_transpose(zq, out=zqT_all[:Vw * r].reshape(Vw, r))
                    _, xqT, sx = _fp8.fp8_quantize(xc, transpose=True)
                    matmul(zqT[:V], xqT, trans_b=True, a_scale=sz, b_scale=sx, a_dtype=gfmt, b_dtype=e4, out=dw,
                           beta=beta)
                    continue
            else:
                grid = (_ce._grid(k, r, threads),)
                if not compute_grad:
                    k(grid, (threads, 1, 1), (z, tc, lr, B.NULL, err, np.int64(r), np.int32(V), np.int64(ldz),
                                              np.int64(ig), np.float32(eps)))
                    continue
                # In place: z becomes dlogits (vec = True: the same pointer is trivially congruent mod 16).
                k(grid, (threads, 1, 1), (z, tc, z, lr, err, cptr, dptr, np.float32(dscalar), np.int64(r),
                                          np.int32(V), np.int64(ldz), np.int64(ldz), np.int64(ig), np.float32(eps),
                                          np.bool_(True), np.bool_(settings.ce_cache_hints)))
                if Vw > V:
                    zw[:, V:].fill(0)  # padding columns: logits -> gradient 0 (a strided fill kernel, capturable)
                matmul(zw, weight, out=dx[c0:c1])  # K = Vw: the padding columns add exact zeros
            matmul(z, xc, trans_a=True, out=dw, beta=beta)  # the bf16 dlogits (also grad_fp8_dw=False's)
    if reduction == "none":
        loss = loss_rows
    else:
        loss = xp.empty((), dtype=np.float32)
        get_function(_ce.FAMILY, "ce_reduce_loss")((1,), (1024, 1, 1), (loss_rows, np.int64(N), cptr, loss))
    return loss, dx, dw


def _reference(x, weight, targets, N, V, ig, eps, reduction, dloss, grad_weight, accumulate, compute_grad, C,
               grad_input, gfmt=None, fp8_dw=True):
    """NumPy path: the same chunk loop; GEMMs in float32, the softmax in float64, dlogits rounded to x's dtype
    (``gfmt``: the gradient GEMMs on the dequantised FP8 operands, each chunk's dlogits with its own scale)."""
    t = targets.astype(np.int64)
    bad = (t != ig) & ((t < 0) | (t >= V))
    if bad.any():
        v = int(t[np.argmax(bad)])
        raise ValueError(f"targets: value {v} is out of range for {V} classes "
                         f"(valid: 0..{V - 1}, or ignore_index={ig})")
    valid = t != ig
    count = int(valid.sum())
    d = float(np.asarray(dloss, dtype=np.float64))
    g = (d / count if count else 0.0) if reduction == "mean" else d
    xf, wf = x.astype(np.float32), weight.astype(np.float32)
    H = x.shape[1]
    e4 = B.float8_e4m3fn
    if gfmt is not None:
        w8 = _fp8_dequantised(weight, e4)
    loss_rows = np.zeros(N, np.float64)
    dx = dw = None
    if compute_grad:
        dx = B.empty(np, (N, H), x.dtype, grad_input, name="grad_input")
        dw = grad_weight if grad_weight is not None else np.empty((V, H), dtype=np.float32)
        if not accumulate:
            dw[...] = 0.0
    for c0 in range(0, N, max(C, 1)):
        c1 = min(N, c0 + C)
        rows = np.arange(c1 - c0)
        z = (xf[c0:c1] @ wf.T).astype(x.dtype).astype(np.float64)  # the logits as the workspace holds them
        ok = valid[c0:c1]
        tc = np.where(ok, t[c0:c1], 0)
        m = z.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
        li = (1 - eps) * (lse - z[rows, tc]) + eps * (lse - z.mean(axis=1))
        loss_rows[c0:c1] = np.where(ok, li, 0.0)
        if compute_grad:
            dz = np.exp(z - lse[:, None]) - eps / V
            dz[rows, tc] -= 1 - eps
            dz = np.where(ok[:, None], dz * g, 0.0).astype(x.dtype).astype(np.float32)
            if gfmt is not None and (c1 - c0) % 16 == 0:
                s = dlogits_scale(_g_f32(dloss, reduction, count), gfmt)
                dz8 = (_fp8.ref_cast(dz, s, gfmt).view(gfmt).astype(np.float32) * (np.float32(1) / s))
                dx[c0:c1] = (dz8 @ w8).astype(x.dtype)
                dw += dz8.T @ _fp8_dequantised(xf[c0:c1], e4) if fp8_dw else dz.T @ xf[c0:c1]
                continue
            dx[c0:c1] = (dz @ wf).astype(x.dtype)
            dw += dz.T @ xf[c0:c1]
    if reduction == "none":
        loss = loss_rows.astype(np.float32)
    else:
        s = loss_rows.sum()
        if reduction == "mean":
            s = s / count if count else 0.0
        loss = np.asarray(s, dtype=np.float32)
    return loss, dx, dw


def _g_f32(dloss, reduction, count) -> np.float32:
    """The kernel's g in float32: dloss, times 1 / count (in float32) for "mean"."""
    d = np.float32(np.asarray(dloss, dtype=np.float32))
    if reduction != "mean":
        return d
    return np.float32(d * (np.float32(1) / np.float32(count) if count else np.float32(0)))


def dlogits_scale(g, fmt) -> np.float32:
    """The scale of FP8 dlogits (``grad_fp8``): the largest power of two s with s |g| <= the format's max, as
    ``ce_q8_scale`` in kernels_cu/cross_entropy.cu takes it from the exponent bits. Every dlogit obeys
    |g (p_j - eps/V - (1 - eps)[j == t])| <= |g|, so no amax pass is needed; 1 / s is exact. A g of 0, a
    subnormal or a non-finite one gives 1."""
    a = abs(np.float32(g))
    if not (a >= np.finfo(np.float32).tiny) or not np.isfinite(a):
        return np.float32(1)
    ma, ea = np.frexp(np.float64(a))
    mf, ef = np.frexp(_fp8.FP8_MAX[np.dtype(fmt)])
    e = int(np.clip(ef - ea - (1 if ma > mf else 0), -126, 126))
    return np.float32(2.0 ** e)


def _fp8_dequantised(a, fmt):
    """float32 values of ``a`` quantised as the kernels do (current scaling: the scale from max |a|)."""
    s = _fp8.ref_scale(_fp8.ref_amax(a), fmt)
    return (_fp8.ref_cast(a, s, fmt).view(fmt).astype(np.float32) * (np.float32(1) / s)).astype(np.float32)


__all__ = ["linear_cross_entropy"]
