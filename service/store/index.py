"""The store's index (repos, commits, trees, refs): one small interface, two backends.

- :class:`SQLiteIndex`, the embedded default: ``STORE/index.sqlite`` (WAL), one connection per
  thread; commits to a repo are serialised by a file lock in ``STORE/locks``.
- :class:`PostgresIndex`, for several hub processes on several hosts sharing one store (the
  blobs on a shared filesystem or in an object store): a connection pool (psycopg 3); commits to
  a repo are serialised by a PostgreSQL advisory lock, which holds across hosts where file locks
  on a network filesystem may not.

SQL is written once, with ``?`` placeholders, in the dialect both accept. The branch move is a
compare-and-swap inside a transaction (``UPDATE refs ... WHERE commit_sha = <parent>``), so even
without the lock no commit is lost or interleaved: a moved branch makes the commit fail.

Beside them, ``hub_state`` holds what every replica must agree on and no replica may keep to
itself (tokens and organisations, the trusted keys, the upload-grant key), each a versioned
value changed by compare-and-swap.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vip_hub.paths import make_private_dir, open_private

__all__ = ["Index", "PostgresIndex", "SQLiteIndex", "open_index"]

Row = Mapping[str, Any]


def _advisory_key(name: str) -> int:
    """The PostgreSQL advisory lock named ``name``: 64 bits of its SHA-256."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


_COLLECTION_KEY = _advisory_key("vip-hub collection")
"""The PostgreSQL advisory lock of ``collection_lock``."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS repos (
    id {id_column},
    org TEXT NOT NULL,
    name TEXT NOT NULL,
    private INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    UNIQUE (org, name)
);
CREATE TABLE IF NOT EXISTS namespaces (
    name TEXT PRIMARY KEY
);
CREATE UNIQUE INDEX IF NOT EXISTS namespaces_any_case ON namespaces (lower(name));
INSERT INTO namespaces (name) SELECT DISTINCT org FROM repos WHERE true ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS commits (
    sha TEXT PRIMARY KEY,
    repo BIGINT NOT NULL REFERENCES repos(id),
    parent TEXT,
    title TEXT NOT NULL,
    message TEXT NOT NULL,
    author TEXT NOT NULL,
    created_at TEXT NOT NULL,
    arch TEXT,
    num_params BIGINT,
    epsilon DOUBLE PRECISION,
    delta DOUBLE PRECISION,
    accountant TEXT,
    datasets TEXT NOT NULL,
    card_data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS files (
    commit_sha TEXT NOT NULL REFERENCES commits(sha),
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    git_oid TEXT NOT NULL,
    size BIGINT NOT NULL,
    PRIMARY KEY (commit_sha, path)
);
CREATE INDEX IF NOT EXISTS files_by_sha256 ON files (sha256);
CREATE TABLE IF NOT EXISTS commit_datasets (
    commit_sha TEXT NOT NULL REFERENCES commits(sha),
    dataset TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS commit_datasets_by_name ON commit_datasets (dataset);
CREATE TABLE IF NOT EXISTS signatures (
    commit_sha TEXT PRIMARY KEY REFERENCES commits(sha),
    signer TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    verified_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS refs (
    repo BIGINT NOT NULL REFERENCES repos(id),
    kind TEXT NOT NULL CHECK (kind IN ('branch', 'tag')),
    name TEXT NOT NULL,
    commit_sha TEXT NOT NULL REFERENCES commits(sha),
    PRIMARY KEY (repo, kind, name)
);
CREATE TABLE IF NOT EXISTS staged_uploads (
    id TEXT PRIMARY KEY,
    account TEXT NOT NULL,
    size BIGINT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS staged_uploads_by_account ON staged_uploads (account);
CREATE TABLE IF NOT EXISTS pending_uploads (
    account TEXT NOT NULL,
    repo_id TEXT NOT NULL,
    oid TEXT NOT NULL,
    size BIGINT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (account, repo_id, oid)
);
CREATE INDEX IF NOT EXISTS pending_uploads_by_object ON pending_uploads (repo_id, oid);
CREATE TABLE IF NOT EXISTS hub_state (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    version BIGINT NOT NULL
);
"""


