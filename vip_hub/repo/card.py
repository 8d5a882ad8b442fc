"""Model cards: rendered from ``model_cards/encoder.md`` with huggingface_hub's ModelCard.

The card is a pure function of the repo's config (architecture, family, feature modes), its
ledger, whether it carries a text decoder with its vocabulary, and a small ``CardInfo`` (name,
summary, licence, evaluation results), so it can be rendered again whenever the ledger grows
(e.g. when a probe head is added). One template serves every family: what differs in the
architecture (heads, layout, feature modes, captioning) comes from
``vip_hub.models.encoders.Family``; what was done (the recipe line, the tags, what the guarantee
assumes) comes from the ledger's stages alone (``recipe_line``, ``card_tags``,
``guarantee_assumes``).
"""

from __future__ import annotations

import html
import math
import re
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from importlib.resources import files
from typing import Any
from urllib.parse import quote

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.repocard import REGEX_YAML_BLOCK

from ..errors import LedgerError, RepoFormatError
from ..models.encoders import EncoderSpec
from ..models.features import PIXELS, SpatialMode, describe, pixel_width
from ..privacy.accounting import CURAND_FLOAT32_SUPPORT
from ..privacy.ledger import (
    DPStage,
    NonPrivateStage,
    PrivacyLedger,
    privacy_headline,
    rounding_before_2026_12_03,
    shown_delta,
    shown_epsilon,
)
from ..privacy.sensitivity import FP32_BLOCKED, ROUNDING_SUM
from ..repo_format import (
    CARD_FILE,
    CARD_LEDGER_KEY,
    CONFIG_FILE,
    ENCODER,
    HEADS_DIR,
    LEDGER_FILE,
    TEXT_DECODER_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    FrontMatterLimits,
)

__all__ = [
    "DEFAULT_LICENSE",
    "LEDGER_COLUMNS",
    "PRIVACY_TAGS",
    "CardInfo",
    "StatedFigure",
    "audit_paragraphs",
    "card_info",
    "card_ledger",
    "card_prose_problem",
    "card_statements",
    "card_tags",
    "card_tags_problem",
    "comparison_lines",
    "component_headlines",
    "format_params",
    "front_matter_problem",
    "guarantee_assumes",
    "guarantee_paragraphs",
    "ledger_rows",
    "load_card",
    "recipe_line",
    "render_card",
    "stated_figures",
    "yaml_problem",
]

LEDGER_COLUMNS = (
    "Stage",
    "Component",
    "Data",
    "Mechanism",
    "q",
    "σ",
    "Steps",
    "Clip C",
    "Batch (expected)",
    "δ",
    "ε",
)

DEFAULT_LICENSE = "apache-2.0"
"""The card's licence when the writer names none."""
TAGS = ["vision-transformer", "image-feature-extraction", "timm"]
"""Every card's tags; ``card_tags`` adds what the ledger's stages did."""
DP_TAG, NO_PRIVATE_DATA_TAG = "differential-privacy", "no-private-data"
PRIVACY_TAGS = (DP_TAG, NO_PRIVATE_DATA_TAG)
"""The tags that claim something of the training data: a card holds one exactly when its ledger
gives it (``card_tags_problem``)."""
_LIBYAML: type[yaml.SafeLoader] | type[yaml.CSafeLoader] = getattr(
    yaml, "CSafeLoader", yaml.SafeLoader
)
"""The YAML parser tried first (``yaml_problem``'s pass, ``load_card``'s load): libyaml's safe
loader where PyYAML was built with it, about 15 times faster than PyYAML's own."""
_MARKUP = re.compile(r"([\\`*_\[\]<>!|&~#])")


@dataclass
class CardInfo:
    """What a card says beyond config and ledger."""

    model_name: str
    repo_id: str
    summary: str = ""
    license: str = DEFAULT_LICENSE
    eval_results: list[EvalResult] = field(default_factory=list)
    # Rows of a side-by-side probe comparison (this model, other models): {"model", "repo",
    # "privacy", "features", "top1"} and, for a head drawn several times, "draws": DP heads
    # (or zero-shot above chance) released in the repo named, top-1 on public test data, each
    # row's guarantee (head and encoder composed); kept in the front matter as
    # ``probe_comparison``; the card says when a row names no repo.
    comparison: list[dict[str, Any]] = field(default_factory=list)


