"""Training data: the tinyshakespeare split, llm.c token files, and the samplers (a sequential cursor, seeded random
windows), each taking its rank's rows of a global batch under data parallelism. (``ByteTokenizer`` is
:class:`cukernels.tokenizer.ByteTokenizer`, kept importable from here.)

The example configs and the tiny runs' text ship with the package (``cukernels/examples/``) and sit in a checkout's
``examples/``: :func:`example_path` finds either, so ``data.path: null`` works from an installed package in any folder.

llm.c token files (the format the seed trained on): a header of 256 int32 (1024 bytes) -- ``[0]`` magic,
``[1]`` version, ``[2]`` token count, the rest zero -- followed by the tokens:

* magic 20240520, version 1: uint16 tokens (GPT-2 vocabulary),
* magic 20240801, version 7: uint32 tokens (LLaMA-3 vocabulary).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from .tokenizer import ByteTokenizer  # noqa: F401  (the trainer's text runs' tokenizer; one class, in tokenizer.py)
from .tokenizer import pipeline

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {  # kind -> (magic, version, token dtype)
    "gpt2": (20240520, 1, np.dtype("<u2")),
    "llama3": (20240801, 7, np.dtype("<u4")),
}
_BY_MAGIC = {m: (k, v, d) for k, (m, v, d) in FORMATS.items()}

_PKG = Path(__file__).resolve().parent
# where the examples are: shipped inside the installed package (setup.cfg maps examples/configs and examples/data
# to cukernels/examples/...), else beside the package in a source checkout
EXAMPLE_ROOTS = (_PKG / "examples", _PKG.parent / "examples")


def example_path(*parts) -> Path:
    """A file or folder of the examples (``example_path("configs", "tiny.yaml")``): the installed package's copy
    (``cukernels/examples/...``), else the checkout's ``examples/...``. The first candidate when neither exists."""
    for root in EXAMPLE_ROOTS:
        p = root.joinpath(*parts)
        if p.exists():
            return p
    return EXAMPLE_ROOTS[0].joinpath(*parts)


DEFAULT_TEXT = str(example_path("data", "tinyshakespeare.txt"))


def load_text_tokens(path=None, val_fraction=0.1):
    """Byte tokens of a text file (tinyshakespeare by default) split into (train, val): the last
    ``val_fraction`` of the file is the held-out split. Returns two uint8 arrays."""
    path = path or DEFAULT_TEXT
    if not os.path.isfile(path):
        raise ValueError(f"data.path: no such file: {path}" + ("" if path != DEFAULT_TEXT else
                         " (the default text is missing from this install: give data.path=FILE)"))
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a number in (0, 1); got {val_fraction}")
    n_val = max(1, int(len(data) * val_fraction))
    return data[:-n_val], data[-n_val:]


def write_token_file(path, tokens, kind="gpt2"):
    """Write tokens in llm.c's format (``kind`` "gpt2" -> uint16, "llama3" -> uint32). Raises ValueError when a
    token does not fit the kind's dtype."""
    if kind not in FORMATS:
        raise ValueError(f"kind: expected one of {sorted(FORMATS)}; got {kind!r}")
    magic, version, dt = FORMATS[kind]
    toks = np.asarray(tokens)
    if toks.size and (toks.min() < 0 or int(toks.max()) > np.iinfo(dt).max):
        raise ValueError(f"tokens: values must lie in [0, {np.iinfo(dt).max}] for kind {kind!r}; "
                         f"got [{toks.min()}, {toks.max()}]")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, toks.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.astype(dt).tobytes())


