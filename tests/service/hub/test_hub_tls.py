"""TLS on the shipped balancer (``docker/nginx-tls.conf``, mounted as ``docker/compose.tls.yaml``
mounts it): clients reach the hub over https, and the URLs the hub hands out (an LFS upload's)
are https too, as nginx forwards the scheme and the hub believes it from the addresses its
``forwarded_allow_ips`` names alone. A real nginx, a real certificate, the real clients."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
import time
import uuid
from pathlib import Path

import httpx
import huggingface_hub
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from huggingface_hub import HfApi, snapshot_download
from support.helpers import tiny_repo_with_head
from support.live import WRITE_TOKEN, ProcessServer, lfs_batch
from support.ports import free_port
from support.system import Nginx
from uvicorn.logging import AccessFormatter

from service.ops import ACCESS_LOGGER, log_config
from vip_hub.repo_format import WEIGHTS_FILE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate for 127.0.0.1: a folder with ``fullchain.pem`` and
    ``privkey.pem``, as compose.tls.yaml's ``VIP_HUB_TLS_CERTS``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vip-hub test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("certs")
    (folder / "fullchain.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "privkey.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return folder


def _trusting(certificate: Path) -> ssl.SSLContext:
    """A client context that trusts the test certificate alone."""
    return ssl.create_default_context(cafile=certificate / "fullchain.pem")


def _access_lines(
    caplog: pytest.LogCaptureFixture, formatter: logging.Formatter, target: str
) -> list[str]:
    """The hub's access log lines (as its format writes them) of the requests for ``target``."""
    return [
        formatter.format(r)
        for r in caplog.records
        if r.name == ACCESS_LOGGER and target in r.getMessage()
    ]


def test_clients_reach_the_hub_over_tls_and_are_handed_https_urls(
    hub, certificate, tmp_path, monkeypatch, caplog
):
    """huggingface_hub creates a repo, uploads a whole model (its weights through Git LFS, to the
    URL the hub hands out) and downloads it, all over https through the balancer; the upload URL
    is the balancer's https one; and the hub logs the balancer's client, not an address the
    client claims."""
    formatter = AccessFormatter(
        fmt=log_config()["formatters"]["vip_hub_access"]["fmt"], use_colors=False
    )
    address = hub.url.removeprefix("http://")
    lb = Nginx(tmp_path / "nginx", free_port(), [address], [address], tls=certificate).start()
    trust = _trusting(certificate)
    monkeypatch.setenv(
        "SSL_CERT_FILE", str(certificate / "fullchain.pem")
    )  # read when huggingface_hub makes a session
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # Git LFS
    huggingface_hub.close_session()
    try:
        folder = tiny_repo_with_head(tmp_path / "model")
        api = HfApi(endpoint=lb.tls_url, token=WRITE_TOKEN)
        repo_id = f"writer/tls-{uuid.uuid4().hex[:8]}"
        api.create_repo(repo_id)
        api.upload_folder(repo_id=repo_id, folder_path=folder)
        got = snapshot_download(
            repo_id, endpoint=lb.tls_url, token=WRITE_TOKEN, cache_dir=tmp_path / "cache"
        )
        assert (Path(got) / WEIGHTS_FILE).read_bytes() == (folder / WEIGHTS_FILE).read_bytes()
        data = uuid.uuid4().bytes * 64
        href = lfs_batch(lb.tls_url, repo_id, data, verify=trust)["actions"]["upload"]["href"]
        assert href.startswith(f"{lb.tls_url}/{repo_id}.git/info/lfs/objects/"), href
        assert httpx.put(href, content=data, verify=trust, timeout=60).status_code == 200
        # the balancer is the edge: a client's own X-Forwarded-For reaches no log
        caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
        forged = {"X-Forwarded-For": "203.0.113.66"}
        httpx.get(f"{lb.tls_url}/api/models?forged", headers=forged, verify=trust, timeout=30)
        deadline = time.monotonic() + 10  # the access log is written after the response
        while not (lines := _access_lines(caplog, formatter, "/api/models?forged")):
            assert time.monotonic() < deadline, "no access log line for the request"
            time.sleep(0.02)
        assert all("127.0.0.1" in line and "203.0.113" not in line for line in lines), lines
    finally:
        huggingface_hub.close_session()
        lb.stop()


def test_the_hub_believes_the_forwarded_scheme_from_its_forwarded_allow_ips_alone(
    certificate, tmp_path
):
    """``vip-hub serve`` believes X-Forwarded-Proto from the addresses ``forwarded_allow_ips``
    names: behind a balancer it does not name, its URLs keep the scheme it was reached by (the
    balancer's plain http), whatever the balancer forwards."""
    server = ProcessServer(
        tmp_path / "store", extra_env={"VIP_HUB_FORWARDED_ALLOW_IPS": "192.0.2.1"}
    ).start()
    address = server.url.removeprefix("http://")
    lb = Nginx(tmp_path / "nginx", free_port(), [address], [address], tls=certificate).start()
    try:
        repo_id = "writer/plain"
        created = httpx.post(
            f"{server.url}/api/repos/create",
            headers={"Authorization": f"Bearer {WRITE_TOKEN}"},
            json={"name": "plain", "organization": "writer", "type": "model"},
            timeout=60,
        )
        assert created.status_code == 200, created.text
        entry = lfs_batch(lb.tls_url, repo_id, b"x" * 100, verify=_trusting(certificate))
        href = entry["actions"]["upload"]["href"]
        assert href.startswith(f"http://127.0.0.1:{lb.tls_port}/"), href
    finally:
        lb.stop()
        server.stop()