def render_card(
    info: CardInfo,
    spec: EncoderSpec,
    ledger: PrivacyLedger,
    *,
    num_params: int,
    feature_dims: dict[str, int],
    captions: bool = False,
    plots: Sequence[str] = (),
) -> str:
    """The model card's text (front matter + Markdown) for a repo whose feature modes have the
    widths ``feature_dims`` (the configuration's); ``captions`` when it carries a text decoder and
    its vocabulary."""
    arch, family = spec.architecture, spec.family
    data = ModelCardData(
        model_name=info.model_name,
        library_name="timm",
        license=info.license,
        pipeline_tag="image-feature-extraction",
        tags=card_tags(ledger, captions),
        datasets=list(dict.fromkeys(s.dataset.name for s in ledger.stages)),
        eval_results=info.eval_results or None,
        summary=info.summary,
        repo_id=info.repo_id,
    )
    data[CARD_LEDGER_KEY] = ledger.to_dict()
    data["probe_comparison"] = info.comparison or None  # after the ledger, as always written
    template = files("model_cards").joinpath("encoder.md").read_text(encoding="utf-8")
    card = ModelCard.from_template(
        data,
        template_str=template,
        arch=spec.arch,
        family=family,
        depth=spec.depth,
        width=arch.embed_dim,
        heads=arch.num_heads,
        patch_size=spec.patch_size,
        img_size=spec.img_size,
        params=format_params(num_params),
        modes=[
            {"name": m, "dim": d, "text": describe(m)}
            for m, d in {**feature_dims, PIXELS: pixel_width((spec.img_size,) * 2)}.items()
        ],
        spatial=any(SpatialMode.parse(m) for m in feature_dims),
        probe_mode=next(iter(feature_dims)),
        avg_dim=feature_dims["avg"],
        captions=captions,
        caption_family=family.captions,
        **_ledger_fields(ledger),
        guarantee_paragraphs=guarantee_paragraphs(ledger, spec.family.unit),
        public_stages=", ".join(
            f"{_code(s.name)} ({_md(s.dataset.name)})"
            for s in ledger.stages
            if isinstance(s, NonPrivateStage) and not s.private_data
        ),
        unprotected=", ".join(
            f"{_code(s.name)} ({_md(s.dataset.name)}, component {_md(s.component)})"
            for s in ledger.stages
            if isinstance(s, NonPrivateStage) and s.private_data
        ),
        unit=f"one training example (one {spec.family.unit})",
        adjacency="add/remove-one",
        schema=ledger.schema_,
        ledger_columns=LEDGER_COLUMNS,
        stage_details=[
            {"name": _md(s.name), "component": _md(_trained(s)), "text": _stage_text(s)}
            for s in ledger.stages
        ],
        plots=[{"alt": _md(p), "url": quote(p)} for p in plots],
        results=info.eval_results,
        comparison=info.comparison,
        comparison_lines=comparison_lines(info.comparison),
        files={  # the repo's file names as the card's text names them: repo_format's
            "ledger": LEDGER_FILE,
            "weights": WEIGHTS_FILE,
            "config": CONFIG_FILE,
            "text_decoder": TEXT_DECODER_FILE,
            "vocab": VOCAB_FILE,
            "card_ledger_key": CARD_LEDGER_KEY,
        },
    )
    return str(card)


def _ledger_fields(ledger: PrivacyLedger) -> dict[str, Any]:
    """What the card's body says from the ledger alone, as the template renders it: the recipe,
    the arithmetic assumed, each component's headline, the audits and the ledger's rows."""
    return {
        "recipe": _md(recipe_line(ledger)),
        "assumes": _md(guarantee_assumes(ledger)),
        "headline": _md(privacy_headline(ledger.summary())),
        "head_headlines": [(name, _md(line)) for name, line in component_headlines(ledger)[1:]],
        "audit_paragraphs": audit_paragraphs(ledger),
        "ledger_rows": [[_md(cell) for cell in row] for row in ledger_rows(ledger)],
    }


def card_statements(ledger: PrivacyLedger) -> list[str]:
    """What a card's text states from ``ledger`` alone, each as rendered: the privacy headlines,
    the recipe, the arithmetic assumed, the audits and each ledger row's cells."""
    fields = _ledger_fields(ledger)
    return [
        fields["headline"],
        *(line for _, line in fields["head_headlines"]),
        fields["recipe"],
        fields["assumes"],
        *fields["audit_paragraphs"],
        *(" | ".join(row) for row in fields["ledger_rows"]),
    ]


def card_prose_problem(
    text: str, ledger: PrivacyLedger, card: ModelCardData | None = None
) -> str | None:
    """Why the card's ``text`` does not state what ``ledger`` gives (one of ``card_statements``
    missing) or states an ε or δ that the components its sentence speaks of do not give
    (``stated_figures``, ``_Scopes``; ``card``, its front matter's metadata, sets its comparison
    table's rows aside), else None: users read the guarantee off the card's text, which its
    front matter's ledger copy does not bind."""
    match = REGEX_YAML_BLOCK.search(text)
    body = text[match.end() :] if match else text
    missing = next(_unstated(body, ledger), None)
    if missing is not None:
        return f"its text does not state {_clipped(missing)!r}, which its ledger gives"
    try:
        comparison = _card_info(card).comparison if card is not None else []
    except TypeError:  # a front matter value of the wrong type
        comparison = []
    lines = [line.rstrip() for line in body.splitlines()]
    rows = zip(
        comparison_lines(comparison), comparison_lines(comparison, privacy=False), strict=True
    )
    for row, without_privacy in rows:  # another repo's guarantee, in its row alone
        if row in lines:
            lines[lines.index(row)] = without_privacy
    scopes = _Scopes(ledger)
    for line in _plain("\n".join(lines)).split("\n"):
        for sentence, components in scopes.named(line):
            for f in _line_figures(sentence):
                if problem := scopes.problem(f, components):
                    return f"its text states {_clipped(f.text)!r}, {problem}"
    return None


