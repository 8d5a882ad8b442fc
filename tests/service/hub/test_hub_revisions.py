"""Revisions through the unmodified huggingface_hub client: paths at a revision
(``get_paths_info``), copies from another revision (``CommitOperationCopy``), commit history
past one page, refs as the client asks for them. A real server (HF_ENDPOINT)."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationCopy,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
)
from huggingface_hub.errors import (
    BadRequestError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from support.helpers import random_text, tiny_repo_with_head
from support.live import WRITE_TOKEN

from vip_hub.repo.push import push_repo
from vip_hub.repo_format import CONFIG_FILE, WEIGHTS_FILE

REPO = "pin/paths"


@pytest.fixture(scope="module")
def repo(hub, tmp_path_factory) -> str:
    """A published tiny repo, and a private one (``pin/hidden``)."""
    base = tmp_path_factory.mktemp("revisions")
    push_repo(tiny_repo_with_head(base / "paths"), REPO, token=WRITE_TOKEN)
    push_repo(tiny_repo_with_head(base / "hidden"), "pin/hidden", token=WRITE_TOKEN, private=True)
    return REPO


def test_paths_info_answers_files_and_folders_at_a_revision(hub, repo):
    """``get_paths_info`` (the client's POST paths-info, which ``CommitOperationCopy`` needs too)
    was a 404 for every repo: files and folders at the revision, absent paths left out."""
    api = HfApi(token=WRITE_TOKEN)
    first = api.create_commit(repo, [CommitOperationAdd("notes.txt", b"v1")], commit_message="a")
    api.create_commit(repo, [CommitOperationDelete("notes.txt")], commit_message="d")
    tree = {e.path: e for e in api.list_repo_tree(repo, recursive=True)}
    found = {
        e.path: e
        for e in api.get_paths_info(repo, [CONFIG_FILE, WEIGHTS_FILE, "heads", "notes.txt", "x"])
    }
    assert found.keys() == {CONFIG_FILE, WEIGHTS_FILE, "heads"}
    assert found[CONFIG_FILE].blob_id == tree[CONFIG_FILE].blob_id and not found[CONFIG_FILE].lfs
    assert found[WEIGHTS_FILE].lfs.sha256 == tree[WEIGHTS_FILE].lfs.sha256
    assert found["heads"].tree_id == tree["heads"].tree_id
    old = api.get_paths_info(repo, ["notes.txt"], revision=first.oid)
    assert [(e.path, e.size) for e in old] == [("notes.txt", 2)]
    with pytest.raises(RevisionNotFoundError):
        api.get_paths_info(repo, [CONFIG_FILE], revision="nope")
    with pytest.raises(RepositoryNotFoundError):  # a private repo, to an anonymous caller
        HfApi().get_paths_info("pin/hidden", [CONFIG_FILE])
    with pytest.raises(BadRequestError, match="invalid path"):
        api.get_paths_info(repo, ["../" + CONFIG_FILE])


def test_files_are_copied_from_another_revision(hub, repo):
    """``CommitOperationCopy`` with ``src_revision``: a regular file and an LFS one (held in the
    repo's history, so nothing is uploaded again) land at the new revision with the old bytes."""
    api = HfApi(token=WRITE_TOKEN)
    big = random_text(11 * 1024 * 1024)  # over LFS_THRESHOLD: an LFS file
    old = api.create_commit(
        repo,
        [CommitOperationAdd("notes/a.txt", b"old"), CommitOperationAdd("notes/big.txt", big)],
        commit_message="old",
    ).oid
    api.create_commit(
        repo,
        [CommitOperationAdd("notes/a.txt", b"new"), CommitOperationDelete("notes/big.txt")],
        commit_message="new",
    )
    api.create_commit(
        repo,
        [
            CommitOperationCopy("notes/a.txt", "notes/a-old.txt", src_revision=old),
            CommitOperationCopy("notes/big.txt", "notes/big.txt", src_revision=old),
        ],
        commit_message="copies",
    )
    assert Path(hf_hub_download(repo, "notes/a-old.txt")).read_bytes() == b"old"
    assert Path(hf_hub_download(repo, "notes/a.txt")).read_bytes() == b"new"
    assert Path(hf_hub_download(repo, "notes/big.txt")).read_bytes() == big


@pytest.mark.slow  # 101 real commits, about 30 s
def test_commit_history_is_listed_whole_past_one_page(hub, repo):
    """``list_repo_commits`` follows the Link header: the history stopped at 100 commits, the
    rest silently missing (the first commit among them)."""
    api = HfApi(token=WRITE_TOKEN)
    root = api.list_repo_commits(repo)[-1].commit_id
    made = [
        api.create_commit(
            repo, [CommitOperationAdd("count.txt", str(i).encode())], commit_message=str(i)
        ).oid
        for i in range(101)
    ]
    history = api.list_repo_commits(repo)
    assert [c.commit_id for c in history[:101]] == made[::-1]
    assert history[-1].commit_id == root and len({c.commit_id for c in history}) == len(history)
    pinned = api.list_repo_commits(repo, revision=made[50])
    assert [c.commit_id for c in pinned] == [c.commit_id for c in history[50:]]


def test_refs_with_pull_requests_as_the_client_asks(hub, repo):
    """``list_repo_refs(include_pull_requests=True)`` raised KeyError('pullRequests'): the hub
    has none, and says so."""
    refs = HfApi().list_repo_refs(repo, include_pull_requests=True)
    assert refs.pull_requests == [] and [b.name for b in refs.branches] == ["main"]
    assert HfApi().list_repo_refs(repo).pull_requests is None