def read_token_file(path, mmap=True):
    """Tokens of an llm.c token file (uint16 or uint32 array, memory-mapped by default).

    Raises ValueError naming the file when the header's magic or version is unknown or the size disagrees."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte llm.c header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, n = int(header[0]), int(header[1]), int(header[2])
    if magic not in _BY_MAGIC:
        raise ValueError(f"{path}: unknown magic {magic} (expected {sorted(_BY_MAGIC)})")
    kind, want_version, dt = _BY_MAGIC[magic]
    if version != want_version:
        raise ValueError(f"{path}: {kind} token file version {version}; expected {want_version}")
    if size != HEADER_BYTES + n * dt.itemsize:
        raise ValueError(f"{path}: header says {n} tokens ({HEADER_BYTES + n * dt.itemsize} bytes), "
                         f"file has {size} bytes")
    if mmap:
        return np.memmap(path, dtype=dt, mode="r", offset=HEADER_BYTES, shape=(n,))
    return np.fromfile(path, dtype=dt, offset=HEADER_BYTES, count=n)


def train_val_tokens(kind="text", path=None, val_path=None, val_fraction=0.1, min_val=1):
    """``(train, val)`` token arrays for a run's ``data`` section: ``kind "text"``: the bytes of a text file
    (tinyshakespeare by default), the last ``val_fraction`` held out; ``"llmc"``: an llm.c token file (``path``)
    and its validation file (``val_path``), or else the last ``val_fraction`` of it, at least ``min_val`` tokens.
    ValueError naming the ``data.*`` key otherwise."""
    for key, p in (("path", path), ("val_path", val_path)):
        if p and not os.path.isfile(p):
            raise ValueError(f"data.{key}: no such file: {p}")
    if kind != "llmc":
        return load_text_tokens(path, val_fraction)
    if not path:
        raise ValueError("data.path: data.kind llmc needs an llm.c token file")
    train = read_token_file(path)
    if val_path:
        return train, read_token_file(val_path)
    n = max(min_val, int(len(train) * val_fraction))
    return train[:-n], train[-n:]


def _rows(x, y, rank, batch_size, xp):
    """Rows ``[rank * batch_size, (rank + 1) * batch_size)`` of a global host batch, on ``xp``'s device."""
    lo = rank * batch_size
    x, y = np.ascontiguousarray(x[lo:lo + batch_size]), np.ascontiguousarray(y[lo:lo + batch_size])
    if xp is not np:
        x, y = xp.asarray(x), xp.asarray(y)
    return x, y


class TokenLoader:
    """Batches (x, y) of shape [B, T] (int32; y is x shifted by one) from a 1-D token array.

    Sequential, llm.c style: each global batch takes the next ``B*T*world_size + 1`` tokens and the cursor moves by
    ``B*T*world_size``, wrapping to the start; rank r keeps rows ``[r*B, (r+1)*B)`` (data parallelism: N ranks
    read exactly the tokens one process reading ``B*N`` rows would). ``state_dict()`` / ``load_state_dict()`` give
    the cursor (to resume a run), the same on every rank."""

    def __init__(self, tokens, batch_size, seq_len, xp=np, *, rank=0, world_size=1):
        if len(tokens) < batch_size * world_size * seq_len + 1:
            raise ValueError(f"tokens: {len(tokens)} tokens are fewer than one batch of "
                             f"{batch_size * world_size}x{seq_len}+1")
        self.tokens, self.B, self.T, self.xp = tokens, batch_size, seq_len, xp
        self.rank, self.world_size = rank, world_size
        self.pos = 0

    def next_batch(self):
        n = self.B * self.world_size * self.T
        if self.pos + n + 1 > len(self.tokens):
            self.pos = 0
        buf = np.asarray(self.tokens[self.pos:self.pos + n + 1]).astype(np.int32)
        self.pos += n
        return _rows(buf[:-1].reshape(-1, self.T), buf[1:].reshape(-1, self.T), self.rank, self.B, self.xp)

    def reset(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": int(self.pos)}

    def load_state_dict(self, s):
        self.pos = int(s["pos"])


class RandomWindows:
    """``data.sampling: random``: each global batch is ``B * world_size`` windows of T+1 tokens at offsets drawn
    from a seeded PCG64 (nanoGPT style), rank r keeping rows ``[r*B, (r+1)*B)``. ``state_dict()`` carries the
    generator's state (the same on every rank), so a resumed run draws the same batches."""

    def __init__(self, tokens, batch_size, seq_len, xp=np, seed=0, *, rank=0, world_size=1):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"tokens: {len(tokens)} tokens are fewer than one window of {seq_len}+1")
        self.tokens, self.B, self.T, self.xp = tokens, batch_size, seq_len, xp
        self.rank, self.world_size = rank, world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self):
        ix = self.rng.integers(0, len(self.tokens) - self.T, size=self.B * self.world_size)
        buf = np.stack([np.asarray(self.tokens[i:i + self.T + 1]) for i in ix]).astype(np.int32)
        return _rows(buf[:, :-1], buf[:, 1:], self.rank, self.B, self.xp)

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, s):
        self.rng.bit_generator.state = s["rng"]


