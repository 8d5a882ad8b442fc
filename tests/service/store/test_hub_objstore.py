"""Blobs in a real S3-compatible object store (SeaweedFS, the session's ``seaweed`` fixture):
unmodified huggingface_hub and timm clients move bytes straight to and from the store through
presigned URLs; the hub trusts nothing a client staged before hashing it, and answers 503
with Retry-After (having written nothing) while the store is down."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import huggingface_hub
import pytest
import timm
import torch
from conftest import HUB_PORT
from huggingface_hub import HfApi, snapshot_download
from safetensors.torch import load_file
from support.helpers import lz4_xorb, tiny_repo_with_head, xorb_of
from support.live import (
    READ_TOKEN,
    WRITE_TOKEN,
    ThreadedServer,
    lfs_batch,
    lfs_commit,
    lfs_send,
    raw_commit,
    settings_for,
)
from support.seaweed import BUCKET

from service.settings import ObjectStoreSettings
from service.store import HubStore, clock
from service.store.errors import StoreUnavailable
from service.store.s3 import S3Objects, blob_key
from vip_hub.repo.verify import repo_files
from vip_hub.repo_format import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE

AUTH = {"Authorization": f"Bearer {WRITE_TOKEN}"}
CHUNK = 8 * 1024 * 1024  # the tiny repo's 22 MB weights go in 3 parts, its head in one PUT
HTTP = httpx.Client(timeout=60)  # generous: 2 shared cores, and the store restarts in a test


@pytest.fixture(scope="module")
def hub(seaweed, tmp_path_factory):
    """A live hub on HF_ENDPOINT's port whose blobs live in the session's SeaweedFS."""
    settings = settings_for(
        tmp_path_factory.mktemp("s3-hub"),
        object_store={"endpoint": seaweed.url, "bucket": BUCKET, "multipart_chunk_bytes": CHUNK},
    )
    with ThreadedServer(settings, port=HUB_PORT) as server:
        yield server


@pytest.fixture(scope="module")
def published(hub, tmp_path_factory) -> Path:
    """``lfs/s3`` published with ``upload_folder`` over presigned LFS (Xet off)."""
    folder = tiny_repo_with_head(tmp_path_factory.mktemp("s3-repo") / "vip-nano-s3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
        api.create_repo("lfs/s3")
        api.upload_folder(repo_id="lfs/s3", folder_path=folder, commit_message="v1")
    return folder


def _keys(seaweed, prefix: str) -> set[str]:
    listed = seaweed.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for o in listed.get("Contents", [])}


def test_clients_move_bytes_through_presigned_urls(hub, seaweed, published, tmp_path, monkeypatch):
    weights = (published / WEIGHTS_FILE).read_bytes()
    sha = hashlib.sha256(weights).hexdigest()
    # upload_folder's weights went to the bucket under their SHA-256, nothing left staged
    assert blob_key(sha) in _keys(seaweed, "blobs/")
    assert not _keys(seaweed, "staging/")

    # /resolve/ of an LFS file: a redirect to a presigned GET, with what the client checks
    url = f"{hub.url}/lfs/s3/resolve/main/{WEIGHTS_FILE}"
    head = HTTP.head(url)
    assert head.status_code == 302
    assert head.headers["location"].startswith(f"{seaweed.url}/{BUCKET}/{blob_key(sha)}?")
    assert "X-Amz-Signature=" in head.headers["location"]
    assert head.headers["x-linked-etag"] == f'"{sha}"'
    assert head.headers["x-linked-size"] == str(len(weights))
    assert head.headers["cache-control"] == "private, no-store"
    got = HTTP.get(head.headers["location"])
    assert got.content == weights and got.headers["cache-control"] == "private, no-store"

    snap = Path(snapshot_download("lfs/s3", endpoint=hub.url, cache_dir=tmp_path / "cache"))
    assert sorted(repo_files(snap)) == sorted(repo_files(published))
    for rel, path in repo_files(published).items():
        assert (snap / rel).read_bytes() == path.read_bytes(), rel

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)  # what HF_ENDPOINT does
    monkeypatch.setattr(
        huggingface_hub.constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "timm-cache"))
    model = timm.create_model("hf-hub:lfs/s3", pretrained=True)
    expected = load_file(published / WEIGHTS_FILE)
    state = model.state_dict()
    assert set(expected) <= set(state)
    assert all(torch.equal(state[k], t) for k, t in expected.items())


def test_private_files_are_presigned_for_readers_only(hub, published):
    HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo("secret/s3", private=True)
    data = (published / WEIGHTS_FILE).read_bytes()
    entry = lfs_batch(hub.url, "secret/s3", data)
    lfs_send(entry["actions"]["upload"], entry["oid"], data)
    verify = entry["actions"]["verify"]["href"]
    assert HTTP.post(verify, json={"oid": entry["oid"], "size": len(data)}, headers=AUTH).is_success
    files = {rel: p.read_bytes() for rel, p in repo_files(published).items()}
    files.pop(WEIGHTS_FILE)
    lines = [{"key": "header", "value": {"summary": "v1", "description": ""}}]
    lines += [
        {
            "key": "file",
            "value": {"path": p, "encoding": "base64", "content": base64.b64encode(b).decode()},
        }
        for p, b in files.items()
    ]
    lines.append(
        {
            "key": "lfsFile",
            "value": {
                "path": WEIGHTS_FILE,
                "algo": "sha256",
                "oid": entry["oid"],
                "size": len(data),
            },
        }
    )
    commit = HTTP.post(
        f"{hub.url}/api/models/secret/s3/commit/main",
        content="\n".join(map(json.dumps, lines)).encode(),
        headers={**AUTH, "Content-Type": "application/x-ndjson"},
        timeout=60,
    )
    assert commit.status_code == 200, commit.text
    url = f"{hub.url}/secret/s3/resolve/main/{WEIGHTS_FILE}"
    anonymous = HTTP.head(url)
    assert anonymous.status_code == 404 and "location" not in anonymous.headers
    reader = HTTP.head(url, headers={"Authorization": f"Bearer {READ_TOKEN}"})
    assert reader.status_code == 302
    assert HTTP.get(reader.headers["location"]).content == data


def test_presigned_urls_are_refused_for_another_key_or_once_expired(hub, seaweed, published):
    # an upload URL names its staging key alone: the store refuses it for any other key
    data = b"another object " * 1000
    href = lfs_batch(hub.url, "lfs/s3", data)["actions"]["upload"]["href"]
    assert "/staging/" in href
    sha = hashlib.sha256((published / WEIGHTS_FILE).read_bytes()).hexdigest()
    elsewhere = href.split("?")[0].rsplit("/staging/", 1)[0] + "/" + blob_key(sha)
    moved = HTTP.put(elsewhere + "?" + href.split("?", 1)[1], content=data)
    assert moved.status_code == 403 and "SignatureDoesNotMatch" in moved.text

    short = S3Objects(
        ObjectStoreSettings(endpoint=seaweed.url, bucket=BUCKET, presign_ttl_s=1)
    ).presign_get(blob_key(sha))
    time.sleep(2.5)  # past its one second of life
    expired = HTTP.get(short)  # refused for its age (not its signature: the key and host hold)
    assert expired.status_code == 403 and "Request has expired" in expired.text
    assert seaweed.client().head_object(Bucket=BUCKET, Key=blob_key(sha))  # untouched


def test_bytes_other_than_announced_are_never_committed(hub, seaweed, published):
    announced, sent = b"A" * 4096, b"B" * 4096  # same size: the store accepts the PUT
    entry = lfs_batch(hub.url, "lfs/s3", announced)
    href, verify = entry["actions"]["upload"]["href"], entry["actions"]["verify"]["href"]
    assert HTTP.put(href, content=sent).status_code == 200
    staged = href.split("?")[0].split(f"/{BUCKET}/", 1)[1]
    assert staged in _keys(seaweed, "staging/")
    refused = HTTP.post(verify, json={"oid": entry["oid"], "size": 4096}, headers=AUTH)
    assert refused.status_code == 400 and "SHA-256" in refused.text
    assert staged not in _keys(seaweed, "staging/")  # deleted
    head = HfApi(endpoint=hub.url).model_info("lfs/s3").sha
    commit = lfs_commit(hub.url, "lfs/s3", "extra.bin", announced)
    assert commit.status_code == 400 and "never uploaded" in commit.text
    assert HfApi(endpoint=hub.url).model_info("lfs/s3").sha == head
    assert blob_key(entry["oid"]) not in _keys(seaweed, "blobs/")
    # skipping verify does not help either: nothing staged is named before the hub hashed it
    skipped = lfs_batch(hub.url, "lfs/s3", announced)
    assert HTTP.put(skipped["actions"]["upload"]["href"], content=announced).status_code == 200
    assert lfs_commit(hub.url, "lfs/s3", "extra.bin", announced).status_code == 400


def test_store_down_answers_503_and_resumes(hub, seaweed, published):
    api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
    head = api.model_info("lfs/s3").sha
    card = (published / CARD_FILE).read_bytes() + b"\nA note on the card.\n"
    data = b"staged before the outage"
    entry = lfs_batch(hub.url, "lfs/s3", data)
    assert HTTP.put(entry["actions"]["upload"]["href"], content=data).status_code == 200
    seaweed.stop()
    try:
        verify = HTTP.post(
            entry["actions"]["verify"]["href"],
            json={"oid": entry["oid"], "size": len(data)},
            headers=AUTH,
        )
        assert verify.status_code == 503 and int(verify.headers["retry-after"]) > 0
        down = raw_commit(hub.url, "lfs/s3", {CARD_FILE: card})
        assert down.status_code == 503 and int(down.headers["retry-after"]) > 0
        assert api.model_info("lfs/s3").sha == head
    finally:
        seaweed.start()
    # nothing in the index names an object the store does not hold
    store = hub.app.state.store
    named = {r["sha256"] for r in store.index.rows("SELECT DISTINCT sha256 FROM files", ())}
    assert named and named <= {
        k.removeprefix("blobs/sha256/").replace("/", "") for k in _keys(seaweed, "blobs/")
    }
    # the same hub resumes without a restart (the staged upload is still there to verify, a
    # collection meanwhile keeping it: its reservation counts until it is verified)
    store.collect_uploads()
    verify = HTTP.post(
        entry["actions"]["verify"]["href"],
        json={"oid": entry["oid"], "size": len(data)},
        headers=AUTH,
    )
    assert verify.status_code == 200, verify.text
    up = raw_commit(hub.url, "lfs/s3", {CARD_FILE: card})
    assert up.status_code == 200, up.text
    assert api.model_info("lfs/s3").sha != head


def test_store_refusing_a_write_answers_503(seaweed, tmp_path, monkeypatch):
    """The store answering a file upload with an error (here: credentials it refuses) is a 503
    with Retry-After, as for every other call: boto3 wraps it in S3UploadFailedError, which was a
    500 (a Xet xorb, a file rebuilt from a shard, a commit's new blobs)."""
    import blake3

    from service.store.xet import _DATA_KEY, xorb_hash

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "0" * 40)  # not the store's
    settings = settings_for(tmp_path, object_store={"endpoint": seaweed.url, "bucket": BUCKET})
    with ThreadedServer(settings, port=None) as refused:
        HfApi(endpoint=refused.url, token=WRITE_TOKEN).create_repo("lfs/refused")
        grant = HTTP.get(
            f"{refused.url}/api/models/lfs/refused/xet-write-token/main", headers=AUTH
        ).json()
        chunk = b"a chunk the store will not take\n" * 64
        name = xorb_hash([(blake3.blake3(chunk, key=_DATA_KEY).digest(), len(chunk))])
        size = len(chunk).to_bytes(3, "little")
        r = HTTP.post(
            f"{grant['casUrl']}/v1/xorbs/default/{name}",
            content=bytes([0]) + size + bytes([0]) + size + chunk,
            headers={"Authorization": f"Bearer {grant['accessToken']}"},
        )
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
        assert "403 SignatureDoesNotMatch" in r.json()["error"]
        assert not [p for p in tmp_path.glob("xet/**/*") if p.is_file()]
        assert not list((tmp_path / "tmp").iterdir())


