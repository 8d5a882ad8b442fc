"""The store's upkeep (``vip-hub store gc``, ``vip-hub store check``) on real files and on a real
SeaweedFS, each from deliberately broken states: what no commit names goes after its grace
period, what a commit or an upload in flight names never does; the check reports where the
index and the store disagree and repairs only what is safe."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import httpx
import huggingface_hub
import pytest
from huggingface_hub import HfApi
from support.helpers import tiny_repo_with_head
from support.live import WRITE_TOKEN, ProcessServer, ThreadedServer, raw_commit, settings_for

from service.settings import ObjectStoreSettings
from service.store import AddFile, AddObject, HubStore, clock, hash_file, upkeep
from service.store.faults import CRASH_ENV, CRASH_STATUS
from service.store.s3 import blob_key, upload_key
from service.store.upkeep import collect_garbage
from vip_hub.cli.main import main
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE

DAY = 24 * 3600
AUTH = {"Authorization": f"Bearer {WRITE_TOKEN}"}
HTTP = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory) -> Path:
    return tiny_repo_with_head(tmp_path_factory.mktemp("upkeep") / "vip-nano-upkeep")


def _published(
    root: Path, repo_dir: Path, objects: ObjectStoreSettings | None = None, repo: str = "vip/m"
) -> tuple[HubStore, dict[str, str]]:
    """A store holding ``repo`` (the repo's files as one commit; blobs in the folder, or in
    ``objects``); path -> SHA-256."""
    store = HubStore(root, objects=objects)
    store.create_repo(repo)
    ops = []
    for rel, path in repo_files(repo_dir).items():
        tmp = store.blobs.new_temp()
        tmp.write_bytes(path.read_bytes())
        ops.append(AddFile(rel, tmp))
    commit = store.commit(repo, ops)
    return store, {p: e.sha256 for p, e in store.tree(repo, commit.sha).items()}


def _later(monkeypatch, seconds: float) -> None:
    """Move the store's clock ``seconds`` forward (every age it compares grows by as much)."""
    ahead = clock.now() + seconds - time.time()
    monkeypatch.setattr(clock, "now", lambda: time.time() + ahead)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _upload(store: HubStore, data: bytes, repo: str | None = None) -> str:
    """``data`` received into the uploads area (for ``repo``: with its upload record)."""
    oid = hashlib.sha256(data).hexdigest()
    tmp = store.blobs.new_temp()
    tmp.write_bytes(data)
    store.blobs.stage_upload(tmp, oid)
    if repo is not None:
        store.blobs.note_upload(repo, oid)
    return oid


def _orphan(store: HubStore, data: bytes) -> str:
    """A blob no commit names, as a commit that crashed after storing its blobs leaves one."""
    oid = hashlib.sha256(data).hexdigest()
    tmp = store.blobs.new_temp()
    tmp.write_bytes(data)
    store.blobs.ingest(tmp, hash_file(tmp))
    return oid


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["store", *args])
    return code, capsys.readouterr().out


def _lines(out: str, kind: str, what: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"{kind}\t{what}")]


# ---------------------------------------------------------------- the folder store


def test_gc_removes_only_what_no_commit_or_upload_names(tmp_path, repo_dir, capsys):
    store, named = _published(tmp_path / "store", repo_dir)
    for sha in named.values():  # however old, a blob a commit names stays
        _age(store.blobs.path(sha), 30 * DAY)
    old, young = _orphan(store, b"a crashed commit's blob"), _orphan(store, b"a newer one")
    _age(store.blobs.path(old), 2 * DAY)
    in_flight = _upload(store, b"uploaded twice", "vip/m")
    _age(store.blobs.upload_path(in_flight), 2 * DAY)  # first received long ago, noted again now
    abandoned = _upload(store, b"never committed", "vip/m")
    _age(store.blobs.upload_path(abandoned), 2 * DAY)
    for record in store.blobs.upload_records.folder.rglob(abandoned):
        _age(record, 2 * DAY)

    code, out = _cli(capsys, "gc", "--store", str(store.root))
    assert code == 0 and f"removed blob {old}" in out, out
    assert "removed 1 blobs no commit names" in out and "1 unnamed blobs kept" in out
    assert all(store.blobs.path(sha).is_file() for sha in named.values())
    assert not store.blobs.path(old).exists() and store.blobs.path(young).is_file()
    assert store.blobs.object_size(abandoned) is None
    # the upload a record still names stays, and its commit goes through
    store.commit("vip/m", [AddObject("notes/extra.txt", in_flight)])
    assert store.blobs.path(in_flight).read_bytes() == b"uploaded twice"


