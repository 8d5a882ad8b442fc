"""Validation of the relative file paths a repo may contain (no traversal, no tricks): each
path alone (:func:`validate_relpath`) and a tree's paths together (:func:`tree_path_problems`)."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

from .errors import UnsafePathError

MAX_PATH_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255
_SHORT_GIT = re.compile(r"git~[0-9]+")
"""An 8.3 short name (``GIT~1``) by which Windows also opens a ``.git`` folder."""

__all__ = ["UnsafePathError", "tree_path_problems", "validate_relpath"]


def validate_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative POSIX path inside a repo, else raise
    UnsafePathError."""
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
        # what Windows opens: trailing dots and spaces dropped, ':' starts a data stream
        opened = segment.split(":", 1)[0].rstrip(". ").casefold()
        if opened == ".git" or _SHORT_GIT.fullmatch(opened):
            raise UnsafePathError(
                f"path {path!r} has a '.git' segment (or a short name of one, such as GIT~1): "
                "it would write into a downloader's git checkout"
            )
    return path


def tree_path_problems(paths: Iterable[str]) -> list[str]:
    """Paths of one tree that no filesystem can hold together: a file that is also a folder of
    another path (``README.md`` beside ``README.md/x``), or two paths equal but for case."""
    problems, seen = [], {}
    files = set(paths)
    for path in sorted(files):
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if (folder := "/".join(parts[:depth])) in files:
                problems.append(f"{folder!r} is a file and the folder of {path!r}")
        folded = path.casefold()
        if folded in seen:
            problems.append(f"{seen[folded]!r} and {path!r} differ only by case")
        seen.setdefault(folded, path)
    return problems
