"""Who may do what (issue 24): users own their namespace and their organisations'; objects do
not cross repos; private names and bytes stay private (listings, /readyz, /metrics, caches,
file modes); Xet uploads are checked against their content and end with their token; tags;
open inference routes take the OpenAI client's placeholder key. A real server, real clients."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from PIL import Image
from support.helpers import lz4_chunk, lz4_xorb, tiny_repo_with_head
from support.live import ThreadedServer, lfs_batch, raw_commit

from service.app import create_app
from service.auth import check_grant, create_token, revoke_token, sign_grant
from service.errors import Unauthorized
from service.hub import lfs as lfs_route
from service.hub import xet as xet_route
from service.hub.uploads import CommitParser
from service.settings import Settings
from service.store.blobs import DigestWriter
from service.store.errors import NoSuchRevision
from service.store.xet import MAX_CHUNK, SHARD_TAG, xet_hex, xorb_hash, xorb_oid
from vip_hub.cli.main import main
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import CONFIG_FILE, WEIGHTS_FILE

ALICE, BOB, CAROL, DAVE, ROOT = "vh_alice", "vh_bob", "vh_carol", "vh_dave", "vh_root"
TOKENS = (
    f"alice:write:{ALICE};bob:read:{BOB};carol:write:{CAROL};dave:read:{DAVE};root:admin:{ROOT}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("access-store")
    settings = Settings(store=store, auth={"tokens": TOKENS, "orgs": {"team": ["alice", "dave"]}})
    with ThreadedServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def repos(server, tmp_path_factory) -> dict[str, Path]:
    """alice/secret (private), alice/public and team/private, published by alice; carol/mine by
    carol."""
    base = tmp_path_factory.mktemp("access-repos")
    folders = {
        "alice/secret": tiny_repo_with_head(base / "secret", seed=3),
        "alice/public": tiny_repo_with_head(base / "public", seed=4),
        "team/private": tiny_repo_with_head(base / "team", seed=5),
    }
    for repo_id, folder in folders.items():
        push_repo(
            folder, repo_id, endpoint=server.url, token=ALICE, private=repo_id != "alice/public"
        )
    push_repo(
        folders["alice/public"], "carol/mine", endpoint=server.url, token=CAROL
    )  # her own namespace
    return folders


def _api(server: ThreadedServer, token: str | None = None) -> HfApi:
    return HfApi(endpoint=server.url, token=token)


def _status(call) -> int:
    with pytest.raises(HfHubHTTPError) as err:
        call()
    return err.value.response.status_code


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_users_write_only_to_their_namespaces(server, repos, tmp_path):
    carol, alice = _api(server, CAROL), _api(server, ALICE)
    card = CommitOperationAdd("notes.txt", b"carol was here")
    # someone else's public repo: 403, as the HF hub answers
    assert _status(lambda: carol.create_commit("alice/public", [card], commit_message="x")) == 403
    assert _status(lambda: carol.create_repo("alice/new-in-alice")) == 403
    assert _status(lambda: carol.create_tag("alice/public", tag="carols")) == 403
    assert (
        _status(
            lambda: carol.preupload_lfs_files("alice/public", [CommitOperationAdd("w.bin", b"x")])
        )
        == 403
    )
    # someone else's private repo: it does not exist for carol (write) nor bob (read)
    with pytest.raises(RepositoryNotFoundError):
        carol.create_commit("alice/secret", [card], commit_message="x")
    for who in (BOB, CAROL, None):
        with pytest.raises(RepositoryNotFoundError):
            _api(server, who).model_info("alice/secret")
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download(
                "alice/secret",
                CONFIG_FILE,
                endpoint=server.url,
                token=who,
                cache_dir=tmp_path / "c",
            )
        assert "alice/secret" not in {m.id for m in _api(server, who).list_models()}
    assert carol.model_info("carol/mine").sha  # her own namespace (the fixture pushed it)
    # organisations: alice (write) and dave (read) are members of team; bob is not
    assert _api(server, DAVE).model_info("team/private").private
    assert "team/private" in {m.id for m in _api(server, DAVE).list_models()}
    assert {m.id for m in _api(server, DAVE).list_models()} >= {"alice/public", "team/private"}
    assert "alice/secret" not in {m.id for m in _api(server, DAVE).list_models()}
    with pytest.raises(RepositoryNotFoundError):
        _api(server, BOB).model_info("team/private")
    assert alice.create_repo("team/another").repo_id == "team/another"
    assert _status(lambda: carol.create_repo("team/by-carol")) == 403
    # a namespace is a whole name: one that begins with alice's or her organisation's is not hers
    for other in ("alicex/new", "alice-team/new", "teams/new"):
        assert _status(lambda repo=other: alice.create_repo(repo)) == 403, other
    assert [o["name"] for o in alice.whoami()["orgs"]] == ["team"]
    # the hub's operators (admin tokens) own every namespace
    assert _api(server, ROOT).model_info("alice/secret").private
    assert alice.model_info("alice/secret").private


def test_org_command_changes_membership_while_running(server, repos, capsys):
    store = str(server.settings.store)
    carol = _api(server, CAROL)
    assert main(["org", "add", "crew", "--member", "carol", "--store", store]) == 0
    carol.create_repo("crew/by-carol")  # no restart needed
    assert main(["org", "list", "--store", store]) == 0
    assert "crew\tcarol" in capsys.readouterr().out
    assert main(["org", "remove", "crew", "--member", "carol", "--store", store]) == 0
    assert _status(lambda: carol.create_repo("crew/again")) == 403
    assert main(["org", "add", "crew", "--member", "dave", "--store", store]) == 0
    assert (
        main(["token", "create", "--name", "crew", "--store", store]) == 1
    )  # an organisation's name
    assert "organisation" in capsys.readouterr().err
    assert main(["token", "create", "--name", "frank", "--store", store]) == 0
    assert (
        main(["org", "add", "frank", "--member", "carol", "--store", store]) == 1
    )  # a user's name
    assert "the user 'frank' holds that namespace" in capsys.readouterr().err
    index = server.app.state.store.index
    before = index.state("auth")[0]
    tokens = json.loads(before)
    tokens["orgs"]["alice"] = ["carol"]  # written by hand: still no way into a user's namespace
    index.update_state("auth", lambda _: json.dumps(tokens))
    assert _status(lambda: carol.create_repo("alice/via-an-org")) == 403
    with pytest.raises(ValueError, match="the settings' user 'alice' clashes"):
        create_app(server.settings)  # nor does a server start on it
    index.update_state("auth", lambda _: before)


def test_names_are_unique_whatever_their_case(server, repos, capsys):
    """Issue 34, point 4: no organisation or user named like another in another case, from the
    command line or the hub (409 naming the existing one)."""
    store = str(server.settings.store)
    assert main(["token", "create", "--name", "gina", "--store", store]) == 0
    for args, existing in (
        (["org", "add", "Gina", "--member", "carol"], "the user 'gina'"),
        (["org", "add", "TEAMS", "--member", "carol"], None),
        (["org", "add", "Teams", "--member", "carol"], "the organisation 'TEAMS'"),
        (["token", "create", "--name", "teams"], "the organisation 'TEAMS'"),
        (["token", "create", "--name", "GINA"], "the user 'gina'"),
    ):
        assert main([*args, "--store", store]) == (1 if existing else 0), args
        if existing:
            assert f"is taken: {existing} holds that namespace" in capsys.readouterr().err
    assert "Gina" not in json.loads(server.app.state.store.index.state("auth")[0])["orgs"]
    root = _api(server, ROOT)  # an operator may create anywhere, but not beside a name
    with pytest.raises(HfHubHTTPError) as err:
        root.create_repo("Alice/imitation")
    assert err.value.response.status_code == 409 and "'alice'" in str(err.value)
    # a holder with no repo yet: its name is taken all the same
    assert main(["token", "create", "--name", "hana", "--store", store]) == 0
    capsys.readouterr()
    with pytest.raises(HfHubHTTPError) as err:
        root.create_repo("Hana/imitation")
    assert err.value.response.status_code == 409
    assert "namespace 'Hana' differs only by case from 'hana''s" in str(err.value)
    root.create_repo("Zed/one")
    with pytest.raises(HfHubHTTPError) as err:
        root.create_repo("zed/two")
    assert err.value.response.status_code == 409 and "from the existing 'Zed'" in str(err.value)
    with pytest.raises(HfHubHTTPError) as err:  # a repo name too, in its namespace
        root.create_repo("Zed/ONE")
    assert err.value.response.status_code == 409 and "the existing Zed/one" in str(err.value)
    root.create_repo("Zed/one", exist_ok=True)  # the same name is the same repo
    assert main(["org", "add", "zed", "--member", "carol", "--store", store]) == 1
    assert "differs only by case from the namespace 'Zed'" in capsys.readouterr().err


def test_a_namespace_with_repos_is_not_handed_to_a_new_holder(server, repos, capsys):
    """Issue 34, point 4: after ``token revoke eve``, ``org add eve`` (or a new token named eve)
    would give eve's repos to someone else: refused unless ``--inherit`` says so."""
    store = str(server.settings.store)
    assert main(["token", "create", "--name", "eve", "--scope", "write", "--store", store]) == 0
    eve = _api(server, capsys.readouterr().out.strip())
    eve.create_repo("eve/e1")
    assert main(["token", "revoke", "--name", "eve", "--store", store]) == 0
    capsys.readouterr()
    for args in (["org", "add", "eve", "--member", "carol"], ["token", "create", "--name", "eve"]):
        assert main([*args, "--store", store]) == 1, args
        err = capsys.readouterr().err
        assert "the namespace 'eve' holds 1 repo(s) (eve/e1)" in err and "--inherit" in err
    assert _status(lambda: _api(server, CAROL).create_repo("eve/d2")) == 403
    assert main(["token", "create", "--name", "Eve", "--inherit", "--store", store]) == 1
    assert "differs only by case from the namespace 'eve'" in capsys.readouterr().err
    # the explicit hand-over: a new token for eve owns eve's repos
    assert (
        main(
            ["token", "create", "--name", "eve", "--scope", "write", "--inherit", "--store", store]
        )
        == 0
    )
    again = _api(server, capsys.readouterr().out.strip())
    assert again.create_repo("eve/e2").repo_id == "eve/e2"


