"""What a verified repo may hold (issue 24, High 3 and 4): no config.json key that sends timm to
other weights, no pickle, archive or compressed content whatever its name, weights files
recognised in any case, no ``.git`` path and no path that is also a folder. Checked by
``vip-hub verify`` and by the live hub at push, with the real huggingface_hub and timm clients."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from helpers import tiny_repo_with_head
from huggingface_hub import HfApi
from huggingface_hub.errors import BadRequestError, RevisionNotFoundError
from live import WRITE_TOKEN, raw_commit

from vip_hub import verify_repo
from vip_hub.paths import tree_path_problems, validate_relpath
from vip_hub.privacy.ledger import PrivacyLedger
from vip_hub.repo.artifacts import (
    digest_file,
    read_safetensors_header,
    rewrite_safetensors_metadata,
)
from vip_hub.repo.content import WEIGHT_SOURCE_KEYS
from vip_hub.repo.push import push_repo


def _rebind(folder: Path) -> None:
    """What an attacker who owns a repo can do: re-digest every listed file and write the three
    ledger copies again, so the tampering is not what gets the repo refused."""
    data = json.loads((folder / "privacy_ledger.json").read_text())
    data["artifacts"] = {rel: digest_file(folder / rel, rel) for rel in data["artifacts"]}
    text = PrivacyLedger.parse(json.dumps(data)).to_json()
    (folder / "privacy_ledger.json").write_text(text)
    meta = read_safetensors_header(folder / "model.safetensors")[0]["__metadata__"]
    rewrite_safetensors_metadata(
        folder / "model.safetensors", {**meta, "vip_hub.privacy_ledger": text}
    )
    _, front, body = (folder / "README.md").read_text().split("---\n", 2)
    card = yaml.safe_load(front)
    card["differential_privacy"] = json.loads(text)
    (folder / "README.md").write_text(
        "---\n" + yaml.safe_dump(card, sort_keys=False) + "---\n" + body
    )


def _redirect(folder: Path, key: str, value: object) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config["pretrained_cfg"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    _rebind(folder)
    return folder


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_repo_with_head(tmp_path_factory.mktemp("good") / "repo")
    assert verify_repo(folder).ok
    return folder


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "repo"))


def _torch_pickle(legacy: bool = False) -> bytes:
    buf = io.BytesIO()
    torch.save({"weight": torch.zeros(2)}, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


def test_rebind_alone_keeps_a_repo_verified(good, tmp_path):
    folder = _copy(good, tmp_path)
    _rebind(folder)
    assert verify_repo(folder).ok


@pytest.mark.parametrize("key", sorted(WEIGHT_SOURCE_KEYS))
def test_every_timm_weight_source_key_is_refused(good, tmp_path, key):
    folder = _redirect(
        _copy(good, tmp_path), key, "weights.pth.tar" if key != "custom_load" else "hf"
    )
    problems = [str(p) for p in verify_repo(folder).problems]
    assert problems == [
        (
            f"config.json:pretrained_cfg.{key}: would make timm load weights from elsewhere "
            "than the verified model.safetensors"
        )
    ]


def test_a_weight_source_at_the_top_level_is_refused(good, tmp_path):
    """timm's legacy config layout reads the source keys at the top level."""
    folder = _copy(good, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "url": "https://example.com/w.pth"}))
    _rebind(folder)
    assert [p.where for p in verify_repo(folder).problems] == ["config.json:url"]


@pytest.mark.parametrize(
    "name, content",
    [
        ("checkpoint.pth.tar", _torch_pickle()),
        ("weights.pth.tar", _torch_pickle(legacy=True)),
        ("model.joblib", pickle.dumps({"w": [0.0] * 4}, protocol=5)),
        ("weights.pt.gz", gzip.compress(_torch_pickle(legacy=True))),
        ("model.npy", pickle.dumps({"w": 1}, protocol=2)),
        (
            "array.npy",
            b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
        ),
        ("notes.txt", b"cos\nsystem\n(S'echo owned'\ntR."),  # protocol 0: plain ASCII
    ],
)
def test_pickle_and_archive_content_is_refused_whatever_the_name(good, tmp_path, name, content):
    folder = _copy(good, tmp_path)
    (folder / name).write_bytes(content)
    problems = verify_repo(folder).problems
    assert [p.where for p in problems] == [name]
    assert "refused whatever the file's name" in problems[0].message


