"""Content-addressed blobs: each file's bytes stored once, under its SHA-256, read-only."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlobStore", "FileDigest", "hash_file"]

_CHUNK = 1 << 20
STALE_TMP_SECONDS = 24 * 3600


@dataclass(frozen=True)
class FileDigest:
    """What the protocol needs to know of a file: SHA-256, git blob SHA-1, size."""

    sha256: str
    git_oid: str
    size: int


def hash_file(path: Path) -> FileDigest:
    """SHA-256 and git blob SHA-1 of a file, in one pass."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            sha1.update(chunk)
    return FileDigest(sha256.hexdigest(), sha1.hexdigest(), size)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    """``root/blobs/sha256/ab/cdef...``; uploads land in ``root/tmp`` first."""

    def __init__(self, root: Path):
        self.dir = root / "blobs" / "sha256"
        self.tmp = root / "tmp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.dir / sha256[:2] / sha256[2:]

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def new_temp(self, suffix: str = "") -> Path:
        """A fresh path in the store's temp area (same filesystem, so renames are atomic)."""
        return self.tmp / f"{uuid.uuid4().hex}{suffix}"

    def ingest(self, tmp: Path, digest: FileDigest) -> Path:
        """Move a verified temp file into place, durably; a blob already there wins."""
        target = self.path(digest.sha256)
        if target.is_file():
            tmp.unlink(missing_ok=True)
            return target
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o444)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
        fsync_dir(target.parent)
        return target

    def clean_stale_temps(self, max_age: float = STALE_TMP_SECONDS) -> int:
        """Remove temp files left by crashed uploads (old enough not to be in flight)."""
        removed = 0
        now = time.time()
        for p in self.tmp.iterdir():
            try:
                if now - p.stat().st_mtime > max_age:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