def test_the_temp_sweep_keeps_a_commits_link_to_an_old_upload(tmp_path, monkeypatch):
    """A commit's hard link to an upload has the upload's modification time: one received two
    days ago (its record refreshed since) is linked by a commit under way, and the sweep of
    stale temp files leaves the link to it; a link a day old goes. Where the filesystem makes no
    hard links, the commit reads its own copy."""
    with HubStore(tmp_path / "store") as store:
        oid = _upload(store, b"noted again today", "vip/m")
        _age(store.blobs.upload_path(oid), 2 * DAY)
        link = store.blobs.committed_source(oid)
        assert link != store.blobs.upload_path(oid) and link.read_bytes() == b"noted again today"
        assert store.blobs.clean_stale(upload_age=7 * DAY) == 0 and link.is_file()
        _later(monkeypatch, DAY + 60)
        assert store.blobs.clean_stale(upload_age=7 * DAY) == 1 and not link.exists()

        def no_links(src, dst):
            raise OSError(95, "Operation not supported")

        monkeypatch.setattr(os, "link", no_links)
        copy = store.blobs.committed_source(oid)
        assert (
            copy.read_bytes() == b"noted again today"
            and copy.stat().st_ino != os.stat(store.blobs.upload_path(oid)).st_ino
        )


@pytest.mark.parametrize("action", ["gc", "check"])
def test_upkeep_of_a_folder_that_is_not_a_store_is_refused(tmp_path, capsys, action):
    """A mistyped --store was made a new, empty store that checked healthy ("0 findings")."""
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"not a store")
    assert main(["store", action, "--store", str(folder)]) != 0
    assert "is not a hub store" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["holiday.jpg"]


def test_gc_waits_for_commits_that_may_name_a_blob(tmp_path, repo_dir):
    store, _ = _published(tmp_path / "store", repo_dir)
    sha = _orphan(store, b"stored by a commit not yet indexed")
    _age(store.blobs.path(sha), 2 * DAY)
    done = threading.Event()
    with store.index.collection_lock(exclusive=False):  # as a commit holds it
        worker = threading.Thread(target=lambda: (collect_garbage(store, DAY), done.set()))
        worker.start()
        assert not done.wait(1.0)  # the collection waits for the commit...
        assert store.blobs.path(sha).is_file()
    worker.join(30)
    assert done.is_set() and not store.blobs.path(sha).exists()  # ...and then goes on


def test_a_blob_stored_again_while_gc_waits_keeps_its_grace(tmp_path, repo_dir, monkeypatch):
    """``store gc`` lists the blobs before it takes the collection lock. A commit it waited for
    stored an old orphan it had listed again, from a new upload (consumed), then failed: the
    collection judged the blob by its listed age and removed it, and the commit's retry found
    neither blob nor upload. Its grace counts from the storing."""
    store, _ = _published(tmp_path / "store", repo_dir)
    data = b"an orphan sent again"
    sha = _orphan(store, data)
    _age(store.blobs.path(sha), 2 * DAY)
    listing = upkeep._every_blob

    def then_a_commit_stores_it(blobs):
        listed = list(listing(blobs))
        upload = store.blobs.upload_path(_upload(store, data))
        store.blobs.ingest(upload, hash_file(upload))  # as a commit does, before it fails
        return iter(listed)

    monkeypatch.setattr(upkeep, "_every_blob", then_a_commit_stores_it)
    assert sha not in collect_garbage(store, DAY).blobs
    assert store.blobs.path(sha).is_file()