def _record(repo: str, oid: str = "") -> str:
    """The key of the upload record of ``oid`` for ``repo`` (the folder of them without)."""
    return f"uploads/for/{hashlib.sha256(repo.encode()).hexdigest()[:32]}/{oid}"


def test_xet_uploads_land_in_the_object_store(hub, seaweed, tmp_path):
    folder = tiny_repo_with_head(tmp_path / "vip-nano-xet", seed=2)
    api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
    api.create_repo("lfs/s3-xet")
    before = _keys(seaweed, "xet/xorbs/")
    api.upload_folder(repo_id="lfs/s3-xet", folder_path=folder, commit_message="v1")
    xorbs = _keys(seaweed, "xet/xorbs/") - before
    assert xorbs  # it went the Xet way: the xorbs to the bucket, with who sent them
    assert {k.rsplit("/", 1)[1] for k in _keys(seaweed, "xet/owners/")} >= {
        k.rsplit("/", 1)[1] for k in xorbs
    }
    assert not _keys(seaweed, _record("lfs/s3-xet"))  # the commit took its upload records
    weights = (folder / WEIGHTS_FILE).read_bytes()
    assert blob_key(hashlib.sha256(weights).hexdigest()) in _keys(seaweed, "blobs/")

    # a replica that never saw these xorbs (its cache wiped) rebuilds the same files from the
    # bucket: the client's shard names the xorbs it sent before and sends no bytes again
    cache = hub.app.state.store.xet.dir
    shutil.rmtree(cache)
    cache.mkdir()
    api.create_repo("lfs/s3-xet2")
    api.upload_folder(repo_id="lfs/s3-xet2", folder_path=folder, commit_message="v1")
    assert _keys(seaweed, "xet/xorbs/") - before == xorbs  # nothing sent again
    read_back = {p.parent.name + p.name for p in cache.rglob("*") if p.is_file()}
    assert read_back and {f"xet/xorbs/{x}" for x in read_back} <= xorbs
    for repo in ("lfs/s3-xet", "lfs/s3-xet2"):
        snap = Path(snapshot_download(repo, endpoint=hub.url, cache_dir=tmp_path / repo))
        assert (snap / WEIGHTS_FILE).read_bytes() == weights


