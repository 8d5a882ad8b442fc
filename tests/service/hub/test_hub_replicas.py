"""Stateless replicas: two ``vip-hub serve`` processes share one PostgreSQL index and one
SeaweedFS bucket behind nginx (the shipped ``docker/nginx.conf``), each with a folder of its
own. Unmodified clients (huggingface_hub with presigned LFS and with Xet, timm, openai) work
through the balancer, a repo at real size (395 MB, presigned LFS) included; what one replica
issued (tokens, upload grants, upload records) the other honours; a replica killed at a crash
point in the middle of an upload or a commit loses nothing: the client sends the request again
through nginx, the other replica completes it, and no commit names a missing or unverified
object."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import huggingface_hub
import openai
import psycopg
import pytest
import timm
import torch
from conftest import HUB_PORT
from huggingface_hub import HfApi, snapshot_download
from PIL import Image
from safetensors.torch import load_file
from support.helpers import base_size_repo, random_text, tiny_repo_with_head
from support.live import WRITE_TOKEN, ProcessServer, lfs_lines
from support.ports import free_port
from support.system import Nginx

from service.store.faults import CRASH_ENV, CRASH_STATUS
from service.store.s3 import blob_key
from vip_hub.cli.main import main
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import WEIGHTS_FILE

pytestmark = pytest.mark.slow

BUCKET = "vip-hub-replicas"  # this module's own: no other test's index names its objects
AUTH = {"Authorization": f"Bearer {WRITE_TOKEN}"}
HTTP = httpx.Client(timeout=120)  # generous: 2 shared cores, replicas killed mid-request


@pytest.fixture(scope="module")
def shared(postgres, seaweed) -> dict[str, str]:
    """What every replica is given: the index and the object store (credentials: the
    ``seaweed`` fixture's environment)."""
    seaweed.client().create_bucket(Bucket=BUCKET)
    return {
        "VIP_HUB_INDEX": postgres,
        "VIP_HUB_OBJECT_STORE__ENDPOINT": seaweed.url,
        "VIP_HUB_OBJECT_STORE__BUCKET": BUCKET,
    }


def _start(servers: list[ProcessServer]) -> None:
    errors: list[BaseException] = []

    def start(server: ProcessServer) -> None:
        try:
            server.start()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]


@pytest.fixture(scope="module")
def replicas(shared, tmp_path_factory):
    """Two replicas (hub and inference), each with a store folder of its own."""
    servers = [
        ProcessServer(tmp_path_factory.mktemp(f"replica-{i}"), extra_env=shared, inference=True)
        for i in range(2)
    ]
    _start(servers)
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def balancer(replicas, tmp_path_factory):
    """nginx on HF_ENDPOINT's port (where unmodified clients go) in front of both replicas."""
    addresses = [f"127.0.0.1:{r.port}" for r in replicas]
    lb = Nginx(tmp_path_factory.mktemp("nginx"), HUB_PORT, addresses, addresses).start()
    try:
        yield lb
    finally:
        lb.stop()


def _served(replica: ProcessServer, route: str) -> float:
    """How many requests ``replica`` answered on routes whose template holds ``route`` (its
    /metrics, asked directly)."""
    text = HTTP.get(f"{replica.url}/metrics").text
    pattern = rf'^vip_hub_requests_total{{[^}}]*route="[^"]*{re.escape(route)}[^"]*"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 60)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _objects_verified(seaweed, postgres: str) -> int:
    """Every object a commit names is in the bucket under its SHA-256, with those bytes;
    returns how many there are."""
    client = seaweed.client()
    with psycopg.connect(postgres) as conn:
        rows = conn.execute("SELECT DISTINCT sha256, size FROM files").fetchall()
    for sha256, size in rows:
        body = client.get_object(Bucket=BUCKET, Key=blob_key(sha256))["Body"].read()
        assert len(body) == size and hashlib.sha256(body).hexdigest() == sha256
    return len(rows)


