"""Real servers for tests: uvicorn on 127.0.0.1, in a thread (fast) or a subprocess (killable)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import uvicorn

from service.app import create_app
from service.settings import Settings

from .ports import free_port

WRITE_TOKEN = "vh_test_write_token"
READ_TOKEN = "vh_test_read_token"
ADMIN_TOKEN = "vh_test_admin_token"
TOKENS = f"writer:write:{WRITE_TOKEN};reader:read:{READ_TOKEN};root:admin:{ADMIN_TOKEN}"
TEST_ORGS = (
    "a",
    "auth",
    "bad",
    "big",
    "cli",
    "crash",
    "lfs",
    "load",
    "multi",
    "org",
    "other",
    "pa-ges",
    "pages",
    "pg",
    "pin",
    "plain",
    "race",
    "ready",
    "secret",
    "timm",
    "up",
    "vip",
)
"""The organisations the tests publish to: the writer and reader users are members of each
(a user writes only to its own namespace and its organisations')."""
ORGS = {org: ["writer", "reader"] for org in TEST_ORGS}


class ThreadedServer:
    """``create_app(settings)`` served by uvicorn in a daemon thread."""

    def __init__(self, settings: Settings, port: int | None = None):
        self.settings = settings
        self.port = port or free_port()
        self.app = create_app(settings)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                # uvicorn's own dictConfig would close every logging handler alive, absl's among
                # them (dp_accounting imports it), whose stream may be pytest's capture of an
                # earlier phase: closed, it fails the run in one process (`make test XDIST=`)
                log_config=None,
                timeout_graceful_shutdown=30,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def answers_while_waiting(
        self, target: object, method: str, send: Callable[[], httpx.Response]
    ) -> httpx.Response:
        """``send()``'s answer, sent from a thread while ``target.method``, which the request
        calls, waits until ``/healthz`` has answered: ``/healthz`` times out where the request
        calls it on the event loop, which it then holds."""
        calling, answered = threading.Event(), threading.Event()
        real = getattr(target, method)

        def waits(*args: object, **kwargs: object) -> object:
            calling.set()
            answered.wait(60)
            return real(*args, **kwargs)

        answers: list[httpx.Response] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(target, method, waits)
            request = threading.Thread(target=lambda: answers.append(send()))
            request.start()
            try:
                assert calling.wait(60), f"the request never called {method}"
                healthz = httpx.get(f"{self.url}/healthz", timeout=10).status_code
            finally:
                answered.set()
                request.join(120)
        assert healthz == 200 and answers, (healthz, answers)
        return answers[0]

    def hold_first_batch(self, repo_id: str, images: int) -> None:
        """Hold the next batch of loaded model ``repo_id`` until ``images`` images are in it or
        queued behind it, so that a test's concurrent requests batch together however they
        happen to arrive."""
        (model,) = [m for m in self.app.state.engine.loaded() if m.repo_id == repo_id]
        batcher = model.batcher
        run_batch = batcher._run_batch
        held = threading.Event()

        def run_after_the_rest_queue(items: list) -> None:
            if not held.is_set():
                held.set()
                deadline = time.monotonic() + 20  # within a request's own deadline
                while batcher.depth + sum(i.size for i in items) < images:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{images} images never queued")
                    time.sleep(0.01)
            run_batch(items)

        batcher._run_batch = run_after_the_rest_queue


def settings_for(store: Path, **overrides: object) -> Settings:
    """Test settings: the given store, the test tokens, overrides merged per section."""
    base: dict[str, object] = {"store": store, "auth": {"tokens": TOKENS, "orgs": ORGS}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}  # type: ignore[dict-item]
        else:
            base[key] = value
    return Settings(**base)


def raw_commit(
    url: str, repo: str, files: dict[str, bytes], token: str = WRITE_TOKEN
) -> httpx.Response:
    """POST a commit body as HfApi.create_commit sends it, without the client's own checks."""
    lines = [{"key": "header", "value": {"summary": "raw", "description": ""}}]
    lines += [
        {
            "key": "file",
            "value": {"path": p, "encoding": "base64", "content": base64.b64encode(b).decode()},
        }
        for p, b in files.items()
    ]
    return httpx.post(
        f"{url}/api/models/{repo}/commit/main",
        content="\n".join(map(json.dumps, lines)).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
        timeout=60,
    )


def lfs_lines(path: str, data: bytes, summary: str = "lfs") -> bytes:
    """A commit body (NDJSON) that adds ``path`` as the LFS object of content ``data``."""
    lines = [
        {"key": "header", "value": {"summary": summary, "description": ""}},
        {
            "key": "lfsFile",
            "value": {
                "path": path,
                "algo": "sha256",
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
            },
        },
    ]
    return "\n".join(map(json.dumps, lines)).encode()


def lfs_commit(
    url: str, repo: str, path: str, data: bytes, token: str = WRITE_TOKEN
) -> httpx.Response:
    """Commit ``path`` to ``repo``'s main as the uploaded LFS object of content ``data``."""
    return httpx.post(
        f"{url}/api/models/{repo}/commit/main",
        content=lfs_lines(path, data, f"add {path}"),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
        timeout=60,
    )


def lfs_batch(
    url: str, repo: str, data: bytes, token: str = WRITE_TOKEN, verify: ssl.SSLContext | bool = True
) -> dict:
    """The LFS batch reply's entry for one object of content ``data`` (``verify``: the TLS
    context to check ``url``'s certificate with)."""
    reply = httpx.post(
        f"{url}/{repo}.git/info/lfs/objects/batch",
        json={
            "operation": "upload",
            "objects": [{"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}],
        },
        headers={"Authorization": f"Bearer {token}"},
        verify=verify,
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["objects"][0]


def lfs_part_urls(upload: dict) -> list[str]:
    """An ``upload`` action's presigned part URLs, in order (none for a single PUT)."""
    header = upload.get("header") or {}
    return [header[str(n)] for n in range(1, len(header))]


def lfs_complete(upload: dict, oid: str, etags: list[str]) -> httpx.Response:
    """The completion POST of a multipart upload (part n's ETag ``etags[n - 1]``)."""
    parts = [{"partNumber": n, "etag": e} for n, e in enumerate(etags, 1)]
    return httpx.post(upload["href"], json={"oid": oid, "parts": parts}, timeout=60)


def lfs_send(upload: dict, oid: str, data: bytes) -> None:
    """Send ``data`` as an LFS ``upload`` action says: one presigned PUT, or a presigned PUT
    per part then the completion POST (as huggingface_hub does)."""
    if "chunk_size" not in (upload.get("header") or {}):
        assert httpx.put(upload["href"], content=data, timeout=60).status_code == 200
        return
    chunk = int(upload["header"]["chunk_size"])
    etags = [
        httpx.put(url, content=data[i * chunk : (i + 1) * chunk], timeout=60).headers["etag"]
        for i, url in enumerate(lfs_part_urls(upload))
    ]
    assert lfs_complete(upload, oid, etags).is_success


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port`` (Linux's
    /proc): so a test never mistakes another process that took a freed port for its server."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:
            return True
    return False


def commit_body(folder: Path) -> bytes:
    """An NDJSON commit body adding every file of ``folder`` inline (base64)."""
    from vip_hub.repo.verify import repo_files

    lines: list[dict[str, object]] = [
        {"key": "header", "value": {"summary": "v2", "description": ""}}
    ]
    for rel, path in repo_files(folder).items():
        content = base64.b64encode(path.read_bytes()).decode()
        lines.append(
            {"key": "file", "value": {"content": content, "path": rel, "encoding": "base64"}}
        )
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def start_request(
    url: str, method: str, target: str, body: bytes, send: int, headers: dict[str, str]
) -> socket.socket:
    """Open a connection to ``url`` and send a request's head and the first ``send`` bytes of
    its ``body`` (the rest with ``sock.sendall``); :func:`read_response` reads the answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Length": len(body)}.items())
    with contextlib.suppress(ConnectionError):  # the server may reach its crash point meanwhile
        sock.sendall(head.encode() + b"\r\n" + body[:send])
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of the HTTP response on ``sock``."""
    reply = http.client.HTTPResponse(sock)
    reply.begin()
    return reply.status, reply.read()


def start_commit(url: str, repo_id: str, body: bytes, send: int) -> socket.socket:
    """Start a commit POST of ``body`` to ``repo_id``'s main, sending ``send`` bytes of it."""
    headers = {"Authorization": f"Bearer {WRITE_TOKEN}", "Content-Type": "application/x-ndjson"}
    return start_request(url, "POST", f"/api/models/{repo_id}/commit/main", body, send, headers)


def start_lfs_put(url: str, repo_id: str, data: bytes, send: int) -> socket.socket:
    """Start the Git LFS PUT of ``data`` (its batch call first), sending ``send`` bytes of it."""
    oid = hashlib.sha256(data).hexdigest()
    batch = httpx.post(
        f"{url}/{repo_id}.git/info/lfs/objects/batch",
        headers={"Authorization": f"Bearer {WRITE_TOKEN}"},
        json={"operation": "upload", "objects": [{"oid": oid, "size": len(data)}]},
        timeout=60,
    ).json()
    href = batch["objects"][0]["actions"]["upload"]["href"]
    return start_request(url, "PUT", href.removeprefix(url), data, send, {})


class ProcessServer:
    """``vip-hub serve`` in its own process (so a test can SIGKILL it)."""

    def __init__(
        self,
        store: Path,
        port: int | None = None,
        extra_env: dict[str, str] | None = None,
        inference: bool = False,
    ):
        self.store, self.port, self.inference = store, port or free_port(), inference
        self.env = {
            **os.environ,
            "VIP_HUB_AUTH__TOKENS": TOKENS,
            "VIP_HUB_AUTH__ORGS": json.dumps(ORGS),
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        # its log (the access log included) in a file: a pipe nobody reads would fill and stall it
        self.log = store.parent / f"{store.name}-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProcessServer:
        script = Path(sys.executable).with_name("vip-hub")
        with open(self.log, "ab") as log:  # the process holds its own copy
            self.proc = subprocess.Popen(
                [
                    str(script),
                    "serve",
                    "--store",
                    str(self.store),
                    "--port",
                    str(self.port),
                    *([] if self.inference else ["--no-inference"]),
                ],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 120
        # one client for the polls: a client per poll loads the CA bundle each time, ten times
        # a second, on the CPU the server starting beside it needs
        with httpx.Client(timeout=1) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.log.read_text(errors="replace")[-4000:])
                try:
                    answered = client.get(self.url + "/healthz").status_code == 200
                    if answered and listens_on(self.proc.pid, self.port):
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
