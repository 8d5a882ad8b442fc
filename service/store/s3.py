"""Blobs in an S3-compatible object store (boto3, SigV4), for hubs whose bytes outgrow one disk.

Keys in the bucket mirror the store folder: ``blobs/sha256/ab/cdef...`` (content a commit
names), ``uploads/sha256/ab/...`` (objects whose bytes the hub checked, awaiting their commit),
``uploads/for/<repo hash>/<sha256>`` (upload records: which repo each was received for),
``xet/xorbs/<hash>`` and ``xet/owners/<user hash>/<hash>`` (Xet xorbs and who sent each), and
``staging/<upload id>`` (what a client PUT through a presigned URL, unchecked: a SigV4
presigned PUT does not sign the body, and stays valid for its lifetime, so the client may write
that key again at any time until then), and ``checking/<id>`` (the store's own copy of a staged
object, which the hub hashes: no URL names it, so nothing a client does changes what is hashed).
Clients only ever get presigned URLs for a staging key (PUT, its length signed, for each part
too) or a blob key (GET). Any failure to reach the store is :class:`StoreUnavailable`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from vip_hub.repo.artifacts import CHUNK

from ..settings import ObjectStoreSettings
from . import clock
from .errors import InvalidRequest, StoreUnavailable, TooLarge

__all__ = [
    "BLOBS",
    "BLOB_TYPE",
    "CHECKING",
    "MULTIPART",
    "RECORDS",
    "STAGING",
    "UPLOADS",
    "XORBS",
    "XORB_OWNERS",
    "Listed",
    "S3Objects",
    "blob_key",
    "checking_key",
    "staging_key",
    "upload_key",
]

_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
_BAD_PARTS = frozenset({"InvalidPart", "InvalidPartOrder", "NoSuchUpload", "EntityTooSmall"})
NO_STORE = "private, no-store"
"""Cache-Control of everything a presigned URL reaches or names: for the caller alone, not
kept (the URL is a short-lived bearer credential)."""
BLOB_TYPE = "application/octet-stream"
"""The Content-Type every object is stored with: what an uploader's presigned PUT sent (it signs
the length only, so any header) is replaced by each copy, never kept."""


BLOBS = "blobs/sha256/"
UPLOADS = "uploads/"
RECORDS = "uploads/for/"
"""Upload records: ``uploads/for/<repo hash>/<sha256>``, empty, one per object and repo."""
STAGING = "staging/"
CHECKING = "checking/"
"""The store's copies of staged objects while the hub hashes them: keys no client can write."""
XORBS = "xet/xorbs/"
XORB_OWNERS = "xet/owners/"
"""Who sent each xorb: ``xet/owners/<user hash>/<xorb>``, empty, rewritten at each use."""
MULTIPART = (STAGING, CHECKING, UPLOADS + "sha256/", BLOBS, XORBS)
"""Where multipart uploads begin: clients' presigned parts (``staging/``), and the hub's own
uploads and copies over ``object_store.multipart_chunk_bytes`` (checked copies, uploads, blobs,
xorbs). One cut by the store's outage stays when boto3's own abort fails too: the uploads'
collection aborts those begun more than ``hub.upload_ttl_s`` ago."""


@dataclass(frozen=True)
class Listed:
    """One object of a listing: its key (or path below the listed folder), size and age."""

    key: str
    size: int
    mtime: float


def blob_key(sha256: str) -> str:
    """A stored blob's object key (by its SHA-256)."""
    return f"{BLOBS}{sha256[:2]}/{sha256[2:]}"


def upload_key(sha256: str) -> str:
    """An LFS upload's object key before its commit (by its SHA-256)."""
    return f"{UPLOADS}sha256/{sha256[:2]}/{sha256[2:]}"


def staging_key(upload_id: str) -> str:
    """The key a client's presigned upload ``upload_id`` is staged at."""
    return f"{STAGING}{upload_id}"


