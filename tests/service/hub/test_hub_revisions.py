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
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from support.helpers import random_text, tiny_repo_with_head
from support.live import READ_TOKEN, WRITE_TOKEN

from vip_hub.repo.push import push_repo
from vip_hub.repo_format import CONFIG_FILE, HEADS_DIR, WEIGHTS_FILE

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
        for e in api.get_paths_info(repo, [CONFIG_FILE, WEIGHTS_FILE, HEADS_DIR, "notes.txt", "x"])
    }
    assert found.keys() == {CONFIG_FILE, WEIGHTS_FILE, HEADS_DIR}
    assert found[CONFIG_FILE].blob_id == tree[CONFIG_FILE].blob_id and not found[CONFIG_FILE].lfs
    assert found[WEIGHTS_FILE].lfs.sha256 == tree[WEIGHTS_FILE].lfs.sha256
    assert found[HEADS_DIR].tree_id == tree[HEADS_DIR].tree_id
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


def test_branches_are_created_committed_to_and_deleted(hub, tmp_path):
    """``create_branch`` and ``delete_branch`` were 404s: a branch starts at main's head, a tag
    or a commit, takes commits of its own while main stays, and goes when deleted."""
    api = HfApi(token=WRITE_TOKEN)
    repo = "pin/branches"
    first = push_repo(tiny_repo_with_head(tmp_path / "b"), repo, token=WRITE_TOKEN)
    api.create_tag(repo, tag="v1")
    head = api.create_commit(repo, [CommitOperationAdd("a.txt", b"a")], commit_message="a").oid
    api.create_branch(repo, branch="dev")
    api.create_branch(repo, branch="from-tag", revision="v1")
    api.create_branch(repo, branch="from-commit", revision=first)
    api.create_branch(repo, branch="dev", exist_ok=True)  # the hub's 409, taken as "exists"
    branches = {b.name: b.target_commit for b in api.list_repo_refs(repo).branches}
    assert branches == {"main": head, "dev": head, "from-tag": first, "from-commit": first}
    api.upload_file(path_or_fileobj=b"dev", path_in_repo="b.txt", repo_id=repo, revision="dev")
    assert Path(hf_hub_download(repo, "b.txt", revision="dev")).read_bytes() == b"dev"
    assert api.model_info(repo).sha == head
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo, "b.txt")
    api.delete_branch(repo, branch="dev")
    assert "dev" not in {b.name for b in api.list_repo_refs(repo).branches}
    assert api.model_info(repo).sha == head
    with pytest.raises(RevisionNotFoundError):
        api.model_info(repo, revision="dev")
    with pytest.raises(RevisionNotFoundError):
        api.delete_branch(repo, branch="dev")


def test_branch_names_starting_points_and_rights_are_checked(hub, tmp_path):
    """An existing branch or a tag's name is a 409, a commit id's a 400; an unknown starting
    point, or none in a repo without a commit, is not found; main cannot be deleted; a read
    token may neither create nor delete one."""
    api = HfApi(token=WRITE_TOKEN)
    repo = "pin/named"
    push_repo(tiny_repo_with_head(tmp_path / "n"), repo, token=WRITE_TOKEN)
    api.create_tag(repo, tag="t1")
    api.create_branch(repo, branch="exists")
    for name in ("exists", "main", "t1"):
        with pytest.raises(HfHubHTTPError) as err:
            api.create_branch(repo, branch=name)
        assert err.value.response.status_code == 409
    for name in ("0" * 40, "AB" * 20, "aB" * 20):  # upper case was a branch, then a tag
        with pytest.raises(BadRequestError, match="looks like a commit id"):
            api.create_branch(repo, branch=name)
        with pytest.raises(BadRequestError, match="looks like a commit id"):
            api.create_tag(repo, tag=name)
    with pytest.raises(RevisionNotFoundError):
        api.create_branch(repo, branch="new", revision="nope")
    api.create_repo("pin/empty")
    with pytest.raises(RevisionNotFoundError, match="no commit yet"):
        api.create_branch("pin/empty", branch="dev")
    with pytest.raises(BadRequestError, match="default branch"):
        api.delete_branch(repo, branch="main")
    with pytest.raises(RevisionNotFoundError):  # a tag is not a branch
        api.delete_branch(repo, branch="t1")
    reader = HfApi(token=READ_TOKEN)
    for call in (
        lambda: reader.create_branch(repo, branch="by-reader"),
        lambda: reader.delete_branch(repo, branch="exists"),
    ):
        with pytest.raises(HfHubHTTPError) as err:
            call()
        assert err.value.response.status_code == 403 and "write scope" in str(err.value)
    reader.create_branch(repo, branch="exists", exist_ok=True)  # the client lists the refs
    assert {b.name for b in api.list_repo_refs(repo).branches} == {"main", "exists"}