def test_check_reports_and_repairs_only_what_is_safe(tmp_path, repo_dir, capsys):
    store, named = _published(tmp_path / "store", repo_dir)
    weights, config, card = (named[p] for p in (WEIGHTS_FILE, CONFIG_FILE, CARD_FILE))
    data = {sha: store.blobs.path(sha).read_bytes() for sha in named.values()}
    # missing, with a checked copy in the uploads area (received again since)
    store.blobs.path(weights).unlink()
    _upload(store, data[weights])
    # missing, no copy anywhere
    store.blobs.path(config).unlink()
    # corrupt: the bytes a commit names changed on disk
    os.chmod(store.blobs.path(card), 0o600)
    store.blobs.path(card).write_bytes(b"not the card")
    # an upload whose bytes are not its name, an old orphan, a young one, a bad xorb
    bad_upload = hashlib.sha256(b"announced").hexdigest()
    store.blobs.upload_path(bad_upload).parent.mkdir(parents=True, exist_ok=True)
    store.blobs.upload_path(bad_upload).write_bytes(b"something else")
    old, young = _orphan(store, b"old orphan"), _orphan(store, b"young orphan")
    _age(store.blobs.path(old), 2 * DAY)
    xorb = "ab" * 32
    store.xet.xorb_path(xorb).parent.mkdir(parents=True, exist_ok=True)
    store.xet.xorb_path(xorb).write_bytes(b"\0" * 64)

    code, out = _cli(capsys, "check", "--store", str(store.root))
    assert code == 1
    assert "PROBLEM" in _lines(out, "missing", weights)[0]
    assert "PROBLEM" in _lines(out, "missing", config)[0]
    assert "holds 12 bytes" in _lines(out, "corrupt", card)[0]
    assert _lines(out, "corrupt", f"upload:{bad_upload}")
    assert _lines(out, "corrupt", f"xorb:{xorb}")
    assert "PROBLEM" in _lines(out, "orphan", old)[0] and "ok" in _lines(out, "orphan", young)[0]
    assert store.blobs.path(old).is_file()  # a check alone changes nothing

    code, out = _cli(capsys, "check", "--repair", "--store", str(store.root))
    assert code == 1  # what has no copy is still missing
    assert "repaired" in _lines(out, "missing", weights)[0]
    assert store.blobs.path(weights).read_bytes() == data[weights]
    assert "cannot repair" in _lines(out, "missing", config)[0]
    assert "cannot repair" in _lines(out, "corrupt", card)[0]
    assert store.blobs.path(card).read_bytes() == b"not the card"  # kept: a commit names it
    assert not store.blobs.upload_path(bad_upload).exists()
    assert not store.xet.xorb_path(xorb).exists()
    assert not store.blobs.path(old).exists() and store.blobs.path(young).is_file()

    # the bytes received again (an upload, no commit), or put among the uploads by an operator
    _upload(store, data[config])
    store.blobs.upload_path(card).parent.mkdir(parents=True, exist_ok=True)
    store.blobs.upload_path(card).write_bytes(data[card])
    code, out = _cli(capsys, "check", "--repair", "--store", str(store.root))
    assert code == 0, out
    assert all(store.blobs.path(sha).read_bytes() == data[sha] for sha in named.values())
    code, out = _cli(capsys, "check", "--store", str(store.root))
    assert code == 0 and "PROBLEM" not in out


# ---------------------------------------------------------------- the object store

BUCKET = "upkeep"


@pytest.fixture(scope="module")
def s3_hub(seaweed, tmp_path_factory, repo_dir):
    """A live hub on its own bucket of the session's SeaweedFS, ``lfs/upkeep`` sent over LFS."""
    seaweed.client().create_bucket(Bucket=BUCKET)
    settings = settings_for(
        tmp_path_factory.mktemp("upkeep-hub"),
        object_store={"endpoint": seaweed.url, "bucket": BUCKET},
    )
    with ThreadedServer(settings) as server, pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        api = HfApi(endpoint=server.url, token=WRITE_TOKEN)
        for repo in ("lfs/upkeep", "lfs/upkeep-other"):
            api.create_repo(repo)
        api.upload_folder(repo_id="lfs/upkeep", folder_path=repo_dir, commit_message="v1")
        yield server


@pytest.fixture
def cli_env(s3_hub, monkeypatch):
    """The CLI pointed at the hub's store and bucket (as an operator's settings would be)."""
    monkeypatch.setenv("VIP_HUB_STORE", str(s3_hub.settings.store))
    monkeypatch.setenv("VIP_HUB_OBJECT_STORE__ENDPOINT", s3_hub.settings.object_store.endpoint)
    monkeypatch.setenv("VIP_HUB_OBJECT_STORE__BUCKET", BUCKET)
    return monkeypatch


def _keys(seaweed, prefix: str) -> set[str]:
    listed = seaweed.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for o in listed.get("Contents", [])}


