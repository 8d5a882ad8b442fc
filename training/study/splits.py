"""Which Fashion-MNIST records play which part, by public rules (file order), so no record's
membership depends on another: the private records (the first ``train_size`` of the train split,
declared with their n), and of the public test split the selection records (the first
``select_size``: they choose feature modes, and the first ``centre_size`` of them centre every DP
head) and the scoring records (the ``test_size`` after them: top-1, which no choice saw)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from vip_hub.errors import DataError

from ..data.labelled import DATA_DIR, LabelledArrays, fashion_mnist
from .config import StudyConfig

__all__ = ["Splits", "study_splits"]


@dataclass(frozen=True)
class Splits:
    """The study's records: private, selection (its first records centre the heads) and
    scoring."""

    private: LabelledArrays
    selection: LabelledArrays
    centre: LabelledArrays
    test: LabelledArrays

    @property
    def classes(self) -> tuple[str, ...]:
        """The class names, in label order."""
        return self.private.classes


def study_splits(
    cfg: StudyConfig,
    data: str | os.PathLike[str] | None = None,
    work_dir: str | os.PathLike[str] = DATA_DIR,
) -> Splits:
    """``cfg``'s splits of Fashion-MNIST from ``data`` (``fashion_mnist``: IDX or image folder,
    else the Debian package fetched into ``work_dir``); a DataError when the test split is
    shorter than the selection and scoring records together."""
    test = fashion_mnist("test", data, work_dir)
    end = cfg.select_size + cfg.test_size
    if end > len(test):
        raise DataError(
            f"select_size {cfg.select_size} + test_size {cfg.test_size} > the {len(test)} test "
            "records"
        )
    selection = test.first(cfg.select_size)
    return Splits(
        private=fashion_mnist("train", data, work_dir).first(cfg.train_size),
        selection=selection,
        centre=selection.first(cfg.centre_size),
        test=test.subset(
            np.arange(cfg.select_size, end),
            f"records {cfg.select_size} to {end - 1} in file order (a public rule)",
        ),
    )
