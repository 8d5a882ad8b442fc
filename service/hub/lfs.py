"""The Git LFS batch API (basic transfer), as huggingface_hub uses it when Xet is off
(``HF_HUB_DISABLE_XET=1``, no ``hf_xet``, or file objects given to ``CommitOperationAdd``).

``POST /{org}/{name}.git/info/lfs/objects/batch`` answers, per object, nothing to do when the
repo already holds it (uploaded for this repo, or in its history: whether another repo holds
it is never told), else an ``upload`` action (a PUT to this server, authorised by a
short-lived grant in its URL, bound to the repo and ended with the token it was given to:
the client sends no token with it) and a ``verify`` action. The
PUT streams the body into the store's uploads area, hashing as it writes; the commit then
names the object by SHA-256 (an ``lfsFile`` line). Multipart transfer is the server's choice
(a ``chunk_size`` in the upload header) and is not offered to this hub: one streamed PUT
serves any size.

With an object store (``object_store.endpoint``) the ``upload`` action is instead a presigned
PUT straight to the store, to a staging key of this upload alone (never a content key), and the
``verify`` action (granted like the PUT above) is where the store copies the staged object to a
key no client can write, and the hub hashes that copy and keeps it only if it is the object
announced (``BlobStore.receive_staged``): nothing a client sent is named by a commit before
that, and what the client writes through its URL afterwards (it stays valid for its lifetime)
changes nothing and goes at the next collection (no reservation names it any more). An object
over ``object_store.multipart_chunk_bytes`` goes in parts: a presigned PUT per part (its length
signed), then the client's completion POST to this hub (granted, as it carries no token), which
joins them. The bytes of a user's presigned uploads not yet verified are capped
(``object_store.max_staged_bytes``: 429 in the batch reply), and with either store the bytes of
a user's objects from their batch reply until a commit names them
(``hub.max_uncommitted_bytes``: ``HubStore.reserve_uploads``, 429 in the batch reply).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..auth import GRANT_TTL_S, Identity, check_grant, sign_grant
from ..errors import BadRequest, EntryNotFound
from ..store import HubStore
from ..store.blobs import check_sha256
from ..store.errors import StoreUnavailable, TooMuchStaged, TooMuchUncommitted
from ..store.naming import validate_repo_id
from ..store.s3 import staging_key
from .common import Writable, base_url, store_of, writable
from .uploads import receive_blob

router = APIRouter()

LFS_JSON = "application/vnd.git-lfs+json"


def _grant_ttl(store: HubStore) -> float:
    """How long an upload's grants last: an hour, or ``hub.upload_ttl_s`` where that is shorter,
    since an upload not verified by then is collected."""
    return min(GRANT_TTL_S, store.limits.upload_ttl_s)


class LfsObject(BaseModel):
    oid: str = Field(max_length=64)
    size: int = Field(ge=0)


class LfsBatch(BaseModel):
    operation: str
    transfers: list[str] = ["basic"]
    objects: list[LfsObject] = Field(max_length=10_000)
    hash_algo: str = "sha256"


@router.post("/{org}/{name}.git/info/lfs/objects/batch", summary="Git LFS batch API (uploads)")
def batch(
    payload: LfsBatch, request: Request, opened: Annotated[Writable, writable("uploading")]
) -> JSONResponse:
    if payload.operation != "upload":
        raise BadRequest(
            "this hub's LFS batch API takes uploads; download files from /{org}/{name}/resolve/..."
        )
    if payload.hash_algo != "sha256" or "basic" not in payload.transfers:
        raise BadRequest("the LFS batch API here speaks the basic transfer with sha256 object ids")
    store, repo_id, who = opened.store, opened.repo_id, opened.who
    limit = request.app.state.settings.hub.max_upload_bytes
    quota = request.app.state.settings.object_store.max_staged_bytes
    base = f"{base_url(request)}/{repo_id}.git/info/lfs"
    objects: list[dict[str, Any]] = []
    for obj in payload.objects:
        oid = check_sha256(obj.oid)
        entry: dict[str, Any] = {"oid": oid, "size": obj.size, "authenticated": True}
        held = store.held_for(repo_id, oid)
        if obj.size > limit:
            entry["error"] = {
                "code": 413,
                "message": f"{obj.size} bytes is over the upload limit of {limit}",
            }
        elif held is None:
            try:
                with store.reserve_uploads(who.name, repo_id, [(oid, obj.size)]):
                    actions = _upload_actions(store, base, repo_id, oid, obj.size, who, quota)
                entry["actions"] = actions
            except (TooMuchUncommitted, TooMuchStaged) as e:
                entry["error"] = {"code": 429, "message": str(e)}
        elif held != obj.size:
            entry["error"] = {
                "code": 422,
                "message": f"object {oid} is held with {held} bytes, not {obj.size}",
            }
        objects.append(entry)
    store.maybe_collect_uploads()
    return JSONResponse(
        {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}, media_type=LFS_JSON
    )


def _upload_actions(
    store: HubStore, base: str, repo_id: str, oid: str, size: int, who: Identity, quota: int
) -> dict[str, Any]:
    """The ``upload`` and ``verify`` actions of one object: a granted PUT to this hub, or a
    presigned PUT to a fresh staging key of the object store (counted against ``who``'s
    ``quota`` of unverified staged bytes: TooMuchStaged) and a granted verify."""
    remote, ttl = store.blobs.remote, _grant_ttl(store)
    if remote is None:
        grant = sign_grant(store.secret(), "lfs-upload", f"{repo_id}:{oid}:{size}", ttl, who)
        return {
            "upload": {
                "href": f"{base}/objects/{oid}?size={size}&grant={grant}",
                "expires_in": int(ttl),
            },
            "verify": {"href": f"{base}/verify", "expires_in": int(ttl)},
        }
    staged = uuid.uuid4().hex
    store.reserve_staging(who.name, staged, size, quota)
    grant = sign_grant(store.secret(), "lfs-staged", f"{repo_id}:{oid}:{size}:{staged}", ttl, who)
    upload: dict[str, Any] = {"expires_in": remote.expiry(ttl)}
    if size <= remote.chunk:
        upload["href"] = remote.presign_put(staging_key(staged), size, ttl)
    else:  # in parts: a presigned PUT each, then the completion POST (no token) to this hub
        parts_id, urls = remote.presign_parts(staging_key(staged), size, ttl)
        subject = f"{repo_id}:{oid}:{size}:{staged}:{parts_id}"
        done = sign_grant(store.secret(), "lfs-parts", subject, ttl, who)
        query = urlencode({"staged": staged, "parts": parts_id, "size": size, "grant": done})
        upload["href"] = f"{base}/complete/{oid}?{query}"
        upload["header"] = {"chunk_size": str(remote.chunk)} | {
            str(n): url for n, url in enumerate(urls, 1)
        }
    return {
        "upload": upload,
        "verify": {
            "href": f"{base}/verify?staged={staged}&grant={grant}",
            "expires_in": int(ttl),
        },
    }


@router.put(
    "/{org}/{name}.git/info/lfs/objects/{oid}", summary="Git LFS basic transfer: upload one object"
)
async def upload(
    org: str,
    name: str,
    oid: str,
    request: Request,
    size: int = Query(ge=0),
    grant: str | None = Query(None),
) -> dict[str, Any]:
    store = store_of(request)
    repo_id = validate_repo_id(org, name)
    subject = f"{repo_id}:{check_sha256(oid)}:{size}"
    # the index and the file system off the loop (a PostgreSQL round trip, fsyncs)
    await run_in_threadpool(_check_upload, request, store, repo_id, subject, grant)
    writer, got = await receive_blob(request, store.blobs, size)
    if writer.size != size or got != oid:
        writer.path.unlink(missing_ok=True)
        raise BadRequest(
            f"the uploaded bytes ({writer.size} bytes, SHA-256 {got}) are not object {oid} of "
            f"{size} bytes"
        )
    await run_in_threadpool(_keep_upload, store, writer.path, repo_id, oid)
    return {"oid": oid, "size": size}


def _check_upload(
    request: Request, store: HubStore, repo_id: str, subject: str, grant: str | None
) -> None:
    """Unauthorized unless ``grant`` allows this PUT to ``repo_id`` (``subject``: repo, object,
    size); the repo must still exist."""
    check_grant(request, store.secret(), "lfs-upload", subject, grant, repo_id.partition("/")[0])
    store.get_repo(repo_id)


def _keep_upload(store: HubStore, path: Path, repo_id: str, oid: str) -> None:
    """Move a received object into the uploads and note it for ``repo_id``'s commits."""
    store.blobs.stage_upload(path, oid)
    store.note_upload(repo_id, oid)