def _lfs_upload(hub, repo: str, data: bytes, verify: bool = True) -> str:
    """``data`` sent for ``repo`` as huggingface_hub sends it (a presigned PUT to a staging
    key), then verified (the hub hashes it), unless not ``verify``; returns the staging key."""
    oid = hashlib.sha256(data).hexdigest()
    reply = HTTP.post(
        f"{hub.url}/{repo}.git/info/lfs/objects/batch",
        json={"operation": "upload", "objects": [{"oid": oid, "size": len(data)}]},
        headers=AUTH,
    )
    actions = reply.json()["objects"][0]["actions"]
    assert HTTP.put(actions["upload"]["href"], content=data).status_code == 200
    if verify:
        done = HTTP.post(
            actions["verify"]["href"], json={"oid": oid, "size": len(data)}, headers=AUTH
        )
        assert done.status_code == 200, done.text
    return actions["upload"]["href"].split("?")[0].split(f"/{BUCKET}/", 1)[1]


def _named(hub) -> set[str]:
    rows = hub.app.state.store.index.rows("SELECT DISTINCT sha256 FROM files")
    return {r["sha256"] for r in rows}


def test_a_repaired_blob_is_what_the_next_snapshot_holds(tmp_path, repo_dir):
    """``store check --repair`` put the right bytes back as a new file, but a commit's snapshot
    made before kept its hard links to the rotted one, reused whenever the commit was loaded:
    inference of that commit failed verification for good."""
    from service.store.upkeep import check_store
    from vip_hub.repo.verify import verify_repo

    store, shas = _published(tmp_path / "store", repo_dir)
    (commit,) = store.index.rows("SELECT sha FROM commits")
    first = store.snapshot_dir("vip/m", commit["sha"])
    blob = store.blobs.path(shas[WEIGHTS_FILE])
    good = blob.read_bytes()
    blob.chmod(0o600)
    blob.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # rot, in place: the snapshot's too
    upload = store.blobs.upload_path(shas[WEIGHTS_FILE])
    upload.parent.mkdir(parents=True, exist_ok=True)
    upload.write_bytes(good)  # the right bytes, where the docs say to put them
    check_store(store, repair=True, grace=86400)
    again = store.snapshot_dir("vip/m", commit["sha"])
    assert again == first and (again / WEIGHTS_FILE).read_bytes() == good
    assert verify_repo(again).ok


def test_what_a_killed_request_left_in_folders_goes_too(tmp_path, repo_dir, monkeypatch):
    """A kill while a snapshot was built left ``snapshots/ORG/NAME/.tmp-*`` (hard links to
    blobs) and one during a signature check ``tmp/keys-*``: the sweep removed files, never
    folders, so both stayed for good."""
    store, _ = _published(tmp_path / "store", repo_dir)
    partial = store.root / "snapshots" / "vip" / "m" / ".tmp-killed"
    partial.mkdir(parents=True)
    os.link(next(store.root.glob("blobs/sha256/*/*")), partial / "weights")
    keys = store.blobs.tmp / "keys-killed"
    keys.mkdir()
    (keys / "alice.pub").write_text("a key")
    store.collect_uploads()
    assert partial.exists() and keys.exists()  # a request may be building them
    _later(monkeypatch, 2 * DAY)
    store.collect_uploads()
    assert not partial.exists() and not keys.exists()
    assert store.snapshot_dir("vip/m", store.index.rows("SELECT sha FROM commits")[0]["sha"])


