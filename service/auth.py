"""Users, organisations and bearer tokens with scopes (read < write < admin). Only SHA-256
hashes are kept, and a presented token is compared against every stored hash in constant time.

A token belongs to a user: its name. A user owns the namespace of its own name and those of
the organisations it is a member of: it writes there (with a write token) and reads the
private repos there; admin tokens (the hub's operators) own every namespace. Everyone else
gets the Hugging Face hub's answers: 403 on a write, RepoNotFound on a private repo.

Tokens and organisations come from the hub's index (one JSON document, ``vip-hub token`` and
``vip-hub org`` change it; every replica sharing the index sees a change on its next request:
one version lookup per request) and from the settings ``auth.tokens``
(``name:scope:secret;...``) and ``auth.orgs`` (``{org: [user, ...]}``). A single-host store's
tokens file (``STORE/tokens.json``) is moved into the index at the first start.

Users and organisations share one set of namespace names, unique whatever their case (no
``Alice`` beside ``alice``). A namespace that holds repos in the store is never handed to a new
user or organisation (a token under a revoked user's name, a new organisation) unless the
command says so (``--inherit``), nor to a user or organisation of the settings named like a
revoked user (the server does not start: the index keeps revoked users' names), nor are a revoked
user's memberships handed to a new user of its name; an organisation keeps its name without
members.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from fastapi import Request

from vip_hub.errors import ConfigError

from .errors import Forbidden, RepoNotFound, Unauthorized
from .settings import Settings
from .store.errors import InvalidRequest
from .store.index import Index
from .store.naming import validate_namespace
from .store.shared import AUTH_KEY, adopt_file

if TYPE_CHECKING:
    from .store import HubStore

__all__ = [
    "GRANT_TTL_S",
    "Identity",
    "Scope",
    "TokenRegistry",
    "add_member",
    "adopt_tokens_file",
    "check_grant",
    "check_read",
    "check_write",
    "create_token",
    "identity",
    "identity_or_anonymous",
    "list_orgs",
    "list_tokens",
    "private_namespaces",
    "remove_member",
    "require_scope",
    "revoke_token",
    "sign_grant",
]

_log = logging.getLogger(__name__)

Scope = Literal["read", "write", "admin"]
_RANK = {"read": 1, "write": 2, "admin": 3}
INVALID = "Invalid credentials in Authorization header"


@dataclass(frozen=True)
class Identity:
    """Who a valid token belongs to: the user, the token's scope, the organisations the user
    is a member of, and the token's id (what upload grants name, so they end with it)."""

    name: str
    scope: Scope
    orgs: frozenset[str] = frozenset()
    token_id: str = ""

    def allows(self, scope: Scope) -> bool:
        """Whether the token's scope reaches ``scope``."""
        return _RANK[self.scope] >= _RANK[scope]

    def owns(self, namespace: str) -> bool:
        """Whether the user writes to ``namespace`` and reads its private repos."""
        return self.scope == "admin" or namespace == self.name or namespace in self.orgs


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _token_id(sha256: str) -> str:
    """A token's id: the first 16 hex digits of its hash (never enough to find the token)."""
    return sha256[:16]


@dataclass(frozen=True)
class _Entry:
    sha256: str
    name: str
    scope: Scope


@dataclass
class _Auth:
    """What one source holds: token entries and organisations (org -> member users)."""

    tokens: list[_Entry]
    orgs: dict[str, set[str]]


