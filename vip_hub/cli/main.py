"""The ``vip-hub`` command line. Sub-commands are plugins registered by each package under
the ``vip_hub.commands`` entry-point group, so this library never imports training/ or
service/. Each entry point is a function taking the argparse sub-parsers object. An entry point
named like the command it registers is loaded alone when that command runs, so that ``vip-hub
serve --no-inference`` or ``vip-hub token`` skip the training plugin's imports (torch, timm:
seconds); any other command, or none, loads every plugin. A command whose options need such
imports declares them with ``add_command(..., options=...)``: they are added when that command
is parsed or its help printed, so ``vip-hub --help`` lists every command in a fraction of a
second.

A :class:`~vip_hub.errors.VipHubError` (something the user can fix) is printed as one line
with exit status 1, as is an OSError of the machine's or the user's making (a full disk, a
folder not writable, a folder given where a file goes: ``USER_FIXABLE``); any other exception
is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ..errors import VipHubError

__all__ = ["CommandParser", "add_command", "main", "require_extra", "unavailable"]


def require_extra(extra: str, *modules: str) -> None:
    """Raise ImportError (the command is then listed as unavailable) unless ``modules`` are
    installed: a plugin from an optional extra calls this before registering its commands."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"needs the {extra} extra: pip install 'vip-hub[{extra}]'")


Options = Callable[[argparse.ArgumentParser], None]
"""A function adding a command's arguments to its parser."""


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser whose ``options`` (a function adding its arguments) run on its
    first use: parsing its arguments, formatting its help or usage, or reading a default."""

    def __init__(self, *args: Any, options: Options | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._options = options

    def _add_options(self) -> None:
        options, self._options = self._options, None
        if options is not None:
            options(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._add_options()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_options()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_options()
        return super().format_help()

    def parse_known_intermixed_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._add_options()
        return super().parse_known_intermixed_args(args, namespace)

    def get_default(self, dest: str) -> Any:
        self._add_options()
        return super().get_default(dest)


def add_command(
    sub: Any,
    name: str,
    handler: Callable[[argparse.Namespace], int | None],
    help: str,
    options: Options | None = None,
) -> argparse.ArgumentParser:
    """Add sub-command ``name`` to the sub-parsers ``sub``; plugins call this to register.
    ``options`` adds its arguments once the command is used (for options whose declaration
    imports something slow)."""
    p = sub.add_parser(name, help=help, description=help, options=options)
    p.set_defaults(handler=handler, command=name)
    return p


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every installed sub-command, or only the plugin's named ``command`` if an
    entry point has that name and registers that command."""
    plugins = _plugins()
    named = [ep for ep in plugins if ep.name == command]
    if named:
        parser, sub, _ = _parser(named)
        if command in sub.choices:
            return parser
    return _parser(plugins)[0]


def unavailable(command: str) -> str | None:
    """Why sub-command ``command`` cannot run here (its plugin's error: a missing extra), or None
    when the installed plugin named like it registers it."""
    _, sub, broken = _parser([ep for ep in _plugins() if ep.name == command])
    if command in sub.choices:
        return None
    return "; ".join(broken) or f"no installed plugin registers `vip-hub {command}`"


def _plugins() -> list[EntryPoint]:
    """The installed ``vip_hub.commands`` entry points, by name."""
    return sorted(entry_points(group="vip_hub.commands"), key=lambda e: e.name)


def _parser(plugins: Sequence[EntryPoint]) -> tuple[argparse.ArgumentParser, Any, list[str]]:
    """A parser with the sub-commands ``plugins`` register, its sub-parsers, and each plugin that
    could not register with its error."""
    parser = argparse.ArgumentParser(
        prog="vip-hub",
        description=(
            "Released private vision encoders: accounting, ledgers, training, hub and serving."
        ),
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=CommandParser)
    broken = []
    for ep in plugins:
        try:
            ep.load()(sub)
        except (ImportError, AttributeError) as e:  # a package not installed, or half-built
            broken.append(f"{ep.name} ({e})")
    if broken:
        parser.epilog = "unavailable commands: " + "; ".join(broken)
    return parser, sub, broken


USER_FIXABLE = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
    | {errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP}
)
"""The OSErrors a command reports as one line: the disk, the permissions, or a path the user
gave that is no file where one is wanted (a folder, a path under a file, a link loop), not a
bug."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except VipHubError as e:
        if os.environ.get("VIP_HUB_DEBUG"):
            raise
        print(f"vip-hub {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in USER_FIXABLE or os.environ.get("VIP_HUB_DEBUG"):
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"vip-hub {args.command}: error: {e.strerror}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
