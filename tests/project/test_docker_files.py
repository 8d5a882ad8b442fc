"""The shipped Docker files read without Docker (in ``make test``; ``tests/project/test_images.py``
builds and runs them): the GPU Dockerfile is the CPU one but for the lines that must differ, both
take their base, torch source and CA from outside, run as a user, and pin the torch the project
pins; the compose files keep every public image, address and secret overridable, their public
images default to named releases (SeaweedFS's the tests' own), and the balancer's
upstreams name their services."""

from __future__ import annotations

import difflib
import re
import subprocess
from pathlib import Path

import yaml
from support.helpers import ROOT

from service.settings import Settings

DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.gpu"]

GPU_DIFFERENCE = [
    "- ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu",
    "+ ARG TORCH_INDEX=https://pypi.org/simple",
    '-  && pip install ".[serve]" && rm -rf build ./*.egg-info \\',
    '+  && pip install ".[all]" && rm -rf build ./*.egg-info \\',
    "+ ENV VIP_HUB_INFERENCE__DEVICE=cuda \\",
    "+     NVIDIA_VISIBLE_DEVICES=all \\",
    "+     NVIDIA_DRIVER_CAPABILITIES=compute,utility \\",
    "- ENV VIP_HUB_STORE=/data/hub \\",
    "+     VIP_HUB_STORE=/data/hub \\",
]
"""What the GPU image must do otherwise: PyPI's torch (CUDA builds), the training extras
(torchrun recipes), inference on the GPU and the NVIDIA runtime's settings."""


