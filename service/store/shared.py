"""What every replica of a hub must agree on, kept in the shared index (``hub_state``), never in
one process or one replica's folder: the upload-grant key and the trusted signers' keys (the
tokens and organisations are :mod:`service.auth`'s, in the same table). A single-host store
keeps them as files (``secret.key``, ``trusted_keys/*.pub``, ``tokens.json``): the first start
on the index adopts them (:func:`adopt_file`), and renames each in the store's folder to
``NAME.migrated`` so nobody edits a file that no longer counts (an operator's key file named by
``hub.trusted_keys`` outside it is only read).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from vip_hub.paths import make_private_dir
from vip_hub.repo.signing import PUBLIC_SUFFIX, PublicKey, check_key_name, load_keys

from .errors import Conflict, NoSuchEntry
from .index import Index

__all__ = [
    "AUTH_KEY",
    "adopt_file",
    "adopt_store_files",
    "distrust_key",
    "grant_key",
    "trust_key",
    "trusted_keys",
    "trusted_public_keys",
]

_log = logging.getLogger(__name__)

AUTH_KEY = "auth"  # tokens and organisations (service.auth's JSON document)
_GRANT_KEY = "grant_key"  # the HMAC key of upload grants, hex
_TRUST_KEY = "trusted_keys"  # {signer name: PEM public key}
MIGRATED_SUFFIX = ".migrated"


def grant_key(index: Index) -> bytes:
    """The random key that signs the short-lived upload grants (made by the first replica to
    ask), so a grant one replica issued is honoured by every other."""
    return bytes.fromhex(index.initial_state(_GRANT_KEY, secrets.token_hex(32)))


def adopt_file(
    index: Index, key: str, path: Path, read: Callable[[Path], str], *, set_aside: bool = True
) -> bool:
    """Move a single-host file's state into the index's ``key`` (``read(path)``: its value),
    unless the index already holds one; then, if ``set_aside``, rename the file
    ``NAME.migrated``. Returns whether the file was adopted."""
    if not path.exists() or index.state(key)[0] is not None:
        return False
    value = read(path)
    adopted = index.initial_state(key, value) == value
    if adopted:
        _log.warning("moved %s into the hub's index (%s)", path, key)
    if set_aside:
        with contextlib.suppress(OSError):  # a read-only folder of the operator's: it stays
            path.rename(path.with_name(path.name + MIGRATED_SUFFIX))
    return adopted


def _read_secret(path: Path) -> str:
    return path.read_bytes().hex()


def _read_key_folder(folder: Path) -> str:
    return json.dumps({k.name: k.path.read_text() for k in load_keys([folder])})


def adopt_store_files(index: Index, root: Path, trusted_folder: Path) -> None:
    """Adopt a single-host store's grant key (``root/secret.key``) and trusted keys
    (``trusted_folder``) into the index; files outside the store's folder (an operator's, named
    by ``hub.trusted_keys``) are read, never renamed."""
    adopt_file(index, _GRANT_KEY, root / "secret.key", _read_secret)
    adopt_file(
        index,
        _TRUST_KEY,
        trusted_folder,
        _read_key_folder,
        set_aside=trusted_folder.resolve().is_relative_to(root.resolve()),
    )


def trusted_keys(index: Index) -> dict[str, str]:
    """The trusted signers: name -> PEM public key."""
    return json.loads(index.state(_TRUST_KEY)[0] or "{}")


def trust_key(index: Index, name: str, public_key: Path) -> PublicKey:
    """Trust the EC public key file ``public_key`` as ``name`` (Conflict if the name is taken);
    every replica checks commits against it from its next commit on."""
    key = PublicKey.load(public_key)  # refuses anything but an EC public key
    check_key_name(name)
    pem = public_key.read_text()

    def add(value: str | None) -> str:
        keys = json.loads(value or "{}")
        if name in keys:
            raise Conflict(f"a trusted key {name!r} exists; remove it first")
        return json.dumps({**keys, name: pem})

    index.update_state(_TRUST_KEY, add)
    return key


def distrust_key(index: Index, name: str) -> None:
    """Stop trusting ``name`` (NoSuchEntry if it is not trusted)."""

    def remove(value: str | None) -> str:
        keys = json.loads(value or "{}")
        if keys.pop(name, None) is None:
            raise NoSuchEntry(f"no trusted key {name!r}")
        return json.dumps(keys)

    index.update_state(_TRUST_KEY, remove)


@contextlib.contextmanager
def trusted_public_keys(index: Index, scratch: Path) -> Iterator[list[PublicKey]]:
    """The trusted keys as :class:`PublicKey` files (what signature checks read), written to an
    owner-only folder under ``scratch`` for the duration of the block."""
    make_private_dir(scratch)
    folder = Path(tempfile.mkdtemp(prefix="keys-", dir=scratch))
    try:
        for name, pem in trusted_keys(index).items():
            path = folder / f"{name}{PUBLIC_SUFFIX}"
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(pem)
        yield load_keys([folder])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
