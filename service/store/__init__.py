"""The hub store: content-addressed blobs, uploads awaiting their commit (Git LFS and Xet),
and an index of repos, commits and refs. Errors are :mod:`service.store.errors` (no HTTP)."""

from .blobs import BlobStore, FileDigest, hash_file
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
    "DeleteFile",
    "DeleteFolder",
    "FileDigest",
    "FileEntry",
    "HubStore",
    "RepoRecord",
    "SignatureRecord",
    "hash_file",
]
