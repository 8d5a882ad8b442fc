"""Bad input to the ``vip-hub`` commands that do not train: a one-line error naming what was
wrong and exit status 1, never a traceback, and nothing stored left behind or half-written."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.ports import free_port

from vip_hub.cli.main import main
from vip_hub.repo_format import SIGNATURE_FILE


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


def test_push_to_an_unreachable_hub_is_a_one_line_error(tiny_repo, cli):
    """A hub that cannot be reached, an endpoint that is no URL, or a repo id the hub client
    refuses: one line naming it (each was an httpx or huggingface_hub traceback)."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    down = cli("push", tiny_repo, "org/name", "--endpoint", endpoint, "--token", "t")
    _one_line_error(down, "push", "cannot reach the hub", endpoint)
    no_url = cli("push", tiny_repo, "org/name", "--endpoint", "hub.example", "--token", "t")
    _one_line_error(no_url, "push", "hub.example")
    bad_id = cli("push", tiny_repo, "../../etc", "--endpoint", endpoint, "--token", "t")
    _one_line_error(bad_id, "push", "'../../etc'")
    for bad in ("http://localhost:abc", "http://[::1", "http://127.0.0.1:99999"):  # tracebacks
        no_port = cli("push", tiny_repo, "org/name", "--endpoint", bad, "--token", "t")
        _one_line_error(no_port, "push", repr(bad))


@pytest.fixture
def web_page():
    """A local web server that answers every request with an HTML page (a mistyped endpoint)."""

    class Page(http.server.BaseHTTPRequestHandler):
        def _page(self) -> None:
            body = b"<!doctype html><title>welcome</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_POST = do_HEAD = _page

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_hub_that_answers_a_web_page_is_a_one_line_error(tiny_repo, cli, web_page, tmp_path):
    """An endpoint that answers HTML made ``push`` and ``caption`` end in a JSONDecodeError
    traceback."""
    pushed = cli("push", tiny_repo, "org/name", "--endpoint", web_page, "--token", "t")
    _one_line_error(pushed, "push", "pushing 'org/name'", web_page, "not JSON")
    image = tmp_path / "a.png"
    image.write_bytes(b"")
    with pytest.MonkeyPatch.context() as patch:
        from huggingface_hub import constants

        patch.setattr(constants, "ENDPOINT", web_page)
        captioned = cli("caption", "org/name", str(image))
    _one_line_error(captioned, "caption", "downloading org/name", "not JSON")


def test_push_with_the_hub_client_offline_is_a_one_line_error(tiny_repo, tmp_path):
    """``HF_HUB_OFFLINE=1`` made ``push`` end in an OfflineModeIsEnabled traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vip_hub.cli.main",
            "push",
            str(tiny_repo),
            "org/name",
            "--token",
            "t",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "HF_HUB_OFFLINE is set" in lines[0], done.stderr


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
    unwritable = tmp_path / "sheet.psd"  # a format Pillow reads only (a KeyError traceback)
    blp = tmp_path / "sheet.blp"  # a format Pillow writes, not in RGB (a ValueError traceback)
    for out in (tmp_path, tmp_path / "sheet.notanext", unwritable, blp, file / "sheet.png", folder):
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


def test_a_folder_where_a_file_goes_is_a_one_line_error_and_replaces_nothing(tiny_repo, cli):
    """A folder named like the signature or a key file, or a work folder under a file: one line
    naming it (each was an IsADirectoryError or NotADirectoryError traceback, naming a temporary
    file); ``key create --overwrite`` wrote the new private key, then failed on the public one,
    leaving a pair that does not match and the old private key gone."""
    keys = tiny_repo.parent / "keys"
    assert cli("key", "create", "--dir", keys).returncode == 0
    (tiny_repo / SIGNATURE_FILE).mkdir()
    signed = cli("sign", tiny_repo, "--key", keys / "signing.key")
    _one_line_error(signed, "sign", str(tiny_repo / SIGNATURE_FILE))
    private = (keys / "signing.key").read_bytes()
    (keys / "signing.pub").unlink()
    (keys / "signing.pub").mkdir()
    again = cli("key", "create", "--dir", keys, "--overwrite")
    _one_line_error(again, "key", str(keys / "signing.pub"))
    assert (keys / "signing.key").read_bytes() == private
    work = tiny_repo.parent / "notes.txt"
    work.write_text("mine")
    _one_line_error(cli("run", "--work-dir", work / "run"), "run", str(work / "run"))


@pytest.mark.parametrize("content", [b"\xff", b"[1]", b'{"a": 1}', b"{"])
def test_a_corrupt_record_of_the_jobs_steps_is_a_one_line_error(tmp_path, cli, content):
    """``steps.json`` not what the job writes (it is written whole now): one line naming it, not
    a UnicodeDecodeError, AttributeError or JSONDecodeError traceback."""
    (tmp_path / "steps.json").write_bytes(content)
    ran = cli("run", "--work-dir", tmp_path, "--data", tmp_path / "none")
    _one_line_error(ran, "run", str(tmp_path / "steps.json"), "remove it")


def test_a_corrupt_store_is_a_one_line_error(tmp_path, cli):
    """A tokens file that is no UTF-8 text, or an index that is no SQLite database: one line
    naming it (each was a traceback), for every admin command."""
    store = tmp_path / "hub"
    store.mkdir()
    (store / "tokens.json").write_bytes(b"\xff")
    made = cli("token", "create", "--name", "bob", "--store", store)
    _one_line_error(made, "token", str(store / "tokens.json"), "not UTF-8")
    (store / "tokens.json").write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError
    made = cli("token", "create", "--name", "bob", "--store", store)
    _one_line_error(made, "token", str(store / "tokens.json"), "nested too deeply")
    store = tmp_path / "damaged"
    store.mkdir()
    (store / "index.sqlite").write_text("garbage")
    for command in (("token", "list"), ("trust", "list"), ("store", "check")):
        _one_line_error(cli(*command, "--store", store), command[0], "index cannot be read")


_STAGE = ("--private-dataset", "org/x", "--sigma", "1", "--batch-size", "2", "--steps", "5",
          "--clip", "1")  # fmt: skip
"""A DP stage's options of ``import-mae``, but its dataset size."""


