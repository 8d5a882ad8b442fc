"""Shared fixtures. Tests make their own small data; nothing is downloaded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# Before huggingface_hub is imported: keep client caches and tokens away from the user's home,
# and point unmodified clients (HF_ENDPOINT) at the session's hub server, on a port chosen now.
_HOME = Path(tempfile.mkdtemp(prefix="vip-hub-tests-"))
os.environ["HF_HOME"] = str(_HOME / "hf")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.pop("HF_TOKEN", None)
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    HUB_PORT = _s.getsockname()[1]
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{HUB_PORT}"

import pytest  # noqa: E402
import torch  # noqa: E402

from vip_hub import Dataset, DPStage, EncoderSpec, NonPrivateStage, create_encoder, export_encoder  # noqa: E402

TINY = EncoderSpec("vip-nano", img_size=32)

# Tests that must also hold on a GPU take ``device`` from here: CUDA runs where one is present.
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


def synthetic_stage() -> NonPrivateStage:
    return NonPrivateStage(
        name="synthetic-pretraining",
        dataset=Dataset(name="procedural-images", description="generated in the test"),
        private_data=False,
    )


def dp_stage(n: int = 1000, batch: int = 50, sigma: float = 1.0, steps: int = 100) -> DPStage:
    return DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="test-images", size=n),
        sample_rate=batch / n,
        noise_multiplier=sigma,
        steps=steps,
        clipping_norm=0.1,
    )


def tiny_encoder(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_encoder(TINY, mae_init=True).eval()


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
    from live import ThreadedServer, settings_for

    store = tmp_path_factory.mktemp("hub-store")
    with ThreadedServer(settings_for(store), port=HUB_PORT) as server:
        yield server


def tiny_repo_with_head(folder: Path, seed: int = 0, dp: bool = True) -> Path:
    """An exported tiny encoder with a 3-class probe head (non-DP, on sensitive labels)."""
    from vip_hub.heads import HeadInfo, LinearProbe, save_head

    stages = [synthetic_stage(), dp_stage()] if dp else [synthetic_stage()]
    repo = export_encoder(folder, tiny_encoder(seed), TINY, stages, model_name=folder.name)
    torch.manual_seed(seed)
    head = LinearProbe(1152, 3)
    head.norm.running_mean.normal_()
    head.norm.running_var.uniform_(0.5, 2.0)
    save_head(repo, head.eval(), HeadInfo("toy", "vip", ["red", "green", "blue"], {"top1": 0.5}),
              NonPrivateStage(name="linear-probe:toy", component="heads/toy",
                              dataset=Dataset(name="toy-labels", size=30), private_data=True))
    return repo


@pytest.fixture(scope="module")
def published(hub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Repos published to the module's hub through `vip-hub push`: repo id -> local folder."""
    from live import WRITE_TOKEN
    from vip_hub.push import push_repo

    base = tmp_path_factory.mktemp("published")
    repos = {"vip/vip-nano-test": tiny_repo_with_head(base / "vip-nano-test")}
    repos["vip/vip-nano-syn"] = tiny_repo_with_head(base / "vip-nano-syn", seed=1, dp=False)
    for repo_id, folder in repos.items():
        push_repo(folder, repo_id, token=WRITE_TOKEN)
    return repos


def published_hashes_of(data: Path, repo: Path) -> set[str]:
    """The plain SHA-256 digests of the private data (each file's, and the whole folder's as vip-hub
    < 0.3 fingerprinted it) that appear in any file of ``repo``: a released repo must hold none."""
    import hashlib

    files = sorted(p for p in data.rglob("*") if p.is_file())
    digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    whole = hashlib.sha256()
    for p in files:
        whole.update(p.relative_to(data).as_posix().encode() + b"\0")
        whole.update(hashlib.sha256(p.read_bytes()).digest())
    digests.add(whole.hexdigest())
    released = b"".join(p.read_bytes() for p in repo.rglob("*") if p.is_file())
    return {d for d in digests if d.encode() in released}


def kill_mid_run(cmd: list[str], out: Path, step: int) -> Path:
    """Start a training command, SIGKILL it once its log (``OUT.run/log.jsonl``) reaches ``step``
    (between checkpoints), check it had not finished; returns the log's path."""
    log = out.parent / f"{out.name}.run" / "log.jsonl"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and any(json.loads(line).get("step") == step for line in log.read_text().splitlines()
                                if line.endswith("}")):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "the run finished before it could be killed"
    return log
