"""Shared fixtures (shared helpers: ``helpers.py``). Tests make their own small data; nothing
is downloaded."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from support.ports import free_port

# Before huggingface_hub is imported: keep client caches and tokens away from the user's home,
# and point unmodified clients (HF_ENDPOINT) at the session's hub server, on a port chosen now.
_HOME = Path(tempfile.mkdtemp(prefix="vip-hub-tests-"))
os.environ["HF_HOME"] = str(_HOME / "hf")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.pop("HF_TOKEN", None)
HUB_PORT = free_port()
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{HUB_PORT}"
# Under pytest-xdist each worker gets its share of the cores, for its torch and the processes it
# starts (tests that measure threads set their own), so the workers do not oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402 - after the environment above
import torch  # noqa: E402 - after the environment above
from support.helpers import TINY, dp_stage, synthetic_stage, tiny_encoder, tiny_repo_with_head  # noqa: E402 - idem

from vip_hub import DPStage, export_encoder  # noqa: E402 - after the environment above


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files holding slow tests first, each file's tests in their own order: the workers take
    whole files in this order (``--dist loadfile --no-loadscope-reorder``), so the long ones start
    early and no worker is left with one at the end while the other idles."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the session's client home (hub caches hold GiB-sized models)."""
    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def dp_stage_session() -> DPStage:
    return dp_stage()


@pytest.fixture
def tiny_repo(tmp_path: Path, dp_stage_session: DPStage) -> Path:
    """A freshly exported random vip-nano (32 px) repo with a synthetic and a DP stage."""
    decoder = {"mask_token": torch.zeros(1, 1, 512), "decoder_embed.weight": torch.randn(512, 192)}
    return export_encoder(
        tmp_path / "repo",
        tiny_encoder(),
        TINY,
        [synthetic_stage(), dp_stage_session],
        model_name="vip-nano-test",
        summary="A randomly initialised test encoder.",
        decoder=decoder,
        decoder_config={"embed_dim": 512, "depth": 0},
    )


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    """A live server (hub + inference) on HF_ENDPOINT's port, with a store of this test module's
    own: what one module publishes never shows up in another's listings."""
    from support.live import ThreadedServer, settings_for

    store = tmp_path_factory.mktemp("hub-store")
    with ThreadedServer(settings_for(store), port=HUB_PORT) as server:
        yield server


@pytest.fixture(scope="module")
def published(hub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Repos published to the module's hub through `vip-hub push`: repo id -> local folder."""
    from support.live import WRITE_TOKEN

    from vip_hub.repo.push import push_repo

    base = tmp_path_factory.mktemp("published")
    repos = {"vip/vip-nano-test": tiny_repo_with_head(base / "vip-nano-test")}
    repos["vip/vip-nano-syn"] = tiny_repo_with_head(base / "vip-nano-syn", seed=1, dp=False)
    for repo_id, folder in repos.items():
        push_repo(folder, repo_id, token=WRITE_TOKEN)
    return repos


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    """One real SeaweedFS per test session, answering S3 on loopback; its credentials in
    boto3's environment variables, where a hub with an object store finds them."""
    from support.seaweed import SeaweedFS

    store = SeaweedFS(tmp_path_factory.mktemp("seaweed")).start()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", store.access_key)
        env.setenv("AWS_SECRET_ACCESS_KEY", store.secret_key)
        try:
            yield store
        finally:
            store.stop()


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server per test session (``system.Postgres``)."""
    from support.system import Postgres

    server = Postgres().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def postgres(postgres_server) -> str:
    """The URL of an empty database of the test module's own on the session's PostgreSQL."""
    return postgres_server.new_database()
