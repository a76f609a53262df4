"""Atomic file writes: a temporary name in the same folder, fsync, ``os.replace`` onto the final name, fsync of
the folder. A crash at any point leaves the previous file intact (or no file), never half a file."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def fsync_dir(folder) -> None:
    """fsync a folder so a rename into it survives a crash (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


@contextlib.contextmanager
def atomic_path(path):
    """``with atomic_path(p) as tmp:`` write the file at ``tmp`` (any way you like); on a clean exit it is
    fsynced and renamed onto ``p``; on an exception it is deleted and ``p`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path, mode="wb"):
    """``with atomic_open(p) as f:`` an open file whose content replaces ``p`` atomically on a clean exit."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()


def write_json(path, obj):
    """``obj`` as indented JSON, atomically."""
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
