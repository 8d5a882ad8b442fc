"""No credential in an access log (issue 53, Low: upload grants in access logs). An upload URL's
grant (a bearer credential for an hour) and a presigned S3 URL's signature, key and token reach
the hub in a query: the hub's access log writes their values REDACTED, and the shipped nginx
(``docker/nginx.conf``, run by ``system.Nginx`` as the image runs it) writes no query at all.
A real server, real uploads, the real nginx."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import pytest
from huggingface_hub import HfApi
from support.live import WRITE_TOKEN, lfs_batch
from support.ports import free_port
from support.system import Nginx

from service.ops import ACCESS_LOGGER, CREDENTIAL_PARAMETERS, log_config

SECRETS = {
    "grant": "SECRET-GRANT",
    "X-Amz-Signature": "SECRET-SIGNATURE",
    "x-amz-credential": "SECRET-CREDENTIAL",
    "X-Amz-Security-Token": "SECRET-TOKEN",
}
"""Every credential parameter, in the cases a client may write it."""


@pytest.fixture(scope="module")
def balancer(hub, tmp_path_factory):
    """The shipped nginx in front of the module's hub."""
    address = hub.url.removeprefix("http://")
    lb = Nginx(tmp_path_factory.mktemp("nginx"), free_port(), [address], [address]).start()
    try:
        yield lb
    finally:
        lb.stop()


def _upload(url: str, repo_id: str, data: bytes) -> tuple[str, str]:
    """Upload ``data`` as the Git LFS client does, through ``url``: the batch call, then a PUT to
    the URL it answers. That URL's path and grant."""
    href = lfs_batch(url, repo_id, data)["actions"]["upload"]["href"]
    assert httpx.put(href, content=data, timeout=60).status_code == 200
    target = urlsplit(href)
    return target.path, parse_qs(target.query)["grant"][0]


def _with_secrets(url: str) -> str:
    """A request carrying every credential parameter, one percent-encoded, beside others."""
    query = urlencode({"search": "vip", **SECRETS}) + "&gr%61nt=SECRET-ENCODED"
    r = httpx.get(f"{url}/api/models?{query}", timeout=30)
    assert r.status_code in (200, 400, 422), r.text
    return query


def _wait_for(read: Callable[[], str], *needles: str) -> str:
    """What ``read()`` gives once it holds every needle (access logs are written after the
    response has gone out)."""
    deadline = time.monotonic() + 10
    while not all(n in (text := read()) for n in needles):
        assert time.monotonic() < deadline, (needles, text[-2000:])
        time.sleep(0.02)
    return text


def test_the_credential_parameters_are_the_ones_clients_send():
    assert {k.lower() for k in SECRETS} == CREDENTIAL_PARAMETERS


def test_the_hubs_access_log_redacts_grants_and_signatures(hub, caplog):
    from uvicorn.logging import AccessFormatter

    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    formatter = AccessFormatter(
        fmt=log_config()["formatters"]["vip_hub_access"]["fmt"], use_colors=False
    )

    def log() -> str:
        return "\n".join(formatter.format(r) for r in caplog.records if r.name == ACCESS_LOGGER)

    HfApi(token=WRITE_TOKEN).create_repo("writer/grants")
    data = b"an object uploaded with a grant\n"
    path, grant = _upload(hub.url, "writer/grants", data)
    _with_secrets(hub.url)
    text = _wait_for(log, f"PUT {path}?", "GET /api/models?")
    assert f'"PUT {path}?size={len(data)}&grant=REDACTED HTTP/1.1" 200' in text, text
    assert (
        "GET /api/models?search=vip&grant=REDACTED&X-Amz-Signature=REDACTED&"
        "x-amz-credential=REDACTED&X-Amz-Security-Token=REDACTED&gr%61nt=REDACTED HTTP/1.1"
    ) in text, text
    for secret in [grant, *SECRETS.values(), "SECRET-ENCODED"]:
        assert secret not in text


def test_nginx_logs_no_query(hub, balancer):
    """Through the shipped nginx (nginx's default format logs the request line, query and all):
    its access log names each request's path, and no grant."""
    HfApi(token=WRITE_TOKEN).create_repo("writer/grants-lb")
    path, grant = _upload(balancer.url, "writer/grants-lb", b"through the balancer\n")
    _with_secrets(balancer.url)
    text = _wait_for(balancer.access_log.read_text, f'"PUT {path} HTTP/1.1" 200', "/api/models")
    assert '"GET /api/models HTTP/1.1" ' in text, text
    for secret in [grant, *SECRETS.values(), "SECRET-ENCODED", "search=vip"]:
        assert secret not in text, secret
