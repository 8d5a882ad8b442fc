"""``vip-hub push``: publish a verified repo folder to a hub (ours, or the Hugging Face Hub).

The folder is verified locally first, then sent as ONE commit (``HfApi.create_commit``) that
mirrors the folder: files that left it are deleted remotely, files whose content the remote
revision already holds are not sent again (so a card-only change sends the card, not the
weights). One commit matters: a vip-hub server verifies every commit's tree.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, RepoFile
from huggingface_hub.errors import (
    EntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..privacy.ledger import privacy_headline
from ..repo_format import DEFAULT_BRANCH, GITATTRIBUTES_FILE, LEDGER_FILE
from .artifacts import file_sha256, git_blob_id
from .verify import repo_files, verify_repo

__all__ = ["is_published", "push_repo"]


def push_repo(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    private: bool = False,
    revision: str = DEFAULT_BRANCH,
    message: str | None = None,
) -> str:
    """Verify ``folder`` and publish it to ``repo_id`` as one commit; returns the commit id.

    ``endpoint`` defaults to ``HF_ENDPOINT`` (else the Hugging Face Hub).
    """
    folder = Path(folder)
    report = verify_repo(folder).raise_for_problems()
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    files = repo_files(folder)
    try:
        remote = {
            f.path: f
            for f in api.list_repo_tree(repo_id, revision=revision, recursive=True)
            if isinstance(f, RepoFile)
        }
    except RevisionNotFoundError:
        remote = {}
    operations: list[CommitOperationAdd | CommitOperationDelete] = [
        CommitOperationDelete(path)
        for path in sorted(set(remote) - set(files) - {GITATTRIBUTES_FILE})
    ]
    operations += [
        CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path))
        for rel, path in files.items()
        if rel not in remote or not _same_content(path, remote[rel])
    ]
    if not operations:  # the remote revision already holds this folder
        sha = api.model_info(repo_id, revision=revision).sha
        assert sha is not None  # a hub names the commit a revision resolves to
        return sha
    assert report.ledger is not None  # a report without problems has read the ledger
    default = f"Publish {folder.name}: {privacy_headline(report.ledger.summary())}"
    info = api.create_commit(
        repo_id, operations, commit_message=message or default, revision=revision
    )
    return info.oid


def _same_content(local: Path, remote: RepoFile) -> bool:
    """Whether ``local`` holds what ``remote`` holds (its LFS SHA-256, else its git blob id)."""
    size = local.stat().st_size
    if remote.size != size:
        return False
    if remote.lfs:
        return file_sha256(local) == f"sha256:{remote.lfs.sha256}"
    return git_blob_id(local) == remote.blob_id


def is_published(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    revision: str = DEFAULT_BRANCH,
) -> bool:
    """Whether ``repo_id`` at ``revision`` already holds this folder's ledger. The ledger binds
    the digest of every file, so equal ledgers mean equal published contents."""
    api = HfApi(endpoint=endpoint, token=token)
    try:
        path = api.hf_hub_download(repo_id, LEDGER_FILE, revision=revision, force_download=True)
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        return False
    return Path(path).read_bytes() == (Path(folder) / LEDGER_FILE).read_bytes()
