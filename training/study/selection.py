"""Each (Syn) encoder's feature mode, chosen once on the public selection records and read by
the heads of every encoder trained from it (a short DP run keeps its prior's geometry, and one
choice per prior costs a fraction of one per encoder): ``choose_pooling`` scores every mode the
(Syn) repo offers, spatial modes included, by two DP heads fit on each half of the records and
scored on the other, their noise on the averaged gradient that of the noisiest private head
reading the choice. No private record takes part."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vip_hub.loading import load_encoder
from vip_hub.privacy.ledger import DPStage

from ..data.labelled import LabelledArrays
from ..recipes.probe import choose_pooling
from .budget import head_epsilon
from .config import StudyConfig
from .heads import head_config, head_sampling

__all__ = ["Choice", "choose_modes"]


@dataclass(frozen=True)
class Choice:
    """A (Syn) encoder's chosen feature mode, every mode's selection score (top-1 %), the (Syn)
    encoder's name and how many selection records chose."""

    mode: str
    scores: dict[str, float]
    prior: str
    records: int

    def describe(self) -> str:
        """The mode and how it was chosen, as the comparison shows it."""
        return (
            f"{self.mode} features (the best of {len(self.scores)} modes on public test records "
            f"0-{self.records - 1}, scored on {self.prior})"
        )


def choose_modes(
    cfg: StudyConfig,
    readers: Mapping[Path, Sequence[Sequence[DPStage]]],
    selection: LabelledArrays,
    private: LabelledArrays,
    device: str = "cpu",
) -> dict[Path, Choice]:
    """Each (Syn) encoder repo of ``readers`` (mapped to the DP stages on ``private`` of every
    encoder whose heads read its choice: none for the (Syn) encoder itself) with its mode,
    chosen on the ``selection`` records for a head on ``private`` after the most spent of those
    stages."""
    q, steps = head_sampling(cfg, len(private), private.dataset.name)
    images = [selection.pil(i) for i in range(len(selection))]
    out = {}
    for prior, stages in readers.items():
        noisiest = min(head_epsilon(cfg, s, q, steps) for s in stages)
        head = head_config(cfg, len(private), noisiest, dataset=private.dataset.name)
        mode, scores = choose_pooling(
            load_encoder(prior, device=device), images, selection.labels,
            len(private.classes), head, len(private), cfg.head_components,
        )  # fmt: skip
        out[prior] = Choice(mode, scores, prior.name, len(selection))
        shown = ", ".join(f"{m} {v:.1f}" for m, v in sorted(scores.items(), key=lambda kv: -kv[1]))
        print(f"    {prior.name}: modes on public records: {shown}; chosen {mode}", flush=True)
    return out
