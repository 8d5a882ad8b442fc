"""Stateless replicas: two ``vip-hub serve`` processes share one PostgreSQL index and one
SeaweedFS bucket behind nginx (the shipped ``docker/nginx.conf``), each with a folder of its
own. Unmodified clients (huggingface_hub with presigned LFS and with Xet, timm, openai) work
through the balancer; what one replica issued (tokens, upload grants, upload records) the other
honours; a replica killed at a crash point in the middle of an upload or a commit loses
nothing: the client sends the request again through nginx, the other replica completes it, and
no commit names a missing or unverified object."""

from __future__ import annotations

import base64
import hashlib
import io
import re
import threading
from pathlib import Path

import httpx
import huggingface_hub
import openai
import psycopg
import pytest
import timm
import torch
from conftest import HUB_PORT
from helpers import tiny_repo_with_head
from huggingface_hub import HfApi, snapshot_download
from live import WRITE_TOKEN, ProcessServer
from PIL import Image
from safetensors.torch import load_file
from system import Nginx

from service.store.s3 import blob_key
from vip_hub.repo.verify import repo_files

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
    assert all(torch.equal(state[k], t) for k, t in load_file(folder / "model.safetensors").items())

    # Xet: the user's session sticks to one replica; the commit may land on either
    xet_folder = tiny_repo_with_head(tmp_path / "vip-nano-replicas-xet", seed=3)
    api.create_repo("lfs/replicas-xet")
    api.upload_folder(repo_id="lfs/replicas-xet", folder_path=xet_folder, commit_message="v1")
    assert any(_served(r, "/v1/shards") for r in replicas)  # it went the Xet way
    snap = Path(snapshot_download("lfs/replicas-xet", cache_dir=tmp_path / "cache"))
    weights = (xet_folder / "model.safetensors").read_bytes()
    assert (snap / "model.safetensors").read_bytes() == weights

    client = openai.OpenAI(base_url=f"{balancer.url}/v1", api_key="EMPTY", timeout=120)
    for _ in range(4):
        got = client.embeddings.create(model="lfs/replicas", input=[_png()])
        assert len(got.data) == 1 and len(got.data[0].embedding) > 0
    # both replicas took their share of the hub and of the inference routes
    assert all(_served(r, "{org}/{name}") for r in replicas)
    assert all(_served(r, "/embeddings") for r in replicas)