def test_large_objects_go_in_presigned_parts(hub, seaweed, published):
    data = bytes(range(256)) * (CHUNK // 256) + b"tail"  # just over one part
    entry = lfs_batch(hub.url, "lfs/s3", data)
    upload = entry["actions"]["upload"]
    assert upload["header"]["chunk_size"] == str(CHUNK)
    assert len(upload["header"]) == 3  # chunk_size and two parts
    assert all(upload["header"][n].startswith(f"{seaweed.url}/{BUCKET}/staging/") for n in "12")
    lfs_send(upload, entry["oid"], data)
    verify = HTTP.post(
        entry["actions"]["verify"]["href"],
        json={"oid": entry["oid"], "size": len(data)},
        headers=AUTH,
    )
    assert verify.status_code == 200, verify.text
    assert _record("lfs/s3", entry["oid"]) in _keys(seaweed, "uploads/for/")  # any replica sees it
    assert lfs_batch(hub.url, "lfs/s3", data).get("actions") is None  # held for the repo now


# ------------------------------------------------------- failures: nothing left, the apt status


def _xet_shard(sha256: str, xorb: str, chunks: int, size: int) -> bytes:
    """A version-2 shard of one file (its SHA-256 in the metadata extension): ``chunks`` chunks
    of ``xorb``, ``size`` bytes unpacked."""
    import struct

    from service.store.xet import SHARD_TAG

    def raw(text: str) -> bytes:
        return b"".join(bytes.fromhex(text[i : i + 16])[::-1] for i in range(0, 64, 16))

    out = SHARD_TAG + struct.pack("<QQ", 2, 0) + b"\0" * 32 + struct.pack("<IIQ", 1 << 30, 1, 0)
    out += raw(xorb) + struct.pack("<IIII", 0, size, 0, chunks)
    return out + raw(sha256) + b"\0" * 16 + b"\xff" * 32 + b"\0" * 16


def _cas(hub, repo: str) -> tuple[str, dict[str, str]]:
    HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo(repo, exist_ok=True)
    grant = HTTP.get(f"{hub.url}/api/models/{repo}/xet-write-token/main", headers=AUTH).json()
    return grant["casUrl"], {"Authorization": f"Bearer {grant['accessToken']}"}


def test_a_shard_cut_by_the_store_going_down_leaves_no_temp_file(hub, seaweed, monkeypatch):
    """The store stopping while a file rebuilt from a shard goes to the bucket is a 503, and the
    rebuilt file does not stay in the store's tmp/ until the day's sweep."""
    cas, grant = _cas(hub, "lfs/s3-shard-down")
    chunk = b"rebuilt, then the store goes down\n" * 100
    name, xorb = xorb_of([chunk])
    assert HTTP.post(f"{cas}/v1/xorbs/default/{name}", content=xorb, headers=grant).is_success
    tmp = hub.app.state.store.blobs.tmp
    before = set(tmp.iterdir())
    put_file = S3Objects.put_file

    def down_then_put(self, path, key):
        if key.startswith("uploads/"):
            seaweed.stop()
        put_file(self, path, key)

    monkeypatch.setattr(S3Objects, "put_file", down_then_put)
    shard = _xet_shard(hashlib.sha256(chunk).hexdigest(), name, 1, len(chunk))
    try:
        r = HTTP.post(f"{cas}/v1/shards", content=shard, headers=grant)
    finally:
        monkeypatch.undo()
        seaweed.start()
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
    assert set(tmp.iterdir()) == before  # neither the shard nor the rebuilt file stays
    r = HTTP.post(f"{cas}/v1/shards", content=shard, headers=grant)  # the retry succeeds
    assert r.status_code == 200, r.text


def test_corrupt_stored_objects_are_the_servers_fault(hub, seaweed, published):
    """Bytes read back from the bucket that are not what the hub stored under that key (a blob,
    a xorb) are a 500 naming the store's corruption, not a 400 blaming the request; bytes a
    client sent that are not the object announced stay a 400."""
    store, s3 = hub.app.state.store, seaweed.client()
    config = (published / CONFIG_FILE).read_bytes()
    sha = hashlib.sha256(config).hexdigest()
    s3.put_object(Bucket=BUCKET, Key=blob_key(sha), Body=b"{}" + b" " * (len(config) - 2))
    store.blobs.path(sha).unlink(missing_ok=True)  # this replica reads the bucket's copy
    try:
        r = HTTP.get(f"{hub.url}/lfs/s3/resolve/main/{CONFIG_FILE}")
        assert r.status_code == 500, r.text
        assert "corrupt" in r.json()["error"] and "store check" in r.json()["error"]
    finally:
        s3.put_object(Bucket=BUCKET, Key=blob_key(sha), Body=config)
    assert HTTP.get(f"{hub.url}/lfs/s3/resolve/main/{CONFIG_FILE}").content == config

    cas, grant = _cas(hub, "lfs/s3-corrupt-xorb")
    chunk = b"a xorb the bucket garbles\n" * 100
    name, xorb = xorb_of([chunk])
    assert HTTP.post(f"{cas}/v1/xorbs/default/{name}", content=xorb, headers=grant).is_success
    s3.put_object(Bucket=BUCKET, Key=f"xet/xorbs/{name}", Body=b"\xee" * len(xorb))
    store.xet.xorb_path(name).unlink()
    shard = _xet_shard(hashlib.sha256(chunk).hexdigest(), name, 1, len(chunk))
    r = HTTP.post(f"{cas}/v1/shards", content=shard, headers=grant)
    assert r.status_code == 500 and "corrupt" in r.json()["error"], r.text

    # a client's own bytes that are not the object it announced: still its fault
    entry = lfs_batch(hub.url, "lfs/s3", b"C" * 4096)
    assert HTTP.put(entry["actions"]["upload"]["href"], content=b"D" * 4096).status_code == 200
    verify = entry["actions"]["verify"]["href"]
    r = HTTP.post(verify, json={"oid": entry["oid"], "size": 4096}, headers=AUTH)
    assert r.status_code == 400 and "SHA-256" in r.text


def test_multipart_uploads_cut_by_an_outage_are_aborted(seaweed, tmp_path, monkeypatch):
    """A xorb over the multipart threshold whose upload the store's outage cuts (boto3's own
    abort fails too: the store is down) leaves a multipart upload, with its parts, in the
    bucket: the uploads' collection aborts it once older than hub.upload_ttl_s, as it does
    under staging/."""
    bucket = "multipart-outage"
    seaweed.client().create_bucket(Bucket=bucket)
    objects = ObjectStoreSettings(endpoint=seaweed.url, bucket=bucket)
    chunks = [os.urandom(128 * 1024) for _ in range(8 * 66)]  # 66 MiB: two parts
    name, xorb = xorb_of(chunks)
    with HubStore(tmp_path / "store", objects=objects) as store:
        sent = store.blobs.new_temp()
        sent.write_bytes(xorb)
        client, stopped = store.blobs.remote._client, []

        def stop_store(**kwargs):
            if not stopped:
                stopped.append(True)
                seaweed.stop()

        client.meta.events.register("before-call.s3.UploadPart", stop_store)
        try:
            with pytest.raises(StoreUnavailable):
                store.xet.put_xorb(name, sent, "alice")
        finally:
            client.meta.events.unregister("before-call.s3.UploadPart", stop_store)
            seaweed.start()
        assert stopped

        def unfinished() -> list[str]:
            listed = seaweed.client().list_multipart_uploads(Bucket=bucket)
            return [u["Key"] for u in listed.get("Uploads", [])]

        assert unfinished() == [f"xet/xorbs/{name}"]
        ahead = clock.now() + store.limits.upload_ttl_s + 60 - time.time()
        monkeypatch.setattr(clock, "now", lambda: time.time() + ahead)
        store.collect_uploads()
        assert unfinished() == []


def test_a_fetched_xorb_never_replaces_a_copy_fetched_meanwhile(seaweed, tmp_path, monkeypatch):
    """A replica fetches a xorb it does not hold into its cache on first use. Two shards
    fetching it at once (the bucket's packing changed between them: a hash names the chunks,
    not their packing) put their copies in place in turn: the second replaced the first under a
    shard reading it at the offsets it had found. The first copy in place stays."""
    bucket = "xorb-fetch-race"
    seaweed.client().create_bucket(Bucket=bucket)
    objects = ObjectStoreSettings(endpoint=seaweed.url, bucket=bucket)
    chunks = [b"chunk one " * 100, b"chunk two " * 100]
    name, raw = xorb_of(chunks)
    with HubStore(tmp_path / "store", objects=objects) as store:
        sent = store.blobs.new_temp()
        sent.write_bytes(raw)
        store.xet.put_xorb(name, sent, "alice")
        path = store.xet.xorb_path(name)
        path.unlink()  # as on a replica that never held it
        first = lz4_xorb(chunks)  # another shard's copy, fetched before the bucket changed
        fetched = store.xet._fetched

        def then_another_shard_places_its_copy(xorb: str) -> Path:
            got = fetched(xorb)
            path.write_bytes(first)
            return got

        monkeypatch.setattr(store.xet, "_fetched", then_another_shard_places_its_copy)
        assert store.xet._local(name) == path
        assert path.read_bytes() == first
        assert not list(store.blobs.tmp.glob("*"))  # the second copy is gone


def _uploaded(hub, repo: str, data: bytes) -> str:
    """``data`` sent for ``repo`` through the LFS batch API and verified; its SHA-256."""
    entry = lfs_batch(hub.url, repo, data)
    lfs_send(entry["actions"]["upload"], entry["oid"], data)
    verify = entry["actions"]["verify"]["href"]
    r = HTTP.post(verify, json={"oid": entry["oid"], "size": len(data)}, headers=AUTH)
    assert r.status_code == 200, r.text
    return entry["oid"]


def test_a_commit_stores_only_bytes_it_has_just_hashed(hub, seaweed, published):
    """A commit copied the bucket's upload key to the blob key without hashing it, so bytes
    planted (or rotted) there after the upload was checked became the committed blob, served
    with the SHA-256 of what was uploaded; and a commit naming an object the repo held sent this
    replica's cache copy, rotted or not, over the bucket's good blob. Now it sends only bytes it
    has just hashed, and never sends a blob the bucket holds."""
    from service.store.s3 import upload_key

    s3, store = seaweed.client(), hub.app.state.store
    data = b"honest bytes\n" * 5000
    sha = _uploaded(hub, "lfs/s3", data)
    s3.put_object(Bucket=BUCKET, Key=upload_key(sha), Body=b"PLANTED\n" * 8125)  # same size
    assert lfs_commit(hub.url, "lfs/s3", "planted.txt", data).status_code == 200
    stored = s3.get_object(Bucket=BUCKET, Key=blob_key(sha))["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == sha
    assert (
        HTTP.get(f"{hub.url}/lfs/s3/resolve/main/planted.txt", follow_redirects=True).content
        == data
    )

    cache = store.blobs.path(sha)
    os.chmod(cache, 0o600)
    cache.write_bytes(b"rotted" + data[6:])
    assert lfs_commit(hub.url, "lfs/s3", "again.txt", data).status_code == 200
    stored = s3.get_object(Bucket=BUCKET, Key=blob_key(sha))["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == sha  # the bucket's good copy stays
    cache.unlink()


def test_an_upload_moved_by_another_replicas_commit_meanwhile_is_found(
    hub, seaweed, published, monkeypatch
):
    """Another replica's commit of the same object moved the upload key to the blob key
    between this commit's look and its read: the store's "no such key" was a raw 500. The read
    now answers "not there" and the commit looks again."""
    from service.store.s3 import upload_key

    s3, blobs = seaweed.client(), hub.app.state.store.blobs
    data = b"moved meanwhile\n" * 3000
    sha = _uploaded(hub, "lfs/s3", data)
    blobs.upload_path(sha).unlink()  # this replica never saw the upload: it reads the bucket
    fetch = blobs._fetch

    def moved_first(key: str, *args, **kwargs):
        if key == upload_key(sha):  # the other replica's commit, just before this read
            s3.copy_object(
                Bucket=BUCKET, Key=blob_key(sha), CopySource={"Bucket": BUCKET, "Key": key}
            )
            s3.delete_object(Bucket=BUCKET, Key=key)
        return fetch(key, *args, **kwargs)

    monkeypatch.setattr(blobs, "_fetch", moved_first)
    r = lfs_commit(hub.url, "lfs/s3", "moved.txt", data)
    assert r.status_code == 200, r.text
    assert (
        HTTP.get(f"{hub.url}/lfs/s3/resolve/main/moved.txt", follow_redirects=True).content == data
    )
