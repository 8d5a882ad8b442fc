"""The web pages: content, sorting and filtering, sanitised cards, and a real browser."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from support.helpers import TINY, audit_of, dp_stage, synthetic_stage, tiny_encoder
from support.live import WRITE_TOKEN, raw_commit
from support.system import CHROMIUM_FLAGS, debian_program

from service.pages.routes import MAX_CARD_BYTES
from vip_hub import export_encoder
from vip_hub.privacy.ledger import shown_epsilon
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import CARD_FILE, head_file


def _rows(html: str) -> list[str]:
    return [
        line.split('href="/')[1].split('"')[0]
        for line in html.splitlines()
        if 'class="model-link"' in line
    ]


def test_index_lists_sorts_and_filters(hub, published):
    html = httpx.get(hub.url + "/").text
    assert "vip/vip-nano-test" in html and "vip-nano" in html and "test-images" in html
    assert "no private data" in html  # the synthetic-only model
    by_eps = _rows(httpx.get(hub.url + "/", params={"sort": "epsilon", "order": "asc"}).text)
    assert by_eps.index("vip/vip-nano-syn") < by_eps.index("vip/vip-nano-test")
    only_public = _rows(httpx.get(hub.url + "/", params={"max_epsilon": "0"}).text)
    assert "vip/vip-nano-syn" in only_public and "vip/vip-nano-test" not in only_public
    assert httpx.get(hub.url + "/", params={"max_epsilon": "abc"}).status_code == 400
    assert httpx.get(hub.url + "/", params={"sort": "evil"}).status_code == 400


def test_model_page(hub, published):
    r = httpx.get(hub.url + "/vip/vip-nano-test")
    assert r.status_code == 200
    html = r.text
    for fragment in (
        "Privacy guarantee",
        "differential privacy for the dataset",
        "Privacy ledger",
        "dp-pretraining",
        "synthetic-pretraining",
        head_file("toy"),
        "History",
        "No guarantee covers",
    ):
        assert fragment in html, fragment
    commit = httpx.get(hub.url + "/api/models/vip/vip-nano-test").json()["sha"]
    assert commit[:10] in html
    assert (
        httpx.get(
            hub.url + f"/vip/vip-nano-test/commit/{commit}", follow_redirects=False
        ).status_code
        == 303
    )
    assert httpx.get(hub.url + "/vip/absent").status_code == 404


def test_card_html_is_sanitised(hub, tmp_path):
    folder = export_encoder(
        tmp_path / "xss",
        tiny_encoder(),
        TINY,
        [synthetic_stage(), dp_stage()],
        model_name="xss",
        summary=(
            "<script>alert(1)</script> [click](javascript:alert(2)) <img src=x onerror=alert(3)>"
        ),
    )
    push_repo(folder, "pages/xss", token=WRITE_TOKEN)
    html = httpx.get(hub.url + "/pages/xss").text
    assert "&lt;script&gt;alert(1)" in html  # shown as text
    assert (
        "<script>alert" not in html and 'href="javascript' not in html and "<img src=x" not in html
    )


ODD_FILES = {
    "docs/a.md": b"# a\n",
    "docs/a#b.md": b"# a#b\n",
    "docs/q+x=y.md": b"# q+x=y\n",  # ("?" is no name Windows writes)
    "docs/my notes.md": b"# my notes\n",
    "docs/r\u00e9sum\u00e9.md": b"# resume\n",
    ".notes.md": b"# dot\n",
}
"""Files whose names a URL must escape or keep ('#', '+', '=', ' ', non-ASCII; '%XX' is refused)."""


@pytest.fixture(scope="module")
def odd_names(hub, published) -> str:
    """A repo carrying ``ODD_FILES``, its card linking some of them by relative links."""
    push_repo(published["vip/vip-nano-test"], "pages/odd-names", token=WRITE_TOKEN)
    card = (published["vip/vip-nano-test"] / CARD_FILE).read_text()
    card += (
        "\n[notes](<docs/my notes.md>) [resume](docs/r\u00e9sum\u00e9.md) [a](docs/a.md#intro)\n"
        "[dot](.notes.md) [here](./docs/a.md)\n"
    )
    r = raw_commit(hub.url, "pages/odd-names", {CARD_FILE: card.encode(), **ODD_FILES})
    assert r.status_code == 200, r.text
    return "pages/odd-names"


def _resolve_links(html: str, repo_id: str) -> dict[str, str]:
    """Links to ``repo_id``'s files in ``html``: their text -> URL."""
    found = re.findall(rf'<a href="(/{repo_id}/resolve/[^"]+)"[^>]*>([^<]+)</a>', html)
    return {text: url.replace("&amp;", "&") for url, text in found}


