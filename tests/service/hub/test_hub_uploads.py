"""Uploads: the exact commit-body parser, the Git LFS batch API, and the collection of uploads
never committed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download, snapshot_download
from support.helpers import tiny_repo_with_head
from support.live import ADMIN_TOKEN, WRITE_TOKEN, lfs_batch

from service.errors import BadRequest
from service.hub.uploads import CommitParser
from service.store import AddFile, AddObject, DeleteFile, HubStore, clock
from service.store.errors import UploadMissing
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import WEIGHTS_FILE, WEIGHTS_SUFFIX


@pytest.fixture
def store(tmp_path) -> HubStore:
    return HubStore(tmp_path / "store")


def _parse(store: HubStore, body: bytes, piece: int) -> object:
    parser = CommitParser(store.blobs, store.limits)
    try:
        for i in range(0, len(body), piece):
            parser.feed(body[i : i + piece])
        return parser.finish()
    except BaseException:
        parser.discard()
        raise


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_parser_reads_every_line_exactly_whatever_the_pieces(store, piece):
    data = os.urandom(5000)
    encoded = base64.b64encode(data).decode()
    lines = [
        '{"value": {"summary": "s \\" q", "parentCommit": null, "description": "d\\nd"}, '
        '"key": "header"}',
        # key order free, escaped '/' in the base64, a path with an escaped quote and unicode
        json.dumps(
            {
                "value": {"path": 'a"b/ü.bin', "encoding": "base64", "content": encoded},
                "key": "file",
            }
        ).replace("/", "\\/"),
        '{"key": "file", "value": {"content": "'
        + encoded[:8].replace("/", "\\u002f")
        + '", "path": "x"}}',
        f'{{"key": "lfsFile", "value": {{"path": "w{WEIGHTS_SUFFIX}", "algo": "sha256", "oid": "'
        + "ab" * 32
        + '"}}',
        "",  # a blank line is skipped
        '{"key": "deletedFile", "value": {"path": "old.txt"}}',
    ]
    commit = _parse(store, "\n".join(lines).encode(), piece)
    assert (
        commit.summary == 's " q' and commit.description == "d\nd" and commit.parent_commit is None
    )
    first, second, lfs, deleted = commit.operations
    assert (
        isinstance(first, AddFile)
        and first.path == 'a"b/ü.bin'
        and first.source.read_bytes() == data
    )
    assert isinstance(second, AddFile) and second.source.read_bytes() == data[:6]
    assert lfs == AddObject(f"w{WEIGHTS_SUFFIX}", "ab" * 32) and deleted == DeleteFile("old.txt")
    commit.discard()
    assert not list(store.blobs.tmp.iterdir())


@pytest.mark.parametrize(
    "body,message",
    [
        (
            b'{"key": "file", "value": {"path": "a", "content": ""}}\n',
            "commit line 1: the first line must be the header",
        ),
        (
            b'{"key": "header", "value": {}}\n'
            b'{"key": "file", "value": {"path": "a", "content": "@@@@"}}\n',
            "commit line 2: content is not base64",
        ),
        (
            b'{"key": "header", "value": {}}\n'
            b'{"key": "file", "value": {"path": "a", "content": "QUJD"}}}\n',
            "commit line 2: unexpected '}'",
        ),
        (
            b'{"key": "header", "value": {}}\n\n{"key": "file" "value": 1}\n',
            "commit line 3: not valid JSON",
        ),
        (
            b'{"key": "header", "value": {}}\n'
            b'{"key": "file", "value": {"path": "a", "content": "QUJD',
            "commit line 2: the body ends inside the line",
        ),
        (
            b'{"key": "header", "value": {}}\n'
            b'{"key": "file", "value": {"path": "a", "content": "QU\nJD"}}\n',
            "commit line 2: a line ends inside a string",
        ),
        (
            b'{"key": "header", "value": {}}\n{"key": "nope", "value": {}}\n',
            "commit line 2: unknown key 'nope'",
        ),
        (
            b'{"key": "header", "value": {}}\n'
            b'{"key": "file", "value": {"path": "a", "content": "QQ==QUJD"}}\n',
            "commit line 2: content has base64 data after its padding",
        ),
        (
            b'{"key": "header", "value": {}}\n'
            b'{"key": "lfsFile", "value": {"path": "a", "oid": 5}}\n',
            "commit line 2: an lfsFile line needs 'oid'",
        ),
    ],
)
def test_malformed_bodies_name_the_line(store, body, message):
    with pytest.raises(BadRequest) as err:
        _parse(store, body, 3)
    assert message in err.value.message
    assert not list(store.blobs.tmp.iterdir())  # no temp file left behind


def test_malformed_commit_is_a_400_naming_the_line(hub, published):
    body = (
        b'{"key": "header", "value": {"summary": "x"}}\n'
        b'{"key": "file", "value": {"path": "a", "content": "%%"}}\n'
    )
    r = httpx.post(
        f"{hub.url}/api/models/vip/vip-nano-test/commit/main",
        content=body,
        headers={"Authorization": f"Bearer {WRITE_TOKEN}", "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 400 and r.json()["error"] == "commit line 2: content is not base64"


def test_a_commit_line_nested_too_deeply_is_a_400_naming_the_line(hub, published):
    """A line of 5000 nested arrays made ``json.loads`` raise RecursionError: a 500."""
    body = b'{"key": "header", "value": {"summary": "x"}}\n' + b"[" * 5000 + b"]" * 5000 + b"\n"
    r = httpx.post(
        f"{hub.url}/api/models/vip/vip-nano-test/commit/main",
        content=body,
        headers={"Authorization": f"Bearer {WRITE_TOKEN}", "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 400 and r.json()["error"].startswith("commit line 2: not valid JSON")
    assert not list(hub.app.state.store.blobs.tmp.iterdir())


@pytest.mark.parametrize(
    "header,message",
    [
        ('{"summary": "a\\ud800b"}', "commit line 1: the header's 'summary' is not UTF-8 text"),
        (
            '{"summary": "s", "description": "\\udfff"}',
            "commit line 1: the header's 'description' is not UTF-8 text",
        ),
        (
            '{"parentCommit": "a\\ud800b"}',
            "commit line 1: the header's 'parentCommit' is not UTF-8 text",
        ),
        ('{"parentCommit": 5}', "commit line 1: 'parentCommit' must be a commit id"),
    ],
)
def test_a_header_the_store_cannot_keep_is_a_400_naming_it(hub, published, header, message):
    """A lone surrogate in the header's texts was a 500 (SQLite, or the error naming it, cannot
    encode it); a parentCommit that is no commit id was ignored (a commit made unchecked)."""
    head = HfApi().model_info("vip/vip-nano-test").sha
    r = httpx.post(
        f"{hub.url}/api/models/vip/vip-nano-test/commit/main",
        content=b'{"key": "header", "value": ' + header.encode() + b"}\n",
        headers={"Authorization": f"Bearer {WRITE_TOKEN}", "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 400 and r.json()["error"].startswith(message), r.text
    assert HfApi().model_info("vip/vip-nano-test").sha == head


def test_git_lfs_batch_api(hub, tmp_path):
    """File objects make huggingface_hub use the Git LFS batch API (its path without Xet):
    the weights go through batch, PUT and verify, the commit names them by SHA-256."""
    folder = tiny_repo_with_head(tmp_path / "lfs")
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("lfs/basic")
    handles = {rel: open(path, "rb") for rel, path in repo_files(folder).items()}
    try:
        info = api.create_commit(
            "lfs/basic",
            [CommitOperationAdd(rel, f) for rel, f in handles.items()],
            commit_message="via LFS",
        )
    finally:
        for f in handles.values():
            f.close()
    weights = (folder / WEIGHTS_FILE).read_bytes()
    oid = hashlib.sha256(weights).hexdigest()
    assert hub.app.state.store.blobs.exists(oid)
    snap = Path(snapshot_download("lfs/basic", revision=info.oid, cache_dir=tmp_path / "cache"))
    assert (snap / WEIGHTS_FILE).read_bytes() == weights

    batch = httpx.post(
        f"{hub.url}/lfs/basic.git/info/lfs/objects/batch",
        headers={"Authorization": f"Bearer {WRITE_TOKEN}"},
        json={
            "operation": "upload",
            "transfers": ["basic"],
            "objects": [{"oid": oid, "size": len(weights)}, {"oid": "cd" * 32, "size": 3}],
        },
    ).json()
    held, missing = batch["objects"]
    assert "actions" not in held  # already stored: nothing to send
    href = missing["actions"]["upload"]["href"]
    assert httpx.put(href, content=b"abc").status_code == 400  # not the announced bytes
    assert httpx.put(href.replace("grant=", "grant=1"), content=b"abc").status_code == 401
    assert (
        httpx.post(
            missing["actions"]["verify"]["href"],
            json={"oid": "cd" * 32, "size": 3},
            headers={"Authorization": f"Bearer {WRITE_TOKEN}"},
        ).status_code
        == 404
    )


def test_uncommitted_bytes_per_user_are_capped_until_their_commit(hub, tmp_path, monkeypatch):
    """A user's LFS objects count against ``hub.max_uncommitted_bytes`` from their batch reply
    until a commit names them or their time-to-live passes; asking again for an object renews
    its count (root: no other test of this module uploads as root)."""
    limits, api = hub.app.state.store.limits, HfApi(token=ADMIN_TOKEN)
    api.create_repo("lfs/quota")
    monkeypatch.setattr(limits, "max_uncommitted_bytes", 3 * 4096)
    objects = [bytes([n]) * 4096 for n in range(5)]
    first = [lfs_batch(hub.url, "lfs/quota", data, ADMIN_TOKEN) for data in objects[:3]]
    assert all("actions" in e for e in first), first
    over = lfs_batch(hub.url, "lfs/quota", objects[3], ADMIN_TOKEN)
    assert "actions" not in over and over["error"]["code"] == 429, over
    assert "not yet committed" in over["error"]["message"]
    assert "hub.max_uncommitted_bytes" in over["error"]["message"]
    assert "actions" in lfs_batch(hub.url, "lfs/quota", objects[0], ADMIN_TOKEN)  # renewed

    # a commit through LFS (file objects): its objects count while sent, not once committed
    folder = tiny_repo_with_head(tmp_path / "quota")
    files = repo_files(folder)
    sent = sum(path.stat().st_size for path in files.values())
    monkeypatch.setattr(limits, "max_uncommitted_bytes", 3 * 4096 + sent)
    handles = {rel: open(path, "rb") for rel, path in files.items()}
    try:
        api.create_commit(
            "lfs/quota",
            [CommitOperationAdd(rel, f) for rel, f in handles.items()],
            commit_message="via LFS",
        )
    finally:
        for f in handles.values():
            f.close()
    monkeypatch.setattr(limits, "max_uncommitted_bytes", 4 * 4096)
    assert "actions" in lfs_batch(hub.url, "lfs/quota", objects[3], ADMIN_TOKEN)
    assert "error" in lfs_batch(hub.url, "lfs/quota", objects[4], ADMIN_TOKEN)

    ahead = clock.now() + limits.upload_ttl_s + 60 - time.time()  # the uploads expire
    monkeypatch.setattr(clock, "now", lambda: time.time() + ahead)
    assert "actions" in lfs_batch(hub.url, "lfs/quota", objects[4], ADMIN_TOKEN)


def test_uploads_never_committed_are_collected(store, tmp_path):
    data = b"weights" * 1000
    oid = hashlib.sha256(data).hexdigest()
    tmp = store.blobs.new_temp()
    tmp.write_bytes(data)
    store.blobs.stage_upload(tmp, oid)
    assert store.collect_uploads() == 0 and store.blobs.object_size(oid) == len(data)
    old = os.path.getmtime(store.blobs.upload_path(oid)) - store.limits.upload_ttl_s - 1
    os.utime(store.blobs.upload_path(oid), (old, old))
    assert store.collect_uploads() == 1 and store.blobs.object_path(oid) is None
    store.create_repo("vip/m")
    with pytest.raises(UploadMissing, match="never uploaded"):
        store.commit("vip/m", [AddObject(WEIGHTS_FILE, oid)])


def _commit_lines(hub, lines: list[dict]) -> httpx.Response:
    return httpx.post(
        f"{hub.url}/api/models/vip/vip-nano-test/commit/main",
        content="\n".join(json.dumps(line) for line in lines).encode(),
        headers={"Authorization": f"Bearer {WRITE_TOKEN}", "Content-Type": "application/x-ndjson"},
    )


def test_an_lfs_lines_size_is_checked_and_the_file_is_listed_as_lfs(hub, published, tmp_path):
    """An ``lfsFile`` line's size was never read: a claim of 5, "huge" or -1 for a 6,001-byte
    object was committed. And a small text file committed that way was listed as a plain file
    (no ``lfs``, its ETag a git id) under its LFS pointer's git id: it is an LFS file, as the
    Hugging Face Hub keeps one."""
    data = b"x" * 6001
    oid = hashlib.sha256(data).hexdigest()
    upload = lfs_batch(hub.url, "vip/vip-nano-test", data)["actions"]["upload"]
    assert httpx.put(upload["href"], content=data).status_code == 200
    header = {"key": "header", "value": {"summary": "notes"}}
    head = HfApi().model_info("vip/vip-nano-test").sha
    for size, message in [
        (5, "notes.txt: the commit says object " + oid + " holds 5 bytes; the upload holds 6,001"),
        ("huge", "commit line 2: an lfsFile line's 'size' must be a byte count, not 'huge'"),
        (-1, "commit line 2: an lfsFile line's 'size' must be a byte count, not -1"),
        (True, "commit line 2: an lfsFile line's 'size' must be a byte count, not True"),
    ]:
        line = {"path": "notes.txt", "algo": "sha256", "oid": oid, "size": size}
        r = _commit_lines(hub, [header, {"key": "lfsFile", "value": line}])
        assert r.status_code == 400 and message in r.json()["error"], (size, r.text)
    assert HfApi().model_info("vip/vip-nano-test").sha == head
    line = {"path": "notes.txt", "algo": "sha256", "oid": oid, "size": len(data)}
    assert _commit_lines(hub, [header, {"key": "lfsFile", "value": line}]).status_code == 200
    (entry,) = [e for e in HfApi().list_repo_tree("vip/vip-nano-test") if e.path == "notes.txt"]
    assert entry.lfs is not None and (entry.lfs.sha256, entry.lfs.size) == (oid, len(data))
    r = httpx.head(f"{hub.url}/vip/vip-nano-test/resolve/main/notes.txt")
    assert r.headers["ETag"] == f'"{oid}"' and r.headers["X-Linked-Size"] == str(len(data))
    got = hf_hub_download("vip/vip-nano-test", "notes.txt", cache_dir=tmp_path / "cache")
    assert Path(got).read_bytes() == data  # huggingface_hub checks it against that ETag


@pytest.mark.parametrize("path", ["docs./a.md", "notes.txt ", "a:b.txt", "con.txt", "nul/x.md"])
def test_a_path_windows_cannot_write_as_named_is_a_400(hub, published, path):
    """Each was committed: ``docs./a.md`` beside ``docs/a.md`` is one file on Windows, ``a:b.txt``
    a data stream of ``a``, ``con.txt`` the console."""
    line = {"path": path, "content": base64.b64encode(b"hello\n").decode()}
    r = _commit_lines(
        hub, [{"key": "header", "value": {"summary": "x"}}, {"key": "file", "value": line}]
    )
    assert r.status_code == 400 and "a download to Windows could not write it" in r.json()["error"]