def test_a_revoked_users_memberships_are_not_handed_to_a_new_user(server, repos, capsys):
    """After ``token revoke hank``, a new user named hank (no repos under ``hank``) would be a
    member of hank's organisations, reading and writing their private repos: refused unless
    ``--inherit`` says so."""
    store = str(server.settings.store)
    assert main(["token", "create", "--name", "hank", "--scope", "write", "--store", store]) == 0
    hank = _api(server, capsys.readouterr().out.strip())
    assert main(["org", "add", "hanks", "--member", "hank", "--store", store]) == 0
    hank.create_repo("hanks/plans", private=True)
    assert main(["token", "revoke", "--name", "hank", "--store", store]) == 0
    capsys.readouterr()
    new = ["token", "create", "--name", "hank", "--scope", "write", "--store", store]
    assert main(new) == 1
    err = capsys.readouterr().err
    assert "'hank' is a member of 'hanks'" in err and "--inherit" in err
    assert main([*new, "--inherit"]) == 0  # the explicit hand-over, as a rotation does
    assert _api(server, capsys.readouterr().out.strip()).model_info("hanks/plans").private


def test_objects_do_not_cross_repos(server, repos):
    """Carol names alice's private weights by SHA-256: the commit is refused, and neither the LFS
    batch answer nor the Xet one says whether the store holds them."""
    weights = (repos["alice/secret"] / WEIGHTS_FILE).read_bytes()
    oid = hashlib.sha256(weights).hexdigest()
    body = (
        "\n".join(
            json.dumps(line)
            for line in [
                {"key": "header", "value": {"summary": "borrow"}},
                {
                    "key": "lfsFile",
                    "value": {
                        "path": WEIGHTS_FILE,
                        "algo": "sha256",
                        "oid": oid,
                        "size": len(weights),
                    },
                },
            ]
        )
        + "\n"
    )
    r = httpx.post(
        f"{server.url}/api/models/carol/mine/commit/main",
        content=body,
        headers={**_bearer(CAROL), "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 400 and "never uploaded for carol/mine" in r.json()["error"]
    absent = "ab" * 32
    held_elsewhere, nowhere = _lfs_upload_batch(
        server, "carol/mine", CAROL, [(oid, len(weights)), (absent, len(weights))]
    )
    assert held_elsewhere.keys() == nowhere.keys() and "upload" in held_elsewhere["actions"]
    verify = httpx.post(
        held_elsewhere["actions"]["verify"]["href"],
        headers=_bearer(CAROL),
        json={"oid": oid, "size": len(weights)},
    )
    assert verify.status_code == 404
    # alice's own repo holds them: nothing to send
    mine = _lfs_upload_batch(server, "alice/secret", ALICE, [(oid, len(weights))])[0]
    assert "actions" not in mine
    # ...and it says so when asked for them under another size
    other = _lfs_upload_batch(server, "alice/secret", ALICE, [(oid, len(weights) + 1)])[0]
    assert other["error"] == {
        "code": 422,
        "message": f"object {oid} is held with {len(weights)} bytes, not {len(weights) + 1}",
    }
    # a Xet shard claiming alice's SHA-256 over other bytes is refused, without telling the real
    # hash
    cas, grant = _xet_grant(server, "carol/mine", CAROL)
    chunk = b"not alice's weights" * 10
    xorb = _xorb([chunk])
    assert (
        httpx.post(
            f"{cas}/v1/xorbs/default/{xorb_hash(_hashes([chunk]))}", content=xorb, headers=grant
        ).status_code
        == 200
    )
    shard = _shard(oid, [(xorb_hash(_hashes([chunk])), 0, 1, len(chunk))])
    r = httpx.post(f"{cas}/v1/shards", content=shard, headers=grant)
    assert r.status_code == 400 and hashlib.sha256(chunk).hexdigest() not in r.text
    # the same user may publish the same bytes to another repo of its own (the bytes are sent)
    push_repo(repos["alice/secret"], "alice/copy", endpoint=server.url, token=ALICE)


def test_private_files_are_not_for_shared_caches(server, repos):
    private = httpx.get(
        f"{server.url}/alice/secret/resolve/main/{CONFIG_FILE}", headers=_bearer(ALICE)
    )
    assert private.status_code == 200
    assert (
        private.headers["cache-control"].startswith("private")
        and "Authorization" in private.headers["vary"]
    )
    commit = private.headers["x-repo-commit"]
    pinned = httpx.get(
        f"{server.url}/alice/secret/resolve/{commit}/{CONFIG_FILE}", headers=_bearer(ALICE)
    )
    assert (
        pinned.headers["cache-control"].startswith("private,")
        and "immutable" in pinned.headers["cache-control"]
    )
    public = httpx.get(f"{server.url}/alice/public/resolve/main/{CONFIG_FILE}")
    assert public.headers["cache-control"].startswith("public")


def _lfs_upload_batch(
    server: ThreadedServer, repo_id: str, token: str, objects: list[tuple[str, int]]
) -> list[dict]:
    """The LFS batch API's answer to uploading ``objects`` ((oid, size) each) to ``repo_id``."""
    return httpx.post(
        f"{server.url}/{repo_id}.git/info/lfs/objects/batch",
        headers=_bearer(token),
        json={"operation": "upload", "objects": [{"oid": o, "size": n} for o, n in objects]},
    ).json()["objects"]


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_readyz_and_metrics_name_no_private_repo(server, repos):
    settings = server.settings.model_copy(deep=True)
    settings.inference.preload = ["alice/secret", "alice/public"]
    with ThreadedServer(settings) as other:
        r = httpx.post(
            f"{other.url}/v1/embeddings",
            headers=_bearer(ALICE),
            json={"model": "alice/secret", "input": [_png()]},
        )
        assert r.status_code == 200
        anonymous = httpx.get(f"{other.url}/readyz").text
        assert "alice/secret" not in anonymous and "alice/public" in anonymous
        assert "alice/secret" in httpx.get(f"{other.url}/readyz", headers=_bearer(ALICE)).text
        metrics = httpx.get(f"{other.url}/metrics").text
        assert "alice/secret" not in metrics and "private@" in metrics


def test_openai_client_with_a_placeholder_key_on_open_routes(server, repos):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY")
    out = client.embeddings.create(model="alice/public", input=[_png()])
    assert len(out.data) == 1 and len(out.data[0].embedding) > 0
    with pytest.raises(openai.NotFoundError):  # anonymous: the private repo does not exist
        client.embeddings.create(model="alice/secret", input=[_png()])
    mine = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=ALICE
    )  # a valid token sees its private repos
    assert len(mine.embeddings.create(model="alice/secret", input=[_png()]).data) == 1
    # the hub's routes keep Hugging Face's 401 for a bad token
    assert _status(lambda: _api(server, "EMPTY").model_info("alice/public")) == 401
    protected = server.settings.model_copy(deep=True)
    protected.auth.protect_inference = True
    with ThreadedServer(protected) as other, pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{other.url}/v1", api_key="EMPTY").embeddings.create(
            model="alice/public", input=[_png()]
        )