def test_clients_through_the_balancer(balancer, replicas, tmp_path, monkeypatch):
    folder = tiny_repo_with_head(tmp_path / "vip-nano-replicas")
    api = HfApi(endpoint=balancer.url, token=WRITE_TOKEN)
    api.create_repo("lfs/replicas")
    with monkeypatch.context() as mp:  # presigned LFS: straight to the object store
        mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        api.upload_folder(repo_id="lfs/replicas", folder_path=folder, commit_message="v1")
    snap = Path(snapshot_download("lfs/replicas", cache_dir=tmp_path / "cache"))
    assert {rel: (snap / rel).read_bytes() for rel in repo_files(snap)} == {
        rel: path.read_bytes() for rel, path in repo_files(folder).items()
    }
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "timm-cache"))
    model = timm.create_model("hf-hub:lfs/replicas", pretrained=True)
    state = model.state_dict()
    assert all(torch.equal(state[k], t) for k, t in load_file(folder / WEIGHTS_FILE).items())

    # Xet: the user's session sticks to one replica; the commit may land on either
    xet_folder = tiny_repo_with_head(tmp_path / "vip-nano-replicas-xet", seed=3)
    api.create_repo("lfs/replicas-xet")
    api.upload_folder(repo_id="lfs/replicas-xet", folder_path=xet_folder, commit_message="v1")
    assert any(_served(r, "/v1/shards") for r in replicas)  # it went the Xet way
    snap = Path(snapshot_download("lfs/replicas-xet", cache_dir=tmp_path / "cache"))
    weights = (xet_folder / WEIGHTS_FILE).read_bytes()
    assert (snap / WEIGHTS_FILE).read_bytes() == weights

    client = openai.OpenAI(base_url=f"{balancer.url}/v1", api_key="EMPTY", timeout=120)
    for _ in range(4):
        got = client.embeddings.create(model="lfs/replicas", input=[_png()])
        assert len(got.data) == 1 and len(got.data[0].embedding) > 0
    # both replicas took their share of the hub and of the inference routes
    assert all(_served(r, "{org}/{name}") for r in replicas)
    assert all(_served(r, "/embeddings") for r in replicas)


def _cli(capsys, *args: str) -> str:
    """``vip-hub ARGS`` in this process; its output (the command must succeed)."""
    assert main(list(args)) == 0, capsys.readouterr().err
    return capsys.readouterr().out.strip()


def _commit(url: str, repo: str, body: bytes, auth: dict[str, str] = AUTH) -> httpx.Response:
    return HTTP.post(
        f"{url}/api/models/{repo}/commit/main",
        content=body,
        headers={**auth, "Content-Type": "application/x-ndjson"},
    )