class TokenRegistry:
    """The known tokens and organisations: those of the index, read again on the first request
    after they change (one version lookup per request), and those of the settings."""

    def __init__(
        self,
        index: Index,
        fixed: _Auth,
        repos_in: Callable[[str], Collection[str]],
        inherit: Collection[str] = (),
    ):
        self._index, self._fixed = index, fixed
        self._stamp = -1
        self._stored = _Auth([], {})
        self._lock = threading.Lock()
        self._refresh(strict=True)
        _check_apart(fixed, self._stored)
        _take_former_namespaces(index, fixed, repos_in, inherit)

    @classmethod
    def from_settings(cls, settings: Settings, store: HubStore) -> TokenRegistry:
        """Tokens and organisations from ``store``'s index (adopting a single-host store's tokens
        file first) and from ``auth.tokens`` and ``auth.orgs``."""
        adopt_tokens_file(store.index, settings.tokens_path())
        return cls(store.index, _settings_auth(settings), store.repos_in, settings.auth.inherit)

    def _refresh(self, strict: bool = False) -> None:
        """Read the index's tokens again if their version changed. An invalid document fails at
        start-up (``strict``); later, the last valid one stays in force."""
        if self._index.state(AUTH_KEY)[1] == self._stamp:
            return
        with self._lock:
            value, stamp = self._index.state(AUTH_KEY)
            if stamp == self._stamp:
                return
            try:
                self._stored = _parse_auth(_document(value, _WHERE), _WHERE)
            except ValueError:
                if strict:
                    raise
                _log.exception("keeping the previous tokens: the index's tokens are invalid")
            self._stamp = stamp

    def __len__(self) -> int:
        self._refresh()
        return len(self._stored.tokens) + len(self._fixed.tokens)

    def lookup(self, token: str) -> Identity | None:
        """The identity of ``token``; every hash is compared, in constant time."""
        self._refresh()
        presented = _hash(token)
        found = None
        for entry in self._stored.tokens + self._fixed.tokens:
            if hmac.compare_digest(entry.sha256, presented):
                found = entry
        return self._identity(found) if found else None

    def by_id(self, token_id: str) -> Identity | None:
        """The identity of the token whose id is ``token_id`` (an upload grant's), None once
        it is revoked."""
        self._refresh()
        found = next(
            (
                e
                for e in self._stored.tokens + self._fixed.tokens
                if hmac.compare_digest(_token_id(e.sha256), token_id)
            ),
            None,
        )
        return self._identity(found) if found else None

    def holder_in_other_case(self, namespace: str) -> str | None:
        """The user or organisation whose name is ``namespace`` in another case, if any."""
        self._refresh()
        return next(
            (
                other
                for source in (self._stored, self._fixed)
                for other in [*(t.name for t in source.tokens), *source.orgs]
                if other != namespace and other.casefold() == namespace.casefold()
            ),
            None,
        )

    def _identity(self, entry: _Entry) -> Identity:
        """``entry``'s identity; an organisation named like a user, in any case, gives no
        membership (a user's namespace is its own)."""
        users = {e.name.casefold() for e in self._stored.tokens + self._fixed.tokens}
        orgs = frozenset(
            org
            for source in (self._stored, self._fixed)
            for org, members in source.orgs.items()
            if entry.name in members and org.casefold() not in users
        )
        return Identity(entry.name, entry.scope, orgs, _token_id(entry.sha256))


def _check_apart(fixed: _Auth, stored: _Auth) -> None:
    """ConfigError (the server does not start) if a user or organisation of the settings
    (``fixed``) holds a namespace the index's users and organisations (``stored``) hold in
    another role or spelling: a settings token named like an index organisation would own its
    namespace, a settings organisation named like an index user would get it on a revoke."""
    theirs = {t.name: "user" for t in stored.tokens} | dict.fromkeys(stored.orgs, "organisation")
    ours = {t.name: "user" for t in fixed.tokens} | dict.fromkeys(fixed.orgs, "organisation")
    for name, role in ours.items():
        for other, other_role in theirs.items():
            if other.casefold() == name.casefold() and (other, other_role) != (name, role):
                raise ConfigError(
                    f"the settings' {role} {name!r} clashes with the index's {other_role} "
                    f"{other!r}: a namespace has one holder whatever its case; rename one"
                )


