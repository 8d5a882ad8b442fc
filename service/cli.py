"""The service's commands: ``vip-hub serve``, ``token``, ``org``, ``trust`` and ``store``."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vip_hub.cli.main import add_command, require_extra
from vip_hub.local_hub import CONFIG_ENV, DEFAULT_HOST, DEFAULT_PORT, DEFAULT_STORE

if TYPE_CHECKING:
    from .settings import Settings
    from .store import HubStore

__all__ = ["register_org", "register_serve", "register_store", "register_token", "register_trust"]


SERVE_EXTRA = ("serve", "fastapi", "uvicorn", "pydantic_settings")
"""The extra every command of the service needs, and the modules that tell it is installed."""


def register_serve(sub: Any) -> None:
    """The ``serve`` command: the hub and inference service under uvicorn."""
    require_extra(*SERVE_EXTRA)
    p = add_command(sub, "serve", _serve, "run the hub and inference service (uvicorn)")
    p.add_argument(
        "--store", type=Path, help=f"store folder (default: {DEFAULT_STORE}, or VIP_HUB_STORE)"
    )
    p.add_argument("--host", help=f"interface to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--no-hub", action="store_true", help="serve inference only")
    p.add_argument("--no-inference", action="store_true", help="serve the hub only")
    p.add_argument(
        "--preload",
        action="append",
        metavar="ORG/NAME[@REV]",
        default=None,
        help="load and warm up a model before reporting ready (repeatable)",
    )
    _config_option(p)


def _config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help=f"TOML settings file (also {CONFIG_ENV})")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    import os

    if getattr(args, "config", None):
        os.environ[CONFIG_ENV] = str(args.config)
    out: dict[str, Any] = {}
    for key in ("store", "host", "port"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    return out


def _serve(args: argparse.Namespace) -> None:
    import os

    # OpenMP threads that spin while idle steal the cores that decoding, preprocessing and the
    # event loop need; passive waiting must be chosen before torch is first imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import uvicorn

    from .app import create_app
    from .ops import log_config
    from .settings import load_settings

    settings = load_settings(**_overrides(args))
    if args.no_hub:
        settings.hub.enabled = False
    if args.no_inference:
        settings.inference.enabled = False
    if args.preload:
        settings.inference.preload = list(args.preload)
    _check_listenable(settings.host, settings.port)
    try:
        app = create_app(settings)
    except OSError as e:  # the store folder, or one the settings name, cannot be made
        raise _unusable(e, "cannot start") from None
    print(
        f"vip-hub: store {settings.store.resolve()}, http://{settings.host}:{settings.port}",
        flush=True,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=log_config(settings.log_level),
        access_log=False,
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
        # SIGTERM: stop accepting, drain, exit; uvicorn hands it to asyncio.wait's timeout, a
        # float, though it annotates it int
        timeout_graceful_shutdown=settings.drain_s,  # type: ignore[arg-type]
    )


def _admin_command(
    sub: Any,
    name: str,
    handler: Callable[[argparse.Namespace], None],
    help: str,
    actions: tuple[str, ...] = ("add", "list", "remove"),
) -> argparse.ArgumentParser:
    """A command that changes or lists what the hub's index holds (its first argument: the
    action); every replica sharing the index sees the change, without a restart."""
    p = add_command(sub, name, handler, f"{help} (running servers see the change)")
    p.add_argument("action", choices=actions)
    p.add_argument(
        "--store", type=Path, help="store folder (its index, unless the settings name one)"
    )
    _config_option(p)
    return p


def _inherit_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--inherit",
        action="store_true",
        help="a new user or organisation takes over the repos already in its namespace, and a "
        "new user the memberships a former user of its name left (refused otherwise)",
    )


@contextmanager
def _hub_store(args: argparse.Namespace, makes: str) -> Iterator[tuple[Settings, HubStore]]:
    """The settings and the store with its index (a single-host store's files adopted into it),
    made only by the action ``makes``; a refused change (ValueError, a store error) becomes a
    one-line error."""
    from vip_hub.errors import ConfigError

    from .auth import adopt_tokens_file
    from .settings import load_settings
    from .store.errors import StoreError

    settings = load_settings(**_overrides(args))
    if args.action != makes:
        _require_store(settings, f"{args.action} needs an existing one, {makes} makes one")
    with _open_store(settings) as store:
        try:
            adopt_tokens_file(store.index, settings.tokens_path())
            yield settings, store
        except (ValueError, StoreError) as e:
            raise ConfigError(str(e)) from None


def _require_store(settings: Settings, why: str) -> None:
    """Refuse a store folder that holds no index (a mistyped ``--store`` would otherwise be made
    a new, empty store), unless the index is PostgreSQL's; ``why`` ends the one-line error."""
    from vip_hub.errors import ConfigError

    from .store.index import SQLITE_FILE

    if settings.index is None and not (settings.store / SQLITE_FILE).is_file():
        raise ConfigError(f"{settings.store} is not a hub store (no {SQLITE_FILE}): {why}")


def _open_store(settings: Settings) -> HubStore:
    """The store the settings name; a store folder that cannot be made (a file, or a folder in
    one, not writable) is a one-line error naming it."""
    import sqlite3

    from vip_hub.errors import ConfigError

    from .store import HubStore

    try:
        return HubStore.from_settings(settings, restate=False)
    except OSError as e:
        raise _unusable(e, f"store {settings.store}") from None
    except sqlite3.DatabaseError as e:  # a file that is no SQLite database, or a damaged one
        raise ConfigError(f"store {settings.store}: its index cannot be read ({e})") from None


def _check_listenable(host: str, port: int) -> None:
    """ConfigError naming the address unless a socket can listen on ``host``:``port`` now (a port
    in use, a host that does not resolve or is not this machine's): uvicorn logged such a
    failure over several lines and exited 3."""
    import socket

    from vip_hub.errors import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            sock.bind(address)
    except OSError as e:  # socket.gaierror is one
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _unusable(e: OSError, what: str) -> Exception:
    """The one-line error for ``what`` failing on a path: a file where a folder is needed, a
    folder not writable..."""
    from vip_hub.errors import ConfigError

    if isinstance(e, (FileExistsError, NotADirectoryError)):
        return ConfigError(f"{what}: {e.filename} is a file, or in one, not a folder")
    return ConfigError(f"{what}: {e.filename}: {e.strerror}")


def register_token(sub: Any) -> None:
    """The ``token`` command: the hub's access tokens created, listed or revoked."""
    require_extra(*SERVE_EXTRA)
    actions = ("create", "list", "revoke")
    p = _admin_command(
        sub, "token", _token, "create, list or revoke the hub's access tokens", actions
    )
    p.add_argument(
        "--name",
        help="the user the token belongs to: it writes to the namespace of this name "
        "and to its organisations' (create, revoke)",
    )
    p.add_argument("--scope", choices=["read", "write", "admin"], default="read")
    _inherit_option(p)


def _token(args: argparse.Namespace) -> None:
    from vip_hub.errors import ConfigError

    from .auth import create_token, list_tokens, revoke_token
    from .store.errors import InvalidRequest
    from .store.naming import validate_namespace

    if args.action != "list" and not args.name:
        raise ConfigError(f"vip-hub token {args.action} needs --name")
    if args.action == "create":
        try:  # the user owns the namespace of its name
            validate_namespace(args.name, "user")
        except InvalidRequest as e:
            raise ConfigError(str(e)) from None
    with _hub_store(args, "create") as (settings, store):
        if args.action == "create":
            repos = store.repos_in(args.name)
            secret = create_token(store.index, args.name, args.scope, settings, repos, args.inherit)
            print(secret)  # shown this once
        elif args.action == "revoke":
            revoke_token(store.index, args.name)
            print(f"revoked {args.name!r}")
        else:
            for t in list_tokens(store.index):
                print(f"{t['name']}\t{t['scope']}\t{t['created_at']}")


def register_org(sub: Any) -> None:
    """The ``org`` command: organisations' members added, listed or removed."""
    require_extra(*SERVE_EXTRA)
    p = _admin_command(sub, "org", _org, "add, list or remove the hub's organisation members")
    p.add_argument("org", nargs="?", help="the organisation (add, remove)")
    p.add_argument("--member", help="the user (a token's name) to add or remove")
    _inherit_option(p)


def _org(args: argparse.Namespace) -> None:
    from vip_hub.errors import ConfigError

    from .auth import add_member, list_orgs, remove_member

    if args.action != "list" and not (args.org and args.member):
        raise ConfigError(f"vip-hub org {args.action} needs ORG and --member USER")
    with _hub_store(args, "add") as (settings, store):
        if args.action == "add":
            repos = store.repos_in(args.org)
            add_member(store.index, args.org, args.member, settings, repos, args.inherit)
            print(f"{args.member!r} is a member of {args.org!r}")
        elif args.action == "remove":
            remove_member(store.index, args.org, args.member)
            print(f"{args.member!r} is no longer a member of {args.org!r}")
        else:
            stored = list_orgs(store.index)
            for org in sorted({*settings.auth.orgs, *stored}):
                members = {*settings.auth.orgs.get(org, []), *stored.get(org, [])}
                print(f"{org}\t{', '.join(sorted(members))}")


def register_trust(sub: Any) -> None:
    """The ``trust`` command: the signers' public keys the hub trusts."""
    require_extra(*SERVE_EXTRA)
    p = _admin_command(sub, "trust", _trust, "add, list or remove the public keys the hub trusts")
    p.add_argument("name", nargs="?", help="the signer's name, shown on model pages (add, remove)")
    p.add_argument(
        "public_key", nargs="?", type=Path, help="the signer's PEM public key file (add)"
    )


def _trust(args: argparse.Namespace) -> None:
    from vip_hub.errors import ConfigError

    from .store.shared import distrust_key, trust_key, trusted_public_keys

    with _hub_store(args, "add") as (_, store):
        if args.action == "list":
            with trusted_public_keys(store.index, store.blobs.tmp) as keys:
                for key in keys:
                    print(f"{key.name}\t{key.fingerprint}")
        elif args.action == "remove":
            if not args.name:
                raise ConfigError("vip-hub trust remove needs NAME")
            distrust_key(store.index, args.name)
            print(f"removed {args.name!r}: commits signed by it are refused from now on")
        else:
            if args.public_key is None:
                raise ConfigError("vip-hub trust add needs NAME and the PUBLIC_KEY file")
            key = trust_key(store.index, args.name, args.public_key)
            print(f"trusted {args.name!r} ({key.fingerprint})")


def register_store(sub: Any) -> None:
    """The ``store`` command: a store's garbage collected or checked."""
    require_extra(*SERVE_EXTRA)
    p = add_command(
        sub,
        "store",
        _store,
        "the store's upkeep: collect objects no commit names (gc), or check where the index "
        "and the stored objects disagree (check; --repair: what is safe)",
    )
    p.add_argument("action", choices=("gc", "check"))
    p.add_argument(
        "--repair",
        action="store_true",
        help="check: restore missing or corrupt blobs from checked copies, remove corrupt "
        "copies no commit names and what gc removes; never what a commit names",
    )
    p.add_argument("--store", type=Path, help="store folder (default: the settings')")
    _config_option(p)


def _store(args: argparse.Namespace) -> int:
    from .settings import load_settings

    settings = load_settings(**_overrides(args))
    _require_store(settings, "gc and check keep an existing one")
    with _open_store(settings) as store:
        return _upkeep(store, args.action, args.repair, settings.hub.gc_grace_s)


def _upkeep(store: HubStore, action: str, repair: bool, grace: float) -> int:
    """``vip-hub store gc|check`` on ``store``: print what was done or found; the exit status."""
    from .store.upkeep import check_store, collect_garbage

    if action == "gc":
        done = collect_garbage(store, grace)
        for sha256 in done.blobs:
            print(f"removed blob {sha256}")
        print(
            f"removed {len(done.blobs)} blobs no commit names and {done.uploads} expired uploads, "
            f"staged uploads, records, temp files and xorbs; {done.young} unnamed blobs kept "
            f"within hub.gc_grace_s ({grace:.0f} s)"
        )
        return 0
    findings = check_store(store, repair, grace)
    for finding in findings:
        print(finding.line())
    left = sum(f.problem and not f.repaired for f in findings)
    print(
        f"{len(findings)} findings, {sum(f.repaired for f in findings)} repaired, {left} "
        "still needing an operator"
    )
    return 1 if left else 0
