"""Content-addressed blobs: each file's bytes stored once, under its SHA-256, read-only.

Beside them, ``uploads/`` holds objects received ahead of a commit (Git LFS PUTs, files
rebuilt from Xet shards), also by SHA-256: a commit that names one moves it into the blobs;
one never committed is removed after the upload time-to-live. ``uploads/for/`` notes which
repo each object was uploaded for: a commit names only objects uploaded for its own repo (or
already in its history). ``tmp/`` holds files being written. All live on one filesystem, so
every move is an atomic rename, fsynced with any folder made for it (``replace_durably``).
Everything is created owner-only (folders 0700, files 0600, blobs 0400): private repos' bytes
are not for the machine's other users.

With an object store (:mod:`service.store.s3`) the bucket is where blobs, checked uploads and
upload records live, under the same names, each written there before any commit may name it;
the folder is this process's cache of what it read or wrote (fetched on first use, checked
against its SHA-256). Clients upload to per-upload staging keys, which
:meth:`BlobStore.receive_staged` copies to a key no client can write before hashing the copy.

The rule every path keeps: an object under a content key (``uploads/sha256/X``,
``blobs/sha256/X``) is bytes this hub hashed as X, written there by the hub after the hash.
Nothing is skipped because the bucket already holds an object of that name: what a name holds
is never trusted, so each upload writes its checked bytes over it (which also makes an upload of
bytes another repo holds cost exactly what one of new bytes does: no existence oracle).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from vip_hub.paths import make_private_dir, open_private, replace_durably
from vip_hub.repo.artifacts import CHUNK, file_sha256, git_blob_hasher
from vip_hub.repo_format import is_weights_file

from . import clock
from .errors import (
    CorruptObject,
    InvalidRequest,
    StoreUnavailable,
    UploadMismatch,
    UploadMissing,
)
from .faults import crash_point
from .s3 import (
    BLOBS,
    CHECKING,
    MULTIPART,
    RECORDS,
    STAGING,
    UPLOADS,
    Listed,
    S3Objects,
    blob_key,
    checking_key,
    staging_key,
    upload_key,
)

__all__ = [
    "BlobStore",
    "DigestWriter",
    "FileDigest",
    "inline_digest",
    "hash_file",
    "is_lfs",
    "listed_files",
    "remove_older_than",
    "sharded_name",
]

STALE_TMP_SECONDS = 24 * 3600
UPLOAD_LINK = ".upload"  # the suffix of a commit's link to an upload in ``tmp/``
SHA256_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class FileDigest:
    """What the protocol needs to know of a file: SHA-256, git blob SHA-1, size."""

    sha256: str
    git_oid: str
    size: int


def hash_file(path: Path) -> FileDigest:
    """SHA-256 and git blob SHA-1 of a file, in one pass."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    sha1 = git_blob_hasher(size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha256.update(chunk)
            sha1.update(chunk)
    return FileDigest(sha256.hexdigest(), sha1.hexdigest(), size)


def lfs_digest(sha256: str, size: int) -> FileDigest:
    """The digest of an object received the LFS way: its git id is that of its LFS pointer
    file, as git (and the Hugging Face Hub) record such a file."""
    pointer = (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    )
    git_oid = git_blob_hasher(len(pointer))
    git_oid.update(pointer)
    return FileDigest(sha256, git_oid.hexdigest(), size)


LFS_THRESHOLD = 10 * 1024 * 1024
"""Files above this size (and every weights file) travel and are served as LFS objects."""


def is_lfs(path: str, size: int) -> bool:
    """Whether a file is uploaded and served the LFS way (ETag = SHA-256): weights and anything
    large."""
    return is_weights_file(path) or size > LFS_THRESHOLD


def inline_digest(path: str, source: Path) -> FileDigest:
    """The digest a commit records for a file sent inline as ``path``: stored the LFS way (its
    git id its pointer's) where ``is_lfs`` says a client should have uploaded it so."""
    digest = hash_file(source)
    return lfs_digest(digest.sha256, digest.size) if is_lfs(path, digest.size) else digest


