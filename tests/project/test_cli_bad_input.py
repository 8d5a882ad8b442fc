"""Bad input to the ``vip-hub`` commands that do not train: a one-line error naming what was
wrong and exit status 1, never a traceback, and nothing stored left behind or half-written."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from vip_hub.cli.main import main


@pytest.fixture
def cli(capsys, monkeypatch):
    """``vip-hub ARGS`` in this process: exit status, stdout, stderr."""
    monkeypatch.delenv("VIP_HUB_CONFIG", raising=False)  # --config sets it for the process

    def run(*args: str | Path) -> SimpleNamespace:
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def _one_line_error(result: SimpleNamespace, command: str, *named: str) -> None:
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vip-hub {command}: error: "), result.stderr
    for text in named:
        assert text in lines[0], lines[0]


def _closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_push_to_an_unreachable_hub_is_a_one_line_error(tiny_repo, cli):
    """A hub that cannot be reached, an endpoint that is no URL, or a repo id the hub client
    refuses: one line naming it (each was an httpx or huggingface_hub traceback)."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    down = cli("push", tiny_repo, "org/name", "--endpoint", endpoint, "--token", "t")
    _one_line_error(down, "push", "cannot reach the hub", endpoint)
    no_url = cli("push", tiny_repo, "org/name", "--endpoint", "hub.example", "--token", "t")
    _one_line_error(no_url, "push", "hub.example")
    bad_id = cli("push", tiny_repo, "../../etc", "--endpoint", endpoint, "--token", "t")
    _one_line_error(bad_id, "push", "'../../etc'")


def test_key_create_into_a_file_is_a_one_line_error(tmp_path, cli):
    """``key create --dir`` naming a file, or a folder under one: the folder is named (was a
    FileExistsError or NotADirectoryError traceback), and the file is left as it was."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for folder in (file, file / "keys"):
        made = cli("key", "create", "--dir", folder, "--name", "bob")
        _one_line_error(made, "key", str(folder))
    assert file.read_text() == "mine"


@pytest.mark.parametrize(
    "command",
    [("token", "list"), ("org", "list"), ("trust", "list"), ("serve", "--no-inference")],
)
def test_a_file_given_as_the_store_is_a_one_line_error(tmp_path, cli, command):
    """``--store`` naming a file, or a folder under one: the store folder is named (was a
    NotADirectoryError traceback from creating the store's folders), the file untouched."""
    file = tmp_path / "store.txt"
    file.write_text("mine")
    for store in (file, file / "sub"):
        listed = cli(*command, "--store", store)
        _one_line_error(listed, command[0], str(store))
    assert file.read_text() == "mine"


@pytest.mark.parametrize(
    "command",
    [
        ("token", "list"),
        ("token", "revoke", "--name", "bob"),
        ("org", "list"),
        ("org", "remove", "vip", "--member", "bob"),
        ("trust", "list"),
        ("trust", "remove", "bob"),
    ],
)
def test_a_mistyped_store_is_refused_not_made(tmp_path, cli, command):
    """A command that lists or removes, given a ``--store`` that holds no store: one line naming
    it (a new, empty store was made there and listed as empty)."""
    typo = tmp_path / "hbu"
    _one_line_error(cli(*command, "--store", typo), command[0], str(typo), "is not a hub store")
    assert not typo.exists()


def test_the_first_token_create_makes_the_store(tmp_path, cli):
    store = tmp_path / "hub"
    assert cli("token", "create", "--name", "ann", "--store", store).returncode == 0
    listed = cli("token", "list", "--store", store)
    assert listed.returncode == 0 and listed.stdout.startswith("ann\tread\t")


def test_synth_preview_to_a_path_it_cannot_write_is_a_one_line_error(tmp_path, cli):
    """``synth-preview --out`` naming a folder, a format Pillow does not write, or a path under
    a file: one line naming it (each was a PIL or OS traceback); a sheet is written whole or not
    at all, never over an existing file half-way."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    folder = tmp_path / "sheet.png"
    folder.mkdir()
    small = ("--count", "4", "--size", "16")
    for out in (tmp_path, tmp_path / "sheet.notanext", file / "sheet.png", folder):
        _one_line_error(cli("synth-preview", "--out", out, *small), "synth-preview", str(out))
    assert file.read_text() == "mine" and not any(folder.iterdir())
    negative = cli("synth-preview", "--out", tmp_path / "s.png", "--seed", "-1", *small)
    _one_line_error(negative, "synth-preview", "--seed -1")  # was numpy's ValueError
    good = tmp_path / "sheet.jpg"
    assert cli("synth-preview", "--out", good, *small).returncode == 0 and good.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "sheet.jpg", "sheet.png"]


def test_a_full_disk_is_a_one_line_error_and_a_bug_keeps_its_traceback(cli, monkeypatch):
    """An OSError of the machine's making (a full disk, a folder not writable) ended in a
    traceback after the work; it is one line naming the file. Any other stays a traceback."""
    import errno

    from training import commands

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/sheet.png")

    monkeypatch.setattr(commands, "_synth_preview", full)
    result = cli("synth-preview", "--out", "sheet.png")
    _one_line_error(result, "synth-preview", "No space left on device: /data/sheet.png")

    def bug(args):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(commands, "_synth_preview", bug)
    with pytest.raises(OSError, match="Bad file descriptor"):
        cli("synth-preview", "--out", "sheet.png")