def test_file_list_links_download_the_file_they_name(hub, odd_names):
    links = _resolve_links(httpx.get(f"{hub.url}/{odd_names}").text, odd_names)
    for path, data in ODD_FILES.items():
        r = httpx.get(hub.url + links[path])
        assert r.status_code == 200 and r.content == data, (path, links[path], r.text)


def test_card_relative_links_reach_files_with_odd_names(hub, odd_names):
    links = _resolve_links(httpx.get(f"{hub.url}/{odd_names}").text, odd_names)
    for text, path in (("notes", "docs/my notes.md"), ("resume", "docs/r\u00e9sum\u00e9.md")):
        r = httpx.get(hub.url + links[text])
        assert r.status_code == 200 and r.content == ODD_FILES[path], (text, links[text], r.text)
    for text, path in (("dot", ".notes.md"), ("here", "docs/a.md")):  # "./" dropped, "." kept
        assert httpx.get(hub.url + links[text]).content == ODD_FILES[path], (text, links[text])
    assert links["a"].endswith("/docs/a.md#intro")  # a fragment stays one
    assert httpx.get(hub.url + links["a"]).content == ODD_FILES["docs/a.md"]


def test_huge_card_is_linked_not_rendered(hub, published):
    push_repo(published["vip/vip-nano-test"], "pages/huge-card", token=WRITE_TOKEN)
    card = (published["vip/vip-nano-test"] / CARD_FILE).read_text()
    card += "Lorem *ipsum* [dolor](x.md).\n\n" * (MAX_CARD_BYTES // 20)
    assert raw_commit(hub.url, "pages/huge-card", {CARD_FILE: card.encode()}).status_code == 200
    r = httpx.get(hub.url + "/pages/huge-card", timeout=60)
    assert r.status_code == 200 and len(r.content) < MAX_CARD_BYTES // 4, len(r.content)
    assert "Privacy guarantee" in r.text and "model card is" in r.text
    readme = _resolve_links(r.text, "pages/huge-card")["read it as a file"]
    assert httpx.get(hub.url + readme).content == card.encode()


@pytest.fixture(scope="module")
def chromium() -> str:
    return debian_program("chromium", "chromium", "/usr/bin/chromium")


@pytest.mark.slow
@pytest.mark.parametrize(
    "page,size", [("/", "1280,900"), ("/vip/vip-nano-test", "1280,2200"), ("/", "390,844")]
)
def test_pages_in_a_real_browser(hub, published, chromium, tmp_path, page, size):
    shot = tmp_path / "page.png"
    base = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(
        [*base, "--dump-dom", hub.url + page], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "vip/vip-nano-test" in dom.stdout
    r = subprocess.run(
        [*base, f"--screenshot={shot}", f"--window-size={size}", hub.url + page],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]
    keep = Path(os.environ.get("VIP_HUB_SCREENSHOTS", tmp_path))
    keep.mkdir(parents=True, exist_ok=True)
    name = ("index" if page == "/" else "model") + f"-{size.split(',')[0]}.png"
    shutil.copy(shot, keep / name)


def test_model_page_shows_every_accountant_and_the_audit(hub, tmp_path):
    from vip_hub.privacy.ledger import DPStage

    plain = dp_stage()
    audit = audit_of(plain)
    stage = DPStage.from_parameters(
        name=plain.name,
        dataset=plain.dataset,
        sample_rate=plain.sample_rate,
        noise_multiplier=plain.noise_multiplier,
        steps=plain.steps,
        clipping_norm=plain.clipping_norm,
        noised_tensors={**plain.noised_tensors, "canaries": audit.canaries},
        audit=audit,
    )
    folder = export_encoder(
        tmp_path / "audited", tiny_encoder(), TINY, [synthetic_stage(), stage], model_name="audited"
    )
    push_repo(folder, "pages/audited", token=WRITE_TOKEN)
    html = httpx.get(hub.url + "/pages/audited").text
    for (
        accountant,
        eps,
    ) in stage.epsilons.items():  # the claim and the two references, in the ledger table
        assert f"{shown_epsilon(eps, 3)} ({accountant.value.upper()})" in html, accountant
    assert (
        "Empirical audit of <code>dp-pretraining</code>" in html
        and "1,000 gradient canaries" in html
    )
    assert (
        f"prove at most <strong>ε ≥ {audit.ceiling:.2f}</strong> (its ceiling" in html
    )  # beside the claim
    assert (
        "(ε = " in html and "test-images [RDP]" in html
    )  # the headline, from the ledger's summary