def _unstated(body: str, ledger: PrivacyLedger) -> Iterator[str]:
    """The ``card_statements`` that ``body`` states neither as rendered now nor, for a card
    written before 2026-12-03, as rendered then (rendered again only where one is missing)."""
    now = card_statements(ledger)
    if all(line in body for line in now):
        return
    with rounding_before_2026_12_03():
        then = card_statements(ledger)
    yield from (a for a, b in zip(now, then, strict=True) if a not in body and b not in body)


def _clipped(text: str, limit: int = 160) -> str:
    """``text`` as a message quotes it: its first ``limit`` characters."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def comparison_lines(rows: Sequence[Any], *, privacy: bool = True) -> list[str]:
    """The card's probe-comparison rows (``CardInfo.comparison``) as its table's Markdown lines
    (``privacy=False``: that cell left empty), a row's head draws beside its top-1; a row it
    cannot render (a field missing, a top-1 or a draw not a number) is left out."""
    lines = []
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        try:
            repo = _md(row["repo"]) if row.get("repo") else "no repo: in no ledger"
            guarantee = _md(row["privacy"]) if privacy else ""
            cells = [_md(row["model"]), repo, guarantee, _md(row["features"])]
            draws = row.get("draws") or []
            each = f" (draws {', '.join(f'{float(d):.4f}' for d in draws)})" if draws else ""
            lines.append(f"| {' | '.join(cells)} | {float(row['top1']):.4f}{each} |")
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
    return lines


@dataclass(frozen=True)
class StatedFigure:
    """An ε or δ as a text states it (``ε = 3.00``, ``epsilon 0.5``, ``δ = 1e-05``, ``ε ≥ 0.2``)."""

    text: str
    symbol: str
    """``ε`` or ``δ``."""
    value: float
    unit: float
    """One unit in the last digit shown: the figure stands for any value less than this away."""
    lower_bound: bool
    """Stated as a lower bound (``≥``, ``>``), as an audit's is; else as the figure or a bound
    above it."""


_SP = r"[^\S\n]*"  # spaces within one line
_NUMBER = r"(?:\d+(?:\.\d+)?|\.\d+)"
_SCALE = rf"(?:{_SP}[eE]{_SP}|{_SP}(?:[x×·*]{_SP}10{_SP})?\^{_SP}\(?{_SP})([-+]?\d{{1,4}})"
_AMOUNT = rf"({_NUMBER}(?:{_SCALE})?)(?!\.?\d|{_SP}times\b)"
_RELATION = r"(:=|=|≈|~|≃|≅|>=|≥|⩾|≳|>|<=|≤|⩽|≲|<|:|is\b)"
_FIGURE = re.compile(  # a symbol, then a relation or a space, then the figure
    rf"(?<![\w^])(varepsilon|[Ee]psilon|[Dd]elta|ε|δ)(?:{_SP}{_RELATION}{_SP}|[^\S\n]+){_AMOUNT}"
)
_PAIR = re.compile(  # (ε, δ) = (a, b), and (a, b)-DP
    rf"\({_SP}(?:varepsilon|[Ee]psilon|ε){_SP},{_SP}(?:[Dd]elta|δ){_SP}\){_SP}"
    rf"(?:(?:=|:=|:){_SP})?\({_SP}{_AMOUNT}{_SP},{_SP}{_AMOUNT}{_SP}\)"
    rf"|\({_SP}{_AMOUNT}{_SP},{_SP}{_AMOUNT}{_SP}\){_SP}(?:-{_SP})?(?:DP\b|differential)"
)
_LOWER = ("≥", ">=", ">", "⩾", "≳")
_SUPERSCRIPT = re.compile("[⁺⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+")
_HIDDEN = re.compile(r"<!--.*?(?:-->|$)|</?[A-Za-z][^<>]*>", re.DOTALL)
_FENCED = re.compile(r"^(`{3,}|~{3,})[^\n]*\n.*?(?:^\1[^\n]*$|\Z)", re.DOTALL | re.MULTILINE)
_INDEXED = re.compile(r"(ε|ϵ|δ|epsilon|delta)(?:_\{?\w{1,3}\}?|[₀-₉]+)")


def stated_figures(text: str) -> list[StatedFigure]:
    """Every ε and δ the Markdown ``text``'s prose states with a number: after its symbol (or
    ``epsilon``, ``delta``) and a relation or a space, within one line, or as an ``(ε, δ)``
    pair, read as it renders (``_plain``); ``e^ε`` is not one (the guarantee paragraph computes
    it), nor a count (``ε 3 times``)."""
    return [f for line in _plain(text).split("\n") for f in _line_figures(line)]


def _line_figures(line: str) -> list[StatedFigure]:
    """``stated_figures`` of one line of plain text (``_plain``'s)."""
    out = []
    for m in _FIGURE.finditer(line):
        name, relation, number = m.groups()[:3]
        symbol = "δ" if name in ("δ", "delta", "Delta") else "ε"
        out.append(_figure(m.group(0), symbol, number, relation in _LOWER))
    for m in _PAIR.finditer(line):
        groups = m.groups()
        eps, delta = (groups[0], groups[2]) if groups[0] is not None else (groups[4], groups[6])
        out += [_figure(m.group(0), "ε", eps, False), _figure(m.group(0), "δ", delta, False)]
    return out


def _plain(markdown: str) -> str:
    """``markdown`` as a reader sees its prose: code blocks, comments and tags dropped,
    entities resolved, superscript exponents written ``^``, a symbol's index (``ε₁``,
    ``ε_1``) dropped, NFKC, no format characters, no emphasis, code or escape marks, and no
    dollar signs around TeX."""
    text = html.unescape(_HIDDEN.sub("", _FENCED.sub("", markdown)))
    text = _INDEXED.sub(r"\1", text)
    text = _SUPERSCRIPT.sub(lambda m: "^" + unicodedata.normalize("NFKC", m.group(0)), text)
    text = unicodedata.normalize("NFKC", text).replace("\u2212", "-")
    text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return re.sub(r"[*_`\\$]", "", text)


def _figure(text: str, symbol: str, number: str, lower_bound: bool) -> StatedFigure:
    """A stated figure from ``number`` as written: ``0.5``, ``1e-05``, ``1 x 10^-5``, ``10^-5``."""
    m = re.fullmatch(rf"({_NUMBER})(?:{_SCALE})?", number)
    assert m is not None  # the patterns above matched it
    mantissa, exponent = m.groups()
    decimals = len(mantissa.partition(".")[2])
    if exponent is not None and "^" in number and not re.search(r"[x×·*]", number):
        try:  # a power: its magnitude is its unit
            value = float(Decimal(mantissa) ** int(exponent)) if Decimal(mantissa) else 0.0
        except ArithmeticError:  # past Decimal's exponents: no figure is that large
            value = math.inf
        return StatedFigure(text, symbol, value, value, lower_bound)
    scale = int(exponent or 0)
    value = float(Decimal(mantissa).scaleb(scale))
    unit = float(Decimal(1).scaleb(scale - decimals))
    return StatedFigure(text, symbol, value, unit, lower_bound)


@dataclass(frozen=True)
class _Given:
    """Figures a ledger gives: upper bounds on ε, its audits' lower bounds and ceilings, δs."""

    upper: tuple[float, ...] = ()
    lower: tuple[float, ...] = ()
    deltas: tuple[float, ...] = ()

    def __add__(self, other: _Given) -> _Given:
        return _Given(
            self.upper + other.upper, self.lower + other.lower, self.deltas + other.deltas
        )


def _component_figures(ledger: PrivacyLedger, component: str) -> _Given:
    """The figures ``component``'s weights give: its guarantees (``summary``: a head's compose
    its encoder's stages), or 0 where it saw no private data, what holds without amplification,
    and each DP stage they compose under every accountant, with its audit's figures."""
    summary = ledger.summary(component)
    given = _Given(
        upper=tuple(g.epsilon for g in summary.guarantees)
        + (() if summary.private_data else (0.0,))
        + (
            ()
            if summary.epsilon_without_amplification is None
            else (summary.epsilon_without_amplification,)
        ),
        deltas=tuple(g.delta for g in summary.guarantees),
    )
    for name in dict.fromkeys(n for g in summary.guarantees for n in g.stages):
        s = ledger.stage(name)
        assert isinstance(s, DPStage)  # a guarantee composes DP stages alone
        given += _Given((s.epsilon, *s.reference_epsilon.values()), (), (s.delta,))
        if s.audit is not None:
            a = s.audit
            given += _Given(
                tuple(a.accountant_epsilon.values()), (a.epsilon_lower_bound, a.ceiling), (a.delta,)
            )
    return given


_HALF = 0.5 + 1e-9
"""Half a unit in the last digit shown, and a little: a figure rounded to the nearest at a tie."""


class _Scopes:
    """Which components each sentence of a card's plain text (``_plain``'s) speaks of, and the
    figures they give (``card_prose_problem``). A sentence speaks of the heads it names
    (``heads/<name>``, ``head <name>`` or ``'<name>'``: the card's privacy rows, ledger table,
    training list and results name theirs so), or, naming none, of those the last sentence
    before it in its line that named any did; a stage's audit paragraph and a guarantee's
    paragraph speak of the components their stages trained; any other sentence speaks of the
    encoder. A table row is one sentence. Several components give their figures and the
    ledger's guarantees that compose only their stages (two heads on one dataset)."""

    def __init__(self, ledger: PrivacyLedger):
        self._ledger = ledger
        components = [ENCODER, *(c for c in ledger.components() if c != ENCODER)]
        self._figures = {c: _component_figures(ledger, c) for c in components}
        self._heads = {c: _naming(c) for c in components[1:]}
        self._audits = {
            _plain(p): s.trained_components
            for s in ledger.dp_stages()
            for p in _stage_audit_paragraphs(ledger, s)
        }
        self._guarantees = {
            _plain(_guarantee_lead(ledger, g)): _guarantee_components(ledger, g)
            for g in ledger.guarantees
        }
        self._given: dict[tuple[str, ...], _Given] = {}
        self._everything = self._of(tuple(components))

    def named(self, line: str) -> list[tuple[str, tuple[str, ...]]]:
        """Each sentence of ``line`` with the components it speaks of, the encoder first."""
        sentences = [line] if line.lstrip().startswith("|") else _SENTENCE_END.split(line)
        heads = [{c for c, p in self._heads.items() if p.search(s)} for s in sentences]
        audited, carried, spoken = set(self._audits.get(line, ())), set[str](), []
        for lead, components in self._guarantees.items():
            if line.startswith(lead):  # a guarantee's paragraph names its components after
                audited.update(components)
        for sentence, named in zip(sentences, heads, strict=True):
            carried = named or carried
            spoken.append(
                (sentence, tuple(c for c in self._figures if c in audited | carried) or (ENCODER,))
            )
        return spoken

    def _of(self, components: tuple[str, ...]) -> _Given:
        if components not in self._given:
            within = {ENCODER, *components}
            composed = [
                g
                for g in self._ledger.guarantees
                if within.issuperset(
                    c for n in g.stages for c in self._ledger.stage(n).trained_components
                )
            ]
            self._given[components] = sum(
                (self._figures[c] for c in components),
                _Given(tuple(g.epsilon for g in composed), (), tuple(g.delta for g in composed)),
            )
        return self._given[components]

    def problem(self, f: StatedFigure, components: tuple[str, ...]) -> str | None:
        """Why ``f``, stated in a sentence that speaks of ``components``, is none of their
        figures (read to its digits: rounded to the nearest or up), nor above every figure of
        the ledger (a weaker claim, true of every component, whichever is meant), else None;
        a lower bound on ε holds unless above all of theirs, a zero only where one of them has
        ε zero."""
        given, half = self._of(components), f.unit * _HALF  # a tie rounds either way
        who = (
            "the encoder (its line names no head)"
            if components == (ENCODER,)
            else " and ".join(
                "the encoder" if c == ENCODER else f"head {c.split('/', 1)[1]!r}"
                for c in components
            )
        )
        if f.lower_bound and f.symbol == "ε":
            if f.value - half < max([*given.upper, *given.lower], default=0.0):
                return None
            return f"above every ε of {who}"
        figures = given.deltas if f.symbol == "δ" else given.upper
        if f.value == 0:
            return None if 0.0 in figures else f"which {who} does not give ({f.symbol} is not 0)"
        everything = self._everything.deltas if f.symbol == "δ" else self._everything.upper
        above_all = f.value > max(everything, default=math.inf) - half
        if above_all or any(-half < f.value - v < f.unit for v in figures):
            return None
        return f"which is no {f.symbol} of {who}, nor above every {f.symbol} its ledger gives"


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[^\sa-z])")
"""Where a sentence of plain text ends: a full stop, question or exclamation mark, then spaces
and no lower-case letter. A split inside a sentence ("vs. Head b") narrows what follows it to the
heads it names; a sentence left unsplit (a semicolon, a lower-case start) is read as one."""


