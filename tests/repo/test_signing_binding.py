"""What a signature and `verify` bind, attacked by someone who can edit a published repo folder:
every file a loader reads is one `verify` checks and the signature covers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helpers import (
    TINY,
    audit_of,
    dp_stage,
    synthetic_stage,
    tiny_encoder,
    tiny_repo_with_head,
)

from training.recipes.probe import top1_result
from vip_hub import export_encoder, update_repo
from vip_hub.cli.main import main
from vip_hub.errors import TamperedFileError, UnsafePathError
from vip_hub.privacy.ledger import (
    NOISED_CANARIES,
    Dataset,
    DPStage,
    PrivacyLedger,
    privacy_headline,
    shown_epsilon,
)
from vip_hub.repo import card as card_module
from vip_hub.repo.card import card_info, ledger_rows
from vip_hub.repo.heads import HeadInfo, LinearProbe, list_heads, save_head
from vip_hub.repo.signing import create_key, load_keys, sign_repo, verify_signature
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import CARD_FILE, head_component


@pytest.fixture
def alice(tmp_path: Path) -> tuple[Path, Path]:
    """A key pair outside any repo: (private key, public key)."""
    private, public = create_key(tmp_path / "keys", "alice")
    return private, public.path


def _signed_repo(folder: Path, private_key: Path) -> Path:
    repo = export_encoder(
        folder, tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name=folder.name
    )
    sign_repo(repo, private_key)
    return repo


def test_a_head_added_through_a_linked_folder_is_refused(tmp_path, alice, capsys):
    """A folder link is not walked, so its files were neither verified nor signed, yet the head
    loader (``list_heads``, the inference service) follows it: a head added after signing, here
    hidden in the repo itself, was served as the trainer's."""
    repo = _signed_repo(tmp_path / "repo", alice[0])
    donor = tiny_repo_with_head(tmp_path / "donor")
    shutil.copytree(donor / head_component("toy"), repo / ".payload")
    (repo / head_component("toy")).parent.mkdir()
    (repo / head_component("toy")).symlink_to(Path("..", ".payload"), target_is_directory=True)
    assert list_heads(repo) == ["toy"]  # what a loader of this folder serves
    linked = f"{head_component('toy')}: a link to a folder"
    with pytest.raises(UnsafePathError, match=linked):
        verify_repo(repo)
    with pytest.raises(UnsafePathError, match=linked):
        verify_signature(repo, load_keys([alice[1]]))
    assert main(["verify", str(repo), "--key", str(alice[1])]) == 1
    assert linked in capsys.readouterr().err
    with pytest.raises(UnsafePathError, match=linked):
        sign_repo(repo, alice[0])  # a signature that leaves out what is loaded


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda tags: [t for t in tags if t != "differential-privacy"] + ["no-private-data"],
            "tags claim no-private-data, which its ledger does not give",
        ),
        (
            lambda tags: [t for t in tags if t != "differential-privacy"],
            "tags leave out differential-privacy, which its ledger gives",
        ),
    ],
)
def test_card_tags_that_the_ledger_does_not_give_fail_verify(tmp_path, change, message):
    """The hub answers a model's tags from its card's front matter (``/api/models``): tags that
    say a repo trained on private data used none passed verify, the ledger copy beside them
    intact."""
    repo = export_encoder(
        tmp_path / "repo", tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name="r"
    )
    _, front, body = (repo / CARD_FILE).read_text(encoding="utf-8").split("---\n", 2)
    data = yaml.safe_load(front)
    data["tags"] = change(data["tags"])
    (repo / CARD_FILE).write_text(
        "---\n" + yaml.safe_dump(data, sort_keys=False) + "---\n" + body, encoding="utf-8"
    )
    report = verify_repo(repo)
    assert [str(p) for p in report.problems] == [f"{CARD_FILE}: {message}"]
    assert report.problems[0].kind is TamperedFileError


