"""MkDocs hook: the reference pages, generated from the code at every build (never written by
hand, so they cannot drift): the CLI from the ``vip-hub`` parsers (every installed plugin), the
service's settings from their pydantic fields, the ledger's JSON schema from its model, the
REST API from the app's OpenAPI document, the Python API pages (mkdocstrings directives), and
the benchmarks' figures page from the benchmarks' README as committed.

Nothing is written into ``docs/``: the pages exist only in the build (``File.generated``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import tomllib
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from pydantic import BaseModel

log = logging.getLogger(f"mkdocs.plugins.{__name__}")

GENERATED = (
    "<!-- Generated at build time by docs/hooks/reference.py: edit the code, not this page. -->"
)

# The Python reference: one page per part of the code, each the modules' docstrings
# (mkdocstrings). Public modules of vip_hub, and the entry points of training/ and service/.
API_PAGES: dict[str, tuple[str, str, list[str]]] = {
    "reference/api/loading.md": (
        "Loading and the top-level package",
        "What `import vip_hub` offers (`vip_hub.load_encoder`, `vip_hub.epsilon`, "
        "`vip_hub.PrivacyLedger`, `vip_hub.export_encoder`, `vip_hub.verify_repo`, ...) is "
        "imported lazily from the modules documented in this reference; loading comes first.",
        ["vip_hub.loading", "vip_hub.errors"],
    ),
    "reference/api/privacy.md": (
        "Privacy: ledger, accountants, sensitivities, audit",
        "The ledger and its summaries, the three accountants and calibration, each mechanism's "
        "sensitivity, and the one-run audit's arithmetic.",
        [
            "vip_hub.privacy.ledger",
            "vip_hub.privacy.accounting",
            "vip_hub.privacy.sensitivity",
            "vip_hub.privacy.audit",
        ],
    ),
    "reference/api/models.md": (
        "Models: families, feature modes, the text decoder",
        "The encoder families and their registry, feature modes, the DP-Cap text decoder and "
        "its tokenizer.",
        [
            "vip_hub.models.encoders",
            "vip_hub.models.features",
            "vip_hub.models.text_decoder",
            "vip_hub.models.tokenizer",
            "vip_hub.models.names",
        ],
    ),
    "reference/api/repo.md": (
        "Repos: write, verify, sign, publish, import",
        "The released-encoder repo: writing and updating it, verification, signing, heads, "
        "pushing to a hub, importing reference checkpoints, the card and the content rules.",
        [
            "vip_hub.repo.files",
            "vip_hub.repo.verify",
            "vip_hub.repo.signing",
            "vip_hub.repo.heads",
            "vip_hub.repo.push",
            "vip_hub.repo.importer",
            "vip_hub.repo.card",
            "vip_hub.repo.content",
            "vip_hub.repo.artifacts",
        ],
    ),
    "reference/api/core.md": (
        "The bottom layer and the command line's core",
        "The repo format's names, safe paths, devices, the local hub's defaults, the RGB rule "
        "of decoded images, and the `vip-hub` command's core (its sub-commands: [CLI](../cli.md)).",
        [
            "vip_hub.repo_format",
            "vip_hub.paths",
            "vip_hub.device",
            "vip_hub.local_hub",
            "vip_hub.images",
            "vip_hub.cli.main",
        ],
    ),
    "reference/api/training.md": (
        "Training: the main job, the study, the recipes, the DP engine",
        "The entry points of `training/`: the main job (`vip-hub run`), the Fashion-MNIST study "
        "it and `benchmarks/utility.py` run, each recipe's settings and training function, the "
        "DP engine and the run skeleton every recipe shares.",
        [
            "training.main_job",
            "training.study",
            "training.study.config",
            "training.study.splits",
            "training.study.features",
            "training.study.budget",
            "training.study.heads",
            "training.study.selection",
            "training.study.table",
            "training.recipes.syn",
            "training.recipes.vip",
            "training.recipes.dpcap",
            "training.recipes.logit_dp",
            "training.recipes.finetune",
            "training.recipes.probe",
            "training.recipes.class_means",
            "training.dp.engine",
            "training.dp.run",
            "training.skeleton.run",
        ],
    ),
    "reference/api/service.md": (
        "Service: the app and its settings",
        "The entry points of `service/`: the FastAPI app (`create_app`), its settings "
        "(tabulated in [Settings](../settings.md)) and the service's commands.",
        ["service.app", "service.settings", "service.cli"],
    ),
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).parent
    # the benchmarks' README, named as pyproject.toml names the project's
    readme = tomllib.loads((root / "pyproject.toml").read_text())["project"]["readme"]
    pages = {
        "reference/cli.md": cli_page(),
        "reference/settings.md": settings_page(),
        "reference/rest.md": rest_page(),
        "reference/ledger-schema.md": ledger_page(),
        "results/benchmarks.md": benchmarks_page(root / "benchmarks" / readme),
    }
    for path, (title, intro, modules) in API_PAGES.items():
        pages[path] = api_page(title, intro, modules)
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    files.append(File.generated(config, "reference/openapi.json", content=openapi_json()))
    files.append(File.generated(config, "reference/privacy-ledger.schema.json", content=schema()))
    return files


def api_page(title: str, intro: str, modules: list[str]) -> str:
    blocks = "\n\n".join(f"::: {m}" for m in modules)
    return f"{GENERATED}\n\n# {title}\n\n{intro}\n\n{blocks}\n"


# ---- the command line ----------------------------------------------------------------------


@contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps help at $COLUMNS: fix it, so a build does not depend on the terminal."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_sections(name: str, parser: argparse.ArgumentParser, level: int) -> Iterator[str]:
    """A command's help under a heading, then its sub-commands' (if it has any), one level down."""
    yield f"{'#' * level} `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n"
    for sub, child in sorted(_subcommands(parser).items()):
        yield from _command_sections(f"{name} {sub}", child, level + 1)


def cli_page() -> str:
    from vip_hub.cli.main import build_parser

    with _columns(100):
        parser = build_parser()
        if parser.epilog:  # a plugin that did not load: its commands would be missing here
            log.warning("the CLI reference lacks commands: %s", parser.epilog)
        top = parser.format_help().rstrip()
        commands = sorted(_subcommands(parser).items())
        sections = [s for name, p in commands for s in _command_sections(f"vip-hub {name}", p, 2)]
    index = "\n".join(  # a command's description is its help (vip_hub.cli.main.add_command)
        f"| [`vip-hub {name}`](#vip-hub-{name}) | {_cell(p.description or '')} |"
        for name, p in commands
    )
    return (
        f"{GENERATED}\n\n# Command line\n\n"
        "Every `vip-hub` sub-command, as its parser prints `--help`. Each package registers its "
        "own (entry-point group `vip_hub.commands`): a command whose extra is not installed "
        "(`serve`, `train`) is listed as unavailable by `vip-hub --help`.\n\n"
        f"```text\n{top}\n```\n\n| command | what it does |\n| --- | --- |\n{index}\n\n"
        + "\n".join(sections)
    )


# ---- settings ------------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    """``int``, ``Path | None``, ``'path' | 'virtual'`` (a Literal's values)."""
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(annotation))
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("pathlib.", "")