def _naming(head: str) -> re.Pattern[str]:
    """How a line of plain text names the head component ``head`` (``heads/<name>``): so, or
    as ``head <name>`` or ``'<name>'``, its name as ``_plain`` renders it in code or
    escaped (``_md``)."""
    name = head.split("/", 1)[1]
    spelled = "|".join(re.escape(n) for n in sorted({_plain(name), _plain(_md(name))}))
    return re.compile(
        rf"(?<![\w/.-])(?:{HEADS_DIR}/|(?i:head)[^\S\n]+)(?:{spelled})(?![\w.-]*\w)|'(?:{spelled})'"
    )


def recipe_line(ledger: PrivacyLedger) -> str:
    """The stages that trained the encoder, in order, each named with its mechanism (or no DP)
    and its data: what the card's Recipe row says, from the ledger alone."""
    parts = []
    for s in ledger.stages:
        if ENCODER not in s.trained_components:
            continue
        if isinstance(s, DPStage):
            parts.append(f"{s.name} ({s.mechanism} on {s.dataset.name})")
        else:
            data = "private data, no guarantee" if s.private_data else "no private data"
            parts.append(f"{s.name} (no DP, on {s.dataset.name}: {data})")
    return ", then ".join(parts)


def card_tags(ledger: PrivacyLedger, captions: bool = False) -> list[str]:
    """The card's tags: ``TAGS``, then what the stages did (``differential-privacy`` and each DP
    mechanism, or ``no-private-data``) and ``image-captioning`` when the repo captions."""
    mechanisms = [s.mechanism.lower() for s in ledger.dp_stages()]
    done = [DP_TAG, *dict.fromkeys(mechanisms)] if mechanisms else []
    if not ledger.summary().private_data:
        done.append(NO_PRIVATE_DATA_TAG)
    return [*TAGS, *done, *(["image-captioning"] if captions else [])]