def test_tags_named_like_branches_are_refused_and_tags_deleted(server, repos):
    alice = _api(server, ALICE)
    assert _status(lambda: alice.create_tag("alice/public", tag="main")) == 409
    alice.create_tag("alice/public", tag="v1")
    assert [t.name for t in alice.list_repo_refs("alice/public").tags] == ["v1"]
    assert _status(lambda: _api(server, CAROL).delete_tag("alice/public", tag="v1")) == 403
    alice.delete_tag("alice/public", tag="v1")
    assert alice.list_repo_refs("alice/public").tags == []
    with pytest.raises(RevisionNotFoundError):
        alice.delete_tag("alice/public", tag="v1")


def test_branches_only_in_ones_own_namespaces(server, repos):
    """Branches are written as tags are: another user's repo is a 403, a private one not found."""
    alice, carol = _api(server, ALICE), _api(server, CAROL)
    assert _status(lambda: carol.create_branch("alice/public", branch="carols")) == 403
    with pytest.raises(RepositoryNotFoundError):
        carol.create_branch("alice/secret", branch="carols")
    alice.create_branch("alice/public", branch="dev")
    assert _status(lambda: carol.delete_branch("alice/public", branch="dev")) == 403
    assert _status(lambda: _api(server, BOB).delete_branch("alice/public", branch="dev")) == 403
    alice.delete_branch("alice/public", branch="dev")
    assert [b.name for b in alice.list_repo_refs("alice/public").branches] == ["main"]


def test_store_is_owner_only(server, repos):
    httpx.post(
        f"{server.url}/v1/embeddings",
        headers=_bearer(ALICE),
        json={"model": "alice/secret", "input": [_png()]},
    )
    root = server.settings.store
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    blobs = [p for p in (root / "blobs").rglob("*") if p.is_file()]
    assert blobs and all(stat.S_IMODE(p.stat().st_mode) == 0o400 for p in blobs)
    assert stat.S_IMODE((root / "index.sqlite").stat().st_mode) == 0o600
    snapshots = [p for p in (root / "snapshots").rglob("*") if p.is_dir()]
    assert snapshots and all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in snapshots)
    xorbs = [p for p in (root / "xet").rglob("*") if p.is_file()]
    assert xorbs  # the real client uploaded through Xet: its xorbs' hashes were checked
    for folder in ("blobs", "uploads", "xet", "tmp", "snapshots", "locks"):
        for p in [root / folder, *(root / folder).rglob("*")]:
            assert not stat.S_IMODE(p.stat().st_mode) & 0o077, p


# ------------------------------------------------------------------------ Xet by hand
def _hashes(chunks: list[bytes]) -> list[tuple[bytes, int]]:
    import blake3

    from service.store.xet import _DATA_KEY

    return [(blake3.blake3(c, key=_DATA_KEY).digest(), len(c)) for c in chunks]


def _xorb(chunks: list[bytes]) -> bytes:
    """Uncompressed chunks (scheme 0), each after its 8-byte header."""
    return b"".join(
        bytes([0]) + len(c).to_bytes(3, "little") + bytes([0]) + len(c).to_bytes(3, "little") + c
        for c in chunks
    )


def _raw(text: str) -> bytes:
    return b"".join(bytes.fromhex(text[i : i + 16])[::-1] for i in range(0, 64, 16))


def _shard(sha256: str, terms: list[tuple[str, int, int, int]]) -> bytes:
    """A version-2 shard of one file (with its SHA-256 metadata extension) made of ``terms``."""
    return _shard_of([(sha256, terms)])


