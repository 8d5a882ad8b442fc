"""Read-only hub API: model listing and search, model info per revision, tree listings,
refs and commit history, ``whoami-v2``."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import JSONResponse

from vip_hub.repo_format import DEFAULT_BRANCH

from ..auth import Identity, identity, private_namespaces, require_scope
from ..errors import BadRequest
from ..store import FileEntry
from ..store.errors import NoSuchEntry, NoSuchRevision
from ..store.naming import validate_path, validate_revision
from .common import (
    MAX_OFFSET,
    POINTER_SIZE,
    model_json,
    page_size,
    raw_segments,
    readable_repo,
    store_of,
)

router = APIRouter(prefix="/api")

TREE_PAGE = 1000
COMMITS_PAGE = 100


@router.get("/models", summary="List and search models")
def list_models(
    request: Request,
    search: str | None = Query(None, max_length=200, description="substring of org/name"),
    author: str | None = Query(None, max_length=100),
    arch: str | None = Query(None, max_length=50, description="e.g. vip-base"),
    dataset: str | None = Query(
        None, max_length=200, description="a private dataset the model saw"
    ),
    max_epsilon: float | None = Query(None, ge=0, description="guarantee at most this epsilon"),
    sort: str = Query("updated", description="updated, epsilon, delta, params, arch or name"),
    direction: int = Query(-1, description="-1 descending, 1 ascending"),
    limit: int | None = Query(None, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
    full: bool = False,
    who: Identity | None = Depends(identity),
) -> JSONResponse:
    store = store_of(request)
    size = page_size(request, limit)
    sort = {"lastModified": "updated", "last_modified": "updated"}.get(sort, sort)
    rows = store.list_models(
        search=search,
        author=author,
        arch=arch,
        dataset=dataset,
        max_epsilon=max_epsilon,
        include_private=private_namespaces(who),
        sort=sort,
        descending=direction < 0,
        limit=size + 1,
        offset=offset,
    )
    body = [
        model_json(repo, commit, store.tree(repo.repo_id, commit.sha) if full else None)
        for repo, commit in rows[:size]
    ]
    headers = {}
    if len(rows) > size and (limit is None or limit > size):
        params = {k: v for k, v in request.query_params.items() if k != "offset"}
        params["offset"] = str(offset + size)
        headers["Link"] = f'<{request.url.replace(query=urlencode(params))}>; rel="next"'
    return JSONResponse(body, headers=headers)


@router.get("/models/{org}/{name}", summary="Model info at main")
def model_info(
    org: str,
    name: str,
    request: Request,
    blobs: bool = False,
    who: Identity | None = Depends(identity),
) -> dict[str, Any]:
    return _info(request, org, name, DEFAULT_BRANCH, blobs, who, missing_ok=True)


@router.get("/models/{org}/{name}/revision/{revision:path}", summary="Model info at a revision")
def model_info_at(
    org: str,
    name: str,
    revision: str,
    request: Request,
    blobs: bool = False,
    who: Identity | None = Depends(identity),
) -> dict[str, Any]:
    del revision  # the raw path keeps an encoded '/' from splitting it
    return _info(request, org, name, _raw_revision(request, 5), blobs, who)


def _info(
    request: Request,
    org: str,
    name: str,
    revision: str,
    blobs: bool,
    who: Identity | None,
    missing_ok: bool = False,
) -> dict[str, Any]:
    store = store_of(request)
    repo = readable_repo(store, org, name, who)
    try:
        commit = store.resolve(repo.repo_id, revision)
    except NoSuchRevision:
        if missing_ok and not store.refs(repo.repo_id)["branch"]:
            return model_json(repo, None, {})  # an empty repo, created but never committed to
        raise
    record = store.commit_record(repo.repo_id, commit)
    return model_json(repo, record, store.tree(repo.repo_id, commit), blobs)


@router.get("/models/{org}/{name}/tree/{rest:path}", summary="Files and folders at a revision")
def tree(
    org: str,
    name: str,
    rest: str,
    request: Request,
    recursive: bool = False,
    expand: bool = False,
    cursor: int = Query(0, ge=0),
    who: Identity | None = Depends(identity),
) -> JSONResponse:
    del rest, expand
    store = store_of(request)
    segments = raw_segments(request, 5)
    revision = validate_revision(segments[0]) if segments and segments[0] else DEFAULT_BRANCH
    prefix = validate_path("/".join(segments[1:])) if len(segments) > 1 and segments[1] else ""
    repo = readable_repo(store, org, name, who)
    commit = store.resolve(repo.repo_id, revision)
    files = store.tree(repo.repo_id, commit)
    base = prefix + "/" if prefix else ""
    if prefix and not any(p.startswith(base) for p in files):
        raise NoSuchEntry(f"{prefix} not found in {repo.repo_id} at {commit}", commit)
    entries: dict[str, dict[str, Any]] = {}
    for path, e in files.items():
        if not path.startswith(base):
            continue
        parts = path[len(base) :].split("/")
        for depth in range(1, len(parts)):  # folders on the way
            folder = base + "/".join(parts[:depth])
            if recursive or depth == 1:
                entries.setdefault(folder, _folder_json(folder, commit))
        if recursive or len(parts) == 1:
            entries[path] = _file_json(e)
    ordered = sorted(entries.values(), key=lambda x: (x["type"] != "directory", x["path"]))
    page = ordered[cursor : cursor + TREE_PAGE]
    headers = {"X-Repo-Commit": commit}
    if cursor + TREE_PAGE < len(ordered):
        params = dict(request.query_params) | {"cursor": str(cursor + TREE_PAGE)}
        headers["Link"] = f'<{request.url.replace(query=urlencode(params))}>; rel="next"'
    return JSONResponse(page, headers=headers)


@router.get("/models/{org}/{name}/refs", summary="Branches and tags")
def refs(
    org: str, name: str, request: Request, who: Identity | None = Depends(identity)
) -> dict[str, Any]:
    store = store_of(request)
    repo = readable_repo(store, org, name, who)
    refs = store.refs(repo.repo_id)
    return {
        "branches": [
            {"name": n, "ref": f"refs/heads/{n}", "targetCommit": c}
            for n, c in refs["branch"].items()
        ],
        "tags": [
            {"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in refs["tag"].items()
        ],
        "converts": [],
        "pullRequests": [],  # none on this hub; list_repo_refs(include_pull_requests=True) reads it
    }


@router.post(
    "/models/{org}/{name}/paths-info/{revision:path}", summary="Files and folders at given paths"
)
def paths_info(
    org: str,
    name: str,
    revision: str,
    request: Request,
    paths: Annotated[list[str], Form()],
    who: Identity | None = Depends(identity),
) -> JSONResponse:
    """The entries (as the tree lists them) of those ``paths`` that are a file or a folder at the
    revision; the others are left out (``get_paths_info``, ``CommitOperationCopy``)."""
    del revision  # the raw path keeps an encoded '/' from splitting it
    store = store_of(request)
    repo = readable_repo(store, org, name, who)
    commit = store.resolve(repo.repo_id, _raw_revision(request, 5))
    files = store.tree(repo.repo_id, commit)
    folders = {p.rsplit("/", depth)[0] for p in files for depth in range(1, p.count("/") + 1)}
    found: list[dict[str, Any]] = []
    for path in dict.fromkeys(validate_path(p) for p in paths):
        if path in files:
            found.append(_file_json(files[path]))
        elif path in folders:
            found.append(_folder_json(path, commit))
    return JSONResponse(found, headers={"X-Repo-Commit": commit})


@router.get("/models/{org}/{name}/commits/{revision}", summary="Commit history")
def commits(
    org: str, name: str, revision: str, request: Request, who: Identity | None = Depends(identity)
) -> JSONResponse:
    """``COMMITS_PAGE`` commits from ``revision`` back, newest first; a Link header names the
    next page (the history from the next older commit, by id, so pages stay put while the
    branch moves)."""
    store = store_of(request)
    repo = readable_repo(store, org, name, who)
    history = store.history(repo.repo_id, validate_revision(revision), limit=COMMITS_PAGE + 1)
    page = [
        {
            "id": c.sha,
            "title": c.title,
            "message": c.message,
            "authors": [{"user": c.author}],
            "date": c.created_at,
            "parents": [c.parent] if c.parent else [],
        }
        for c in history[:COMMITS_PAGE]
    ]
    headers = {}
    if len(history) > COMMITS_PAGE:
        path = request.url.path.rsplit("/", 1)[0] + "/" + history[COMMITS_PAGE].sha
        headers["Link"] = f'<{request.url.replace(path=path)}>; rel="next"'
    return JSONResponse(page, headers=headers)


@router.get("/whoami-v2", summary="Who the token belongs to")
def whoami(who: Identity | None = Depends(identity)) -> dict[str, Any]:
    who = require_scope(who, "read", "whoami")
    role = "write" if who.allows("write") else "read"
    return {
        "type": "user",
        "id": who.name,
        "name": who.name,
        "fullname": who.name,
        "orgs": [{"type": "org", "name": org, "fullname": org} for org in sorted(who.orgs)],
        "auth": {"type": "access_token", "accessToken": {"displayName": who.name, "role": role}},
    }


def _raw_revision(request: Request, skip: int) -> str:
    segments = raw_segments(request, skip)
    if len(segments) != 1:
        raise BadRequest("a revision cannot contain '/'")
    return validate_revision(segments[0])


def _file_json(entry: FileEntry) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "file",
        "path": entry.path,
        "size": entry.size,
        "oid": entry.git_oid,
    }
    if entry.lfs:
        out["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": POINTER_SIZE}
    return out


def _folder_json(folder: str, commit: str) -> dict[str, Any]:
    oid = hashlib.sha1(f"{commit}:{folder}".encode(), usedforsecurity=False).hexdigest()
    return {"type": "directory", "path": folder, "oid": oid}
