"""python -m cukernels.data prepare: documents to llm.c token files, streamed in chunks, equal to encoding each
document whole."""
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="pip install tokenizers (the 'tokenizers' extra)")

import cukernels as ck  # noqa: E402
from cukernels import data as D  # noqa: E402
from cukernels.data import prepare, prepare_main as main  # noqa: E402

FIX = Path(__file__).resolve().parent / "fixtures" / "tokenizer_shakespeare"
TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def tok():
    return ck.Tokenizer.from_pretrained(FIX)


def _doc(tok, text, eos=True):
    return tok.encode(text) + ([tok.eos_token_id] if eos else [])


def test_chunks_equal_whole_documents(tok, tmp_path):
    a = TEXT.read_text(encoding="utf-8")[:60000]
    b = "Second document.\n\n\n  indented line\nend"
    (tmp_path / "a.txt").write_text(a, encoding="utf-8")
    (tmp_path / "b.txt").write_text(b, encoding="utf-8")
    s = prepare(FIX, [tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out", val_fraction=0, workers=2,
                chunk_mb=0.002, progress=False)  # ~2 KB pieces: dozens of cuts
    got = D.read_token_file(tmp_path / "out" / "train.bin")
    assert got.dtype == np.uint16 and s["kind"] == "gpt2"
    assert got.tolist() == _doc(tok, a) + _doc(tok, b)
    assert D.read_token_file(tmp_path / "out" / "val.bin").size == 0
    assert json.loads((tmp_path / "out" / "prepare.json").read_text())["train_tokens"] == got.size


def test_val_split_and_jsonl(tok, tmp_path):
    docs = [f"Document {i}: " + "words and more words. " * (i + 1) for i in range(40)]
    with open(tmp_path / "d.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    prepare(FIX, [tmp_path / "d.jsonl"], tmp_path / "o", val_fraction=0.25, workers=1, eos=False, progress=False)
    train = D.read_token_file(tmp_path / "o" / "train.bin").tolist()
    val = D.read_token_file(tmp_path / "o" / "val.bin").tolist()
    want = [t for d in docs for t in _doc(tok, d, eos=False)]
    assert train + val == want and len(val) > 0 and len(train) > 3 * len(val) * 0.8


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["--tokenizer", str(FIX), str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "inputs: " in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    assert main(["--tokenizer", str(FIX), str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert 'bad.jsonl:1: expected a JSON object with a string "text" field' in capsys.readouterr().err
    (tmp_path / "x.txt").write_bytes(b"\xff\xfe bad")
    assert main(["--tokenizer", str(FIX), str(tmp_path / "x.txt"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err
    assert main(["--tokenizer", str(FIX), str(tmp_path / "x.txt"), "--out", str(tmp_path / "o"),
                 "--val-fraction", "1.5"]) == 2
    assert "val_fraction" in capsys.readouterr().err


def test_text_val_split_lands_near_the_fraction(tok, tmp_path):
    text = TEXT.read_text(encoding="utf-8")[:200000]
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    prepare(FIX, [tmp_path / "t.txt"], tmp_path / "o", val_fraction=0.1, workers=1, chunk_mb=0.03, progress=False)
    train = D.read_token_file(tmp_path / "o" / "train.bin").tolist()
    val = D.read_token_file(tmp_path / "o" / "val.bin").tolist()
    assert train + val == _doc(tok, text)
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.12


def test_python_m_cukernels_data_prepare(tmp_path):
    import subprocess
    import sys

    (tmp_path / "a.txt").write_text("To be, or not to be:\nthat is the question.\n", encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "cukernels.data", "prepare", "--tokenizer", str(FIX),
                        str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--val-fraction", "0", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert D.read_token_file(tmp_path / "o" / "train.bin").size > 5
    r = subprocess.run([sys.executable, "-m", "cukernels.data"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: python -m cukernels.data prepare" in r.stderr


# ------------------------------------------------------------------------------------------------ chunks, fast path
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# lines with trailing spaces, CRLF, blank lines, indentation, specials, unicode: the places a careless cut breaks
HARD = ("First line  \nSecond\r\nThird\r\n\r\nFourth\n\n\nFifth \t\n  indented  line\n\tTabbed, ok.\n/slash\n"
        "x<|eos|>y <|eos|> z\n中文 テキスト 😀 e\u0301 ½ 12345678 'S 'll\n") * 40


def _save(tok, folder, eos="<|eos|>"):
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return folder


def _llama3_style(folder, *, normalizer=None, added=(), prefix_space=False, pre=None, pattern=LLAMA3):
    from tokenizers import Regex, Tokenizer as HF, models, normalizers, pre_tokenizers, trainers

    tok = HF(models.BPE())
    if normalizer:
        tok.normalizer = getattr(normalizers, normalizer)()
    tok.pre_tokenizer = pre or pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT.read_text(encoding="utf-8")[:100000], HARD], trainer)
    if added:
        tok.add_special_tokens(list(added))
    return _save(tok, folder)


def _whole(folder, docs, eos=True):
    t = ck.Tokenizer.from_pretrained(folder)
    return [i for d in docs for i in t.encode(d) + ([t.eos_token_id] if eos else [])]


def _prepared(out):
    return D.read_token_file(out / "train.bin").tolist() + D.read_token_file(out / "val.bin").tolist()


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("which", ["fixture", "llama3-nfc"])
def test_fast_and_tokenizers_paths_equal_whole_documents(tmp_path, fast, which):
    folder = FIX if which == "fixture" else _llama3_style(tmp_path / "tok", normalizer="NFC")
    docs = [HARD, "", " lone", TEXT.read_text(encoding="utf-8")[:30000]]
    for i, d in enumerate(docs[:3]):
        (tmp_path / f"{i}.txt").write_text(d, encoding="utf-8", newline="")
    with open(tmp_path / "d.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[3]}) + "\n" + json.dumps({"text": HARD[:999]}) + "\n")
    inputs = [tmp_path / "0.txt", tmp_path / "1.txt", tmp_path / "2.txt", tmp_path / "d.jsonl"]
    s = prepare(folder, inputs, tmp_path / "o", val_fraction=0.2, workers=2, chunk_mb=0.001, progress=False, fast=fast)
    assert s["encoder"] == ("FastEncoder" if fast else "tokenizers") and s["chunked"]
    assert _prepared(tmp_path / "o") == _whole(folder, docs[:3] + [docs[3], HARD[:999]])


@pytest.mark.parametrize("which", ["fixture", "llama3-nfc", "o200k"])
def test_every_safe_cut_splits_the_ids(tmp_path, which):
    """Wherever a chunk may be cut (``_safe_cut``), encoding the two sides apart gives the ids of the whole."""
    folder = (FIX if which == "fixture" else _llama3_style(tmp_path / "tok", normalizer="NFC") if which == "llama3-nfc"
              else _llama3_style(tmp_path / "tok", pattern=O200K))
    t = ck.Tokenizer.from_pretrained(folder)
    rng = np.random.default_rng(0)
    pool = list("ab XY 01 .,'\n\r\t/") + [" ", "\r\n", "  ", "\n\n", "é", "中", "😀", "\u0301", "<|eos|>", "'s"]
    cuts = 0
    for _ in range(150):
        text = "".join(pool[i] for i in rng.integers(0, len(pool), size=60))
        whole = t.encode(text, add_special_tokens=False)
        for i in range(1, len(text)):
            if D._safe_cut(text, i, ("<|eos|>",)):
                cuts += 1
                assert t.encode(text[:i], add_special_tokens=False) + t.encode(text[i:], add_special_tokens=False) \
                    == whole, (text[:i], text[i:])
    assert cuts > 300


def test_old_newline_cut_broke_gpt2_pre_tokens():
    r"""The cut the first version used (after any newline followed by a non-space) is unsafe for GPT-2's pattern:
    "a  \n" + "B" pre-tokenizes as "a", "  ", "\n", "B" whole but "a", "  \n" | "B" apart (``\s+(?!\S)`` at the end
    of a piece). The rule refuses it: "a  \nB x" may be cut only before " x", "a\nBc" after the newline."""
    pre = ck.Tokenizer.from_pretrained(FIX)._tok.pre_tokenizer

    def pieces(s):
        return [p for p, _ in pre.pre_tokenize_str(s)]

    text = "a  \nB"
    assert pieces(text[:4]) + pieces(text[4:]) != pieces(text)
    assert not D._safe_cut(text, 4) and D._split_point(text) == 0
    assert D._split_point("a  \nB x") == 5 and D._split_point("a\nBc") == 2


def test_added_tokens_with_spaces_are_never_cut(tmp_path):
    folder = _llama3_style(tmp_path / "tok", added=["<end of text>", "a b"])
    text = ("word <end of text> word a b c " * 300)
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    for fast in (True, False):
        prepare(folder, [tmp_path / "t.txt"], tmp_path / f"o{fast}", val_fraction=0.1, workers=1, chunk_mb=0.0005,
                progress=False, fast=fast)
        assert _prepared(tmp_path / f"o{fast}") == _whole(folder, [text])


def test_prefix_space_tokenizers_read_whole_documents(tmp_path, capsys):
    folder = _llama3_style(tmp_path / "tok", prefix_space=True)
    (tmp_path / "t.txt").write_text(HARD, encoding="utf-8", newline="")
    s = prepare(folder, [tmp_path / "t.txt"], tmp_path / "o", val_fraction=0, workers=1, chunk_mb=0.001)
    assert not s["chunked"] and s["encoder"] == "tokenizers"
    assert "no fast path (ByteLevel add_prefix_space)" in capsys.readouterr().err
    assert _prepared(tmp_path / "o") == _whole(folder, [HARD])


def test_other_pipelines_fall_back_and_say_so_once(tmp_path, capsys):
    from tokenizers import pre_tokenizers

    folder = _llama3_style(tmp_path / "tok", pre=pre_tokenizers.Whitespace())
    (tmp_path / "t.txt").write_text(HARD, encoding="utf-8", newline="")
    s = prepare(folder, [tmp_path / "t.txt"], tmp_path / "o", val_fraction=0.1, workers=2, chunk_mb=0.001)
    err = capsys.readouterr().err
    assert s["encoder"] == "tokenizers" and err.count("no fast path") == 1 and "Whitespace" in err
    assert _prepared(tmp_path / "o") == _whole(folder, [HARD])
