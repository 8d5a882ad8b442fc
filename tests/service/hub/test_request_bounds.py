"""Bounded work for every request (issue 35, points 1, 2, 6 and 7): the JSON-depth check is
linear and off the event loop; a card's front matter is capped in size and depth and each model
page is rendered once per commit; /v1 admits a bounded number of bodies (429 with Retry-After
before reading more) so concurrent maximal bodies stay within a stated memory; /datasets/NAME
is the dataset's page; no third-party script on /docs and no image from elsewhere on the pages
(point 7's Xet answers: test_hub_access.py). A real server, real clients."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import selectors
import shutil
import socket
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi
from support.helpers import tiny_repo_with_head, with_front_matter
from support.live import WRITE_TOKEN, ThreadedServer, raw_commit, settings_for

from service.body_limits import JsonDepth, json_problem
from service.pages.render import markdown_html
from vip_hub import verify_repo
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import CARD_FILE

MIB = 1024 * 1024
QUADRATIC = b"[" * 9 + b'"' + b'\\"' * (MIB // 2)
"""The issue's body at 1 MB: 9 brackets, then one string of escaped quotes that never closes
(a regex over strings tried it from each of its 524,288 quotes)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Hub and inference with default limits."""
    with ThreadedServer(settings_for(tmp_path_factory.mktemp("bounds-store"))) as server:
        yield server


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A tiny exported repo; each test publishes its own copy."""
    return tiny_repo_with_head(tmp_path_factory.mktemp("bounds-repo") / "repo")


def _copy(exported: Path, folder: Path) -> Path:
    return Path(shutil.copytree(exported, folder))