def _take_former_namespaces(
    index: Index,
    fixed: _Auth,
    repos_in: Callable[[str], Collection[str]],
    inherit: Collection[str],
) -> None:
    """ConfigError (the server does not start) if a user or organisation of the settings
    (``fixed``) is named like a revoked user of ``index`` (its tokens document's
    ``former_users``) whose namespace holds repos (``repos_in``), unless ``inherit`` (the
    settings' ``auth.inherit``) names it: it would own them, which the commands allow only with
    ``--inherit``; likewise a settings user so named whom the index's organisations still list
    (the revoked user's memberships). Each settings name that passes holds its namespace from
    then on: it leaves ``former_users``, so that the repos it makes are never taken for the
    revoked user's."""
    data = _load(index)
    former = _former_users(data)
    handed = {name.casefold() for name in inherit}
    ours = [(t.name, "user") for t in fixed.tokens] + [(org, "organisation") for org in fixed.orgs]
    taken = [(name, role) for name, role in ours if name.casefold() in former]
    for name, role in taken:
        if name.casefold() in handed:
            continue
        revoked = (
            f"the settings' {role} {name!r} is named like the revoked user "
            f"{former[name.casefold()]!r}"
        )
        if repos := repos_in(name):
            listed = ", ".join(sorted(repos)[:3]) + (", ..." if len(repos) > 3 else "")
            raise ConfigError(
                f"{revoked}, whose namespace holds {len(repos)} repo(s) ({listed}): it would "
                "own them. Rename it, or hand them over on purpose by naming it in auth.inherit"
            )
        if role == "user" and (orgs := _memberships(name, data)):
            raise ConfigError(
                f"{revoked}, still a member of {', '.join(map(repr, orgs))}: it would write "
                "there. Rename it, `vip-hub org remove` the memberships first, or hand them over "
                "on purpose by naming it in auth.inherit"
            )
    if taken:

        def held(data: dict[str, Any]) -> None:
            for name, _ in taken:
                _held_again(data, name)

        _change(index, held)


def _former_users(data: dict[str, Any]) -> dict[str, str]:
    """The tokens document's revoked users, by their names' case fold."""
    names = data.get(FORMER_USERS, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{_WHERE} are not valid: {FORMER_USERS} is not a list of names")
    return {name.casefold(): name for name in names}


def _settings_auth(settings: Settings) -> _Auth:
    """The tokens and organisations of the settings (``auth.tokens``, ``auth.orgs``), checked."""
    fixed = _Auth([], {org: set(members) for org, members in settings.auth.orgs.items()})
    for item in filter(None, (settings.auth.tokens or "").split(";")):
        try:
            name, scope, secret = item.strip().split(":", 2)
        except ValueError:
            raise ValueError("auth.tokens entries must look like name:scope:secret") from None
        if scope not in _RANK:  # (not echoed: an entry written name:secret:scope holds a secret)
            raise ValueError(
                f"auth.tokens entry {name!r}: its second field, the scope, must be read, write or "
                "admin (entries look like name:scope:secret)"
            )
        fixed.tokens.append(_Entry(_hash(secret), name, cast(Scope, scope)))  # checked: a Scope
    for org in fixed.orgs:
        _check_org_name(org, "auth.orgs")
        others = _Auth(fixed.tokens, {o: m for o, m in fixed.orgs.items() if o != org})
        _check_free(org, [others], "auth.orgs")
    return fixed


_WHERE = "the hub's tokens"
FORMER_USERS = "former_users"
"""The tokens document's list of revoked users' names: a user or organisation of the settings
named like one, whose namespace holds repos, is refused (``_take_former_namespaces``)."""


def _parse_auth(data: dict[str, Any], where: str) -> _Auth:
    try:
        entries = []
        for t in data["tokens"]:
            _check_scope(t["scope"], f"{where}: token {t['name']!r}")
            entries.append(_Entry(t["sha256"], t["name"], t["scope"]))
        orgs = {
            str(org): {str(m) for m in members} for org, members in data.get("orgs", {}).items()
        }
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where} are not valid: {e}") from None
    return _Auth(entries, orgs)


def _document(text: str | None, where: str) -> dict[str, Any]:
    """The tokens document ``{"tokens": [...], "orgs": {...}}`` of ``text`` (empty if None)."""
    try:
        data = json.loads(text) if text is not None else {"tokens": []}
    except ValueError as e:
        raise ValueError(f"{where} are not valid: {e}") from None
    except RecursionError:
        raise ValueError(f"{where} are not valid: JSON nested too deeply") from None
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        raise ValueError(f"{where} are not valid: no 'tokens' list")
    return data


