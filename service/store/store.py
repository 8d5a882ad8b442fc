"""The hub store: repos, immutable commits, branches and tags over content-addressed blobs.

A commit is written in this order, so a crash at any point leaves the previous revision
intact and nothing half-visible: (1) uploaded files sit in ``tmp/`` or ``uploads/``; (2) the
would-be tree is verified (``vip_hub.verify_repo``); (3) new blobs are fsynced and renamed
into place, the rename and any folder made for it fsynced in their parents; (4) one index
transaction inserts the commit and its tree and moves the ref, but only if the ref still
points at the parent the tree was built on (a compare-and-swap).
Publishes to one repo are serialised by the index's per-repo lock, so history stays linear.
The index is SQLite in the store, or PostgreSQL for several hosts (``service.store.index``).
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vip_hub.errors import LedgerError, SignatureError
from vip_hub.paths import fsync_dir, make_private_dir, replace_dir
from vip_hub.privacy.accounting import is_weak_delta
from vip_hub.privacy.ledger import PrivacyLedger, PrivacySummary, privacy_headline
from vip_hub.repo.card import load_card
from vip_hub.repo.signing import PublicKey, verify_signature
from vip_hub.repo.verify import VerificationReport, verify_repo
from vip_hub.repo_format import (
    CARD_FILE,
    CARD_LEDGER_KEY,
    CONFIG_BLOCK,
    CONFIG_FILE,
    DEFAULT_BRANCH,
    HEAD_LABELS,
    SIGNATURE_FILE,
    head_file,
    heads_in,
)

from ..settings import TRUSTED_KEYS_DIR, HubSettings, ObjectStoreSettings, Settings
from . import clock
from .blobs import (
    STALE_TMP_SECONDS,
    BlobStore,
    FileDigest,
    check_sha256,
    inline_digest,
    is_lfs,
    lfs_digest,
)
from .errors import (
    Conflict,
    InvalidRequest,
    NoSuchEntry,
    NoSuchRepo,
    NoSuchRevision,
    PublishRefused,
    SignatureRefused,
    TooLarge,
    TooMuchStaged,
    TooMuchUncommitted,
    UploadMissing,
)
from .faults import crash_point
from .index import Index, Row, Transaction, open_index
from .naming import (
    COMMIT_RE,
    RESERVED_NAMESPACES,
    validate_path,
    validate_repo_id,
    validate_revision,
)
from .s3 import S3Objects
from .shared import adopt_store_files, grant_key, trusted_public_keys
from .xet import XetStore, is_xorb_oid, xorb_oid

__all__ = [
    "AddFile",
    "AddObject",
    "CommitRecord",
    "DeleteFile",
    "DeleteFolder",
    "FileEntry",
    "HubStore",
    "RepoRecord",
    "SignatureRecord",
]

_log = logging.getLogger(__name__)

_INDEX_DELTA_KEY = "index_delta"
"""hub_state's key for the delta the index's epsilons are stated at (the hub's ``delta``)."""
_PARTIAL_SNAPSHOT = ".tmp-"
"""The prefix of a snapshot folder being built (``collect_uploads`` removes a killed one's)."""


@dataclass(frozen=True)
class RepoRecord:
    """A repo as the index knows it."""

    repo_id: str
    private: bool
    created_at: str

    @property
    def org(self) -> str:
        return self.repo_id.split("/")[0]


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit's tree."""

    path: str
    sha256: str
    git_oid: str
    size: int

    @property
    def lfs(self) -> bool:
        """Whether it is an LFS file (served with its SHA-256 as ETag): committed as an object
        uploaded ahead (its git id its LFS pointer's), or one ``is_lfs`` says is uploaded so."""
        return (
            is_lfs(self.path, self.size)
            or self.git_oid == lfs_digest(self.sha256, self.size).git_oid
        )


@dataclass(frozen=True)
class CommitRecord:
    """A commit with the index fields taken from its verified ledger, config and card;
    ``epsilon`` is the encoder's at the hub's one ``delta`` (``hub.delta``), not the ledger's."""

    sha: str
    repo_id: str
    parent: str | None
    title: str
    message: str
    author: str
    created_at: str
    arch: str | None
    num_params: int | None
    epsilon: float | None
    delta: float | None
    accountant: str | None
    datasets: list[str] = field(default_factory=list)
    card_data: dict[str, Any] = field(default_factory=dict)

    @property
    def caveat(self) -> str | None:
        """What the encoder's epsilon assumes but its training did not meet
        (``PrivacySummary.caveat``)."""
        ledger = self.card_data.get(CARD_LEDGER_KEY) or {}
        if all(s.get("sampling", "poisson") == "poisson" for s in ledger.get("stages", [])):
            return None  # the common case, without parsing the ledger on every listed row
        try:
            return PrivacyLedger.parse(ledger).summary().caveat
        except LedgerError as e:  # committed before a rule this hub's version added
            return f"its ledger fails this hub's checks ({e})"

    @property
    def weak_delta(self) -> bool:
        """Whether a DP stage of its ledger states a delta above 1/(10n) (flagged on pages)."""
        ledger = self.card_data.get(CARD_LEDGER_KEY) or {}
        return any(
            is_weak_delta(s["delta"], s["dataset"]["size"])
            for s in ledger.get("stages", [])
            if s.get("type") == "dp"
        )


@dataclass(frozen=True)
class SignatureRecord:
    """The hub's attestation, kept in its index beside the commit: it checked the commit's
    signature against its trusted keys, and this key (its name then, and fingerprint) made it."""

    signer: str
    fingerprint: str
    verified_at: str


@dataclass(frozen=True)
class _NewCommit:
    """A verified commit whose blobs are stored, as the index transaction writes it."""

    sha: str
    parent: str | None
    title: str
    message: str
    author: str
    created: str
    meta: dict[str, Any]  # the config's CONFIG_BLOCK
    summary: PrivacySummary
    card_data: dict[str, Any]
    files: dict[str, FileEntry]
    dp_datasets: list[str]  # the datasets of every DP stage, any component's
    signer: PublicKey | None


@dataclass(frozen=True)
class AddFile:
    """Commit operation: add or replace ``path`` with the content of the temp file ``source``."""

    path: str
    source: Path


@dataclass(frozen=True)
class AddObject:
    """Commit operation: add or replace ``path`` with an object uploaded ahead (Git LFS or Xet),
    named by its SHA-256."""

    path: str
    sha256: str
    size: int | None = None
    """The size the commit line claims, checked against the object's (None: not claimed)."""


@dataclass(frozen=True)
class DeleteFile:
    path: str


@dataclass(frozen=True)
class DeleteFolder:
    path: str


Operation = AddFile | AddObject | DeleteFile | DeleteFolder


@dataclass(frozen=True)
class Reservation:
    """What ``HubStore.reserve_uploads`` counted (each object's expiry), the earlier counts it
    renewed (size, expiry) and the objects it replaces; as a context manager, undone if its
    block raises."""

    store: HubStore = field(repr=False)
    account: str
    repo_id: str
    counted: dict[str, float]
    renewed: dict[str, tuple[int, float]]
    replacing: tuple[str, ...]

    def _rows(self) -> contextlib.AbstractContextManager[Transaction]:
        return self.store.index.transaction(locks=[f"pending:{self.account}"])

    def done(self) -> None:
        """What it counted was kept: the counts of the objects it replaces go."""
        with self._rows() as tx:
            for oid in self.replacing:
                tx.execute(
                    "DELETE FROM pending_uploads WHERE account = ? AND oid = ?",
                    (self.account, oid),
                )

    def undo(self, keep: Collection[str] = ()) -> None:
        """Drop the counts of the objects not in ``keep`` (not uploaded after all), a renewed
        one back to its earlier count; a row a later reservation renewed, or a commit released,
        since is left as it is. The objects it replaces keep their counts."""
        with self._rows() as tx:
            for oid, expires in self.counted.items():
                if oid in keep:
                    continue
                key = (self.account, self.repo_id, oid, expires)
                if oid in self.renewed:
                    tx.execute(
                        "UPDATE pending_uploads SET size = ?, expires_at = ? WHERE account = ? "
                        "AND repo_id = ? AND oid = ? AND expires_at = ?",
                        (*self.renewed[oid], *key),
                    )
                else:
                    tx.execute(
                        "DELETE FROM pending_uploads WHERE account = ? AND repo_id = ? AND "
                        "oid = ? AND expires_at = ?",
                        key,
                    )

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None:
            self.undo()


class HubStore:
    """Read and write API of the store rooted at ``root`` (created on first use). What replicas
    must share lives in the index (``shared``): ``trusted_keys`` names only a single-host
    store's key folder, adopted into the index at the first start."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        index: str | None = None,
        trusted_keys: str | os.PathLike[str] | None = None,
        limits: HubSettings | None = None,
        objects: ObjectStoreSettings | None = None,
        restate: bool = True,
    ):
        self.root = Path(root).resolve()
        self.limits = limits or HubSettings()  # its limits, time-outs and signature rule
        self.trusted_keys = (
            Path(trusted_keys) if trusted_keys is not None else self.root / TRUSTED_KEYS_DIR
        )
        make_private_dir(self.root)
        with contextlib.suppress(PermissionError):  # a store made before it was owner-only
            os.chmod(self.root, 0o700)
        # blobs in an object store when ``objects`` names one, else in the folder
        self.blobs = BlobStore(
            self.root, S3Objects(objects) if objects and objects.endpoint else None
        )
        self.xet = XetStore(self.root, self.blobs)
        self._collected = time.monotonic()
        self._secret = b""
        make_private_dir(self.root / "snapshots")
        self.index: Index = open_index(index, self.root)
        adopt_store_files(self.index, self.root, self.trusted_keys)
        if restate:  # a server; the operator's commands leave the index at its delta
            self._restate_epsilons()
        self.collect_uploads()

    @classmethod
    def from_settings(cls, settings: Settings, restate: bool = True) -> HubStore:
        """The store the service's settings describe (folder, index, limits, object store);
        ``restate``: its index stated at their ``hub.delta`` (a server's, not a command's)."""
        return cls(
            settings.store,
            index=settings.index,
            trusted_keys=settings.hub.trusted_keys,
            limits=settings.hub,
            objects=settings.object_store,
            restate=restate,
        )

    def _restate_epsilons(self) -> None:
        """Recompute every indexed commit's epsilon and delta at the hub's delta when the index
        was stated at another one (a store indexed before the hub fixed one delta, or under
        another ``delta`` setting); the delta the index is stated at is kept in ``hub_state``,
        and a commit states its row at it (``_index_delta``). The collection lock, which every
        commit holds shared, is held exclusively: no row is written meanwhile at the old delta,
        as a replica not yet restarted with the new one would."""
        stated_at = repr(self.limits.delta)
        if self.index.state(_INDEX_DELTA_KEY)[0] == stated_at:
            return
        with self.index.collection_lock(exclusive=True):
            for row in self.index.rows("SELECT sha, card_data FROM commits WHERE delta > 0"):
                ledger = json.loads(row["card_data"]).get(CARD_LEDGER_KEY)
                try:
                    summary = PrivacyLedger.parse(ledger).summary(delta=self.limits.delta)
                except LedgerError as e:  # committed before a rule this hub's version added
                    _log.warning("commit %s keeps its indexed epsilon: %s", row["sha"], e)
                    continue
                self.index.execute(
                    "UPDATE commits SET epsilon = ?, delta = ? WHERE sha = ?",
                    [summary.epsilon, summary.delta, row["sha"]],
                )
            self.index.update_state(_INDEX_DELTA_KEY, lambda _: stated_at)

    def _index_delta(self) -> float:
        """The delta the index's rows are stated at (a replica restarted with another one may
        have restated them since this one opened), else this hub's."""
        stated = self.index.state(_INDEX_DELTA_KEY)[0]
        return float(stated) if stated is not None else self.limits.delta

    def close(self) -> None:
        """Release the index's connections (a PostgreSQL pool's threads): the store's last use."""
        self.index.close()

    def __enter__(self) -> HubStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def collect_uploads(self) -> int:
        """Remove uploads never committed older than the upload time-to-live (staged ones with
        their share of their user's staging quota), staged objects no reservation counts any
        more (sent again after their verify), xorbs unused for the Xet time-to-live, and temp
        files left by crashed requests; returns how many went."""
        now = clock.now()
        self.index.execute("DELETE FROM staged_uploads WHERE expires_at < ?", (now,))
        self.index.execute("DELETE FROM pending_uploads WHERE expires_at < ?", (now,))
        for partial in (self.root / "snapshots").glob(f"*/*/{_PARTIAL_SNAPSHOT}*"):
            with contextlib.suppress(OSError):  # a killed snapshot's build, of a day ago
                if now - partial.stat().st_mtime > STALE_TMP_SECONDS:
                    shutil.rmtree(partial)
        unreserved = self.blobs.clean_unreserved_staging(
            lambda: [r["id"] for r in self.index.rows("SELECT id FROM staged_uploads")]
        )
        return (
            unreserved
            + self.blobs.clean_stale(upload_age=self.limits.upload_ttl_s)
            + self.xet.clean_stale(self.limits.xet_ttl_s)
        )

    def reserve_staging(self, account: str, upload_id: str, size: int, limit: int) -> None:
        """Count a presigned upload of ``size`` bytes against ``account``'s staging quota until
        ``release_staging`` (its verify) or its collection after the upload time-to-live;
        TooMuchStaged when the account's unverified uploads would then pass ``limit`` bytes."""
        now = clock.now()
        with self.index.repo_lock(f"staging:{account}"), self.index.transaction() as tx:
            tx.execute(
                "DELETE FROM staged_uploads WHERE account = ? AND expires_at < ?", (account, now)
            )
            row = tx.row(
                "SELECT COALESCE(SUM(size), 0) AS held FROM staged_uploads WHERE account = ?",
                (account,),
            )
            held = int(row["held"]) if row else 0
            if held + size > limit:
                raise TooMuchStaged(
                    f"{account} holds {held} bytes of presigned uploads not yet verified; "
                    f"{size} more would pass the limit of {limit} (object_store.max_staged_bytes): "
                    "verify those first, or wait for them to expire"
                )
            tx.execute(
                "INSERT INTO staged_uploads (id, account, size, expires_at) VALUES (?, ?, ?, ?)",
                (upload_id, account, size, now + self.limits.upload_ttl_s),
            )

    def reserve_uploads(
        self,
        account: str,
        repo_id: str,
        objects: Sequence[tuple[str, int]],
        replacing: Sequence[str] = (),
    ) -> Reservation:
        """Count ``objects`` (SHA-256 or ``xorb_oid``, size) that ``account`` is about to upload
        for ``repo_id`` against its bytes received and not yet committed, until a commit names
        each or it expires (``_count_ttl``), in place of the counts of ``replacing`` (objects of
        the account's, of any repo, that these are made from: their counts go at
        ``Reservation.done``); TooMuchUncommitted, changing no count, when they would pass
        ``hub.max_uncommitted_bytes``. Asking again for an object renews its count at the larger
        of its two sizes, never adds to it nor lowers it. The returned ``Reservation`` undoes it
        if what it counts is not kept."""
        wanted, now, limit = dict(objects), clock.now(), self.limits.max_uncommitted_bytes
        with self.index.transaction(locks=[f"pending:{account}"]) as tx:
            tx.execute(
                "DELETE FROM pending_uploads WHERE account = ? AND expires_at < ?", (account, now)
            )
            renewed: dict[str, tuple[int, float]] = {}
            for oid in wanted:
                r = tx.row(
                    "SELECT size, expires_at FROM pending_uploads "
                    "WHERE account = ? AND repo_id = ? AND oid = ?",
                    (account, repo_id, oid),
                )
                if r is not None:  # asked again
                    renewed[oid] = (int(r["size"]), float(r["expires_at"]))
                    wanted[oid] = max(wanted[oid], renewed[oid][0])
            replaced = 0
            for oid in set(replacing) - set(wanted):
                r = tx.row(
                    "SELECT COALESCE(SUM(size), 0) AS size FROM pending_uploads "
                    "WHERE account = ? AND oid = ?",
                    (account, oid),
                )
                replaced += int(r["size"]) if r else 0
            row = tx.row(
                "SELECT COALESCE(SUM(size), 0) AS held FROM pending_uploads WHERE account = ?",
                (account,),
            )
            held = (int(row["held"]) if row else 0) - replaced
            held -= sum(size for size, _ in renewed.values())
            size = sum(wanted.values())
            if held + size > limit:  # the transaction, renewals included, is rolled back
                raise TooMuchUncommitted(
                    f"{account} holds {held} bytes uploaded and not yet committed; {size} more "
                    f"would pass the limit of {limit} (hub.max_uncommitted_bytes): commit those "
                    "first, or wait for them to expire"
                )
            counted = {oid: now + self._count_ttl(oid) for oid in wanted}
            for oid, bytes_ in wanted.items():
                if oid in renewed:
                    tx.execute(
                        "UPDATE pending_uploads SET size = ?, expires_at = ? "
                        "WHERE account = ? AND repo_id = ? AND oid = ?",
                        (bytes_, counted[oid], account, repo_id, oid),
                    )
                else:
                    tx.execute(
                        "INSERT INTO pending_uploads (account, repo_id, oid, size, expires_at) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (account, repo_id, oid, bytes_, counted[oid]),
                    )
        return Reservation(self, account, repo_id, counted, renewed, tuple(replacing))

    def _count_ttl(self, oid: str) -> float:
        """How long an uncommitted object counts: a xorb as long as it is kept unused
        (``hub.xet_ttl_s``), anything else until uploads are collected (``hub.upload_ttl_s``)."""
        return self.limits.xet_ttl_s if is_xorb_oid(oid) else self.limits.upload_ttl_s

    def note_upload(self, repo_id: str, sha256: str) -> None:
        """Record that object ``sha256`` was received for ``repo_id`` (``blobs.note_upload``),
        its uploaders' counts of it lasting as long as that record: an LFS object is counted
        from its batch reply, and received up to its grant's lifetime later."""
        self.blobs.note_upload(repo_id, sha256)
        until = clock.now() + self.limits.upload_ttl_s
        self.index.execute(
            "UPDATE pending_uploads SET expires_at = ? "
            "WHERE repo_id = ? AND oid = ? AND expires_at < ?",
            (until, repo_id, sha256, until),
        )

    def release_staging(self, upload_id: str) -> None:
        """Give a staged upload's share of its user's quota back (it was verified or refused)."""
        self.index.execute("DELETE FROM staged_uploads WHERE id = ?", (upload_id,))

    def maybe_collect_uploads(self) -> None:
        """``collect_uploads``, at most once per tenth of the time-to-live (called as uploads
        begin)."""
        now = time.monotonic()
        if now - self._collected > self.limits.upload_ttl_s / 10:
            self._collected = now
            self.collect_uploads()

    def secret(self) -> bytes:
        """The key that signs the short-lived upload grants the hub hands out: kept in the
        index, so every replica sharing it agrees (``shared.grant_key``)."""
        if not self._secret:
            self._secret = grant_key(self.index)
        return self._secret

    # ----------------------------------------------------------------- plumbing
    def _repo_row(self, db: Index | Transaction, repo_id: str) -> Row:
        org, _, name = repo_id.partition("/")
        validate_repo_id(org, name)
        row = db.row("SELECT * FROM repos WHERE org = ? AND name = ?", (org, name))
        if row is None:
            raise NoSuchRepo(f"repository {repo_id} not found")
        return row

    # -------------------------------------------------------------------- repos
    def create_repo(self, repo_id: str, private: bool = False) -> tuple[RepoRecord, bool]:
        """Create ``org/name``; returns (repo, created). An existing repo is returned as is; a
        namespace, or a name in its namespace, that differs from an existing one only by case is a
        Conflict (two names a reader cannot tell apart)."""
        org, _, name = repo_id.partition("/")
        validate_repo_id(org, name)
        if org in RESERVED_NAMESPACES:
            raise InvalidRequest(
                f"no repo can be created under {org}/: the service's own paths use it"
            )
        # every creation in a namespace holds its lock, whatever the spelling asked for (a
        # twin's is refused below): the twin check and the insert are one step
        with self.index.transaction(locks=[f"repo names in {org.casefold()}"]) as tx:
            tx.execute("INSERT INTO namespaces (name) VALUES (?) ON CONFLICT DO NOTHING", (org,))
            held = tx.rows("SELECT name FROM namespaces WHERE lower(name) = lower(?)", (org,))
            if held[0]["name"] != org:
                raise Conflict(
                    f"namespace {org!r} differs only by case from the existing "
                    f"{held[0]['name']!r}: namespaces are unique whatever their case"
                )
            twin = tx.rows(
                "SELECT name FROM repos WHERE org = ? AND lower(name) = lower(?) AND name <> ?",
                (org, name, name),
            )
            if twin:
                raise Conflict(
                    f"repo name {name!r} differs only by case from the existing "
                    f"{org}/{twin[0]['name']}: names in a namespace are unique whatever their case"
                )
            created = tx.execute(
                "INSERT INTO repos (org, name, private, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (org, name) DO NOTHING",
                (org, name, int(private), _now()),
            )
        return self.get_repo(repo_id), created == 1

    def repos_in(self, namespace: str) -> list[str]:
        """The ids of the repos in ``namespace``, in any case (what a new user or organisation
        of that name would own)."""
        rows = self.index.rows(
            "SELECT org, name FROM repos WHERE lower(org) = lower(?) ORDER BY org, name",
            (namespace,),
        )
        return [f"{r['org']}/{r['name']}" for r in rows]

    def get_repo(self, repo_id: str) -> RepoRecord:
        """The repo, or NoSuchRepo."""
        row = self._repo_row(self.index, repo_id)
        return RepoRecord(f"{row['org']}/{row['name']}", bool(row["private"]), row["created_at"])

    # ---------------------------------------------------------------- revisions
    def resolve(self, repo_id: str, revision: str = DEFAULT_BRANCH) -> str:
        """The commit id a branch, tag or full commit id of ``repo_id`` names."""
        validate_revision(revision)
        repo = self._repo_row(self.index, repo_id)
        if COMMIT_RE.match(revision):
            row = self.index.row(
                "SELECT sha FROM commits WHERE sha = ? AND repo = ?", (revision, repo["id"])
            )
        else:
            row = self.index.row(
                "SELECT commit_sha AS sha FROM refs WHERE repo = ? AND name = ? "
                "ORDER BY kind = 'branch' DESC LIMIT 1",
                (repo["id"], revision),
            )
        if row is None:
            raise NoSuchRevision(f"revision {revision!r} not found in {repo_id}")
        return row["sha"]

    def commit_record(self, repo_id: str, commit: str) -> CommitRecord:
        """Metadata of one commit of ``repo_id``."""
        repo = self._repo_row(self.index, repo_id)
        row = self.index.row(
            "SELECT * FROM commits WHERE sha = ? AND repo = ?", (commit, repo["id"])
        )
        if row is None:
            raise NoSuchRevision(f"commit {commit} not found in {repo_id}")
        return _commit_record(repo_id, row)

    def tree(self, repo_id: str, commit: str) -> dict[str, FileEntry]:
        """Every file of a commit, by path."""
        self.commit_record(repo_id, commit)
        rows = self.index.rows(
            "SELECT path, sha256, git_oid, size FROM files WHERE commit_sha = ? ORDER BY path",
            (commit,),
        )
        return {r["path"]: FileEntry(r["path"], r["sha256"], r["git_oid"], r["size"]) for r in rows}

    def file(self, repo_id: str, commit: str, path: str) -> FileEntry:
        """One file of a commit, or NoSuchEntry."""
        validate_path(path)
        entry = self.tree(repo_id, commit).get(path)
        if entry is None:
            raise NoSuchEntry(f"{path} not found in {repo_id} at {commit}", commit)
        return entry

    def blob_path(self, entry: FileEntry) -> Path:
        """A committed file's content as a local file (``BlobStore.local``)."""
        return self.blobs.local(entry.sha256)

    def history(
        self, repo_id: str, revision: str = DEFAULT_BRANCH, limit: int = 100
    ) -> list[CommitRecord]:
        """Commits reachable from ``revision``, newest first."""
        sha: str | None = self.resolve(repo_id, revision)
        out: list[CommitRecord] = []
        while sha and len(out) < limit:
            record = self.commit_record(repo_id, sha)
            out.append(record)
            sha = record.parent
        return out

    def refs(self, repo_id: str) -> dict[str, dict[str, str]]:
        """``{"branch": {name: commit}, "tag": {name: commit}}``."""
        out: dict[str, dict[str, str]] = {"branch": {}, "tag": {}}
        repo = self._repo_row(self.index, repo_id)
        for row in self.index.rows(
            "SELECT kind, name, commit_sha FROM refs WHERE repo = ?", (repo["id"],)
        ):
            out[row["kind"]][row["name"]] = row["commit_sha"]
        return out

    def create_tag(self, repo_id: str, tag: str, revision: str = DEFAULT_BRANCH) -> str:
        """Point a new tag at ``revision``; an existing tag, or a branch's name, is a conflict."""
        return self._new_ref(repo_id, "tag", tag, revision)

    def delete_tag(self, repo_id: str, tag: str) -> None:
        """Remove a tag (the commit it named stays); NoSuchRevision when there is none."""
        self._delete_ref(repo_id, "tag", tag)

    def create_branch(self, repo_id: str, branch: str, revision: str = DEFAULT_BRANCH) -> str:
        """Start a new branch at ``revision``; an existing branch, or a tag's name, is a
        conflict."""
        return self._new_ref(repo_id, "branch", branch, revision)

    def delete_branch(self, repo_id: str, branch: str) -> None:
        """Remove a branch other than the default one (its commits stay); NoSuchRevision when
        there is none."""
        if validate_revision(branch) == DEFAULT_BRANCH:
            raise InvalidRequest(f"cannot delete {branch}: it is the default branch of {repo_id}")
        self._delete_ref(repo_id, "branch", branch)

    def _new_ref(self, repo_id: str, kind: str, name: str, revision: str) -> str:
        """Point a new ``kind`` ref (branch or tag) at ``revision``; the commit. Under the repo's
        lock, so a branch and a tag of one name cannot both be made."""
        validate_revision(name)
        if COMMIT_RE.match(name.lower()):  # in any case: a tool that folds it reads a commit
            raise InvalidRequest(f"{kind} {name!r} looks like a commit id")
        other = "tag" if kind == "branch" else "branch"
        with self.index.repo_lock(repo_id):
            refs = self.refs(repo_id)
            if not refs["branch"]:  # a repo's first commit makes its default branch
                raise NoSuchRevision(
                    f"{repo_id} has no commit yet: commit to {DEFAULT_BRANCH} first, then make "
                    f"a {kind} of a revision"
                )
            if name in refs[other]:
                raise Conflict(
                    f"{name!r} is a {other} of {repo_id}; a {kind} needs a name of its own"
                )
            commit = self.resolve(repo_id, revision)
            repo = self._repo_row(self.index, repo_id)
            if not self.index.execute(
                "INSERT INTO refs (repo, kind, name, commit_sha) VALUES (?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (repo["id"], kind, name, commit),
            ):
                raise Conflict(f"{kind} {name!r} already exists in {repo_id}")
        return commit

    def _delete_ref(self, repo_id: str, kind: str, name: str) -> None:
        """Remove the ``kind`` ref ``name``; NoSuchRevision when there is none."""
        repo = self._repo_row(self.index, repo_id)
        if not self.index.execute(
            "DELETE FROM refs WHERE repo = ? AND kind = ? AND name = ?",
            (repo["id"], kind, validate_revision(name)),
        ):
            raise NoSuchRevision(f"{kind} {name!r} not found in {repo_id}")

    def held_for(self, repo_id: str, sha256: str) -> int | None:
        """The size of object ``sha256`` if a commit to ``repo_id`` may name it (uploaded for this
        repo, or in its history), else None, whether or not another repo holds it."""
        repo = self._repo_row(self.index, repo_id)
        if (
            not self.blobs.was_uploaded_for(repo_id, check_sha256(sha256))
            and self.index.row(
                "SELECT 1 FROM files f JOIN commits c ON c.sha = f.commit_sha "
                "WHERE c.repo = ? AND f.sha256 = ? LIMIT 1",
                (repo["id"], sha256),
            )
            is None
        ):
            return None
        return self.blobs.object_size(sha256)

    # ------------------------------------------------------------------ listing
    def list_models(
        self,
        *,
        search: str | None = None,
        author: str | None = None,
        arch: str | None = None,
        dataset: str | Sequence[str] | None = None,
        max_epsilon: float | None = None,
        include_private: bool | Collection[str] = False,
        sort: str = "updated",
        descending: bool = True,
        limit: int = 100,
        offset: int = 0,
    ) -> list[tuple[RepoRecord, CommitRecord]]:
        """Repos with a default branch, filtered and sorted by the index (no blob is read);
        ``dataset``: a DP stage on that name (or on any of these names); private ones with
        ``include_private`` (True: all; a collection: those of these namespaces)."""
        columns = {
            "updated": "c.created_at",
            "epsilon": "c.epsilon",
            "name": "r.org || '/' || r.name",
            "params": "c.num_params",
            "delta": "c.delta",
            "arch": "c.arch",
        }
        if sort not in columns:
            raise InvalidRequest(f"cannot sort by {sort!r}; choose one of {', '.join(columns)}")
        where = ["f.kind = 'branch'", "f.name = ?"]
        args: list[str | float] = [DEFAULT_BRANCH]  # the SQL's parameters
        if include_private is not True:
            namespaces = sorted(include_private or ())
            where.append(
                f"(r.private = 0 OR r.org IN ({', '.join('?' * len(namespaces)) or 'NULL'}))"
            )
            args.extend(namespaces)
        if search:
            where.append("(r.org || '/' || r.name) LIKE ? ESCAPE '\\'")
            args.append(
                "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            )
        if author:
            where.append("r.org = ?")
            args.append(author)
        if arch:
            where.append("c.arch = ?")
            args.append(arch)
        if dataset:
            names = [dataset] if isinstance(dataset, str) else list(dataset)
            where.append(
                "EXISTS (SELECT 1 FROM commit_datasets d "
                f"WHERE d.commit_sha = c.sha AND d.dataset IN ({', '.join('?' * len(names))}))"
            )
            args.extend(names)
        if max_epsilon is not None:
            where.append("c.epsilon <= ?")
            args.append(max_epsilon)
        order = f"{columns[sort]} {'DESC' if descending else 'ASC'}, r.org, r.name"
        sql = (
            "SELECT r.org, r.name, r.private, r.created_at AS repo_created, c.* FROM repos r "
            "JOIN refs f ON f.repo = r.id JOIN commits c ON c.sha = f.commit_sha "
            f"WHERE {' AND '.join(where)} ORDER BY {order} LIMIT ? OFFSET ?"
        )
        rows = self.index.rows(sql, [*args, limit, offset])
        return [
            (
                RepoRecord(f"{r['org']}/{r['name']}", bool(r["private"]), r["repo_created"]),
                _commit_record(f"{r['org']}/{r['name']}", r),
            )
            for r in rows
        ]

    def public_dataset_names(self) -> list[str]:
        """Every dataset name a DP stage of a public repo's default branch gives, each once (the
        spellings a dataset page gathers; a private repo's names never appear)."""
        rows = self.index.rows(
            "SELECT DISTINCT d.dataset FROM commit_datasets d "
            "JOIN refs f ON f.commit_sha = d.commit_sha JOIN repos r ON r.id = f.repo "
            "WHERE f.kind = 'branch' AND f.name = ? AND r.private = 0 ORDER BY d.dataset",
            [DEFAULT_BRANCH],
        )
        return [r["dataset"] for r in rows]

    # ------------------------------------------------------------------ writing
    def commit(
        self,
        repo_id: str,
        operations: Sequence[Operation],
        *,
        branch: str = DEFAULT_BRANCH,
        parent_commit: str | None = None,
        title: str = "",
        message: str = "",
        author: str = "anonymous",
    ) -> CommitRecord:
        """Apply ``operations`` on top of ``branch`` as one verified, atomic commit.

        Temp files of AddFile operations are consumed (moved into the blob store, or
        deleted when the commit is refused); AddObject uploads move into the blob store when
        the commit is made. Raises PublishRefused when the resulting tree does not verify,
        Conflict when ``parent_commit`` is not the branch head.
        """
        links: list[Path] = []  # this commit's own links to the uploads it names (``_added``)
        try:
            self.index.await_collection()  # not on its repo lock's connection
            with self.index.repo_lock(repo_id), self.index.collection_lock(exclusive=False):
                return self._commit_locked(
                    repo_id, operations, branch, parent_commit, title, message, author, links
                )
        finally:
            for op in operations:
                if isinstance(op, AddFile):
                    op.source.unlink(missing_ok=True)
            for link in links:  # consumed by the blob store when the commit is made
                link.unlink(missing_ok=True)

    def _commit_locked(
        self,
        repo_id: str,
        operations: Sequence[Operation],
        branch: str,
        parent_commit: str | None,
        title: str,
        message: str,
        author: str,
        links: list[Path],
    ) -> CommitRecord:
        """``commit`` under the repo's lock, in the steps and order of the module docstring."""
        head = self._branch_head(repo_id, branch, parent_commit)
        tree = self.tree(repo_id, head) if head else {}
        local, new = self._staged(repo_id, tree, operations, links)
        self._check_limits(local)
        report, signer = self._verified(repo_id, local)
        crash_point("commit-verified")
        ledger = report.ledger
        assert ledger is not None  # a report without problems has read the ledger
        # the encoder's, at the hub's one delta: what the index shows, ranks and filters
        summary = ledger.summary(delta=self._index_delta())
        config = json.loads(local[CONFIG_FILE].read_bytes())
        card_data = load_card(
            local[CARD_FILE].read_text(encoding="utf-8"), limits=self.limits.front_matter()
        ).to_dict()
        files = self._store_blobs(tree, local, new)
        crash_point("commit-blobs-stored")
        claim = privacy_headline(ledger.summary())  # as stated
        message = "\n\n".join(filter(None, [message, f"Privacy: {claim}"]))
        created = _now()
        commit = _NewCommit(
            sha=_commit_id(repo_id, head, files, title, message, author, created),
            parent=head,
            title=title,
            message=message,
            author=author,
            created=created,
            meta=config.get(CONFIG_BLOCK) or {},
            summary=summary,
            card_data=card_data,
            files=files,
            signer=signer,
            dp_datasets=sorted({s.dataset.name for s in ledger.dp_stages()}),
        )
        self._write_index(repo_id, branch, commit)
        crash_point("commit-indexed")
        self._forget_uploads(repo_id, operations)
        return self.commit_record(repo_id, commit.sha)

    def _branch_head(self, repo_id: str, branch: str, parent_commit: str | None) -> str | None:
        """The head of ``branch`` to build on (None: none yet), if ``parent_commit`` is it."""
        validate_revision(branch)
        if COMMIT_RE.match(branch):
            raise InvalidRequest("commits go to a branch, not to a commit id")
        refs = self.refs(repo_id)  # raises NoSuchRepo first
        if branch in refs["tag"]:
            raise InvalidRequest(f"{branch!r} is a tag; commits go to a branch")
        head = refs["branch"].get(branch)
        if branch != DEFAULT_BRANCH and head is None:
            raise NoSuchRevision(f"branch {branch!r} does not exist in {repo_id}")
        if parent_commit is not None and parent_commit != head:
            raise Conflict(
                f"parent commit {parent_commit} is stale: branch {branch} of {repo_id} is at "
                f"{head}; fetch the new revision and commit again"
            )
        return head

    def _staged(
        self,
        repo_id: str,
        tree: dict[str, FileEntry],
        operations: Sequence[Operation],
        links: list[Path],
    ) -> tuple[dict[str, Path], dict[str, tuple[Path, FileDigest]]]:
        """The would-be tree (path -> local file) of ``operations`` on ``tree``; its new files
        (the links to uploads among them noted in ``links``)."""
        local: dict[str, Path] = {p: self.blob_path(e) for p, e in tree.items()}
        new: dict[str, tuple[Path, FileDigest]] = {}
        for op in operations:
            path = validate_path(op.path.rstrip("/") if isinstance(op, DeleteFolder) else op.path)
            if isinstance(op, AddFile | AddObject):  # what a file may hold is verify_repo's rule
                new[path] = self._added(repo_id, op, links)
                local[path] = new[path][0]
            elif isinstance(op, DeleteFile):
                if path not in local:
                    raise NoSuchEntry(f"cannot delete {path}: no such file in {repo_id}")
                local.pop(path)
                new.pop(path, None)
            else:
                prefix = path + "/"
                for p in [p for p in local if p.startswith(prefix)]:
                    local.pop(p)
                    new.pop(p, None)
        return local, new

    def _check_limits(self, local: dict[str, Path]) -> None:
        """TooLarge for a would-be tree over ``hub.max_commit_files`` files, or with a head's
        the heads' labels over ``hub.max_labels_bytes`` (checked before the tree is verified)."""
        if problem := self.limits.commit_files_problem(len(local), "the commit's tree"):
            raise TooLarge(problem)
        for name in heads_in(local):
            labels = local.get(head_file(name, HEAD_LABELS))
            if labels is not None and labels.stat().st_size > self.limits.max_labels_bytes:
                raise TooLarge(
                    f"{head_file(name, HEAD_LABELS)} is {labels.stat().st_size} bytes, over the "
                    f"limit of {self.limits.max_labels_bytes} (hub.max_labels_bytes)"
                )

    def _added(
        self, repo_id: str, op: AddFile | AddObject, links: list[Path]
    ) -> tuple[Path, FileDigest]:
        """The local file an added file's content is in, and its digest."""
        if isinstance(op, AddFile):
            return op.source, inline_digest(op.path, op.source)
        source = self._uploaded_source(repo_id, op.sha256)  # checked as it arrived
        if source != self.blobs.path(op.sha256):  # this commit's link to the upload
            links.append(source)
        size = source.stat().st_size
        if op.size is not None and op.size != size:
            raise InvalidRequest(
                f"{op.path}: the commit says object {op.sha256} holds {op.size:,} bytes; "
                f"the upload holds {size:,}"
            )
        return source, lfs_digest(op.sha256, size)  # an LFS file, whatever its path and size

    def _verified(
        self, repo_id: str, local: dict[str, Path]
    ) -> tuple[VerificationReport, PublicKey | None]:
        """The would-be tree's report and signer; else PublishRefused or SignatureRefused."""
        report = verify_repo(local, front_matter=self.limits.front_matter())
        if not report.ok:
            raise PublishRefused(
                f"refused: {repo_id} does not verify, nothing was stored. "
                + "; ".join(str(p) for p in report.problems)
            )
        return report, self._signer(local)

    def _store_blobs(
        self,
        tree: dict[str, FileEntry],
        local: dict[str, Path],
        new: dict[str, tuple[Path, FileDigest]],
    ) -> dict[str, FileEntry]:
        """Move the ``new`` files into the blob store; the commit's tree (kept and new entries)."""
        files = {p: e for p, e in tree.items() if p in local and p not in new}
        for path, (source, digest) in new.items():
            self.blobs.ingest(source, digest)
            files[path] = FileEntry(path, digest.sha256, digest.git_oid, digest.size)
        return files

    def _write_index(self, repo_id: str, branch: str, commit: _NewCommit) -> None:
        """One index transaction: the commit, its tree, datasets, signature and the branch move."""
        summary = commit.summary
        with self.index.transaction() as tx:
            repo_row = self._repo_row(tx, repo_id)
            tx.execute(
                "INSERT INTO commits (sha, repo, parent, title, message, author, created_at, arch, "
                "num_params, epsilon, delta, accountant, datasets, card_data) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    commit.sha,
                    repo_row["id"],
                    commit.parent,
                    commit.title,
                    commit.message,
                    commit.author,
                    commit.created,
                    commit.meta.get("arch"),
                    commit.meta.get("num_params"),
                    summary.epsilon,
                    summary.delta,
                    summary.accountant.value if summary.accountant else None,
                    json.dumps(list(summary.datasets)),
                    json.dumps(commit.card_data, default=str),
                ),
            )
            tx.executemany(
                "INSERT INTO files (commit_sha, path, sha256, git_oid, size) "
                "VALUES (?, ?, ?, ?, ?)",
                [(commit.sha, e.path, e.sha256, e.git_oid, e.size) for e in commit.files.values()],
            )
            tx.executemany(
                # any component's
                "INSERT INTO commit_datasets (commit_sha, dataset) VALUES (?, ?)",
                [(commit.sha, d) for d in commit.dp_datasets],
            )
            if commit.signer is not None:
                tx.execute(
                    "INSERT INTO signatures (commit_sha, signer, fingerprint, verified_at) "
                    "VALUES (?, ?, ?, ?)",
                    (commit.sha, commit.signer.name, commit.signer.fingerprint, commit.created),
                )
            self._move_branch(tx, repo_row["id"], repo_id, branch, commit)

    @staticmethod
    def _move_branch(
        tx: Transaction, repo: Any, repo_id: str, branch: str, commit: _NewCommit
    ) -> None:
        """Move the branch: compare-and-swap from the head the tree was built on, else Conflict."""
        if commit.parent is None:
            moved = tx.execute(
                "INSERT INTO refs (repo, kind, name, commit_sha) "
                "VALUES (?, 'branch', ?, ?) ON CONFLICT DO NOTHING",
                (repo, branch, commit.sha),
            )
        else:
            moved = tx.execute(
                "UPDATE refs SET commit_sha = ? WHERE repo = ? AND kind = 'branch' "
                "AND name = ? AND commit_sha = ?",
                (commit.sha, repo, branch, commit.parent),
            )
        if moved != 1:  # rolls the whole transaction back
            raise Conflict(f"branch {branch} of {repo_id} moved during the commit; try again")

    def _forget_uploads(self, repo_id: str, operations: Sequence[Operation]) -> None:
        """Drop the upload records of the committed objects, and their count against their
        uploaders' quota (``reserve_uploads``): the repo's history holds them now."""
        for op in operations:
            if isinstance(op, AddObject):
                self.blobs.forget_upload(repo_id, op.sha256)
                self.index.execute(
                    "DELETE FROM pending_uploads WHERE repo_id = ? AND oid = ?",
                    (repo_id, op.sha256),
                )

    def _signer(self, files: dict[str, Path]) -> PublicKey | None:
        """The trusted key that signed the would-be tree ``files`` (None: unsigned, where this hub
        accepts that); else SignatureRefused. The trusted keys are read from the index at every
        commit."""
        try:
            with trusted_public_keys(self.index, self.blobs.tmp) as keys:
                signer = verify_signature(files, keys)
        except SignatureError as e:
            raise SignatureRefused(
                "refused, nothing was stored: " + "; ".join(map(str, e.problems))
            ) from None
        if signer is None and self.limits.require_signature:
            raise SignatureRefused(
                f"refused, nothing was stored: this hub accepts signed repos only, and the "
                f"commit has no {SIGNATURE_FILE} (sign it with `vip-hub sign`)"
            )
        return signer

    def signature(self, commit: str) -> SignatureRecord | None:
        """The hub's record of who signed ``commit`` (None: unsigned)."""
        row = self.index.row(
            "SELECT signer, fingerprint, verified_at FROM signatures WHERE commit_sha = ?",
            (commit,),
        )
        return (
            SignatureRecord(row["signer"], row["fingerprint"], row["verified_at"]) if row else None
        )

    def put_xorb(self, repo_id: str, xorb: str, tmp: Path, uploader: str) -> None:
        """Keep the xorb ``tmp`` that ``uploader`` sent under ``repo_id``'s grant
        (``XetStore.put_xorb``) once its hash checks and its bytes are counted against the
        uploader's ``reserve_uploads`` (until a shard rebuilds files from all of it, or the
        Xet time-to-live passes); refused with nothing kept past
        ``hub.max_uncommitted_bytes``."""
        self.xet.put_xorb(
            xorb,
            tmp,
            uploader,
            lambda size: self.reserve_uploads(uploader, repo_id, [(xorb_oid(xorb), size)]),
        )

    def apply_shard(self, repo_id: str, shard: Path, uploader: str) -> list[str]:
        """Rebuild the files of a Xet shard ``uploader`` sent for ``repo_id``
        (``XetStore.apply_shard``, within the hub's limits, those rebuilt counted against the
        uploader's ``reserve_uploads`` in place of the xorbs they read whole, the xorbs they
        read in part counted again for as long as the read keeps them) and note them as
        uploaded for it; returns their SHA-256s."""
        done = self.xet.apply_shard(
            shard,
            uploader,
            lambda sha256: self.held_for(repo_id, sha256) is not None,
            self.limits.max_upload_bytes,
            self.limits.xet_max_expansion,
            lambda files, whole, part: self.reserve_uploads(
                uploader,
                repo_id,
                [*files, *((xorb_oid(x), size) for x, size in part)],
                [xorb_oid(x) for x in whole],
            ),
        )
        for sha256 in done:
            self.note_upload(repo_id, sha256)
        return done

    def _uploaded_source(self, repo_id: str, sha256: str) -> Path:
        """The file an ``lfsFile`` line names, if this repo may name it (``held_for``), else
        UploadMissing."""
        if self.held_for(repo_id, sha256) is None:
            raise UploadMissing(
                f"object {sha256} was never uploaded for {repo_id} (or its upload expired): "
                "upload it first (preupload, then the LFS batch API or Xet), then commit"
            )
        return self.blobs.committed_source(sha256)

    # ---------------------------------------------------------------- inference
    def snapshot_dir(self, repo_id: str, commit: str) -> Path:
        """A read-only folder holding ``commit``'s files (hard links to blobs), made once, and
        made again whole when a blob it links was replaced since (``store check --repair``, a
        verified push over rotted bytes): its old links hold the bytes that were replaced."""
        tree = self.tree(repo_id, commit)
        target = self.root / "snapshots" / repo_id / commit
        if target.is_dir() and all(
            _same_file(target / path, self.blob_path(entry)) for path, entry in tree.items()
        ):
            return target
        tmp = target.parent / f"{_PARTIAL_SNAPSHOT}{uuid.uuid4().hex}"
        try:
            make_private_dir(tmp)
            for path, entry in tree.items():
                dest = tmp / path
                make_private_dir(dest.parent)
                try:
                    os.link(self.blob_path(entry), dest)
                except OSError:  # another filesystem: copy instead
                    shutil.copyfile(self.blob_path(entry), dest)
                    os.chmod(dest, 0o400)
            if target.is_dir():  # stale: exchanged whole, never absent to a reader
                replace_dir(tmp, target)
            else:
                try:
                    os.rename(tmp, target)
                except OSError:
                    if not target.is_dir():  # lost a race to a twin: theirs is identical
                        raise
            fsync_dir(target.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return target


def _same_file(link: Path, blob: Path) -> bool:
    """Whether a snapshot's ``link`` is ``blob`` itself (its hard link), or a copy of it."""
    try:
        if os.path.samefile(link, blob):
            return True
        return link.stat().st_size == blob.stat().st_size and filecmp.cmp(link, blob, False)
    except OSError:
        return False


def _commit_record(repo_id: str, row: Row) -> CommitRecord:
    return CommitRecord(
        sha=row["sha"],
        repo_id=repo_id,
        parent=row["parent"],
        title=row["title"],
        message=row["message"],
        author=row["author"],
        created_at=row["created_at"],
        arch=row["arch"],
        num_params=row["num_params"],
        epsilon=row["epsilon"],
        delta=row["delta"],
        accountant=row["accountant"],
        datasets=json.loads(row["datasets"]),
        card_data=json.loads(row["card_data"]),
    )


def _commit_id(
    repo_id: str,
    parent: str | None,
    files: dict[str, FileEntry],
    title: str,
    message: str,
    author: str,
    created: str,
) -> str:
    # the repo too: commit ids are unique across the hub (``commits.sha``), and two repos' first
    # commits of one tree, by one author, in one millisecond are otherwise the same content
    content = json.dumps(
        {
            "repo": repo_id,
            "parent": parent,
            "tree": sorted((p, e.sha256) for p, e in files.items()),
            "title": title,
            "message": message,
            "author": author,
            "created": created,
        },
        sort_keys=True,
    )
    return hashlib.sha1(content.encode(), usedforsecurity=False).hexdigest()


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