def _metric(server: ThreadedServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


# ---------------------------------------------------------------------- 1. JSON depth, linear


def test_json_depth_is_one_pass_over_strings_and_escapes():
    """The scanner's steps grow linearly with the body (each a fixed number of operations on
    ``JsonDepth.BLOCK`` bytes), and strings, escapes and backslash runs crossing its blocks
    are tracked: brackets inside strings never count."""
    from service.body_limits import JsonDepth

    steps = []
    for size in (1, 2, 4):
        scan = JsonDepth()
        assert scan.feed(QUADRATIC[:10] + b'\\"' * (size * MIB // 2)) == 9
        steps.append(scan.blocks)
    assert steps == [math.ceil((10 + size * MIB) / JsonDepth.BLOCK) for size in (1, 2, 4)]
    assert JsonDepth(stop_above=8).feed(QUADRATIC) == 9
    pad = b" " * (JsonDepth.BLOCK - 3)  # puts the next bytes across a block boundary
    cases = {
        b'["[[[", "\\"[[", "\\\\", [["]"]]]': 3,
        b"[" + pad + b'"\\\\\\"[[[[", [[]]]': 3,  # an escaped quote across the boundary
        b"[" + pad + b'"\\\\", [[[]]]]': 4,  # an even backslash run: the string ends
        # a run ending a block, its quote the next block's first byte: odd escapes it, even not
        b"[" + pad + b'"\\"[[[[", [[]]]': 3,
        b"[" + pad[1:] + b'"\\\\", [[[]]]]': 4,
        b'{"a": {"b": [1, {"c": "}}}}"}]}}': 4,
    }
    for text, depth in cases.items():
        assert json.loads(text) is not None
        assert JsonDepth().feed(text) == depth, text[-40:]


def test_a_json_body_of_millions_of_values_is_refused_before_it_is_parsed(server):
    """64 MB of two-letter strings parse into about a gigabyte of Python objects (then pydantic's
    copy) before the image count is checked: refused first, 413 naming the values' bound."""
    url = f"{server.url}/v1/embeddings"
    values = b",".join([b'"ab"'] * (server.settings.inference.max_request_bytes // 5 - 8))
    r = httpx.post(
        url,
        content=b'{"model": "vip/x", "input": [' + values + b"]}",
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    most = server.settings.inference.max_json_commas + 1
    assert r.status_code == 413 and f"more than {most} values" in r.json()["error"], r.text
    commas = b'{"model": "vip/x", "input": ["a,b", "[,]"], "labels": ["' + b"," * 10_000 + b'"]}'
    assert json_problem(commas, 8, 3) is None  # commas inside strings are text


@pytest.mark.parametrize(
    "content_type", ["application/JSON", "Application/Json; charset=utf-8", "application/ld+JSON"]
)
def test_json_bounds_hold_whatever_the_content_type_case(server, content_type):
    """A media type is case-insensitive and FastAPI parses each of these as JSON: the depth and
    values bounds are checked before, as for ``application/json``."""
    url = f"{server.url}/v1/embeddings"
    headers = {"Content-Type": content_type}
    deep = b'{"model": "vip/x", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(url, content=deep, headers=headers, timeout=60)
    assert r.status_code == 400 and "nested deeper than 8 levels" in r.json()["error"], r.text
    wide = b'{"model": "vip/x", "input": "QUFB", "x": [' + b",".join([b"0"] * 100_000) + b"]}"
    r = httpx.post(url, content=wide, headers=headers, timeout=60)
    assert r.status_code == 413 and "values in its lists" in r.json()["error"], r.text


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32-le"])
def test_json_in_utf16_or_utf32_is_refused_before_it_is_parsed(server, encoding):
    """Python's parser reads UTF-16 and UTF-32 too, where a character's bytes can be a quote
    (U+0122: 22 01) and hide the brackets and commas after it from the byte scan: such a body is
    refused (RFC 8259: JSON between systems is UTF-8), however small."""
    url = f"{server.url}/v1/embeddings"
    headers = {"Content-Type": "application/json"}
    for tail in ("[" * 5000 + "]" * 5000, "[" + ",".join(["0"] * 100_000) + "]", "1"):
        body = '{"model": "vip/x", "input": "\u0122", "x": ' + tail + "}"
        r = httpx.post(url, content=body.encode(encoding), headers=headers, timeout=60)
        assert r.status_code == 400 and "not UTF-8" in r.json()["error"], r.text[:300]


def test_a_repeated_content_type_is_refused_before_the_json_checks_are_skipped(server):
    """``application/json`` then ``text/plain``: the middleware read the last (no JSON checks)
    and FastAPI the first (parsed as JSON), so a 6 MB body of two million ``{}`` took 76 s and
    3.7 GB to answer 422 with 254 MB of errors. A header sent twice is now refused at once."""
    url = f"{server.url}/v1/embeddings"
    body = b'{"model": "vip/x", "input": [' + b",".join([b"{}"] * 200_000) + b"]}"
    headers = [("Content-Type", "application/json"), ("Content-Type", "text/plain")]
    r = httpx.post(url, content=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert "content-type header is sent more than once" in r.json()["error"], r.text


@pytest.mark.parametrize(
    ("content_type", "body"),
    [("application/json", b'{"model": "vip/x", "input": "\xff\xfe"}'), ("text/plain", b"\xff\xfe")],
)
def test_a_body_not_in_utf8_gets_a_message_naming_it(server, content_type, body):
    """Stray bytes in a JSON body got Starlette's ``There was an error parsing the body``, not the
    service's error; sent as ``text/plain``, the 422 handler itself raised (500) echoing them."""
    body = body.decode("unicode_escape").encode("latin-1")
    r = httpx.post(
        f"{server.url}/v1/embeddings", content=body, headers={"Content-Type": content_type}
    )
    if content_type == "application/json":
        assert r.status_code == 400 and "not UTF-8" in r.json()["error"], r.text
        assert "byte 29 is invalid start byte" in r.json()["error"], r.text
    else:
        assert r.status_code == 422 and r.json()["detail"][0]["input"] == "\ufffd\ufffd", r.text


def test_an_integer_longer_than_python_reads_is_named_by_its_byte(server):
    """A 5,000-digit integer got Starlette's bare ``There was an error parsing the body``; it is
    now a 400 naming its byte and length. As long a run of digits in a string, a fraction or an
    exponent is no integer: it reaches the route's validation (422 naming the field)."""
    url, headers = f"{server.url}/v1/embeddings", {"Content-Type": "application/json"}
    digits = "7" * 5000
    r = httpx.post(url, content=f'{{"model": "vip/x", "input": [-{digits}]}}', headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == (
        "JSON body holds an integer of 5,000 digits at byte 29, over the 4,300 Python reads"
    )
    assert r.headers["X-Error-Message"] == r.json()["error"]
    for number in (f'"{digits}"', f"0.{digits}", f"1e{digits}", f"1E-{digits}"):
        body = f'{{"model": "vip/x", "input": "QUFB", "dimensions": {number}}}'
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "dimensions", r.text


def test_starlettes_own_errors_come_in_the_services_shape(server):
    """A GET on an inference route answered 404 "repository v1/embeddings not found" (the model
    page's route took it), and a multipart body without a boundary or of over 1,000 files got
    Starlette's bare ``{"detail": ...}``. Each is now an ``{"error": ...}`` naming what was
    wrong, also in ``X-Error-Message``; no repo can be created under ``v1/`` or ``api/``."""
    for route in ("embeddings", "embeddings/files", "classify", "captions", "zero-shot"):
        r = httpx.get(f"{server.url}/v1/{route}")
        assert r.status_code == 405 and r.headers["Allow"] == "POST", r.text
        assert r.json() == {"error": f"GET /v1/{route}: the route takes POST"}
    r = httpx.get(f"{server.url}/a%20b/%E2%80%AE/commit/main", follow_redirects=False)
    assert r.status_code == 400 and "invalid organisation" in r.json()["error"], r.text
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json() == {"error": "GET /v1/nothing: not found"}, r.text
    assert httpx.get(f"{server.url}/v1/models").status_code == 200
    files = f"{server.url}/v1/embeddings/files"
    r = httpx.post(files, content=b"--x\r\n", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and "Missing boundary" in r.json()["error"], r.text
    part = b'--B\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\nx\r\n'
    r = httpx.post(
        files,
        content=part * 1001 + b"--B--\r\n",
        headers={"Content-Type": "multipart/form-data; boundary=B"},
    )
    assert r.status_code == 400 and "Too many files" in r.headers["X-Error-Message"], r.text
    for org in ("v1", "api"):
        r = httpx.post(
            f"{server.url}/api/repos/create",
            json={"name": "embeddings", "organization": org},
            headers={"Authorization": "Bearer vh_test_admin_token"},
        )
        assert r.status_code == 400 and f"under {org}/" in r.json()["error"], r.text


@pytest.mark.parametrize("flag", ["1", "true", "True", "yes", "on"])
def test_a_pull_request_asked_for_in_any_spelling_is_refused(server, flag):
    """``create_pr`` was read as a pull request only when ``1`` or ``true``: ``True``, ``yes``
    or ``on`` published the change straight to main."""
    auth, repo = {"Authorization": f"Bearer {WRITE_TOKEN}"}, f"pr-{flag.encode().hex()}"
    created = httpx.post(
        f"{server.url}/api/repos/create", json={"name": repo, "organization": "vip"}, headers=auth
    )
    assert created.status_code == 200, created.text
    r = httpx.post(
        f"{server.url}/api/models/vip/{repo}/commit/main",
        params={"create_pr": flag},
        content=b"",
        headers=auth,
    )
    assert r.status_code == 400 and "pull requests are not supported" in r.json()["error"], r.text


def test_what_the_body_limits_refuse_is_counted(server):
    """The request metrics sat inside the body limits: a 413, a 400 for depth or a 429 they
    answered never reached ``vip_hub_requests_total`` nor the access log."""

    def refused() -> float:  # the 400s counted so far, whatever their route
        text = httpx.get(server.url + "/metrics").text
        counts = re.findall(r'^vip_hub_requests_total\{[^}]*status="400"[^}]*\} (\S+)$', text, re.M)
        return sum(map(float, counts))

    before = refused()
    deep = b'{"model": "vip/x", "input": ' + b"[" * 100 + b"]" * 100 + b"}"
    r = httpx.post(
        f"{server.url}/v1/embeddings", content=deep, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert refused() == before + 1


def test_the_utf8_check_reads_blocks_and_names_the_byte_across_them():
    """The UTF-8 check decodes a block at a time (no copy of the body): a character split
    across two blocks is UTF-8, and a bad byte is named at its place in the body."""
    block = JsonDepth.BLOCK
    split = b'"' + b"a" * (block - 2) + "é".encode() + b'"'  # é's two bytes in two blocks
    assert json_problem(split, 8, 3) is None
    for body, at, why in [
        (b'"' + b"a" * (block - 2) + b"\xc3(" + b'"', block - 1, "invalid continuation byte"),
        (b'"' + b"a" * (2 * block) + b"\xff" + b'"', 2 * block + 1, "invalid start byte"),
        (b'"abc\xc3', 4, "unexpected end of data"),
    ]:
        problem = json_problem(body, 8, 3)
        assert problem is not None and f"byte {at} is {why}" in problem.message, problem


def test_a_body_that_never_arrives_frees_its_share(tmp_path):
    """Four connections that sent a chunked body's headers and one byte held the whole
    ``max_pending_bytes`` (each counted as a maximal body) for as long as they stayed open:
    every other /v1 request got 429. An admitted body now has ``body_timeout_s`` to arrive."""
    settings = settings_for(tmp_path, inference={"max_pending_requests": 1, "body_timeout_s": 1.0})
    head = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    with ThreadedServer(settings) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as idle:
            idle.sendall(head)
            ((status, _, answer),) = _first_answers([idle], 1).values()
            assert status == 408 and "did not arrive within 1 s" in answer["error"], answer
        r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "a/b", "input": "QUFB"})
        assert r.status_code != 429, r.text  # its share is free again


def test_a_quadratic_json_body_is_refused_while_healthz_answers(server):
    """Four 1 MB bodies of the issue's shape, at once: each is refused with 400 naming the depth
    limit, and /healthz answers meanwhile (the check runs in worker threads, in linear work;
    before, each took about half an hour on the event loop)."""
    url = f"{server.url}/v1/embeddings"
    headers = {"Content-Type": "application/json"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        calls = [
            pool.submit(httpx.post, url, content=QUADRATIC, headers=headers, timeout=120)
            for _ in range(4)
        ]
        health = [httpx.get(server.url + "/healthz", timeout=30).status_code for _ in range(5)]
        answers = [c.result() for c in calls]
    assert health == [200] * 5
    for r in answers:
        assert r.status_code == 400 and "nested deeper than 8 levels" in r.json()["error"]


# ------------------------------------------------------------- 2. YAML front matter, pages


def test_validate_yaml_caps_front_matter_depth_and_size(server, tmp_path):
    nested = "---\nlicense: mit\nx: " + "[" * 20_000 + "]" * 20_000 + "\n---\n# card\n"
    r = httpx.post(server.url + "/api/validate-yaml", json={"content": nested}, timeout=60)
    assert r.status_code == 400, r.text  # was 500: an uncaught RecursionError
    assert "deeper than the limit of 20 levels" in r.json()["errors"][0]["message"]
    big = "---\nlicense: mit\n" + "k: v\n" * 14_000 + "---\n"  # 70 KB
    r = httpx.post(server.url + "/api/validate-yaml", json={"content": big}, timeout=60)
    assert r.status_code == 400 and "over the limit of 65536 bytes" in r.json()["error"]
    settings = settings_for(
        tmp_path, hub={"max_front_matter_bytes": 200, "max_front_matter_depth": 3}
    )
    with ThreadedServer(settings) as small:
        for text, message in (
            ("---\nx: [[[1]]]\n---\n", "deeper than the limit of 3 levels"),  # the mapping: 1
            ("---\nx: [[1]]\n" + "k: v\n" * 50 + "---\n", "over the limit of 200 bytes"),
        ):
            r = httpx.post(small.url + "/api/validate-yaml", json={"content": text})
            assert r.status_code == 400 and message in r.json()["error"], r.text
        ok = httpx.post(small.url + "/api/validate-yaml", json={"content": "---\nx: [[1]]\n---\n"})
        assert ok.status_code == 200


def test_a_card_nested_too_deep_is_refused_at_commit(server, exported, tmp_path):
    folder = _copy(exported, tmp_path / "deep")
    readme = folder / CARD_FILE
    readme.write_text(
        with_front_matter(readme.read_text(), "deep: " + "[" * 300 + "]" * 300 + "\n")
    )
    report = verify_repo(folder, check_accounting=False)
    assert any("limit of 20 levels" in str(p) for p in report.problems)
    HfApi(endpoint=server.url, token=WRITE_TOKEN).create_repo("writer/deep")
    r = raw_commit(
        server.url,
        "writer/deep",
        {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in folder.rglob("*")
            if p.is_file()
        },
    )
    assert r.status_code == 400 and "limit of 20 levels" in r.json()["error"], r.text


def test_a_model_page_is_rendered_once_per_commit(server, exported, tmp_path):
    folder = _copy(exported, tmp_path / "paged")
    push_repo(folder, "writer/paged", endpoint=server.url, token=WRITE_TOKEN)
    before = _metric(server, "vip_hub_page_renders_total")
    pages = [httpx.get(server.url + "/writer/paged", timeout=30) for _ in range(3)]
    assert [p.status_code for p in pages] == [200] * 3 and pages[0].text == pages[2].text
    assert _metric(server, "vip_hub_page_renders_total") == before + 1
    (folder / "notes.txt").write_text("a new commit\n")
    push_repo(folder, "writer/paged", endpoint=server.url, token=WRITE_TOKEN)
    for _ in range(2):
        assert "notes.txt" in httpx.get(server.url + "/writer/paged", timeout=30).text
    assert _metric(server, "vip_hub_page_renders_total") == before + 2


# --------------------------------------------------------- 6. bounded /v1 bodies and queue


def _start(port: int, length: int, head: bytes) -> socket.socket:
    """A POST /v1/embeddings of ``length`` body bytes, of which only ``head`` is sent yet."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {length}\r\n\r\n".encode()
        + head
    )
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body of the response on ``sock``."""
    sock.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_concurrent_maximal_bodies_stay_within_the_pending_budget(tmp_path):
    """Twelve clients send maximal (2 MiB) bodies at once to a server that holds at most
    4 MiB + 64 KiB of /v1 bodies: two are read, the other ten are answered 429 with Retry-After
    from their headers alone, and the server's allocations while it serves them stay under
    4 x max_pending_bytes: each admitted body, its parsed text and what is decoded from it, the
    two held at once since the routes read the index off the event loop (twelve bodies read at
    once would be 24 MiB before any parsing, 96 MiB with theirs).
    Then a count limit: small bodies are admitted up to max_pending_requests."""
    body_bytes, clients = 2 * MIB, 12
    budget = 2 * body_bytes + 64 * 1024
    settings = settings_for(
        tmp_path,
        inference={
            "max_request_bytes": body_bytes,
            "max_pending_bytes": budget,
            "max_pending_requests": 3,
        },
    )
    payload = b"A" * (body_bytes - 40)  # valid base64, decoded before the model is looked up
    body = b'{"model": "writer/none", "input": "' + payload + b'"}'
    body += b" " * (body_bytes - len(body))
    view = memoryview(body)
    with ThreadedServer(settings) as server:
        tracemalloc.start()
        try:
            socks = [_start(server.port, len(body), view[:1024]) for _ in range(clients)]
            refused = _first_answers(socks, clients - 2)
            admitted = [s for s in socks if s not in refused]
            for sock in admitted:  # the rest of their bodies, but the last byte
                sock.sendall(view[1024:-1])
            for sock in admitted:
                sock.sendall(view[-1:])
            done = [_answer(s) for s in admitted]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        for status, headers, answer in refused.values():
            assert status == 429 and headers["retry-after"] == "1"
            assert f"the limit of {budget}" in answer["error"]
        assert [status for status, _, _ in done] == [404, 404], done  # no such model
        assert peak < 4 * budget, f"{peak / MIB:.1f} MiB"
        for sock in socks:
            sock.close()
        small = [_start(server.port, 100, b"{") for _ in range(4)]  # count limit: 3 at once
        refused = _first_answers(small, 1)
        ((status, headers, answer),) = refused.values()
        assert status == 429 and "3 requests" in answer["error"]
        for sock in small:
            sock.close()


def _first_answers(socks: list[socket.socket], n: int) -> dict[socket.socket, tuple]:
    """The first ``n`` sockets to be answered, with their answers (the others are not)."""
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        answered: dict[socket.socket, tuple] = {}
        while len(answered) < n:
            ready = sel.select(timeout=60)
            assert ready, f"{len(answered)} of {n} requests answered"
            for key, _ in ready:
                answered[key.fileobj] = _answer(key.fileobj)  # type: ignore[index]
                sel.unregister(key.fileobj)
    return answered


@pytest.mark.parametrize("coding", [b"chunked", b"Chunked", b"CHUNKED"])
def test_chunked_bodies_count_whatever_the_coding_case(tmp_path, coding):
    """A transfer coding's name is case-insensitive (RFC 9112): a chunked body, whose length is
    not known, counts as a maximal one in every spelling; with room for one, a second such
    request is answered 429 before its body is read."""
    settings = settings_for(tmp_path, inference={"max_pending_requests": 1})
    head = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + b"Transfer-Encoding: "
        + coding
        + b'\r\n\r\n10\r\n{"model": "a/b",\r\n'
    )
    with ThreadedServer(settings) as server:
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        for sock in socks:
            sock.sendall(head)
        ((status, headers, answer),) = _first_answers(socks, 1).values()
        assert status == 429 and "1 requests" in answer["error"], answer
        for sock in socks:
            sock.close()


# ------------------------------------------------------------------------------- 7. low


def test_a_dataset_name_without_a_slash_has_its_page(server, exported, tmp_path):
    push_repo(_copy(exported, tmp_path / "ds"), "writer/ds", endpoint=server.url, token=WRITE_TOKEN)
    page = httpx.get(server.url + "/datasets/test-images", timeout=30)
    assert page.status_code == 200, page.text  # was 404: "repository datasets/test-images"
    assert "/writer/ds" in page.text and "dp-pretraining" in page.text
    missing = httpx.get(server.url + "/datasets/nobody", timeout=30)
    assert missing.status_code == 404 and "no public release names" in missing.json()["error"]
    r = httpx.post(
        f"{server.url}/api/repos/create",
        json={"name": "x", "organization": "datasets"},
        headers={"Authorization": "Bearer vh_test_admin_token"},
    )
    assert r.status_code == 400 and "datasets/" in r.json()["error"]


def test_no_third_party_script_and_images_only_from_the_hub(server, exported, tmp_path):
    assert httpx.get(server.url + "/docs").status_code == 404
    assert httpx.get(server.url + "/redoc").status_code == 404
    assert httpx.get(server.url + "/openapi.json").status_code == 200
    with ThreadedServer(settings_for(tmp_path, api_docs=True)) as docs:
        assert httpx.get(docs.url + "/docs").status_code == 200  # the operator's choice
    html = markdown_html(
        "![plot](https://elsewhere.example/p.png) ![curve](curve.png)", "/o/n/resolve/c"
    )
    assert '<img src="/o/n/resolve/c/curve.png"' in html
    assert '<a href="https://elsewhere.example/p.png"' in html and '<img src="https' not in html
    folder = _copy(exported, tmp_path / "imgs")
    readme = folder / CARD_FILE
    readme.write_text(readme.read_text() + "\n![plot](https://elsewhere.example/p.png)\n")
    push_repo(folder, "writer/imgs", endpoint=server.url, token=WRITE_TOKEN)
    page = httpx.get(server.url + "/writer/imgs", timeout=30)
    csp = page.headers["content-security-policy"]
    assert "img-src 'self';" in csp and "https:" not in csp and "data:" not in csp
    assert 'href="https://elsewhere.example/p.png"' in page.text
    assert 'src="https://elsewhere.example' not in page.text


def test_a_client_that_hangs_up_mid_upload_is_a_499_not_a_server_fault(server, caplog):
    """``ClientDisconnect`` from a body cut short was an unhandled exception: counted as a 500,
    logged as an ERROR with its traceback, as if the server had failed."""

    def counted(status: str) -> float:
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        mark = f'status="{status}"}} '  # the route, before it, may hold braces
        return sum(
            float(n.split(mark)[1])
            for n in lines
            if n.startswith("vip_hub_requests_total") and mark in n
        )

    auth = {"Authorization": f"Bearer {WRITE_TOKEN}"}
    created = httpx.post(
        f"{server.url}/api/repos/create",
        json={"name": "hangup", "organization": "vip"},
        headers=auth,
    )
    assert created.status_code == 200, created.text
    before = counted("499"), counted("500")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /api/models/vip/hangup/commit/main HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {WRITE_TOKEN}\r\n".encode()
            + b"Content-Type: application/x-ndjson\r\nContent-Length: 1000000\r\n\r\n"
            + b'{"key": "header", "value": {"summary": "x"}}\n'
            + b'{"key": "file", "value": {"path": "a.txt", "content": "'
            + b"QUJD" * 2000
        )
    for _ in range(100):
        if counted("499") > before[0]:
            break
        time.sleep(0.05)
    assert (counted("499"), counted("500")) == (before[0] + 1, before[1])
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
