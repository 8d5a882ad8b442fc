"""Xet uploads: what an unmodified huggingface_hub 2.x client with ``hf_xet`` installed (its
default on x86-64 and ARM64) does with a file that preupload marks ``lfs``.

Such a client never uses the Git LFS batch API: ``_upload_files`` and ``upload_folder``'s
pipeline choose Xet from ``is_xet_available()`` alone (``hf_xet`` importable and
``HF_HUB_DISABLE_XET`` unset); no response of the hub changes that. So the hub speaks Xet:

1. ``GET /api/models/{org}/{name}/xet-write-token/{rev}`` (with the user's write token) ->
   ``{accessToken, exp, casUrl}``: a short-lived grant, and this server's ``/xet/<CAS id>``
   as the CAS, the id drawn from the store and the user. The client keeps its deduplication
   cache per CAS URL, so the id keeps a client from deduplicating against xorbs of another (or
   a wiped) store, or of another user of the same machine: a shard reads only the xorbs its
   own user sent (``service.store.xet``).
2. ``POST {casUrl}/v1/xorbs/default/{hash}``: the chunk containers, kept in the store, each
   counted against its user's ``hub.max_uncommitted_bytes`` (429 past it) until a shard
   rebuilds files from every chunk of it (the files are counted then) or ``hub.upload_ttl_s``.
3. ``POST {casUrl}/v1/shards``: the file records; each file is rebuilt from the xorbs into
   the uploads area and checked against its SHA-256 (``service.store.xet``). (``/v2/shards``
   is absent: the client falls back to v1 on the 404.)
4. The commit names each file by SHA-256 in an ``lfsFile`` line, as with Git LFS.

Global deduplication (``GET /v1/chunks/...``) answers 404: nothing is shared across users.
A xorb is kept only under the hash of its content, and the answer to its upload does not
tell whether the store held it already; a shard's files count as uploaded for the grant's
repo only, and each shard rebuilds at most ``hub.xet_max_expansion`` times the stored bytes of
the chunks it reads (413 beyond). A grant ends with the token it was given to (revoked, or no
longer a member).
Downloads never advertise Xet (no ``X-Xet-*`` headers), so they stay plain HTTP.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..auth import GRANT_TTL_S, Identity, check_grant, sign_grant
from ..errors import EntryNotFound, Unauthorized
from ..store.xet import MAX_XORB_BYTES, check_xet_hash
from .common import Writable, base_url, store_of, writable
from .uploads import receive_blob

router = APIRouter()

CAS_PREFIX = "/xet"
MAX_SHARD_BYTES = 64 * 1024 * 1024


@router.get("/api/models/{org}/{name}/xet-write-token/{revision:path}", summary="Xet upload grant")
def write_token(
    revision: str, request: Request, opened: Annotated[Writable, writable("uploading")]
) -> dict[str, Any]:
    del revision  # the grant covers the repo's uploads; the commit names the branch
    store, repo_id = opened.store, opened.repo_id
    store.maybe_collect_uploads()
    grant = sign_grant(store.secret(), "xet-upload", repo_id, GRANT_TTL_S, opened.who)
    return {
        "accessToken": f"{repo_id}:{grant}",
        "exp": int(time.time() + GRANT_TTL_S) - 60,
        "casUrl": f"{base_url(request)}{CAS_PREFIX}/{_cas_id(request, opened.who.name)}",
    }


def _cas_id(request: Request, user: str) -> str:
    return hashlib.sha256(store_of(request).secret() + b"\0" + user.encode()).hexdigest()[:16]


def _authorised(request: Request, cas_id: str) -> tuple[str, Identity]:
    """The repo whose grant from ``write_token`` the CAS call carries (``Authorization: Bearer
    <repo>:<grant>``), and who it was given to, on that user's CAS URL of this store."""
    kind, _, token = request.headers.get("authorization", "").partition(" ")
    repo_id, _, grant = token.rpartition(":")
    if kind.lower() != "bearer" or not repo_id:
        raise Unauthorized("Xet CAS calls need the grant from xet-write-token")
    who = check_grant(
        request, store_of(request).secret(), "xet-upload", repo_id, grant, repo_id.partition("/")[0]
    )
    if cas_id != _cas_id(request, who.name):
        raise EntryNotFound(
            f"no Xet store {cas_id!r} here for this grant: ask xet-write-token for the current "
            "CAS URL"
        )
    return repo_id, who


@router.post(CAS_PREFIX + "/{cas_id}/v1/xorbs/default/{xorb}", include_in_schema=False)
async def upload_xorb(cas_id: str, xorb: str, request: Request) -> dict[str, bool]:
    repo_id, who = await run_in_threadpool(_authorised, request, cas_id)
    store = store_of(request)
    check_xet_hash(xorb)
    writer, _ = await receive_blob(request, store.blobs, MAX_XORB_BYTES)
    await run_in_threadpool(store.put_xorb, repo_id, xorb, writer.path, who.name)
    return {
        "was_inserted": True
    }  # held now; whether it was before (another upload's bytes) is not told


@router.post(CAS_PREFIX + "/{cas_id}/v1/shards", include_in_schema=False)
async def upload_shard(cas_id: str, request: Request) -> dict[str, int]:
    repo_id, who = await run_in_threadpool(_authorised, request, cas_id)
    store = store_of(request)
    writer, _ = await receive_blob(request, store.blobs, MAX_SHARD_BYTES)
    try:
        await run_in_threadpool(store.apply_shard, repo_id, writer.path, who.name)
    finally:
        writer.path.unlink(missing_ok=True)
    return {"result": 1}  # "sync performed"


@router.get(CAS_PREFIX + "/{cas_id}/v1/chunks/{prefix}/{chunk}", include_in_schema=False)
def dedup_query(cas_id: str, prefix: str, chunk: str, request: Request) -> None:
    _authorised(request, cas_id)
    raise EntryNotFound(f"chunk {chunk} is not offered for global deduplication")


@router.post(CAS_PREFIX + "/{cas_id}/v1/telemetry", include_in_schema=False)
def telemetry(request: Request) -> JSONResponse:
    del request
    return JSONResponse({})