@pytest.mark.parametrize(
    "change",
    [
        lambda body, ledger: body.replace(
            privacy_headline(ledger.summary()).split(",")[0], "ε = 0.1"
        ),
        lambda body, ledger: body.replace(f"| {ledger_rows(ledger)[-1][-1]} |", "| 0.1 |"),
        lambda body, ledger: "\n".join(
            line for line in body.splitlines() if not line.startswith("| Guarantee assumes |")
        ),
    ],
    ids=["headline", "ledger row", "assumptions"],
)
def test_card_text_that_misstates_the_ledger_fails_verify(tmp_path, change):
    """Users read the guarantee off the card's text: an ε edited in its headline or in its
    ledger table, or the row of what it assumes removed, passed verify, the ledger copy in its
    front matter intact."""
    repo = export_encoder(
        tmp_path / "repo", tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name="r"
    )
    assert verify_repo(repo).ok
    ledger = PrivacyLedger.read(repo)
    _, front, body = (repo / CARD_FILE).read_text(encoding="utf-8").split("---\n", 2)
    changed = change(body, ledger)
    assert changed != body
    (repo / CARD_FILE).write_text("---\n" + front + "---\n" + changed, encoding="utf-8")
    report = verify_repo(repo)
    assert [p.where for p in report.problems] == [CARD_FILE], report.problems
    assert "which its ledger gives" in str(report.problems[0])
    assert report.problems[0].kind is TamperedFileError


def _dp_repo(folder: Path) -> Path:
    """A tiny repo whose one DP stage gives ε 4.04 (RDP), 3.513 (PRV), 3.503 (PLD) at δ 1e-05."""
    return export_encoder(
        folder, tiny_encoder(), TINY, [synthetic_stage(), dp_stage()], model_name="r"
    )


def _with_text(repo: Path, line: str) -> None:
    path = repo / CARD_FILE
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")


@pytest.mark.parametrize(
    "line, problem",
    [
        ("This encoder is (ε = 1.00, δ = 1e-05)-DP.", "'ε = 1.00', which is no ε"),
        ("Trained at epsilon 0.5 on the private set.", "'epsilon 0.5', which is no ε"),
        ("Guarantee: ε=3.4", "'ε=3.4', which is no ε"),  # the accountants give 3.503-4.039
        ("Or ε = 3.9", "'ε = 3.9', which is no ε"),  # between them: none of them, nor above all
        ("The accountants' δ = 1e-06.", "'δ = 1e-06', which is no δ"),
        ("Audited: ε ≥ 9.9.", "'ε ≥ 9.9', above every ε"),
        (
            "A private release with ε = 0.",
            "'ε = 0', which the encoder (its line names no head) does not give (ε is not 0)",
        ),
        (
            "Pure DP: δ = 0.",
            "'δ = 0', which the encoder (its line names no head) does not give (δ is not 0)",
        ),
        ("Roughly ε = 3.", "'ε = 3', which is no ε"),  # 3.503 rounds to 4 (or up), never 3
        # as it renders: an entity, a comment, TeX, a mathematical letter, a superscript power
        ("It is &epsilon; = 1.00.", "'ε = 1.00', which is no ε"),
        ("It is ε<!-- hidden -->= 1.", "'ε= 1', which is no ε"),
        ("It is $\\varepsilon = 1$.", "'varepsilon = 1', which is no ε"),
        ("It is **𝛆** = 1.", "'ε = 1', which is no ε"),
        ("With δ = 10⁻⁹.", "'δ = 10^-9', which is no δ"),
        ("A (1.00, 1e-09)-DP encoder.", "'(1.00, 1e-09)-DP', which is no ε"),
        ("Its (ε, δ) = (1, 1e-5).", "'(ε, δ) = (1, 1e-5)', which is no ε"),
        ("Its ε₁ = 1.00.", "'ε = 1.00', which is no ε"),  # an index is not the figure
        ("It is ε\u200b = 1.00.", "'ε = 1.00', which is no ε"),  # a zero-width space
        pytest.param("ε ≥ 9" + "9" * 400 + "^9999", "'ε ≥ 99999", id="past Decimal's range"),
    ],
)
def test_card_text_that_adds_a_figure_the_ledger_does_not_give_fails_verify(
    tmp_path, line, problem
):
    """Every statement the ledger gives stayed in the text and verify passed while a line added
    to it claimed another ε or δ: each figure the text states is one the ledger gives, to its
    digits, or above them all (a weaker claim, true of every component)."""
    repo = _dp_repo(tmp_path / "repo")
    _with_text(repo, line)
    report = verify_repo(repo)
    assert len(report.problems) == 1, report.problems
    assert str(report.problems[0]).startswith(f"{CARD_FILE}: its text states {problem}")
    assert report.problems[0].kind is TamperedFileError


