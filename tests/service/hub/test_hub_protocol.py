"""Unmodified huggingface_hub and timm clients against a real server (HF_ENDPOINT)."""

import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import huggingface_hub.constants
import pytest
import timm
import torch
from huggingface_hub import HfApi, ModelCard, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    BadRequestError,
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from support.helpers import (
    TINY,
    dp_stage,
    random_text,
    rewrite_ledger_copies,
    synthetic_stage,
    tiny_encoder,
    tiny_repo_with_head,
)
from support.live import READ_TOKEN, WRITE_TOKEN

import vip_hub
from vip_hub import export_encoder
from vip_hub.errors import ConfigError, MissingInputError
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import (
    CARD_LEDGER_KEY,
    CONFIG_FILE,
    GITATTRIBUTES_FILE,
    HEAD_LABELS,
    HEADS_DIR,
    LEDGER_FILE,
    WEIGHTS_FILE,
    WEIGHTS_SUFFIX,
    head_file,
)

MODEL = "vip/vip-nano-test"


def test_downloads_and_metadata(hub, published):
    api = HfApi()
    info = api.model_info(MODEL, files_metadata=True)
    assert len(info.sha) == 40 and info.library_name == "timm" and not info.private
    assert "differential-privacy" in info.tags
    sizes = {s.rfilename: s.size for s in info.siblings}
    local = published[MODEL]
    assert sizes[WEIGHTS_FILE] == (local / WEIGHTS_FILE).stat().st_size
    assert next(s for s in info.siblings if s.rfilename == WEIGHTS_FILE).lfs is not None
    assert sorted(api.list_repo_files(MODEL)) == sorted(
        p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()
    )
    path = hf_hub_download(MODEL, LEDGER_FILE)
    assert Path(path).read_bytes() == (local / LEDGER_FILE).read_bytes()
    snap = Path(snapshot_download(MODEL))
    assert (snap / head_file("toy")).read_bytes() == (local / head_file("toy")).read_bytes()
    assert vip_hub.verify_repo(snap).ok
    card = ModelCard.load(MODEL)
    assert getattr(card.data, CARD_LEDGER_KEY)["schema"] == "vip-hub/privacy-ledger/v4"


