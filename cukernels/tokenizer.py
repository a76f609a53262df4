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
``tokenizer.json`` needs it. :class:`FastEncoder` (the data preparation's encoder) also needs ``regex``.
"""
from __future__ import annotations

import json
import re
import sys
import unicodedata
from array import array
from pathlib import Path

import numpy as np

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


# ------------------------------------------------------------------------------------------------ the fast encoder
# tokenizers' own encode runs at 1-3 MB/s of text a core on the 2-core CPU machine (`python
# benchmarks/bench_prepare.py`): most of it is bookkeeping per character (offsets, alignments), not BPE. The
# FastEncoder reproduces the pipeline in front of the model (added tokens, normalizer, the pre-tokenizer's regex,
# the byte-level map) with C-speed str/re/dict operations and asks the tokenizer's own BPE model only for pre-tokens
# it has not seen, so its ids are the tokenizer's wherever the pre-tokenization is reproduced exactly.

# GPT-2's pre-tokenizer pattern (tokenizers' ByteLevel with use_regex, its src/pre_tokenizers/byte_level.rs)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Patterns known to tile the text with matches none of which holds a non-space character followed by " ": in them a
# " " between two non-space characters always starts a pre-token and no match looks past it (lookaheads read one
# character, and " " and the end of a string look the same to them), so a text may be cut there and the pieces
# pre-tokenized apart -- the ASCII stretches of a text by Python's re, the rest by the regex package. Listed by hand
# (GPT-2; Llama-3 / cl100k; Qwen2, digits one by one; GPT-4o / o200k), each checked against tokenizers in
# tests/test_tokenizer.py; any other Split pattern goes through the regex package whole.
SPACE_SAFE_PATTERNS = frozenset((
    GPT2_PATTERN,
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_WS = r"\t\n\x0b\x0c\r "  # what onig's \s matches among ASCII characters (Unicode White_Space)
# The classes of those patterns over ASCII text, for Python's re (2x the regex package's speed on them; the contractions
# with their apostrophe first and no IGNORECASE, 5-10 % faster): applied to ASCII text only (tests/test_tokenizer.py
# checks them against the Unicode patterns and tokenizers).
_ASCII_CLASSES = ((r"(?i:'s|'t|'re|'ve|'m|'ll|'d)", r"(?:'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))"),
                  (r"'s|'t|'re|'ve|'m|'ll|'d|", r"'(?:s|t|re|ve|m|ll|d)|"),
                  (r"[^\s\p{L}\p{N}]", f"[^{_WS}A-Za-z0-9]"), (r"[^\r\n\p{L}\p{N}]", r"[^\r\nA-Za-z0-9]"),
                  (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", "[A-Z]"), (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", "[a-z]"),
                  (r"\p{L}", "[A-Za-z]"), (r"\p{N}", "[0-9]"), (r"(?!\S)", f"(?![^{_WS}])"), (r"\s", f"[{_WS}]"))


def _ascii_pattern(pattern: str):
    """``pattern`` for ASCII-only text, compiled with Python's re; None when it uses a class not translated."""
    for u, a in _ASCII_CLASSES:
        pattern = pattern.replace(u, a)
    return None if "\\p" in pattern or "\\S" in pattern or "\\s" in pattern else re.compile(pattern, re.ASCII)


_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
# A text the constructor encodes both ways; any difference turns the fast path off (its last line of defence).
_PROBE = ("First Citizen:\nBefore we proceed, hear me speak.\r\n\r\nYou're   I'M we'Ve HE'LL it'S 'ſ 't\t\t end \n"
          "  indented\n\n\n x  \n y12345 6789012 3.14159 ½ ² ٣٤٥ 一二三 中文字符 日本語のテキスト 한국어 Ελληνικά русский "
          "עברית العربية हिन्दी ไทย e\u0301 A\u030a \u212b ﬁ Ⅻ ｆｕｌｌ \u00a0nbsp\u2003em\u3000ideo \u200bzw "
          "🙂👍🏽 👨‍👩‍👧 🇫🇷 ✓ — “quoted” ‘single’ «guillemets» … \x00\x1c\x1f\x7f\x85 ##$$%% ((())) ....!!!???"
          " https://example.com/a?b=c&d=e#f foo_bar fooBar FOO_BAR x=1;y=2 ' '' ''' \"\"\"\n" + "w" * 300 + " end")

_BYTE_CHARS = None


def _byte_chars() -> str:
    """The 256 characters byte-level BPE writes bytes 0..255 as (GPT-2's ``bytes_to_unicode``)."""
    global _BYTE_CHARS
    if _BYTE_CHARS is None:
        keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
        table, n = {}, 0
        for b in range(256):
            if b in keep:
                table[b] = chr(b)
            else:
                table[b] = chr(256 + n)
                n += 1
        _BYTE_CHARS = "".join(table[b] for b in range(256))
    return _BYTE_CHARS


_SUSPECT = None


def _suspect_chars():
    """A pattern for characters the fast path cannot vouch for: those unassigned in this Python's Unicode database
    (a newer character may be a letter to tokenizers' regex engine and normalize differently in Rust) -- every
    astral character is matched and checked one at a time (a class of the astral gaps is ~200x slower to search)."""
    global _SUSPECT
    if _SUSPECT is None:
        cat, ranges = unicodedata.category, []
        for c in range(0x10000):
            if cat(chr(c)) in ("Cn", "Cs"):
                if ranges and ranges[-1][1] == c - 1:
                    ranges[-1][1] = c
                else:
                    ranges.append([c, c])
        _SUSPECT = re.compile("[" + "".join(f"\\u{a:04x}-\\u{b:04x}" for a, b in ranges) + "\\U00010000-\\U0010ffff]")
    return _SUSPECT


def pipeline(backend) -> dict:
    """The parts of a ``tokenizers.Tokenizer``'s JSON that say how it cuts text: ``normalizer``, ``pre_tokenizer``
    (each its JSON object, or None), ``added_tokens`` (content, id and flags, as in tokenizer.json) and ``model``
    (type, dropout) -- read without serializing the vocabulary (10 MB for Llama-3's, a second to parse)."""
    def part(obj, key):
        if obj is None:
            return None
        try:
            return json.loads(obj.__getstate__())
        except (AttributeError, TypeError, ValueError):  # an older tokenizers: the whole JSON
            return json.loads(backend.to_str()).get(key)

    added = [{"id": int(i), "content": t.content, "special": t.special, "normalized": t.normalized,
              "lstrip": t.lstrip, "rstrip": t.rstrip, "single_word": t.single_word}
             for i, t in sorted(backend.get_added_tokens_decoder().items())]
    return {"normalizer": part(backend.normalizer, "normalizer"),
            "pre_tokenizer": part(backend.pre_tokenizer, "pre_tokenizer"), "added_tokens": added,
            "model": {"type": type(backend.model).__name__, "dropout": getattr(backend.model, "dropout", None)}}


def _fast_path_config(conf: dict, backend) -> tuple:
    """(normalization forms, pre-tokenizer pattern) of a pipeline (``pipeline``) the fast path reproduces;
    ValueError saying why not otherwise."""
    model = conf.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"the model is {model.get('type')!r}, not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise ValueError("BPE dropout is random")
    norm = conf.get("normalizer")
    norms = [] if norm is None else norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    forms = []
    for n in norms:
        if not isinstance(n, dict) or n.get("type") not in _FORMS:
            raise ValueError(f"normalizer {n.get('type') if isinstance(n, dict) else n!r} (only {'/'.join(_FORMS)})")
        forms.append(n["type"])
    pre = conf.get("pre_tokenizer") or {}
    seq = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    types = [p.get("type") for p in seq]
    if types == ["ByteLevel"] and seq[0].get("use_regex", True):
        bl, pattern = seq[0], GPT2_PATTERN
    elif (types == ["Split", "ByteLevel"] and not seq[1].get("use_regex", True)
          and isinstance(seq[0].get("pattern"), dict) and "Regex" in seq[0]["pattern"]
          and seq[0].get("behavior") == "Isolated" and not seq[0].get("invert")):
        bl, pattern = seq[1], seq[0]["pattern"]["Regex"]
    else:
        raise ValueError(f"pre-tokenizer {types} (only ByteLevel, or Split(regex) then ByteLevel)")
    if bl.get("add_prefix_space"):
        raise ValueError("ByteLevel add_prefix_space")
    for t in conf.get("added_tokens") or []:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            raise ValueError(f"added token {t.get('content')!r} has lstrip/rstrip/single_word")
    if getattr(backend, "encode_special_tokens", False):
        raise ValueError("encode_special_tokens is on")
    return tuple(forms), pattern


class FastEncoder:
    """``tokenizer.encode(text, add_special_tokens=False)`` as a uint32 array, exactly and 3-7x faster, for
    byte-level BPE tokenizers (GPT-2's ``ByteLevel``; Llama-3's and Qwen2's ``Sequence[Split(regex), ByteLevel]``;
    no normalizer, or NFC and the other Unicode forms): the data preparation's encoder.

    The steps tokenizers takes, each reproduced: the added tokens (specials) are cut out first -- those matched on
    the raw text, then, after normalization, those matched on the normalized text, leftmost-longest as its
    Aho-Corasick matcher does; each piece between them is normalized (``unicodedata``) and cut into pre-tokens by the
    tokenizer's own pattern (the ``regex`` package: ``\\p{L}``, possessive and atomic groups; for the patterns of
    ``SPACE_SAFE_PATTERNS``, Python's ``re`` with ASCII classes on the ASCII stretches, twice as fast); each
    pre-token's bytes go through the byte-level map and the tokenizer's own BPE model (``model.tokenize``) the first
    time it is met, and a dict keeps its ids. Once warm, one core of the 2-core CPU machine takes ~80 ms a MB of
    tinyshakespeare-like text, ~125 of code, ~145 of mixed prose and code (``python benchmarks/bench_prepare.py``;
    ``benchmarks/NOTES.md``, "Data preparation").

    It cannot vouch for characters this Python's Unicode database does not know (a letter newer than it): a piece
    that holds one is encoded by tokenizers. The cache is emptied when it reaches ``max_entries`` (bounded memory,
    ~150 bytes an entry). The constructor raises ValueError saying why when the tokenizer's pipeline is not one it
    reproduces, or when it disagrees with tokenizers on a probe text; callers fall back to ``encode_batch``.

    Args:
        tokenizer: a :class:`Tokenizer` (a ``tokenizer.json``).
        max_entries: the number of pre-tokens at which the cache is emptied.

    Example::

        enc = FastEncoder(ck.Tokenizer.from_pretrained("Llama-3.2-1B"))
        ids = enc.encode(text)   # == tok.encode(text, add_special_tokens=False), as np.uint32
    """

    def __init__(self, tokenizer, *, max_entries: int = 1 << 19):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer: expected a Tokenizer (a tokenizer.json); got {type(tokenizer).__name__}")
        self.max_entries = B.check_int("max_entries", max_entries, min=1)
        try:
            import regex
        except ImportError:
            raise ValueError("the fast path needs the regex package (pip install regex)") from None
        conf = pipeline(tokenizer._tok)
        self.forms, pattern = _fast_path_config(conf, tokenizer._tok)
        self._backend, self._copy = tokenizer._tok, None
        self._model = tokenizer._tok.model
        try:  # tokenizers' onig regexes use Ruby syntax, where ^ and $ match at line ends
            self._pat = regex.compile(pattern, regex.MULTILINE | regex.V0)
        except regex.error as e:
            raise ValueError(f"the pre-tokenizer pattern does not compile with the regex package ({e})") from None
        self.space_safe = pattern in SPACE_SAFE_PATTERNS  # (these also tile the text: no gaps to look for)
        self._ascii = _ascii_pattern(pattern) if self.space_safe else None
        raw, normed = {}, {}
        for t in conf.get("added_tokens") or []:
            if not t["content"]:
                continue
            if t.get("normalized") and self.forms:
                normed[self._normalize(t["content"])] = t["id"]
            else:
                (normed if t.get("normalized") else raw)[t["content"]] = t["id"]
        self._raw, self._normed = raw, normed
        self._raw_split = self._splitter(raw)
        self._normed_split = self._splitter(normed)
        self._bytes = str.maketrans(dict(enumerate(_byte_chars())))
        self._words: dict = {}  # pre-token -> its ids (uint32 bytes)
        self._good: set = set()  # astral characters known to be assigned
        self.misses = 0  # pre-tokens sent to the BPE model
        got = self.encode(_PROBE).tolist()
        if got != self._tokenizers_encode(_PROBE):
            raise ValueError("the fast path disagrees with tokenizers on a probe text")

    def _tokenizers_encode(self, text: str) -> list[int]:
        """The tokenizers package's ids of ``text``, never truncated or padded (a private copy when the tokenizer
        would: made the first time it is needed, as it serializes the whole vocabulary)."""
        tok = self._backend
        if tok.truncation is not None or tok.padding is not None:
            if self._copy is None:
                import tokenizers

                self._copy = tokenizers.Tokenizer.from_str(tok.to_str())
                self._copy.no_truncation()
                self._copy.no_padding()
            tok = self._copy
        return tok.encode(text, add_special_tokens=False).ids

    @staticmethod
    def _splitter(tokens):
        # a regex alternation of literals, longest first, finds the leftmost-longest match as Aho-Corasick does
        if not tokens:
            return None
        return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")").split

    def _normalize(self, s: str) -> str:
        for f in self.forms:
            s = unicodedata.normalize(f, s)
        return s

    def _suspect(self, s: str) -> bool:
        """Whether ``s`` holds a character this Python's Unicode database does not know."""
        if s.isascii():
            return False
        search, i = _suspect_chars().search, 0
        while True:
            m = search(s, i)
            if m is None:
                return False
            c = m.group()
            if c not in self._good:
                if unicodedata.category(c) in ("Cn", "Cs"):
                    return True
                self._good.add(c)
            i = m.end()

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text`` (no post-processor tokens) as a uint32 array."""
        B.check_str("text", text)
        out = []
        pieces = self._raw_split(text) if self._raw_split else [text]
        for k, piece in enumerate(pieces):
            if k % 2:
                out.append(_pack((self._raw[piece],)))
            elif piece:
                if self._suspect(piece):
                    out.append(_pack(self._tokenizers_encode(piece)))
                    continue
                if self.forms and not piece.isascii():
                    piece = self._normalize(piece)
                sub = self._normed_split(piece) if self._normed_split else [piece]
                for j, s in enumerate(sub):
                    if j % 2:
                        out.append(_pack((self._normed[s],)))
                    elif s:
                        out.append(self._encode_words(s))
        return np.frombuffer(bytearray().join(out), dtype="<u4")

    def _pretokens(self, s: str) -> list[str]:
        """The pre-tokens of a normalized piece without added tokens, by the tokenizer's pattern."""
        if self._ascii is not None:
            if s.isascii():
                return self._ascii.findall(s)
            return self._mostly_ascii(s)
        words = self._pat.findall(s)
        if not self.space_safe and sum(map(len, words)) != len(s):  # gaps: tokenizers keeps them as pre-tokens too
            words, i = [], 0
            for m in self._pat.finditer(s):
                if m.start() > i:
                    words.append(s[i:m.start()])
                if m.end() > m.start():
                    words.append(m.group())
                i = m.end()
            if i < len(s):
                words.append(s[i:])
        return words

    def _mostly_ascii(self, s: str) -> list[str]:
        """``_pretokens`` of a text with some non-ASCII characters: each run of them, widened to the " " boundaries
        around it (``SPACE_SAFE_PATTERNS``), goes through the Unicode pattern, the ASCII stretches between through the
        ASCII one; a text with a run every 2000 characters or more goes through the Unicode pattern whole."""
        out, i, budget = [], 0, len(s) // 2000 + 1
        for m in _NON_ASCII.finditer(s):
            a, b = m.span()
            if a < i:
                continue
            budget -= 1
            if budget < 0:
                break
            a = s.rfind(" ", i, a)
            while a > i and (s[a - 1].isspace() or s[a + 1].isspace()):
                a = s.rfind(" ", i, a)
            a = max(a, i)
            b = s.find(" ", b)
            while b > 0 and (s[b - 1].isspace() or b + 1 == len(s) or s[b + 1].isspace()):
                b = s.find(" ", b + 1)
            b = len(s) if b < 0 else b
            # (slices: an ASCII slice is a 1-byte string, which re scans faster than the 4-byte one it came from)
            if a > i:
                out += self._ascii.findall(s[i:a])
            out += self._pat.findall(s[a:b])
            i = b
        else:
            if i < len(s):
                out += self._ascii.findall(s[i:])
            return out
        return out + self._pat.findall(s[i:])

    def _word_ids(self, words: list[str]) -> list[bytes]:
        """The ids of each pre-token (uint32 bytes), from the cache or, the first time, the BPE model."""
        cache = self._words
        vals = list(map(cache.get, words))
        if None in vals:  # (only the empty slots are visited: ~0.5 us each, ~40k a MB of mixed text at first)
            k = -1
            try:
                while True:
                    k = vals.index(None, k + 1)
                    w = words[k]
                    v = cache.get(w)
                    if v is None:
                        v = self._bpe(w)
                        if len(cache) >= self.max_entries:
                            cache.clear()
                        cache[w] = v
                    vals[k] = v
            except ValueError:
                pass
        return vals

    def _bpe(self, word: str) -> bytes:
        """The ids of a pre-token by the tokenizer's BPE model, its bytes written as byte-level BPE's characters."""
        self.misses += 1
        chars = word.encode("utf-8").decode("latin-1").translate(self._bytes)
        return _pack([t.id for t in self._model.tokenize(chars)])

    def _encode_words(self, s: str) -> bytes:
        return b"".join(self._word_ids(self._pretokens(s)))


def _pack(ids) -> bytes:
    a = array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


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
