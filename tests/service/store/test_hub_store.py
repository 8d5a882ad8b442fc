"""The store on its own: commits, refs, verification on commit, atomicity, listing."""

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
from support.helpers import (
    TINY,
    create_side_by_side,
    dp_stage,
    lz4_xorb,
    synthetic_stage,
    tiny_encoder,
    tiny_repo_with_head,
    xorb_of,
)

from service.store import AddFile, AddObject, DeleteFile, HubStore
from service.store import store as store_module
from service.store.blobs import hash_file
from service.store.errors import (
    Conflict,
    InvalidRequest,
    NoSuchEntry,
    NoSuchRepo,
    NoSuchRevision,
    PublishRefused,
)
from vip_hub import export_encoder
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import LEDGER_FILE, WEIGHTS_FILE, head_file


def _ops(store: HubStore, folder: Path) -> list[AddFile]:
    """AddFile operations for every file of a repo folder (copied into the store's temp area)."""
    ops = []
    for rel, path in repo_files(folder).items():
        tmp = store.blobs.new_temp()
        tmp.write_bytes(path.read_bytes())
        ops.append(AddFile(rel, tmp))
    return ops


@pytest.fixture
def store(tmp_path):
    return HubStore(tmp_path / "store")


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory):
    return tiny_repo_with_head(tmp_path_factory.mktemp("r") / "m")


def test_commit_resolve_tree_and_dedup(store, repo_dir):
    store.create_repo("vip/m")
    c1 = store.commit("vip/m", _ops(store, repo_dir), title="first", author="t")
    assert len(c1.sha) == 40 and c1.parent is None and c1.arch == "vip-nano"
    assert (
        c1.datasets == ["test-images"] and c1.epsilon > 0 and c1.card_data["library_name"] == "timm"
    )
    assert store.resolve("vip/m") == store.resolve("vip/m", c1.sha) == c1.sha
    tree = store.tree("vip/m", c1.sha)
    assert head_file("toy") in tree
    blobs_before = sorted(p for p in (store.root / "blobs").rglob("*") if p.is_file())
    c2 = store.commit("vip/m", _ops(store, repo_dir), title="same again", author="t")
    assert c2.parent == c1.sha
    assert (
        sorted(p for p in (store.root / "blobs").rglob("*") if p.is_file()) == blobs_before
    )  # stored once
    assert [c.sha for c in store.history("vip/m")] == [c2.sha, c1.sha]
    assert not list((store.root / "tmp").iterdir())


def test_refused_commit_stores_nothing(store, repo_dir):
    store.create_repo("vip/m")
    good = store.commit("vip/m", _ops(store, repo_dir))
    ops = _ops(store, repo_dir)
    ledger = next(op for op in ops if op.path == LEDGER_FILE)
    data = json.loads(ledger.source.read_text())
    data["stages"][1]["epsilon"] = 0.01
    ledger.source.write_text(json.dumps(data))
    with pytest.raises(PublishRefused, match=f"does not verify, nothing was stored.*{LEDGER_FILE}"):
        store.commit("vip/m", ops)
    assert store.resolve("vip/m") == good.sha
    assert not list((store.root / "tmp").iterdir())
    with pytest.raises(PublishRefused, match="pytorch_model.bin: a '.bin' file is refused by name"):
        tmp = store.blobs.new_temp()
        tmp.write_bytes(b"\x80\x04")
        store.commit("vip/m", [AddFile("pytorch_model.bin", tmp)])


def test_deleting_a_ledger_file_is_refused(store, repo_dir):
    store.create_repo("vip/m")
    store.commit("vip/m", _ops(store, repo_dir))
    with pytest.raises(PublishRefused, match=f"{LEDGER_FILE}: missing"):
        store.commit("vip/m", [DeleteFile(LEDGER_FILE)])
    with pytest.raises(NoSuchEntry):
        store.commit("vip/m", [DeleteFile("nope.txt")])


def test_stale_parent_is_a_conflict(store, repo_dir):
    store.create_repo("vip/m")
    c1 = store.commit("vip/m", _ops(store, repo_dir))
    store.commit("vip/m", _ops(store, repo_dir), parent_commit=c1.sha)
    with pytest.raises(Conflict, match="stale"):
        store.commit("vip/m", _ops(store, repo_dir), parent_commit=c1.sha)


