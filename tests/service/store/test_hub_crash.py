"""A publish killed midway (inline content, or an LFS object and the commit naming it) leaves the
previous revision intact and served, or the new one whole. The server dies at a named crash
point (``VIP_HUB_CRASH_AT``, ``service/store/faults.py``), not after a guessed sleep."""

import base64
import hashlib
import json
import os
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, snapshot_download
from support.helpers import TINY, random_text, synthetic_stage, tiny_encoder
from support.live import WRITE_TOKEN, ProcessServer, commit_body, start_commit, start_lfs_put

from service.store.blobs import LFS_THRESHOLD
from service.store.faults import CRASH_ENV, CRASH_STATUS
from vip_hub import export_encoder, verify_repo
from vip_hub.repo.push import push_repo
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import CONFIG_FILE

pytestmark = pytest.mark.slow


def _lfs_commit_body(folder: Path, big: str) -> bytes:
    lines = [{"key": "header", "value": {"summary": "v2", "description": ""}}]
    for rel, path in repo_files(folder).items():
        if rel == big:
            data = path.read_bytes()
            lines.append(
                {
                    "key": "lfsFile",
                    "value": {
                        "path": rel,
                        "algo": "sha256",
                        "oid": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                    },
                }
            )
        else:
            lines.append(
                {
                    "key": "file",
                    "value": {
                        "content": base64.b64encode(path.read_bytes()).decode(),
                        "path": rel,
                        "encoding": "base64",
                    },
                }
            )
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _served(url: str, repo_id: str) -> str:
    api = HfApi(endpoint=url)
    sha = api.model_info(repo_id).sha
    folder = snapshot_download(
        repo_id, revision=sha, endpoint=url, cache_dir=os.environ["HF_HOME"] + "/crash"
    )
    assert verify_repo(folder).ok
    return sha


# (what is being sent, the crash point the server dies at, whether the commit was made)
CASES = [
    ("inline-commit", "upload-partial", False),  # half the commit body sent: killed mid-content
    ("lfs-upload", "upload-partial", False),  # half an LFS object sent: killed mid-object
    ("inline-commit", "commit-verified", False),
    ("inline-commit", "commit-indexed", True),
    ("lfs-commit", "commit-blobs-stored", False),
    ("lfs-commit", "commit-indexed", True),
]


@pytest.mark.parametrize(
    ("send", "step", "committed"), CASES, ids=[f"{s}-at-{p}" for s, p, _ in CASES]
)
def test_sigkill_mid_publish(tmp_path, send, step, committed):
    store = tmp_path / "store"
    server = ProcessServer(store).start()
    try:
        v1 = push_repo(
            export_encoder(
                tmp_path / "v1", tiny_encoder(0), TINY, [synthetic_stage()], model_name="m"
            ),
            "crash/m",
            endpoint=server.url,
            token=WRITE_TOKEN,
        )
    finally:
        server.stop()
    v2 = export_encoder(
        tmp_path / "v2",
        tiny_encoder(1),
        TINY,
        [synthetic_stage()],
        model_name="m",
        # just over the LFS threshold: a file clients upload and fetch the LFS way
        extra_files={"extra/noise.txt": random_text(LFS_THRESHOLD + 1024 * 1024)},
    )
    big = (v2 / "extra/noise.txt").read_bytes()
    server = ProcessServer(store, port=server.port, extra_env={CRASH_ENV: step}).start()
    try:
        if send == "lfs-upload":
            sock = start_lfs_put(server.url, "crash/m", big, len(big) // 2)
        elif send == "lfs-commit":  # the object arrives whole; the commit naming it dies
            start_lfs_put(server.url, "crash/m", big, len(big)).recv(4096)
            body = _lfs_commit_body(v2, "extra/noise.txt")
            sock = start_commit(server.url, "crash/m", body, len(body))
        else:
            body = commit_body(v2)
            sock = start_commit(
                server.url,
                "crash/m",
                body,
                len(body) // 2 if step == "upload-partial" else len(body),
            )
        assert (
            server.proc is not None and server.proc.wait(60) == CRASH_STATUS
        )  # it died at the step
        sock.close()
    finally:
        server.stop()
    restarted = ProcessServer(store, port=server.port).start()
    try:
        served = _served(restarted.url, "crash/m")
        history = [c.commit_id for c in HfApi(endpoint=restarted.url).list_repo_commits("crash/m")]
        assert history == ([served, v1] if committed else [v1]) and (served != v1) == committed
        if step == "upload-partial":
            assert not [
                p for p in (store / "uploads").rglob("*") if p.is_file()
            ]  # no partial object kept
        assert httpx.get(f"{restarted.url}/crash/m/resolve/{v1}/{CONFIG_FILE}").status_code == 200
        # and the store still takes new publishes
        v3 = push_repo(
            export_encoder(
                tmp_path / "v3", tiny_encoder(2), TINY, [synthetic_stage()], model_name="m"
            ),
            "crash/m",
            endpoint=restarted.url,
            token=WRITE_TOKEN,
        )
        assert _served(restarted.url, "crash/m") == v3
    finally:
        restarted.stop()
