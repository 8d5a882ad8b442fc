"""Untrusted text and bodies (issue 24, Medium 8 and 10, Low 12): YAML aliases in a card's front
matter are refused wherever a card is parsed, and every YAML file a repo carries is held to the
card's limits (issue 53, Low: alias bombs in extra YAML files); every route bounds its body;
ledger strings stay literal text in the card and on the pages, which send a
Content-Security-Policy and nosniff."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi
from support.helpers import TINY, synthetic_stage, tiny_encoder, with_front_matter
from support.live import WRITE_TOKEN, ThreadedServer, raw_commit, settings_for

from service.pages.render import card_body, markdown_html
from vip_hub import Dataset, DPStage, export_encoder, verify_repo
from vip_hub.errors import RepoFormatError
from vip_hub.repo.card import load_card
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import CARD_FILE

EVIL = (
    "digits` | [click](https://evil.example/a) ![x](https://evil.example/i.png) <b>bold</b>\n\n# `x"
)


def _alias_bomb(levels: int, width: int = 4) -> str:
    lines = [f"l0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def evil_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A verified repo whose ledger strings carry Markdown: a dataset name breaking out of its
    code span into a link, an image, HTML, a table cell and a heading."""
    stage = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(
            name=EVIL, size=1000, description="see [here](https://evil.example/d) | **now**"
        ),
        sample_rate=0.05,
        noise_multiplier=1.0,
        steps=100,
        clipping_norm=0.1,
        noised_tensors={"unreleased:test": 1_000},
    )
    folder = export_encoder(
        tmp_path_factory.mktemp("evil") / "repo",
        tiny_encoder(),
        TINY,
        [synthetic_stage(), stage],
        model_name="evil",
    )
    assert verify_repo(folder).ok
    return folder


def _no_markup_from_the_ledger(html: str) -> None:
    assert "evil.example" in html  # the text is shown...
    assert not re.search(
        r"""(href|src)=["']?https://evil\.example""", html
    )  # ...never as a link or image
    assert "<b>bold</b>" not in html


def test_ledger_strings_are_literal_in_the_card(evil_repo):
    readme = (evil_repo / CARD_FILE).read_text()
    html = markdown_html(card_body(readme))
    _no_markup_from_the_ledger(html)
    assert "&lt;b&gt;bold&lt;/b&gt;" in html
    table = html.split("<table>")[2]  # the first table is the model summary, the second the ledger
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.DOTALL)
    assert {len(re.findall(r"<t[dh]", r)) for r in rows} == {11}  # no cell split by the name's '|'
    assert html.count("<h1>") == 1  # the card's title; the name's '# ' made no heading


def test_card_images_come_from_the_hub_alone_and_links_send_no_referrer():
    """A protocol-relative image (another site's) and a data: image become links, the data:
    one without its URL; every link carries ``rel`` so the page leaks no referrer."""
    html = markdown_html(
        "![px](//elsewhere.example/p.png) ![d](data:image/png;base64,iVBORw0KGgo=) "
        "[site](https://elsewhere.example/) [notes](docs/a.md)",
        "/o/n/resolve/c",
    )
    assert "<img" not in html and "data:" not in html
    links = re.findall(r"<a ([^>]*)>", html)
    assert [re.sub(r' ?rel="[^"]*"', "", a) for a in links] == [
        'href="//elsewhere.example/p.png"',
        "",
        'href="https://elsewhere.example/"',
        'href="/o/n/resolve/c/docs/a.md"',
    ]
    assert all('rel="noopener noreferrer nofollow"' in a for a in links)


def test_pages_escape_the_ledger_and_send_csp_and_nosniff(hub, evil_repo):
    push_repo(evil_repo, "writer/markdown", token=WRITE_TOKEN)
    for path in ("/writer/markdown", "/"):
        r = httpx.get(hub.url + path)
        assert r.status_code == 200
        assert (
            "script-src" not in r.headers["content-security-policy"]
        )  # default-src 'none' covers it
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
    box = (
        httpx.get(hub.url + "/writer/markdown")
        .text.split('class="panel guarantee"')[1]
        .split("</section>")[0]
    )
    _no_markup_from_the_ledger(box)


# ------------------------------------------------------------------------------- YAML aliases


def test_load_card_refuses_aliases():
    readme = "---\nlicense: mit\n" + _alias_bomb(3) + "---\n# card\n"
    with pytest.raises(RepoFormatError, match="YAML aliases"):
        load_card(readme)
    assert load_card("---\nlicense: mit\n---\n# card\n").license == "mit"