def _bounds(metadata: list[Any]) -> str:
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = []
    for item in metadata:
        for attr, sign in signs.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {_number(value)}")
    return ", ".join(parts)


def _number(value: Any) -> str:
    """Integers of whole MiB or GiB with their size beside them."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024**2:
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
            if value % size == 0:
                return f"{value} ({value // size} {unit})"
    return repr(value) if isinstance(value, str) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _settings_rows(model: type[BaseModel], prefix: str) -> Iterator[str]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            continue  # a section: tabulated on its own
        kind = f"`{_type_name(annotation)}`"  # a pipe in a code span does not split the cell
        bounds = _bounds(field.metadata)
        default = field.get_default(call_default_factory=True)
        yield (
            f"| `{prefix}{name}` | {kind}{', ' + bounds if bounds else ''} | "
            f"`{_number(default)}` | {_cell(field.description or '')} |"
        )


def _env_of(prefix: str) -> str:
    return "VIP_HUB_" + prefix.replace(".", "__").upper()


def settings_page() -> str:
    from service import settings

    head = "| setting | type | default | what it sets |\n| --- | --- | --- | --- |\n"
    top = settings.Settings
    example = next(iter(n for n in top.model_fields if n != "store"), "port")
    out = [
        f"{GENERATED}\n\n# Settings\n\n{settings.__doc__.strip()}\n\n"
        "A setting's environment variable is its name in capitals after `VIP_HUB_`, with `__` "
        f"between a section and its field: `{example}` is `{_env_of(example)}`, "
        "`inference.max_batch_size` is `VIP_HUB_INFERENCE__MAX_BATCH_SIZE`. A TOML file holds "
        "the same names, sections as tables (`[hub]`, `[inference]`); `vip-hub serve --config "
        "FILE` names one too. Sizes are in bytes, times in seconds (`_s`) or milliseconds "
        "(`_ms`).\n\n## Top level\n\n"
        f"{top.__doc__} Environment variables `{_env_of('')}<NAME>`.\n\n{head}"
        + "\n".join(_settings_rows(top, ""))
    ]
    for name, field in top.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            doc = " ".join((section.__doc__ or "").split())
            rows = "\n".join(_settings_rows(section, f"{name}."))
            env = f"Environment variables `{_env_of(name)}__<NAME>`."
            out.append(f"## `{name}`\n\n{doc} {env}\n\n{head}{rows}")
    return "\n\n".join(out) + "\n"


# ---- the ledger's schema ------------------------------------------------------------------


def _schema() -> dict[str, Any]:
    from vip_hub.privacy.ledger import PrivacyLedger

    return PrivacyLedger.model_json_schema(by_alias=True)


def schema() -> str:
    return json.dumps(_schema(), indent=2, ensure_ascii=False) + "\n"


def _schema_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " or ".join(_schema_type(p) for p in prop[key])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return " or ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    kind = prop.get("type", "any")
    if kind == "array" and "items" in prop:
        return f"array of {_schema_type(prop['items'])}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"object of {_schema_type(prop['additionalProperties'])}"
    return str(kind)


def _schema_table(model: dict[str, Any]) -> str:
    required = set(model.get("required", []))
    rows = [
        f"| `{name}` | {_schema_type(prop)} | {'yes' if name in required else ''} | "
        f"{_cell(prop.get('description', ''))} |"
        for name, prop in model.get("properties", {}).items()
    ]
    head = "| field | type | required | description |\n| --- | --- | --- | --- |\n"
    return head + "\n".join(rows)


def ledger_page() -> str:
    from vip_hub.privacy.ledger import SCHEMA
    from vip_hub.repo_format import LEDGER_FILE

    doc = _schema()
    parts = [
        f"{GENERATED}\n\n# Privacy ledger schema\n\n"
        f"The JSON schema of `{LEDGER_FILE}` (schema `{SCHEMA}`), generated from its "
        "pydantic model `vip_hub.privacy.ledger.PrivacyLedger` (what the fields mean: "
        "[the privacy ledger](../concepts/ledger.md)). The whole schema as a file: "
        "[privacy-ledger.schema.json](privacy-ledger.schema.json).\n\n"
        f"## {doc.get('title', 'PrivacyLedger')}\n\n"
        f"{_cell(doc.get('description', ''))}\n\n{_schema_table(doc)}"
    ]
    for name, model in sorted(doc.get("$defs", {}).items()):
        if "properties" in model:
            desc = _cell(model.get("description", ""))
            parts.append(f"## {name}\n\n{desc}\n\n{_schema_table(model)}")
        else:
            parts.append(
                f"## {name}\n\n{_cell(model.get('description', ''))} {_schema_type(model)}"
            )
    body = json.dumps(doc, indent=2, ensure_ascii=False)
    parts.append(f"## The schema\n\n```json\n{body}\n```")
    return "\n\n".join(parts) + "\n"


# ---- REST ----------------------------------------------------------------------------------

_OPENAPI: dict[str, Any] = {}


def _openapi() -> dict[str, Any]:
    """The app's OpenAPI document, from an app on a throwaway store (hub and inference on)."""
    if not _OPENAPI:
        from service.app import create_app
        from service.settings import Settings

        with tempfile.TemporaryDirectory(prefix="vip-hub-docs-") as store:
            _OPENAPI.update(create_app(Settings(store=Path(store))).openapi())
    return _OPENAPI


def openapi_json() -> str:
    return json.dumps(_openapi(), indent=2, ensure_ascii=False) + "\n"


def rest_page() -> str:
    doc = _openapi()
    groups: dict[str, list[str]] = {}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            tag = (op.get("tags") or ["other"])[0]
            summary = _cell(op.get("summary", "") or "")
            description = _cell(" ".join((op.get("description") or "").split()))
            groups.setdefault(tag, []).append(
                f"| `{method.upper()}` | `{_cell(path)}` | {summary} | {description} |"
            )
    out = [
        f"{GENERATED}\n\n# REST API\n\n"
        f"Every route of `vip-hub serve` ({doc['info']['title']} {doc['info']['version']}), "
        "from the app's own OpenAPI document, which a running server also serves at "
        "`/openapi.json`; the same document as a file: [openapi.json](openapi.json). How to "
        "call the inference routes: [the inference API](../guides/inference.md); the hub "
        "routes are what `huggingface_hub` and `timm` clients call. Routes the app leaves out "
        "of its schema (file downloads, Xet, the web pages) are not listed.\n"
    ]
    head = "| method | path | summary | description |\n| --- | --- | --- | --- |\n"
    for tag in sorted(groups):
        out.append(f"## {tag}\n\n{head}" + "\n".join(groups[tag]))
    return "\n\n".join(out) + "\n"


# ---- results -------------------------------------------------------------------------------


def benchmarks_page(readme: Path) -> str:
    """The benchmarks' README ``readme`` as committed, under a note saying where it comes from."""
    text = readme.read_text(encoding="utf-8")
    title, _, rest = text.partition("\n")
    note = (
        f"\n\n> This page is `benchmarks/{readme.name}` as committed, shown here whole: what each "
        "benchmark measures, how to run it, its targets and every figure with its history.\n"
    )
    return f"{GENERATED}\n\n{title}{note}{rest}"
