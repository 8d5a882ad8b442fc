"""``HEAD`` / ``GET /{org}/{name}/resolve/{revision}/{path}``: file downloads with ETag,
X-Repo-Commit and Range, as ``hf_hub_download`` and timm expect.

With an object store, an LFS file is a redirect to a presigned GET of its blob, with
``X-Linked-Etag`` / ``X-Linked-Size`` (which huggingface_hub reads, then checks the download
against): issued like the file itself, only to a caller who may read the repo, short-lived,
and neither the redirect nor the URL kept by any cache (``private, no-store``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from starlette import responses as starlette_responses

from vip_hub.repo.artifacts import CHUNK

from ..auth import Identity, identity
from ..errors import BadRequest, PreconditionFailed, RangeNotSatisfiable
from ..store.naming import validate_path, validate_revision
from ..store.s3 import NO_STORE, blob_key
from .common import etag, raw_segments, readable_repo, store_of

router = APIRouter()


@router.api_route(
    "/{org}/{name}/resolve/{rest:path}", methods=["GET", "HEAD"], include_in_schema=False
)
def resolve(
    org: str, name: str, rest: str, request: Request, who: Identity | None = Depends(identity)
) -> Response:
    """A file at a revision (branch, tag or commit id); a plain ``def``, so its index queries and
    a replica's fetch of a blob from the object store run in the threadpool, not on the loop."""
    del rest  # parsed from the raw path below
    store = store_of(request)
    segments = raw_segments(request, 3)
    if len(segments) < 2:
        raise BadRequest("expected /{org}/{name}/resolve/{revision}/{path}")
    repo = readable_repo(store, org, name, who)
    revision, path = validate_revision(segments[0]), validate_path("/".join(segments[1:]))
    commit = store.resolve(repo.repo_id, revision)
    entry = store.file(repo.repo_id, commit, path)
    headers = {
        "ETag": f'"{etag(entry)}"',
        "X-Repo-Commit": commit,
        "Accept-Ranges": "bytes",
        # a private file is for its readers' caches only, never a shared one's
        "Cache-Control": ("private" if repo.private else "public")
        + (", max-age=31536000, immutable" if revision == commit else ", no-cache"),
        "Vary": "Authorization",
    }
    if _not_modified(request, headers["ETag"]):
        return Response(status_code=304, headers=headers)
    if entry.lfs:
        headers["X-Linked-Size"] = str(entry.size)
        remote = store.blobs.remote
        if remote is not None:
            headers.update({"X-Linked-Etag": headers["ETag"], "Cache-Control": NO_STORE})
            return RedirectResponse(
                remote.presign_get(blob_key(entry.sha256), _media_type(path)),
                status_code=302,
                headers=headers,
            )
    return BlobResponse(
        store.blob_path(entry), headers=headers, filename=None, media_type=_media_type(path)
    )


def _etags(header: str) -> set[str]:
    """The entity tags a conditional header lists, weak ones (``W/``) compared as strong."""
    return {tag.strip().removeprefix("W/") for tag in header.split(",")}


def _not_modified(request: Request, tag: str) -> bool:
    """Whether ``If-None-Match`` names the file (a 304); PreconditionFailed where ``If-Match``
    names none of it."""
    wanted = request.headers.get("if-match")
    if wanted is not None and not {"*", tag} & _etags(wanted):
        raise PreconditionFailed(f"If-Match {wanted} does not name this file, whose ETag is {tag}")
    cached = request.headers.get("if-none-match")
    return cached is not None and bool({"*", tag} & _etags(cached))


class BlobResponse(FileResponse):
    """A blob sent in 1 MiB reads (Starlette's 64 KiB cost a third of the throughput), with a
    bad or unsatisfiable ``Range`` answered in the service's error shape."""

    chunk_size = CHUNK

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        try:
            return super()._parse_range_header(http_range, file_size)
        except starlette_responses.MalformedRangeHeader as err:
            raise BadRequest(f"Range {http_range!r}: {err.content}") from None
        except starlette_responses.RangeNotSatisfiable:
            raise RangeNotSatisfiable(
                f"Range {http_range!r} starts past the file's end (it holds {file_size:,} bytes)",
                headers={"Content-Range": f"bytes */{file_size}"},
            ) from None


def _media_type(path: str) -> str:
    if path.endswith(".md"):
        return "text/markdown; charset=utf-8"
    if path.endswith(".json"):
        return "application/json"
    if path.endswith(".png"):
        return "image/png"
    return "application/octet-stream"
