"""What a hub with an object store trusts (issue 53): an object under a content key
(``uploads/sha256/X``, ``blobs/sha256/X``) is exactly bytes the hub hashed, on every upload path
(a single presigned PUT, presigned parts, Xet), whatever a client does with a URL it was given
and whatever the bucket already holds under that name. Against the session's real SeaweedFS."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from urllib.parse import parse_qs, urlsplit

import httpx
import huggingface_hub
import pytest
from huggingface_hub import HfApi, hf_hub_download
from support.helpers import tiny_repo_with_head
from support.live import (
    ADMIN_TOKEN,
    WRITE_TOKEN,
    ThreadedServer,
    lfs_batch,
    lfs_commit,
    lfs_complete,
    lfs_part_urls,
    lfs_send,
    settings_for,
)
from support.seaweed import BUCKET

from service.store.s3 import (
    BLOB_TYPE,
    CHECKING,
    S3Objects,
    blob_key,
    staging_key,
    upload_key,
)
from service.store.upkeep import check_store
from vip_hub.repo_format import WEIGHTS_FILE

CHUNK = 12 * 1024 * 1024  # parts of 12 MiB: an 11 MiB file goes in one PUT and is served by
# redirect to its blob key (over LFS_THRESHOLD), as is a file of two parts
SIZES = pytest.mark.parametrize("size", [11 << 20, CHUNK + 4096], ids=["single-put", "parts"])
HTTP = httpx.Client(timeout=60)
REPO = "lfs/trust"


@pytest.fixture(scope="module")
def hub(seaweed, tmp_path_factory):
    """A live hub whose blobs live in the session's SeaweedFS, ``REPO`` published on it."""
    settings = settings_for(
        tmp_path_factory.mktemp("trust-hub"),
        object_store={"endpoint": seaweed.url, "bucket": BUCKET, "multipart_chunk_bytes": CHUNK},
    )
    with ThreadedServer(settings, port=None) as server:
        folder = tiny_repo_with_head(tmp_path_factory.mktemp("trust-repo") / "vip-nano-trust")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
            api = HfApi(endpoint=server.url, token=WRITE_TOKEN)
            api.create_repo(REPO)
            api.upload_folder(repo_id=REPO, folder_path=folder, commit_message="v1")
        yield server


