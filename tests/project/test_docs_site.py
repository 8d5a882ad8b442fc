"""The documentation site: built strictly (``mkdocs build --strict``), served by a real HTTP
server on loopback and opened page by page in Debian's Chromium through chromedriver, finding no
broken internal link (pages and anchors) and no empty page; and the quick start's code blocks,
run as they stand against a hub of the test's own."""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urlsplit

import httpx
import pytest
import torch
from PIL import Image
from support.helpers import (
    BENCHMARKS_README,
    PROJECT_README,
    ROOT,
    TINY,
    dp_stage,
    synthetic_stage,
    tiny_encoder,
)
from support.live import WRITE_TOKEN
from support.ports import free_port
from support.system import CHROMIUM_FLAGS, debian_program

from vip_hub import Dataset, NonPrivateStage, export_encoder
from vip_hub.repo.heads import HeadInfo, LinearProbe, save_head
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import head_component

QUICKSTART = ROOT / "docs" / "get-started" / "quickstart.md"
HOOK = ROOT / "docs" / "hooks" / "reference.py"
MAKE_RUN_HUB = "http://127.0.0.1:8000"
"""Where the quick start expects the hub that `make run` serves; the test points it at its own."""
MIN_TEXT = 200
"""Characters of text a page's article must hold: a stub, or a reference page whose generator
produced nothing, has a title and little else."""
PAGE_FACTS = """() => {
  const article = document.querySelector("article") || document.body;
  return {
    h1: (article.querySelector("h1") || {textContent: ""}).textContent.trim(),
    text: article.innerText.trim().length,
    ids: Array.from(document.querySelectorAll("[id]"), (e) => e.id),
    links: Array.from(document.querySelectorAll("a[href]"), (a) => a.href),
  };
}"""


