"""``/`` (models, sortable and filterable by epsilon at the hub's one delta), ``/{org}/{name}``
(card, ledger, files, history) and ``/datasets/{name}`` (every public release on a dataset,
composed at the hub's delta, the dataset owner's apart from other publishers').
Server-rendered: they work without JavaScript."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.routing import Match
from starlette.types import Scope

from vip_hub.models.encoders import ARCHS
from vip_hub.privacy.accounting import Accountant, composed_epsilon
from vip_hub.privacy.ledger import (
    DPStage,
    LedgerError,
    PrivacyLedger,
    compose_releases,
    dataset_identity,
    shown_delta,
    shown_epsilon,
)
from vip_hub.repo.card import (
    LEDGER_COLUMNS,
    audit_paragraphs,
    component_headlines,
    format_params,
    guarantee_paragraphs,
    ledger_rows,
)
from vip_hub.repo_format import CARD_FILE, DEFAULT_BRANCH, LEDGER_FILE, SIGNATURE_FILE

from ..auth import identity
from ..errors import BadRequest, NotFound
from ..hub.common import readable_repo, store_of
from ..metrics import Metrics
from ..store import CommitRecord, FileEntry, HubStore, RepoRecord
from ..store.naming import (
    MAX_REVISION_LENGTH,
    RESERVED_NAMESPACES,
    validate_repo_id,
    validate_revision,
)
from .cache import ComputedOnce
from .render import card_body, markdown_html

__all__ = ["install"]

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["epsilon"] = shown_epsilon  # a claim shown rounded up, never to the nearest
templates.env.filters["delta"] = shown_delta
templates.env.globals["signature_file"] = SIGNATURE_FILE
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
}
"""Sent with every page: no script runs, nothing loads from elsewhere (a card's images from
other sites are links: ``markdown_html``), no framing (nosniff goes with every response:
``service/headers.py``)."""
MAX_CARD_BYTES = 1024**2
"""Largest model card a page renders (about a second per MiB, and each commit's page is kept:
``commit_pages``); a larger one is linked to, not shown (a commit may carry gigabytes)."""
SORTS = {
    "updated": "Last update",
    "epsilon": "ε",
    "name": "Name",
    "params": "Parameters",
    "arch": "Architecture",
}


def install(app: FastAPI) -> None:
    """Mount the pages and their static files on ``app``; its dataset compositions are kept
    in ``app.state.compositions``, what model pages show of each commit in
    ``app.state.commit_pages``."""
    app.state.compositions = ComputedOnce(app.state.settings.hub.compositions_kept)
    app.state.commit_pages = ComputedOnce(app.state.settings.hub.page_cache_entries)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.add_api_route(
        "/", index, methods=["GET"], response_class=HTMLResponse, include_in_schema=False
    )
    app.add_api_route(  # before /{org}/{name}: /datasets/NAME is a dataset, not a model
        "/datasets/{dataset:path}",
        dataset_page,
        methods=["GET"],
        response_class=HTMLResponse,
        include_in_schema=False,
    )
    for path, page in (("/{org}/{name}", model_page), ("/{org}/{name}/commit/{sha}", commit_page)):
        app.router.add_api_route(
            path, page, methods=["GET"], include_in_schema=False, route_class_override=_RepoRoute
        )


class _RepoRoute(APIRoute):
    """A page route under ``/{org}/`` that leaves the reserved namespaces to the service's own
    routes: ``GET /v1/embeddings`` is then a 405 (the route takes POST), not a missing repo."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE and child["path_params"]["org"] in RESERVED_NAMESPACES:
            return Match.NONE, {}
        return match, child


def index(
    request: Request,
    sort: str = Query("updated"),
    order: str = Query("desc", pattern="^(asc|desc)$"),
    max_epsilon: str = Query("", max_length=20),
    q: str = Query("", max_length=200),
) -> HTMLResponse:
    if sort not in SORTS:
        raise BadRequest(f"cannot sort by {sort!r}")
    try:
        bound = float(max_epsilon) if max_epsilon.strip() else None
    except ValueError:
        raise BadRequest(f"max_epsilon must be a number, not {max_epsilon!r}") from None
    store = store_of(request)
    rows = store.list_models(
        search=q or None,
        max_epsilon=bound,
        sort=sort,
        descending=order == "desc",
        limit=request.app.state.settings.hub.page_size,
    )
    models = [
        {
            "id": repo.repo_id,
            "arch": c.arch,
            "params": format_params(c.num_params),
            "epsilon": c.epsilon,
            "delta": c.delta,
            "datasets": c.datasets,
            "updated": _date(c.created_at),
            "accountant": (c.accountant or "").upper(),
            "caveat": c.caveat,
            "weak_delta": c.weak_delta,
        }
        for repo, c in rows
    ]
    return templates.TemplateResponse(
        request,
        "index.html",
        {
            "models": models,
            "sort": sort,
            "order": order,
            "max_epsilon": max_epsilon,
            "q": q,
            "sorts": SORTS,
        },
        headers=PAGE_HEADERS,
    )


