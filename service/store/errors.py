"""Errors the store raises. They carry no HTTP status: ``service/errors.py`` maps them onto
responses in one place (and the CLI or a library caller reads their messages as they are)."""

from __future__ import annotations

__all__ = [
    "Conflict",
    "CorruptObject",
    "InvalidRequest",
    "NoSuchEntry",
    "NoSuchRepo",
    "NoSuchRevision",
    "PublishRefused",
    "SignatureRefused",
    "StoreError",
    "StoreUnavailable",
    "TooLarge",
    "TooMuchStaged",
    "TooMuchUncommitted",
    "UploadMismatch",
    "UploadMissing",
]


class StoreError(Exception):
    """Base: something the store was asked to do and cannot; the message says why."""


class InvalidRequest(StoreError):
    """A name, path, revision or operation the store does not accept."""


class PublishRefused(InvalidRequest):
    """A commit whose resulting tree does not verify (nothing was stored)."""


class SignatureRefused(PublishRefused):
    """A commit whose signature does not hold, is by a key the hub does not trust, or is
    missing where the hub requires one (nothing was stored)."""


class UploadMissing(InvalidRequest):
    """A commit names an uploaded object (by SHA-256) that the store does not hold."""


class UploadMismatch(InvalidRequest):
    """Uploaded bytes that are not the object announced (another SHA-256 or size): refused and
    removed."""


class NoSuchRepo(StoreError):
    """No repo of that id."""


class NoSuchRevision(StoreError):
    """No branch, tag or commit of that name in the repo."""


class NoSuchEntry(StoreError):
    """No file at that path in the commit (``commit`` says which, so clients can cache the
    absence)."""

    def __init__(self, message: str, commit: str | None = None):
        super().__init__(message)
        self.commit = commit


class Conflict(StoreError):
    """The branch moved (stale parent), or a tag already exists."""


class TooLarge(StoreError):
    """An upload over the configured size limit."""


class TooMuchStaged(StoreError):
    """A user's presigned uploads not yet verified would hold more bytes than their quota
    (``object_store.max_staged_bytes``): verify or wait for some, then ask again."""


class TooMuchUncommitted(StoreError):
    """A user's uploads not yet committed would hold more bytes than their quota
    (``hub.max_uncommitted_bytes``): commit or wait for some, then send again."""


class CorruptObject(StoreError):
    """An object the store holds (a blob, an upload awaiting its commit, a xorb; in the bucket or
    the folder) read back with bytes other than those the hub checked when it wrote them: the
    store's fault, not the request's. ``vip-hub store check`` reports it (``--repair`` repairs
    what is safe)."""


class StoreUnavailable(StoreError):
    """The object store holding the blobs does not answer (nothing was written to the index):
    try again after ``retry_after_s`` seconds."""

    retry_after_s = 10
