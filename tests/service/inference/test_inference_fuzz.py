"""Schemathesis fuzzes the live server's OpenAPI schema: no request may cause a 5xx."""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_openapi_fuzz_has_no_server_errors(hub, published, tmp_path):
    from support.dpcap import DPCAP, publish_dpcap

    publish_dpcap(
        tmp_path / "dpcap"
    )  # a repo that captions, so the fuzzed captions and zero-shot run too
    assert DPCAP in {m["id"] for m in httpx.get(f"{hub.url}/v1/models").json()["data"]}
    schema = httpx.get(f"{hub.url}/openapi.json").json()
    assert {
        "/v1/embeddings",
        "/v1/embeddings/files",
        "/v1/classify",
        "/v1/captions",
        "/v1/zero-shot",
        "/v1/models",
        "/healthz",
    } <= set(schema["paths"])
    st = Path(sys.executable).with_name("schemathesis")
    # One worker: hypothesis parses lambda sources while generating, and CPython 3.11's
    # ast.parse is not thread-safe ("AST constructor recursion depth mismatch" with two).
    r = subprocess.run(
        [
            str(st),
            "run",
            f"{hub.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--workers",
            "1",
            "--seed",
            "1",
            "--phases",
            "examples,coverage,fuzzing",
            "--generation-database",
            ":memory:",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert httpx.get(f"{hub.url}/healthz").status_code == 200