def _instructions(path: Path) -> list[str]:
    """A Dockerfile's lines without comments and blank lines."""
    return [
        line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


def _joined(path: Path) -> list[str]:
    """A Dockerfile's instructions, continuation lines joined."""
    return re.sub(r"\\\n", " ", "\n".join(_instructions(path))).splitlines()


def test_the_gpu_dockerfile_differs_from_the_cpu_one_only_where_it_must():
    cpu, gpu = (_instructions(p) for p in DOCKERFILES)
    changed = [line for line in difflib.ndiff(cpu, gpu) if line[:2] in ("- ", "+ ")]
    assert changed == GPU_DIFFERENCE, (
        "docker/Dockerfile and docker/Dockerfile.gpu drifted apart: change both, or "
        "GPU_DIFFERENCE when the GPU image must differ\n" + "\n".join(changed)
    )


def test_the_dockerfiles_take_base_torch_and_ca_from_outside_and_run_as_a_user():
    for path in DOCKERFILES:
        lines = _joined(path)
        assert "ARG BASE_IMAGE=python:3.11-slim" in lines and "FROM ${BASE_IMAGE}" in lines, path
        args = {m.group(1) for line in lines if (m := re.match(r"ARG (\w+)", line))}
        assert {"BASE_IMAGE", "TORCH_INDEX", "TORCH_FIND_LINKS"} <= args, path
        # build arguments stay in the image's history: none may carry a credential
        assert not [a for a in args if re.search(r"TOKEN|SECRET|PASSWORD|KEY|CERT", a)], path
        for line in lines:
            if "pip install" in line:  # the CA comes as a build secret, mounted, never copied
                assert "--mount=type=secret,id=pip-ca" in line, (path, line)
                assert "PIP_CERT=/run/secrets/pip-ca" in line, (path, line)
        users = [line for line in lines if line.startswith("USER ")]
        assert users and users[-1] != "USER root" and lines.index(users[-1]) < len(lines) - 1
        assert any(line.startswith("HEALTHCHECK ") and "/healthz" in line for line in lines)
        assert lines[-1] == 'CMD ["vip-hub", "serve"]', path


def test_the_images_pin_the_torch_the_project_pins():
    pyproject = (ROOT / "pyproject.toml").read_text()
    pins = set(re.findall(r'"(torch(?:vision)?==[\w.]+)"', pyproject))
    assert len(pins) == 2, pins
    for path in DOCKERFILES:
        assert set(re.findall(r"\b(torch(?:vision)?==[\w.]+)", path.read_text())) == pins, path


def test_the_build_context_holds_what_the_dockerfiles_copy():
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for path in DOCKERFILES:
        for line in _joined(path):
            if line.startswith("COPY "):
                *sources, _ = line.split()[1:]
                assert set(sources) <= kept, (path, line, kept)


def _compose(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def test_compose_files_keep_images_addresses_and_secrets_overridable():
    for name in ("compose.yaml", "compose.replicas.yaml"):
        services = _compose(name)["services"]
        for service, spec in services.items():
            image = spec["image"]
            # ours are built here; a public one can be pointed at a mirror (or a test's stand-in)
            assert image.startswith("vip-hub:") or image.startswith("${VIP_HUB_"), (name, image)
            for port in spec.get("ports", []):
                # published on loopback unless the operator says otherwise
                assert re.fullmatch(r"\$\{VIP_HUB_\w+:-127\.0\.0\.1:\d+\}:\d+", port), (name, port)
            for key, value in (spec.get("environment") or {}).items():
                if re.search(r"TOKEN|SECRET|PASSWORD|KEY", key):
                    assert str(value).startswith("${"), f"{name}: {service}.{key} is written in"
                # a password or key has no default: ``change-me`` was a public key pair to every
                # blob wherever the S3 port was reachable
                for secret in re.findall(
                    r"\$\{(VIP_HUB_\w*(?:PASSWORD|_KEY))([^}]*)\}", str(value)
                ):
                    assert secret[1].startswith(":?"), f"{name}: {service}.{key}: {secret}"


def test_public_images_default_to_a_release_and_seaweedfs_to_the_one_the_tests_run():
    """A compose file's public image defaults to a named release, never ``latest`` or no tag (a
    later pull would run what nobody tested); SeaweedFS's to the ``weed`` of the tests."""
    from support.seaweed import weed_binary

    defaults = {}
    for name in ("compose.yaml", "compose.replicas.yaml"):
        for spec in _compose(name)["services"].values():
            image = spec["image"]
            if image.startswith("vip-hub:"):
                continue  # built here
            found = re.fullmatch(r"\$\{VIP_HUB_\w+_IMAGE:-([\w./-]+):([^}]+)\}", image)
            assert found, (name, image)  # a public image's default names a repository and tag
            defaults[found[1]] = found[2]
    assert {"postgres", "chrislusf/seaweedfs", "nginx"} <= defaults.keys(), defaults
    assert all(re.fullmatch(r"\d+(\.\d+)*", tag) for tag in defaults.values()), defaults
    version = subprocess.run(
        [weed_binary(), "version"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert defaults["chrislusf/seaweedfs"] in version, (defaults, version)


def test_every_server_drains_before_it_is_killed_and_restarts_when_it_dies():
    """compose.yaml's ``hub`` had Docker's 10 s grace, so ``docker compose stop`` killed it
    mid-drain, and ``hub-gpu`` no restart policy, where docs/deploy.md promised both."""
    drain = Settings.model_fields["drain_s"].default
    servers = [
        (name, service, spec)
        for name in ("compose.yaml", "compose.replicas.yaml")
        for service, spec in _compose(name)["services"].items()
        if spec["image"].startswith("vip-hub:")
    ]
    assert {"hub", "hub-gpu", "inference"} <= {service for _, service, _ in servers}
    for name, service, spec in servers:
        grace = spec.get("stop_grace_period", "10s")
        assert int(grace.rstrip("s")) > drain, (name, service, grace)
        assert spec.get("restart") == "unless-stopped", (name, service)


def test_the_balancer_routes_to_the_replicas_services():
    services = _compose("compose.replicas.yaml")["services"]
    conf = (DOCKER / "nginx.conf").read_text()
    upstream_hosts = set(re.findall(r"server (\w+):8000", conf))
    assert upstream_hosts == {"hub", "inference"} and upstream_hosts <= set(services)
    assert "listen 8000;" in conf
    balancer = services["balancer"]
    assert "./nginx.conf:/etc/nginx/conf.d/default.conf:ro" in balancer["volumes"]
    assert "./nginx-proxy.conf:/etc/nginx/vip-hub/proxy.conf:ro" in balancer["volumes"]
    assert "include /etc/nginx/vip-hub/proxy.conf;" in conf
    assert set(balancer["depends_on"]) == upstream_hosts
    for name in upstream_hosts:  # SIGTERM drains for up to drain_s (120 s) before the kill
        grace = services[name]["stop_grace_period"]
        assert int(grace.rstrip("s")) > 120, (name, grace)


def test_the_tls_override_mounts_what_the_balancer_includes_and_keeps_it_on_loopback():
    """compose.tls.yaml adds docker/nginx-tls.conf where nginx.conf includes TLS servers from,
    the operator's certificate folder (no default: a missing one names the variable) where
    nginx-tls.conf reads it, and 8443 on loopback unless the operator says otherwise; and the
    replicas believe the scheme the balancer forwards."""
    conf, tls = (DOCKER / "nginx.conf").read_text(), (DOCKER / "nginx-tls.conf").read_text()
    balancer = _compose("compose.tls.yaml")["services"]["balancer"]
    assert "include /etc/nginx/vip-hub/tls/*.conf;" in conf
    assert "./nginx-tls.conf:/etc/nginx/vip-hub/tls/tls.conf:ro" in balancer["volumes"]
    certs = next(v for v in balancer["volumes"] if v.endswith(":/etc/nginx/vip-hub/certs:ro"))
    assert certs.startswith("${VIP_HUB_TLS_CERTS:?"), certs
    for name in ("fullchain.pem", "privkey.pem"):
        assert f"/etc/nginx/vip-hub/certs/{name};" in tls
    assert "listen 8443 ssl;" in tls and "include /etc/nginx/vip-hub/proxy.conf;" in tls
    assert balancer["ports"] == ["${VIP_HUB_TLS_LISTEN:-127.0.0.1:8443}:8443"]
    replicas = _compose("compose.replicas.yaml")["x-replica"]["environment"]
    assert replicas["VIP_HUB_FORWARDED_ALLOW_IPS"] == "*"
