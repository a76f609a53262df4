"""Tokenizers: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` package, or the byte tokenizer of the
trainer's text runs, behind one interface.

    tok = ck.Tokenizer.from_pretrained("path/to/Llama-3.2-1B")   # tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode("Hello")                                   # the ids transformers' AutoTokenizer gives
    tok.decode(ids), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size

``encode`` applies the tokenizer's post-processor (the special tokens it adds, e.g. Llama-3's ``<|begin_of_text|>``),
as ``AutoTokenizer(text)["input_ids"]`` does for a fast tokenizer; ``add_special_tokens=False`` leaves them out.
The special-token ids come from ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``: a string or
an added-token dict), else from ``config.json``'s ids. ``ByteTokenizer`` is UTF-8 bytes, ids 0..255 (the vocabulary
of ``data.kind: text`` runs). ``TextStream`` turns ids sampled one at a time into text as it becomes printable.

``tokenizers`` is an optional dependency (``pip install 'cukernels[tokenizers]'``); only ``from_pretrained`` on a
``tokenizer.json`` needs it.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import _backend as B

__all__ = ["Tokenizer", "ByteTokenizer", "TextStream"]


def _ids(name, ids) -> list[int]:
    """A sequence of non-negative ints (a list, a tuple or a 1-D integer array) as a list."""
    if hasattr(ids, "tolist") and getattr(ids, "dtype", None) is not None:
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise TypeError(f"{name}: expected a 1-D array of integer token ids; got {ids.dtype} of shape {ids.shape}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of integer token ids; got {type(ids).__name__}")
    out = [B.check_int(f"{name}[{i}]", v, min=0) for i, v in enumerate(ids)]
    return out


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: the tokenizer of the trainer's ``data.kind: text`` runs (vocab_size 256). No
    special tokens (``bos_token_id`` and the others are None)."""

    vocab_size = 256
    bos_token_id = eos_token_id = pad_token_id = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        B.check_str("text", text)
        B.check_bool("add_special_tokens", add_special_tokens)
        return list(text.encode("utf-8"))

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """Bytes that are not valid UTF-8 (a character cut in half) become U+FFFD, as ``bytes.decode`` with
        ``errors="replace"`` does."""
        ids = _ids("ids", ids)
        bad = next((i for i in ids if i > 255), None)
        if bad is not None:
            raise ValueError(f"ids: byte tokens are 0..255; got {bad}")
        return bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self):
        return "ByteTokenizer(vocab_size=256)"


class Tokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``), read through the ``tokenizers`` package."""

    def __init__(self, backend, *, bos_token=None, eos_token=None, pad_token=None, path=None):
        self._tok = backend
        self.path = path
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._special_id("bos_token", bos_token)
        self.eos_token_id = self._special_id("eos_token", eos_token)
        self.pad_token_id = self._special_id("pad_token", pad_token)

    def _special_id(self, name, token):
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{name}: {token!r} is not in the tokenizer's vocabulary ({self.path})")
        return int(i)

    @classmethod
    def from_pretrained(cls, folder) -> "Tokenizer | ByteTokenizer":
        """The tokenizer of a Hugging Face folder (``tokenizer.json``, and ``tokenizer_config.json`` /
        ``config.json`` for the special tokens). A folder without ``tokenizer.json`` whose ``config.json`` says
        ``vocab_size: 256`` (a model from the trainer's text runs) gets the :class:`ByteTokenizer`."""
        if not isinstance(folder, (str, Path)):
            raise TypeError(f"folder: expected a path to a folder; got {type(folder).__name__}")
        root = Path(folder)
        if root.is_file() and root.name == "tokenizer.json":
            root = root.parent
        if not root.is_dir():
            raise ValueError(f"folder: {str(root)!r} is not a folder")
        cfg = _read_json(root / "config.json")
        tj = root / "tokenizer.json"
        if not tj.is_file():
            if cfg.get("vocab_size") == 256:
                return ByteTokenizer()
            raise ValueError(f"folder: {str(root)!r} has no tokenizer.json (only fast tokenizers are supported: save "
                             f"one with transformers' tokenizer.save_pretrained, or use a 256-token byte model)")
        try:
            import tokenizers
        except ImportError:
            raise ImportError("reading tokenizer.json needs the tokenizers package: pip install tokenizers "
                              "(or pip install 'cukernels[tokenizers]')") from None
        try:
            backend = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the package's own error types vary across versions
            raise ValueError(f"folder: {str(tj)!r} is not a valid tokenizer.json: {str(e).splitlines()[0]}") from None
        tc = _read_json(root / "tokenizer_config.json")
        special = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            v = tc.get(key)
            if isinstance(v, dict):  # an AddedToken written out: {"content": "<s>", ...}
                v = v.get("content")
            if v is None and cfg.get(f"{key}_id") is not None and isinstance(cfg[f"{key}_id"], int):
                v = backend.id_to_token(cfg[f"{key}_id"])
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{root / 'tokenizer_config.json'}: {key} must be a string; got {v!r}")
            special[key] = v
        return cls(backend, path=str(root), **special)

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added tokens included (``len(AutoTokenizer)``)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` those the post-processor adds."""
        B.check_str("text", text)
        B.check_bool("add_special_tokens", add_special_tokens)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts, *, add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, in the package's threads (the data preparation's fast path)."""
        if isinstance(texts, str) or not hasattr(texts, "__iter__"):
            raise TypeError(f"texts: expected a list of strings; got {type(texts).__name__}")
        texts = [B.check_str(f"texts[{i}]", t) for i, t in enumerate(texts)]
        B.check_bool("add_special_tokens", add_special_tokens)
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        ids = _ids("ids", ids)
        n = self.vocab_size
        bad = next((i for i in ids if i >= n), None)
        if bad is not None:
            raise ValueError(f"ids: token ids must be < vocab_size={n}; got {bad}")
        return self._tok.decode(ids, skip_special_tokens=B.check_bool("skip_special_tokens", skip_special_tokens))

    def token_to_id(self, token: str):
        return self._tok.token_to_id(B.check_str("token", token))

    def __repr__(self):
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


class TextStream:
    """Text of ids that arrive one at a time (sampling): ``push(id)`` returns the text that became printable.

    A token can end in the middle of a UTF-8 character (byte-level BPE, the byte tokenizer), so the text of the ids
    so far is decoded again on each push and only what no longer ends in a replacement character is released;
    ``flush()`` returns what is left at the end.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        if not hasattr(tokenizer, "decode"):
            raise TypeError(f"tokenizer: expected a Tokenizer or ByteTokenizer; got {type(tokenizer).__name__}")
        self.tok = tokenizer
        self.skip = B.check_bool("skip_special_tokens", skip_special_tokens)
        self.ids: list[int] = []
        self.sent = 0  # characters already returned

    def push(self, token_id) -> str:
        self.ids.append(B.check_int("token_id", token_id, min=0))
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):  # an unfinished character: wait for its next bytes
            return ""
        out, self.sent = text[self.sent:], len(text)
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        out, self.sent = text[self.sent:], len(text)
        return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object; got {type(data).__name__}")
    return data