def _batch(url: str, repo: str, data: bytes, auth: dict[str, str] = AUTH) -> dict:
    """Announce ``data`` (LFS batch) and PUT it to the presigned staging URL; the object's
    ``verify`` action (not yet called)."""
    reply = HTTP.post(
        f"{url}/{repo}.git/info/lfs/objects/batch",
        json={
            "operation": "upload",
            "objects": [{"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}],
        },
        headers=auth,
    )
    assert reply.status_code == 200, reply.text
    actions = reply.json()["objects"][0]["actions"]
    assert HTTP.put(actions["upload"]["href"], content=data).status_code == 200
    return actions["verify"]


def verify_oid(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify(verify: dict, data: bytes, auth: dict[str, str] = AUTH) -> httpx.Response:
    payload = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return HTTP.post(verify["href"], json=payload, headers=auth)


def test_what_one_replica_issued_the_other_honours(replicas, shared, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VIP_HUB_INDEX", shared["VIP_HUB_INDEX"])
    admin = str(tmp_path / "admin")  # the operator's own folder: the index is what counts
    secret = _cli(capsys, "token", "create", "--name", "nina", "--scope", "write", "--store", admin)
    nina = {"Authorization": f"Bearer {secret}"}
    first, second = replicas
    for r in replicas:  # a token made once, honoured by every replica at once
        assert HTTP.get(f"{r.url}/api/whoami-v2", headers=nina).json()["name"] == "nina"
    assert HTTP.post(
        f"{first.url}/api/repos/create", json={"name": "m", "organization": "nina"}, headers=nina
    ).is_success
    data = random_text(256 * 1024)
    verify = _batch(first.url, "nina/m", data, nina)  # the grant comes from the first replica
    verify["href"] = verify["href"].replace(first.url, second.url)
    assert _verify(verify, data, nina).status_code == 200  # the second checks it
    with httpx.Client(base_url=first.url) as client:  # the first honours the second's record
        assert client.get("/api/models/nina/m", headers=nina).status_code == 200
        batch = client.post(
            "/nina/m.git/info/lfs/objects/batch",
            json={
                "operation": "upload",
                "objects": [{"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}],
            },
            headers=nina,
        ).json()
        assert "actions" not in batch["objects"][0]  # held for nina/m: nothing to upload again
    _cli(capsys, "token", "revoke", "--name", "nina", "--store", admin)
    for r in replicas:
        assert HTTP.get(f"{r.url}/api/whoami-v2", headers=nina).status_code == 401


@pytest.fixture(scope="module")
def crash_repo(replicas, tmp_path_factory) -> str:
    """``crash/replicas``, published to the second replica (the one every fault test keeps)."""
    folder = tiny_repo_with_head(tmp_path_factory.mktemp("crash") / "vip-nano-crash", dp=False)
    api = HfApi(endpoint=replicas[1].url, token=WRITE_TOKEN)
    api.create_repo("crash/replicas")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        api.upload_folder(repo_id="crash/replicas", folder_path=folder, commit_message="v1")
    return "crash/replicas"


@contextlib.contextmanager
def _armed(
    shared: dict[str, str], folder: Path, other: ProcessServer, step: str
) -> Iterator[tuple[Nginx, ProcessServer]]:
    """A hub replica that dies (as under SIGKILL) when it reaches ``step``, and nginx in front
    of it and ``other``, started once it answers: a balancer that never saw it down (nginx
    skips a replica it saw fail for the shipped ``fail_timeout``, 10 s)."""
    armed = ProcessServer(folder / "armed", extra_env={**shared, CRASH_ENV: step}).start()
    try:
        addresses = [f"127.0.0.1:{armed.port}", f"127.0.0.1:{other.port}"]
        lb = Nginx(folder / "nginx", free_port(), addresses, addresses).start()
        try:
            yield lb, armed
        finally:
            lb.stop()
    finally:
        armed.stop()


def _next_goes_to_armed(lb: Nginx, other: ProcessServer) -> None:
    """Send probes through ``lb`` until one reached the armed replica and the last reached
    ``other``: nginx (one worker, round robin) sends the next request to the armed one."""
    deadline, armed_seen = time.monotonic() + 60, False
    while True:
        before = _served(other, "/healthz")
        assert HTTP.get(f"{lb.url}/healthz").status_code == 200
        on_other = _served(other, "/healthz") > before
        if on_other and armed_seen:
            return
        armed_seen |= not on_other
        assert time.monotonic() < deadline, "nginx sent no probe to the armed replica"
        time.sleep(0.2)  # nginx retries a replica it saw fail after fail_timeout


def _head_names(lb: Nginx, path: str, data: bytes) -> None:
    """The branch head holds ``path`` with ``data``, read through the balancer."""
    reply = HTTP.get(f"{lb.url}/crash/replicas/resolve/main/{path}", follow_redirects=True)
    assert reply.status_code == 200 and reply.content == data


def test_upload_killed_midway_completes_on_the_other_replica(
    crash_repo, replicas, shared, seaweed, postgres, tmp_path
):
    with _armed(shared, tmp_path, replicas[1], "upload-partial") as (lb, armed):
        data = random_text(3 * 1024 * 1024)
        verify = _batch(lb.url, crash_repo, data)
        _next_goes_to_armed(lb, replicas[1])
        # the armed replica dies while it hashes the staged object: nginx answers 502
        assert _verify(verify, data).status_code == 502
        assert armed.proc is not None and armed.proc.wait(30) == CRASH_STATUS
        # the client sends it again through nginx; the other replica checks it and completes
        assert _verify(verify, data).status_code == 200
        assert _commit(lb.url, crash_repo, lfs_lines("extra/upload.txt", data)).is_success
        _head_names(lb, "extra/upload.txt", data)
    assert _objects_verified(seaweed, postgres) > 0


@pytest.mark.parametrize("step", ["commit-blobs-stored", "commit-indexed"])
def test_commit_killed_midway_completes_on_the_other_replica(
    crash_repo, replicas, shared, seaweed, postgres, tmp_path, step
):
    data = random_text(1024 * 1024)
    with _armed(shared, tmp_path, replicas[1], step) as (lb, armed):
        assert _verify(_batch(lb.url, crash_repo, data), data).status_code == 200
        body = lfs_lines(f"extra/{step}.txt", data)
        before = HfApi(endpoint=lb.url).model_info(crash_repo).sha
        _next_goes_to_armed(lb, replicas[1])
        assert _commit(lb.url, crash_repo, body).status_code == 502  # died mid-commit
        assert armed.proc is not None and armed.proc.wait(30) == CRASH_STATUS
        again = _commit(lb.url, crash_repo, body)  # sent again: the other replica
        assert again.status_code == 200, again.text
        history = [c.commit_id for c in HfApi(endpoint=lb.url).list_repo_commits(crash_repo)]
        _head_names(lb, f"extra/{step}.txt", data)
    made = history[: history.index(before)]
    # killed before its index transaction: one commit; after it: the first and the resent one
    assert len(made) == (2 if step == "commit-indexed" else 1)
    assert _objects_verified(seaweed, postgres) > 0


def _staged(seaweed) -> set[str]:
    listed = seaweed.client().list_objects_v2(Bucket=BUCKET, Prefix="staging/")
    return {o["Key"] for o in listed.get("Contents", [])}


def test_real_size_repo_through_the_balancer(balancer, seaweed, tmp_path, monkeypatch):
    # last in the module: the fault tests above read back every object the index names
    folder = base_size_repo(tmp_path / "vip-base-replicas")
    assert (folder / WEIGHTS_FILE).stat().st_size > 340e6
    staged = _staged(seaweed)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    api = HfApi(endpoint=balancer.url, token=WRITE_TOKEN)
    api.create_repo("big/replicas")
    api.upload_folder(repo_id="big/replicas", folder_path=folder, commit_message="v1")
    assert _staged(seaweed) == staged  # each upload's staged object checked, then gone
    snap = snapshot_download("big/replicas", endpoint=balancer.url, cache_dir=tmp_path / "cache")
    assert sorted(repo_files(Path(snap))) == sorted(repo_files(folder))
    for rel, path in repo_files(folder).items():
        assert (Path(snap) / rel).read_bytes() == path.read_bytes(), rel