def test_timm_and_vip_hub_load_from_the_hub(hub, published):
    model = timm.create_model(f"hf-hub:{MODEL}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tiny_encoder(0)(x), rtol=0, atol=0)
    encoder = vip_hub.load_encoder(MODEL)
    assert encoder.privacy.datasets == ("test-images",)


def test_load_encoder_loads_the_revision_pinned_or_says_why_not(hub, published, monkeypatch):
    """A revision the load cannot honour is refused, not dropped: given with a folder (which
    loaded the folder) or besides another ``@revision`` (the argument won); offline without the
    revision cached, or a revision the hub refuses, is a MissingInputError naming the repo (was
    huggingface_hub's LocalEntryNotFoundError)."""
    commit = HfApi().model_info(MODEL).sha
    assert vip_hub.load_encoder(f"hf-hub:{MODEL}@{commit}").path.name == commit
    with pytest.raises(ConfigError, match=f"{MODEL}@main pins revision 'main' but revision"):
        vip_hub.load_encoder(f"{MODEL}@main", revision=commit)
    with pytest.raises(ConfigError, match="is a folder: it has no revision 'v1'"):
        vip_hub.load_encoder(published[MODEL], revision="v1")
    with pytest.raises(MissingInputError, match=f"{MODEL} at revision '../x' is neither"):
        vip_hub.load_encoder(MODEL, revision="../x")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(MissingInputError, match=f"{MODEL} at revision '{'0' * 40}' is neither"):
        vip_hub.load_encoder(MODEL, revision="0" * 40)


def test_list_models_and_search(hub, published):
    api = HfApi()
    ids = {m.id for m in api.list_models()}
    assert ids == {MODEL, "vip/vip-nano-syn"}  # this module's store holds exactly what it published
    assert [m.id for m in api.list_models(search="nano-syn")] == ["vip/vip-nano-syn"]
    assert {m.id for m in api.list_models(author="vip")} >= {MODEL}
    rows = httpx.get(f"{hub.url}/api/models", params={"max_epsilon": 0, "sort": "epsilon"}).json()
    assert [r["id"] for r in rows] == ["vip/vip-nano-syn"]
    rows = httpx.get(f"{hub.url}/api/models", params={"dataset": "test-images"}).json()
    assert MODEL in [r["id"] for r in rows] and rows[0]["vip_hub"]["private_datasets"] == [
        "test-images"
    ]
    assert len(list(api.list_models(limit=1))) == 1


def test_a_listing_offset_past_the_index_range_is_refused_naming_it(hub, published):
    """An offset past what the index's integers hold (2**63 - 1) was a 500 (SQLite's
    OverflowError); it is a 422 naming ``offset``, and the largest one lists nothing."""
    r = httpx.get(f"{hub.url}/api/models", params={"offset": 2**63})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["query", "offset"]
    r = httpx.get(f"{hub.url}/api/models", params={"offset": 2**63 - 1})
    assert r.status_code == 200 and r.json() == []


def test_revision_pinning(hub, tmp_path):
    api = HfApi(token=WRITE_TOKEN)
    repo_id = "pin/model"
    first = push_repo(tiny_repo_with_head(tmp_path / "a", seed=3), repo_id, token=WRITE_TOKEN)
    api.create_tag(repo_id, tag="v1")
    second = push_repo(tiny_repo_with_head(tmp_path / "b", seed=4), repo_id, token=WRITE_TOKEN)
    assert first != second
    for revision, seed in ((first, 3), ("v1", 3), ("main", 4), (second, 4)):
        model = timm.create_model(f"hf-hub:{repo_id}@{revision}", pretrained=True).eval()
        x = torch.randn(1, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(model(x), tiny_encoder(seed)(x), rtol=0, atol=0)
    assert api.model_info(repo_id, revision=first).sha == first
    refs = api.list_repo_refs(repo_id)
    assert {t.name: t.target_commit for t in refs.tags} == {"v1": first}
    assert [c.commit_id for c in api.list_repo_commits(repo_id)][:2] == [second, first]
    head = httpx.head(f"{hub.url}/{repo_id}/resolve/v1/{CONFIG_FILE}")
    assert head.headers["x-repo-commit"] == first


def test_range_resume_and_headers(hub, published):
    url = f"{hub.url}/{MODEL}/resolve/main/{WEIGHTS_FILE}"
    full = (published[MODEL] / WEIGHTS_FILE).read_bytes()
    head = httpx.head(url)
    assert head.status_code == 200 and head.headers["accept-ranges"] == "bytes"
    assert len(head.headers["x-repo-commit"]) == 40 and head.headers["etag"].strip('"').isalnum()
    assert int(head.headers["content-length"]) == len(full)
    # a branch moves: its files are revalidated; a commit's never change
    assert head.headers["cache-control"] == "public, no-cache"
    pinned = httpx.head(url.replace("/main/", f"/{head.headers['x-repo-commit']}/"))
    assert pinned.headers["cache-control"] == "public, max-age=31536000, immutable"
    part = httpx.get(url, headers={"Range": "bytes=1000-"})
    assert part.status_code == 206 and part.content == full[1000:]
    assert part.headers["content-range"] == f"bytes 1000-{len(full) - 1}/{len(full)}"
    assert httpx.get(url, headers={"Range": f"bytes={len(full) + 5}-"}).status_code == 416
    # the client resumes an interrupted download from its .incomplete file
    cache = Path(os.environ["HF_HOME"]) / "resume"
    blob_dir = cache / f"models--{MODEL.replace('/', '--')}" / "blobs"
    blob_dir.mkdir(parents=True)
    etag = head.headers["etag"].strip('"')
    (blob_dir / f"{etag}.incomplete").write_bytes(full[:5000])
    path = hf_hub_download(MODEL, WEIGHTS_FILE, cache_dir=cache)
    assert Path(path).read_bytes() == full


def test_error_codes(hub, published):
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("vip/absent", CONFIG_FILE)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(MODEL, CONFIG_FILE, revision="nope")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(MODEL, "pytorch_model.bin")
    r = httpx.head(f"{hub.url}/{MODEL}/resolve/main/missing.txt")
    assert (
        r.status_code == 404
        and r.headers["x-error-code"] == "EntryNotFound"
        and r.headers["x-repo-commit"]
    )
    assert httpx.get(f"{hub.url}/api/models/vip/absent").headers["x-error-code"] == "RepoNotFound"
    assert (
        httpx.get(f"{hub.url}/api/models/{MODEL}/revision/nope").headers["x-error-code"]
        == "RevisionNotFound"
    )


def test_uploads_with_unmodified_clients(hub, tmp_path):
    api = HfApi(token=WRITE_TOKEN)
    url = api.create_repo("up/folder", exist_ok=True)
    assert url == f"{hub.url}/up/folder"
    assert api.create_repo("up/folder", exist_ok=True) == url  # 409 carries the url
    folder = tiny_repo_with_head(tmp_path / "f")
    info = api.upload_folder(repo_id="up/folder", folder_path=folder, commit_message="first")
    assert info.oid == api.model_info("up/folder").sha
    assert api.whoami()["name"] == "writer"
    # create_commit that removes the head must also update the ledger: refused as a partial change
    from huggingface_hub import CommitOperationDelete

    with pytest.raises(BadRequestError, match="does not verify"):
        api.create_commit(
            "up/folder",
            [CommitOperationDelete(f"{HEADS_DIR}/", is_folder=True)],
            commit_message="x",
        )


def _with_notes(repo_id: str, tmp_path: Path) -> HfApi:
    """``repo_id`` published with ``notes/a.md``, ``notes/deep/b.md`` and, beginning with the
    same letters, ``notes-old/c.md`` and ``notes.md``; the writer's client."""
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo(repo_id, exist_ok=True)
    folder = tiny_repo_with_head(tmp_path / "f")
    for rel in ("notes/a.md", "notes/deep/b.md", "notes-old/c.md", "notes.md"):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(f"{rel}\n")
    api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="first")
    return api


def test_deleting_a_folder_deletes_what_is_under_it_alone(hub, tmp_path):
    """``delete_folder("notes")`` takes ``notes/`` and leaves ``notes-old/`` and a file
    ``notes.md``, whose paths begin with the same letters."""
    api = _with_notes("up/folders", tmp_path)
    before = set(api.list_repo_files("up/folders"))
    api.delete_folder("notes", repo_id="up/folders")
    after = set(api.list_repo_files("up/folders"))
    assert before - after == {"notes/a.md", "notes/deep/b.md"}
    assert {"notes-old/c.md", "notes.md", LEDGER_FILE} <= after


def test_a_tree_lists_one_level_or_all_under_its_folder_across_pages(hub, tmp_path, monkeypatch):
    """``list_repo_tree`` of a folder holds what is under it (not ``notes-old/`` beside
    ``notes/``), one level unless recursive; split into pages of any size (the ``Link`` header
    the client follows), it is the same list."""
    import service.hub.metadata

    api = _with_notes("up/tree", tmp_path)

    def listed(path: str = "", recursive: bool = False) -> list[str]:
        return [e.path for e in api.list_repo_tree("up/tree", path, recursive=recursive)]

    assert listed("notes") == ["notes/deep", "notes/a.md"]  # folders first
    assert listed("notes", recursive=True) == ["notes/deep", "notes/a.md", "notes/deep/b.md"]
    top = listed()
    assert {"notes", "notes-old", HEADS_DIR, "notes.md", LEDGER_FILE} <= set(top)
    assert not [p for p in top if "/" in p]
    whole = listed(recursive=True)
    assert len(whole) == len(set(whole)) > len(top)
    for size in (1, 2, 3):
        monkeypatch.setattr(service.hub.metadata, "TREE_PAGE", size)
        assert listed(recursive=True) == whole, size


def test_a_pull_request_is_refused_not_committed_to_main(hub, tmp_path):
    """This hub has no pull requests: ``create_pr=True`` is a 400 saying so, never a commit
    straight to the branch the request meant to leave alone."""
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("up/no-prs", exist_ok=True)
    api.upload_folder(repo_id="up/no-prs", folder_path=tiny_repo_with_head(tmp_path / "f"))
    head = api.model_info("up/no-prs").sha
    with pytest.raises(BadRequestError, match="pull requests are not supported"):
        api.upload_file(
            path_or_fileobj=b"n\n", path_in_repo="n.md", repo_id="up/no-prs", create_pr=True
        )
    assert api.model_info("up/no-prs").sha == head


def test_a_commit_to_a_branch_that_does_not_exist_is_refused(hub, tmp_path):
    """Only ``main`` is made by a first commit; any other branch is made by ``create_branch``
    first, as on the HF hub, so a commit never starts a history of its own."""
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("up/branchless", exist_ok=True)
    folder = tiny_repo_with_head(tmp_path / "f")
    api.upload_folder(repo_id="up/branchless", folder_path=folder, commit_message="first")
    with pytest.raises(RevisionNotFoundError, match="branch 'dev' does not exist"):
        api.upload_folder(repo_id="up/branchless", folder_path=folder, revision="dev")
    assert [b.name for b in api.list_repo_refs("up/branchless").branches] == ["main"]
    api.create_branch("up/branchless", branch="dev")
    api.upload_file(
        path_or_fileobj=b"n\n", path_in_repo="n.md", repo_id="up/branchless", revision="dev"
    )
    assert "n.md" in api.list_repo_files("up/branchless", revision="dev")
    assert "n.md" not in api.list_repo_files("up/branchless")


def test_bad_ledger_is_refused_naming_the_stage(hub, tmp_path):
    folder = export_encoder(
        tmp_path / "bad", tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name="bad"
    )
    for name in (LEDGER_FILE,):
        data = json.loads((folder / name).read_text())
        data["stages"][1]["epsilon"] = 0.5
        data["guarantees"][0]["epsilon"] = 0.5
        (folder / name).write_text(json.dumps(data))
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("bad/ledger", exist_ok=True)
    with pytest.raises(BadRequestError, match=LEDGER_FILE) as err:
        api.upload_folder(repo_id="bad/ledger", folder_path=folder)
    assert "nothing was stored" in str(err.value)
    # consistent but understated copies: the accountant check names the stage
    rewrite_ledger_copies(folder, lambda data: data)
    with pytest.raises(BadRequestError, match="stage 'dp-pretraining': claims epsilon 0.5"):
        api.upload_folder(repo_id="bad/ledger", folder_path=folder)
    with pytest.raises(RevisionNotFoundError):
        api.model_info("bad/ledger", revision="main")  # nothing was stored


def test_no_ledger_and_pickles_are_refused(hub, tmp_path):
    api = HfApi(token=WRITE_TOKEN)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32, depth=1
    )
    with pytest.raises(
        BadRequestError,
        match="pytorch_model.bin: a '.bin' file is refused by name",
    ):
        timm.models.push_to_hf_hub(model, "plain/timm", token=WRITE_TOKEN)  # safetensors and a .bin
    with pytest.raises(BadRequestError, match=f"{LEDGER_FILE}: missing"):
        timm.models.push_to_hf_hub(model, "plain/timm", token=WRITE_TOKEN, safe_serialization=True)
    with pytest.raises(RevisionNotFoundError):
        api.model_info("plain/timm", revision="main")