# ------------------------------------------------------------------------------------------------------ prepare
# Text to llm.c token files, streaming: ``python -m cukernels.data prepare --tokenizer FOLDER INPUT... --out DIR``.
#
# Each input is a document: a text file, or a ``.jsonl`` file whose lines are JSON objects with a ``"text"`` field (one
# document a line). A document becomes the tokens the tokenizer's post-processor puts around a text (Llama-3's BOS,
# say) around the tokens of its text, then the EOS token (``--no-eos`` leaves it out). Large files are read in chunks
# of about ``--chunk-mb`` cut before a " " between two non-space characters or after a "\n" between a non-space
# character and a letter or digit (``_safe_cut``) -- boundaries the byte-level pre-tokenizers (GPT-2's, Llama-3's,
# Qwen2's, GPT-4o's patterns) never cross -- and never inside an added token, so the ids equal those of encoding the
# whole document at once, and memory stays bounded whatever the input size.
# Chunks are encoded by ``--workers`` processes, with :class:`cukernels.tokenizer.FastEncoder` (exact, 3-7x the
# tokenizers package's speed) when it reproduces the tokenizer's pipeline, else with the package's encode_batch.
#
# Output: ``DIR/train.bin`` and ``DIR/val.bin`` in llm.c's format (``cukernels.data``: uint16 tokens when the
# vocabulary fits, else the uint32 LLaMA-3 format), the last ``--val-fraction`` of the input bytes going to val
# (cut at a safe point near it), and ``DIR/prepare.json`` (tokenizer, inputs, token counts). The trainer reads them with
# ``data: {kind: llmc, path: DIR/train.bin, val_path: DIR/val.bin}``.


_TOK = {}


def _worker_init(folder, fast=True, tok=None):
    """The encoder of a process: the FastEncoder when it applies, else the tokenizers package (never truncating);
    ``_TOK["why"]`` says why there is no FastEncoder. Workers forked from the parent find the parent's ready (a
    Llama-3 tokenizer.json takes ~0.5 s to load)."""
    from .tokenizer import FastEncoder, Tokenizer

    if _TOK.get("key") == (folder, fast):
        return
    _TOK.clear()
    t = tok if tok is not None else Tokenizer.from_pretrained(folder)
    t._tok.no_truncation()
    t._tok.no_padding()
    _TOK.update(t=t, avoid=spaced_added_tokens(t), fast=None, why="--no-fast")
    if fast:
        try:
            _TOK["fast"] = FastEncoder(t)
        except ValueError as e:
            _TOK["why"] = str(e)
    _TOK["key"] = (folder, fast)


PIECE = 16384  # characters: tokenizers encodes a batch of pieces in parallel threads, a 1 MB string in one


def _pieces(text: str, avoid=()) -> list[str]:
    """``text`` cut into pieces of about PIECE characters at safe boundaries (see ``_split_point``)."""
    out, i = [], 0
    while len(text) - i > 2 * PIECE:
        cut = _split_point(text[i:i + PIECE], avoid)
        if cut == 0:
            cut = _split_point(text[i:i + 2 * PIECE], avoid) or len(text) - i
        out.append(text[i:i + cut])
        i += cut
    out.append(text[i:])
    return out


def _encode(texts, split=True):
    if _TOK["fast"] is not None:
        return [_TOK["fast"].encode(text) for text in texts]
    t = _TOK["t"]
    pieces, owner = [], []
    for k, text in enumerate(texts):
        for p in (_pieces(text, _TOK["avoid"]) if split else [text]):
            pieces.append(p)
            owner.append(k)
    ids = t.encode_batch(pieces, add_special_tokens=False)
    out = [[] for _ in texts]
    for k, e in zip(owner, ids):
        out[k].append(np.asarray(e, dtype=np.int64))
    return [np.concatenate(o) if o else np.zeros(0, np.int64) for o in out]


def specials_around(tok) -> tuple[list[int], list[int]]:
    """(the ids the post-processor puts before a text, those it puts after)."""
    probe = "a"
    plain = tok.encode(probe, add_special_tokens=False)
    full = tok.encode(probe)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    raise ValueError("tokenizer: its post-processor changes the text's own tokens; cannot stream it")