def model_page(
    request: Request,
    org: str,
    name: str,
    revision: str = Query(DEFAULT_BRANCH, max_length=MAX_REVISION_LENGTH),
) -> HTMLResponse:
    store = store_of(request)
    repo = readable_repo(store, org, name, identity(request))
    commit = store.resolve(repo.repo_id, validate_revision(revision))
    context: dict[str, Any] = {
        "repo": repo,
        "revision": revision,
        "history": store.history(repo.repo_id, commit, limit=50),
        "signature": store.signature(commit),
        "date": _date,
        "default_branch": DEFAULT_BRANCH,
        **request.app.state.commit_pages.get(
            (repo.repo_id, commit),
            partial(_commit_content, store, request.app.state.metrics, repo.repo_id, commit),
        ),
    }
    return templates.TemplateResponse(request, "model.html", context, headers=PAGE_HEADERS)


def _commit_content(store: HubStore, metrics: Metrics, repo_id: str, commit: str) -> dict[str, Any]:
    """What a model page shows of one commit: its card, guarantee, ledger and files, rendered
    once per commit (kept in ``app.state.commit_pages``: a commit never changes)."""
    metrics.page_renders.inc()
    record = store.commit_record(repo_id, commit)
    tree = store.tree(repo_id, commit)
    file_base = f"/{repo_id}/resolve/{commit}"
    try:
        ledger = PrivacyLedger.parse(store.blob_path(tree[LEDGER_FILE]).read_bytes())
    except LedgerError:  # cannot happen for a verified commit; shown rather than hidden
        ledger = None
    return {
        "commit": record,
        "card_html": _card_html(store, tree[CARD_FILE], file_base),
        "headlines": component_headlines(ledger) if ledger else [],
        "guarantee_html": [
            markdown_html(p) for p in guarantee_paragraphs(ledger, _unit(record.arch))
        ]
        if ledger
        else [],
        "audit_html": [markdown_html(p) for p in audit_paragraphs(ledger)] if ledger else [],
        "ledger_columns": LEDGER_COLUMNS,
        "ledger_rows": ledger_rows(ledger) if ledger else [],
        "weak_stages": [s for s in ledger.dp_stages() if s.weak_delta] if ledger else [],
        "files": [
            {
                "path": e.path,
                "size": _size(e.size),
                "sha256": e.sha256,
                "url": f"{file_base}/{quote(e.path)}",
            }
            for e in tree.values()
        ],
        "datasets": [
            {"name": d, "url": dataset_link(d)}
            for d in dict.fromkeys(s.dataset.name for s in (ledger.dp_stages() if ledger else []))
        ],
        "params": format_params(record.num_params),
    }


def _card_html(store: HubStore, card: FileEntry, file_base: str) -> str:
    """The model card rendered; over ``MAX_CARD_BYTES``, unread: a link to its file."""
    if card.size > MAX_CARD_BYTES:
        return markdown_html(
            f"This model card is {_size(card.size)}, over the {_size(MAX_CARD_BYTES)} a page "
            f"shows: [read it as a file]({CARD_FILE}).",
            file_base,
        )
    return markdown_html(card_body(store.blob_path(card).read_text(encoding="utf-8")), file_base)