def build_site(out: Path) -> None:
    """``mkdocs build --strict`` (what ``make docs`` runs) into ``out``."""
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """The folder over HTTP on 127.0.0.1 (Python's own server, in a thread); yields its URL."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def browser(chromium: str, chromedriver: str, profile: Path) -> Iterator[Browser]:
    """A Chromium session through chromedriver, both stopped on the way out."""
    port = free_port()
    driver = subprocess.Popen(
        [chromedriver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    session = None
    # one client for the session's requests (a client per request loads the CA bundle each time)
    client = httpx.Client(timeout=120)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/status", timeout=1).json()["value"]["ready"]:
                    break
            time.sleep(0.05)
        options = {"binary": chromium, "args": [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]}
        caps = {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}
        reply = client.post(url + "/session", json={"capabilities": caps})
        assert reply.status_code == 200, reply.text
        session = f"{url}/session/{reply.json()['value']['sessionId']}"
        yield Browser(session, client)
    finally:
        if session:
            with contextlib.suppress(httpx.HTTPError):
                client.delete(session, timeout=30)
        client.close()
        driver.terminate()
        driver.wait(30)


class Browser:
    """A Chromium session driven over the W3C WebDriver protocol (plain HTTP)."""

    def __init__(self, session: str, client: httpx.Client):
        self.session, self.client = session, client

    def open(self, url: str) -> None:
        """Navigate to ``url`` and wait until its document has loaded: chromedriver can answer
        the navigation while the previous page's document is still the one scripts see."""
        reply = self.client.post(self.session + "/url", json={"url": url})
        assert reply.status_code == 200, reply.text
        loaded = f"() => location.href === {json.dumps(url)} && document.readyState === 'complete'"
        deadline = time.monotonic() + 60
        while not self.run(loaded):
            assert time.monotonic() < deadline, f"{url} did not load"
            time.sleep(0.02)

    def block(self, *patterns: str) -> None:
        """Refuse every request whose URL matches one of ``patterns`` (DevTools wildcards)."""
        for cmd, params in (("Network.enable", {}), ("Network.setBlockedURLs", {"urls": patterns})):
            reply = self.client.post(
                self.session + "/goog/cdp/execute", json={"cmd": cmd, "params": params}
            )
            assert reply.status_code == 200, reply.text

    def run(self, function: str) -> Any:
        body = {"script": f"return ({function})();", "args": []}
        reply = self.client.post(self.session + "/execute/sync", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["value"]


def page_paths(site: Path) -> list[str]:
    """The URL path of every page the build wrote (``x/index.html`` is ``/x/``)."""
    pages = []
    for html in sorted(site.rglob("index.html")):
        rel = html.parent.relative_to(site).as_posix()
        pages.append("/" if rel == "." else f"/{rel}/")
    return pages


@pytest.mark.slow
def test_every_page_opens_in_a_browser_without_a_broken_link(tmp_path):
    site = tmp_path / "site"
    build_site(site)
    pages = page_paths(site)
    assert len(pages) >= 35, pages
    chromium = debian_program("chromium", "chromium", "/usr/bin/chromium")
    chromedriver = debian_program("chromedriver", "chromium-driver", "/usr/bin/chromedriver")
    facts: dict[str, dict[str, Any]] = {}
    with serve(site) as base, httpx.Client(timeout=30) as client:
        with browser(chromium, chromedriver, tmp_path / "profile") as chrome:
            # the theme's search fetches the whole site's index (1 MB) on every page and indexes
            # it in a worker: half the browser's time, and nothing this test reads
            chrome.block("*/search/search_index.json")
            for page in pages:
                chrome.open(base + page)
                facts[page] = chrome.run(PAGE_FACTS)
        empty = {p: f["text"] for p, f in facts.items() if not f["h1"] or f["text"] < MIN_TEXT}
        assert not empty, f"pages without a title or text: {empty}"
        broken, linked = [], set()
        fetch = functools.cache(lambda path: client.get(base + path).status_code)
        for page, f in facts.items():
            for link in f["links"]:
                target, anchor = urldefrag(link)
                if not target.startswith(base):
                    continue  # another site: never fetched by this test
                path = urlsplit(target).path
                linked.add(path)
                if path in facts:
                    if anchor and anchor not in facts[path]["ids"]:
                        broken.append(f"{page} -> {path}#{anchor} (no such anchor)")
                elif fetch(path) != 200:
                    broken.append(f"{page} -> {path}")
        assert not broken, "broken internal links:\n" + "\n".join(sorted(set(broken)))
    # every page is reachable from another one (the navigation), none is an orphan
    assert set(pages) - linked <= {"/"}, set(pages) - linked


def test_the_generated_reference_says_what_the_code_declares():
    """The reference pages come from the code (the site's build hook): each holds what its
    source declares."""
    spec = importlib.util.spec_from_file_location("docs_reference", HOOK)
    assert spec and spec.loader
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    cli = hook.cli_page()
    for command in ("vip-hub serve", "vip-hub verify", "vip-hub train-vip", "{create,list,revoke}"):
        assert command in cli, command
    assert "unavailable commands" not in cli  # every plugin loaded
    settings = hook.settings_page()
    for name in ("`hub.delta`", "`inference.max_batch_size`", "`object_store.bucket`"):
        assert name in settings, name
    assert "VIP_HUB_HUB__<NAME>" in settings
    assert "`/v1/classify`" in hook.rest_page()
    assert '"/v1/classify"' in hook.openapi_json()
    schema = hook.ledger_page()
    assert "vip-hub/privacy-ledger/v4" in schema and "## DPStage" in schema
    api = hook.api_page("T", "I", ["vip_hub.loading"])
    assert "::: vip_hub.loading" in api
    for page, (_, _, modules) in hook.API_PAGES.items():
        for module in modules:
            assert importlib.util.find_spec(module), (page, module)
    assert hook.benchmarks_page(BENCHMARKS_README).count("\n") > 100


# ---- the quick start ------------------------------------------------------------------------


def code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, re.S | re.M)