def _shard_of(files: list[tuple[str, list[tuple[str, int, int, int]]]]) -> bytes:
    """A version-2 shard of ``files``, each a SHA-256 and its terms (xorb, start, end, size)."""
    out = SHARD_TAG + struct.pack("<QQ", 2, 0)
    for sha256, terms in files:
        out += b"\0" * 32 + struct.pack("<IIQ", 1 << 30, len(terms), 0)
        for xorb, start, end, size in terms:
            out += _raw(xorb) + struct.pack("<IIII", 0, size, start, end)
        out += _raw(sha256) + b"\0" * 16
    return out + b"\xff" * 32 + b"\0" * 16


def _xet_grant(server: ThreadedServer, repo_id: str, token: str) -> tuple[str, dict[str, str]]:
    r = httpx.get(f"{server.url}/api/models/{repo_id}/xet-write-token/main", headers=_bearer(token))
    assert r.status_code == 200, r.text
    return r.json()["casUrl"], _bearer(r.json()["accessToken"])


def test_xet_hash_matches_the_official_client(tmp_path):
    """A one-chunk file's Xet file hash is its xorb hash keyed with the zero salt (xet-core)."""
    import blake3
    import hf_xet

    data = b"a small file: one chunk" * 50
    (tmp_path / "f").write_bytes(data)
    official = hf_xet.hash_files([str(tmp_path / "f")])[0].hash
    ours = blake3.blake3(_raw(xorb_hash(_hashes([data]))), key=b"\0" * 32).digest()
    assert official == xet_hex(ours)


def test_xet_uploads_are_checked_and_end_with_their_token(server, repos, tmp_path):
    cas, grant = _xet_grant(server, "carol/mine", CAROL)
    chunk = bytes(range(256)) * 512  # 128 KiB
    name = xorb_hash(_hashes([chunk]))
    # a xorb sent under another xorb's hash is refused (it cannot poison a later upload)
    other = xorb_hash(_hashes([b"someone else's chunk"]))
    r = httpx.post(f"{cas}/v1/xorbs/default/{other}", content=_xorb([chunk]), headers=grant)
    assert r.status_code == 400 and "do not hash" in r.json()["error"]
    assert not (server.settings.store / "xet" / "xorbs" / other[:2] / other[2:]).exists()
    assert httpx.post(
        f"{cas}/v1/xorbs/default/{name}", content=_xorb([chunk]), headers=grant
    ).json() == {"was_inserted": True}
    # one 128 KiB chunk repeated 800 times (100 MiB) is refused: reconstructed sizes are bounded
    bomb = chunk * 800
    r = httpx.post(
        f"{cas}/v1/shards",
        content=_shard(hashlib.sha256(bomb).hexdigest(), [(name, 0, 1, len(chunk))] * 800),
        headers=grant,
    )
    assert r.status_code == 413
    assert not [
        p
        for p in (server.settings.store / "uploads" / "sha256").rglob("*")
        if p.is_file() and p.stat().st_size > 1 << 20
    ]
    # a term names a non-empty range of its xorb's chunks
    for start, end in ((0, 0), (1, 2), (1, 0)):
        empty = _shard(hashlib.sha256(b"").hexdigest(), [(name, start, end, 0)])
        r = httpx.post(f"{cas}/v1/shards", content=empty, headers=grant)
        assert r.status_code == 400, r.text
        assert f"chunks [{start}, {end}) are not in xorb {name} (1 chunks)" in r.json()["error"]
    # a grant ends with its token: revoked in the index, the next CAS call is refused
    tokens = server.app.state.store.index
    secret = create_token(tokens, "erin", "write")
    store = str(server.settings.store)
    assert main(["org", "add", "erins", "--member", "erin", "--store", store]) == 0
    _api(server, secret).create_repo("erins/model")
    cas, erin = _xet_grant(server, "erins/model", secret)
    chunk_oid = hashlib.sha256(chunk).hexdigest()
    put = _lfs_upload_batch(server, "erins/model", secret, [(chunk_oid, len(chunk))])[0]["actions"][
        "upload"
    ]["href"]
    revoke_token(tokens, "erin")
    assert (
        httpx.post(
            f"{cas}/v1/xorbs/default/{name}", content=_xorb([chunk]), headers=erin
        ).status_code
        == 401
    )
    assert httpx.put(put, content=chunk).status_code == 401


def test_xet_shards_rebuild_at_most_their_ratio_of_what_their_user_uploaded(server, repos):
    """A shard rebuilds at most ``hub.xet_max_expansion`` times the stored (compressed) bytes of
    the chunks it reads, each from a xorb its own user sent; earlier xorbs of the same user count
    at their stored size; another user's xorb is answered like one never uploaded."""
    ratio = server.settings.hub.xet_max_expansion
    cas, grant = _xet_grant(server, "carol/mine", CAROL)
    zeros = [bytes(128 * 1024)] * 64  # 8 MiB unpacked, about 36 KB as LZ4 frames
    packed = lz4_xorb(zeros)
    name = xorb_hash(_hashes(zeros))
    r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=packed, headers=grant)
    assert r.status_code == 200 and len(packed) < 40_000
    for copies in (1, 3):  # the three shards wrote 384 MiB
        body = bytes(128 * 1024 * 64 * copies)
        terms = [(name, 0, 64, 128 * 1024 * 64)] * copies
        shard = _shard(hashlib.sha256(body).hexdigest(), terms)
        r = httpx.post(f"{cas}/v1/shards", content=shard, headers=grant)
        assert r.status_code == 413, r.text
        assert f"limit of {ratio} times what was uploaded" in r.json()["error"]
    uploads = server.settings.store / "uploads"
    assert not [p for p in uploads.rglob("*") if p.is_file() and p.stat().st_size >= 1 << 20]
    # incompressible chunks: a file repeating its xorb up to the ratio is rebuilt, not beyond
    noise = [np.random.default_rng(i).bytes(32 * 1024) for i in range(2)]
    random_xorb = xorb_hash(_hashes(noise))
    assert httpx.post(
        f"{cas}/v1/xorbs/default/{random_xorb}", content=_xorb(noise), headers=grant
    ).is_success
    whole = (random_xorb, 0, 2, 64 * 1024)
    within = _shard(hashlib.sha256(b"".join(noise) * ratio).hexdigest(), [whole] * ratio)
    assert httpx.post(f"{cas}/v1/shards", content=within, headers=grant).status_code == 200
    over = (b"".join(noise) * (ratio + 1), [whole] * (ratio + 1))
    r = httpx.post(
        f"{cas}/v1/shards",
        content=_shard(hashlib.sha256(over[0]).hexdigest(), over[1]),
        headers=grant,
    )
    assert r.status_code == 413
    # a later session deduplicating against carol's earlier xorb counts it at its stored size
    cas2, grant2 = _xet_grant(server, "carol/mine", CAROL)
    assert cas2 == cas  # one CAS URL per user: the client deduplicates against its own xorbs
    again = _shard(hashlib.sha256(b"".join(noise) * 2).hexdigest(), [whole] * 2)
    assert httpx.post(f"{cas}/v1/shards", content=again, headers=grant2).status_code == 200
    # alice may not read carol's xorb: answered exactly as a xorb never uploaded
    alice_cas, alice = _xet_grant(server, "alice/public", ALICE)
    assert alice_cas != cas
    absent = xorb_hash(_hashes([b"never uploaded"]))
    answers = [
        httpx.post(
            f"{alice_cas}/v1/shards",
            content=_shard(hashlib.sha256(b"".join(noise)).hexdigest(), [(x, 0, 2, 64 * 1024)]),
            headers=alice,
        )
        for x in (random_xorb, absent)
    ]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].text.replace(random_xorb, absent) == answers[1].text
    # a grant is good on its own user's CAS URL only
    assert httpx.post(f"{cas}/v1/shards", content=again, headers=alice).status_code == 404


