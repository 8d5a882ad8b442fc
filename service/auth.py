"""Bearer tokens with scopes (read < write < admin). Only SHA-256 hashes are kept, and a
presented token is compared against every stored hash in constant time.

Tokens come from a JSON file (``vip-hub token create|revoke`` writes it; a running server
re-reads it on the next request after a change) and/or the ``VIP_HUB_AUTH__TOKENS`` setting
(``name:scope:secret;...``). Anonymous callers may read
public repos; private repos answer RepoNotFound to anyone without a read token, as the
Hugging Face hub does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from fastapi import Request

from .errors import Forbidden, RepoNotFound, Unauthorized
from .settings import Settings

__all__ = ["Identity", "Scope", "TokenRegistry", "check_grant", "create_token", "identity", "list_tokens",
           "require_scope", "revoke_token", "sign_grant"]

_log = logging.getLogger(__name__)

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
    """The known tokens, as (hash, identity) pairs: those of the tokens file, re-read on the
    first request after it changes (one ``stat`` per lookup), and those of ``auth.tokens``."""

    def __init__(self, path: Path | None, fixed: list[tuple[str, Identity]]):
        self._path, self._fixed = path, fixed
        self._stamp: tuple[int, int, int] | None = None
        self._from_file: list[tuple[str, Identity]] = []
        self._lock = threading.Lock()
        self._refresh(strict=True)

    @classmethod
    def from_settings(cls, settings: Settings) -> "TokenRegistry":
        """Tokens from the tokens file (if it exists) and from ``auth.tokens``."""
        fixed: list[tuple[str, Identity]] = []
        for item in filter(None, (settings.auth.tokens or "").split(";")):
            try:
                name, scope, secret = item.strip().split(":", 2)
            except ValueError:
                raise ValueError("auth.tokens entries must look like name:scope:secret") from None
            _check_scope(scope, f"auth.tokens entry {name!r}")
            fixed.append((_hash(secret), Identity(name, scope)))  # type: ignore[arg-type]
        return cls(settings.tokens_path(), fixed)

    def _refresh(self, strict: bool = False) -> None:
        """Re-read the tokens file if it changed (written by ``vip-hub token``, atomically). An
        invalid file fails at start-up (``strict``); later, the last valid one stays in force."""
        try:
            st = self._path.stat() if self._path else None
        except FileNotFoundError:
            st = None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino) if st else None
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                self._from_file = _read_tokens(self._path) if st and self._path else []
            except ValueError:
                if strict:
                    raise
                _log.exception("keeping the previous tokens: the tokens file is invalid")
            self._stamp = stamp

    def __len__(self) -> int:
        self._refresh()
        return len(self._from_file) + len(self._fixed)

    def lookup(self, token: str) -> Identity | None:
        """The identity of ``token``; every hash is compared, in constant time."""
        self._refresh()
        presented = _hash(token)
        found = None
        for stored, who in self._from_file + self._fixed:
            if hmac.compare_digest(stored, presented):
                found = who
        return found


def _read_tokens(path: Path) -> list[tuple[str, Identity]]:
    entries = []
    try:
        for t in _load(path)["tokens"]:
            _check_scope(t["scope"], f"{path}: token {t['name']!r}")
            entries.append((t["sha256"], Identity(t["name"], t["scope"])))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a valid tokens file: {e}") from None
    return entries


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {"tokens": []}
    except ValueError as e:
        raise ValueError(f"{path} is not a valid tokens file: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        raise ValueError(f"{path} is not a valid tokens file: no 'tokens' list")
    return data


def _save(path: Path, data: dict[str, Any]) -> None:
    """Write the tokens file atomically (a running server sees the old or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


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
    data = _load(path)
    if any(t["name"] == name for t in data["tokens"]):
        raise ValueError(f"a token named {name!r} already exists in {path}")
    secret = "vh_" + secrets.token_urlsafe(32)
    data["tokens"].append({"name": name, "scope": scope, "sha256": _hash(secret),
                           "created_at": datetime.now(UTC).isoformat(timespec="seconds")})
    _save(path, data)
    return secret


def list_tokens(path: Path) -> list[dict[str, str]]:
    """The tokens of the tokens file: name, scope and creation time (never a secret)."""
    return [{k: t.get(k, "") for k in ("name", "scope", "created_at")} for t in _load(path)["tokens"]]


def revoke_token(path: Path, name: str) -> None:
    """Remove the token ``name``; a running server refuses it from its next request on."""
    data = _load(path)
    kept = [t for t in data["tokens"] if t["name"] != name]
    if len(kept) == len(data["tokens"]):
        raise ValueError(f"no token named {name!r} in {path}")
    _save(path, {**data, "tokens": kept})


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
    if not (expires.isascii() and expires.isdigit() and len(expires) <= 12) or int(expires) < time.time():
        raise Unauthorized(f"{purpose}: missing or expired grant; ask the hub for a new one")
    good = hmac.new(key, f"{purpose}\n{subject}\n{expires}".encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(good, mac):
        raise Unauthorized(f"{purpose}: invalid grant")