def test_concurrent_commits_make_a_linear_history(store, repo_dir):
    store.create_repo("vip/m")
    results, errors = [], []

    def publish() -> None:
        try:
            results.append(store.commit("vip/m", _ops(store, repo_dir)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=publish) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    history = store.history("vip/m")
    assert len(history) == 3
    assert [c.parent for c in history] == [history[1].sha, history[2].sha, None]


def test_another_repos_commit_of_a_shared_upload_takes_nothing_from_under_a_commit(
    store, repo_dir, monkeypatch
):
    """Two repos (of two owners) commit the same uploaded object: the first to finish moves the
    one upload of it into the blobs while the other still has its tree to verify."""
    weights = (repo_dir / WEIGHTS_FILE).read_bytes()
    oid = hashlib.sha256(weights).hexdigest()
    tmp = store.blobs.new_temp()
    tmp.write_bytes(weights)
    store.blobs.stage_upload(tmp, oid)
    ops = {}
    for repo in ("alice/m", "bob/m"):
        store.create_repo(repo)
        store.blobs.note_upload(repo, oid)
        ops[repo] = [op for op in _ops(store, repo_dir) if op.path != WEIGHTS_FILE]
        ops[repo].append(AddObject(WEIGHTS_FILE, oid))
    for leftover in set((store.root / "tmp").iterdir()) - {
        op.source for repo_ops in ops.values() for op in repo_ops if isinstance(op, AddFile)
    }:
        leftover.unlink()  # the inline copies of the weights _ops made
    verified, staged, done = store._verified, threading.Event(), threading.Event()

    def paused(repo_id, local):  # bob's commit holds its would-be tree, then waits for alice's
        if repo_id == "bob/m":
            staged.set()
            assert done.wait(60)
        return verified(repo_id, local)

    monkeypatch.setattr(store, "_verified", paused)
    results, errors = {}, []

    def bob() -> None:
        try:
            results["bob/m"] = store.commit("bob/m", ops["bob/m"])
        except Exception as e:  # reported below
            errors.append(e)
        finally:
            staged.set()

    worker = threading.Thread(target=bob)
    worker.start()
    try:
        assert staged.wait(60)
        results["alice/m"] = store.commit("alice/m", ops["alice/m"])
    finally:
        done.set()
        worker.join()
    assert not errors
    for repo, commit in results.items():
        assert store.tree(repo, commit.sha)[WEIGHTS_FILE].sha256 == oid
    assert store.blobs.path(oid).read_bytes() == weights
    assert not store.blobs.upload_path(oid).exists()
    assert not list((store.root / "tmp").iterdir())


def test_identical_first_commits_to_two_repos_are_two_commits(store, repo_dir, monkeypatch):
    """The same tree, title, message and author in the same millisecond, to two repos."""
    monkeypatch.setattr(store_module, "_now", lambda: "2025-01-01T00:00:00.000Z")
    commits = []
    for repo in ("alice/m", "org/m"):
        store.create_repo(repo)
        commits.append(store.commit(repo, _ops(store, repo_dir), title="first", author="alice"))
    assert commits[0].sha != commits[1].sha
    assert [store.resolve(r) for r in ("alice/m", "org/m")] == [c.sha for c in commits]
    assert store.tree("alice/m", commits[0].sha) == store.tree("org/m", commits[1].sha)


def test_tags_and_errors(store, repo_dir):
    with pytest.raises(NoSuchRepo):
        store.resolve("vip/none")
    store.create_repo("vip/m")
    with pytest.raises(NoSuchRevision):
        store.resolve("vip/m")  # empty repo
    c1 = store.commit("vip/m", _ops(store, repo_dir))
    store.create_tag("vip/m", "v1")
    store.commit("vip/m", _ops(store, repo_dir))
    assert store.resolve("vip/m", "v1") == c1.sha
    with pytest.raises(Conflict):
        store.create_tag("vip/m", "v1")
    with pytest.raises(InvalidRequest, match="is a tag"):
        store.commit("vip/m", _ops(store, repo_dir), branch="v1")
    with pytest.raises(NoSuchRevision):
        store.resolve("vip/m", "0" * 40)
    for name in ("v1..v2", "-v1", "v1\n", "a/b"):  # git's range syntax, an option, a newline
        with pytest.raises(InvalidRequest, match="invalid revision"):
            store.create_tag("vip/m", name)


def test_listing_filters_without_reading_blobs(store, tmp_path):
    a = tiny_repo_with_head(tmp_path / "a")
    b = export_encoder(
        tmp_path / "b",
        tiny_encoder(),
        TINY,
        [synthetic_stage(), dp_stage(sigma=0.6)],
        model_name="b",
    )
    c = export_encoder(tmp_path / "c", tiny_encoder(), TINY, [synthetic_stage()], model_name="c")
    for name, folder in (("org/a", a), ("org/b", b), ("other/c", c)):
        store.create_repo(name, private=name == "other/c")
        store.commit(name, _ops(store, folder))
    (store.root / "blobs").rename(
        store.root / "blobs-away"
    )  # listing must not need them (even as root)
    ids = lambda rows: [r.repo_id for r, _ in rows]  # noqa: E731
    assert ids(store.list_models(sort="epsilon", descending=False)) == ["org/a", "org/b"]
    assert ids(store.list_models(include_private=True, sort="epsilon", descending=False)) == [
        "other/c",
        "org/a",
        "org/b",
    ]
    eps_a = store.list_models(search="org/a")[0][1].epsilon
    assert ids(store.list_models(max_epsilon=eps_a)) == ["org/a"]
    assert ids(store.list_models(dataset="test-images", sort="name", descending=False)) == [
        "org/a",
        "org/b",
    ]
    assert ids(store.list_models(arch="vip-tiny")) == []
    assert ids(store.list_models(author="org", search="_")) == []
    with pytest.raises(InvalidRequest):
        store.list_models(sort="nonsense")


def test_snapshot_dir(store, repo_dir):
    store.create_repo("vip/m")
    c = store.commit("vip/m", _ops(store, repo_dir))
    snap = store.snapshot_dir("vip/m", c.sha)
    assert snap == store.snapshot_dir("vip/m", c.sha)
    assert sorted(repo_files(snap)) == sorted(repo_files(repo_dir))
    assert (snap / WEIGHTS_FILE).read_bytes() == (repo_dir / WEIGHTS_FILE).read_bytes()


def test_sqlite_serialises_case_twin_creations(store, monkeypatch):
    """Two stores on one SQLite index creating ``org/Model`` and ``org/model`` at once: a write
    transaction (BEGIN IMMEDIATE) excludes the other's from its start, so the second one, held
    until the first's insert is committed, finds the twin (PostgreSQL needs its lock:
    test_hub_postgres)."""
    store.create_repo("org/first")
    other = HubStore(store.root)
    results = create_side_by_side(
        monkeypatch, [store, other], ["org/Model", "org/model"], lambda: False, patience=1
    )
    assert results.count(True) == 1, results
    assert "differs only by case" in str(next(r for r in results if r is not True))


@pytest.mark.parametrize(
    "repo_id",
    ["../etc", "a/..", "a/b\\c", "a/" + "x" * 200, "a/b\x00", "a/.hidden", "a..b/c", "a/b..c"],
)
def test_bad_repo_ids(store, repo_id):
    with pytest.raises(InvalidRequest):
        store.create_repo(repo_id)


def test_a_verified_push_replaces_rotted_bytes_under_its_name(store, repo_dir):
    """A blob whose bytes rotted on disk kept winning: the publisher's push of the right file
    verified, then was thrown away for the stored (wrong) bytes, which the commit served."""
    store.create_repo("team/model")
    first = store.commit("team/model", _ops(store, repo_dir))
    entry = store.file("team/model", first.sha, WEIGHTS_FILE)
    blob, good = store.blob_path(entry), (repo_dir / WEIGHTS_FILE).read_bytes()
    rotted = bytearray(good)
    rotted[-1] ^= 1
    blob.chmod(0o600)
    blob.write_bytes(bytes(rotted))
    again = AddFile(WEIGHTS_FILE, tmp := store.blobs.new_temp())
    tmp.write_bytes(good)
    second = store.commit("team/model", [again], title="push it again")
    served = store.blob_path(store.file("team/model", second.sha, WEIGHTS_FILE)).read_bytes()
    assert hashlib.sha256(served).hexdigest() == entry.sha256


def test_a_blob_stored_from_an_old_upload_gets_the_full_grace(store, repo_dir, tmp_path):
    """A blob took its upload's time: stored from a two-day-old upload by a commit that then
    failed (its branch deleted meanwhile), ``store gc`` removed it at once, with the upload
    gone and the retry failing. Its time is now the storing's."""
    import os
    import time

    from service.store.upkeep import collect_garbage

    store.create_repo("team/model")
    store.commit("team/model", _ops(store, repo_dir))
    data = b"notes uploaded two days ago\n"
    sha = hashlib.sha256(data).hexdigest()
    tmp = store.blobs.new_temp()
    tmp.write_bytes(data)
    store.blobs.stage_upload(tmp, sha)
    store.blobs.note_upload("team/model", sha)
    old = time.time() - 2 * 86400
    os.utime(store.blobs.upload_path(sha), (old, old))
    store.create_branch("team/model", "dev")
    real = store._store_blobs

    def then_the_branch_goes(*args):
        stored = real(*args)
        store.delete_branch("team/model", "dev")
        return stored

    store._store_blobs = then_the_branch_goes
    with pytest.raises(Conflict):
        store.commit("team/model", [AddObject("notes.txt", sha)], branch="dev")
    store._store_blobs = real
    assert collect_garbage(store, 86400).blobs == []  # within its grace, from its storing
    store.commit("team/model", [AddObject("notes.txt", sha)])  # the retry finds it


def test_a_checked_xorb_replaces_rotted_bytes_under_its_hash(store):
    """A xorb sent again, and checked against its hash, was dropped for the one held (only its
    age refreshed), whose bytes may have rotted: it now replaces it."""
    name, good = xorb_of([b"chunk one " * 100, b"chunk two " * 100])
    sent = store.blobs.new_temp()
    sent.write_bytes(good)
    store.xet.put_xorb(name, sent, "alice")
    held = store.xet.xorb_path(name)
    held.chmod(0o600)
    held.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    again = store.blobs.new_temp()
    again.write_bytes(good)
    store.xet.put_xorb(name, again, "alice")
    assert held.read_bytes() == good


def test_a_sound_xorb_stays_when_its_hash_comes_again_packed_otherwise(store):
    """A xorb's hash names its chunks, not how they are packed: the same hash sent again as
    LZ4 chunks replaced the held raw ones, under a shard reading them at the offsets it had
    found there (a spurious CorruptObject). A held xorb that still checks stays, its age
    refreshed."""
    chunks = [b"chunk one " * 100, b"chunk two " * 100]
    name, raw = xorb_of(chunks)
    sent = store.blobs.new_temp()
    sent.write_bytes(raw)
    store.xet.put_xorb(name, sent, "alice")
    held = store.xet.xorb_path(name)
    then = time.time() - 3600
    os.utime(held, (then, then))
    again = store.blobs.new_temp()
    again.write_bytes(lz4_xorb(chunks))
    store.xet.put_xorb(name, again, "bob")
    assert held.read_bytes() == raw and held.stat().st_mtime > then + 60
    assert not again.exists()


def test_a_xorb_collected_while_it_is_sent_again_is_stored(store, monkeypatch):
    """A held xorb checked sound is kept, its age refreshed; collected between its check and
    the refresh (it was old: that is when a client sends it again), the upload stores it."""
    from service.store import xet

    chunks = [b"chunk one " * 100, b"chunk two " * 100]
    name, raw = xorb_of(chunks)
    sent = store.blobs.new_temp()
    sent.write_bytes(raw)
    store.xet.put_xorb(name, sent, "alice")
    held, check = store.xet.xorb_path(name), xet.check_xorb

    def then_collected(path: Path, xorb: str) -> None:
        check(path, xorb)
        if path == held:
            held.unlink()

    monkeypatch.setattr(xet, "check_xorb", then_collected)
    again = store.blobs.new_temp()
    again.write_bytes(lz4_xorb(chunks))
    store.xet.put_xorb(name, again, "bob")
    assert held.read_bytes() == lz4_xorb(chunks)


def test_new_folders_and_renames_into_them_are_fsynced(store, monkeypatch):
    """An upload, its record, the blob it becomes and a xorb each land in a fan-out folder made
    for them: the rename is fsynced in that folder, and the folder in its parent, so a crash
    after the index names the blob cannot lose it."""
    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tmp = store.blobs.new_temp()
    tmp.write_bytes(b"bytes of a new blob")
    upload = store.blobs.stage_upload(tmp, hash_file(tmp).sha256)
    store.blobs.note_upload("team/model", hash_file(upload).sha256)
    blob = store.blobs.ingest(upload, hash_file(upload))
    name, data = xorb_of([b"chunk one " * 100])
    sent = store.blobs.new_temp()
    sent.write_bytes(data)
    store.xet.put_xorb(name, sent, "alice")
    for placed in (upload, blob, store.xet.xorb_path(name)):
        assert placed.parent in synced and placed.parent.parent in synced, placed
    assert store.blobs.upload_records.folder in synced  # the upload record's new folder


def test_sound_bytes_stay_under_their_name(store, repo_dir):
    """Bytes sent again for a name whose stored bytes still hash to it keep the stored file:
    the snapshots' hard links stay its links (a new file would leave them holding a second
    copy of it for good)."""
    store.create_repo("team/model")
    first = store.commit("team/model", _ops(store, repo_dir))
    blob = store.blob_path(store.file("team/model", first.sha, WEIGHTS_FILE))
    inode = blob.stat().st_ino
    again = AddFile(WEIGHTS_FILE, tmp := store.blobs.new_temp())
    tmp.write_bytes((repo_dir / WEIGHTS_FILE).read_bytes())
    notes = AddFile("notes.txt", tmp := store.blobs.new_temp())
    tmp.write_bytes(b"notes")  # a change, so that the commit is not empty
    store.commit("team/model", [again, notes], title="again")
    assert blob.stat().st_ino == inode