def check_sha256(oid: str) -> str:
    """``oid`` if it is 64 lowercase hex digits, else InvalidRequest."""
    if len(oid) != 64 or not SHA256_HEX.issuperset(oid):
        raise InvalidRequest(
            f"invalid object id {oid!r}: expected a SHA-256 as 64 lowercase hex digits"
        )
    return oid


class DigestWriter:
    """A temp file written piece by piece and hashed while it is written (bounded memory).
    ``close()`` returns its digest; ``discard()`` removes it."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open_private(path)
        self._sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray) -> None:  # a request body comes in bytearrays
        self._file.write(data)
        self._sha256.update(data)
        self.size += len(data)
        crash_point("upload-partial")

    def close(self) -> str:
        """Flush to disk; the SHA-256 of what was written."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._sha256.hexdigest()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class Markers:
    """Empty records that ``who`` did something with ``name`` (an upload received for a repo,
    a xorb sent by a user): ``<sha256(who)[:32]>/<name>`` in ``folder``, or with ``remote``
    under ``prefix`` in its bucket, where every replica sees them. Noting one again refreshes
    its age, by which the uploads' collection removes it."""

    def __init__(self, folder: Path, remote: S3Objects | None, prefix: str):
        self.folder, self.remote, self.prefix = folder, remote, prefix
        make_private_dir(folder)

    @staticmethod
    def _name(who: str, name: str) -> str:
        return f"{hashlib.sha256(who.encode()).hexdigest()[:32]}/{name}"

    def path(self, who: str, name: str) -> Path:
        """The record's file in the folder (what it is without an object store)."""
        return self.folder / self._name(who, name)

    def note(self, who: str, name: str) -> None:
        """Record (again: its age refreshed) that ``who`` did it with ``name``."""
        if self.remote is not None:
            self.remote.put_bytes(self.prefix + self._name(who, name), b"")
            return
        marker = self.path(who, name)
        make_private_dir(marker.parent)
        open_private(marker).close()

    def forget(self, who: str, name: str) -> None:
        """Drop that record, if there is one."""
        if self.remote is not None:
            self.remote.delete(self.prefix + self._name(who, name))
        else:
            self.path(who, name).unlink(missing_ok=True)

    def holds(self, who: str, name: str) -> bool:
        """Whether that record is there (younger than the collection's age)."""
        if self.remote is not None:
            return self.remote.size(self.prefix + self._name(who, name)) is not None
        return self.path(who, name).is_file()


