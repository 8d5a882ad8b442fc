"""``vip-hub key create`` (a signing key pair kept outside any repo) and ``vip-hub sign`` (sign
a repo folder again, e.g. after a probe head was added)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..repo_format import SIGNATURE_FILE
from .main import add_command

__all__ = ["register_key", "register_sign"]


def register_key(sub: Any) -> None:
    """Add ``vip-hub key create``."""
    add_command(
        sub,
        "key",
        _key,
        "create the EC key pair that signs your repos (kept outside them)",
        _key_options,
    )


def _key_options(p: argparse.ArgumentParser) -> None:
    from ..repo.signing import KEY_NAME  # signing imports the verifier: only for this command

    p.add_argument("action", choices=["create"])
    p.add_argument("--dir", type=Path, help="folder to keep it in (default: ~/.config/vip-hub)")
    p.add_argument("--name", default=KEY_NAME, help=f"NAME.key and NAME.pub (default {KEY_NAME})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing pair of that name")


def _key(args: argparse.Namespace) -> None:
    from ..repo.signing import SIGNING_KEY_ENV, create_key

    try:
        private, public = create_key(args.dir, args.name, overwrite=args.overwrite)
    except (FileExistsError, NotADirectoryError) as e:  # --dir names a file, or a folder in one
        raise ConfigError(f"--dir {e.filename}: a file, or in one, not a folder") from None
    except OSError as e:  # a folder not writable, a full disk
        raise ConfigError(f"cannot write the key pair to {e.filename}: {e.strerror}") from None
    print(f"private key  {private}  (mode 0600: keep it secret, never inside a repo)")
    print(
        f"public key   {public.path}  (give it to readers and hub operators: `vip-hub trust add`)"
    )
    print(f"fingerprint  {public.fingerprint}")
    print(
        f"training runs sign their repos with it when {SIGNING_KEY_ENV}={private} (or "
        "--signing-key)"
    )


def register_sign(sub: Any) -> None:
    """Add ``vip-hub sign``."""
    help = f"sign a verified repo folder (writes {SIGNATURE_FILE})"
    add_command(sub, "sign", _sign, help, _sign_options)


def _sign_options(p: argparse.ArgumentParser) -> None:
    from ..repo.signing import SIGNING_KEY_ENV

    p.add_argument("folder", help="repo folder")
    p.add_argument(
        "--key",
        type=Path,
        default=os.environ.get(SIGNING_KEY_ENV),
        help=f"private key (default: {SIGNING_KEY_ENV})",
    )


def _sign(args: argparse.Namespace) -> None:
    from ..repo.signing import sign_repo
    from ..repo.verify import verify_repo

    if args.key is None:
        raise ConfigError("name the private key: --key PATH (see `vip-hub key create`)")
    verify_repo(args.folder).raise_for_problems()
    fingerprint = sign_repo(args.folder, args.key)
    print(f"signed {args.folder} with key {fingerprint[:16]}")
