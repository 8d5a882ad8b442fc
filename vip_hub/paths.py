"""Validation of the relative file paths a repo may contain (no traversal, no tricks)."""

from __future__ import annotations

import unicodedata

from .errors import UnsafePathError

MAX_PATH_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255

__all__ = ["UnsafePathError", "validate_relpath"]


def validate_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative POSIX path inside a repo, else raise UnsafePathError."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError("empty path")
    if len(path) > MAX_PATH_LENGTH:
        raise UnsafePathError(f"path longer than {MAX_PATH_LENGTH} characters")
    if path.startswith("/"):
        raise UnsafePathError(f"absolute path {path!r}")
    if "\\" in path:
        raise UnsafePathError(f"backslash in path {path!r}")
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co") for c in path):
        raise UnsafePathError(f"control or format character in path {path!r}")
    if path != unicodedata.normalize("NFC", path):
        raise UnsafePathError(f"path {path!r} is not NFC-normalised")
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            raise UnsafePathError(f"path {path!r} has an empty, '.' or '..' segment")
        if len(segment) > MAX_SEGMENT_LENGTH:
            raise UnsafePathError(f"a segment of {path!r} is longer than {MAX_SEGMENT_LENGTH}")
    return path