def _read_tokens_file(path: Path) -> str:
    """A single-host store's tokens file, checked, as the index keeps it."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    data = _document(text, str(path))
    _parse_auth(data, str(path))
    return json.dumps(data)


def adopt_tokens_file(index: Index, path: Path) -> None:
    """Move a single-host store's tokens file into ``index`` (unless it holds tokens already)."""
    adopt_file(index, AUTH_KEY, path, _read_tokens_file)


def _change(index: Index, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the index's tokens document (atomically, against other writers)."""

    def changed(value: str | None) -> str:
        data = _document(value, _WHERE)
        change(data)
        return json.dumps(data)

    index.update_state(AUTH_KEY, changed)


def _load(index: Index) -> dict[str, Any]:
    return _document(index.state(AUTH_KEY)[0], _WHERE)


def _check_scope(scope: str, where: str) -> None:
    if scope not in _RANK:
        raise ValueError(f"{where}: scope must be read, write or admin, not {scope!r}")


def _check_org_name(org: str, where: str, what: str = "organisation") -> None:
    """An organisation's (or a user's: ``what``) name is a valid namespace
    (``validate_namespace``)."""
    try:
        validate_namespace(org, what)
    except InvalidRequest as e:
        raise ValueError(f"{where}: {e}") from None


def _check_free(name: str, sources: Collection[_Auth], where: str) -> None:
    """No user or organisation of ``sources`` holds ``name`` in any case (users and
    organisations share the namespaces)."""
    holders = [(t.name, "user") for source in sources for t in source.tokens]
    holders += [(org, "organisation") for source in sources for org in source.orgs]
    for other, what in holders:  # users first: an organisation named like one is void
        if other.casefold() == name.casefold():
            raise ValueError(
                f"{where}: {name!r} is taken: the {what} {other!r} holds that namespace "
                "(names of users and organisations are unique whatever their case)"
            )


def _sources(data: dict[str, Any], settings: Settings | None) -> list[_Auth]:
    """The users and organisations of the tokens document and of the settings."""
    return [_parse_auth(data, _WHERE), *([_settings_auth(settings)] if settings else [])]


def _check_unheld(name: str, kind: str, repos: Collection[str], inherit: bool) -> None:
    """The store's repos in namespace ``name`` (``repos``: their ids, the namespace in any
    case) go to a new user or organisation only when ``inherit`` says so, and never to a name
    that differs from theirs only by case."""
    if not repos:
        return
    listed = ", ".join(sorted(repos)[:3]) + (", ..." if len(repos) > 3 else "")
    held = sorted({r.partition("/")[0] for r in repos} - {name})
    if held:
        raise ValueError(
            f"{name!r} differs only by case from the namespace {held[0]!r}, which holds repos "
            f"({listed}): names are unique whatever their case"
        )
    if not inherit:
        raise ValueError(
            f"the namespace {name!r} holds {len(repos)} repo(s) ({listed}) of a former user or "
            f"organisation: a new {kind} named {name!r} would own them. Pass --inherit to hand "
            "them over on purpose (e.g. a new token for the same person)"
        )


def _held_again(data: dict[str, Any], name: str) -> None:
    """``name``'s namespace has a holder again (a new user or organisation of the index, handed
    its repos on purpose where it holds any): it is no former user's any more."""
    if FORMER_USERS in data:
        data[FORMER_USERS] = [n for n in data[FORMER_USERS] if n.casefold() != name.casefold()]


def _memberships(name: str, data: dict[str, Any]) -> list[str]:
    """The organisations of the tokens document ``data`` that list ``name`` as a member."""
    return sorted(org for org, members in data.get("orgs", {}).items() if name in members)


def _check_no_memberships(name: str, data: dict[str, Any], inherit: bool) -> None:
    """A new user ``name`` becomes a member of the index's organisations that list that name (a
    former user's memberships, left by ``token revoke``) only when ``inherit`` says so; the
    settings' ``auth.orgs`` name their members on purpose, whoever holds the name."""
    orgs = _memberships(name, data)
    if orgs and not inherit:
        raise ValueError(
            f"{name!r} is a member of {', '.join(map(repr, orgs))} (memberships of a former "
            f"user): a new user named {name!r} would write there. Pass --inherit to hand them "
            "over on purpose, or `vip-hub org remove` them first"
        )


def identity(request: Request) -> Identity | None:
    """FastAPI dependency: the caller's identity, None when anonymous; 401 for a bad token."""
    header = request.headers.get("authorization")
    if not header:
        return None
    kind, _, token = header.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        raise Unauthorized(INVALID)
    who = request.app.state.tokens.lookup(token.strip())
    if who is None:
        raise Unauthorized(INVALID)
    return who


def identity_or_anonymous(request: Request) -> Identity | None:
    """The caller's identity where no token is required: an unknown or malformed token counts
    as anonymous (as OpenAI-compatible servers without keys do with ``api_key="EMPTY"``)."""
    try:
        return identity(request)
    except Unauthorized:
        return None


def require_scope(who: Identity | None, scope: Scope, what: str) -> Identity:
    """``who`` if it has ``scope``; else 401 (no token) or 403 (too weak a token)."""
    if who is None:
        raise Unauthorized(f"{what} needs a token with {scope} scope (Authorization: Bearer ...)")
    if not who.allows(scope):
        raise Forbidden(f"{what} needs {scope} scope; token {who.name!r} has {who.scope}")
    return who


def check_read(private: bool, repo_id: str, who: Identity | None) -> None:
    """Hide a private repo from callers who do not own its namespace (RepoNotFound, like the HF
    hub)."""
    if private and (who is None or not who.owns(repo_id.partition("/")[0])):
        raise RepoNotFound(f"repository {repo_id} not found")


def check_write(who: Identity | None, namespace: str, what: str) -> Identity:
    """``who`` if it holds a write token and owns ``namespace``; else 401, or 403 as the HF hub
    answers."""
    who = require_scope(who, "write", what)
    if not who.owns(namespace):
        raise Forbidden(
            f"{what}: {who.name!r} may not write to {namespace!r} (its own namespace "
            f"and its organisations' only)"
        )
    return who


def private_namespaces(who: Identity | None) -> bool | frozenset[str]:
    """Whose private repos a listing shows ``who``: all (an admin), its namespaces, or none."""
    if who is None:
        return False
    return True if who.scope == "admin" else who.orgs | {who.name}


def create_token(
    index: Index,
    name: str,
    scope: Scope,
    settings: Settings | None = None,
    repos: Collection[str] = (),
    inherit: bool = False,
) -> str:
    """Add a new random token for user ``name`` to the index (hash only) and return the secret
    once. ``name`` may not be a user's or an organisation's in any case (the index's, or the
    ``settings``'), nor a namespace holding ``repos`` (the store's repos in it), nor a member
    of the index's organisations (a former user's memberships) unless ``inherit``."""
    _check_scope(scope, "token")
    secret = "vh_" + secrets.token_urlsafe(32)

    def add(data: dict[str, Any]) -> None:
        _check_free(name, _sources(data, settings), _WHERE)
        _check_unheld(name, "user", repos, inherit)
        _check_no_memberships(name, data, inherit)
        _held_again(data, name)
        data["tokens"].append(
            {
                "name": name,
                "scope": scope,
                "sha256": _hash(secret),
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
        )

    _change(index, add)
    return secret


def list_tokens(index: Index) -> list[dict[str, str]]:
    """The index's tokens: name, scope and creation time (never a secret)."""
    return [
        {k: t.get(k, "") for k in ("name", "scope", "created_at")} for t in _load(index)["tokens"]
    ]


def revoke_token(index: Index, name: str) -> None:
    """Remove the token ``name``; every replica refuses it (and the upload grants it was given)
    from its next request on."""

    def remove(data: dict[str, Any]) -> None:
        kept = [t for t in data["tokens"] if t["name"] != name]
        if len(kept) == len(data["tokens"]):
            raise ValueError(f"no token named {name!r} in {_WHERE}")
        data["tokens"] = kept
        data[FORMER_USERS] = sorted({*_former_users(data).values(), name})

    _change(index, remove)


def add_member(
    index: Index,
    org: str,
    user: str,
    settings: Settings | None = None,
    repos: Collection[str] = (),
    inherit: bool = False,
) -> None:
    """Make ``user`` a member of organisation ``org``. A new organisation's name may not be a
    user's or another organisation's in any case (the index's, or the ``settings'``), nor a
    namespace holding ``repos`` (the store's repos in it) unless ``inherit``. ``user`` is a valid
    user name (a name no token could hold would fake lines of ``org list``)."""
    _check_org_name(user, "member", "user")

    def add(data: dict[str, Any]) -> None:
        orgs = data.setdefault("orgs", {})
        if org not in orgs and (settings is None or org not in settings.auth.orgs):
            _check_org_name(org, _WHERE)
            _check_free(org, _sources(data, settings), _WHERE)
            _check_unheld(org, "organisation", repos, inherit)
            _held_again(data, org)
        elif inherit:  # a settings organisation handed a former user's repos in the index
            _held_again(data, org)
        members = orgs.setdefault(org, [])
        if user not in members:
            members.append(user)

    _change(index, add)


def remove_member(index: Index, org: str, user: str) -> None:
    """Remove ``user`` from ``org``; the organisation keeps its name (and its namespace) even
    without members."""

    def remove(data: dict[str, Any]) -> None:
        members = data.get("orgs", {}).get(org, [])
        if user not in members:
            raise ValueError(f"{user!r} is not a member of {org!r} in {_WHERE}")
        members.remove(user)

    _change(index, remove)


def list_orgs(index: Index) -> dict[str, list[str]]:
    """The index's organisations and their members."""
    return {org: list(members) for org, members in _load(index).get("orgs", {}).items()}


GRANT_TTL_S = 3600.0
"""How long an upload grant (an LFS object's PUT, a Xet upload session) lasts at most."""


def sign_grant(key: bytes, purpose: str, subject: str, ttl_s: float, who: Identity) -> str:
    """A short-lived bearer grant for ``purpose`` on ``subject`` (e.g. an LFS object PUT, a
    Xet upload session), given to ``who``'s token: ``<expiry>.<token id>.<hmac>``, checked
    with :func:`check_grant` by any replica that shares the index (its grant key)."""
    expires = int(time.time() + ttl_s)
    return f"{expires}.{who.token_id}.{_grant_mac(key, purpose, subject, expires, who.token_id)}"


def _grant_mac(key: bytes, purpose: str, subject: str, expires: int | str, token_id: str) -> str:
    message = f"{purpose}\n{subject}\n{expires}\n{token_id}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def check_grant(
    request: Request, key: bytes, purpose: str, subject: str, grant: str | None, namespace: str
) -> Identity:
    """The identity a grant was given to, unless the grant was not signed for ``purpose`` on
    ``subject``, has expired, or its token was revoked or no longer writes to ``namespace``
    (Unauthorized)."""
    expires, _, rest = (grant or "").partition(".")
    token_id, _, mac = rest.partition(".")
    if (
        not (expires.isascii() and expires.isdigit() and len(expires) <= 12)
        or int(expires) < time.time()
    ):
        raise Unauthorized(f"{purpose}: missing or expired grant; ask the hub for a new one")
    expected = _grant_mac(key, purpose, subject, expires, token_id)
    if not hmac.compare_digest(expected.encode(), mac.encode()):  # str: ASCII only
        raise Unauthorized(f"{purpose}: invalid grant")
    who = request.app.state.tokens.by_id(token_id)
    if who is None or not who.allows("write") or not who.owns(namespace):
        raise Unauthorized(
            f"{purpose}: the token this grant was given to was revoked or may no longer "
            f"write to {namespace!r}"
        )
    return who