def test_gc_in_the_object_store(s3_hub, seaweed, cli_env, capsys):
    s3 = seaweed.client()
    orphan = os.urandom(1000)
    orphan_sha = hashlib.sha256(orphan).hexdigest()
    s3.put_object(Bucket=BUCKET, Key=blob_key(orphan_sha), Body=orphan)
    twice = b"received for two repos" * 100
    oid = hashlib.sha256(twice).hexdigest()
    _lfs_upload(s3_hub, "lfs/upkeep", twice)
    abandoned = _lfs_upload(s3_hub, "lfs/upkeep", b"PUT, never verified", verify=False)
    # past the TTL and grace below, the fresh record then within them: the bucket dates its
    # objects by its own clock, so here (alone) real time passes rather than the store's clock.
    # The fresh record must still be within them when gc reads it: 12 s of margin for the upload
    # and the CLI's start on a loaded machine (5 s failed once, the suite beside other work)
    time.sleep(12.5)
    _lfs_upload(s3_hub, "lfs/upkeep-other", twice)  # a fresh record names the old upload
    cli_env.setenv("VIP_HUB_HUB__UPLOAD_TTL_S", "12")
    cli_env.setenv("VIP_HUB_HUB__GC_GRACE_S", "12")
    code, out = _cli(capsys, "gc")
    assert code == 0 and f"removed blob {orphan_sha}" in out, out
    blobs = {k.rsplit("/", 2)[1] + k.rsplit("/", 1)[1] for k in _keys(seaweed, "blobs/")}
    assert _named(s3_hub) <= blobs and orphan_sha not in blobs
    assert abandoned not in _keys(seaweed, "staging/")
    assert upload_key(oid) in _keys(seaweed, "uploads/")  # still named by lfs/upkeep-other's record
    reply = HTTP.post(
        f"{s3_hub.url}/lfs/upkeep-other.git/info/lfs/objects/batch",
        json={"operation": "upload", "objects": [{"oid": oid, "size": len(twice)}]},
        headers=AUTH,
    )
    assert "actions" not in reply.json()["objects"][0]  # held for lfs/upkeep-other: nothing to send


def test_a_replicas_cache_does_not_stand_for_the_bucket(s3_hub, seaweed):
    """What a replica's cache holds says nothing of the bucket: an upload the bucket lost is
    asked for again, and lands in the bucket, where any replica reads it."""
    data = b"cached here, gone from the bucket" * 100
    oid = hashlib.sha256(data).hexdigest()
    _lfs_upload(s3_hub, "lfs/upkeep", data)
    assert s3_hub.app.state.store.blobs.upload_path(oid).is_file()  # this replica's cache
    seaweed.client().delete_object(Bucket=BUCKET, Key=upload_key(oid))
    _lfs_upload(s3_hub, "lfs/upkeep", data)  # asked for again (not "held"), then verified
    assert upload_key(oid) in _keys(seaweed, "uploads/")


def test_check_in_the_object_store(s3_hub, seaweed, repo_dir, cli_env, capsys, monkeypatch):
    s3, store = seaweed.client(), s3_hub.app.state.store
    files = {rel: p.read_bytes() for rel, p in repo_files(repo_dir).items()}
    weights = hashlib.sha256(files[WEIGHTS_FILE]).hexdigest()
    config = hashlib.sha256(files[CONFIG_FILE]).hexdigest()
    s3.put_object(Bucket=BUCKET, Key=blob_key(weights), Body=b"x" * 100)  # corrupt in the bucket
    s3.delete_object(Bucket=BUCKET, Key=blob_key(config))  # missing from the bucket
    staged = _lfs_upload(s3_hub, "lfs/upkeep", b"in flight", verify=False)
    orphan = os.urandom(500)
    orphan_sha = hashlib.sha256(orphan).hexdigest()
    s3.put_object(Bucket=BUCKET, Key=blob_key(orphan_sha), Body=orphan)
    xorb = "cd" * 32
    s3.put_object(Bucket=BUCKET, Key=f"xet/xorbs/{xorb}", Body=b"\0" * 64)

    code, out = _cli(capsys, "check")
    assert code == 1
    assert "holds 100 bytes" in _lines(out, "corrupt", weights)[0]
    assert "PROBLEM" in _lines(out, "missing", config)[0]
    assert "in flight" in _lines(out, "staged", staged)[0]
    assert _lines(out, "orphan", orphan_sha) and _lines(out, "corrupt", f"xorb:{xorb}")

    # the hub's cache holds checked copies: --repair puts them back in the bucket
    cli_env.setenv("VIP_HUB_HUB__GC_GRACE_S", "1")
    cli_env.setenv("VIP_HUB_HUB__UPLOAD_TTL_S", "1")
    _later(monkeypatch, 2)  # the orphan past its grace
    code, out = _cli(capsys, "check", "--repair")
    assert "repaired" in _lines(out, "corrupt", weights)[0]
    assert "repaired" in _lines(out, "missing", config)[0]
    assert "repaired" in _lines(out, "orphan", orphan_sha)[0]
    assert code == 0, out
    body = s3.get_object(Bucket=BUCKET, Key=blob_key(weights))["Body"].read()
    assert body == files[WEIGHTS_FILE]
    assert blob_key(config) in _keys(seaweed, "blobs/")
    assert blob_key(orphan_sha) not in _keys(seaweed, "blobs/")
    assert f"xet/xorbs/{xorb}" not in _keys(seaweed, "xet/")
    for name in ("VIP_HUB_HUB__GC_GRACE_S", "VIP_HUB_HUB__UPLOAD_TTL_S"):
        cli_env.delenv(name)  # the uploads an operator puts back below are not stale

    # no copy left anywhere: the corrupt blob is kept (a commit names it) until an operator
    # puts the bytes among the uploads
    s3.put_object(Bucket=BUCKET, Key=blob_key(weights), Body=b"y" * 100)
    store.blobs.path(weights).unlink()
    code, out = _cli(capsys, "check", "--repair")
    assert code == 1 and "cannot repair" in _lines(out, "corrupt", weights)[0]
    assert blob_key(weights) in _keys(seaweed, "blobs/")
    s3.put_object(Bucket=BUCKET, Key=upload_key(weights), Body=b"z" * 100)  # not its bytes
    code, out = _cli(capsys, "check", "--repair")
    assert code == 1 and "cannot repair" in _lines(out, "corrupt", weights)[0]
    s3.put_object(Bucket=BUCKET, Key=upload_key(weights), Body=files[WEIGHTS_FILE])
    code, out = _cli(capsys, "check", "--repair")
    assert code == 0 and "repaired" in _lines(out, "corrupt", weights)[0], out
    body = s3.get_object(Bucket=BUCKET, Key=blob_key(weights))["Body"].read()
    assert body == files[WEIGHTS_FILE]


