"""The hub at real model sizes: a ViP-Base-size repo (random weights, 344 MB encoder + 52 MB
decoder) published with unmodified clients (``upload_folder``: Xet; ``vip-hub push``), a
card-only revision that does not send the weights again, downloads through
``snapshot_download`` and timm, the server's memory while it receives a 1 GiB file, and a hub
without inference that starts without torch and never loads the models. The server runs as
its own process (its RSS and its mapped libraries are read)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import huggingface_hub
import pytest
import timm
import torch
from huggingface_hub import CommitOperationAdd, HfApi, snapshot_download
from safetensors.torch import load_file
from support.helpers import base_size_repo, tiny_repo_with_head
from support.live import WRITE_TOKEN, ProcessServer

from vip_hub import verify_repo
from vip_hub.repo.push import push_repo
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import CARD_FILE, MAE_DECODER_FILE, WEIGHTS_FILE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ProcessServer(tmp_path_factory.mktemp("large-store")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base_repo(tmp_path_factory) -> Path:
    return base_size_repo(tmp_path_factory.mktemp("base") / "vip-base-test")


def _held(store: Path) -> set[str]:
    """Every upload the server holds (xorbs, LFS objects awaiting or past their commit)."""
    return {
        str(p.relative_to(store))
        for d in ("xet", "uploads", "blobs")
        for p in (store / d).rglob("*")
        if p.is_file()
    }


def test_publish_and_download_at_real_size(server, base_repo, tmp_path, monkeypatch):
    assert (base_repo / WEIGHTS_FILE).stat().st_size > 340e6
    api = HfApi(endpoint=server.url, token=WRITE_TOKEN)

    api.create_repo("big/folder")
    info = api.upload_folder(repo_id="big/folder", folder_path=base_repo, commit_message="v1")
    commits = api.list_repo_commits("big/folder")
    assert [c.commit_id for c in commits] == [info.oid]  # one commit, which verified whole
    assert "Privacy: (ε = " in commits[0].message  # the headline, from the ledger's summary

    first = push_repo(base_repo, "big/push", endpoint=server.url, token=WRITE_TOKEN)
    held = _held(server.store)
    (base_repo / CARD_FILE).write_text(
        (base_repo / CARD_FILE).read_text() + "\nA note on the card.\n"
    )
    assert verify_repo(base_repo).ok
    second = push_repo(base_repo, "big/push", endpoint=server.url, token=WRITE_TOKEN)
    assert second != first and [c.commit_id for c in api.list_repo_commits("big/push")] == [
        second,
        first,
    ]
    new = _held(server.store) - held
    assert len(new) == 1 and all(
        p.startswith("blobs/") for p in new
    )  # the card's blob, nothing else was sent

    # upload_file and create_commit of single files at real size (the tree still verifies)
    api.upload_file(
        path_or_fileobj=base_repo / CARD_FILE, path_in_repo=CARD_FILE, repo_id="big/folder"
    )
    api.upload_file(
        path_or_fileobj=base_repo / MAE_DECODER_FILE,
        path_in_repo=MAE_DECODER_FILE,
        repo_id="big/folder",
    )
    # the card made a commit; the decoder did not: preupload gave its SHA-256, the client saw it
    # unchanged
    assert len(api.list_repo_commits("big/folder")) == 2

    snap = Path(snapshot_download("big/push", endpoint=server.url, cache_dir=tmp_path / "cache"))
    assert sorted(repo_files(snap)) == sorted(repo_files(base_repo))
    for rel in (WEIGHTS_FILE, MAE_DECODER_FILE, CARD_FILE):
        assert (snap / rel).read_bytes() == (base_repo / rel).read_bytes(), rel
    assert verify_repo(snap).ok

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)  # what HF_ENDPOINT does
    monkeypatch.setattr(
        huggingface_hub.constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        server.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "timm-cache"))
    model = timm.create_model("hf-hub:big/folder", pretrained=True)
    expected = load_file(base_repo / WEIGHTS_FILE)
    got = model.state_dict()
    assert set(expected) == set(got)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_receiving_a_gib_keeps_server_memory_flat(server, tmp_path):
    """A 1 GiB file through the Git LFS batch API (the client takes it for a file object):
    the server's RSS grows by less than 100 MB."""
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(1024):
            f.write(block)
    api = HfApi(endpoint=server.url, token=WRITE_TOKEN)
    api.create_repo("big/gib")
    pid = server.proc.pid
    baseline, peak, done = _rss_kb(pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kb(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with open(big, "rb") as f:
            api.preupload_lfs_files("big/gib", [CommitOperationAdd("weights.bin", f)])
    finally:
        done.set()
        sampler.join()
    uploads = list((server.store / "uploads").rglob("*"))
    assert any(p.is_file() and p.stat().st_size == 1 << 30 for p in uploads)
    growth_mb = (peak[0] - baseline) / 1024
    print(
        f"server RSS while receiving 1 GiB: {baseline / 1024:.0f} MB "
        f"-> peak {peak[0] / 1024:.0f} MB"
    )
    assert growth_mb < 100, f"server RSS grew by {growth_mb:.0f} MB"


def test_a_hub_without_inference_starts_without_torch_and_never_loads_the_models(tmp_path):
    """The hub half alone (``vip-hub serve --no-inference``: the replicas behind a balancer)
    starts without importing torch, and verifies, stores, serves and renders repos without the
    models (timm, and with it torchvision): only the accountants that verify recomputes epsilon
    with (opacus) bring torch in, at the first commit."""
    server = ProcessServer(tmp_path / "store").start()
    try:
        assert "libtorch" not in Path(f"/proc/{server.proc.pid}/maps").read_text()
        repo = tiny_repo_with_head(tmp_path / "tiny")
        push_repo(repo, "big/tiny", endpoint=server.url, token=WRITE_TOKEN)
        snap = Path(snapshot_download("big/tiny", endpoint=server.url, cache_dir=tmp_path / "c"))
        assert verify_repo(snap).ok
        for path in ("/big/tiny", "/api/models/big/tiny", "/"):
            assert httpx.get(server.url + path, timeout=30).status_code == 200, path
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        assert "libtorch" in maps and "torchvision" not in maps  # opacus, but no timm
    finally:
        server.stop()