@pytest.mark.parametrize(
    "line",
    [
        "In short: ε = 4.0, δ = 0.00001.",  # the headline's figures, fewer digits
        "Under PRV the same run gives ε = 3.51, or epsilon 3.5.",  # a reference accountant's
        "Its stage: ε = 4.039 (RDP).",  # the ledger table's figure, with the ε written out
        "At most ε = 4.1.",  # the claim rounded up
        "The paper's target was ε = 8 at δ = 1e-4.",  # looser than the ledger: true
        "ε around 8 is common; e^ε ≈ 2 is not a figure of ε.",  # no number stated of ε
        "1. a head at a fixed ε\n2. its calibration",  # a figure stays on its line
        "ε₁ = 4.04 and $\\varepsilon_2 = 3.51$",  # an index is not the figure
        "The composed ε of 2 heads; an ε 3 times the head's; Δ = 0.00 points.",  # counts
        "```python\nAdamW(params, eps=1e-8)  # epsilon = 1e-8\n```",  # code is not prose
    ],
)
def test_card_text_that_restates_the_ledgers_figures_verifies(tmp_path, line):
    repo = _dp_repo(tmp_path / "repo")
    _with_text(repo, line)
    assert verify_repo(repo).ok, verify_repo(repo).problems


def test_a_comparison_rows_figures_hold_in_its_row_alone_and_its_privacy_cell_alone(tmp_path):
    """Other repos' guarantees are the comparison table's rows: the card renders them and
    verifies, but their figures in the card's own prose do not, and a row's cells cannot hide
    the prose's symbols (a row named ``ε``)."""
    repo = _dp_repo(tmp_path / "repo")
    other = {"repo": "vip/b", "privacy": "(ε = 1.00, δ = 1e-05)-DP on x [RDP]", "top1": 0.5}
    update_repo(repo, comparison=[{**other, "model": "ε", "features": "δ"}])
    assert verify_repo(repo).ok, verify_repo(repo).problems
    assert "| ε | vip/b | (ε = 1.00, δ = 1e-05)-DP on x \\[RDP\\] | δ | 0.5000 |" in (
        repo / CARD_FILE
    ).read_text(encoding="utf-8")
    _with_text(repo, "This encoder: ε = 1.00.")
    assert [str(p) for p in verify_repo(repo).problems] == [
        f"{CARD_FILE}: its text states 'ε = 1.00', which is no ε of the encoder (its line names no "
        "head), nor above every ε its ledger gives"
    ]


def test_a_public_priors_card_with_a_dp_head_states_the_encoders_zero(tmp_path):
    """A prior trained on no private data is ε = 0 while its DP head is not: the card states
    both and verifies (the encoder's zero is given by its component, not by the ledger as a
    whole), and a figure under the head's ε still fails."""
    repo = export_encoder(
        tmp_path / "prior", tiny_encoder(), TINY, [synthetic_stage()], model_name="p"
    )
    probe = dp_stage().model_copy(update={"name": "dp-probe", "component": head_component("toy")})
    save_head(repo, LinearProbe(192, 3).eval(), HeadInfo("toy", "avg", ["a", "b", "c"]), probe)
    text = (repo / CARD_FILE).read_text(encoding="utf-8")
    assert "no private data (ε = 0) (the encoder)" in text
    assert verify_repo(repo).ok, verify_repo(repo).problems
    _with_text(repo, "The head is (ε = 2.00, δ = 1e-05)-DP.")
    assert "'ε = 2.00', which is no ε" in str(verify_repo(repo).problems)


