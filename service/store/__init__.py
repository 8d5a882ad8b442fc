"""The hub store: content-addressed blobs, uploads awaiting their commit (Git LFS and Xet),
and an index of repos, commits and refs. Errors are :mod:`service.store.errors` (no HTTP)."""

from .blobs import BlobStore, FileDigest, hash_file
from .errors import (
    Conflict,
    InvalidRequest,
    NoSuchEntry,
    NoSuchRepo,
    NoSuchRevision,
    PublishRefused,
    SignatureRefused,
    StoreError,
    TooLarge,
    UploadMissing,
)
from .store import (
    AddFile,
    AddObject,
    CommitRecord,
    DeleteFile,
    DeleteFolder,
    FileEntry,
    HubStore,
    RepoRecord,
    SignatureRecord,
)

__all__ = [
    "AddFile",
    "AddObject",
    "BlobStore",
    "CommitRecord",
    "Conflict",
    "DeleteFile",
    "DeleteFolder",
    "FileDigest",
    "FileEntry",
    "HubStore",
    "InvalidRequest",
    "NoSuchEntry",
    "NoSuchRepo",
    "NoSuchRevision",
    "PublishRefused",
    "RepoRecord",
    "SignatureRecord",
    "SignatureRefused",
    "StoreError",
    "TooLarge",
    "UploadMissing",
    "hash_file",
]