def test_timm_push_updates_a_verified_repo_only_with_a_ledger(hub, tmp_path):
    """push_to_hf_hub speaks the protocol to a verified repo, but weights without the
    repo's ledger are refused: the hub serves verified claims only."""
    api = HfApi(token=WRITE_TOKEN)
    push_repo(tiny_repo_with_head(tmp_path / "t"), "timm/verified", token=WRITE_TOKEN)
    before = api.model_info("timm/verified").sha
    with pytest.raises(BadRequestError, match=WEIGHTS_FILE):
        timm.models.push_to_hf_hub(
            tiny_encoder(0), "timm/verified", token=WRITE_TOKEN, safe_serialization=True
        )
    assert api.model_info("timm/verified").sha == before


def test_auth(hub, tmp_path):
    folder = tiny_repo_with_head(tmp_path / "p")
    with pytest.raises(HfHubHTTPError) as err:
        HfApi().create_repo("auth/none")
    assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(token=READ_TOKEN).create_repo("auth/none")
    assert err.value.response.status_code == 403 and "write scope" in str(err.value)
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(token="vh_wrong").model_info("vip/vip-nano-test")
    assert err.value.response.status_code == 401
    push_repo(folder, "auth/private", token=WRITE_TOKEN, private=True)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("auth/private")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("auth/private", CONFIG_FILE)
    assert "auth/private" not in {m.id for m in HfApi().list_models()}
    assert HfApi(token=READ_TOKEN).model_info("auth/private").private
    assert hf_hub_download("auth/private", CONFIG_FILE, token=READ_TOKEN)
    assert "auth/private" in {m.id for m in HfApi(token=READ_TOKEN).list_models()}


