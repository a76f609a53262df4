"""Training data: a byte-level tokenizer, the tinyshakespeare split, llm.c token files, and the samplers (a
sequential cursor, seeded random windows), each taking its rank's rows of a global batch under data parallelism.

llm.c token files (the format the seed trained on): a header of 256 int32 (1024 bytes) -- ``[0]`` magic,
``[1]`` version, ``[2]`` token count, the rest zero -- followed by the tokens:

* magic 20240520, version 1: uint16 tokens (GPT-2 vocabulary),
* magic 20240801, version 7: uint32 tokens (LLaMA-3 vocabulary).
"""
from __future__ import annotations

import os

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {  # kind -> (magic, version, token dtype)
    "gpt2": (20240520, 1, np.dtype("<u2")),
    "llama3": (20240801, 7, np.dtype("<u4")),
}
_BY_MAGIC = {m: (k, v, d) for k, (m, v, d) in FORMATS.items()}

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data",
                            "tinyshakespeare.txt")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab_size 256, lossless for any text."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = ids.get() if hasattr(ids, "get") else np.asarray(ids)
        return bytes(np.asarray(ids, dtype=np.int64).astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def load_text_tokens(path=None, val_fraction=0.1):
    """Byte tokens of a text file (tinyshakespeare by default) split into (train, val): the last
    ``val_fraction`` of the file is the held-out split. Returns two uint8 arrays."""
    path = path or DEFAULT_TEXT
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
