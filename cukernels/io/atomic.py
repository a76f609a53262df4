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


def check_target(path, name="path") -> Path:
    """``path`` as a Path after checking a file can be written there: a str or os.PathLike (TypeError), not an
    existing folder, and no part of its folder an existing regular file (ValueError naming it: ``mkdir`` raised a
    FileExistsError for a path under a file)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise TypeError(f"{name}: expected a str or os.PathLike file path; got {type(path).__name__}")
    path = Path(path)
    if not path.name:
        raise ValueError(f"{name}: expected a file path; got {str(path)!r}")
    if path.is_dir():
        raise ValueError(f"{name}: {path} is a folder; expected a file path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{name}: {path}: {parent} is a file, not a folder")
            break
    return path


@contextlib.contextmanager
def atomic_path(path):
    """``with atomic_path(p) as tmp:`` write the file at ``tmp`` (any way you like); on a clean exit it is
    fsynced and renamed onto ``p``; on an exception it is deleted and ``p`` is untouched."""
    path = check_target(path)
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
