"""Byte tokenizer, tinyshakespeare split, llm.c token files, batch loader."""
import numpy as np
import pytest

from cukernels import data


@pytest.mark.parametrize("kind,dt,top", [("gpt2", np.uint16, 50256), ("llama3", np.uint32, 128255)])
def test_token_file_roundtrip(tmp_path, rng, kind, dt, top):
    toks = rng.integers(0, top + 1, 1001)
    p = tmp_path / f"{kind}.bin"
    data.write_token_file(p, toks, kind=kind)
    raw = np.fromfile(p, dtype="<i4", count=256)
    magic, version, _ = data.FORMATS[kind]
    assert (raw[0], raw[1], raw[2]) == (magic, version, 1001) and not raw[3:].any()
    assert p.stat().st_size == 1024 + 1001 * np.dtype(dt).itemsize
    back = data.read_token_file(p)
    assert back.dtype == dt
    np.testing.assert_array_equal(back, toks)
    np.testing.assert_array_equal(data.read_token_file(p, mmap=False), toks)


def test_token_file_errors(tmp_path):
    p = tmp_path / "t.bin"
    with pytest.raises(ValueError, match="kind"):
        data.write_token_file(p, [1, 2], kind="bert")
    with pytest.raises(ValueError, match="65535"):
        data.write_token_file(p, [70000], kind="gpt2")
    data.write_token_file(p, [1, 2, 3], kind="gpt2")
    b = bytearray(p.read_bytes())
    (tmp_path / "short.bin").write_bytes(bytes(b[:-2]))
    with pytest.raises(ValueError, match="short.bin.*3 tokens"):
        data.read_token_file(tmp_path / "short.bin")
    b[0] = 7
    (tmp_path / "magic.bin").write_bytes(bytes(b))
    with pytest.raises(ValueError, match="unknown magic"):
        data.read_token_file(tmp_path / "magic.bin")
    (tmp_path / "tiny.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="shorter"):
        data.read_token_file(tmp_path / "tiny.bin")


def test_byte_tokenizer_and_split():
    tok = data.ByteTokenizer()
    s = "First Citizen:\nBefore we proceed — any further, hear me speak."
    ids = tok.encode(s)
    assert max(ids) < 256 and tok.decode(ids) == s
    train, val = data.load_text_tokens(val_fraction=0.1)
    assert len(val) == int((len(train) + len(val)) * 0.1)
    assert tok.decode(train[:14]) == "First Citizen:"


def test_loader_shift_and_wrap():
    toks = np.arange(50, dtype=np.uint16)
    ld = data.TokenLoader(toks, 2, 8)
    x, y = ld.next_batch()
    assert x.shape == (2, 8) and x.dtype == np.int32
    np.testing.assert_array_equal(x.reshape(-1), np.arange(16))
    np.testing.assert_array_equal(y.reshape(-1), np.arange(1, 17))
    ld.next_batch(), ld.next_batch()
    st = ld.state_dict()
    x4, _ = ld.next_batch()  # 48 + 17 > 50: wraps to the start
    np.testing.assert_array_equal(x4.reshape(-1), np.arange(16))
    ld.load_state_dict(st)
    np.testing.assert_array_equal(ld.next_batch()[0], x4)
    with pytest.raises(ValueError, match="fewer than one batch"):
        data.TokenLoader(toks, 4, 16)
