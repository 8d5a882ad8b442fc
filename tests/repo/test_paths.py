"""``vip_hub.paths``: a repo path is refused by name unless it is a plain relative POSIX path
every downloader can write; ``replace_dir`` replaces a folder whole, never absent to a reader."""

from __future__ import annotations

import re
import shutil
import sys
import threading
from pathlib import Path

import pytest

from vip_hub import paths
from vip_hub.errors import UnsafePathError
from vip_hub.repo_format import GITATTRIBUTES_FILE, HEAD_WEIGHTS, HEADS_DIR, WEIGHTS_FILE


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("", "empty path"),
        ("/etc/passwd", "absolute path"),
        ("a\\b.txt", "backslash"),
        ("a/b\x00c", "control or format character"),
        ("docs/e\u0301.md", "not NFC-normalised"),
        ("docs/%61.md", "percent escape"),
        ("../escape.txt", "'..' segment"),
        ("a/../../b", "'..' segment"),
        ("a/..", "'..' segment"),
        ("./a", "'..' segment"),
        ("a//b", "'..' segment"),
        ("a/", "'..' segment"),
        ("x" * (paths.MAX_SEGMENT_LENGTH + 1), "longer than"),
        ("a/" * (paths.MAX_PATH_LENGTH // 2) + "b", "path longer than"),
        (".git/config", "'.git' segment"),
        ("a/GIT~1/hooks", "'.git' segment"),
        (".git./x", "'.git' segment"),
        ("a:b.txt", "holds :"),
        ("nul/x.md", "device name"),
        ("docs./a.md", "ends in a dot"),
    ],
)
def test_an_unsafe_repo_path_is_refused_by_name(path: str, named: str) -> None:
    with pytest.raises(UnsafePathError, match=re.escape(named)):
        paths.validate_relpath(path)


@pytest.mark.parametrize(
    "path", [WEIGHTS_FILE, f"{HEADS_DIR}/toy/{HEAD_WEIGHTS}", "docs/\u00fc.md", GITATTRIBUTES_FILE]
)
def test_a_plain_relative_path_is_kept(path: str) -> None:
    assert paths.validate_relpath(path) == path


def _folder(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "f.txt").write_text(text)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "renamed-aside"])
def test_a_folder_is_replaced_whole_and_nothing_is_left_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:  # the way without renameat2 (another OS, a file system without it)
        monkeypatch.setattr(paths, "_exchange", lambda a, b: False)
    root = tmp_path / "root"
    paths.replace_dir(_folder(tmp_path / "new1", "one"), root)  # root absent: a rename
    assert (root / "f.txt").read_text() == "one"
    paths.replace_dir(_folder(tmp_path / "new2", "two"), root)
    assert (root / "f.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_the_fallback_puts_the_old_folder_back_when_the_new_cannot_take_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_exchange_and_new_gone(a: Path, b: Path) -> bool:
        shutil.rmtree(a)  # the new folder vanishes before its rename
        return False

    monkeypatch.setattr(paths, "_exchange", no_exchange_and_new_gone)
    root = _folder(tmp_path / "root", "old")
    with pytest.raises(FileNotFoundError):
        paths.replace_dir(_folder(tmp_path / "new", "new"), root)
    assert (root / "f.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_a_reader_never_finds_the_folder_gone_while_it_is_replaced(tmp_path: Path) -> None:
    swapped = paths._exchange(_folder(tmp_path / "a", "a"), _folder(tmp_path / "b", "b"))
    if sys.platform == "linux":  # glibc and every local file system the tests run on have it
        assert swapped and (tmp_path / "a" / "f.txt").read_text() == "b"
    elif not swapped:
        pytest.skip("no renameat2 exchange here: the folder is renamed aside, with a gap")
    root = _folder(tmp_path / "root", "0")
    done, missing = threading.Event(), []

    def read() -> None:
        while not done.is_set():
            if not (root / "f.txt").is_file():
                missing.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(1, 200):
            paths.replace_dir(_folder(tmp_path / f"new{i}", str(i)), root)
    finally:
        done.set()
        reader.join()
    assert (root / "f.txt").read_text() == "199" and missing == []


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_a_failed_exchange_is_named(tmp_path: Path) -> None:
    with pytest.raises(OSError) as e:
        paths._exchange(tmp_path / "absent", _folder(tmp_path / "b", "b"))
    assert "absent" in str(e.value)


def test_folders_are_made_where_the_filesystem_does_not_sync_folders(tmp_path, monkeypatch):
    """A filesystem that refuses to fsync a folder (EINVAL) has nothing to sync: folders are
    still made and files still renamed in (the fsync of new folders made them fail there)."""
    import errno
    import os

    def no_folder_sync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", no_folder_sync)
    paths.make_private_dir(tmp_path / "a" / "b")
    source = tmp_path / "file"
    source.write_bytes(b"x")
    paths.replace_durably(source, tmp_path / "c" / "file")
    assert (tmp_path / "a" / "b").is_dir() and (tmp_path / "c" / "file").read_bytes() == b"x"