def card_tags_problem(card: ModelCardData, ledger: PrivacyLedger) -> str | None:
    """Why the tags of a card (``card``, its metadata: ``load_card``'s) claim of its data what
    ``ledger`` does not (a ``PRIVACY_TAGS`` tag ``card_tags`` does not give, or one it gives left
    out), else None."""
    tags = card.to_dict().get("tags")
    held = {str(t) for t in tags} if isinstance(tags, list) else set()
    given = set(card_tags(ledger))
    claimed = [t for t in PRIVACY_TAGS if t in held and t not in given]
    left_out = [t for t in PRIVACY_TAGS if t in given and t not in held]
    if claimed:
        return f"tags claim {', '.join(claimed)}, which its ledger does not give"
    if left_out:
        return f"tags leave out {', '.join(left_out)}, which its ledger gives"
    return None


def guarantee_assumes(ledger: PrivacyLedger) -> str:
    """What the repo's guarantees assume of floating point, in one line: the noise's precision
    (float64 rounded once mitigates, it does not prove) and the rule each clipped sum's rounding
    rests on (a proof given per-example gradients independent of their batch, or a model)."""
    stages = ledger.dp_stages()
    if not stages:
        return "nothing of the arithmetic: no DP stage, no private data"
    names = ", ".join
    float32 = [
        s.name
        for s in stages
        if math.isclose(s.noise_support, CURAND_FLOAT32_SUPPORT, rel_tol=1e-12)
    ]
    modelled = [
        s.name for s in stages if s.mechanism_params.get(ROUNDING_SUM, FP32_BLOCKED) == FP32_BLOCKED
    ]
    noise = (
        "Gaussian noise drawn in float64 and rounded once (a mitigation of floating-point "
        "leakage, not a proof)"
        if len(float32) < len(stages)
        else "Gaussian noise"
    )
    if float32:
        noise += f"; {names(float32)} drew and added it in float32 (torch's CUDA generator)"
    proved = [s.name for s in stages if s.name not in modelled]
    rounding = []
    if proved:
        rounding.append(
            f"{names(proved)}: each clipped sum within its rounding allowance, proved given that "
            "an example's gradient does not depend on the rest of its batch"
        )
    if modelled:
        rounding.append(
            f"{names(modelled)}: each clipped sum within its rounding allowance under a model of "
            "blocked fp32 summation, not a proof"
        )
    return f"{noise}; {'; '.join(rounding)}"