@pytest.mark.slow  # two processes, as the other crash tests
def test_a_commit_killed_after_storing_its_blobs_is_cleared_by_gc(
    seaweed, tmp_path, repo_dir, capsys, monkeypatch
):
    """A hub killed between storing a commit's new blob in the bucket and its index transaction
    leaves an orphan: the check reports it (within its grace period: no problem), gc removes
    it once older, and nothing a commit names is touched."""
    bucket = "upkeep-crash"
    seaweed.client().create_bucket(Bucket=bucket)
    env = {"VIP_HUB_OBJECT_STORE__ENDPOINT": seaweed.url, "VIP_HUB_OBJECT_STORE__BUCKET": bucket}
    for name, value in {**env, "VIP_HUB_STORE": str(tmp_path / "store")}.items():
        monkeypatch.setenv(name, value)
    files = {rel: p.read_bytes() for rel, p in repo_files(repo_dir).items()}
    objects = ObjectStoreSettings(endpoint=seaweed.url, bucket=bucket)
    _published(tmp_path / "store", repo_dir, objects, repo="crash/objgc")
    extra = b"stored, never indexed"
    orphan = hashlib.sha256(extra).hexdigest()
    server = ProcessServer(tmp_path / "store", extra_env={**env, CRASH_ENV: "commit-blobs-stored"})
    server.start()
    with pytest.raises(httpx.HTTPError):
        raw_commit(server.url, "crash/objgc", {**files, "notes/extra.txt": extra})
    assert server.proc.wait(30) == CRASH_STATUS
    listed = seaweed.client().list_objects_v2(Bucket=bucket, Prefix="blobs/")
    held = {o["Key"] for o in listed["Contents"]}
    assert blob_key(orphan) in held

    code, out = _cli(capsys, "check")
    assert code == 0 and "kept within hub.gc_grace_s" in _lines(out, "orphan", orphan)[0], out
    monkeypatch.setenv("VIP_HUB_HUB__GC_GRACE_S", "1")
    monkeypatch.setenv("VIP_HUB_HUB__UPLOAD_TTL_S", "1")
    _later(monkeypatch, 2)  # the orphan past its grace
    code, out = _cli(capsys, "gc")
    assert code == 0 and f"removed blob {orphan}" in out and "removed 1 blobs" in out, out
    listed = seaweed.client().list_objects_v2(Bucket=bucket, Prefix="blobs/")
    assert {o["Key"] for o in listed["Contents"]} == held - {blob_key(orphan)}
    code, out = _cli(capsys, "check")
    assert code == 0 and not out.splitlines()[:-1], out  # the index and the bucket agree