def _import_mae(cli, tmp_path: Path, *options: str) -> SimpleNamespace:
    """``import-mae`` of an empty checkpoint into ``tmp_path / "out"`` with ``options``."""
    checkpoint = tmp_path / "mae.pth"
    checkpoint.write_bytes(b"")
    return cli("import-mae", checkpoint, "--out", tmp_path / "out", "--arch", "vip-nano", *options)


def test_an_import_of_an_empty_private_dataset_is_a_one_line_error(tmp_path, cli):
    """``--dataset-size 0`` was a pydantic ValidationError traceback (q = B / n)."""
    imported = _import_mae(cli, tmp_path, *_STAGE, "--dataset-size", "0")
    _one_line_error(imported, "import-mae", "--dataset-size 0")
    assert not (tmp_path / "out").exists()


def test_numbers_out_of_range_are_one_line_errors(tmp_path, cli):
    """A dataset size past 2^53, an image 10^11 pixels wide, a subnormal sample rate: each was a
    traceback (pydantic's, timm's, dp_accounting's)."""
    huge_n = _import_mae(cli, tmp_path, *_STAGE, "--dataset-size", str(10**23))
    _one_line_error(huge_n, "import-mae", f"--dataset-size {10**23}", "2^53")
    wide = _import_mae(cli, tmp_path, "--synthetic-dataset", "shaders", "--img-size", str(10**11))
    _one_line_error(wide, "import-mae", f"img_size {10**11}", "at most 4096")
    assert not (tmp_path / "out").exists()
    q = cli("epsilon", "--sigma", "1", "--sample-rate", "1e-310", "--steps", "5",
            "--delta", "1e-5", "--accountant", "pld")  # fmt: skip
    _one_line_error(q, "epsilon", "a normal float")


def test_a_delta_of_zero_is_refused_not_replaced_by_the_default(tmp_path, cli):
    """``--delta 0`` read as "not given" (``args.delta or default``): the ledger stated 1/(2n)."""
    imported = _import_mae(cli, tmp_path, *_STAGE, "--dataset-size", "1000", "--delta", "0")
    _one_line_error(imported, "import-mae", "delta must be in (0, 1), got 0.0")
    assert not (tmp_path / "out").exists()


def test_a_token_or_endpoint_that_cannot_be_sent_is_a_one_line_error(tiny_repo, cli, monkeypatch):
    """A curly quote pasted into the token, or a byte the shell could not decode in the endpoint,
    was a UnicodeEncodeError traceback from the HTTP client."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    pasted = cli("push", tiny_repo, "org/name", "--endpoint", endpoint, "--token", "hf_abc\u2019")
    _one_line_error(pasted, "push", "not ASCII")
    monkeypatch.setenv("HF_TOKEN", "hf_abc\u2019")
    from_env = cli("push", tiny_repo, "org/name", "--endpoint", endpoint)
    _one_line_error(from_env, "push", "HF_TOKEN", "not ASCII")
    undecodable = cli(
        "push", tiny_repo, "org/name", "--endpoint", "http://h\udcffx/", "--token", "t"
    )
    _one_line_error(undecodable, "push", "hub endpoint")


def test_a_member_name_no_user_could_hold_is_refused(tmp_path, cli):
    """``org add --member`` took any text: a newline and a tab faked lines of ``org list``."""
    store = tmp_path / "hub"
    assert cli("token", "create", "--name", "ann", "--store", store).returncode == 0
    for bad in ("x\nfake\tmember", "../x"):
        added = cli("org", "add", "vip", "--member", bad, "--store", store)
        _one_line_error(added, "org", "invalid user")
    listed = cli("org", "list", "--store", store)
    assert "fake" not in listed.stdout and "../x" not in listed.stdout


def test_serve_on_a_port_in_use_is_a_one_line_error(tmp_path, cli):
    """uvicorn logged a port in use (or a host that does not resolve) over six lines and exited
    3; the address is now checked first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = cli("serve", "--store", tmp_path / "hub", "--host", "127.0.0.1", "--port", port)
    _one_line_error(served, "serve", f"cannot listen on 127.0.0.1:{port}")
    unknown = cli("serve", "--store", tmp_path / "hub", "--host", "no-such-host.invalid")
    _one_line_error(unknown, "serve", "cannot listen on no-such-host.invalid")
