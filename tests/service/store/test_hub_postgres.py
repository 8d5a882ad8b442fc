"""Several hub processes on one store: a PostgreSQL index (a real server, a throwaway cluster
made with initdb) and one blob folder; concurrent pushes through both lose and interleave
nothing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from huggingface_hub import HfApi
from support.helpers import create_side_by_side, tiny_repo_with_head
from support.live import WRITE_TOKEN, ProcessServer, ThreadedServer, settings_for

from service.settings import HubSettings
from service.store import AddFile, HubStore
from service.store import store as store_module
from service.store.errors import Conflict, NoSuchRevision, TooMuchUncommitted
from service.store.index import PostgresIndex, Transaction
from service.store.xet import xorb_oid
from vip_hub.cli.main import main
from vip_hub.repo.push import push_repo
from vip_hub.repo.verify import repo_files

pytestmark = pytest.mark.slow


def _ops(store: HubStore, folder: Path) -> list[AddFile]:
    ops = []
    for rel, path in repo_files(folder).items():
        tmp = store.blobs.new_temp()
        tmp.write_bytes(path.read_bytes())
        ops.append(AddFile(rel, tmp))
    return ops


def test_store_on_postgres_compares_and_swaps(postgres, tmp_path):
    with HubStore(tmp_path / "store", index=postgres) as store:
        folder = tiny_repo_with_head(tmp_path / "m")
        store.create_repo("pg/m")
        assert store.create_repo("pg/m")[1] is False
        with pytest.raises(Conflict, match="'PG' differs only by case from the existing 'pg'"):
            store.create_repo("PG/other")  # namespaces are unique by lower(name) here too
        with pytest.raises(Conflict, match="'M' differs only by case from the existing pg/m"):
            store.create_repo("pg/M")  # and names in a namespace
        assert store.repos_in("Pg") == ["pg/m"]
        first = store.commit("pg/m", _ops(store, folder))
        second = store.commit("pg/m", _ops(store, folder), parent_commit=first.sha)
        with pytest.raises(Conflict, match="stale"):
            store.commit("pg/m", _ops(store, folder), parent_commit=first.sha)
        assert [c.sha for c in store.history("pg/m")] == [second.sha, first.sha]
        assert second.epsilon == first.epsilon > 0 and second.datasets == ["test-images"]
        assert [r.repo_id for r, _ in store.list_models(search="pg/")] == ["pg/m"]
        assert store.public_dataset_names() == ["test-images"]  # the dataset page's spellings
        assert [r.repo_id for r, _ in store.list_models(dataset=["x", "test-images"])] == ["pg/m"]
        store.create_tag("pg/m", "v1", first.sha)
        with pytest.raises(Conflict):
            store.create_tag("pg/m", "v1")
        assert store.resolve("pg/m", "v1") == first.sha
        assert store.create_branch("pg/m", "dev", "v1") == first.sha
        with pytest.raises(Conflict, match="already exists"):
            store.create_branch("pg/m", "dev")
        with pytest.raises(Conflict, match="is a tag"):
            store.create_branch("pg/m", "v1")
        store.delete_branch("pg/m", "dev")
        assert store.refs("pg/m")["branch"] == {"main": second.sha}
        with pytest.raises(NoSuchRevision):
            store.delete_branch("pg/m", "dev")
    assert store.index.pool.closed  # the pool and its threads gone with the block


def test_uncommitted_bytes_are_counted_on_postgres(postgres, tmp_path):
    """``reserve_uploads`` on PostgreSQL: asking again renews (never lowering a count), a refusal
    counts none of the objects asked for, each user has a quota of their own, objects made from
    others (files from a user's xorbs) take their count's place, and a reservation undone gives
    it back."""
    limits = HubSettings(max_uncommitted_bytes=10)
    with HubStore(tmp_path / "store", index=postgres, limits=limits) as store:
        store.reserve_uploads("u", "pg/m", [("ab" * 32, 6)])
        store.reserve_uploads("u", "pg/m", [("ab" * 32, 6)])  # renewed, not added
        with pytest.raises(TooMuchUncommitted, match="u holds 6 bytes"):
            store.reserve_uploads("u", "pg/m", [("cd" * 32, 2), ("ef" * 32, 3)])
        store.reserve_uploads("u", "pg/m", [("cd" * 32, 2)])  # the refused pair left no count
        store.reserve_uploads("v", "pg/m", [("cd" * 32, 10)])
        # what is made from earlier objects takes their place, whichever repo they came for
        store.reserve_uploads("u", "pg/other", [(xorb_oid("12" * 32), 2)])
        made = store.reserve_uploads("u", "pg/m", [("ef" * 32, 2)], replacing=[xorb_oid("12" * 32)])
        made.done()  # kept: the xorb's count goes
        with pytest.raises(TooMuchUncommitted, match="u holds 10 bytes"):
            store.reserve_uploads("u", "pg/m", [("99" * 32, 1)], replacing=["ab" * 32 + "?"])
        # asked again smaller, the count stays the larger
        renewal = store.reserve_uploads("u", "pg/m", [("ab" * 32, 1)])
        with pytest.raises(TooMuchUncommitted, match="u holds 10 bytes"):
            store.reserve_uploads("u", "pg/m", [("99" * 32, 1)])
        # undone, a reservation drops its own counts (a renewal's back to the earlier one) and
        # leaves what it replaces, even once another reservation that replaced it is done
        first = store.reserve_uploads("u", "pg/m", [("77" * 32, 1)], replacing=["ab" * 32])
        second = store.reserve_uploads("u", "pg/m", [("88" * 32, 4)], replacing=["ab" * 32])
        second.done()
        first.undo()
        renewal.undo()
        counted = store.index.rows("SELECT oid, size FROM pending_uploads WHERE account = 'u'")
        assert {r["oid"]: r["size"] for r in counted} == {
            "88" * 32: 4,
            "cd" * 32: 2,
            "ef" * 32: 2,
        }


def test_a_sql_ascii_database_gives_names_as_text(postgres_server, tmp_path):
    """A database created SQL_ASCII (an initdb under the C locale makes them) hands psycopg
    bytes unless the connection says its text is UTF-8: the index asks for it."""
    url = postgres_server.new_database("SQL_ASCII")
    with HubStore(tmp_path / "store", index=url) as store:
        store.create_repo("pg/m")
        assert store.repos_in("pg") == ["pg/m"]
        with pytest.raises(Conflict, match="from the existing 'pg'"):
            store.create_repo("PG/other")


def test_concurrent_creations_make_no_case_twins(postgres_server, tmp_path, monkeypatch):
    """Two replicas creating ``org/ModelN`` and ``org/modelN`` at once: each checks for a twin
    before its insert, so both would pass the check and both insert, but the second waits for
    the first's transaction and finds its repo. Each is stopped before its insert until the
    other reached its own or waits on a lock (``pg_stat_activity``), so the race is run every
    round, not by chance."""
    url = postgres_server.new_database()
    first, second = (HubStore(tmp_path / "store", index=url) for _ in range(2))
    with first, second, psycopg.connect(url, autocommit=True) as watcher:

        def held_back() -> bool:
            return watcher.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock')"
            ).fetchone()[0]

        first.create_repo("org/first")  # the namespace exists: its insert makes no one wait
        for n in range(3):
            ids = [f"org/Model{n}", f"org/model{n}"][:: 1 if n % 2 else -1]
            results = create_side_by_side(monkeypatch, [first, second], ids, held_back, patience=30)
            assert results.count(True) == 1, results
            refused = next(r for r in results if r is not True)
            assert "differs only by case from the existing" in str(refused)
            assert len(first.repos_in("org")) == n + 2  # org/first and one of the two


def test_commits_waiting_for_a_repo_hold_no_pooled_connection(postgres):
    """Commits of one process waiting for a repo's lock wait without a pooled connection: each
    held one while it waited on the server, and as many as the pool holds left no connection
    for anything else (every request of the replica stalled behind one slow commit)."""
    index = PostgresIndex(postgres, max_connections=3)
    try:
        with index.repo_lock("pg/busy"):

            def commit() -> None:
                with index.repo_lock("pg/busy"):
                    pass

            waiting = [threading.Thread(target=commit) for _ in range(5)]
            for t in waiting:
                t.start()
            deadline = time.monotonic() + 30  # until all five wait for the lock (six users)
            while index._waits._locks["repo pg/busy"][1] < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
            read: list[object] = []
            reader = threading.Thread(target=lambda: read.append(index.row("SELECT 1 AS one")))
            reader.start()
            reader.join(timeout=10)
            assert read == [{"one": 1}], "the pool was exhausted by waiting commits"
        for t in waiting:  # each gets the lock in turn once it is released
            t.join(timeout=30)
        assert not any(t.is_alive() for t in waiting)
    finally:
        index.close()


def test_commits_waiting_for_a_collection_hold_no_pooled_connection(
    postgres, tmp_path, monkeypatch
):
    """A collection holds the collection lock exclusively (on another host); commits to other
    repos of one replica each took a pooled connection for their repo's lock and waited on it,
    on the server, for the collection: as many as the pool holds left no connection for
    anything else, and every request of the replica stalled until the collection ended."""
    folder = tiny_repo_with_head(tmp_path / "m")
    monkeypatch.setattr(
        store_module, "open_index", lambda url, root: PostgresIndex(url, max_connections=3)
    )
    with (
        HubStore(tmp_path / "store", index=postgres) as store,
        HubStore(tmp_path / "gc-host", index=postgres) as gc_host,
        psycopg.connect(postgres, autocommit=True) as watcher,
    ):
        repos = [f"pg/r{i}" for i in range(5)]
        for repo in repos:
            store.create_repo(repo)
        errors: list[BaseException] = []

        def commit(repo: str) -> None:
            try:
                store.commit(repo, _ops(store, folder))
            except BaseException as e:  # reported below
                errors.append(e)

        with gc_host.index.collection_lock(exclusive=True):  # the collection, elsewhere
            committers = [threading.Thread(target=commit, args=(r,)) for r in repos]
            for t in committers:
                t.start()
            deadline = time.monotonic() + 60  # until every commit waits for the collection
            while time.monotonic() < deadline and (
                sum(users for _, users in store.index._waits._locks.values()) < len(repos)
                or not watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                ).fetchone()[0]
            ):
                time.sleep(0.05)
            time.sleep(1)  # the last ones reach the server, if they do
            read: list[object] = []
            reader = threading.Thread(
                target=lambda: read.append(store.index.row("SELECT 1 AS one"))
            )
            reader.start()
            reader.join(timeout=10)
            read_during_collection = list(read)
        for t in committers:
            t.join(timeout=120)
        reader.join(timeout=60)
        assert read_during_collection == [{"one": 1}], "waiting commits took the whole pool"
        assert not errors, errors
        assert all(len(store.history(r)) == 1 for r in repos)


def test_creations_waiting_for_a_namespace_hold_no_pooled_connection(
    postgres_server, tmp_path, monkeypatch
):
    """Creations in one namespace take turns (its case-twin check and its insert are one step):
    each waited for its turn on the server, holding a pooled connection, so as many creations
    as the pool holds behind one slow creation stalled every request of the replica. Now they
    wait inside the process."""
    real, inserting, release = Transaction.execute, threading.Event(), threading.Event()

    def execute(self: Transaction, sql: str, args: object = ()) -> int:
        if sql.startswith("INSERT INTO repos") and threading.current_thread().name == "slow":
            inserting.set()
            release.wait(60)
        return real(self, sql, args)

    monkeypatch.setattr(Transaction, "execute", execute)
    with HubStore(tmp_path / "store", index=postgres_server.new_database()) as store:
        index = store.index
        assert isinstance(index, PostgresIndex)
        store.create_repo("pg/first")  # the namespace exists
        slow = threading.Thread(target=store.create_repo, args=("pg/slow",), name="slow")
        slow.start()
        assert inserting.wait(30)
        waiting = [
            threading.Thread(target=store.create_repo, args=(f"pg/model{i}",))
            for i in range(index.pool.max_size + 4)
        ]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 30  # until every creation waits, in the process or on a
        while time.monotonic() < deadline and not (  # connection of the exhausted pool
            index.pool.get_stats().get("requests_waiting", 0)
            or sum(users for _, users in index._waits._locks.values()) > len(waiting)
        ):
            time.sleep(0.01)
        read: list[object] = []
        reader = threading.Thread(target=lambda: read.append(index.row("SELECT 1 AS one")))
        reader.start()
        reader.join(timeout=10)
        read_while_waiting = list(read)
        release.set()
        for t in [slow, *waiting]:
            t.join(timeout=60)
        assert read_while_waiting == [{"one": 1}], "the pool was exhausted by waiting creations"
        assert len(store.repos_in("pg")) == len(waiting) + 2


def test_two_hub_processes_share_one_store(postgres, tmp_path):
    store = tmp_path / "shared-store"
    env = {"VIP_HUB_INDEX": postgres}
    servers = [ProcessServer(store, extra_env=env) for _ in range(2)]
    starters = [threading.Thread(target=s.start) for s in servers]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    try:
        folders = [tiny_repo_with_head(tmp_path / f"v{i}", seed=i) for i in range(4)]
        results: dict[int, str] = {}
        errors: list[BaseException] = []

        def publish(i: int) -> None:
            try:  # alternate between the two processes
                results[i] = push_repo(
                    folders[i], "multi/m", endpoint=servers[i % 2].url, token=WRITE_TOKEN
                )
            except BaseException as e:  # reported below
                errors.append(e)

        pushers = [threading.Thread(target=publish, args=(i,)) for i in range(4)]
        for t in pushers:
            t.start()
        for t in pushers:
            t.join()
        assert not errors, errors
        for server in servers:  # both see the same linear history holding every push
            history = HfApi(endpoint=server.url).list_repo_commits("multi/m")
            assert sorted(c.commit_id for c in history) == sorted(results.values())
        heads = {HfApi(endpoint=s.url).model_info("multi/m").sha for s in servers}
        assert len(heads) == 1
        with HubStore(store, index=postgres) as index:
            chain = index.history("multi/m")
        assert [c.parent for c in chain] == [c.sha for c in chain[1:]] + [None]
    finally:
        for server in servers:
            server.stop()


def test_collection_waits_for_commits_on_other_hosts(postgres, tmp_path):
    """Two stores (two hosts' folders) on one PostgreSQL index: a collection on one waits while
    a commit on the other holds the collection lock shared (an advisory lock)."""
    from service.store.upkeep import collect_garbage

    done = threading.Event()
    with HubStore(tmp_path / "here", index=postgres) as here:
        with HubStore(tmp_path / "there", index=postgres) as there:
            with here.index.collection_lock(exclusive=False):  # as a commit holds it
                worker = threading.Thread(target=lambda: (collect_garbage(there, 3600), done.set()))
                worker.start()
                assert not done.wait(1.0)
            worker.join(30)
    assert done.is_set()


def test_the_service_closes_its_index_when_it_stops(postgres, tmp_path):
    with ThreadedServer(settings_for(tmp_path / "store", index=postgres)) as server:
        pool = server.app.state.store.index.pool
        assert not pool.closed
    assert pool.closed


def test_the_admin_commands_close_their_index(postgres_server, tmp_path, monkeypatch, capsys):
    """``vip-hub token`` and ``vip-hub store`` close the PostgreSQL pool they opened (left to
    the collector, a pool's threads were joined from one of their own)."""
    closed: list[PostgresIndex] = []
    close = PostgresIndex.close

    def spy(index: PostgresIndex) -> None:
        closed.append(index)
        close(index)

    monkeypatch.setattr(PostgresIndex, "close", spy)
    monkeypatch.setenv("VIP_HUB_INDEX", postgres_server.new_database())  # no other store's rows
    store = str(tmp_path / "store")
    assert main(["token", "create", "--name", "ann", "--scope", "read", "--store", store]) == 0
    assert main(["store", "check", "--store", store]) == 0, capsys.readouterr()
    assert len(closed) == 2 and all(index.pool.closed for index in closed)