def load_card(
    readme: str, *, strict: bool = False, limits: FrontMatterLimits | None = None
) -> ModelCardData:
    """The metadata of ``readme``'s front matter as huggingface_hub's ModelCard reads it (its
    ``data``), once the front matter is known to be within ``limits`` (default:
    ``FrontMatterLimits()``; ``yaml_problem``), parsed by libyaml (``_LIBYAML``; PyYAML's own
    parser where libyaml refuses the text, as the clients read it); ``strict`` refuses bad
    metadata; a value JSON cannot carry (NaN, an infinity), which the hub's index and model list
    would serve, is refused."""
    if problem := front_matter_problem(readme, limits or FrontMatterLimits()):
        raise RepoFormatError(f"{CARD_FILE}: {problem}")
    match = REGEX_YAML_BLOCK.search(readme)
    text = match.group(2) if match else ""  # no front matter: no metadata
    try:
        try:
            fields = yaml.load(text, Loader=_LIBYAML)
        except yaml.YAMLError:
            fields = yaml.load(text, Loader=yaml.SafeLoader)
        if not isinstance(fields, dict | None):
            raise ValueError("repo card metadata block should be a dict")
        data = ModelCardData(**(fields or {}), ignore_metadata_errors=not strict)
    except (ValueError, TypeError) as e:  # no mapping, a key not a string, tags not a list
        raise RepoFormatError(
            f"{CARD_FILE}: its front matter is not a model card's metadata ({e})"
        ) from None
    if where := _nonfinite(data.to_dict()):
        raise RepoFormatError(
            f"{CARD_FILE}: its front matter's {where} is not a finite number (JSON has none)"
        )
    return data