def test_xorbs_and_files_rebuilt_from_them_count_against_their_users_uncommitted_bytes(
    server, repos, monkeypatch
):
    """Xorbs as they arrive, and the files a shard rebuilds before they are written, count
    against their user's ``hub.max_uncommitted_bytes``: a xorb or a shard past it is a 429
    naming the setting, and keeps or rebuilds nothing; a xorb refused for its hash counts
    nothing; files rebuilt from every chunk of a xorb take its count's place, a xorb read in
    part stays counted (root: no other test of this module uploads as root)."""
    store = server.app.state.store
    monkeypatch.setattr(store.limits, "max_uncommitted_bytes", 100 * 1024)
    cas, grant = _xet_grant(server, "alice/public", ROOT)

    def send(chunks: list[bytes]) -> tuple[str, httpx.Response]:
        name = xorb_hash(_hashes(chunks))
        return name, httpx.post(
            f"{cas}/v1/xorbs/default/{name}", content=_xorb(chunks), headers=grant
        )

    noise = [np.random.default_rng(10 + i).bytes(32 * 1024) for i in range(2)]
    elsewhere = xorb_hash(_hashes([b"other chunks"]))
    wrong = _xorb([np.random.default_rng(40).bytes(64 * 1024)])  # not the chunks of its name
    r = httpx.post(f"{cas}/v1/xorbs/default/{elsewhere}", content=wrong, headers=grant)
    assert r.status_code == 400, r.text  # and uncounted: the 64 KiB below still fit
    name, r = send(noise)
    assert r.is_success, r.text
    over, r = send([np.random.default_rng(20).bytes(64 * 1024)])  # 64 KiB held, 64 more
    assert r.status_code == 429 and "hub.max_uncommitted_bytes" in r.json()["error"], r.text
    assert not store.xet.xorb_path(over).exists()
    whole = (name, 0, 2, 64 * 1024)
    once = _shard(hashlib.sha256(b"".join(noise)).hexdigest(), [whole])
    # the file takes the xorb's 64 KiB: counted twice, the two would pass the 100
    assert httpx.post(f"{cas}/v1/shards", content=once, headers=grant).status_code == 200
    twice = b"".join(noise) * 2
    r = httpx.post(
        f"{cas}/v1/shards",
        content=_shard(hashlib.sha256(twice).hexdigest(), [whole] * 2),
        headers=grant,
    )
    assert r.status_code == 429, r.text
    assert "hub.max_uncommitted_bytes" in r.json()["error"]
    assert server.app.state.store.blobs.object_path(hashlib.sha256(twice).hexdigest()) is None
    # a shard of a file already received for the repo rebuilds and counts nothing again
    assert httpx.post(f"{cas}/v1/shards", content=once, headers=grant).status_code == 200
    halves = [np.random.default_rng(30 + i).bytes(16 * 1024) for i in range(2)]
    part, r = send(halves)  # 64 KiB of file and 32 of xorb held
    assert r.is_success, r.text
    first = _shard(hashlib.sha256(halves[0]).hexdigest(), [(part, 0, 1, 16 * 1024)])
    assert httpx.post(f"{cas}/v1/shards", content=first, headers=grant).status_code == 429
    both = _shard(hashlib.sha256(b"".join(halves)).hexdigest(), [(part, 0, 2, 32 * 1024)])
    assert httpx.post(f"{cas}/v1/shards", content=both, headers=grant).status_code == 200


def _counted(server: ThreadedServer, account: str) -> dict[str, tuple[int, float]]:
    """``account``'s uncommitted objects: size and expiry of each."""
    rows = server.app.state.store.index.rows(
        "SELECT oid, size, expires_at FROM pending_uploads WHERE account = ?", (account,)
    )
    return {r["oid"]: (int(r["size"]), float(r["expires_at"])) for r in rows}


def _batch(server: ThreadedServer, oid: str, size: int) -> dict:
    """Root's LFS batch reply for one object of alice/public."""
    r = httpx.post(
        f"{server.url}/alice/public.git/info/lfs/objects/batch",
        json={"operation": "upload", "objects": [{"oid": oid, "size": size}]},
        headers=_bearer(ROOT),
    )
    assert r.status_code == 200, r.text
    return r.json()["objects"][0]


@pytest.fixture
def root_counts(server, repos, monkeypatch):
    """A cap of 300 KiB for root's uncommitted bytes, none counted yet; yields the store."""
    store = server.app.state.store
    monkeypatch.setattr(store.limits, "max_uncommitted_bytes", 300 * 1024)
    store.index.execute("DELETE FROM pending_uploads WHERE account = ?", ("root",))
    yield store
    store.index.execute("DELETE FROM pending_uploads WHERE account = ?", ("root",))


def test_asking_again_for_an_object_never_lowers_its_count(server, root_counts):
    """A xorb's hash names its chunks, not how they are packed: sent raw (256 KiB) and then
    LZ4-packed (1 KiB), the raw copy stays on disk, and its count stayed 1 KiB; an LFS batch
    asking again at size 0 renewed a 200 KiB count at 0 while its first grant still took the
    200 KiB. Asking again now keeps the larger count, and the count of a xorb lasts as long as
    the xorb is kept unused (``hub.xet_ttl_s``)."""
    store = root_counts
    cas, grant = _xet_grant(server, "alice/public", ROOT)
    chunks = [bytes([1]) * (128 * 1024), bytes([2]) * (128 * 1024)]
    name = xorb_hash(_hashes(chunks))
    for body in (_xorb(chunks), lz4_xorb(chunks)):
        r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=body, headers=grant)
        assert r.status_code == 200, r.text
    kept = store.xet.xorb_path(name).stat().st_size
    assert kept > 256 * 1024  # the raw copy
    size, expires = _counted(server, "root")[xorb_oid(name)]
    assert size == kept and expires > time.time() + store.limits.xet_ttl_s - 60
    data = np.random.default_rng(81).bytes(20 * 1024)
    oid = hashlib.sha256(data).hexdigest()
    first, again = (_batch(server, oid, size) for size in (len(data), 0))
    assert "actions" in first and "actions" in again, (first, again)
    assert _counted(server, "root")[oid][0] == len(data)