def test_a_comparison_row_smuggled_into_the_prose_or_its_other_cells_fails(tmp_path):
    """The front matter's rows are no ledger's: a row's rendered line pasted into the prose
    stood for another repo's guarantee there, and a claim put in a row's model cell was read as
    that repo's; only the privacy cell of a whole table line is set aside."""
    repo = _dp_repo(tmp_path / "repo")
    claim = {"model": "This encoder is (ε = 0.10, δ = 1e-09)-DP", "repo": "", "features": "f"}
    row = {**claim, "privacy": "(ε = 0.10, δ = 1e-09)-DP on x [RDP]", "top1": 0.5}
    with pytest.raises(TamperedFileError, match="'ε = 0.10', which is no ε"):  # its model cell
        update_repo(repo, comparison=[row])
    assert verify_repo(repo).ok  # the update is refused, the repo left as it was


def test_a_dataset_two_heads_compose_on_states_its_composed_figure(tmp_path):
    """Two DP heads on one labelled dataset: the guarantee paragraph states their composition,
    a figure no one component gives (the ledger's guarantee for that dataset does)."""
    repo = _dp_repo(tmp_path / "repo")
    for name in ("a", "b"):
        probe = dp_stage(n=2000).model_copy(
            update={"name": f"dp-probe-{name}", "component": head_component(name)}
        )
        probe = probe.model_copy(
            update={"dataset": probe.dataset.model_copy(update={"name": "labels"})}
        )
        head = LinearProbe(192, 3).eval()
        save_head(repo, head, HeadInfo(name, "avg", ["x", "y", "z"]), probe)
    assert verify_repo(repo).ok, verify_repo(repo).problems


def _probe_toy(repo: Path, sigma: float) -> str:
    """Save head ``toy`` with a DP stage at ``sigma`` and a card result naming its ε; returns
    the result's protocol."""
    probe = dp_stage(sigma=sigma).model_copy(
        update={"name": "dp-probe", "component": head_component("toy")}
    )
    protocol = f"top-1, DP linear head 'toy' (DP epsilon {probe.epsilon:.3g})"
    head, info = LinearProbe(192, 3).eval(), HeadInfo("toy", "avg", ["a", "b", "c"])
    save_head(repo, head, info, probe, top1_result("toy", 0.5, protocol))
    return protocol


def test_a_replaced_heads_card_result_goes_with_it(tmp_path):
    """A head probed again at another ε: its old result (whose protocol names the old ε) stayed
    on the card beside the new one, a figure of a stage no longer in the ledger."""
    repo = _dp_repo(tmp_path / "repo")
    for sigma in (2.0, 1.0):
        protocol = _probe_toy(repo, sigma)
        assert verify_repo(repo).ok, verify_repo(repo).problems
    results = card_info((repo / CARD_FILE).read_text(encoding="utf-8")).eval_results
    assert [r.metric_name for r in results] == [protocol]


def test_a_head_probed_again_on_a_card_from_before_results_named_their_head(tmp_path):
    """Results written before ``metric_config`` named their head are the head's when their
    protocol quotes its name, as every recipe's does."""
    repo = _dp_repo(tmp_path / "repo")
    path = repo / CARD_FILE
    for sigma in (2.0, 1.0):  # the stale result's ε (σ 2) is no figure of the new ledger
        _probe_toy(repo, sigma)
        text = path.read_text(encoding="utf-8")  # as a card written before metric_config was
        config = f"      config: {head_component('toy')}\n"
        path.write_text(text.replace(config, ""), encoding="utf-8")
        assert config in text and "config:" not in path.read_text(encoding="utf-8")
    assert verify_repo(repo).ok, verify_repo(repo).problems
    assert len(card_info(path.read_text(encoding="utf-8")).eval_results) == 1


