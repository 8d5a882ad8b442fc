"""The embedded hub store: content-addressed blobs plus a SQLite index of repos, commits
and refs. Replicas on one machine (or a shared filesystem with working locks) can share it."""

from .blobs import BlobStore, FileDigest, hash_file
from .store import AddFile, CommitRecord, DeleteFile, DeleteFolder, FileEntry, HubStore, RepoRecord

__all__ = [
    "AddFile",
    "BlobStore",
    "CommitRecord",
    "DeleteFile",
    "DeleteFolder",
    "FileDigest",
    "FileEntry",
    "HubStore",
    "RepoRecord",
    "hash_file",
]