def _text(size: int) -> bytes:
    """``size`` bytes of fresh plain text (a file kind any repo may carry; each line opens with
    '#', no pickle opcode, so the content rules' pickle walk never takes it for one)."""
    line = ("# " + secrets.token_hex(30) + "\n").encode()
    return (line * (size // len(line) + 1))[:size]


def _verify(entry: dict, size: int, token: str = WRITE_TOKEN) -> httpx.Response:
    return HTTP.post(
        entry["actions"]["verify"]["href"],
        json={"oid": entry["oid"], "size": size},
        headers={"Authorization": f"Bearer {token}"},
    )


def _held(seaweed, key: str) -> str | None:
    """The SHA-256 of what the bucket holds under ``key``, None when nothing."""
    try:
        body = seaweed.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    except seaweed.client().exceptions.NoSuchKey:
        return None
    return hashlib.sha256(body).hexdigest()


def _downloaded(hub, path: str, tmp_path, repo: str = REPO) -> bytes:
    local = hf_hub_download(repo, path, endpoint=hub.url, cache_dir=tmp_path / "dl")
    with open(local, "rb") as f:
        return f.read()


def _assert_content_keys_hold(seaweed, sha: str) -> None:
    """Every content key of object ``sha`` the bucket holds holds exactly its bytes."""
    for key in (upload_key(sha), blob_key(sha)):
        assert _held(seaweed, key) in (None, sha), key


def _after_hash(monkeypatch, action) -> list[str]:
    """Run ``action()`` once, right after the hub has read back (hashed) the first staged or
    checked object of the next verify: between its hash and what follows. Returns the keys read."""
    read_into, read = S3Objects.read_into, []

    def hooked(self, key, write, limit):
        read_into(self, key, write, limit)
        read.append(key)
        if len(read) == 1 and not key.startswith(("blobs/", "uploads/", "xet/")):
            action()

    monkeypatch.setattr(S3Objects, "read_into", hooked)
    return read


@SIZES
def test_staged_bytes_swapped_after_the_hash_are_never_kept(
    hub, seaweed, monkeypatch, tmp_path, size
):
    data, bad = _text(size), _text(size)  # same length: the signed length holds
    entry = lfs_batch(hub.url, REPO, data)
    upload = entry["actions"]["upload"]
    lfs_send(upload, entry["oid"], data)

    def swap() -> None:  # the client writes other bytes through the URL it still holds
        if "chunk_size" in (upload.get("header") or {}):
            etags = [
                HTTP.put(url, content=bad[i * CHUNK : (i + 1) * CHUNK]).headers.get("etag", "")
                for i, url in enumerate(lfs_part_urls(upload))
            ]
            lfs_complete(upload, entry["oid"], etags)  # completed again (or refused: either way)
        else:
            assert HTTP.put(upload["href"], content=bad).status_code == 200

    read = _after_hash(monkeypatch, swap)
    assert _verify(entry, size).status_code == 200
    assert read, "verify read nothing back"
    monkeypatch.undo()
    _assert_content_keys_hold(seaweed, entry["oid"])
    assert lfs_commit(hub.url, REPO, f"swap-{size}.txt", data).status_code == 200
    assert _downloaded(hub, f"swap-{size}.txt", tmp_path) == data
    _assert_content_keys_hold(seaweed, entry["oid"])


def test_staged_bytes_swapped_before_the_hash_are_never_kept(hub, seaweed, monkeypatch):
    """The client stages other bytes, then the object's own once the hub has copied the staged
    object aside to hash it: the hub hashes that copy, not the staged key (which would pass and
    keep the copy's other bytes under the object's name), so the verify is refused."""
    size = 11 << 20
    data, bad = _text(size), _text(size)
    entry = lfs_batch(hub.url, REPO, data)
    upload = entry["actions"]["upload"]
    lfs_send(upload, entry["oid"], bad)
    copy, copied = S3Objects.copy, []

    def hooked(self, source: str, key: str) -> None:
        copy(self, source, key)
        if key.startswith(CHECKING) and not copied:
            copied.append(key)
            assert HTTP.put(upload["href"], content=data).status_code == 200

    monkeypatch.setattr(S3Objects, "copy", hooked)
    r = _verify(entry, size)
    assert copied and r.status_code == 400 and "not object" in r.json()["error"], r.text
    monkeypatch.undo()
    _assert_content_keys_hold(seaweed, entry["oid"])


def _plant(seaweed, sha: str, size: int) -> None:
    """Wrong bytes of the right size under both content keys of ``sha``."""
    for key in (upload_key(sha), blob_key(sha)):
        seaweed.client().put_object(Bucket=BUCKET, Key=key, Body=_text(size))
    assert _held(seaweed, blob_key(sha)) != sha


@SIZES
def test_planted_bytes_are_never_served_after_an_lfs_push(hub, seaweed, tmp_path, size):
    data = _text(size)
    sha = hashlib.sha256(data).hexdigest()
    _plant(seaweed, sha, size)
    entry = lfs_batch(hub.url, REPO, data)
    lfs_send(entry["actions"]["upload"], sha, data)
    assert _verify(entry, size).status_code == 200
    assert lfs_commit(hub.url, REPO, f"planted-{size}.txt", data).status_code == 200
    assert _downloaded(hub, f"planted-{size}.txt", tmp_path) == data
    _assert_content_keys_hold(seaweed, sha)


def test_planted_bytes_are_never_served_after_a_xet_push(hub, seaweed, tmp_path):
    folder = tiny_repo_with_head(tmp_path / "vip-nano-xet", seed=7)
    weights = (folder / WEIGHTS_FILE).read_bytes()
    sha = hashlib.sha256(weights).hexdigest()
    _plant(seaweed, sha, len(weights))
    api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
    api.create_repo("lfs/trust-xet", private=True)
    xorbs = {o["Key"] for o in seaweed.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])}
    api.upload_folder(repo_id="lfs/trust-xet", folder_path=folder, commit_message="v1")
    after = {o["Key"] for o in seaweed.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])}
    assert any(k.startswith("xet/xorbs/") for k in after - xorbs)  # it went the Xet way
    local = hf_hub_download(
        "lfs/trust-xet",
        WEIGHTS_FILE,
        endpoint=hub.url,
        token=WRITE_TOKEN,
        cache_dir=tmp_path / "dl",
    )
    with open(local, "rb") as f:
        assert f.read() == weights
    _assert_content_keys_hold(seaweed, sha)