class BlobStore:
    """``root/blobs/sha256/ab/cdef...``, uploads in ``root/uploads/sha256/ab/...``, temp files in
    ``root/tmp``; with ``remote``, blobs and uploads in its bucket, the folder caching them."""

    def __init__(self, root: Path, remote: S3Objects | None = None):
        self.remote = remote
        self.dir = root / "blobs" / "sha256"
        self.uploads = root / "uploads" / "sha256"
        self.tmp = root / "tmp"
        for d in (self.dir, self.uploads, self.tmp):
            make_private_dir(d)
        self.upload_records = Markers(root / "uploads" / "for", remote, RECORDS)

    def path(self, sha256: str) -> Path:
        return self.dir / sha256[:2] / sha256[2:]

    def local(self, sha256: str) -> Path:
        """The blob ``sha256`` as a local file (with an object store: fetched into the cache on
        first use)."""
        path = self.path(sha256)
        if self.remote is None or path.is_file():
            return path
        try:
            fetched = self._fetch(blob_key(sha256), sha256)
        except FileNotFoundError:
            raise CorruptObject(
                f"the object store holds no blob {sha256}, which a commit names: the hub's storage "
                "is corrupt (its operator's `vip-hub store check --repair` reports it)"
            ) from None
        return self._place(fetched, path, sha256)

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def new_temp(self, suffix: str = "") -> Path:
        """A fresh path in the store's temp area (same filesystem, so renames are atomic)."""
        return self.tmp / f"{uuid.uuid4().hex}{suffix}"

    def writer(self) -> DigestWriter:
        """A hashing writer onto a fresh temp file."""
        return DigestWriter(self.new_temp(".part"))

    # ------------------------------------------------------------------ uploads
    def upload_path(self, sha256: str) -> Path:
        return self.uploads / sha256[:2] / sha256[2:]

    def object_path(self, sha256: str) -> Path | None:
        """Where the object ``sha256`` lies (a blob, or an upload awaiting its commit), else
        None."""
        for path in (self.path(check_sha256(sha256)), self.upload_path(sha256)):
            if path.is_file():
                return path
        return None

    def object_size(self, sha256: str) -> int | None:
        """The size of a held object, None when it is not held (with an object store: in its
        bucket, whatever this cache holds; the uploads first, so that right after an upload the
        answer costs the same whether or not a commit already named the object)."""
        if self.remote is not None:
            size = self.remote.size(upload_key(check_sha256(sha256)))
            return self.remote.size(blob_key(sha256)) if size is None else size
        path = self.object_path(sha256)
        try:
            return path.stat().st_size if path else None
        except FileNotFoundError:  # committed (moved) or collected meanwhile
            return None

    def stage_upload(self, tmp: Path, sha256: str) -> Path:
        """Move a fully written and checked temp file into the uploads area, durably (with an
        object store: into its bucket first, over whatever the bucket held under that name)."""
        if self.remote is not None:
            self.remote.put_file(tmp, upload_key(sha256))
        return self._stage_local(tmp, sha256)

    def _stage_local(self, tmp: Path, sha256: str) -> Path:
        target = self.upload_path(sha256)
        replace_durably(tmp, target)
        return target

    def receive_staged(self, upload_id: str, sha256: str, size: int) -> None:
        """Check what a client PUT to the staging key ``upload_id`` through a presigned URL: the
        store copies it to a key no client can write, the hub hashes that copy, then copies it
        to its upload key (over whatever that key held) and keeps it in its cache; bytes that
        are not object ``sha256`` of ``size`` bytes are UploadMismatch. The store calls are the
        same whether or not the bucket holds the object. The staged object is removed either
        way, unless the store stopped answering (then it stays for a retry, and goes with the
        uploads' collection if none comes)."""
        assert self.remote is not None
        staged, checking = staging_key(upload_id), checking_key(uuid.uuid4().hex)
        try:
            try:  # from this copy on, nothing the client writes changes what is hashed
                if self.remote.size(staged) != size:
                    raise FileNotFoundError(staged)
                self.remote.copy(staged, checking)
            except FileNotFoundError:
                raise UploadMismatch(
                    f"the staged upload is not object {sha256} of {size} bytes "
                    "(missing, or another size): upload it again"
                ) from None
            try:
                tmp = self._fetch(checking, sha256, size, sent=True)
                self.remote.copy(checking, upload_key(sha256))
            finally:
                self.remote.delete(checking)
            self._stage_local(tmp, sha256)
        except StoreUnavailable:
            raise
        except BaseException:
            self.remote.delete(staged)
            raise
        self.remote.delete(staged)

    def _fetch(self, key: str, sha256: str, limit: int | None = None, sent: bool = False) -> Path:
        """``key`` of the object store downloaded to a temp file, if its SHA-256 is ``sha256``;
        else UploadMismatch for bytes a client ``sent`` (the copy of a staged upload), and
        CorruptObject for a content key (the hub hashed what it wrote there: the store's
        fault)."""
        assert self.remote is not None
        writer = self.writer()
        try:
            self.remote.read_into(key, writer.write, limit)
        except BaseException:
            writer.discard()
            raise
        got = writer.close()
        if got != sha256:
            writer.path.unlink(missing_ok=True)
            if sent:
                raise UploadMismatch(f"{key} holds bytes of SHA-256 {got}, not object {sha256}")
            raise CorruptObject(  # (its actual hash is not told: it could name another's bytes)
                f"the object store's {key} does not hold object {sha256}: the hub's storage is "
                "corrupt (its operator's `vip-hub store check --repair` reports and repairs it)"
            )
        return writer.path

    def note_upload(self, repo_id: str, sha256: str) -> None:
        """Record that object ``sha256`` was received (its bytes checked) for ``repo_id`` (with
        an object store, in its bucket, so that any replica sees it); a record already there
        has its age refreshed."""
        self.upload_records.note(repo_id, check_sha256(sha256))

    def forget_upload(self, repo_id: str, sha256: str) -> None:
        """Drop the record of ``note_upload`` (the object is in the repo's history now)."""
        self.upload_records.forget(repo_id, check_sha256(sha256))

    def was_uploaded_for(self, repo_id: str, sha256: str) -> bool:
        """Whether object ``sha256`` was received for ``repo_id`` within the upload time-to-live."""
        return self.upload_records.holds(repo_id, check_sha256(sha256))

    def committed_source(self, sha256: str) -> Path:
        """The file a commit's ``lfsFile`` line names (with an object store: fetched into the
        cache), or UploadMissing. An upload is shared by every repo it was uploaded for, and the
        first commit to store it moves it into the blobs: a commit gets its own hard link to it
        in ``tmp/`` instead (which ``ingest`` consumes; the caller removes it otherwise), so
        that another repo's commit takes nothing from under it."""
        upload = self.upload_path(check_sha256(sha256))  # fresh bytes before stored ones,
        path = upload if upload.is_file() else self.object_path(sha256)  # which may have rotted
        if path is None and self.remote is not None:
            # the blob key again: a commit elsewhere may move the upload there meanwhile
            for key in (blob_key(sha256), upload_key(sha256), blob_key(sha256)):
                try:
                    path = self._stage_local(self._fetch(key, sha256), sha256)
                    break
                except FileNotFoundError:
                    continue
        if path is None:
            raise UploadMissing(
                f"object {sha256} was never uploaded for this repo (or its upload expired): upload "
                "it first (preupload, then the LFS batch API or Xet), then commit"
            )
        if path != self.upload_path(sha256):
            return path  # a blob: never moved, nor collected while a commit may name it
        link = self.new_temp(UPLOAD_LINK)
        try:
            os.link(path, link)
        except FileNotFoundError:
            if path.exists():
                raise
            # moved into the blobs (or collected) meanwhile: look again, once
            blob = self.object_path(sha256)
            if blob is None or blob == path:
                raise UploadMissing(
                    f"object {sha256}: its upload went while it was committed"
                ) from None
            return blob
        except OSError:  # a filesystem without hard links: a copy the commit owns
            shutil.copyfile(path, link)
        return link

    # ------------------------------------------------------------------ ingest
    def ingest(self, source: Path, digest: FileDigest) -> Path:
        """Move a temp or upload file into place, durably, once it hashes to ``digest``'s
        SHA-256 again (CorruptObject otherwise: it rotted since it was checked). With an object
        store it is sent to its bucket first, over whatever the bucket held under that name
        (bytes planted or rotted there, the upload's key included, are never copied), unless it
        is this cache's copy of a blob the bucket holds, which is left as it is. An upload of
        the object is consumed either way: one sent again for an object already stored does not
        wait for the uploads' collection."""
        sha256, upload, remote = digest.sha256, self.upload_path(digest.sha256), self.remote
        key = blob_key(sha256)
        cached = source == self.path(sha256)  # this cache's copy: kept if the bucket holds it
        if not (remote is not None and cached and remote.size(key) is not None):
            if file_sha256(source) != f"sha256:{sha256}":
                raise CorruptObject(
                    f"the hub's copy of object {sha256} no longer holds its bytes: the hub's "
                    "storage is corrupt (its operator's `vip-hub store check --repair` repairs "
                    "it), then upload it again"
                )
            if remote is not None:
                remote.put_file(source, key)
        if remote is not None:
            remote.delete(upload_key(sha256))
        placed = self._place(source, self.path(sha256), sha256)
        upload.unlink(missing_ok=True)
        return placed

    def _place(self, source: Path, target: Path, sha256: str) -> Path:
        """Move a checked file to its blob path ``target``, durably, read-only, over what was
        there unless that still hashes to ``sha256`` (bytes stored earlier may have rotted, the
        checked ones may not; sound ones stay, the inode the snapshots link). Its time is now, so
        the collection's grace for it counts from its storing."""
        if source == target:
            return target
        if target.is_file() and file_sha256(target) == f"sha256:{sha256}":
            source.unlink(missing_ok=True)
            os.utime(target)
            return target
        with open(source, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(source, 0o400)
        replace_durably(source, target)
        os.utime(target)
        return target

    def clean_stale(
        self, temp_age: float = STALE_TMP_SECONDS, upload_age: float = STALE_TMP_SECONDS
    ) -> int:
        """Remove temp files left by crashed requests, upload records older than
        ``upload_age``, then uploads and staged objects older than it that no remaining record
        names (so nothing an upload in flight may still name is touched), in the object store
        too. Returns how many went."""
        # a commit's link to an upload has the upload's age: it is as old as its link(2) (ctime)
        removed = remove_older_than(self.tmp, temp_age, keep=lambda p: _fresh_link(p, temp_age))
        for folder in self.tmp.iterdir():  # a killed request's own (mkdtemp), emptied above
            with contextlib.suppress(OSError):  # not empty, or gone
                if folder.is_dir() and clock.now() - folder.stat().st_mtime > temp_age:
                    folder.rmdir()
        if self.remote is None:
            removed += remove_older_than(self.upload_records.folder, upload_age)
            named = {p.name for p in self.upload_records.folder.rglob("*") if p.is_file()}
        else:
            try:
                removed += self.remote.remove_older_than(RECORDS, upload_age)
                named = {o.key.rsplit("/", 1)[1] for o in self.remote.listed(RECORDS)}
                removed += self.remote.remove_older_than(
                    UPLOADS + "sha256/", upload_age, keep=lambda key: sharded_name(key) in named
                )
                removed += self.remote.remove_older_than(STAGING, upload_age)
                removed += self.remote.remove_older_than(CHECKING, upload_age)
                for prefix in MULTIPART:  # the hub's own too: one an outage cut stays
                    removed += self.remote.abort_older_than(prefix, upload_age)
            except StoreUnavailable:  # collected at a later call
                return removed
        return removed + remove_older_than(
            self.uploads, upload_age, keep=lambda p: sharded_name(p) in named
        )

    def clean_unreserved_staging(self, reserved: Callable[[], Collection[str]]) -> int:
        """Remove the staged objects whose upload no reservation names any more: what a client
        PUT through its presigned URL after its verify (the URL stays valid for its lifetime) or
        after its reservation expired, which its user's staging quota no longer counts.
        ``reserved()`` (the upload ids reserved) is read after the listing, so an upload
        reserved meanwhile, whose URL was handed out after, keeps its object. Returns how many
        went."""
        if self.remote is None:
            return 0
        try:
            staged = [o.key for o in self.remote.listed(STAGING)]
            kept = {staging_key(upload_id) for upload_id in reserved()}
            gone = [key for key in staged if key not in kept]
            self.remote.delete_many(gone)
        except StoreUnavailable:  # collected at a later call
            return 0
        return len(gone)

    # ------------------------------------------------------------------ upkeep
    def listed_blobs(self) -> Iterator[Listed]:
        """Every blob held (with an object store: in its bucket), keyed by SHA-256."""
        return self._listed(BLOBS, self.dir)

    def listed_uploads(self) -> Iterator[Listed]:
        """Every upload awaiting its commit (with an object store: in its bucket), keyed by
        SHA-256."""
        return self._listed(UPLOADS + "sha256/", self.uploads)

    def _listed(self, prefix: str, folder: Path) -> Iterator[Listed]:
        """The sharded objects under ``prefix`` in the bucket, else the files in ``folder``."""
        if self.remote is not None:
            for o in self.remote.listed(prefix):
                yield Listed(sharded_name(o.key), o.size, o.mtime)
        else:
            yield from listed_files(folder, sharded_name)

    def stored_sha256(self, sha256: str, upload: bool = False) -> str | None:
        """The SHA-256 of the bytes held as blob ``sha256`` (``upload``: as the upload of that
        name; with an object store: in its bucket), None when none are."""
        if self.remote is None:
            path = (self.upload_path if upload else self.path)(check_sha256(sha256))
            try:
                return hash_file(path).sha256
            except FileNotFoundError:
                return None
        key = (upload_key if upload else blob_key)(sha256)
        digest = hashlib.sha256()
        try:
            self.remote.read_into(key, digest.update, None)
        except FileNotFoundError:
            return None
        return digest.hexdigest()

    def remove_upload(self, sha256: str) -> None:
        """Delete the upload ``sha256`` (with an object store: from its bucket, then this
        cache); for one whose bytes are not its name (no commit names an upload)."""
        if self.remote is not None:
            self.remote.delete(upload_key(sha256))
        self.upload_path(check_sha256(sha256)).unlink(missing_ok=True)

    def good_copy(self, sha256: str) -> Path | None:
        """A local file holding object ``sha256``'s bytes, checked, from anywhere but the blob
        itself: this process's cache of it (with an object store), or an upload of it (in the
        folder, or fetched from the bucket); None when there is none."""
        places = [self.upload_path(check_sha256(sha256))]
        if self.remote is not None:
            places.insert(0, self.path(sha256))
        for path in places:
            with contextlib.suppress(FileNotFoundError):
                if hash_file(path).sha256 == sha256:
                    return path
        if self.remote is not None and self.remote.size(upload_key(sha256)) is not None:
            with contextlib.suppress(CorruptObject):
                return self._fetch(upload_key(sha256), sha256)
        return None

    def restore(self, sha256: str, good: Path) -> None:
        """Put the checked file ``good`` (``good_copy``) in place of blob ``sha256``, whatever
        is held there now (with an object store: in its bucket, then its cache)."""
        if self.remote is not None:
            self.remote.put_file(good, blob_key(sha256))
        target = self.path(sha256)
        if good != target:
            self._place(good, target, sha256)  # over it: never absent to a reader

    def stored_at(self, sha256: str) -> float | None:
        """When blob ``sha256`` was last stored (with an object store: in its bucket, or in this
        cache where only the cache holds it), None when it is held nowhere."""
        if self.remote is not None and (held := self.remote.stat(blob_key(sha256))) is not None:
            return held.mtime
        try:
            return self.path(check_sha256(sha256)).stat().st_mtime
        except FileNotFoundError:
            return None

    def remove_blob(self, sha256: str) -> None:
        """Delete blob ``sha256`` (with an object store: from its bucket, then this cache). Only
        for one no commit names: the caller holds the index's collection lock."""
        if self.remote is not None:
            self.remote.delete(blob_key(sha256))
        self.path(check_sha256(sha256)).unlink(missing_ok=True)


def sharded_name(name: str | Path) -> str:
    """The hash a path or key sharded by its first two digits (``.../ab/cdef...``) names."""
    parts = str(name).rsplit("/", 2)
    return parts[-2] + parts[-1]


def listed_files(folder: Path, name: Callable[[Path], str]) -> Iterator[Listed]:
    """The files below ``folder``, each named by ``name`` of its path (one that vanishes while
    listed is skipped)."""
    for p in folder.rglob("*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.is_file():
            yield Listed(name(p), st.st_size, st.st_mtime)


def _fresh_link(path: Path, max_age: float) -> bool:
    """Whether ``path`` is a commit's link to an upload (``committed_source``) made within
    ``max_age`` seconds."""
    return path.suffix == UPLOAD_LINK and clock.now() - path.stat().st_ctime <= max_age


def remove_older_than(
    folder: Path, max_age: float, keep: Callable[[Path], bool] = lambda path: False
) -> int:
    """Remove the files below ``folder`` last modified more than ``max_age`` seconds ago, but
    those ``keep`` says to keep (one that vanishes meanwhile is skipped); returns how many went."""
    now, removed = clock.now(), 0
    for p in folder.rglob("*"):
        try:
            if p.is_file() and now - p.stat().st_mtime > max_age and not keep(p):
                p.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed
