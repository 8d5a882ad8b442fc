"""The lazy public API of ``vip_hub``: ``_EXPORTS`` (used at run time) and the ``TYPE_CHECKING``
re-exports (read by type checkers and ruff) name the same things, and every name resolves."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import vip_hub

INIT = Path(vip_hub.__file__)


def _declarations() -> tuple[dict[str, list[str]], list[tuple[str, str, str | None]]]:
    """``_EXPORTS`` as written, and each TYPE_CHECKING import as (module, name, alias)."""
    tree = ast.parse(INIT.read_text())
    exports = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["_EXPORTS"]
    )
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    )
    imports = []
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        imports += [(node.module or "", alias.name, alias.asname) for alias in node.names]
    return exports, imports


def test_type_checking_block_re_exports_exactly_the_lazy_exports() -> None:
    exports, imports = _declarations()
    not_re_exported = [f"{m}.{n} as {a}" for m, n, a in imports if a != n]
    assert not not_re_exported, f"write `from .x import A as A`: {not_re_exported}"
    declared = sorted((module, name) for module, names in exports.items() for name in names)
    imported = sorted((module, name) for module, name, _ in imports)
    assert len(set(declared)) == len(declared), "a name twice in _EXPORTS"
    assert imported == declared, (
        f"only in TYPE_CHECKING: {sorted(set(imported) - set(declared))}; "
        f"only in _EXPORTS: {sorted(set(declared) - set(imported))}"
    )


def test_every_public_name_resolves_to_its_module_object() -> None:
    exports, _ = _declarations()
    lazy = [name for names in exports.values() for name in names]
    assert vip_hub.__all__ == sorted([*lazy, *vip_hub.errors.__all__])
    for name in vip_hub.errors.__all__:
        assert getattr(vip_hub, name) is getattr(vip_hub.errors, name), f"vip_hub.{name}"
    for module, names in exports.items():
        home = importlib.import_module(f"vip_hub.{module}")
        for name in names:
            assert getattr(vip_hub, name) is getattr(home, name), f"vip_hub.{name}"