def test_an_lfs_objects_count_lasts_as_long_as_its_upload_record(server, root_counts, monkeypatch):
    """An LFS object is counted from its batch reply, but its upload record is dated from its
    PUT, up to the grant's hour later: the count expired first, the object kept uncounted for
    that long. Receiving it renews its count."""
    from service.store import clock

    store = root_counts
    data = np.random.default_rng(85).bytes(10 * 1024)
    oid = hashlib.sha256(data).hexdigest()
    entry = _batch(server, oid, len(data))
    batched = _counted(server, "root")[oid][1]
    monkeypatch.setattr(clock, "now", lambda: time.time() + 1800)  # the PUT, half an hour on
    assert httpx.put(entry["actions"]["upload"]["href"], content=data).status_code == 200
    assert _counted(server, "root")[oid][1] > batched + 1800 - 60
    assert store.held_for("alice/public", oid) == len(data)


def test_a_shard_refused_after_its_count_gives_the_xorbs_count_back(server, root_counts):
    """A shard whose rebuild failed released the count of the xorb it read whole for good:
    the xorb stayed on disk, counted nowhere. A term stating another size than its chunks is now
    refused before anything is counted; a file whose bytes are not its SHA-256 is refused after,
    and the xorb's count comes back; the files rebuilt before it stay, and count."""
    cas, grant = _xet_grant(server, "alice/public", ROOT)
    parts = [np.random.default_rng(90 + i).bytes(40 * 1024) for i in range(2)]
    name = xorb_hash(_hashes(parts))
    r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=_xorb(parts), headers=grant)
    assert r.status_code == 200, r.text
    before = _counted(server, "root")
    assert list(before) == [xorb_oid(name)]
    whole = (name, 0, 2, 80 * 1024)
    lying = _shard(hashlib.sha256(b"".join(parts)).hexdigest(), [(name, 0, 2, 1)])
    r = httpx.post(f"{cas}/v1/shards", content=lying, headers=grant)
    assert r.status_code == 400 and "not the 1 bytes it states" in r.json()["error"], r.text
    assert _counted(server, "root") == before
    wrong = _shard("ab" * 32, [whole])
    r = httpx.post(f"{cas}/v1/shards", content=wrong, headers=grant)
    assert r.status_code == 400 and "does not have the SHA-256" in r.json()["error"], r.text
    assert _counted(server, "root") == before  # the xorb's own row, as it was
    good = hashlib.sha256(parts[0]).hexdigest()
    two = _shard_of([(good, [(name, 0, 1, 40 * 1024)]), ("cd" * 32, [whole])])
    r = httpx.post(f"{cas}/v1/shards", content=two, headers=grant)
    assert r.status_code == 400, r.text
    after = _counted(server, "root")
    assert after[xorb_oid(name)] == before[xorb_oid(name)] and after[good][0] == 40 * 1024
    assert set(after) == {xorb_oid(name), good}
    assert server.app.state.store.held_for("alice/public", good) is None  # not noted: no commit


def test_a_refused_shard_keeps_no_xorb_alive_and_a_read_renews_the_count_of_what_it_keeps(
    server, root_counts
):
    """Reading a xorb refreshed its age before the shard could be refused: a refused shard kept
    any xorb alive for another ``hub.xet_ttl_s``, uncounted; and a shard naming a file already
    received refreshed its upload record, keeping it uncounted past its time-to-live. Now only
    a shard that rebuilds files refreshes the xorbs it read, a xorb it read in part counted again
    for as long, and a file already received is neither rebuilt nor refreshed."""
    store = root_counts
    cas, grant = _xet_grant(server, "alice/public", ROOT)
    parts = [np.random.default_rng(95 + i).bytes(30 * 1024) for i in range(2)]
    name = xorb_hash(_hashes(parts))
    r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=_xorb(parts), headers=grant)
    assert r.status_code == 200, r.text
    path, old = store.xet.xorb_path(name), time.time() - 20 * 24 * 3600
    os.utime(path, (old, old))
    refused = _shard("ab" * 32, [(name, 0, 1, 30 * 1024)])
    assert httpx.post(f"{cas}/v1/shards", content=refused, headers=grant).status_code == 400
    assert path.stat().st_mtime == old
    store.index.execute(
        "UPDATE pending_uploads SET expires_at = ? WHERE account = ?", (time.time() + 60, "root")
    )
    first = hashlib.sha256(parts[0]).hexdigest()
    read = _shard(first, [(name, 0, 1, 30 * 1024)])  # half the xorb
    assert httpx.post(f"{cas}/v1/shards", content=read, headers=grant).status_code == 200
    assert path.stat().st_mtime > time.time() - 60
    counted = _counted(server, "root")
    assert counted[xorb_oid(name)][1] > time.time() + store.limits.xet_ttl_s - 60
    assert counted[first][0] == 30 * 1024
    record = store.blobs.upload_records.path("alice/public", first)
    os.utime(record, (old, old))
    assert httpx.post(f"{cas}/v1/shards", content=read, headers=grant).status_code == 200
    assert record.stat().st_mtime == old


def test_an_upload_not_kept_leaves_no_count(server, root_counts, monkeypatch):
    """A xorb whose write failed (a full disk), or an LFS object whose staging was refused,
    kept its count until the time-to-live though nothing was kept: both counts are undone. A
    xorb stored before a later step failed keeps its count."""
    import errno

    import service.store.xet as xet

    cas, grant = _xet_grant(server, "alice/public", ROOT)
    chunks = [np.random.default_rng(99).bytes(10 * 1024)]
    name = xorb_hash(_hashes(chunks))

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(xet, "replace_durably", full)
        r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=_xorb(chunks), headers=grant)
    assert r.status_code >= 500 and not server.app.state.store.xet.xorb_path(name).exists()
    assert _counted(server, "root") == {}
    with monkeypatch.context() as m:  # stored, then failing: it stays, and stays counted
        m.setattr(server.app.state.store.xet.senders, "note", full)  # who sent it
        r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=_xorb(chunks), headers=grant)
    assert r.status_code >= 500 and server.app.state.store.xet.xorb_path(name).exists()
    assert list(_counted(server, "root")) == [xorb_oid(name)]
    server.app.state.store.index.execute("DELETE FROM pending_uploads WHERE account = 'root'")

    def refused(*args: object) -> None:
        raise lfs_route.TooMuchStaged("over the staging quota")

    monkeypatch.setattr(lfs_route, "_upload_actions", refused)
    oid = hashlib.sha256(b"never staged").hexdigest()
    entry = _batch(server, oid, 12)
    assert entry["error"]["code"] == 429, entry
    assert _counted(server, "root") == {}


