"""Signed provenance: a repo folder signed with an elliptic-curve key (OpenSSF model-signing),
checked against public keys the reader trusts.

``verify`` proves that a repo is consistent (its ledger copies agree, its files have the
digests the ledger binds, every epsilon follows from its parameters); it cannot tell a
consistent rewrite from the original. A signature (``SIGNATURE_FILE``, a Sigstore bundle over
the SHA-256 of every file but itself and the hidden ones, ``verify.is_hidden``:
git's ``GITATTRIBUTES_FILE``, a download's cache) says whose key produced exactly these files: the
trainer's at export, and the hub records which trusted key that was when it accepts a
commit. A key is named by its file (``NAME.pub``) and identified by its fingerprint, the
SHA-256 of its PEM form (the key hint model-signing writes into the bundle).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import ConfigError, MissingInputError, SignatureError, UntrustedSignerError
from ..paths import private_writer, validate_relpath, write_private
from ..repo_format import SIGNATURE_FILE, check_name
from .artifacts import file_sha256
from .verify import Problem, VerificationReport, is_hidden, repo_files

__all__ = [
    "KEY_NAME",
    "PRIVATE_SUFFIX",
    "PUBLIC_SUFFIX",
    "SIGNING_KEY_ENV",
    "PublicKey",
    "check_key_name",
    "check_signature",
    "create_key",
    "default_key_dir",
    "load_keys",
    "load_signing_key",
    "sign_repo",
    "verify_signature",
]

SIGNING_KEY_ENV = "VIP_HUB_SIGNING_KEY"
"""The environment variable naming the private key training runs sign their repos with."""
KEY_NAME = "signing"
"""The default name of a key pair: ``signing.key`` and ``signing.pub``."""
PRIVATE_SUFFIX, PUBLIC_SUFFIX = ".key", ".pub"
_CURVE = ec.SECP256R1()


@dataclass(frozen=True)
class PublicKey:
    """A public key a reader or a hub trusts: its name (the file's stem), file and fingerprint."""

    name: str
    path: Path
    fingerprint: str

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PublicKey:
        """Read a PEM public key file (an EC key on a curve model-signing supports)."""
        path = Path(path)
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except FileNotFoundError:
            raise MissingInputError(f"{path}: no such public key file") from None
        except OSError as e:  # a folder, an unreadable file
            raise ConfigError(f"{path}: cannot read the public key file ({e.strerror})") from None
        except ValueError as e:
            raise ConfigError(f"{path}: not a PEM public key ({e})") from None
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ConfigError(
                f"{path}: not an elliptic-curve key (model-signing signs with EC keys)"
            )
        return cls(path.name.removesuffix(PUBLIC_SUFFIX), path, _fingerprint(key))

    def short(self) -> str:
        """The name and the first 16 hex digits of the fingerprint, as messages and pages show
        it."""
        return f"{self.name} ({self.fingerprint[:16]})"


def _fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """SHA-256 of the key's PEM SubjectPublicKeyInfo: the hint model-signing records."""
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(pem).hexdigest()


def check_key_name(name: str) -> str:
    """``name`` if it can name a key (``NAME.key``, ``NAME.pub``, a signer on pages), else
    ConfigError."""
    return check_name("key", name)


def default_key_dir() -> Path:
    """Where ``vip-hub key create`` keeps keys by default: ``$XDG_CONFIG_HOME/vip-hub`` (else
    ``~/.config/vip-hub``), outside any repo."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "vip-hub"


def create_key(
    folder: str | os.PathLike[str] | None = None, name: str = KEY_NAME, *, overwrite: bool = False
) -> tuple[Path, PublicKey]:
    """Write a new P-256 key pair ``NAME.key`` (mode 0600) and ``NAME.pub`` to ``folder``
    (default :func:`default_key_dir`); returns the private key's path and the public key."""
    check_key_name(name)
    folder = Path(folder) if folder is not None else default_key_dir()
    private, public = folder / f"{name}{PRIVATE_SUFFIX}", folder / f"{name}{PUBLIC_SUFFIX}"
    if not overwrite and (os.path.lexists(private) or os.path.lexists(public)):
        raise ConfigError(f"{private} or {public} exists; choose another name or pass overwrite")
    _no_folders(private, public)  # checked before either is written: the pair is replaced whole
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(_CURVE)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # each file is new and renamed into place: whole after a crash, never written through a link
    write_private(private, pem)
    with private_writer(public) as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    return private, PublicKey.load(public)


def _no_folders(*targets: Path) -> None:
    """ConfigError naming the first of ``targets``, files about to be replaced, that is a folder
    (the write would fail after the files before it were replaced)."""
    for target in targets:
        if target.is_dir() and not target.is_symlink():
            raise ConfigError(f"{target} is a folder where a file is to be written: remove it")


def load_keys(paths: Iterable[str | os.PathLike[str]]) -> list[PublicKey]:
    """The public keys named: files, or folders whose ``*.pub`` files are read (a missing
    folder holds none: a hub with no key list trusts nobody)."""
    keys = []
    for p in map(Path, paths):
        if p.is_dir():
            keys += [PublicKey.load(f) for f in sorted(p.glob(f"*{PUBLIC_SUFFIX}"))]
        elif p.exists() or p.suffix == PUBLIC_SUFFIX:
            keys.append(PublicKey.load(p))
    return keys


def load_signing_key(
    private_key: str | os.PathLike[str], folder: str | os.PathLike[str]
) -> ec.EllipticCurvePrivateKey:
    """The EC private key ``sign_repo`` signs the repo ``folder`` with (a readable, unencrypted
    PEM file outside it), else a ConfigError or MissingInputError naming what is wrong: a
    training run checks it before it trains, not once its export has replaced the repo."""
    private_key = Path(private_key)
    if private_key.resolve().is_relative_to(Path(folder).resolve()):
        raise ConfigError(
            f"{private_key} lies inside the repo {folder}: it would be published with it"
        )
    try:
        key = serialization.load_pem_private_key(private_key.read_bytes(), None)
    except FileNotFoundError:
        raise MissingInputError(f"{private_key}: no such private key file") from None
    except OSError as e:  # a folder, an unreadable file
        raise ConfigError(
            f"{private_key}: cannot read the private key file ({e.strerror})"
        ) from None
    except (TypeError, ValueError) as e:  # not PEM, or protected by a password
        raise ConfigError(f"{private_key}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(
            f"{private_key}: not an elliptic-curve key (model-signing signs with EC keys)"
        )
    from model_signing import signing

    try:  # model-signing's own rule of the curves it signs with (P-256, P-384, P-521)
        signing.Config().use_elliptic_key_signer(private_key=private_key)
    except ValueError as e:
        raise ConfigError(f"{private_key}: cannot sign with it ({e})") from None
    return key


def sign_repo(
    folder: str | os.PathLike[str], private_key: str | os.PathLike[str], name: str | None = None
) -> str:
    """Sign every file of repo ``folder`` (``repo_files``: hidden ones left out) but its
    signature into ``folder``/``SIGNATURE_FILE`` (replacing any earlier one), as the repo
    ``name`` (default: the folder's; an export signs its staging folder under the name it is
    released as); returns the key's fingerprint."""
    from model_signing import signing

    folder, private_key = Path(folder).resolve(), Path(private_key)
    key = load_signing_key(private_key, folder)
    files = repo_files(folder)
    files.pop(SIGNATURE_FILE, None)
    _no_folders(folder / SIGNATURE_FILE)
    tmp = folder / f".{SIGNATURE_FILE}.tmp-{os.getpid()}"
    try:
        with _view(files, name or folder.name) as view:
            config = signing.Config().use_elliptic_key_signer(private_key=private_key)
            config.set_hashing_config(_hashing()).sign(view, tmp)
        os.replace(tmp, folder / SIGNATURE_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    return _fingerprint(key.public_key())


def verify_signature(
    repo: str | os.PathLike[str] | Mapping[str, Path], keys: Iterable[PublicKey]
) -> PublicKey | None:
    """Check a repo folder's (or a mapping of repo paths to files') signature file against
    ``keys``; returns the key that signed it, or None for an unsigned repo.

    Raises UntrustedSignerError when the signature names no key of ``keys``, SignatureError
    when it is malformed, not made by that key, leaves a file unsigned, or the files changed
    after signing; UnsafePathError for a mapping's unsafe path. Hidden files (``is_hidden``) are
    never signed, and left out here as ``repo_files`` leaves them out of a folder."""
    from model_signing import verifying

    if isinstance(repo, Mapping):
        files = {rel: p for rel, p in repo.items() if not is_hidden(validate_relpath(rel))}
    else:
        files = repo_files(repo)
    signature = files.pop(SIGNATURE_FILE, None)
    if signature is None:
        return None
    bundle = _read_bundle(signature)
    hint = _key_hint(bundle)
    by_fingerprint = {k.fingerprint: k for k in keys}
    signer = by_fingerprint.get(hint or "")
    if signer is None:
        trusted = ", ".join(k.short() for k in by_fingerprint.values()) or "none"
        raise _refusal(
            f"signed by key {str(hint)[:16]}, which is not a trusted key (trusted: {trusted})",
            UntrustedSignerError,
        )
    name = "repo" if isinstance(repo, Mapping) else Path(repo).name
    with _view(files, name) as view:
        try:
            config = verifying.Config().use_elliptic_key_verifier(public_key=signer.path)
            config.set_hashing_config(_hashing()).verify(view, signature)
        except ValueError as e:
            if str(e).startswith("Signature mismatch"):
                changes = _changes(files, bundle)
                raise _refusal(
                    f"the files differ from what {signer.short()} signed ({changes})"
                ) from None
            raise _refusal(f"not a valid signature by {signer.short()}: {e}") from None
        except Exception as e:  # noqa: BLE001 - cryptography's InvalidSignature, a malformed bundle
            raise _refusal(
                f"not a valid signature by {signer.short()}: {type(e).__name__} {e}".rstrip()
            ) from None
    unsigned = sorted(p for p in files if p not in _signed(bundle))
    if unsigned:  # the signer listed them as ignored
        raise _refusal(f"leaves {', '.join(unsigned)} unsigned")
    return signer


def check_signature(
    repo: str | os.PathLike[str],
    key_paths: list[str] | None,
    report: VerificationReport,
    *,
    required: bool = False,
) -> PublicKey | None:
    """Add the signature's check to ``report`` (``vip-hub verify --key``): a problem when it
    does not hold (or, ``required``, when the repo is unsigned), a warning when the repo is
    unsigned or no key was given; returns the signer."""
    if required and key_paths is None:
        raise MissingInputError("--require-signature needs --key PUB: whose signature?")
    keys = None
    if key_paths is not None:
        missing = [str(k) for k in key_paths if not Path(k).exists()]
        if missing:
            raise MissingInputError(
                f"--key {', '.join(missing)}: no such public key file or folder"
            )
        keys = load_keys(key_paths)
    if not (Path(repo) / SIGNATURE_FILE).is_file():
        unsigned = (
            f"unsigned: no {SIGNATURE_FILE}, so nothing says who trained or published these files"
        )
        if required:  # a signature stripped from a signed repo would otherwise pass
            report.fail(SIGNATURE_FILE, f"{unsigned} (--require-signature)", SignatureError)
        else:
            report.warnings.append(f"{unsigned}; verify proves only that they are consistent")
        return None
    if keys is None:
        report.warnings.append(
            f"signed ({SIGNATURE_FILE}) but not checked: pass --key PUB, the public key of "
            "whoever you trust to have trained it"
        )
        return None
    try:
        signer = verify_signature(repo, keys)
    except SignatureError as e:
        report.problems.extend(e.problems)
        return None
    report.checks.append(f"signed by {signer.short()}" if signer else "unsigned")
    return signer


def _refusal(message: str, kind: type[SignatureError] = SignatureError) -> SignatureError:
    """The error for a signature that does not hold, its one problem named by the signature file."""
    return kind([Problem(SIGNATURE_FILE, message, kind)])


def _hashing() -> Any:
    """The hashing every signature here uses: SHA-256 per file over a folder of links, the
    signature file itself listed as ignored."""
    from model_signing import hashing

    return hashing.Config().set_allow_symlinks(True).set_ignored_paths(paths=[SIGNATURE_FILE])


def _read_bundle(path: Path) -> dict[str, Any]:
    """The signature file's JSON (a Sigstore bundle), or SignatureError."""
    try:
        bundle = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise _refusal(f"not a signature bundle ({e})") from None
    if not isinstance(bundle, dict):
        raise _refusal("not a signature bundle (not a JSON object)")
    return bundle


def _key_hint(bundle: Mapping[str, Any]) -> str | None:
    """The fingerprint the bundle names its key by (``verificationMaterial.publicKey.hint``), None
    when it names none, or SignatureError when that part of the bundle is malformed."""
    material = bundle.get("verificationMaterial") or {}
    key = (material.get("publicKey") or {}) if isinstance(material, dict) else None
    hint = key.get("hint") if isinstance(key, dict) else None
    if not isinstance(key, dict) or not isinstance(hint, (str, type(None))):
        raise _refusal("not a signature bundle (verificationMaterial.publicKey.hint is malformed)")
    return hint


def _signed(bundle: Mapping[str, Any]) -> dict[str, str]:
    """Repo path -> SHA-256 hex of every file the bundle's payload lists."""
    payload = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    return {r["name"]: r["digest"] for r in payload["predicate"]["resources"]}


def _changes(files: Mapping[str, Path], bundle: Mapping[str, Any]) -> str:
    """Which files were changed, added or removed since signing (the bundle's signature is
    already checked, so its payload is what the signer signed)."""
    signed = _signed(bundle)
    changed = sorted(
        p for p in set(signed) & set(files) if file_sha256(files[p]) != "sha256:" + signed[p]
    )
    parts = [
        f"{label} {', '.join(paths)}"
        for label, paths in (
            ("changed:", changed),
            ("added:", sorted(set(files) - set(signed))),
            ("removed:", sorted(set(signed) - set(files))),
        )
        if paths
    ]
    return "; ".join(parts)


@contextlib.contextmanager
def _view(files: Mapping[str, Path], name: str) -> Iterator[Path]:
    """A temporary folder named ``name`` of symbolic links to ``files`` (repo path -> file):
    what is signed and verified is exactly a repo's files, wherever they are kept."""
    with tempfile.TemporaryDirectory(prefix="vip-hub-sign-") as tmp:
        root = Path(tmp) / name
        root.mkdir()
        for rel, path in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(Path(path).resolve(), root / rel)
        yield root
