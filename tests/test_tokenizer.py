"""ck.Tokenizer against transformers' AutoTokenizer (ids recorded in tests/fixtures/tokenizer_shakespeare/expected.json
by tests/fixtures/make_tokenizer.py), the byte tokenizer, streaming decode, and bad input."""
import json
from pathlib import Path

import numpy as np
import pytest

import cukernels as ck
from cukernels.tokenizer import ByteTokenizer, TextStream

FIX = Path(__file__).resolve().parent / "fixtures" / "tokenizer_shakespeare"
EXPECTED = json.loads((FIX / "expected.json").read_text(encoding="utf-8"))
tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers (the 'tokenizers' extra)")


@pytest.fixture(scope="module")
def tok():
    return ck.Tokenizer.from_pretrained(FIX)


def test_special_tokens_and_size_match_transformers(tok):
    assert tok.vocab_size == EXPECTED["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        EXPECTED["bos_token_id"], EXPECTED["eos_token_id"], EXPECTED["pad_token_id"])


@pytest.mark.parametrize("i", range(len(EXPECTED["samples"])))
def test_encode_decode_match_transformers(tok, i):
    s = EXPECTED["samples"][i]
    assert tok.encode(s["text"]) == s["ids"]
    assert tok.encode(s["text"], add_special_tokens=False) == s["ids_plain"]
    assert tok.decode(s["ids"]) == s["decoded"]
    assert tok.decode(s["ids"], skip_special_tokens=True) == s["decoded_skip"]
    assert tok.decode(np.array(s["ids"], np.int64)) == s["decoded"]


def test_encode_batch(tok):
    texts = [s["text"] for s in EXPECTED["samples"]]
    assert tok.encode_batch(texts) == [s["ids"] for s in EXPECTED["samples"]]


def test_stream_releases_whole_characters(tok):
    text = "héllo wörld ✓ 🙂 and more"
    for t in (tok, ByteTokenizer()):
        ids = t.encode(text, add_special_tokens=False)
        st = TextStream(t)
        pieces = [st.push(i) for i in ids] + [st.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
    st = TextStream(ByteTokenizer())
    assert st.push("🙂".encode()[0]) == ""  # the first byte of a 4-byte character alone prints nothing


def test_byte_tokenizer():
    b = ByteTokenizer()
    assert b.encode("hé") == [104, 195, 169] and b.decode([104, 195, 169]) == "hé"
    assert b.vocab_size == 256 and b.bos_token_id is None
    with pytest.raises(ValueError, match=r"ids: byte tokens are 0\.\.255; got 256"):
        b.decode([1, 256])


def test_a_byte_model_folder_gets_the_byte_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256}))
    assert isinstance(ck.Tokenizer.from_pretrained(tmp_path), ByteTokenizer)


@pytest.mark.parametrize("call,err,match", [
    (lambda t: t.encode(3), TypeError, r"^text: expected a string"),
    (lambda t: t.encode("a", add_special_tokens="yes"), TypeError, r"^add_special_tokens:"),
    (lambda t: t.decode("abc"), TypeError, r"^ids: expected a sequence of integer token ids"),
    (lambda t: t.decode([1, 2.5]), TypeError, r"^ids\[1\]: expected an integer"),
    (lambda t: t.decode([1, -1]), ValueError, r"^ids\[1\]: expected an integer >= 0"),
    (lambda t: t.decode([1, 512]), ValueError, r"^ids: token ids must be < vocab_size=512; got 512"),
    (lambda t: t.decode(np.zeros((2, 2), np.int32)), TypeError, r"^ids: expected a 1-D array"),
    (lambda t: t.encode_batch("abc"), TypeError, r"^texts: expected a list of strings"),
])
def test_bad_input(tok, call, err, match):
    with pytest.raises(err, match=match):
        call(tok)


def test_bad_folders(tmp_path):
    with pytest.raises(TypeError, match=r"^folder: expected a path"):
        ck.Tokenizer.from_pretrained(3)
    with pytest.raises(ValueError, match=r"is not a folder"):
        ck.Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        ck.Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"is not a valid tokenizer\.json"):
        ck.Tokenizer.from_pretrained(tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    (good / "tokenizer.json").write_text((FIX / "tokenizer.json").read_text(encoding="utf-8"))
    (good / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"bos_token: '<\|nope\|>' is not in the tokenizer's vocabulary"):
        ck.Tokenizer.from_pretrained(good)