class Index:
    """What the store needs of its index: reads, writes, a transaction, a per-repo lock."""

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        """All rows of a query (``?`` placeholders)."""
        with self.transaction(read_only=True) as tx:
            return tx.rows(sql, args)

    def row(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        """The first row of a query, or None."""
        found = self.rows(sql, args)
        return found[0] if found else None

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Run one statement in its own transaction; the number of rows it changed."""
        with self.transaction() as tx:
            return tx.execute(sql, args)

    def state(self, key: str) -> tuple[str | None, int]:
        """The hub-wide value ``key`` (tokens, trust list, grant key) and its version; (None, 0)
        while unset."""
        row = self.row("SELECT value, version FROM hub_state WHERE key = ?", (key,))
        return (row["value"], int(row["version"])) if row else (None, 0)

    def update_state(self, key: str, change: Callable[[str | None], str]) -> str:
        """Set ``key`` to ``change(current value)``, retried until no other writer (process or
        host) changed it meanwhile (a compare-and-swap on its version); returns what was set.
        An exception from ``change`` leaves the value as it was."""
        while True:
            value, version = self.state(key)
            new = change(value)
            if version and new == value:
                return new
            with self.transaction() as tx:
                if version == 0:
                    done = tx.execute(
                        "INSERT INTO hub_state (key, value, version) VALUES (?, ?, 1) "
                        "ON CONFLICT (key) DO NOTHING",
                        (key, new),
                    )
                else:
                    done = tx.execute(
                        "UPDATE hub_state SET value = ?, version = version + 1 "
                        "WHERE key = ? AND version = ?",
                        (new, key, version),
                    )
            if done == 1:
                return new

    def initial_state(self, key: str, value: str) -> str:
        """``key``'s value, set to ``value`` first if unset (the first writer wins)."""
        return self.update_state(key, lambda current: value if current is None else current)

    def transaction(
        self, read_only: bool = False, locks: Sequence[str] = ()
    ) -> contextlib.AbstractContextManager[Transaction]:
        """A transaction: committed when the block ends, rolled back when it raises; a write
        transaction holds the named ``locks`` from its start to its end, so that a check and
        the write it allows are one step."""
        raise NotImplementedError

    def repo_lock(self, repo_id: str) -> contextlib.AbstractContextManager[None]:
        """Serialise commits to ``repo_id`` (across processes, and for PostgreSQL across hosts)."""
        raise NotImplementedError

    def collection_lock(self, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """Held shared by every commit while it may name an object its index rows do not name
        yet, exclusive by the collection of blobs no commit names: none goes while a commit
        may be about to name it."""
        raise NotImplementedError

    def await_collection(self) -> None:
        """Return once no collection holds ``collection_lock`` exclusively (a commit's wait for
        one, before it takes its repo's lock); SQLite's file lock needs none."""

    def close(self) -> None:
        """Release the index's shared connections (SQLite's, one per thread, close with their
        threads)."""


class Transaction:
    """Statements inside one transaction."""

    def __init__(self, conn: Any, placeholder: str):
        self._conn, self._placeholder = conn, placeholder

    def _sql(self, sql: str) -> str:
        return sql.replace("?", self._placeholder) if self._placeholder != "?" else sql

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return list(self._conn.execute(self._sql(sql), tuple(args)).fetchall())

    def row(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        found = self.rows(sql, args)
        return found[0] if found else None

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._conn.execute(self._sql(sql), tuple(args)).rowcount

    def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        if args:
            self._conn.cursor().executemany(self._sql(sql), [tuple(a) for a in args])


SQLITE_FILE = "index.sqlite"
"""The embedded index's file in the store folder."""


class SQLiteIndex(Index):
    """``root/index.sqlite`` (owner-only, as its WAL files then are); a connection per thread
    (opened on its first use)."""

    def __init__(self, root: Path):
        self.path = root / SQLITE_FILE
        self.locks = root / "locks"
        make_private_dir(self.locks)
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        self._local = threading.local()
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(_SCHEMA.format(id_column="INTEGER PRIMARY KEY"))

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
        return conn

    @contextlib.contextmanager
    def transaction(
        self, read_only: bool = False, locks: Sequence[str] = ()
    ) -> Iterator[Transaction]:
        """(BEGIN IMMEDIATE excludes every other writer from its start: ``locks`` need nothing
        more.)"""
        conn = self._conn()
        if read_only:  # autocommit reads see the last committed state
            yield Transaction(conn, "?")
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield Transaction(conn, "?")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def repo_lock(self, repo_id: str) -> contextlib.AbstractContextManager[None]:
        return self._flock(hashlib.sha256(repo_id.encode()).hexdigest()[:32], fcntl.LOCK_EX)

    def collection_lock(self, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return self._flock("collection", fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    @contextlib.contextmanager
    def _flock(self, name: str, mode: int) -> Iterator[None]:
        with open_private(self.locks / f"{name}.lock", "ab") as f:
            fcntl.flock(f, mode)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class _NamedLocks:
    """One thread lock per name, kept while a thread holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Hold ``name``'s lock for the block, waiting for it first."""
        with self._guard:
            lock, users = self._locks.get(name, (threading.Lock(), 0))
            self._locks[name] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[name]
                if users == 1:
                    del self._locks[name]
                else:
                    self._locks[name] = (lock, users - 1)


class PostgresIndex(Index):
    """A PostgreSQL database named by a ``postgresql://`` URL; a pool of connections."""

    def __init__(self, url: str, max_connections: int = 16):
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        self.pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            open=True,
            # UTF-8 text whatever the database's encoding (SQL_ASCII would hand over bytes)
            kwargs={"autocommit": True, "row_factory": dict_row, "client_encoding": "utf8"},
        )
        self._local = threading.local()
        self._waits = _NamedLocks()
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(
                "SELECT pg_advisory_xact_lock(0)"
            )  # one replica at a time creates the schema
            conn.execute(
                _SCHEMA.format(id_column="BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
            )

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        """The connection this thread holds a repo lock on (so waiting commits, each holding one,
        cannot starve the lock holder of the pool), else one from the pool."""
        held = getattr(self._local, "conn", None)
        if held is not None:
            yield held
        else:
            with self.pool.connection() as conn:
                yield conn

    @contextlib.contextmanager
    def transaction(
        self, read_only: bool = False, locks: Sequence[str] = ()
    ) -> Iterator[Transaction]:
        """``locks`` are transaction-scoped advisory locks, waited for in this process first
        (as a repo's lock is: without a pooled connection)."""
        if read_only:
            with self._connection() as conn:
                yield Transaction(conn, "%s")
            return
        names = sorted(set(locks))
        with contextlib.ExitStack() as held:
            for name in names:
                held.enter_context(self._waits.hold(name))
            with self._connection() as conn, conn.transaction():
                for name in names:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_advisory_key(name),))
                yield Transaction(conn, "%s")

    @contextlib.contextmanager
    def repo_lock(self, repo_id: str) -> Iterator[None]:
        """The repo's advisory lock, on a pooled connection held until it is released; this
        process's other commits to the repo wait for it without one (each waiting on the
        server would hold a connection, and as many as the pool holds would starve it)."""
        key = _advisory_key(repo_id)
        with self._waits.hold(f"repo {repo_id}"), self.pool.connection() as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            self._local.conn = conn
            try:
                yield
            finally:
                self._local.conn = None
                conn.execute("SELECT pg_advisory_unlock(%s)", (key,))

    @contextlib.contextmanager
    def collection_lock(self, exclusive: bool) -> Iterator[None]:
        kind = "" if exclusive else "_shared"
        with self._connection() as conn:
            conn.execute(f"SELECT pg_advisory_lock{kind}(%s)", (_COLLECTION_KEY,))
            try:
                yield
            finally:
                conn.execute(f"SELECT pg_advisory_unlock{kind}(%s)", (_COLLECTION_KEY,))

    def await_collection(self) -> None:
        """One thread of this process at a time waits on the server, on a pooled connection,
        for a collection to end; the others wait here without one (a commit holds a connection
        for its repo's lock: each waiting for the collection on it, as many as the pool holds
        left none for anything else)."""
        with self._waits.hold("collection"), self.pool.connection() as conn:
            conn.execute("SELECT pg_advisory_lock_shared(%s)", (_COLLECTION_KEY,))
            conn.execute("SELECT pg_advisory_unlock_shared(%s)", (_COLLECTION_KEY,))

    def close(self) -> None:
        """Close the pool: its connections and its worker threads."""
        self.pool.close()


def open_index(url: str | None, root: Path) -> Index:
    """The index a store's settings name: PostgreSQL for a ``postgresql://`` URL, else SQLite in
    ``root``."""
    if url and url.startswith(("postgresql://", "postgres://")):
        return PostgresIndex(url)
    if url:
        raise ValueError(
            f"index {url!r}: use a postgresql:// URL, or leave it unset for SQLite in the store"
        )
    return SQLiteIndex(root)