def chunkable(tok) -> bool:
    """Whether a document may be encoded in pieces cut at a space or newline between non-space characters: not for
    tokenizers that mark the start of a text (SentencePiece's Metaspace with a prepend scheme, a Prepend normalizer:
    Llama-2, Mistral; ByteLevel's add_prefix_space: RoBERTa), which would mark every piece, nor for those without a
    pre-tokenizer (their model sees the whole text at once)."""
    conf = pipeline(tok._tok)
    pre = json.dumps(conf["pre_tokenizer"])
    spec = pre + json.dumps(conf["normalizer"])
    return (conf["pre_tokenizer"] is not None and "Metaspace" not in spec and "Prepend" not in spec
            and '"add_prefix_space": true' not in pre)


def spaced_added_tokens(tok) -> tuple[str, ...]:
    """The added tokens holding whitespace: a chunk is never cut inside one of them."""
    return tuple(t["content"] for t in pipeline(tok._tok)["added_tokens"] if any(c.isspace() for c in t["content"]))


def _safe_cut(buf: str, i: int, avoid=()) -> bool:
    r"""Whether ``buf`` may be cut before index i: buf[i] is a " " between two non-space characters, or buf[i-1]
    a "\n" between a non-space character and a letter or digit; and no added token of ``avoid`` spans i.
    Pre-tokenizer patterns keep a space with the word after it and end a newline's pre-token before a letter: neither
    GPT-2's, Llama-3's, Qwen2's nor GPT-4o's pattern crosses such a point, while a cut after "\r\n", "\n\n" or
    "  \n" would (``\s+(?!\S)`` matches differently at the end of a piece), and one between "\n" and "/" would for
    GPT-4o's (``[^\s\p{L}\p{N}]+[\r\n/]*``). A space or newline is a starter, so NFC composes nothing across."""
    if buf[i] == " ":
        ok = 0 < i < len(buf) - 1 and not buf[i - 1].isspace() and not buf[i + 1].isspace()
    else:
        ok = 1 < i < len(buf) and buf[i - 1] == "\n" and not buf[i - 2].isspace() and buf[i].isalnum()
    return ok and not any(buf.startswith(t, s) for t in avoid for s in range(max(0, i - len(t) + 1), i))


def _split_point(buf: str, avoid=(), end=None) -> int:
    """The last index 0 < i < ``end`` where ``buf`` may be cut (``_safe_cut``), 0 when there is none. An added
    token of ``avoid`` spanning i must lie within ``buf`` to be seen: i stays that far from its end."""
    best = 0
    end = min(len(buf) if end is None else end, len(buf) - max(map(len, avoid), default=0))
    for sep, off in ((" ", 0), ("\n", 1)):  # the cut is before a " ", after a "\n"
        j = end + 1 - off
        while True:
            j = buf.rfind(sep, 0, j)
            if j < 0 or j + off <= best:
                break
            if j + off < end and _safe_cut(buf, j + off, avoid):
                best = j + off
                break
    return best


def _first_split_after(buf: str, k: int, avoid=()) -> int:
    """The first index i >= k where ``buf`` may be cut (``_safe_cut``), 0 when there is none."""
    best = 0
    end = len(buf) - max(map(len, avoid), default=0)
    for sep, off in ((" ", 0), ("\n", 1)):
        j = buf.find(sep, max(0, k - off))
        while 0 <= j < end and (not best or j + off < best):
            if k <= j + off < end and _safe_cut(buf, j + off, avoid):
                best = j + off
                break
            j = buf.find(sep, j + 1)
    return best


