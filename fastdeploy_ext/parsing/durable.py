"""Durable file writes for the workspace: a whole file replaced atomically, or an append-only
log whose committed length is tracked. Every write is fsynced before the caller builds on it."""
from __future__ import annotations

import json
import os


def write_atomic(path: str, data: bytes) -> None:
    """temp + fsync + rename: a reader (or a rerun) sees the old file or the whole new one.
    The temp name is fixed per target, so a crash's leftover is replaced when the file is redone."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate(path: str, length: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) > length:
        with open(path, "r+b") as f:
            f.truncate(length)
            os.fsync(f.fileno())


def json_line(entry: dict) -> bytes:
    return (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class AppendLog:
    """An append-only file whose committed length we track: every append is fsynced before it
    counts, and a failed append is cut off so the next record never follows a partial one."""

    def __init__(self, path: str, length: int):
        self.path = path
        self.length = length
        self._f = open(path, "ab")

    def append(self, data: bytes) -> int:
        """Append durably; returns the new length (the record's end offset)."""
        try:
            self._f.write(data)
            self._f.flush()
            os.fsync(self._f.fileno())
        except BaseException:
            self._f.truncate(self.length)
            raise
        self.length += len(data)
        return self.length

    def close(self) -> None:
        self._f.close()
