"""Text to llm.c token files, streaming: ``python -m cukernels.data prepare --tokenizer FOLDER INPUT... --out DIR``.

Each input is a document: a text file, or a ``.jsonl`` file whose lines are JSON objects with a ``"text"`` field (one
document a line). A document becomes the tokens the tokenizer's post-processor puts around a text (Llama-3's BOS,
say) around the tokens of its text, then the EOS token (``--no-eos`` leaves it out). Large files are read in chunks
of about ``--chunk-mb`` that end after a newline followed by a non-space character -- a boundary the byte-level
pre-tokenizers (GPT-2's and Llama-3's patterns) never cross -- so the ids equal those of encoding the whole document
at once, and memory stays bounded whatever the input size. Chunks are encoded by ``--workers`` processes.

Output: ``DIR/train.bin`` and ``DIR/val.bin`` in llm.c's format (``cukernels.data``: uint16 tokens when the
vocabulary fits, else the uint32 LLaMA-3 format), the last ``--val-fraction`` of the input bytes going to val
(at least one chunk), and ``DIR/prepare.json`` (tokenizer, inputs, token counts). The trainer reads them with
``data: {kind: llmc, path: DIR/train.bin, val_path: DIR/val.bin}``.
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

from . import data as D

_TOK = {}


def _worker_init(folder):
    from .tokenizer import Tokenizer

    _TOK["t"] = Tokenizer.from_pretrained(folder)


PIECE = 16384  # characters: tokenizers encodes a batch of pieces in parallel threads, a 1 MB string in one


def _pieces(text: str) -> list[str]:
    """``text`` cut into pieces of about PIECE characters at safe boundaries (see ``_split_point``)."""
    out, i = [], 0
    while len(text) - i > 2 * PIECE:
        cut = _split_point(text[i:i + PIECE])
        if cut == 0:
            cut = _split_point(text[i:i + 2 * PIECE]) or len(text) - i
        out.append(text[i:i + cut])
        i += cut
    out.append(text[i:])
    return out


def _encode(texts, split=True):
    t = _TOK["t"]
    pieces, owner = [], []
    for k, text in enumerate(texts):
        for p in (_pieces(text) if split else [text]):
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
    """Whether a document may be encoded in pieces cut after a newline: not for tokenizers that mark the start of
    a text (SentencePiece's Metaspace with a prepend scheme, a Prepend normalizer: Llama-2, Mistral), which would
    mark every piece."""
    spec = json.dumps(json.loads(tok._tok.to_str()).get("pre_tokenizer")) + json.dumps(
        json.loads(tok._tok.to_str()).get("normalizer"))
    return "Metaspace" not in spec and "Prepend" not in spec


def _split_point(buf: str) -> int:
    """The last index i with buf[i-1] == '\\n' and buf[i] not whitespace (0 when there is none)."""
    i = len(buf) - 1
    while i > 0:
        j = buf.rfind("\n", 0, i)
        if j < 0:
            return 0
        if j + 1 < len(buf) and not buf[j + 1].isspace():
            return j + 1
        i = j
    return 0


def _first_split_after(buf: str, k: int) -> int:
    """The first index i >= k with buf[i-1] == '\n' and buf[i] not whitespace (0 when there is none)."""
    j = buf.find("\n", max(0, k - 1))
    while 0 <= j < len(buf) - 1:
        if not buf[j + 1].isspace():
            return j + 1
        j = buf.find("\n", j + 1)
    return 0


def iter_documents(path: Path, chunk_bytes: int, until=None):
    """Yield (document start?, document end?, text chunk, bytes read) for one input file. ``until()``: how many
    more bytes may be read before the val split begins (reads stop short of it, so a chunk does not straddle it)."""
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
                cut = _split_point(carry[:left + 1]) or _first_split_after(carry, left)
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
            cut = _split_point(buf)
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
        self.magic, self.version, self.dt = D.FORMATS[kind]
        self.tmp = path.with_name(path.name + ".tmp")
        self.f = open(self.tmp, "wb")
        self.f.write(np.zeros(D.HEADER_INTS, "<i4").tobytes())
        self.n = 0

    def write(self, ids: np.ndarray):
        self.f.write(ids.astype(self.dt).tobytes())
        self.n += ids.size

    def close(self):
        header = np.zeros(D.HEADER_INTS, "<i4")
        header[:3] = (self.magic, self.version, self.n)
        self.f.seek(0)
        self.f.write(header.tobytes())
        self.f.close()
        os.replace(self.tmp, self.path)


def prepare(tokenizer, inputs, out, *, val_fraction=0.005, eos=True, workers=None, chunk_mb=1.0, progress=True):
    """Tokenize ``inputs`` into ``out/train.bin`` and ``out/val.bin``; returns the summary written to
    ``out/prepare.json``."""
    from . import _backend as B
    from .tokenizer import Tokenizer

    B.check_real("val_fraction", val_fraction, min=0, max=1, max_open=True)
    B.check_real("chunk_mb", chunk_mb, min=0, min_open=True)
    workers = B.check_int("workers", workers if workers is not None else (os.cpu_count() or 1), min=1)
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
    files = {"train": _Out(out / "train.bin", kind), "val": _Out(out / "val.bin", kind)}
    split = chunkable(tok)
    chunk_bytes = max(1, int(chunk_mb * 2**20)) if split else 1 << 62
    t0, seen, shown = time.time(), 0, 0.0

    read = [0]

    def until():
        return val_from - read[0] if read[0] < val_from else None

    def jobs():
        for p in paths:
            for job in iter_documents(p, chunk_bytes, until):
                read[0] += job[3]
                yield job

    batch = 64  # chunks a worker call: a few MB of text in flight a worker
    ex = ProcessPoolExecutor(workers, initializer=_worker_init, initargs=(str(tokenizer),)) if workers > 1 else None
    if ex is None:
        _worker_init(str(tokenizer))
    try:
        pending = []
        it = jobs()
        done = False
        while not done or pending:
            while not done and len(pending) < 2 * workers:
                group = [j for _, j in zip(range(batch), it)]
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
        for f in files.values():
            f.close()
    secs = time.time() - t0
    if progress:
        print(f"\rprepare: {seen / 2**20:.1f} MB in {secs:.1f} s ({seen / 2**20 / max(secs, 1e-9):.1f} MB/s)"
              f"{' ' * 20}", file=sys.stderr)
    summary = {"tokenizer": str(tokenizer), "vocab_size": tok.vocab_size, "kind": kind, "inputs": [str(p) for p in paths],
               "bytes": seen, "train_tokens": files["train"].n, "val_tokens": files["val"].n, "eos": bool(eos),
               "seconds": round(secs, 2)}
    (out / "prepare.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cukernels.data prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face folder with tokenizer.json")
    ap.add_argument("inputs", nargs="+", help="text files (one document each) or .jsonl files ({'text': ...} a line)")
    ap.add_argument("--out", required=True, help="output folder (train.bin, val.bin, prepare.json)")
    ap.add_argument("--val-fraction", type=float, default=0.005, help="share of the input bytes for val.bin")
    ap.add_argument("--no-eos", action="store_true", help="no EOS token after each document")
    ap.add_argument("--workers", type=int, default=None, help="encoding processes (default: the CPU count)")
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="text read at a time (MB)")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)
    try:
        s = prepare(a.tokenizer, a.inputs, a.out, val_fraction=a.val_fraction, eos=not a.no_eos, workers=a.workers,
                    chunk_mb=a.chunk_mb, progress=not a.quiet)
    except (TypeError, ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: {s['train_tokens']:,} train + {s['val_tokens']:,} val tokens ({s['kind']} format)")
    return 0