def test_a_card_with_aliases_does_not_verify_nor_publish(hub, tmp_path):
    from support.helpers import tiny_repo_with_head

    folder = tiny_repo_with_head(tmp_path / "aliases")
    readme = folder / CARD_FILE
    readme.write_text(with_front_matter(readme.read_text(), _alias_bomb(22, 2)))
    assert any("YAML aliases" in str(p) for p in verify_repo(folder).problems)
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("writer/aliases")
    with pytest.raises(
        ValueError, match="YAML aliases"
    ):  # the client asks /api/validate-yaml first
        api.upload_folder(repo_id="writer/aliases", folder_path=folder)
    # a client that does not ask: refused by the alias rule (its message), before anything
    # walks the 2^22 nodes the aliases stand for
    r = raw_commit(
        hub.url,
        "writer/aliases",
        {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in folder.rglob("*")
            if p.is_file()
        },
    )
    assert r.status_code == 400 and "YAML aliases" in r.json()["error"]


def test_validate_yaml_refuses_aliases(hub):
    r = httpx.post(
        hub.url + "/api/validate-yaml",
        json={"content": "---\nlicense: mit\n" + _alias_bomb(30, 2) + "---\n"},
        timeout=30,
    )
    assert r.status_code == 400 and "YAML aliases" in r.json()["errors"][0]["message"]
    ok = httpx.post(
        hub.url + "/api/validate-yaml", json={"content": "---\nlicense: mit\n---\n# card\n"}
    )
    assert ok.status_code == 200 and ok.json() == {"errors": [], "warnings": []}


@pytest.mark.parametrize(
    "front, why",
    [
        ("tags: 3", "not a model card's metadata"),
        ("1: 2", "not a model card's metadata"),
        ("extra: .nan", "front matter's extra is not a finite number"),
        ("extra: {a: [1, -.inf]}", "front matter's extra.a[1] is not a finite number"),
    ],
    ids=["tags not a list", "a number key", "NaN", "an infinity"],
)
def test_a_front_matter_the_hub_cannot_take_is_a_400_naming_it(hub, front, why):
    """huggingface_hub's ModelCard raised TypeError on the first two, and the index stored the
    others' NaN, which then failed every /api/models page that listed the repo: each route
    answers 400, naming the file and what is wrong."""
    content = f"---\n{front}\n---\n# card\n"
    r = httpx.post(hub.url + "/api/validate-yaml", json={"content": content})
    assert r.status_code == 400 and why in r.json()["errors"][0]["message"], r.text
    HfApi(token=WRITE_TOKEN).create_repo("writer/cards", exist_ok=True)
    r = raw_commit(hub.url, "writer/cards", {"notes/x.md": content.encode()})
    assert r.status_code == 400 and "notes/x.md" in r.json()["error"], r.text
    assert why in r.json()["error"], r.text