def iter_documents(path: Path, chunk_bytes: int, until=None, avoid=()):
    """Yield (document start?, document end?, text chunk, bytes read) for one input file. ``until()``: how many
    more bytes may be read before the val split begins (reads stop short of it, so a chunk does not straddle it);
    ``avoid``: added tokens holding whitespace, never cut (``spaced_added_tokens``)."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(f'{path}:{n}: expected a JSON object with a string "text" field')
                yield True, True, obj["text"], len(line)
        return
    with open(path, "r", encoding="utf-8", errors="strict", newline="") as f:
        carry, first = "", True
        while True:
            left = until() if until is not None else None  # (characters stand in for bytes: about the split)
            if left is not None and 0 < left <= len(carry):
                # The val split falls inside what is held: cut at the last safe point before it, else the first one
                # after it.
                cut = _split_point(carry, avoid, left + 1) or _first_split_after(carry, left, avoid)
                if cut:
                    yield first, False, carry[:cut], len(carry[:cut].encode("utf-8"))
                    carry, first = carry[cut:], False
                    continue
            if left is None:
                n = chunk_bytes
            elif left <= len(carry):  # no safe point yet around the split: read on in small steps to find one
                n = 4096
            else:
                n = min(chunk_bytes, left - len(carry))
            try:
                block = f.read(n)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e})") from None
            if not block:
                yield first, True, carry, len(carry.encode("utf-8"))
                return
            buf = carry + block
            if left is not None and left <= len(carry):  # looking for a cut around the split: the branch above
                carry = buf
                continue
            cut = _split_point(buf, avoid)
            if cut == 0:  # no safe boundary yet: read more
                carry = buf
                continue
            piece, carry = buf[:cut], buf[cut:]
            yield first, False, piece, len(piece.encode("utf-8"))
            first = False


class _Out:
    """An llm.c token file written as tokens arrive; the header's count is filled in at the end."""

    def __init__(self, path: Path, kind: str):
        self.path, self.kind = path, kind
        self.magic, self.version, self.dt = FORMATS[kind]
        self.tmp = path.with_name(path.name + ".tmp")
        self.f = open(self.tmp, "wb")
        self.f.write(np.zeros(HEADER_INTS, "<i4").tobytes())
        self.n = 0

    def write(self, ids: np.ndarray):
        self.f.write(ids.astype(self.dt).tobytes())
        self.n += ids.size

    def close(self):
        header = np.zeros(HEADER_INTS, "<i4")
        header[:3] = (self.magic, self.version, self.n)
        self.f.seek(0)
        self.f.write(header.tobytes())
        self.f.close()
        os.replace(self.tmp, self.path)


