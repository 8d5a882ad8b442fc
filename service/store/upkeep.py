"""The store's upkeep, run by an operator (``vip-hub store gc``, ``vip-hub store check``): the
collection of objects no commit names, and a check of where the index and the stored objects
disagree, with the repairs that are safe.

Nothing a commit names is ever removed: blobs are collected under the index's exclusive
collection lock, which every commit holds shared from reading its objects to its index
transaction, so a blob no commit names at that moment cannot be about to be named, and only
once older than the grace period (``hub.gc_grace_s``). Uploads, staged uploads, upload
records, temp files and xorbs go by their own time-to-live (``HubStore.collect_uploads``): an
upload that an upload record still names stays, whatever its age.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from . import clock
from .blobs import BlobStore, hash_file, listed_files, sharded_name
from .errors import CorruptObject
from .s3 import CHECKING, STAGING, Listed
from .store import HubStore

__all__ = ["Collected", "Finding", "check_store", "collect_garbage"]


@dataclass(frozen=True)
class Collected:
    """What one collection removed: ``uploads`` (uploads, staged uploads, upload records, temp
    files, xorbs and notes of who sent them, each past its time-to-live) and ``blobs`` (no
    commit names them, older than the grace period); ``young``: blobs no commit names, kept
    until they are that old."""

    uploads: int
    blobs: list[str]
    young: int


def collect_garbage(store: HubStore, grace: float) -> Collected:
    """Remove what ``Collected`` says: nothing a commit names, nothing an upload in flight may
    still name, no blob younger than ``grace`` seconds."""
    uploads = store.collect_uploads()
    gone, young = _collect_blobs(store, grace)
    return Collected(uploads, gone, young)


def _collect_blobs(store: HubStore, grace: float) -> tuple[list[str], int]:
    """Remove the blobs no commit names older than ``grace`` seconds (with an object store, in
    its bucket and this process's cache); returns them, and how many younger ones stay."""
    listed = list(_every_blob(store.blobs))  # before the lock: a bucket's listing is slow
    with store.index.collection_lock(exclusive=True):
        named, now = _named(store), clock.now()
        orphans = {b.key: b.mtime for b in listed if b.key not in named}
        gone = sorted(
            sha
            for sha, mtime in orphans.items()
            # stored again since it was listed (by a commit that then failed): its grace
            # counts from then, and the upload it came from is gone
            if now - mtime > grace and now - (store.blobs.stored_at(sha) or mtime) > grace
        )
        for sha256 in gone:
            store.blobs.remove_blob(sha256)
    return gone, len(orphans) - len(gone)


def _every_blob(blobs: BlobStore) -> Iterator[Listed]:
    """The blobs held; with an object store, also those only this process's cache holds."""
    seen = set()
    for blob in blobs.listed_blobs():
        seen.add(blob.key)
        yield blob
    if blobs.remote is not None:
        yield from (b for b in listed_files(blobs.dir, sharded_name) if b.key not in seen)


def _named(store: HubStore) -> set[str]:
    """Every object a commit names."""
    return {r["sha256"] for r in store.index.rows("SELECT DISTINCT sha256 FROM files")}


@dataclass(frozen=True)
class Finding:
    """One place where the index and the store disagree, or an object the check reports:
    ``kind`` (missing, corrupt, orphan, staged), the object, what is wrong, and what became of
    it (``repaired``; else ``note`` says why not). ``problem``: it still needs an operator (an
    upload in flight or a blob within its grace period does not)."""

    kind: str
    what: str
    detail: str
    note: str
    repaired: bool = False
    problem: bool = True

    def line(self) -> str:
        state = "repaired" if self.repaired else ("PROBLEM" if self.problem else "ok")
        return f"{self.kind}\t{self.what}\t{self.detail}\t{state}: {self.note}"


def check_store(store: HubStore, repair: bool, grace: float) -> list[Finding]:
    """Compare every object the index names with the bytes the store holds (each hashed), hash
    every upload awaiting its commit, orphaned blob and xorb too, and report staged uploads.
    With ``repair``: restore a missing or corrupt blob from a checked copy (this process's
    cache, an upload of the same bytes), remove corrupt copies no commit names (uploads,
    orphaned blobs, caches, xorbs), collect what ``collect_garbage`` would; never remove what a
    commit names."""
    blobs = store.blobs
    rows = store.index.rows(
        "SELECT f.sha256, f.size, f.path, f.commit_sha, r.org, r.name FROM files f "
        "JOIN commits c ON c.sha = f.commit_sha JOIN repos r ON r.id = c.repo"
    )
    named: dict[str, tuple[int, str]] = {}
    for r in rows:
        named.setdefault(
            r["sha256"], (r["size"], f"{r['org']}/{r['name']}@{r['commit_sha'][:12]}:{r['path']}")
        )
    held = {b.key: b for b in blobs.listed_blobs()}
    checked = [
        _check_named(blobs, sha, size, where, held.get(sha), repair)
        for sha, (size, where) in sorted(named.items())
    ]
    found = [f for f in checked if f is not None]
    if blobs.remote is not None:
        found += _check_cache(blobs, repair)
    found += _check_uploads(store, repair)
    found += _check_xorbs(store, repair)
    orphans = sorted(set(held) - set(named))
    wrong = {s: actual for s in orphans if (actual := blobs.stored_sha256(s)) not in (s, None)}
    found += _wrong_orphans(store, wrong, repair)
    gone = set(_collect_blobs(store, grace)[0]) if repair else set()
    now = clock.now()
    for sha in (o for o in orphans if o not in wrong):
        old = now - held[sha].mtime > grace
        found.append(
            Finding(
                "orphan",
                sha,
                f"{held[sha].size} bytes, no commit names it",
                "removed"
                if sha in gone
                else (
                    "older than hub.gc_grace_s: `vip-hub store gc` or --repair removes it"
                    if old
                    else "kept within hub.gc_grace_s (a failed or crashed commit's)"
                ),
                repaired=sha in gone,
                problem=old and sha not in gone,
            )
        )
    return found


def _check_named(
    blobs: BlobStore, sha: str, size: int, where: str, held: Listed | None, repair: bool
) -> Finding | None:
    """A blob a commit names (``where``: the first): held, with its bytes and size?"""
    if held is None:
        kind, detail = "missing", f"named by {where}, not held"
    else:
        actual = blobs.stored_sha256(sha)
        if actual == sha and held.size == size:
            return None
        kind = "corrupt"
        detail = f"named by {where} ({size} bytes): holds {held.size} bytes of SHA-256 {actual}"
    good = blobs.good_copy(sha) if repair else None
    if good is not None:
        blobs.restore(sha, good)
        return Finding(kind, sha, detail, "restored from a checked copy", repaired=True)
    return Finding(
        kind,
        sha,
        detail,
        "cannot repair (kept: a commit names it): no checked copy of its bytes is held; "
        "put them among the uploads (uploads/sha256/<2 digits>/<the rest>, in the bucket or "
        "the folder; a missing one: upload it again to the repo, no commit needed), then "
        "run check --repair"
        if repair
        else "--repair restores it if a checked copy is held (kept: a commit names it)",
    )


def _wrong_orphans(store: HubStore, wrong: dict[str, str], repair: bool) -> list[Finding]:
    """Blobs no commit names whose bytes are not their name (``wrong``: what they hash to); with
    ``repair`` removed, under the collection lock once no commit names them still."""
    removed: set[str] = set()
    if repair and wrong:
        with store.index.collection_lock(exclusive=True):
            named = _named(store)
            for sha in wrong:
                if sha not in named and store.blobs.stored_sha256(sha) != sha:
                    store.blobs.remove_blob(sha)
                    removed.add(sha)
    return [
        Finding(
            "corrupt",
            f"orphan:{sha}",
            f"no commit names it, and it holds SHA-256 {actual}",
            "removed" if sha in removed else "--repair removes it",
            repaired=sha in removed,
        )
        for sha, actual in sorted(wrong.items())
    ]


def _check_cache(blobs: BlobStore, repair: bool) -> list[Finding]:
    """With an object store: copies of blobs and uploads in this process's cache whose bytes
    are not their name."""
    found = []
    for folder, path_of in ((blobs.dir, blobs.path), (blobs.uploads, blobs.upload_path)):
        for b in listed_files(folder, sharded_name):
            actual = hash_file(path_of(b.key)).sha256
            if actual != b.key:
                if repair:
                    path_of(b.key).unlink(missing_ok=True)
                found.append(
                    Finding(
                        "corrupt",
                        f"cache:{b.key}",
                        f"the cached copy holds SHA-256 {actual}",
                        "removed (the bucket's copy is read again)"
                        if repair
                        else "--repair removes it",
                        repaired=repair,
                    )
                )
    return found


def _check_uploads(store: HubStore, repair: bool) -> list[Finding]:
    """Uploads awaiting their commit whose bytes are not their name (with an object store: in
    its bucket; removed with ``repair``: no commit names an upload), and objects staged by
    clients' presigned PUTs (unchecked) or left by a check of one that stopped midway."""
    blobs, found, now = store.blobs, [], clock.now()
    for u in list(blobs.listed_uploads()):
        actual = blobs.stored_sha256(u.key, upload=True)
        if actual not in (u.key, None):  # None: committed or collected since it was listed
            if repair:
                blobs.remove_upload(u.key)
            found.append(
                Finding(
                    "corrupt",
                    f"upload:{u.key}",
                    f"holds SHA-256 {actual}",
                    "removed: upload it again" if repair else "--repair removes it",
                    repaired=repair,
                )
            )
    if blobs.remote is not None:
        listed = [*blobs.remote.listed(STAGING), *blobs.remote.listed(CHECKING)]
        for o in listed:
            age, stale = now - o.mtime, now - o.mtime > store.limits.upload_ttl_s
            note = "an upload in flight (younger than hub.upload_ttl_s)"
            if stale:
                note = "abandoned: " + ("removed" if repair else "`vip-hub store gc` removes it")
            found.append(
                Finding(
                    "staged",
                    o.key,
                    f"{o.size} bytes, {age:.0f} s old",
                    note,
                    repaired=stale and repair,
                    problem=stale and not repair,
                )
            )
    if repair:
        store.collect_uploads()
    return found


def _check_xorbs(store: HubStore, repair: bool) -> list[Finding]:
    """Xorbs whose chunks do not hash to their name (no commit names a xorb: removed with
    ``repair``; a client that needs it uploads it again)."""
    found = []
    for xorb in store.xet.listed():
        try:
            store.xet.check(xorb)
        except FileNotFoundError:  # collected since it was listed
            continue
        except CorruptObject as e:
            if repair:
                store.xet.remove(xorb)
            note = (
                "removed: a client that needs it uploads it again"
                if repair
                else "--repair removes it"
            )
            found.append(Finding("corrupt", f"xorb:{xorb}", str(e), note, repaired=repair))
    return found
