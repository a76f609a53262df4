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
