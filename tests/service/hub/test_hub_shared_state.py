"""What every replica must agree on lives in the index, not in a replica's folder: a store made
by a single host (tokens.json, trusted_keys/, secret.key) is adopted at its first start
without losing anything, and what one replica's store was told, another's on
the same PostgreSQL index honours."""

from __future__ import annotations

import hashlib
import json
import os

import httpx
import pytest
from huggingface_hub import HfApi
from support.live import ThreadedServer, settings_for

from service.auth import TokenRegistry, create_token, revoke_token
from service.store import HubStore
from service.store.shared import AUTH_KEY, trust_key, trusted_keys
from vip_hub.errors import ConfigError
from vip_hub.repo.signing import create_key


def test_a_single_host_store_is_adopted_into_the_index(tmp_path):
    root = tmp_path / "store"
    HubStore(root).create_repo("team/model")
    secret = "vh_" + "s" * 40  # what `vip-hub token create` wrote before: its hash, in a file
    digest = hashlib.sha256(secret.encode()).hexdigest()
    tokens = {
        "tokens": [{"name": "sam", "scope": "write", "sha256": digest}],
        "orgs": {"team": ["sam"]},
    }
    (root / "tokens.json").write_text(json.dumps(tokens))
    grant_key = os.urandom(32)
    (root / "secret.key").write_bytes(grant_key)
    create_key(root / "trusted_keys", "alice")
    (root / "trusted_keys" / "alice.key").unlink()  # a hub holds public keys only

    with ThreadedServer(settings_for(root, auth={"tokens": None, "orgs": {}})) as server:
        store = server.app.state.store
        who = HfApi(endpoint=server.url, token=secret).whoami()
        assert who["name"] == "sam" and [o["name"] for o in who["orgs"]] == ["team"]
        assert store.secret() == grant_key  # grants issued before the move still hold
        assert list(trusted_keys(store.index)) == ["alice"]
        reply = httpx.get(f"{server.url}/api/whoami-v2", headers={"Authorization": "Bearer x"})
        assert reply.status_code == 401
    # the files are set aside, so nobody edits what no longer counts
    for name in ("tokens.json", "secret.key", "trusted_keys"):
        assert not (root / name).exists() and (root / f"{name}.migrated").exists()

    # an operator's key file outside the store (hub.trusted_keys) is read, never renamed
    outside = tmp_path / "signing"
    create_key(outside, "job")
    fresh = HubStore(tmp_path / "other", trusted_keys=outside / "job.pub")
    assert list(trusted_keys(fresh.index)) == ["job"] and (outside / "job.pub").is_file()

    # a file put back later is not adopted over what the index holds
    (root / "tokens.json").write_text(json.dumps({"tokens": []}))
    again = HubStore(root)
    assert again.secret() == grant_key
    registry = TokenRegistry.from_settings(settings_for(root, auth={"tokens": None}), again)
    assert registry.lookup(secret) is not None


def test_stores_on_one_index_share_tokens_grant_key_and_trust(postgres, tmp_path):
    """Two replicas' folders on one PostgreSQL index: what one was told, the other honours."""
    with (
        HubStore(tmp_path / "replica-a", index=postgres) as first,
        HubStore(tmp_path / "replica-b", index=postgres) as second,
    ):
        assert first.secret() == second.secret()
        registry = TokenRegistry.from_settings(
            settings_for(tmp_path / "replica-b", auth={"tokens": None}), second
        )
        secret = create_token(first.index, "rita", "write")
        assert registry.lookup(secret).name == "rita"  # seen on the next lookup
        revoke_token(first.index, "rita")
        assert registry.lookup(secret) is None
        _, public = create_key(tmp_path / "keys", "bob")
        trust_key(first.index, "bob", public.path)
        assert list(trusted_keys(second.index)) == ["bob"]


def test_the_settings_names_may_not_take_the_index_namespaces(tmp_path):
    """A settings token named like an index organisation owned its namespace (its members lost
    their private repos to it), and a settings organisation named like an index user got that
    user's namespace once the user's token was revoked: the server does not start."""
    from service.auth import add_member
    from service.settings import Settings

    store = HubStore(tmp_path / "store")
    index = store.index
    create_token(index, "alice", "write")
    create_token(index, "dana", "write")
    add_member(index, "labs", "alice")
    for auth, clash in [
        (
            {"tokens": "labs:read:X"},
            "the settings' user 'labs' clashes with the index's organisation",
        ),
        ({"tokens": "Alice:read:X"}, "the settings' user 'Alice' clashes with the index's user"),
        (
            {"orgs": {"dana": ["bob"]}},
            "the settings' organisation 'dana' clashes with the index's user",
        ),
    ]:
        settings = Settings(store=tmp_path / "store", auth={"tokens": None, **auth})
        with pytest.raises(ValueError, match=clash):
            TokenRegistry.from_settings(settings, store)
    same = Settings(store=tmp_path / "store", auth={"tokens": "alice:read:Y"})
    assert TokenRegistry.from_settings(same, store).lookup("Y").name == "alice"  # one user