def dataset_page(request: Request, dataset: str) -> HTMLResponse:
    """Every public release's DP stages that name ``dataset`` in any spelling that reads as it
    (``dataset_identity``; the default branch of each repo), and their composition at the hub's
    one delta, each stage once: the owner's (repos in the namespace ``dataset`` names) apart from
    other publishers'; what an adversary reading them faces. Each composition is computed once per
    change of those releases (``_composed``)."""
    store = store_of(request)
    delta = request.app.state.settings.hub.delta
    # a name without one has no owner; namespaces are unique whatever their case only, so a
    # look-alike spelling (al_ice for al-ice) is another publisher's, not the owner's
    owner = dataset.split("/")[0] if "/" in dataset else None
    identity = dataset_identity(dataset)
    names = [n for n in store.public_dataset_names() if dataset_identity(n) == identity]
    groups: dict[bool, list[DPStage]] = {True: [], False: []}
    rows: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    sources = []
    for repo, commit in _every_model(store, names or [dataset]):
        sources.append(f"{repo.repo_id}@{commit.sha}")
        tree = store.tree(repo.repo_id, commit.sha)
        ledger = PrivacyLedger.parse(store.blob_path(tree[LEDGER_FILE]).read_bytes())
        own = owner is not None and repo.org.lower() == owner.lower()
        for s in ledger.dp_stages():
            if dataset_identity(s.dataset.name) == identity:
                groups[own].append(s)
                rows[own].append(_stage_row(repo.repo_id, s, delta))
    if not (groups[True] or groups[False]):
        raise NotFound(f"no public release names the dataset {dataset!r}")
    digest = hashlib.sha256("\n".join(sorted(sources)).encode()).hexdigest()
    key = (identity, owner.casefold() if owner else "", digest)  # one entry per reading of it
    return templates.TemplateResponse(
        request,
        "dataset.html",
        {
            "dataset": dataset,
            "spellings": sorted({s.dataset.name for s in groups[True] + groups[False]}),
            "owner": owner,
            "delta": delta,
            "owners": rows[True],
            "others": rows[False],
            "composed": _composed(request.app, (*key, "owner"), groups[True], delta),
            "composed_all": _composed(
                request.app, (*key, "all"), groups[True] + groups[False], delta
            )
            if groups[False]
            else None,
            "distinct": {own: len({s.identity for s in groups[own]}) for own in groups},
            "repos": {own: sorted({r["repo"] for r in rows[own]}) for own in rows},
            "assumed_poisson": any(r["sampling"] != "poisson" for r in rows[True] + rows[False]),
        },
        headers=PAGE_HEADERS,
    )


def _every_model(store: HubStore, datasets: list[str]) -> Iterator[tuple[RepoRecord, CommitRecord]]:
    """Every public repo with a DP stage on one of ``datasets``, by name, a page at a time."""
    for offset in itertools.count(0, _PAGE):
        page = store.list_models(
            dataset=datasets, sort="name", descending=False, limit=_PAGE, offset=offset
        )
        yield from page
        if len(page) < _PAGE:
            return


_PAGE = 1000


def _composed(
    app: FastAPI, key: tuple[str, ...], stages: list[DPStage], delta: float
) -> dict[str, Any] | None:
    """``compose_releases`` of ``stages`` at ``delta`` as the page shows it (None without
    stages), computed once per ``key`` (``app.state.compositions``), under PRV only up to
    ``hub.max_prv_stages`` distinct stages (``prv_budget`` says when it was left out)."""
    if not stages:
        return None
    budget = app.state.settings.hub.max_prv_stages
    count = len({s.identity for s in stages})
    accountants = [a for a in Accountant if not (count > budget and a is Accountant.PRV)]

    def compose() -> dict[Accountant, float]:
        app.state.metrics.compositions.inc()
        return compose_releases(stages, delta, accountants)

    epsilons = app.state.compositions.get((*key, delta), compose)
    return {
        "epsilons": [(a.value.upper(), eps) for a, eps in epsilons.items()],
        "stages": count,
        "prv_budget": budget if count > budget else None,
    }


def _stage_row(repo_id: str, s: DPStage, delta: float) -> dict[str, Any]:
    """One stage of the dataset page: as stated, and its claim's accountant at the hub's delta."""
    at_hub = composed_epsilon([s.mechanism_tuple], delta, s.accountant)
    return {
        "repo": repo_id,
        "stage": s.name,
        "id": s.identity[:12],
        "component": s.component,
        "mechanism": s.mechanism,
        "q": f"{s.sample_rate:.4g}",
        "sigma": f"{s.noise_multiplier:.4g}",
        "steps": f"{s.steps:,}",
        "delta": shown_delta(s.delta),
        "weak_delta": s.weak_delta,
        "epsilon": f"{shown_epsilon(s.epsilon)} ({s.accountant.value.upper()})",
        "epsilon_at_hub": shown_epsilon(at_hub),
        "sampling": s.sampling,
    }


def dataset_link(name: str) -> str:
    """The path of ``name``'s dataset page."""
    return f"/datasets/{quote(name, safe='/')}"


def commit_page(org: str, name: str, sha: str) -> RedirectResponse:
    """Where ``commitUrl`` points: the model page at that commit (a 400 for an id or revision
    the page would refuse)."""
    validate_repo_id(org, name)
    return RedirectResponse(f"/{org}/{name}?revision={validate_revision(sha)}", status_code=303)


def _unit(arch: str | None) -> str:
    """The unit of privacy the page names: one example of the arch's family's recipe."""
    return ARCHS[arch].family.unit if arch in ARCHS else "training example"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _date(iso: str) -> str:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).strftime("%Y-%m-%d %H:%M UTC")