def _yaml_files(folder: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


def test_every_yaml_file_is_held_to_the_cards_limits(tmp_path):
    """The review's bomb.yaml (10^9 nodes: 9 levels of 10 aliases each), and the same bomb as a
    .yml file and as an extra Markdown file's front matter, are refused as a card's would be,
    before anything expands them; so are YAML files nested too deep or too large."""
    from support.helpers import tiny_repo_with_head

    folder = _yaml_files(
        tiny_repo_with_head(tmp_path / "bombs"),
        {
            "bomb.yaml": _alias_bomb(9, 10),
            "notes/bomb.yml": _alias_bomb(9, 10),
            "notes/extra.md": "---\n" + _alias_bomb(9, 10) + "---\n# Notes\n",
            "notes/deep.yaml": "x: " + "[" * 20 + "]" * 20 + "\n",  # 21 levels with the mapping
            "notes/big.yaml": "k: v\n" * 14_000,
            "notes/fine.yaml": "x: " + "[" * 19 + "]" * 19 + "\n" + "k: v\n" * 1000,
        },
    )
    problems = {p.where: p.message for p in verify_repo(folder).problems}
    assert problems == {
        "bomb.yaml": "uses YAML aliases ('*name'), which are refused",
        "notes/bomb.yml": "uses YAML aliases ('*name'), which are refused",
        "notes/extra.md": "its front matter uses YAML aliases ('*name'), which are refused",
        "notes/deep.yaml": "nests lists and mappings deeper than the limit of 20 levels",
        "notes/big.yaml": "is 70000 bytes, over the limit of 65536 bytes",
    }


def test_the_hub_refuses_an_alias_bomb_in_any_yaml_file(hub, tmp_path):
    """The review's commit (bomb.yaml beside a good repo, 200 before): a 400 naming the file."""
    from support.helpers import tiny_repo_with_head

    folder = tiny_repo_with_head(tmp_path / "bomb")
    push_repo(folder, "writer/yaml-bomb", token=WRITE_TOKEN)
    api = HfApi(token=WRITE_TOKEN)
    before = api.model_info("writer/yaml-bomb").sha
    r = raw_commit(hub.url, "writer/yaml-bomb", {"bomb.yaml": _alias_bomb(9, 10).encode()})
    assert r.status_code == 400, r.text
    assert "bomb.yaml: uses YAML aliases ('*name'), which are refused" in r.json()["error"]
    assert api.model_info("writer/yaml-bomb").sha == before


def test_the_hub_holds_yaml_files_to_its_own_limits(tmp_path):
    """A hub configured below the defaults (the card fits: 5 levels, about 2 KB) refuses YAML
    files the defaults allow, naming its limits."""
    from support.helpers import tiny_repo_with_head

    folder = tiny_repo_with_head(tmp_path / "repo")
    files = {"deep.yaml": "x: " + "[" * 6 + "]" * 6 + "\n", "big.yaml": "k: v\n" * 1000}
    assert verify_repo(_yaml_files(Path(shutil.copytree(folder, tmp_path / "copy")), files)).ok
    settings = settings_for(
        tmp_path / "store",
        hub={"max_front_matter_depth": 6, "max_front_matter_bytes": 4096},
        inference={"enabled": False},
    )
    with ThreadedServer(settings) as server:
        push_repo(folder, "writer/small-yaml", endpoint=server.url, token=WRITE_TOKEN)
        for name, message in (
            ("deep.yaml", "deep.yaml: nests lists and mappings deeper than the limit of 6 levels"),
            ("big.yaml", "big.yaml: is 5000 bytes, over the limit of 4096 bytes"),
        ):
            r = raw_commit(server.url, "writer/small-yaml", {name: files[name].encode()})
            assert r.status_code == 400 and message in r.json()["error"], r.text


# ------------------------------------------------------------------------------- body limits


def test_every_route_bounds_its_body(hub):
    big = b"x" * (2 * 1024 * 1024)  # over the 1 MiB default of routes without a limit of their own
    for path in (
        "/api/validate-yaml",
        "/api/repos/create",
        "/api/models/vip/x/preupload/main",
        "/healthz",
    ):
        r = httpx.post(hub.url + path, content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, (path, r.status_code)

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(64):
            yield b"x" * 65536

    r = httpx.post(
        hub.url + "/api/validate-yaml",
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413 and "exceeds the limit of 1048576" in r.json()["error"]


def test_uploads_stream_past_the_default_limit(hub, tmp_path):
    """A commit with a 3 MiB inline file is not held to the 1 MiB default: it streams."""
    from support.helpers import tiny_repo_with_head

    folder = tiny_repo_with_head(tmp_path / "big")
    api = HfApi(token=WRITE_TOKEN)
    push_repo(folder, "writer/big-upload", token=WRITE_TOKEN)
    api.upload_file(
        path_or_fileobj=b"a line of notes\n" * 200_000,
        path_in_repo="notes.txt",
        repo_id="writer/big-upload",
    )
    assert "notes.txt" in api.list_repo_files("writer/big-upload")
    shutil.rmtree(folder)


def test_an_error_naming_a_path_with_control_characters_is_still_answered(hub):
    """A 413 whose message quotes a request path holding C1 control characters (U+0096) was dropped
    by the server ("Invalid HTTP header value"), so the client saw a network error."""
    body = b'{"files": [' + b",".join([b'{"path": "aaaa", "size": 1}'] * 50_000) + b"]}"
    r = httpx.post(
        f"{hub.url}/api/models/%C2%96/toy/preupload/main",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and "\x96" in r.json()["error"]
    assert r.headers["X-Error-Message"].isascii() and "?" in r.headers["X-Error-Message"]


def test_a_repos_visibility_is_public_or_private_and_agrees_with_private(hub):
    """``visibility: "Private"`` (or any word but "private") made a public repo, and won over
    ``private: true``: a raw API caller's misspelling published what it meant to keep."""
    headers = {"Authorization": f"Bearer {WRITE_TOKEN}"}
    create = lambda **body: httpx.post(  # noqa: E731
        f"{hub.url}/api/repos/create", json={"name": "meant-private", **body}, headers=headers
    )
    for body, why in [
        ({"visibility": "Private"}, "visibility must be 'public' or 'private', not 'Private'"),
        ({"visibility": "public", "private": True}, "visibility 'public' and private=True"),
    ]:
        r = create(**body)
        assert r.status_code == 400 and why in r.json()["error"], r.text
    assert httpx.get(f"{hub.url}/api/models/writer/meant-private").status_code == 404
    assert create(visibility="private", private=True).status_code == 200
    assert httpx.get(f"{hub.url}/api/models/writer/meant-private").status_code == 404  # private
    r = httpx.get(f"{hub.url}/api/models/writer/meant-private", headers=headers)
    assert r.status_code == 200 and r.json()["private"] is True