def test_a_single_file_commit_replaces_planted_bytes(hub, seaweed, tmp_path):
    data = b"a small file committed inline, not through LFS\n"
    sha = hashlib.sha256(data).hexdigest()
    _plant(seaweed, sha, len(data))
    api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
    api.upload_file(path_or_fileobj=data, path_in_repo="inline.txt", repo_id=REPO)
    assert _downloaded(hub, "inline.txt", tmp_path) == data
    assert _held(seaweed, blob_key(sha)) == sha  # sent from the commit's own bytes


def test_parts_sent_again_during_and_after_verify_change_nothing(
    hub, seaweed, monkeypatch, tmp_path
):
    size = CHUNK + 1000
    data, bad = _text(size), _text(size)
    entry = lfs_batch(hub.url, REPO, data)
    upload = entry["actions"]["upload"]
    urls = lfs_part_urls(upload)
    etags = [
        HTTP.put(url, content=data[i * CHUNK : (i + 1) * CHUNK]).headers["etag"]
        for i, url in enumerate(urls)
    ]
    assert lfs_complete(upload, entry["oid"], etags).is_success
    # during verify: a part sent again (with other bytes) and the upload completed again
    _after_hash(
        monkeypatch,
        lambda: (HTTP.put(urls[0], content=bad[:CHUNK]), lfs_complete(upload, entry["oid"], etags)),
    )
    assert _verify(entry, size).status_code == 200
    monkeypatch.undo()
    # after verify: the same again
    again = HTTP.put(urls[0], content=bad[:CHUNK])
    lfs_complete(upload, entry["oid"], [again.headers.get("etag", ""), *etags[1:]])
    _assert_content_keys_hold(seaweed, entry["oid"])
    assert lfs_commit(hub.url, REPO, "parts-again.txt", data).status_code == 200
    assert _downloaded(hub, "parts-again.txt", tmp_path) == data
    _assert_content_keys_hold(seaweed, entry["oid"])