def checking_key(name: str) -> str:
    """The key a staged object is copied to while the hub hashes it (no client can write it)."""
    return f"{CHECKING}{name}"


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Turn the store failing (no connection, time-out, an error answer other than "no such
    key", such as a 5xx or credentials it refuses) into StoreUnavailable."""
    try:
        yield
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in _NOT_FOUND:
            raise
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        raise StoreUnavailable(f"the object store failed ({status} {code}); try again") from None
    except BotoCoreError as e:  # connection refused or reset, time-out
        raise StoreUnavailable(
            f"the object store does not answer ({type(e).__name__}); try again"
        ) from None


class S3Objects:
    """One bucket of an S3-compatible store: the hub's own client, and a second one that only
    signs URLs for the public endpoint clients reach."""

    def __init__(self, settings: ObjectStoreSettings):
        assert settings.endpoint is not None
        self.bucket, self.ttl = settings.bucket, settings.presign_ttl_s
        self.chunk = settings.multipart_chunk_bytes
        self._transfer = TransferConfig(
            multipart_chunksize=self.chunk, multipart_threshold=self.chunk
        )
        config = Config(
            signature_version="s3v4",
            region_name=settings.region,
            s3={"addressing_style": settings.addressing_style},
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
        )
        session = boto3.session.Session()  # credentials: boto3's environment and config files
        self._client = session.client("s3", endpoint_url=settings.endpoint, config=config)
        self._signer = session.client(
            "s3", endpoint_url=settings.public_endpoint or settings.endpoint, config=config
        )

    def presign_put(self, key: str, size: int, ttl: float) -> str:
        """A URL that PUTs ``size`` bytes (the length is signed) to ``key`` for ``ttl`` seconds
        at most (``object_store.presign_ttl_s`` where shorter)."""
        return self._signer.generate_presigned_url(
            "put_object",
            Params={"Bucket": self.bucket, "Key": key, "ContentLength": size},
            ExpiresIn=self.expiry(ttl),
        )

    def expiry(self, ttl: float) -> int:
        """A presigned URL's lifetime: ``ttl`` or ``presign_ttl_s``, the shorter, whole seconds."""
        return max(1, int(min(self.ttl, ttl)))

    def presign_parts(self, key: str, size: int, ttl: float) -> tuple[str, list[str]]:
        """A multipart upload to ``key`` begun for ``size`` bytes: its id, and a URL that PUTs
        each part of ``self.chunk`` bytes (the last one shorter), in order, its length signed,
        for ``ttl`` seconds at most (as ``presign_put``)."""
        with _reachable():
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=key)[
                "UploadId"
            ]
        urls = [
            self._signer.generate_presigned_url(
                "upload_part",
                Params={
                    "Bucket": self.bucket,
                    "Key": key,
                    "UploadId": upload_id,
                    "PartNumber": number,
                    "ContentLength": min(self.chunk, size - (number - 1) * self.chunk),
                },
                ExpiresIn=self.expiry(ttl),
            )
            for number in range(1, -(-size // self.chunk) + 1)
        ]
        return upload_id, urls

    def complete_parts(self, key: str, upload_id: str, etags: list[str]) -> None:
        """Join the parts of a multipart upload (part ``n`` is ``etags[n - 1]``) into ``key``."""
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, 1)]
        with _reachable():
            try:
                self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                if code in _BAD_PARTS:
                    raise InvalidRequest(
                        f"the parts sent do not complete the upload ({code}): upload it again"
                    ) from None
                raise

    def presign_get(self, key: str, media_type: str = BLOB_TYPE) -> str:
        """A short-lived URL that GETs ``key``, answered as not for shared caches, as
        ``media_type`` (the hub's type for the file's path), unencoded, and to be saved unless an
        image, whatever headers the object was stored with: a store's origin never runs a
        publisher's bytes as a page."""
        disposition = "inline" if media_type.startswith("image/") else "attachment"
        return self._signer.generate_presigned_url(
            "get_object",
            Params={
                "Bucket": self.bucket,
                "Key": key,
                "ResponseCacheControl": NO_STORE,
                "ResponseContentType": media_type,
                "ResponseContentDisposition": disposition,
                "ResponseContentEncoding": "identity",
            },
            ExpiresIn=self.ttl,
        )

    def size(self, key: str) -> int | None:
        """The size of ``key``, None when the bucket does not hold it."""
        held = self.stat(key)
        return None if held is None else held.size

    def stat(self, key: str) -> Listed | None:
        """``key`` as a listing names it (its size and time), None when the bucket does not
        hold it."""
        with _reachable():
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in _NOT_FOUND:
                    return None
                raise
        return Listed(key, int(head["ContentLength"]), head["LastModified"].timestamp())

    def read_into(self, key: str, write: Callable[[bytes], None], limit: int | None) -> None:
        """Stream ``key`` into ``write`` in pieces; TooLarge past ``limit`` bytes (if any),
        FileNotFoundError when the bucket does not hold it (removed since it was seen, say)."""
        got = 0
        with _reachable():
            try:
                body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in _NOT_FOUND:
                    raise FileNotFoundError(key) from None
                raise
            with contextlib.closing(body):
                for chunk in body.iter_chunks(CHUNK):
                    got += len(chunk)
                    if limit is not None and got > limit:
                        raise TooLarge(f"{key} holds more than the {limit} bytes announced")
                    write(chunk)

    def put_file(self, path: Path, key: str) -> None:
        """Upload a local file to ``key`` (multipart when large), as ``BLOB_TYPE`` (the store
        never guesses a type from the bytes)."""
        with _reachable():
            try:
                self._client.upload_file(
                    str(path),
                    self.bucket,
                    key,
                    ExtraArgs={"ContentType": BLOB_TYPE},
                    Config=self._transfer,
                )
            except S3UploadFailedError as e:  # boto3's wrapping of the store's error answer
                if isinstance(e.__context__, ClientError):
                    raise e.__context__ from None
                raise

    def copy(self, source: str, key: str) -> None:
        """Copy ``source`` to ``key`` inside the store (multipart when large), replacing what
        ``key`` held, its headers ``BLOB_TYPE``'s, not ``source``'s; FileNotFoundError when the
        bucket does not hold ``source``."""
        with _reachable():
            try:
                self._client.copy(
                    {"Bucket": self.bucket, "Key": source},
                    self.bucket,
                    key,
                    ExtraArgs={"MetadataDirective": "REPLACE", "ContentType": BLOB_TYPE},
                    Config=self._transfer,
                )
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in _NOT_FOUND:
                    raise FileNotFoundError(source) from None
                raise

    def delete(self, key: str) -> None:
        with _reachable():
            self._client.delete_object(Bucket=self.bucket, Key=key)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object (a record) whole; one already there is replaced (its age
        refreshed)."""
        with _reachable():
            self._client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def listed(self, prefix: str) -> Iterator[Listed]:
        """Every object under ``prefix``, page by page."""
        with _reachable():
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for o in page.get("Contents", []):
                    yield Listed(o["Key"], int(o["Size"]), o["LastModified"].timestamp())

    def delete_many(self, keys: list[str]) -> None:
        """Delete ``keys`` (a thousand per request, the S3 limit)."""
        with _reachable():
            for i in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})

    def remove_older_than(
        self, prefix: str, max_age: float, keep: Callable[[str], bool] = lambda key: False
    ) -> int:
        """Remove the objects under ``prefix`` last modified more than ``max_age`` seconds
        ago, but those ``keep`` says to keep; returns how many went."""
        now = clock.now()
        old = [o.key for o in self.listed(prefix) if now - o.mtime > max_age and not keep(o.key)]
        self.delete_many(old)
        return len(old)

    def abort_older_than(self, prefix: str, max_age: float) -> int:
        """Abort the multipart uploads to keys under ``prefix`` begun more than ``max_age``
        seconds ago (their parts go with them); returns how many."""
        aborted, now = 0, clock.now()
        with _reachable():
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if now - upload["Initiated"].timestamp() > max_age:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        return aborted
