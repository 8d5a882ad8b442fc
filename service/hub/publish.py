"""Write side of the hub API: create repos, preupload, commits (verified), tags, YAML checks.

Every commit runs the repo format's verification on the resulting tree; a tree that does
not verify is refused with a 400 naming the failing check, and nothing is stored.
"""

from __future__ import annotations

from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from vip_hub.paths import MAX_PATH_LENGTH
from vip_hub.repo.card import load_card
from vip_hub.repo_format import CARD_FILE, DEFAULT_BRANCH

from ..auth import Identity, check_write, identity, require_scope
from ..errors import BadRequest, Conflicting, PayloadTooLarge
from ..store.blobs import is_lfs
from ..store.errors import NoSuchRevision
from ..store.naming import (
    MAX_REVISION_LENGTH,
    validate_path,
    validate_repo_id,
    validate_revision,
)
from .common import Writable, base_url, check_still_writable, store_of, writable
from .uploads import CommitParser, receive_body

router = APIRouter(prefix="/api")


class CreateRepo(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(max_length=96)
    organization: str | None = Field(None, max_length=96)
    type: str = "model"
    private: bool | None = None
    visibility: str | None = None


@router.post("/repos/create", summary="Create a model repo")
def create_repo(
    payload: CreateRepo, request: Request, who: Identity | None = Depends(identity)
) -> JSONResponse:
    who = require_scope(who, "write", "creating a repo")
    if payload.type != "model":
        raise BadRequest(f"this hub stores models only, not {payload.type}s")
    org = payload.organization or who.name
    repo_id = validate_repo_id(org, payload.name)
    check_write(who, org, "creating a repo")
    if (other := request.app.state.tokens.holder_in_other_case(org)) is not None:
        raise Conflicting(
            f"namespace {org!r} differs only by case from {other!r}'s: namespaces are unique "
            "whatever their case"
        )
    private = _private(payload)
    repo, created = store_of(request).create_repo(repo_id, private=private)
    url = f"{base_url(request)}/{repo.repo_id}"
    if not created:  # huggingface_hub's create_repo(exist_ok=True) reads the url
        raise Conflicting("You already created this model repo", body={"url": url})
    return JSONResponse({"url": url, "name": repo.repo_id, "id": repo.repo_id})


def _private(payload: CreateRepo) -> bool:
    """Whether the repo ``payload`` asks for is private: ``visibility`` public or private, or
    ``private``; anything else, or the two disagreeing, is refused (never a public repo asked
    for as private by a misspelling)."""
    if payload.visibility is None:
        return bool(payload.private)
    if payload.visibility not in ("public", "private"):
        raise BadRequest(f"visibility must be 'public' or 'private', not {payload.visibility!r}")
    private = payload.visibility == "private"
    if payload.private is not None and payload.private != private:
        raise BadRequest(
            f"visibility {payload.visibility!r} and private={payload.private} disagree"
        )
    return private


class PreuploadFile(BaseModel):
    path: str = Field(max_length=MAX_PATH_LENGTH)
    sample: str = ""
    size: int = Field(ge=0)


class Preupload(BaseModel):
    model_config = ConfigDict(extra="allow")

    files: list[PreuploadFile]


@router.post("/models/{org}/{name}/preupload/{revision}", summary="Upload modes for files")
def preupload(
    revision: str, payload: Preupload, opened: Annotated[Writable, writable("uploading")]
) -> dict[str, Any]:
    store, repo_id = opened.store, opened.repo_id
    if problem := store.limits.commit_files_problem(len(payload.files), "the preupload"):
        raise PayloadTooLarge(problem)
    try:
        tree = store.tree(repo_id, store.resolve(repo_id, validate_revision(revision)))
    except NoSuchRevision:  # an empty repo or a new branch: nothing to compare against
        tree = {}
    files = []
    for f in payload.files:
        path = validate_path(f.path)
        existing = tree.get(path)
        lfs = is_lfs(path, f.size)
        oid = (existing.sha256 if lfs else existing.git_oid) if existing else None
        files.append(
            {
                "path": path,
                "uploadMode": "lfs" if lfs else "regular",
                "shouldIgnore": False,
                "oid": oid,
            }
        )
    return {"files": files, "commitOid": None}


@router.post("/models/{org}/{name}/commit/{revision}", summary="Commit files (NDJSON body)")
async def commit(
    revision: str, request: Request, opened: Annotated[Writable, writable("committing")]
) -> dict[str, Any]:
    if request.query_params.get("create_pr", "").lower() not in ("", "0", "false"):
        raise BadRequest("pull requests are not supported by this hub; commit to a branch")
    store, repo_id = opened.store, opened.repo_id
    branch = validate_revision(revision)
    parser = CommitParser(store.blobs, store.limits)
    try:
        await receive_body(request, parser.feed, parser.limit)
        parsed = await run_in_threadpool(parser.finish)  # closes its last file: off the loop
        await run_in_threadpool(check_still_writable, opened, request, "committing")
    except BaseException:
        parser.discard()
        raise
    record = await run_in_threadpool(
        store.commit,
        repo_id,
        parsed.operations,
        branch=branch,
        parent_commit=parsed.parent_commit,
        title=parsed.summary or "Update",
        message=parsed.description,
        author=opened.who.name,
    )
    return {
        "commitUrl": f"{base_url(request)}/{repo_id}/commit/{record.sha}",
        "commitOid": record.sha,
        "pullRequestUrl": None,
    }


class TagRequest(BaseModel):
    tag: str = Field(max_length=MAX_REVISION_LENGTH)
    message: str | None = None


@router.post("/models/{org}/{name}/tag/{revision}", summary="Tag a revision")
def create_tag(
    revision: str, payload: TagRequest, opened: Annotated[Writable, writable("tagging")]
) -> dict[str, Any]:
    commit = opened.store.create_tag(opened.repo_id, payload.tag, validate_revision(revision))
    return {"tag": payload.tag, "targetCommit": commit}


@router.delete("/models/{org}/{name}/tag/{tag}", summary="Delete a tag")
def delete_tag(tag: str, opened: Annotated[Writable, writable("deleting a tag")]) -> Response:
    opened.store.delete_tag(opened.repo_id, validate_revision(tag))
    return Response(status_code=204)


class BranchRequest(BaseModel):
    """``create_branch``'s body: the revision the branch starts at (default: main's head)."""

    starting_point: str = Field(
        DEFAULT_BRANCH, alias="startingPoint", max_length=MAX_REVISION_LENGTH
    )


@router.post("/models/{org}/{name}/branch/{branch}", summary="Create a branch")
def create_branch(
    branch: str,
    opened: Annotated[Writable, writable("creating a branch")],
    payload: BranchRequest | None = None,
) -> dict[str, Any]:
    start = payload.starting_point if payload else DEFAULT_BRANCH
    commit = opened.store.create_branch(opened.repo_id, branch, validate_revision(start))
    return {"branch": branch, "targetCommit": commit}


@router.delete("/models/{org}/{name}/branch/{branch}", summary="Delete a branch")
def delete_branch(
    branch: str, opened: Annotated[Writable, writable("deleting a branch")]
) -> Response:
    opened.store.delete_branch(opened.repo_id, validate_revision(branch))
    return Response(status_code=204)


@router.post("/validate-yaml", summary="Check a model card's YAML front matter")
def validate_yaml(request: Request, payload: dict[str, Any] = Body(...)) -> JSONResponse:
    content = payload.get("content")
    if not isinstance(content, str):
        raise BadRequest(f"'content' must be the {CARD_FILE} text")
    try:
        load_card(content, strict=True, limits=request.app.state.settings.hub.front_matter())
    except (ValueError, yaml.YAMLError) as e:  # RepoFormatError (YAML aliases) is a ValueError
        message = " ".join(str(e).split())
        raise BadRequest(message, body={"errors": [{"message": message}], "warnings": []}) from None
    return JSONResponse({"errors": [], "warnings": []})