def test_a_xorb_collected_while_its_shard_is_applied_is_asked_for_again(server, repos, monkeypatch):
    """A xorb the collector removes between the shard's reading of it and the rebuild is a
    xorb no longer held (400: upload it again), not a 500 from refreshing its age by name."""
    import service.store.xet as xet

    cas, grant = _xet_grant(server, "carol/mine", CAROL)
    chunks = [np.random.default_rng(7).bytes(32 * 1024)]
    name = xorb_hash(_hashes(chunks))
    assert httpx.post(f"{cas}/v1/xorbs/default/{name}", content=_xorb(chunks), headers=grant)
    read = xet._chunk_offsets

    def read_then_collected(f, size, xorb):
        offsets = read(f, size, xorb)
        server.app.state.store.xet.xorb_path(xorb).unlink()  # as `clean_stale` would
        return offsets

    monkeypatch.setattr(xet, "_chunk_offsets", read_then_collected)
    shard = _shard(hashlib.sha256(chunks[0]).hexdigest(), [(name, 0, 1, len(chunks[0]))])
    r = httpx.post(f"{cas}/v1/shards", content=shard, headers=grant)
    assert r.status_code == 400, r.text
    assert f"xorb {name}" in r.json()["error"] and "upload again" in r.json()["error"]


def test_the_collector_keeps_an_old_xorb_while_a_shard_reads_it(server, repos, monkeypatch):
    """A xorb near ``hub.xet_ttl_s`` (a client deduplicating against its own weeks-old upload)
    could be collected between the shard's reading of it and the rebuild, refusing a shard that
    named a held xorb. The collector now keeps the xorbs a shard is reading, and the shard that
    rebuilt its file refreshes them."""
    import service.store.xet as xet

    store = server.app.state.store
    cas, grant = _xet_grant(server, "carol/mine", CAROL)
    chunks = [np.random.default_rng(8).bytes(32 * 1024)]
    name = xorb_hash(_hashes(chunks))
    assert httpx.post(f"{cas}/v1/xorbs/default/{name}", content=_xorb(chunks), headers=grant)
    path, old = store.xet.xorb_path(name), time.time() - store.limits.xet_ttl_s - 60
    read, collected = xet._chunk_offsets, []

    def read_then_collect(f, size, xorb):
        offsets = read(f, size, xorb)
        os.utime(path, (old, old))
        collected.append(store.xet.clean_stale(store.limits.xet_ttl_s))
        return offsets

    monkeypatch.setattr(xet, "_chunk_offsets", read_then_collect)
    shard = _shard(hashlib.sha256(chunks[0]).hexdigest(), [(name, 0, 1, len(chunks[0]))])
    r = httpx.post(f"{cas}/v1/shards", content=shard, headers=grant)
    assert r.status_code == 200, r.text
    assert collected == [0] and path.stat().st_mtime > time.time() - 60
    os.utime(path, (old, old))  # no shard reads it now: collected
    assert store.xet.clean_stale(store.limits.xet_ttl_s) >= 1 and not path.exists()


def test_lz4_chunks_unpack_to_at_most_their_stated_size(server):
    """An LZ4 chunk is unpacked to at most the size its header states, whatever its frame
    declares: a 23-byte xorb whose frame header announces 4 EiB was a MemoryError (500), and a
    frame of 56 MiB of zeros in a chunk stating 128 KiB was unpacked whole before it was refused."""
    import lz4.frame

    _api(server, CAROL).create_repo("carol/frames")
    cas, grant = _xet_grant(server, "carol/frames", CAROL)
    data = b"ten bytes!"
    frame = lz4.frame.LZ4FrameCompressor()
    packed = frame.begin(source_size=1 << 62) + frame.compress(data)  # never flushed
    name = xorb_hash(_hashes([data]))
    r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=lz4_chunk(packed, 10), headers=grant)
    assert r.status_code == 400 and "does not decompress" in r.json()["error"], r.text
    bomb = lz4.frame.compress(bytes(56 << 20))
    r = httpx.post(
        f"{cas}/v1/xorbs/default/{name}", content=lz4_chunk(bomb, MAX_CHUNK), headers=grant
    )
    assert r.status_code == 400, r.text
    assert f"unpacks to {MAX_CHUNK + 1} bytes, not the {MAX_CHUNK}" in r.json()["error"]


def test_a_shard_term_writes_no_more_than_its_stated_size(server, monkeypatch):
    """A shard term stating fewer bytes than its chunks unpack to is refused before it writes
    any: a 145 KB xorb of 256 LZ4-packed zero chunks, named by a term stating 1 byte, wrote its
    32 MiB (past hub.xet_max_expansion, whose check reads the stated sizes) before the 400. The
    chunks' headers (checked as the xorb was kept) now refuse it before anything is counted."""
    peak = 0
    write = DigestWriter.write

    def watched(self: DigestWriter, data: bytes | bytearray) -> None:
        nonlocal peak
        write(self, data)
        peak = max(peak, self.size)

    _api(server, CAROL).create_repo("carol/understated")
    cas, grant = _xet_grant(server, "carol/understated", CAROL)
    zeros = [bytes(MAX_CHUNK)] * 256
    name = xorb_hash(_hashes(zeros))
    r = httpx.post(f"{cas}/v1/xorbs/default/{name}", content=lz4_xorb(zeros), headers=grant)
    assert r.status_code == 200, r.text
    monkeypatch.setattr(DigestWriter, "write", watched)
    shard = _shard(hashlib.sha256(b"\0").hexdigest(), [(name, 0, 256, 1)])
    r = httpx.post(f"{cas}/v1/shards", content=shard, headers=grant)
    assert r.status_code == 400, r.text
    assert peak <= len(shard)  # the shard's own body; not one byte of the term
    assert f"unpacks to {256 * MAX_CHUNK} bytes, not the 1 bytes it states" in r.json()["error"]


def test_a_grant_with_non_ascii_characters_is_refused_not_a_server_error(server):
    """A forged upload grant whose MAC holds a non-ASCII character is a 401, as any other bad
    grant (``hmac.compare_digest`` refuses to compare such strings: it was a 500)."""
    _api(server, CAROL).create_repo("carol/grants")
    data = b"an object behind a grant\n"
    oid = hashlib.sha256(data).hexdigest()
    href = _lfs_upload_batch(server, "carol/grants", CAROL, [(oid, len(data))])[0]["actions"][
        "upload"
    ]["href"]
    r = httpx.put(href[:-1] + "%C3%A9", content=data)  # the MAC's last digit made an é
    assert r.status_code == 401 and "invalid grant" in r.json()["error"], r.text
    cas, grant = _xet_grant(server, "carol/grants", CAROL)
    forged = {"Authorization": grant["Authorization"][:-1].encode() + b"\xe9"}  # latin-1 é
    r = httpx.post(f"{cas}/v1/shards", content=b"", headers=forged)
    assert r.status_code == 401 and "invalid grant" in r.json()["error"], r.text


def test_the_batch_reply_refuses_an_object_over_the_upload_limit(server):
    """An object one byte over ``hub.max_upload_bytes`` gets a 413 and no upload action in the
    LFS batch reply; one at the limit is not refused for its size."""
    limit = server.settings.hub.max_upload_bytes
    _api(server, CAROL).create_repo("carol/limits", exist_ok=True)
    oid = hashlib.sha256(b"declared, never sent").hexdigest()
    over, at = (
        _lfs_upload_batch(server, "carol/limits", CAROL, [(oid, n)])[0] for n in (limit + 1, limit)
    )
    assert over["error"] == {
        "code": 413,
        "message": f"{limit + 1} bytes is over the upload limit of {limit}",
    }
    assert "actions" not in over
    assert at.get("error", {}).get("code") != 413, at