def test_a_part_longer_than_its_share_is_refused(hub):
    data = _text(CHUNK + 4096)
    upload = lfs_batch(hub.url, REPO, data)["actions"]["upload"]
    first = lfs_part_urls(upload)[0]
    longer = HTTP.put(first, content=data[:CHUNK] + b"x" * (CHUNK // 2))
    assert longer.status_code == 403, longer.text  # its length is signed
    assert HTTP.put(first, content=data[:CHUNK]).status_code == 200


def test_verify_makes_the_same_store_calls_whether_or_not_the_object_is_held(
    hub, seaweed, monkeypatch
):
    """No existence oracle: verifying bytes that another repo holds costs what verifying unknown
    bytes does, call for call (timing follows from the calls)."""
    HfApi(endpoint=hub.url, token=WRITE_TOKEN).create_repo("lfs/trust-other")
    held = _text(4096)
    entry = lfs_batch(hub.url, REPO, held)
    lfs_send(entry["actions"]["upload"], entry["oid"], held)
    assert _verify(entry, len(held)).status_code == 200
    committed = lfs_commit(hub.url, REPO, "held.txt", held)
    assert committed.status_code == 200, committed.text  # now a blob of REPO

    calls: list[tuple[str, str]] = []
    for name in ("size", "read_into", "copy", "delete", "put_file", "put_bytes"):
        method = getattr(S3Objects, name)

        def record(self, *args, _name=name, _method=method, **kwargs):
            keys = [a for a in args if isinstance(a, str)]
            calls.append((_name, "/".join(k.split("/", 1)[0] for k in keys)))
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(S3Objects, name, record)

    def verified(data: bytes) -> list[tuple[str, str]]:
        entry = lfs_batch(hub.url, "lfs/trust-other", data)
        lfs_send(entry["actions"]["upload"], entry["oid"], data)
        calls.clear()
        assert _verify(entry, len(data)).status_code == 200
        return list(calls)

    a, b = verified(held), verified(_text(4096))
    assert a == b, (a, b)


def test_store_check_reports_and_repairs_wrong_bytes_under_uploads(hub, seaweed):
    data = _text(2048)
    sha = hashlib.sha256(data).hexdigest()
    seaweed.client().put_object(Bucket=BUCKET, Key=upload_key(sha), Body=_text(2048))
    store = hub.app.state.store
    grace = store.limits.upload_ttl_s
    found = [f for f in check_store(store, repair=False, grace=grace) if sha in f.what]
    assert [(f.kind, f.problem) for f in found] == [("corrupt", True)], found
    repaired = [f for f in check_store(store, repair=True, grace=grace) if sha in f.what]
    assert repaired and all(f.repaired for f in repaired)
    assert _held(seaweed, upload_key(sha)) is None


def test_store_check_reports_an_orphan_blob_with_wrong_bytes(hub, seaweed):
    sha = hashlib.sha256(b"never committed").hexdigest()
    seaweed.client().put_object(Bucket=BUCKET, Key=blob_key(sha), Body=b"something else")
    store = hub.app.state.store
    found = [f for f in check_store(store, repair=False, grace=3600.0) if sha in f.what]
    assert ("corrupt", True) in [(f.kind, f.problem) for f in found], found
    check_store(store, repair=True, grace=3600.0)
    assert _held(seaweed, blob_key(sha)) is None


def test_staged_bytes_per_user_are_capped(hub, monkeypatch):
    """Outstanding staging grants count against their user (root: no other test uses it)."""
    limit = 3 * 4096
    monkeypatch.setattr(hub.app.state.settings.object_store, "max_staged_bytes", limit)
    entries = [lfs_batch(hub.url, REPO, _text(4096), ADMIN_TOKEN) for _ in range(3)]
    assert all("actions" in e for e in entries), entries
    over = lfs_batch(hub.url, REPO, _text(4096), ADMIN_TOKEN)
    assert "actions" not in over and over["error"]["code"] == 429, over
    assert "staged" in over["error"]["message"]
    for e in entries:  # never sent: refused at verify, which gives their shares back
        assert _verify(e, 4096, ADMIN_TOKEN).status_code == 400
    data = _text(4096)
    entry = lfs_batch(hub.url, REPO, data, ADMIN_TOKEN)
    lfs_send(entry["actions"]["upload"], entry["oid"], data)
    assert _verify(entry, len(data), ADMIN_TOKEN).status_code == 200
    assert all("actions" in lfs_batch(hub.url, REPO, _text(4096), ADMIN_TOKEN) for _ in range(3))


def _staged_at(entry: dict) -> str:
    """The staging key an LFS batch entry's presigned upload goes to (its verify names it)."""
    return staging_key(parse_qs(urlsplit(entry["actions"]["verify"]["href"]).query)["staged"][0])


def test_bytes_sent_again_after_verify_are_collected(hub, seaweed):
    """A presigned PUT URL stays valid after its verify, which gave its bytes' share of the
    staging quota back: bytes sent through it again sat in the bucket, counted by no quota,
    until the uploads' time-to-live (a day). The next collection removes them now, and keeps a
    staged upload whose reservation still counts (sent, not yet verified)."""
    data, waiting = _text(4096), _text(4096)
    entry = lfs_batch(hub.url, REPO, data)
    lfs_send(entry["actions"]["upload"], entry["oid"], data)
    assert _verify(entry, len(data)).status_code == 200
    again = _text(4096)  # the same length: the URL signs it
    assert HTTP.put(entry["actions"]["upload"]["href"], content=again).status_code == 200
    sent_again = _staged_at(entry)
    pending = lfs_batch(hub.url, REPO, waiting)
    lfs_send(pending["actions"]["upload"], pending["oid"], waiting)
    reserved = _staged_at(pending)
    assert _held(seaweed, sent_again) == hashlib.sha256(again).hexdigest()
    hub.app.state.store.collect_uploads()
    assert _held(seaweed, sent_again) is None
    assert _held(seaweed, reserved) == hashlib.sha256(waiting).hexdigest()
    assert _verify(pending, len(waiting)).status_code == 200  # and it verifies after


def test_concurrent_verifies_of_one_object_keep_its_bytes(hub, seaweed, tmp_path):
    """Two uploads of the same object, one with wrong bytes, verified at once."""
    data = _text(CHUNK + 10)
    good, evil = lfs_batch(hub.url, REPO, data), lfs_batch(hub.url, REPO, data)
    lfs_send(good["actions"]["upload"], good["oid"], data)
    lfs_send(evil["actions"]["upload"], evil["oid"], _text(CHUNK + 10))
    answers: dict[str, int] = {}
    threads = [
        threading.Thread(
            target=lambda k=k, e=e: answers.__setitem__(k, _verify(e, len(data)).status_code)
        )
        for k, e in (("good", good), ("evil", evil))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {"good": 200, "evil": 400}
    _assert_content_keys_hold(seaweed, good["oid"])


def test_an_upload_of_a_stored_object_is_consumed_by_its_commit(hub, seaweed, tmp_path):
    """An object sent again (a second repo's copy of stored bytes) is written and checked like a
    new one, and its commit consumes the upload: neither the bucket's upload key nor the hub's
    cache keeps it until the uploads' collection."""
    data = _text(1 << 20)
    sha = hashlib.sha256(data).hexdigest()
    api = HfApi(endpoint=hub.url, token=WRITE_TOKEN)
    api.create_repo("lfs/trust-again")
    folder = tiny_repo_with_head(tmp_path / "vip-nano-again")
    api.upload_folder(repo_id="lfs/trust-again", folder_path=folder, commit_message="v1")
    for repo in (REPO, "lfs/trust-again"):
        entry = lfs_batch(hub.url, repo, data)
        lfs_send(entry["actions"]["upload"], sha, data)
        assert _verify(entry, len(data)).status_code == 200
        assert lfs_commit(hub.url, repo, "copied.txt", data).status_code == 200
        assert _held(seaweed, upload_key(sha)) is None, repo
        assert _held(seaweed, blob_key(sha)) == sha
        assert not list((hub.settings.store / "uploads" / "sha256").rglob(sha[2:])), repo


def test_headers_an_uploader_sends_are_never_what_a_download_is_served_with(hub, seaweed):
    """A presigned PUT signs the length only: an uploader could send ``Content-Type: text/html``
    and ``Content-Disposition: inline`` (or ``Content-Encoding: gzip``, over another publisher's
    identical object), which each copy kept and the store sent to whoever followed /resolve's
    redirect: a publisher's script run as a page on the store's origin. Each copy now replaces
    the headers, and the presigned GET names the ones the hub serves the path with."""
    data = b"<html><script>alert(document.domain)</script>\n" + _text(11 << 20)
    entry = lfs_batch(hub.url, REPO, data)
    hostile = {"Content-Type": "text/html", "Content-Disposition": "inline"}
    put = HTTP.put(entry["actions"]["upload"]["href"], content=data, headers=hostile)
    assert put.status_code == 200
    assert _verify(entry, len(data)).status_code == 200
    assert lfs_commit(hub.url, REPO, "page.txt", data).status_code == 200
    stored = seaweed.client().head_object(Bucket=BUCKET, Key=blob_key(entry["oid"]))
    assert stored["ContentType"] == BLOB_TYPE and "ContentDisposition" not in stored
    redirect = HTTP.get(f"{hub.url}/{REPO}/resolve/main/page.txt", follow_redirects=False)
    assert redirect.status_code == 302
    with HTTP.stream("GET", redirect.headers["location"]) as served:
        assert served.status_code == 200
        assert served.headers["content-type"] == BLOB_TYPE
        assert served.headers["content-disposition"] == "attachment"
        assert served.headers.get("content-encoding", "identity") == "identity"


def test_grants_end_when_an_unverified_upload_would_be_collected(hub, monkeypatch):
    """A staged upload's reservation lapses ``hub.upload_ttl_s`` after its batch, when its bytes
    may be collected: an operator's time-to-live under the grants' hour shortens every grant
    and presigned URL of the batch to it, so no verify is granted for bytes already gone."""
    monkeypatch.setattr(hub.app.state.store.limits, "upload_ttl_s", 600.0)
    before = time.time()
    entry = lfs_batch(hub.url, REPO, _text(CHUNK + 4096))
    actions = entry["actions"]
    assert actions["verify"]["expires_in"] == actions["upload"]["expires_in"] == 600, actions
    for href in (actions["verify"]["href"], actions["upload"]["href"]):
        expiry = int(parse_qs(urlsplit(href).query)["grant"][0].split(".")[0])
        assert int(before) + 600 <= expiry <= time.time() + 600, (href, expiry - before)
    parts = lfs_part_urls(actions["upload"])
    assert len(parts) == 2
    assert all(parse_qs(urlsplit(url).query)["X-Amz-Expires"] == ["600"] for url in parts), parts
    single = lfs_batch(hub.url, REPO, _text(4096))["actions"]["upload"]
    assert parse_qs(urlsplit(single["href"]).query)["X-Amz-Expires"] == ["600"], single