@pytest.mark.parametrize(
    "front",
    [
        lambda front: "- a list\n",
        lambda front: (
            front
            + "probe_comparison:\n- {model: m, repo: '', privacy: p, features: f, top1: 1%s}\n"
            % ("0" * 400)
        ),
        lambda front: front.replace("\ntags:", "\nold_tags:") + "tags: 3\n",
        lambda front: "1: 2\n" + front,
    ],
    ids=["no mapping", "a top-1 past a float", "tags not a list", "a key not a string"],
)
def test_a_card_front_matter_verify_cannot_read_is_named_not_raised(tmp_path, front):
    repo = _dp_repo(tmp_path / "repo")
    _, old, body = (repo / CARD_FILE).read_text(encoding="utf-8").split("---\n", 2)
    (repo / CARD_FILE).write_text("---\n" + front(old) + "---\n" + body, encoding="utf-8")
    report = verify_repo(repo)  # raised ValueError, OverflowError, TypeError
    assert all(p.where == CARD_FILE for p in report.problems), report.problems


def _probe(name: str, sigma: float, sampling: str = "poisson", audited: bool = False) -> DPStage:
    """Head ``name``'s DP probe stage at ``sigma`` on labelled data of its own, with an audit of
    1,000 canaries (3 in 5 guesses right) when ``audited``."""
    fields: dict[str, Any] = {
        "name": f"dp-probe-{name}",
        "component": head_component(name),
        "dataset": Dataset(name=f"labels-{name}", size=1000),
        "sample_rate": 0.05,
        "noise_multiplier": sigma,
        "steps": 100,
        "clipping_norm": 0.1,
        "noised_tensors": {"unreleased:test": 1_000},
        "sampling": sampling,
    }
    stage = DPStage.from_parameters(**fields)
    if not audited:
        return stage
    audit = audit_of(stage)
    tensors = {**stage.noised_tensors, NOISED_CANARIES: audit.canaries}
    return DPStage.from_parameters(**{**fields, "noised_tensors": tensors}, audit=audit)


def _save_probe(repo: Path, stage: DPStage) -> None:
    name = stage.component.split("/", 1)[1]
    save_head(repo, LinearProbe(192, 3).eval(), HeadInfo(name, "avg", ["x", "y", "z"]), stage)


_ENCODERS = "the encoder (its line names no head)"


@pytest.mark.parametrize(
    "line, figure, named",
    [
        ("This encoder is (ε = {a}, δ = 1e-05)-DP.", "ε = {a}", _ENCODERS),
        ("Trained at epsilon {a}.", "epsilon {a}", _ENCODERS),
        ("Head `b` is at ε = {a}.", "ε = {a}", "head 'b'"),
        (
            "| x | y | accuracy | 0.5 | linear probe 'b' (DP epsilon {a}) |",
            "epsilon {a}",
            "head 'b'",
        ),
        ("Head `a` is at ε = {a}. Head `b` is at ε = {a} too.", "ε = {a}", "head 'b'"),
        ("The encoder is at ε = {a}. Head `a` reads it.", "ε = {a}", _ENCODERS),
    ],
)
def test_a_heads_figure_stated_of_another_component_fails_verify(tmp_path, line, figure, named):
    """Users read each component's guarantee off the sentence that names it: a head's ε stated
    as the encoder's (or another head's, in the next sentence of its paragraph) verified, being
    a figure of the ledger."""
    repo = _dp_repo(tmp_path / "repo")
    a, b = _probe("a", 2.0), _probe("b", 3.0)
    for stage in (a, b):
        _save_probe(repo, stage)
    eps = shown_epsilon(a.epsilon)
    assert eps != shown_epsilon(b.epsilon) and a.epsilon < 3.503  # below the encoder's
    for naming_a in (
        "Head `a` is at ε = {a}.",
        f"The probe {head_component('a')}: ε = {{a}}.",
        "'a': ε = {a}",
        "Head `a` reads the encoder. Its ε = {a}.",  # the sentence before named it
    ):
        _with_text(repo, naming_a.format(a=eps))
    assert verify_repo(repo).ok, verify_repo(repo).problems
    _with_text(repo, line.format(a=eps))
    report = verify_repo(repo)
    assert [str(p) for p in report.problems] == [
        f"{CARD_FILE}: its text states {figure.format(a=eps)!r}, which is no ε of {named}, nor "
        "above every ε its ledger gives"
    ]
    assert report.problems[0].kind is TamperedFileError