def test_push_cli(hub, tmp_path, capsys):
    from vip_hub.cli.main import main

    folder = tiny_repo_with_head(tmp_path / "cli")
    push = ["push", str(folder), "cli/model", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    assert main(push) == 0, capsys.readouterr().err  # `vip-hub push`
    out = capsys.readouterr().out
    assert "pushed" in out and HfApi().model_info("cli/model").sha in out
    (folder / CONFIG_FILE).write_text("{}")
    assert main(push) == 1
    assert "does not verify, nothing was pushed" in capsys.readouterr().err


def test_push_sends_what_changed_and_keeps_the_remotes_gitattributes(hub, tmp_path):
    """``push_repo`` makes the remote hold the folder: it deletes what the remote holds beyond
    it, but not its ``.gitattributes``, which git clients need; pushed again unchanged, the
    head stays where it is."""
    api, repo = HfApi(token=WRITE_TOKEN), "up/push-diff"
    folder = tiny_repo_with_head(tmp_path / "m")
    push_repo(folder, repo, token=WRITE_TOKEN)
    lfs = f"*{WEIGHTS_SUFFIX} filter=lfs -text\n".encode()
    for name, data in ((GITATTRIBUTES_FILE, lfs), ("x.md", b"x\n")):
        api.upload_file(path_or_fileobj=data, path_in_repo=name, repo_id=repo)
    (folder / "notes.md").write_text("notes\n")
    head = push_repo(folder, repo, token=WRITE_TOKEN)
    files = set(api.list_repo_files(repo))
    assert files == {
        *(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()),
        GITATTRIBUTES_FILE,
    }
    assert push_repo(folder, repo, token=WRITE_TOKEN) == head == api.model_info(repo).sha


@pytest.mark.parametrize(
    "path",
    [
        "/vip/vip-nano-test/resolve/main/../../../etc/passwd",
        "/vip/vip-nano-test/resolve/main/%2e%2e/%2e%2e/etc/passwd",
        f"/vip/vip-nano-test/resolve/main/%252e%252e/{CONFIG_FILE}",
        f"/vip/vip-nano-test/resolve/main/heads%5Ctoy%5C{HEAD_LABELS}",
        "/vip/vip-nano-test/resolve/main/%2Fetc%2Fpasswd",
        "/vip/vip-nano-test/resolve/main/conf%00ig.json",
        "/vip/vip-nano-test/resolve/main/" + "a" * 300 + "/x",
        f"/vip/vip-nano-test/resolve/..%2f..%2fmain/{CONFIG_FILE}",
        f"/vip/vip-nano-test/resolve/refs%2Fpr%2F1/{CONFIG_FILE}",
        "/vip/" + "n" * 200 + f"/resolve/main/{CONFIG_FILE}",
        "/api/models/vip/vip-nano-test/tree/main/..%2F..",
    ],
)
def test_path_tricks_are_refused(hub, published, path):
    with httpx.Client() as client:
        request = client.build_request("GET", hub.url)
        request.url = request.url.copy_with(raw_path=path.encode())
        r = client.send(request)
    assert 400 <= r.status_code < 500, (path, r.status_code)
    assert b"root:" not in r.content


def test_names_ending_in_a_newline_are_refused(hub, published):
    """``$`` matches before a final newline: a repo, tag or revision name ending in one was taken
    (a repo "vip/vip-nano-test\\n" beside vip/vip-nano-test, a tag "v1\\n")."""
    auth = {"Authorization": f"Bearer {WRITE_TOKEN}"}
    created = httpx.post(
        f"{hub.url}/api/repos/create",
        json={"name": "vip-nano-test\n", "organization": "vip"},
        headers=auth,
    )
    assert created.status_code == 400 and "invalid repo name" in created.json()["error"]
    tagged = httpx.post(
        f"{hub.url}/api/models/{MODEL}/tag/main", json={"tag": "v1\n"}, headers=auth
    )
    assert tagged.status_code == 400 and "invalid revision" in tagged.json()["error"]
    assert HfApi().list_repo_refs(MODEL).tags == []
    info = httpx.get(f"{hub.url}/api/models/{MODEL}/revision/main%0A")
    assert info.status_code == 400 and "invalid revision" in info.json()["error"]


@pytest.mark.parametrize("path", ["../escape.txt", "docs/%61.md"])
def test_upload_path_tricks(hub, published, tmp_path, path):
    """A path out of the repo, or one holding a percent escape (committed, its download URL
    named another file's, '%61' being 'a', or was refused as doubly encoded)."""
    body = "\n".join(
        json.dumps(line)
        for line in [
            {"key": "header", "value": {"summary": "x"}},
            {"key": "file", "value": {"path": path, "content": "aGk=", "encoding": "base64"}},
        ]
    )
    r = httpx.post(
        f"{hub.url}/api/models/{MODEL}/commit/main",
        content=body,
        headers={"Authorization": f"Bearer {WRITE_TOKEN}", "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 400 and "invalid path" in r.json()["error"]
    assert not any(
        p.name == "escape.txt" for p in Path(hub.settings.store).parent.rglob("escape.txt")
    )


def test_concurrent_publishes(hub, tmp_path):
    repo_id = "race/model"
    folders = [tiny_repo_with_head(tmp_path / f"r{i}", seed=10 + i) for i in range(2)]
    HfApi(token=WRITE_TOKEN).create_repo(repo_id)
    commits, errors = [], []

    def publish(folder: Path) -> None:
        try:
            commits.append(push_repo(folder, repo_id, token=WRITE_TOKEN))
        except Exception as e:  # pragma: no cover - shown on failure
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(f,)) for f in folders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    history = [c.commit_id for c in HfApi().list_repo_commits(repo_id)]
    assert (
        sorted(history) == sorted(commits) and len(history) == 2
    )  # linear: one on top of the other
    # a client that commits against a stale parent gets a clear conflict
    from huggingface_hub import CommitOperationAdd

    with pytest.raises(HfHubHTTPError, match="stale") as err:
        HfApi(token=WRITE_TOKEN).create_commit(
            repo_id,
            [CommitOperationAdd("notes.txt", b"hello")],
            commit_message="late",
            parent_commit=history[-1],
        )
    assert err.value.response.status_code == 409


def test_validate_yaml(hub):
    ok = httpx.post(
        f"{hub.url}/api/validate-yaml",
        json={"content": "---\nlicense: mit\n---\nhi", "repoType": "model"},
    )
    assert ok.status_code == 200 and ok.json()["errors"] == []
    bad = httpx.post(
        f"{hub.url}/api/validate-yaml",
        json={"content": "---\nlicense: [unclosed\n---\n", "repoType": "model"},
    )
    assert bad.status_code == 400 and bad.json()["errors"]


def test_big_commit_streams_to_disk(hub, tmp_path):
    """A folder with a 40 MB extra file goes through one commit; nothing is held in memory whole."""
    folder = export_encoder(
        tmp_path / "big",
        tiny_encoder(),
        TINY,
        [synthetic_stage()],
        model_name="big",
        extra_files={"data/blob.bin.txt": random_text(40 * 1024 * 1024)},
    )
    commit = push_repo(folder, "big/model", token=WRITE_TOKEN)
    r = httpx.get(f"{hub.url}/big/model/resolve/{commit}/data/blob.bin.txt")
    assert r.content == (folder / "data/blob.bin.txt").read_bytes()
    shutil.rmtree(folder)


def test_resolve_answers_conditionals_and_bad_ranges_in_the_services_shape(hub, published):
    """``If-None-Match`` with the file's own ETag was a 200 with the whole file, and ``If-Match``
    with another ETag a 200; a malformed ``Range`` was Starlette's text/plain 400 and one past
    the end an empty 416 (no ``error``, no ``X-Error-Message``)."""
    url = f"{hub.url}/{MODEL}/resolve/main/{WEIGHTS_FILE}"
    size = (published[MODEL] / WEIGHTS_FILE).stat().st_size
    tag = httpx.head(url).headers["etag"]
    for cached in [tag, f"W/{tag}", f'"other", {tag}', "*"]:
        r = httpx.get(url, headers={"If-None-Match": cached})
        assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == tag, cached
    assert httpx.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    for wanted in [tag, "*"]:
        assert httpx.get(url, headers={"If-Match": wanted}).status_code == 200
    r = httpx.get(url, headers={"If-Match": '"other"'})
    assert r.status_code == 412 and r.json()["error"].startswith('If-Match "other" does not name')
    r = httpx.get(url, headers={"Range": "lines=0-9"})
    assert (
        r.status_code == 400 and r.json()["error"] == "Range 'lines=0-9': Only support bytes range"
    )
    assert r.headers["x-error-message"] == r.json()["error"]
    r = httpx.get(url, headers={"Range": f"bytes={size + 5}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{size}"
    assert f"holds {size:,} bytes" in r.json()["error"]