def prepare(tokenizer, inputs, out, *, val_fraction=0.005, eos=True, workers=None, chunk_mb=1.0, progress=True,
            fast=True):
    """Tokenize ``inputs`` into ``out/train.bin`` and ``out/val.bin``; returns the summary written to
    ``out/prepare.json``. ``fast=False`` encodes with the tokenizers package even where the FastEncoder applies
    (the same ids, 3-7x slower)."""
    from . import _backend as B
    from .tokenizer import Tokenizer

    B.check_real("val_fraction", val_fraction, min=0, max=1, max_open=True)
    B.check_real("chunk_mb", chunk_mb, min=0, min_open=True)
    workers = B.check_int("workers", workers if workers is not None else (os.cpu_count() or 1), min=1)
    fast = B.check_bool("fast", fast)
    if not isinstance(tokenizer, (str, Path)):
        raise TypeError(f"tokenizer: expected a tokenizer folder; got {type(tokenizer).__name__}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("inputs: give at least one text or .jsonl file")
    for p in paths:
        if not p.is_file():
            raise ValueError(f"inputs: {str(p)!r} is not a file")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_pretrained(tokenizer)
    kind = "gpt2" if tok.vocab_size <= 65536 else "llama3"
    if not hasattr(tok, "_tok"):
        raise ValueError(f"tokenizer: {str(tokenizer)!r} has no tokenizer.json (byte-level text runs need no "
                         f"preparation: data.kind: text reads the text file itself)")
    pre, post = specials_around(tok)
    tail = post + ([tok.eos_token_id] if eos and tok.eos_token_id is not None else [])
    total = sum(p.stat().st_size for p in paths)
    val_from = total - int(total * val_fraction) if val_fraction > 0 else total + 1
    split = chunkable(tok)
    chunk_bytes = max(1, int(chunk_mb * 2**20)) if split else 1 << 62
    avoid = spaced_added_tokens(tok)
    # this process's encoder, which forked workers inherit; it says once why there is no fast path
    _worker_init(str(tokenizer), fast, tok)
    encoder = "tokenizers" if _TOK["fast"] is None else "FastEncoder"
    if progress and fast and _TOK["fast"] is None:
        print(f"prepare: no fast path ({_TOK['why']}): encoding with the tokenizers package", file=sys.stderr)
    t0, seen, shown = time.time(), 0, 0.0

    read = [0]

    def until():
        return val_from - read[0] if read[0] < val_from else None

    def jobs():
        for p in paths:
            for job in iter_documents(p, chunk_bytes, until, avoid):
                read[0] += job[3]
                yield job

    def take():  # a worker call: 4 MB of text, or 1024 documents (2 calls in flight a worker)
        group, size = [], 0
        for j in it:
            group.append(j)
            size += j[3]
            if len(group) >= 1024 or size >= 4 << 20:
                break
        return group

    files = {"train": _Out(out / "train.bin", kind), "val": _Out(out / "val.bin", kind)}
    ex = None if workers == 1 else ProcessPoolExecutor(workers, initializer=_worker_init,
                                                       initargs=(str(tokenizer), fast))
    try:
        pending = []
        it = jobs()
        done = False
        while not done or pending:
            while not done and len(pending) < 2 * workers:
                group = take()
                if not group:
                    done = True
                    break
                texts = [g[2] for g in group]
                fut = ex.submit(_encode, texts, split) if ex is not None else _encode(texts, split)
                pending.append((group, fut))
            if not pending:
                break
            group, fut = pending.pop(0)
            encoded = fut.result() if ex is not None else fut
            for (start, end, _, nbytes), ids in zip(group, encoded):
                dest = files["val" if seen >= val_from else "train"]
                if start and pre:
                    dest.write(np.asarray(pre, np.int64))
                dest.write(ids)
                if end and tail:
                    dest.write(np.asarray(tail, np.int64))
                seen += nbytes
            if progress and time.time() - shown > 0.5:
                shown = time.time()
                mb = seen / 2**20
                print(f"\rprepare: {mb:8.1f} / {total / 2**20:.1f} MB  {mb / max(1e-9, shown - t0):6.1f} MB/s",
                      end="", file=sys.stderr, flush=True)
    finally:
        if ex is not None:
            ex.shutdown()
        _TOK.clear()  # the caches (tens of MB) go with the call
        for f in files.values():
            f.close()
    secs = time.time() - t0
    if progress:
        print(f"\rprepare: {seen / 2**20:.1f} MB in {secs:.1f} s ({seen / 2**20 / max(secs, 1e-9):.1f} MB/s)"
              f"{' ' * 20}", file=sys.stderr)
    summary = {"tokenizer": str(tokenizer), "vocab_size": tok.vocab_size, "kind": kind,
               "inputs": [str(p) for p in paths], "bytes": seen, "train_tokens": files["train"].n,
               "val_tokens": files["val"].n, "eos": bool(eos), "encoder": encoder, "chunked": split,
               "seconds": round(secs, 2)}
    (out / "prepare.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def prepare_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cukernels.data prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face folder with tokenizer.json")
    ap.add_argument("inputs", nargs="+", help="text files (one document each) or .jsonl files ({'text': ...} a line)")
    ap.add_argument("--out", required=True, help="output folder (train.bin, val.bin, prepare.json)")
    ap.add_argument("--val-fraction", type=float, default=0.005, help="share of the input bytes for val.bin")
    ap.add_argument("--no-eos", action="store_true", help="no EOS token after each document")
    ap.add_argument("--workers", type=int, default=None, help="encoding processes (default: the CPU count)")
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="text read at a time (MB)")
    ap.add_argument("--no-fast", action="store_true", help="encode with the tokenizers package (same ids, slower)")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)
    try:
        s = prepare(a.tokenizer, a.inputs, a.out, val_fraction=a.val_fraction, eos=not a.no_eos, workers=a.workers,
                    chunk_mb=a.chunk_mb, progress=not a.quiet, fast=not a.no_fast)
    except (TypeError, ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: {s['train_tokens']:,} train + {s['val_tokens']:,} val tokens ({s['kind']} format)")
    return 0


def main(argv=None) -> int:
    """``python -m cukernels.data prepare ...`` (the only command)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] != "prepare":
        print("usage: python -m cukernels.data prepare --tokenizer FOLDER INPUT... --out DIR   (--help for more)",
              file=sys.stderr)
        return 2
    return prepare_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
