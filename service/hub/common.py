"""Shared pieces of the hub routes: the store dependency, raw-path parsing, JSON shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from ..auth import Identity, check_read, check_write, identity, require_scope
from ..store import CommitRecord, FileEntry, HubStore, RepoRecord
from ..store.naming import decode_segment, validate_repo_id

__all__ = [
    "Writable",
    "base_url",
    "etag",
    "model_json",
    "raw_segments",
    "readable_repo",
    "store_of",
    "writable",
]

MAX_OFFSET = 2**63 - 1
"""The largest listing offset: the index's integers (SQLite's, PostgreSQL's BIGINT) hold no more."""
POINTER_SIZE = 134  # bytes of a git LFS pointer file (what clients show as the stored size)


def page_size(request: Request, limit: int | None) -> int:
    """A listing page's size: ``limit``, at most ``hub.page_size``, its default."""
    page = request.app.state.settings.hub.page_size
    return min(limit or page, page)


def etag(entry: FileEntry) -> str:
    """The ETag clients cache a file under: SHA-256 for LFS files, else the git blob id."""
    return entry.sha256 if entry.lfs else entry.git_oid


def store_of(request: Request) -> HubStore:
    """The app's store (``app.state.store``)."""
    return request.app.state.store


def base_url(request: Request) -> str:
    """The server's URL as the client reached it (clients check it matches HF_ENDPOINT)."""
    return str(request.base_url).rstrip("/")


def raw_segments(request: Request, skip: int) -> list[str]:
    """The URL path's segments after the first ``skip``, each percent-decoded exactly once.

    Routing on the raw path keeps an encoded ``%2F`` inside a revision from being read as a
    separator, and lets double-encoding tricks be refused.
    """
    raw = request.scope.get("raw_path") or request.url.path.encode()
    parts = raw.decode("latin-1").split("/")[1:]
    return [decode_segment(p) for p in parts[skip:]]


def readable_repo(store: HubStore, org: str, name: str, who: Identity | None) -> RepoRecord:
    """The repo if the caller may read it; private repos are RepoNotFound without a token."""
    repo = store.get_repo(validate_repo_id(org, name))
    check_read(repo.private, repo.repo_id, who)
    return repo


@dataclass(frozen=True)
class Writable:
    """A repo a route opened for writing: the store, the repo, the caller who may write it."""

    store: HubStore
    repo: RepoRecord
    who: Identity

    @property
    def repo_id(self) -> str:
        return self.repo.repo_id


def writable(what: str) -> Any:
    """A route dependency, ``Annotated[Writable, writable(what)]``: the path's ``{org}/{name}``
    repo if the caller may write to it: 401 without a write token, RepoNotFound for a private
    repo it cannot read, 403 outside its namespaces (as the HF hub answers); ``what`` names the
    action in these errors."""

    def open_writable(
        org: str, name: str, request: Request, who: Annotated[Identity | None, Depends(identity)]
    ) -> Writable:
        writer = require_scope(who, "write", what)
        store = store_of(request)
        repo = readable_repo(store, org, name, writer)
        check_write(writer, repo.org, what)
        return Writable(store, repo, writer)

    return Depends(open_writable)


def check_still_writable(opened: Writable, request: Request, what: str) -> None:
    """``writable``'s checks again, once a long request's body has arrived: a token revoked or
    a membership removed meanwhile ends the request (401, 403), as it ends the user's grants."""
    writer = require_scope(identity(request), "write", what)
    check_write(writer, opened.repo.org, what)


def sibling_json(entry: FileEntry, blobs: bool) -> dict[str, Any]:
    """A file as the model info's ``siblings`` lists it (``blobs``: with size, oid and LFS)."""
    out: dict[str, Any] = {"rfilename": entry.path}
    if blobs:
        out.update(size=entry.size, blobId=entry.git_oid)
        if entry.lfs:
            out["lfs"] = {"size": entry.size, "sha256": entry.sha256, "pointerSize": POINTER_SIZE}
    return out


def model_json(
    repo: RepoRecord,
    commit: CommitRecord | None,
    tree: dict[str, FileEntry] | None = None,
    blobs: bool = False,
) -> dict[str, Any]:
    """A repo in the shape of the HF ``/api/models`` answers (plus a ``vip_hub`` block)."""
    card = commit.card_data if commit else {}
    out: dict[str, Any] = {
        "_id": repo.repo_id,
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "author": repo.org,
        "sha": commit.sha if commit else None,
        "lastModified": commit.created_at if commit else repo.created_at,
        "createdAt": repo.created_at,
        "private": repo.private,
        "gated": False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "library_name": card.get("library_name"),
        "tags": card.get("tags", []),
        "pipeline_tag": card.get("pipeline_tag"),
        "cardData": card,
    }
    if commit is not None:
        out["vip_hub"] = {
            "arch": commit.arch,
            "num_params": commit.num_params,
            "epsilon": commit.epsilon,
            "delta": commit.delta,
            "accountant": commit.accountant,
            "private_datasets": commit.datasets,
            "caveat": commit.caveat,
        }
    if tree is not None:
        out["siblings"] = [sibling_json(e, blobs) for e in tree.values()]
    return out