class LfsPart(BaseModel):
    partNumber: int = Field(ge=1)  # noqa: N815 - the protocol's name
    etag: str = Field(max_length=200)


class LfsCompletion(BaseModel):
    oid: str = Field(max_length=64)
    parts: list[LfsPart] = Field(max_length=10_000)


@router.post(
    "/{org}/{name}.git/info/lfs/complete/{oid}",
    summary="Git LFS multipart transfer: join the parts PUT through presigned URLs",
)
def complete(
    org: str,
    name: str,
    oid: str,
    payload: LfsCompletion,
    request: Request,
    staged: str = Query(max_length=32),
    parts: str = Query(max_length=1024),
    size: int = Query(ge=0),
    grant: str | None = Query(None),
) -> dict[str, Any]:
    store = store_of(request)
    repo_id = validate_repo_id(org, name)
    subject = f"{repo_id}:{check_sha256(oid)}:{size}:{staged}:{parts}"
    check_grant(request, store.secret(), "lfs-parts", subject, grant, org)
    if payload.oid != oid or [p.partNumber for p in payload.parts] != list(
        range(1, len(payload.parts) + 1)
    ):
        raise BadRequest(f"expected the parts of object {oid}, numbered from 1 in order")
    if store.blobs.remote is None:
        raise BadRequest("this hub keeps no object store: upload with a single PUT")
    store.blobs.remote.complete_parts(staging_key(staged), parts, [p.etag for p in payload.parts])
    return {"oid": oid, "size": size}


@router.post("/{org}/{name}.git/info/lfs/verify", summary="Git LFS: check that an object arrived")
def verify(
    payload: Annotated[LfsObject, Body()],
    request: Request,
    opened: Annotated[Writable, writable("uploading")],
    staged: str | None = Query(None, max_length=32),
    grant: str | None = Query(None),
) -> dict[str, Any]:
    store, repo_id, oid = opened.store, opened.repo_id, check_sha256(payload.oid)
    if staged is not None and store.blobs.remote is not None:  # a presigned PUT: check it
        subject = f"{repo_id}:{oid}:{payload.size}:{staged}"
        check_grant(request, store.secret(), "lfs-staged", subject, grant, opened.repo.org)
        try:
            store.blobs.receive_staged(staged, oid, payload.size)
        except StoreUnavailable:  # staged object and reservation kept for the client's retry
            raise
        except BaseException:  # refused: the staged object went
            store.release_staging(staged)
            raise
        store.release_staging(staged)  # verified
        store.note_upload(repo_id, oid)
    held = store.held_for(repo_id, oid)
    if held != payload.size:
        raise EntryNotFound(f"object {payload.oid} of {payload.size} bytes was not received")
    return {"oid": payload.oid, "size": held}