def test_the_settings_names_may_not_take_a_revoked_users_repos(tmp_path):
    """A settings organisation (or user) named like a revoked index user got that user's repos
    on the next start: the index kept no record that a user had held the namespace. Now it keeps
    revoked users' names, and the server does not start until the repos are handed over on
    purpose (``auth.inherit``, the settings' ``--inherit``). A revoked user without repos holds
    nothing: the settings' name takes the namespace, and the repos it makes stay its own."""
    from service.auth import FORMER_USERS, revoke_token
    from service.settings import Settings

    store = HubStore(tmp_path / "store")
    for user in ("dana", "erin"):
        create_token(store.index, user, "write")
    store.create_repo("dana/model")
    for user in ("dana", "erin"):
        revoke_token(store.index, user)

    def start(**auth: object) -> TokenRegistry:
        settings = Settings(store=tmp_path / "store", auth={"tokens": "mallory:write:M", **auth})
        return TokenRegistry.from_settings(settings, store)

    def former() -> list[str]:
        return json.loads(store.index.state(AUTH_KEY)[0]).get(FORMER_USERS, [])

    for auth, holder in [
        ({"orgs": {"Dana": ["mallory"]}}, "organisation 'Dana'"),
        ({"tokens": "dana:write:X"}, "user 'dana'"),
    ]:
        with pytest.raises(
            ConfigError, match=rf"the settings' {holder} is named like the revoked user 'dana'"
        ) as refused:
            start(**auth)
        assert "holds 1 repo(s) (dana/model)" in str(refused.value)
    assert former() == ["dana", "erin"]
    start(orgs={"erin": ["mallory"]})  # erin held no repo: the organisation takes the name
    assert former() == ["dana"]
    store.create_repo("erin/model")  # its own repo: the next start is no hand-over
    start(orgs={"erin": ["mallory"]})
    registry = start(orgs={"dana": ["mallory"]}, inherit=["dana"])  # handed over on purpose
    assert registry.lookup("M").owns("dana") and former() == []
    start(orgs={"dana": ["mallory"]})  # and for good


def test_a_settings_user_may_not_take_a_revoked_users_memberships(tmp_path):
    """``token revoke`` leaves the user in the index's organisations, and ``token create``
    refuses a new user of that name their memberships; a settings user of that name got them on
    the next start (it read and wrote the organisation's private repos). Now the server does
    not start until they are removed or handed over (``auth.inherit``)."""
    from service.auth import add_member
    from service.settings import Settings

    store = HubStore(tmp_path / "store")
    create_token(store.index, "mallory", "write")
    add_member(store.index, "team", "mallory")
    revoke_token(store.index, "mallory")

    def start(**auth: object) -> TokenRegistry:
        settings = Settings(store=tmp_path / "store", auth={"tokens": "mallory:write:M", **auth})
        return TokenRegistry.from_settings(settings, store)

    with pytest.raises(ConfigError, match="revoked user 'mallory', still a member of 'team'"):
        start()
    assert start(inherit=["mallory"]).lookup("M").orgs == {"team"}  # handed over on purpose


def test_a_settings_token_entry_in_the_wrong_order_does_not_print_its_secret(tmp_path):
    """An ``auth.tokens`` entry written name:secret:scope put the secret in the refusal
    ("scope must be read, write or admin, not 'vh_...'"), on stderr and in logs."""
    from service.settings import Settings

    settings = Settings(store=tmp_path / "store", auth={"tokens": "alice:vh_TOPSECRET:write"})
    with pytest.raises(ValueError, match="entries look like name:scope:secret") as refused:
        TokenRegistry.from_settings(settings, HubStore(tmp_path / "store"))
    assert "TOPSECRET" not in str(refused.value)


def test_a_settings_organisation_takes_a_revoked_users_repos_through_org_add_inherit(tmp_path):
    """The index's way to hand a revoked user's repos to an organisation of the settings:
    ``vip-hub org add NAME --member USER --inherit`` (the settings passed, as the command
    does) clears the revoked name; it used to skip an organisation the settings declare."""
    from service.auth import add_member
    from service.settings import Settings

    store = HubStore(tmp_path / "store")
    create_token(store.index, "dana", "write")
    store.create_repo("dana/model")
    revoke_token(store.index, "dana")
    settings = Settings(
        store=tmp_path / "store", auth={"tokens": "mallory:write:M", "orgs": {"dana": ["ann"]}}
    )
    with pytest.raises(ConfigError, match="named like the revoked user 'dana'"):
        TokenRegistry.from_settings(settings, store)
    add_member(store.index, "dana", "mallory", settings, store.repos_in("dana"), inherit=True)
    assert TokenRegistry.from_settings(settings, store).lookup("M").owns("dana")
