"""Files that lie consistently (issue 36): a safetensors or checkpoint header rewritten -- its checksum recomputed
for a checkpoint -- so that every integrity check passes while the header describes something it must not. Each
must be refused (SafetensorsError / CheckpointError, ValueErrors naming the file and the tensor) before any
tensor is read."""
import hashlib
import json
import struct

import numpy as np
import pytest

from cukernels.io import checkpoint as C
from cukernels.io import safetensors as S

F32 = np.float32


# ------------------------------------------------------------------------------------------ safetensors
def _st_bytes(header: dict, data: bytes) -> bytes:
    hb = json.dumps(header).encode()
    return len(hb).to_bytes(8, "little") + hb + data


def _good():
    a, b = np.arange(6, dtype=F32), np.arange(4, dtype=np.int32)
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "I32", "shape": [4], "data_offsets": [24, 40]},
              "__metadata__": {"format": "pt"}}
    return header, a.tobytes() + b.tobytes()


def _forge(**edits):
    header, data = _good()
    for path, v in edits.items():
        name, key = (path, None) if path == "__metadata__" or "__" not in path else path.split("__")
        if key is None:
            header[name] = v
        else:
            header[name][key] = v
    return header, data


FORGED = [
    ("negative offset", _forge(a__data_offsets=[-8, 16]), "data_offsets"),  # (read header bytes as data)
    ("float shape", _forge(a__shape=[2.5, 3]), "shape"),  # (truncated)
    ("negative shape", _forge(a__shape=[-2, -3]), "shape"),
    ("bool shape", _forge(b__shape=[True, 4]), "shape"),
    ("shared bytes", _forge(b__data_offsets=[0, 16]), "overlaps"),  # two tensors on the same bytes
    ("dtype reinterpreting", _forge(a__dtype="F64", a__shape=[2, 3], a__data_offsets=[0, 48]), "do not hold"),
    ("dtype reinterpreting 2", _forge(b__dtype="I64"), "do not hold"),  # I64 [4] in I32 [4]'s 16 bytes
    ("unknown dtype", _forge(a__dtype="O"), "unknown dtype"),
    ("string offsets", _forge(a__data_offsets=["0", "24"]), "data_offsets"),
    ("float offsets", _forge(b__data_offsets=[24.0, 40.0]), "data_offsets"),
    ("non-dict metadata", _forge(__metadata__=["x"]), "__metadata__"),
    ("metadata of ints", _forge(__metadata__={"n": 3}), "__metadata__"),
    ("extra field", _forge(a__extra=1), "exactly the fields"),
    ("entry not a dict", _forge(a=[1, 2]), "exactly the fields"),
    ("past the end", _forge(b__data_offsets=[24, 48], b__shape=[6]), "within the 40 data bytes"),
    ("gap", _forge(b__data_offsets=[28, 40], b__shape=[3]), "gap"),
]


@pytest.mark.parametrize("header, data, match", [(h, d, m) for _, (h, d), m in FORGED], ids=[f[0] for f in FORGED])
def test_forged_safetensors_header_is_refused(tmp_path, header, data, match):
    p = tmp_path / "x.safetensors"
    p.write_bytes(_st_bytes(header, data))
    with pytest.raises(S.SafetensorsError, match=match):
        S.read(p)
    with pytest.raises(S.SafetensorsError):  # the whole header is checked, even when reading only some names
        S.read(p, names=["a"])


def test_trailing_bytes_and_a_huge_header_length_are_refused(tmp_path):
    header, data = _good()
    p = tmp_path / "x.safetensors"
    p.write_bytes(_st_bytes(header, data + b"\0" * 8))
    with pytest.raises(S.SafetensorsError, match="cover 40 of the 48 data bytes"):
        S.read(p)
    p.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(S.SafetensorsError, match="header length 1099511627776 exceeds the format's limit"):
        S.read(p)  # (a MemoryError)


def test_honest_safetensors_still_read(tmp_path):
    header, data = _good()
    p = tmp_path / "x.safetensors"
    p.write_bytes(_st_bytes(header, data))
    t = S.read(p)
    np.testing.assert_array_equal(t["a"], np.arange(6, dtype=F32).reshape(2, 3))
    S.write(tmp_path / "w.safetensors", {"z": np.zeros((0, 3), F32), "a": np.ones(2, F32)})
    assert S.read(tmp_path / "w.safetensors")["z"].shape == (0, 3)


# ------------------------------------------------------------------------------------------ checkpoints
def _ckpt_bytes(doc: dict, data: bytes) -> bytes:
    """A checkpoint file whose checksum is right for whatever the header says (the forger's part)."""
    hb = json.dumps(doc).encode()
    body = C.MAGIC + struct.pack("<Q", len(hb)) + hb + data
    return body + hashlib.sha256(body).digest()


def _good_ckpt():
    a, b = np.arange(6, dtype=F32), np.arange(4, dtype=np.int32)
    doc = {"arrays": {"a": {"dtype": "<f4", "shape": [2, 3], "offset": 0, "nbytes": 24},
                      "b": {"dtype": "<i4", "shape": [4], "offset": 24, "nbytes": 16}},
           "meta": {"step": 1}}
    return doc, a.tobytes() + b.tobytes()


def _forge_ckpt(name=None, **edits):
    doc, data = _good_ckpt()
    for k, v in edits.items():
        if name is None:
            doc[k] = v
        else:
            doc["arrays"][name][k] = v
    return doc, data


FORGED_CKPT = [
    ("negative offset", _forge_ckpt("a", offset=-8), "do not hold"),
    ("float shape", _forge_ckpt("a", shape=[2.0, 3]), "shape"),
    ("negative shape", _forge_ckpt("a", shape=[-2, -3], nbytes=24), "shape"),
    ("shared bytes", _forge_ckpt("b", offset=8), "overlaps"),
    ("dtype reinterpreting", _forge_ckpt("a", dtype="<f8", nbytes=48), "overlaps|end past"),
    ("object dtype", _forge_ckpt("a", dtype="|O", shape=[3], nbytes=24), "unknown dtype"),
    ("string nbytes", _forge_ckpt("a", nbytes="24"), "do not hold"),
    ("past the end", _forge_ckpt("b", shape=[8], nbytes=32), "end past"),
    ("non-dict meta", _forge_ckpt(meta=[1, 2]), "meta"),
    ("no arrays", _forge_ckpt(arrays=[1]), "arrays"),
]


@pytest.mark.parametrize("doc, data, match", [(d, b, m) for _, (d, b), m in FORGED_CKPT],
                         ids=[f[0] for f in FORGED_CKPT])
def test_forged_checkpoint_header_with_a_valid_checksum_is_refused(tmp_path, doc, data, match):
    p = tmp_path / "x.ckpt"
    p.write_bytes(_ckpt_bytes(doc, data))
    with pytest.raises(C.CheckpointError, match=match):
        C.load(p)


def test_checkpoint_header_length_is_bounded_before_reading(tmp_path):
    body = C.MAGIC + struct.pack("<Q", 2**40) + b"{}"
    p = tmp_path / "x.ckpt"
    p.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(C.CheckpointError, match="header length 1099511627776 exceeds"):
        C.load(p)  # (a MemoryError)


def test_honest_checkpoint_still_loads(tmp_path):
    doc, data = _good_ckpt()
    p = tmp_path / "x.ckpt"
    p.write_bytes(_ckpt_bytes(doc, data))
    arrays, meta = C.load(p)
    np.testing.assert_array_equal(arrays["b"], np.arange(4, dtype=np.int32))
    assert meta == {"step": 1}