def _nonfinite(value: Any, where: str = "") -> str | None:
    """Where in ``value`` (parsed YAML, nested within the front matter's limits) a float is NaN
    or infinite (``a.b[0]``), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    if isinstance(value, dict):
        inner = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        inner = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    return next(filter(None, (_nonfinite(v, at) for at, v in inner)), None)


def front_matter_problem(markdown: str, limits: FrontMatterLimits) -> str | None:
    """Why the YAML front matter of ``markdown`` may not be loaded (``yaml_problem``), else None."""
    match = REGEX_YAML_BLOCK.search(markdown)
    problem = match and yaml_problem(match.group(2), limits)
    return f"its front matter {problem}" if problem else None


def yaml_problem(text: str, limits: FrontMatterLimits) -> str | None:
    """Why YAML ``text`` may not be loaded (over ``limits`` in size or nesting, or with an alias:
    a few KB of nested aliases expand to gigabytes), else None; from its size, then one pass over
    its YAML events stopped at the first excess (parsing events does not recurse; loading does):
    libyaml's where PyYAML has it (``_LIBYAML``), and PyYAML's own, which yields
    each event as it reads, where libyaml refuses the text (it scans ahead, so a document nested
    past its 1,000 levels raises before the excess is seen, and PyYAML's loader would recurse)."""
    size = len(text.encode("utf-8"))
    if size > limits.max_bytes:
        return f"is {size} bytes, over the limit of {limits.max_bytes} bytes"
    try:
        return _event_problem(text, limits, _LIBYAML)
    except yaml.YAMLError:
        try:
            return _event_problem(text, limits, yaml.SafeLoader)
        except yaml.YAMLError:
            return None  # not YAML: its parser says where, having nested no deeper than the limit


def _event_problem(
    text: str, limits: FrontMatterLimits, loader: type[yaml.SafeLoader] | type[yaml.CSafeLoader]
) -> str | None:
    """``yaml_problem``'s pass over the events of ``text`` as ``loader`` parses it."""
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):
            return "uses YAML aliases ('*name'), which are refused"
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > limits.max_depth:
                return (
                    f"nests lists and mappings deeper than the limit of {limits.max_depth} levels"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return None


def component_headlines(ledger: PrivacyLedger) -> list[tuple[str | None, str]]:
    """What each component promises: (None, the encoder's headline) first, then (head name, the
    head's: its own stages composed with its encoder's), so no figure is mistaken for another."""
    heads = [c for c in ledger.components() if c != ENCODER]
    return [
        (None, privacy_headline(ledger.summary())),
        *[(c.split("/", 1)[1], privacy_headline(ledger.summary(c))) for c in heads],
    ]


def card_ledger(card: ModelCardData) -> PrivacyLedger:
    """The ledger copy kept in a card's front matter (under ``CARD_LEDGER_KEY``), ``card`` its
    metadata (``load_card``'s)."""
    data = card.to_dict()
    if CARD_LEDGER_KEY not in data:
        raise LedgerError([f"{CARD_FILE}: front matter has no {CARD_LEDGER_KEY} block"])
    return PrivacyLedger.parse(data[CARD_LEDGER_KEY])


def format_params(n: int | None) -> str:
    """A parameter count as people read it: ``86.6M``, ``742K``, ``–`` when unknown."""
    if not n:
        return "–"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def card_info(readme: str, limits: FrontMatterLimits | None = None) -> CardInfo:
    """Recover the CardInfo a card was rendered from (its front matter read within ``limits``)."""
    return _card_info(load_card(readme, limits=limits))


def _card_info(data: ModelCardData) -> CardInfo:
    """``card_info`` of a card's metadata (``load_card``'s)."""
    return CardInfo(
        model_name=data.model_name or "",
        repo_id=getattr(data, "repo_id", "") or "",
        summary=getattr(data, "summary", "") or "",
        license=data.license or DEFAULT_LICENSE,
        eval_results=list(data.eval_results or []),
        comparison=list(getattr(data, "probe_comparison", None) or []),
    )


def guarantee_paragraphs(ledger: PrivacyLedger, unit: str = "image") -> list[str]:
    """The guarantee in plain words (Markdown), one paragraph per private dataset."""
    if not ledger.guarantees and any(
        isinstance(s, NonPrivateStage) and s.private_data for s in ledger.stages
    ):
        return [
            "**No stage trained with differential privacy**: no guarantee covers the private "
            "data named below; what only synthetic or public data trained reveals nothing of it."
        ]
    if not ledger.guarantees:
        return [
            "**No private data was used to train these weights**: every stage saw only "
            "synthetic or public data, so the weights reveal nothing about any private dataset "
            "(ε = 0)."
        ]
    return [_guarantee_text(ledger, g, unit) for g in ledger.guarantees]


def ledger_rows(ledger: PrivacyLedger) -> list[list[str]]:
    """The ledger as table rows, one per stage, in the order of ``LEDGER_COLUMNS``."""
    return [_ledger_row(s) for s in ledger.stages]


def audit_paragraphs(ledger: PrivacyLedger) -> list[str]:
    """Each DP stage's empirical audit (and any sampling caveat) in plain words (Markdown)."""
    return [p for s in ledger.dp_stages() for p in _stage_audit_paragraphs(ledger, s)]


def _stage_audit_paragraphs(ledger: PrivacyLedger, s: DPStage) -> list[str]:
    """``audit_paragraphs`` of the DP stage ``s``: its sampling caveat, then its audit's."""
    out = []
    if s.sampling != "poisson":
        without = ledger.summary(s.component).epsilon_without_amplification
        assert without is not None  # summary() computes it always
        out.append(
            f"**Sampling caveat for {_code(s.name)}:** the accounted ε assumes Poisson "
            "sampling (each example in each step independently with probability q), but this "
            f"stage's training used {_code(s.sampling)} sampling instead, so the figures are "
            "what the recipe would give with Poisson sampling, not a formal guarantee for "
            "these weights as they were trained. What holds without amplification by sampling "
            "(each example in each of its epochs, the same σ, PLD): **ε = "
            f"{shown_epsilon(without)}**."
        )
    a = s.audit
    if a is None:
        return out
    accounted = ", ".join(
        f"{shown_epsilon(eps)} ({acc.value.upper()})" for acc, eps in a.accountant_epsilon.items()
    )
    best = max(a.results, key=lambda r: r.correct / r.guesses)
    out.append(
        f"**Empirical audit of {_code(s.name)}:** {a.canaries:,} gradient canaries were each "
        "secretly put in the training data with probability 1/2 and read off every noisy "
        "update. An attack that knew everything but those secret bits could prove at most **ε "
        f"≥ {shown_epsilon(a.epsilon_lower_bound, lower_bound=True)}** with {1 - a.beta:.0%} "
        "confidence (its best guess "
        f"count: {best.correct} of {best.guesses} correct); the accounted ε at the same δ = "
        f"{a.delta:g} is {accounted}. The audit is a lower bound and the accountants an upper "
        "bound: a lower bound above the accounted ε would mean the training leaks more than it "
        "claims, and such a repo does not verify. With every guess right this audit could "
        f"prove at most **ε ≥ {a.ceiling:.2f}** (its ceiling, for {a.canaries:,} canaries at "
        "this δ); "
        + (
            f"it could detect a violation of the accounted ε = {shown_epsilon(a.accounted)}."
            if a.can_fail
            else f"that is not above the accounted ε = {shown_epsilon(a.accounted)}, so **this "
            "audit "
            "could not detect a violation of the claimed ε; it catches only gross bugs**."
        )
    )
    return out


def _guarantee_components(ledger: PrivacyLedger, g: Any) -> list[str]:
    """The components whose weights the guarantee ``g`` covers: those its stages trained."""
    return sorted({c for n in g.stages for c in ledger.stage(n).trained_components})


def _guarantee_lead(ledger: PrivacyLedger, g: Any) -> str:
    """The first sentence of the guarantee ``g``'s paragraph: its figures, dataset and stages."""
    stages = [ledger.stage(n) for n in g.stages]
    return (
        f"**(ε = {shown_epsilon(g.epsilon)}, δ = {shown_delta(g.delta)})-differential privacy "
        "for the dataset "
        f"{_code(g.dataset)}** ({stages[0].dataset.size:,} examples), composed over stage(s) "
        f"{', '.join(_code(s) for s in g.stages)} under the {g.accountant.value.upper()} "
        f"accountant{_reference_note(stages)}."
    )


def _guarantee_text(ledger: PrivacyLedger, g: Any, unit: str) -> str:
    bound = math.exp(g.epsilon) if g.epsilon < 700 else math.inf
    components = _guarantee_components(ledger, g)
    return (
        f"{_guarantee_lead(ledger, g)} In plain words: for any single {unit} of "
        f"{_code(g.dataset)}, anything one can compute from the {_md(' and '.join(components))} "
        f"weights is almost equally likely whether or not that {unit} was in the training data: "
        f"probabilities differ by at most a factor e^ε ≈ {bound:,.3g}, except with probability δ."
    )


def _reference_note(stages: list[Any]) -> str:
    if len(stages) != 1 or not isinstance(stages[0], DPStage) or not stages[0].reference_epsilon:
        return ""
    others = ", ".join(
        f"ε = {shown_epsilon(eps)} under {acc.value.upper()}"
        for acc, eps in stages[0].reference_epsilon.items()
    )
    return f" (for reference: {others}, a tighter analysis of the same run)"


def _trained(s: NonPrivateStage | DPStage) -> str:
    """The components a stage trained, as the card names them, joined by `` + ``."""
    return " + ".join(s.trained_components)


def _ledger_row(s: NonPrivateStage | DPStage) -> list[str]:
    data = s.dataset.name + (f" (n={s.dataset.size:,})" if s.dataset.size else "")
    if isinstance(s, NonPrivateStage):
        note = "none: private data, NO guarantee" if s.private_data else "none (no private data)"
        return [
            s.name,
            _trained(s),
            data,
            note,
            "",
            "",
            "",
            "",
            "",
            "",
            "0" if not s.private_data else "∞",
        ]
    eps = f"{shown_epsilon(s.epsilon, 3)} ({s.accountant.value.upper()})" + "".join(
        f"; {shown_epsilon(v, 3)} ({a.value.upper()})" for a, v in s.reference_epsilon.items()
    )
    sampling = "Poisson" if s.sampling == "poisson" else f"{s.sampling} (accounted as Poisson)"
    return [
        s.name,
        _trained(s),
        data,
        f"{s.mechanism}, {sampling}",
        f"{s.sample_rate:.4g}",
        f"{s.noise_multiplier:.4g}",
        f"{s.steps:,}",
        f"{s.clipping_norm:g}",
        f"{s.expected_batch_size:,.1f}",
        shown_delta(s.delta),
        eps,
    ]


def _stage_text(s: NonPrivateStage | DPStage) -> str:
    text = (
        _md(s.description)
        if s.description
        else (
            f"{_md(s.mechanism)} on {_code(s.dataset.name)}"
            if isinstance(s, DPStage)
            else f"trained on {_code(s.dataset.name)}"
        )
    )
    if isinstance(s, DPStage) and s.hyperparameters:
        text += (
            " Hyperparameters: "
            + _md(", ".join(f"{k} = {v}" for k, v in s.hyperparameters.items()))
            + "."
        )
    return text


def _md(text: str) -> str:
    """A ledger string as literal Markdown text: one line, every character that starts markup
    (or ends a table cell) escaped."""
    return _MARKUP.sub(r"\\\1", " ".join(str(text).split()))


def _code(text: str) -> str:
    """A ledger string as one Markdown code span, whatever backticks or line breaks it holds."""
    text = " ".join(str(text).split())
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = (
        " " if text.startswith("`") or text.endswith("`") else ""
    )  # CommonMark strips one space each side
    return f"{fence}{pad}{text}{pad}{fence}"
