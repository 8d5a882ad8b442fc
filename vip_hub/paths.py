"""Validation of the relative file paths a repo may contain (no traversal, no tricks): each
path alone (:func:`validate_relpath`) and a tree's paths together (:func:`tree_path_problems`);
and owner-only folders and files, private from their creation (never chmod-ed afterwards, so
no other user can open them in between), made and renamed into durably (fsynced in their
parents: :func:`make_private_dir`, :func:`replace_durably`): the hub's store and the training
run folders; and a folder replaced whole (:func:`replace_dir`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import unicodedata
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

from .errors import UnsafePathError

MAX_PATH_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255
_SHORT_GIT = re.compile(r"git~[0-9]+")
"""An 8.3 short name (``GIT~1``) by which Windows also opens a ``.git`` folder."""
_WINDOWS_FORBIDDEN = frozenset('<>:"|?*')
"""Characters no Windows file name holds (``:`` would open an alternate data stream)."""
_WINDOWS_DEVICE = re.compile(r"(con|prn|aux|nul|com[0-9¹²³]|lpt[0-9¹²³])", re.IGNORECASE)
"""Names Windows opens as devices, whatever extension follows (``con.txt``, ``nul/x.md``)."""
PERCENT_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
"""A URL's percent escape: a file name holding one has no URL a hub serves it by (a decoded
URL segment still holding one is refused as doubly encoded, a trick)."""
_TEMPORARY = ".tmp-"  # a private_writer file's name: .NAME.tmp-<random hex>

__all__ = [
    "PERCENT_ESCAPE",
    "UnsafePathError",
    "fsync_dir",
    "make_private_dir",
    "open_private",
    "private_writer",
    "remove_temporaries",
    "replace_dir",
    "replace_durably",
    "tree_path_problems",
    "validate_relpath",
    "windows_problem",
    "write_private",
]


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
    if PERCENT_ESCAPE.search(path):
        raise UnsafePathError(f"path {path!r} holds a percent escape: no URL could download it")
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
        if problem := windows_problem(segment):
            raise UnsafePathError(
                f"path {path!r}: segment {segment!r} {problem}: a download to Windows could not "
                "write it as named"
            )
    return path


def windows_problem(segment: str) -> str | None:
    """Why Windows would not write a file or folder named ``segment`` as named, if it would
    not: it drops a trailing dot or space, refuses some characters, opens device names as
    devices."""
    if segment[-1] in ". ":
        return "ends in a dot or a space, which Windows drops"
    if forbidden := sorted(_WINDOWS_FORBIDDEN.intersection(segment)):
        return f"holds {' '.join(forbidden)}, which no Windows file name holds"
    if _WINDOWS_DEVICE.fullmatch(segment.split(".", 1)[0].rstrip(" ")):
        return "is a Windows device name (CON, PRN, AUX, NUL, COM1-9, LPT1-9)"
    return None


def tree_path_problems(paths: Iterable[str]) -> list[str]:
    """Paths of one tree that no filesystem can hold together: a file that is also a folder of
    another path (``notes.txt`` beside ``notes.txt/x``), or two paths equal but for case."""
    problems: list[str] = []
    seen: dict[str, str] = {}  # casefolded path: the first path folded so
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


def make_private_dir(path: Path) -> None:
    """Create ``path`` and its missing parents owner-only (0700), durably: each new folder is
    fsynced in its parent, so a crash cannot lose it with what is then written in it."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        # made meanwhile by another request: synced here too, as it may not have been yet
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        with contextlib.suppress(PermissionError):  # a parent to write in, not to read (-wx)
            fsync_dir(folder.parent)


def open_private(path: Path, mode: Literal["wb", "ab"] = "wb") -> BinaryIO:
    """Open a file for writing, created owner-only (0600)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    return open(os.open(path, flags, 0o600), mode)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (where the filesystem syncs folders: one
    that refuses, EINVAL, has nothing to sync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def replace_durably(source: Path, target: Path) -> None:
    """Rename the fsynced file ``source`` to ``target`` (its missing folders made as
    :func:`make_private_dir` makes them), the rename fsynced in ``target``'s folder."""
    make_private_dir(target.parent)
    os.replace(source, target)
    fsync_dir(target.parent)


@contextlib.contextmanager
def private_writer(path: Path) -> Iterator[BinaryIO]:
    """A new owner-only (0600) file that replaces ``path`` in one fsynced rename when the block
    ends (so a crash leaves the old file or the new one, whole); discarded if the block raises
    (a kill leaves it: ``remove_temporaries``)."""
    tmp = path.with_name(f".{path.name}{_TEMPORARY}{uuid.uuid4().hex}")
    f = open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_temporaries(folder: Path) -> int:
    """Remove the temporaries killed ``private_writer`` blocks left in ``folder`` (call only
    while nothing can be writing there, e.g. holding its lock); how many were removed."""
    left = [p for p in folder.glob(f".*{_TEMPORARY}*") if p.is_file() and not p.is_symlink()]
    for path in left:
        path.unlink(missing_ok=True)
    return len(left)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as :func:`private_writer` does."""
    with private_writer(path) as f:
        f.write(data)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
"""Linux's renameat2(2): a path relative to the working directory; swap the two paths."""


@functools.cache
def _renameat2() -> Any:
    """The C library's renameat2, typed; None where there is none (not Linux, an old libc)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, TypeError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap the existing ``a`` and ``b`` in one step (Linux's renameat2 with RENAME_EXCHANGE);
    False where the C library or the file system has no such call."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def replace_dir(new: Path, root: Path) -> None:
    """Put the folder ``new`` (a sibling of ``root``) at ``root`` and remove the folder it
    replaces, if any. Where renameat2 exchanges the two (Linux) a reader of ``root`` finds the old
    folder or the new one, never neither; elsewhere the old one is renamed aside first, which
    leaves a moment without ``root``."""
    try:
        new.rename(root)
        return
    except OSError as e:  # root is a folder with files: the one to replace
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if _exchange(new, root):
        shutil.rmtree(new, ignore_errors=True)  # root is replaced; what is left is the old copy
        return
    old = root.with_name(f".{root.name}.{uuid.uuid4().hex}.old")
    root.rename(old)
    try:
        new.rename(root)
    except OSError:  # another writer's folder took root meanwhile, or none did: then the old back
        if root.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(root)
        raise
    shutil.rmtree(old, ignore_errors=True)
