"""Bearer tokens with scopes (read < write < admin). Only SHA-256 hashes are kept, and a
presented token is compared against every stored hash in constant time.

Tokens come from a JSON file (``vip-hub token create`` writes it) and/or the
``VIP_HUB_AUTH__TOKENS`` setting (``name:scope:secret;...``). Anonymous callers may read
public repos; private repos answer RepoNotFound to anyone without a read token, as the
Hugging Face hub does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from fastapi import Request

from .errors import Forbidden, RepoNotFound, Unauthorized
from .settings import Settings

__all__ = ["Identity", "Scope", "TokenRegistry", "check_grant", "create_token", "identity", "require_scope", "sign_grant"]

Scope = Literal["read", "write", "admin"]
_RANK = {"read": 1, "write": 2, "admin": 3}
INVALID = "Invalid credentials in Authorization header"


@dataclass(frozen=True)
class Identity:
    """Who a valid token belongs to."""

    name: str
    scope: Scope

    def allows(self, scope: Scope) -> bool:
        return _RANK[self.scope] >= _RANK[scope]


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenRegistry:
    """The known tokens, as (hash, identity) pairs."""

    def __init__(self, entries: list[tuple[str, Identity]]):
        self._entries = entries

    @classmethod
    def from_settings(cls, settings: Settings) -> "TokenRegistry":
        """Tokens from the tokens file (if it exists) and from ``auth.tokens``."""
        entries: list[tuple[str, Identity]] = []
        path = settings.tokens_path()
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                for t in data.get("tokens", []):
                    _check_scope(t["scope"], f"{path}: token {t['name']!r}")
                    entries.append((t["sha256"], Identity(t["name"], t["scope"])))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path} is not a valid tokens file: {e}") from None
        for item in filter(None, (settings.auth.tokens or "").split(";")):
            try:
                name, scope, secret = item.strip().split(":", 2)
            except ValueError:
                raise ValueError("auth.tokens entries must look like name:scope:secret") from None
            _check_scope(scope, f"auth.tokens entry {name!r}")
            entries.append((_hash(secret), Identity(name, scope)))  # type: ignore[arg-type]
        return cls(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Identity | None:
        """The identity of ``token``; every hash is compared, in constant time."""
        presented = _hash(token)
        found = None
        for stored, who in self._entries:
            if hmac.compare_digest(stored, presented):
                found = who
        return found


def _check_scope(scope: str, where: str) -> None:
    if scope not in _RANK:
        raise ValueError(f"{where}: scope must be read, write or admin, not {scope!r}")


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


def require_scope(who: Identity | None, scope: Scope, what: str) -> Identity:
    """``who`` if it has ``scope``; else 401 (no token) or 403 (too weak a token)."""
    if who is None:
        raise Unauthorized(f"{what} needs a token with {scope} scope (Authorization: Bearer ...)")
    if not who.allows(scope):
        raise Forbidden(f"{what} needs {scope} scope; token {who.name!r} has {who.scope}")
    return who


def check_read(private: bool, repo_id: str, who: Identity | None) -> None:
    """Hide a private repo from callers without a read token (RepoNotFound, like the HF hub)."""
    if private and (who is None or not who.allows("read")):
        raise RepoNotFound(f"repository {repo_id} not found")


def create_token(path: Path, name: str, scope: Scope) -> str:
    """Add a new random token to the tokens file (hash only) and return the secret once."""
    _check_scope(scope, "token")
    data = json.loads(path.read_text()) if path.is_file() else {"tokens": []}
    if any(t["name"] == name for t in data["tokens"]):
        raise ValueError(f"a token named {name!r} already exists in {path}")
    secret = "vh_" + secrets.token_urlsafe(32)
    data["tokens"].append({"name": name, "scope": scope, "sha256": _hash(secret),
                           "created_at": datetime.now(UTC).isoformat(timespec="seconds")})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return secret


def sign_grant(key: bytes, purpose: str, subject: str, ttl_s: float) -> str:
    """A short-lived bearer grant for ``purpose`` on ``subject`` (e.g. an LFS object PUT, a
    Xet upload session): ``<expiry>.<hmac>``, checked with :func:`check_grant` by any replica
    that shares the store's key."""
    expires = int(time.time() + ttl_s)
    mac = hmac.new(key, f"{purpose}\n{subject}\n{expires}".encode(), hashlib.sha256).hexdigest()
    return f"{expires}.{mac}"


def check_grant(key: bytes, purpose: str, subject: str, grant: str | None) -> None:
    """Unauthorized unless ``grant`` was signed for ``purpose`` on ``subject`` and has not expired."""
    expires, _, mac = (grant or "").partition(".")
    if not expires.isdigit() or int(expires) < time.time():
        raise Unauthorized(f"{purpose}: missing or expired grant; ask the hub for a new one")
    good = hmac.new(key, f"{purpose}\n{subject}\n{expires}".encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(good, mac):
        raise Unauthorized(f"{purpose}: invalid grant")
