"""Graceful drain: a real ``vip-hub serve`` process sent SIGTERM stops accepting connections at
once, finishes what is in flight (an LFS upload, a commit, inference batches), then exits;
what it finished is stored and served after a restart."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import signal
import socket
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from support.helpers import random_text, tiny_repo_with_head
from support.live import (
    WRITE_TOKEN,
    ProcessServer,
    commit_body,
    read_response,
    start_commit,
    start_lfs_put,
    start_request,
)

from service.store import HubStore
from vip_hub.repo.push import push_repo

pytestmark = pytest.mark.slow

REPO = "load/drain"
AUTH = {"Authorization": f"Bearer {WRITE_TOKEN}"}


def _png(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r"^vip_hub_requests_in_flight (\S+)$", text, re.M).group(1))


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_drains_uploads_commits_and_batches(tmp_path):
    store = tmp_path / "store"
    server = ProcessServer(store, inference=True).start()
    try:
        first = push_repo(
            tiny_repo_with_head(tmp_path / "v1"), REPO, token=WRITE_TOKEN, endpoint=server.url
        )
        embed = {"model": REPO, "input": [_png(0)]}
        warm = httpx.post(f"{server.url}/v1/embeddings", json=embed, timeout=120)
        assert warm.status_code == 200, warm.text  # the model is loaded: batches run at once
        # in flight when SIGTERM comes: every request's head and all but its last byte sent
        blob = random_text(4 * 1024 * 1024)
        upload = start_lfs_put(server.url, REPO, blob, len(blob) - 1)
        body = commit_body(tiny_repo_with_head(tmp_path / "v2", seed=1))
        commit = start_commit(server.url, REPO, body, len(body) - 1)
        batches = []
        for i in range(3):
            data = json.dumps({"model": REPO, "input": [_png(i), _png(i + 10)]}).encode()
            sock = start_request(
                server.url,
                "POST",
                "/v1/embeddings",
                data,
                len(data) - 1,
                {"Content-Type": "application/json"},
            )
            batches.append((sock, data))
        while _in_flight(server.url) < 6:  # the 5 above and this /metrics call: heads parsed
            time.sleep(0.05)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while not _refused(server.url):  # it stops accepting at once
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        assert server.proc.poll() is None  # and waits for what is in flight
        upload.sendall(blob[-1:])
        commit.sendall(body[-1:])
        for sock, data in batches:
            sock.sendall(data[-1:])
        assert read_response(upload)[0] == 200
        status, reply = read_response(commit)
        assert status == 200, reply
        second = json.loads(reply)["commitOid"]
        for sock, _ in batches:
            status, reply = read_response(sock)
            assert status == 200 and len(json.loads(reply)["data"]) == 2
        # drained, it ends by the signal's default action, as uvicorn re-raises it after shutdown
        assert server.proc.wait(60) == -signal.SIGTERM
    finally:
        server.stop()
    stored = HubStore(store)  # what it finished while draining is in the store
    assert [c.sha for c in stored.history(REPO)] == [second, first]
    oid = hashlib.sha256(blob).hexdigest()
    assert stored.held_for(REPO, oid) == len(blob)  # a commit may name the drained upload