def fashion_repo(folder: Path) -> Path:
    """A tiny vip-nano repo shaped like the one `make run` publishes: a DP stage, and a 10-class
    head ``fashion-mnist`` on its ``avg`` features."""
    repo = export_encoder(
        folder, tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name=folder.name
    )
    torch.manual_seed(0)
    classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"]
    save_head(
        repo,
        LinearProbe(192, len(classes)).eval(),
        HeadInfo("fashion-mnist", "avg", classes, {"top1": 0.5}),
        NonPrivateStage(
            name="linear-probe:fashion-mnist",
            component=head_component("fashion-mnist"),
            dataset=Dataset(name="test-labels", size=30),
            private_data=True,
        ),
    )
    return repo


@pytest.fixture(scope="module")
def fashion_hub(hub, tmp_path_factory: pytest.TempPathFactory):
    """The module's hub, serving a repo named and shaped like the one `make run` publishes."""
    folder = tmp_path_factory.mktemp("published") / "vip-nano-fashion-dp"
    push_repo(fashion_repo(folder), "vip/vip-nano-fashion-dp", token=WRITE_TOKEN)
    return hub


def run_snippets(page: str, hub_url: str, cwd: Path) -> tuple[str, str]:
    """Run the ```python blocks of a page's Markdown as one script, then its ```bash blocks as one
    script (with the venv's programs on PATH), each against ``hub_url``; their outputs."""
    python = "\n".join(code_blocks(page, "python")).replace(MAKE_RUN_HUB, hub_url)
    shell = "\n".join(code_blocks(page, "bash")).replace(MAKE_RUN_HUB, hub_url)
    env = {
        **os.environ,
        "HF_HOME": str(cwd / "hf"),  # a user's fresh cache
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("HF_ENDPOINT", None)  # the snippets set it themselves
    (cwd / "snippets.py").write_text(python)
    outputs = []
    for cmd in ([sys.executable, "snippets.py"], ["bash", "-euo", "pipefail", "-c", shell]):
        ran = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-5000:]
        outputs.append(ran.stdout)
    return outputs[0], outputs[1]


@pytest.mark.slow
def test_the_quickstart_runs_against_a_hub(fashion_hub, tmp_path):
    page = QUICKSTART.read_text()
    assert "hf-hub:vip/vip-nano-fashion-dp" in page and "/v1/classify" in page
    assert "verify_repo" in page and "vip-hub verify" in page
    python, _ = run_snippets(page, fashion_hub.url, tmp_path)
    assert "torch.Size([1, 192])" in python  # timm's forward
    assert "-DP on " in python  # the guarantee's headline
    assert "T-shirt/top" in python or "Trouser" in python  # the head's labels
    assert "True []" in python  # verify's report: ok, no warning


@pytest.mark.slow
def test_the_readme_snippets_run_after_make_run(fashion_hub, tmp_path):
    """The README's snippets, where `make run` leaves its venv and its test images."""
    debian_program("curl", "curl")
    (tmp_path / ".venv").symlink_to(sys.prefix)
    coats = tmp_path / "var/run/fashion-mnist/test/Coat"
    coats.mkdir(parents=True)
    Image.new("L", (28, 28), 200).save(coats / "0.png")
    readme = PROJECT_README.read_text()
    section = readme.split("## After `make run`", 1)[1].split("\n## ", 1)[0]
    python, shell = run_snippets(section, fashion_hub.url, tmp_path)
    assert "torch.Size([1, 192])" in python
    answer, _ = json.JSONDecoder().raw_decode(shell)  # curl's answer, then verify's lines
    assert answer["head"] == "fashion-mnist" and len(answer["data"][0]["labels"]) == 3
    assert "-DP on " in shell  # verify's headline


def test_the_readme_is_two_screens_whose_links_resolve():
    readme = PROJECT_README.read_text()
    assert len(readme.splitlines()) <= 150
    assert "make run" in readme and "make test" in readme
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert len(local) >= 20, local  # the site's pages, by their Markdown files
    assert [t for t in local if not (ROOT / t).exists()] == []