def test_an_upload_grant_is_good_for_its_own_object_only(server):
    """An LFS upload URL names its object and size, and its grant is signed for them: the same
    grant on another object's URL is refused (it would let a grant's holder put bytes the hub
    never offered to take)."""
    _api(server, CAROL).create_repo("carol/one-object", exist_ok=True)
    offered, other = b"the object offered\n", b"another object, never offered\n"
    oid, other_oid = (hashlib.sha256(d).hexdigest() for d in (offered, other))
    href = _lfs_upload_batch(server, "carol/one-object", CAROL, [(oid, len(offered))])[0][
        "actions"
    ]["upload"]["href"]
    moved = href.replace(oid, other_oid).replace(f"size={len(offered)}", f"size={len(other)}")
    r = httpx.put(moved, content=other)
    assert r.status_code == 401 and "invalid grant" in r.json()["error"], r.text
    assert httpx.put(href, content=offered).status_code == 200


def test_a_grant_is_good_for_its_purpose_subject_token_namespace_and_time_only(server):
    """``check_grant`` against the server's own token registry and grant key: a grant signed
    for one purpose, subject and token is refused for any other, past its expiry, or in a
    namespace its token does not write to."""
    key, tokens = server.app.state.store.secret(), server.app.state.tokens
    request = SimpleNamespace(app=server.app)
    carol, alice = tokens.lookup(CAROL), tokens.lookup(ALICE)
    subject, other = (f"carol/mine:{c * 64}:3" for c in "ab")
    grant = sign_grant(key, "lfs-upload", subject, 60, carol)
    assert check_grant(request, key, "lfs-upload", subject, grant, "carol") == carol
    expires, _, mac = grant.split(".")
    expired = sign_grant(key, "lfs-upload", subject, -2, carol)
    refused = [
        ("lfs-staged", subject, grant, "carol", "invalid grant"),
        ("lfs-upload", other, grant, "carol", "invalid grant"),
        ("lfs-upload", subject, f"{expires}.{alice.token_id}.{mac}", "alice", "invalid grant"),
        ("lfs-upload", subject, grant, "alice", "may no longer write to 'alice'"),
        ("lfs-upload", subject, expired, "carol", "expired"),
    ]
    for purpose, what, presented, namespace, message in refused:
        with pytest.raises(Unauthorized, match=message):
            check_grant(request, key, purpose, what, presented, namespace)


def test_a_token_revoked_while_its_commit_streams_in_commits_nothing(
    server, repos, capsys, monkeypatch
):
    """Write rights were checked when a commit's headers arrived only: a token revoked (or a
    member removed) while a large body streamed in still had its commit land."""
    from service.hub import uploads

    store = str(server.settings.store)
    assert main(["token", "create", "--name", "ivy", "--scope", "write", "--store", store]) == 0
    ivy = capsys.readouterr().out.strip()
    _api(server, ivy).create_repo("ivy/m")
    feeding, resume = threading.Event(), threading.Event()
    real_feed = uploads.CommitParser.feed

    def feed(self, data):
        feeding.set()  # the route runs: its write check has passed
        return real_feed(self, data)

    monkeypatch.setattr(uploads.CommitParser, "feed", feed)
    header = {"key": "header", "value": {"summary": "late", "description": ""}}
    big = base64.b64encode(b"x" * uploads.BATCH).decode()  # a batch: the route reads it at once
    first = {"key": "file", "value": {"path": "big.txt", "encoding": "base64", "content": big}}
    line = {"key": "file", "value": {"path": "notes.txt", "encoding": "base64", "content": "aGk="}}

    def body():
        yield (json.dumps(header) + "\n" + json.dumps(first) + "\n").encode()
        resume.wait(60)
        yield json.dumps(line).encode()

    answers: list[httpx.Response] = []
    post = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                f"{server.url}/api/models/ivy/m/commit/main",
                content=body(),
                headers={**_bearer(ivy), "Content-Type": "application/x-ndjson"},
                timeout=120,
            )
        )
    )
    post.start()
    assert feeding.wait(60)
    assert main(["token", "revoke", "--name", "ivy", "--store", store]) == 0
    resume.set()
    post.join(120)
    assert answers and answers[0].status_code == 401, answers
    with pytest.raises(NoSuchRevision):  # no commit: the repo's main has none
        server.app.state.store.resolve("ivy/m", "main")


def _sender(server: ThreadedServer, route: str) -> Callable[[], httpx.Response]:
    """A request on ``route`` with fresh bytes (an LFS PUT granted by the batch API, a Xet
    upload by its write token), ready to send as carol."""
    data = secrets.token_bytes(4096)
    if route == "resolve":
        url = f"{server.url}/alice/public/resolve/main/{CONFIG_FILE}"
        return lambda: httpx.get(url, timeout=60)
    if route == "lfs put":
        href = lfs_batch(server.url, "carol/mine", data, CAROL)["actions"]["upload"]["href"]
        return lambda: httpx.put(href, content=data, timeout=60)
    if route == "commit":
        files = {"notes.txt": data.hex().encode()}
        return lambda: raw_commit(server.url, "carol/mine", files, CAROL)
    cas, grant = _xet_grant(server, "carol/mine", CAROL)
    url = f"{cas}/v1/xorbs/default/{xorb_hash(_hashes([data]))}"
    return lambda: httpx.post(url, content=_xorb([data]), headers=grant, timeout=60)


@pytest.mark.parametrize(
    "route, waits",
    [
        ("resolve", "the index"),
        ("lfs put", "the grant's token"),
        ("lfs put", "the index"),
        ("lfs put", "the fsync"),
        ("lfs put", "the upload's rename"),
        ("commit", "its last file"),
        ("xet xorb", "the grant's token"),
    ],
)
def test_hub_routes_leave_the_event_loop_free(server, repos, route, waits):
    """A download, an LFS PUT, a commit's end and a Xet upload called the index (PostgreSQL's:
    a round trip, or a wait for a pool's connection), an object store or an fsync on the event
    loop: while one waited the server answered nothing, ``/healthz`` included."""
    store = server.app.state.store
    target = {
        ("resolve", "the index"): (store, "file"),
        ("lfs put", "the grant's token"): (lfs_route, "check_grant"),
        ("lfs put", "the index"): (store, "get_repo"),
        ("lfs put", "the fsync"): (DigestWriter, "close"),
        ("lfs put", "the upload's rename"): (store.blobs, "stage_upload"),
        ("commit", "its last file"): (CommitParser, "finish"),
        ("xet xorb", "the grant's token"): (xet_route, "check_grant"),
    }[route, waits]
    answer = server.answers_while_waiting(*target, _sender(server, route))
    assert answer.status_code == 200, answer.text
