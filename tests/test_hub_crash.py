"""A publish killed with SIGKILL midway (inline content, or an LFS object and the commit naming it)
leaves the previous revision intact and served."""

import base64
import hashlib
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, snapshot_download

from live import WRITE_TOKEN, ProcessServer
from vip_hub import verify_repo
from vip_hub.push import push_repo
from vip_hub.verify import repo_files

from conftest import TINY, export_encoder, synthetic_stage, tiny_encoder

pytestmark = pytest.mark.slow


def _commit_body(folder: Path) -> bytes:
    lines = [{"key": "header", "value": {"summary": "v2", "description": ""}}]
    for rel, path in repo_files(folder).items():
        lines.append({"key": "file", "value": {"content": base64.b64encode(path.read_bytes()).decode(),
                                               "path": rel, "encoding": "base64"}})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _start_commit(url: str, repo_id: str, body: bytes, send: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (f"POST /api/models/{repo_id}/commit/main HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {WRITE_TOKEN}\r\nContent-Type: application/x-ndjson\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body[:send])
    return sock


def _lfs_upload(url: str, repo_id: str, data: bytes, send: int) -> socket.socket:
    """Start the Git LFS PUT of ``data`` (its batch call first), sending ``send`` bytes of it."""
    oid = hashlib.sha256(data).hexdigest()
    batch = httpx.post(f"{url}/{repo_id}.git/info/lfs/objects/batch", headers={"Authorization": f"Bearer {WRITE_TOKEN}"},
                       json={"operation": "upload", "objects": [{"oid": oid, "size": len(data)}]}).json()
    href = batch["objects"][0]["actions"]["upload"]["href"].removeprefix(url)
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"PUT {href} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data[:send])
    return sock


def _lfs_commit_body(folder: Path, big: str) -> bytes:
    lines = [{"key": "header", "value": {"summary": "v2", "description": ""}}]
    for rel, path in repo_files(folder).items():
        if rel == big:
            data = path.read_bytes()
            lines.append({"key": "lfsFile", "value": {"path": rel, "algo": "sha256",
                                                      "oid": hashlib.sha256(data).hexdigest(), "size": len(data)}})
        else:
            lines.append({"key": "file", "value": {"content": base64.b64encode(path.read_bytes()).decode(),
                                                   "path": rel, "encoding": "base64"}})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _served(url: str, repo_id: str) -> str:
    api = HfApi(endpoint=url)
    sha = api.model_info(repo_id).sha
    folder = snapshot_download(repo_id, revision=sha, endpoint=url, cache_dir=os.environ["HF_HOME"] + "/crash")
    assert verify_repo(folder).ok
    return sha


@pytest.mark.parametrize("when", ["mid-upload", "after-upload", "mid-lfs-upload", "lfs-commit"])
def test_sigkill_mid_publish(tmp_path, when):
    store = tmp_path / "store"
    server = ProcessServer(store).start()
    try:
        v1 = push_repo(export_encoder(tmp_path / "v1", tiny_encoder(0), TINY, [synthetic_stage()], model_name="m"),
                       "crash/m", endpoint=server.url, token=WRITE_TOKEN)
        v2 = export_encoder(tmp_path / "v2", tiny_encoder(1), TINY, [synthetic_stage()], model_name="m",
                            extra_files={"extra/noise.txt": os.urandom(24 * 1024 * 1024)})
        big = (v2 / "extra/noise.txt").read_bytes()
        if when == "mid-lfs-upload":  # killed while an LFS object streams in
            sock = _lfs_upload(server.url, "crash/m", big, len(big) // 2)
            time.sleep(0.2)
        elif when == "lfs-commit":  # the object arrived whole; killed while the commit naming it runs
            _lfs_upload(server.url, "crash/m", big, len(big)).recv(4096)
            body = _lfs_commit_body(v2, "extra/noise.txt")
            sock = _start_commit(server.url, "crash/m", body, len(body))
            time.sleep(0.3)
        else:
            body = _commit_body(v2)
            sock = _start_commit(server.url, "crash/m", body, len(body) // 2 if when == "mid-upload" else len(body))
            if when == "after-upload":
                time.sleep(0.4)  # parsing, verifying or moving blobs: kill it there
        server.kill()
        sock.close()
    finally:
        server.stop()
    restarted = ProcessServer(store, port=server.port).start()
    try:
        served = _served(restarted.url, "crash/m")
        history = [c.commit_id for c in HfApi(endpoint=restarted.url).list_repo_commits("crash/m")]
        if when in ("mid-upload", "mid-lfs-upload"):
            assert served == v1 and history == [v1]
            assert not [p for p in (store / "uploads").rglob("*") if p.is_file()]  # no partial object kept
        else:  # the commit either happened whole or not at all
            assert history in ([v1], [served, v1])
        assert httpx.get(f"{restarted.url}/crash/m/resolve/{v1}/config.json").status_code == 200
        # and the store still takes new publishes
        v3 = push_repo(export_encoder(tmp_path / "v3", tiny_encoder(2), TINY, [synthetic_stage()], model_name="m"),
                       "crash/m", endpoint=restarted.url, token=WRITE_TOKEN)
        assert _served(restarted.url, "crash/m") == v3
    finally:
        restarted.stop()