def test_ordinary_text_is_not_taken_for_a_pickle(good, tmp_path):
    folder = _copy(good, tmp_path)
    for i, text in enumerate(
        ["The model card.\n" * 50, "N.B. short", "S'quoted'\n", "(\n)\n", "I1\nI2\n"]
    ):
        (folder / f"note{i}.txt").write_text(text)
    assert verify_repo(folder).ok


def test_weights_files_are_recognised_in_any_case(good, tmp_path):
    folder = _copy(good, tmp_path)
    shutil.copy(folder / "model.safetensors", folder / "extra.SAFETENSORS")
    assert [(p.where, "not listed" in p.message) for p in verify_repo(folder).problems] == [
        ("extra.SAFETENSORS", True)
    ]


def test_git_segments_and_file_folder_clashes_are_refused():
    for path in (
        ".git/config",
        "a/.git/hooks/post-checkout",
        ".GIT/config",
        ".git./config",
        ".git",
    ):
        with pytest.raises(ValueError, match="'.git' segment"):
            validate_relpath(path)
    assert validate_relpath(".gitattributes") == ".gitattributes"
    assert tree_path_problems(["README.md", "README.md/x", "a/b", "A/b", "c"]) == [
        "'README.md' is a file and the folder of 'README.md/x'",
        "'A/b' and 'a/b' differ only by case",
    ]


# ---------------------------------------------------------------------------- the live hub


def test_hub_refuses_a_repo_that_sends_timm_to_a_pickle(hub, good, tmp_path):
    """The review's repo: pretrained_cfg.hf_hub_filename names a pickle beside the verified
    weights."""
    folder = _redirect(_copy(good, tmp_path), "hf_hub_filename", "weights.pth.tar")
    (folder / "weights.pth.tar").write_bytes(_torch_pickle(legacy=True))
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("writer/redirect")
    with pytest.raises(BadRequestError, match="pretrained_cfg.hf_hub_filename") as err:
        api.upload_folder(repo_id="writer/redirect", folder_path=folder)
    assert "weights.pth.tar: holds a pickle" in str(err.value)
    with pytest.raises(RevisionNotFoundError):  # nothing was stored: timm has nothing to load
        timm.create_model("hf-hub:writer/redirect", pretrained=True)
    # the same repo without the redirect is served, and timm loads its verified safetensors
    push_repo(good, "writer/redirect", token=WRITE_TOKEN)
    model = timm.create_model("hf-hub:writer/redirect", pretrained=True)
    assert model.pretrained_cfg["hf_hub_id"] == "writer/redirect" and not model.pretrained_cfg.get(
        "hf_hub_filename"
    )


@pytest.mark.parametrize(
    "name", ["checkpoint.pth.tar", "model.joblib", "weights.pt.gz", "model.npy"]
)
def test_hub_refuses_pickles_under_any_name(hub, good, tmp_path, name):
    api = HfApi(token=WRITE_TOKEN)
    repo = f"writer/{name.replace('.', '-')}"
    api.create_repo(repo)
    push_repo(good, repo, token=WRITE_TOKEN)
    before = api.model_info(repo).sha
    data = gzip.compress(_torch_pickle(legacy=True)) if name.endswith(".gz") else _torch_pickle()
    if name.endswith(".npy"):
        buf = io.BytesIO()
        np.save(buf, np.array([{"w": 1}], dtype=object), allow_pickle=True)
        data = buf.getvalue()
    with pytest.raises(BadRequestError, match=f"{name}: holds"):
        api.upload_file(path_or_fileobj=data, path_in_repo=name, repo_id=repo)
    with pytest.raises(BadRequestError, match="MODEL.SAFETENSORS: not listed in the ledger"):
        api.upload_file(
            path_or_fileobj=(good / "model.safetensors").read_bytes(),
            path_in_repo="MODEL.SAFETENSORS",
            repo_id=repo,
        )
    assert api.model_info(repo).sha == before


def test_hub_refuses_git_paths_and_a_file_that_is_a_folder(hub, good):
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("writer/paths")
    push_repo(good, "writer/paths", token=WRITE_TOKEN)
    before = api.model_info("writer/paths").sha
    hook = b"[core]\n\tfsmonitor = touch /tmp/owned\n"
    for path in (".git/config", "sub/.git/config", ".Git/config"):
        r = raw_commit(hub.url, "writer/paths", {path: hook})
        assert r.status_code == 400 and "'.git' segment" in r.json()["error"], (path, r.text)
    r = raw_commit(hub.url, "writer/paths", {"README.md/x": b"shadow"})
    assert (
        r.status_code == 400
        and "'README.md' is a file and the folder of 'README.md/x'" in r.json()["error"]
    )
    assert api.model_info("writer/paths").sha == before