def test_a_zero_holds_on_the_line_of_a_component_that_saw_no_private_data(tmp_path):
    """A public prior's ε = 0 is the encoder's: on a line that names its DP head it verified."""
    repo = export_encoder(
        tmp_path / "prior", tiny_encoder(), TINY, [synthetic_stage()], model_name="p"
    )
    _save_probe(repo, _probe("toy", 2.0))
    _with_text(repo, "The encoder saw no private data: ε = 0.")
    assert verify_repo(repo).ok, verify_repo(repo).problems
    _with_text(repo, "Head `toy`: ε = 0.")
    assert [str(p) for p in verify_repo(repo).problems] == [
        f"{CARD_FILE}: its text states 'ε = 0', which head 'toy' does not give (ε is not 0)"
    ]


def test_a_heads_audit_and_sampling_caveat_state_the_heads_figures(tmp_path):
    """The card's paragraphs on a head's DP stage (its audit, its sampling caveat) name the
    stage, not the head: they state the head's figures, and verify."""
    repo = _dp_repo(tmp_path / "repo")
    stage = _probe("toy", 2.0, sampling="shuffle", audited=True)
    _save_probe(repo, stage)
    text = (repo / CARD_FILE).read_text(encoding="utf-8")
    assert "**Empirical audit of `dp-probe-toy`:**" in text
    assert "**Sampling caveat for `dp-probe-toy`:**" in text
    assert verify_repo(repo).ok, verify_repo(repo).problems


def test_verify_parses_the_cards_front_matter_once(tmp_path, monkeypatch):
    """``verify_repo`` read the card's front matter once for its ledger copy, once for its tags
    and once for its text: now once, beside the check of every Markdown file's kind."""
    repo = _dp_repo(tmp_path / "repo")
    parsed = []

    class Counted(card_module.ModelCardData):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            parsed.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(card_module, "ModelCardData", Counted)
    assert verify_repo(repo).ok
    assert len(parsed) == 2  # content_problem's, for the file's kind, and verify's own


@pytest.mark.parametrize("entry", ["fifo", "dangling", "loop"])
def test_an_entry_that_is_not_a_regular_file_is_named_not_waited_on(tmp_path, alice, capsys, entry):
    """A FIFO in a repo hung `verify` (and sign, push, caption) forever on its read; a link that
    leads nowhere or loops ended in a FileNotFoundError traceback."""
    repo = _signed_repo(tmp_path / "repo", alice[0])
    odd = repo / "extra.bin"
    if entry == "fifo":
        os.mkfifo(odd)
    elif entry == "dangling":
        odd.symlink_to(tmp_path / "gone")
    else:
        odd.symlink_to(odd)
    expected = "not a regular file" if entry == "fifo" else "a link that leads to no file"
    with pytest.raises(UnsafePathError, match=f"extra.bin: {expected}"):
        verify_repo(repo)
    assert main(["verify", str(repo), "--key", str(alice[1])]) == 1
    assert f"extra.bin: {expected}" in capsys.readouterr().err
    with pytest.raises(UnsafePathError, match=expected):
        sign_repo(repo, alice[0])
