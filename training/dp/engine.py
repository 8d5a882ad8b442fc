"""The DP engine: one logical DP step for any recipe (see ``docs/architecture.md``).

A recipe brings a model, a loss and a clipper (``PerExampleClipper`` for per-example losses,
the per-pair clipper for Logit-DP); everything private about a step lives here, once:

1. **Poisson sampling** at rate q = B/n: one sample per step over the whole dataset and the
   audit's canaries in the data, drawn alike by every rank from (seed, step) (``sampler``), so
   it does not depend on the number of ranks; each rank keeps its share of the examples (rank 0
   the canaries too); each step's plan is computed once and cut into physical micro-batches, an
   empty sample included (it is still a step);
2. the clipper **adds the clipped sums** of each micro-batch into its fp64 sum (``take_sum``),
   under autocast too (``FP64_CAPPED``); a step whose sample holds more than
   ``sample_bound(n, q)`` examples (probability below 2^-64), beyond what the sensitivity's
   rounding allowance covers, stops the run before its update is applied;
3. the canaries of the step's sample add their clipped gradients to their own block
   (``DiracCanaries``), clipped to the sensitivity the clipper's own bound gives;
4. **one all-reduce** of one flat fp64 buffer, then Gaussian **noise N(0, (sigma *
   sensitivity)^2) added once** to the sum in fp64 (every rank draws the same keyed noise, so the
   ranks stay alike);
5. division by the **expected** batch size B (never the sampled count) and the one rounding to
   the parameters' dtype, then the optimiser and scheduler step, and (``ema_decay`` d > 0) the
   exponential moving average of the iterates, ``a <- d a + (1 - d) w`` from the initial weights
   (De et al. 2022), which ``train`` leaves in the model at its end: all post-processing, no
   privacy cost;
6. the accountant's history advances one step; the ``Budget`` fixed before training stops the
   run before the target epsilon would be exceeded.

Its state (history, canary scores, the average) goes into checkpoints, so a resumed run ends with
the same ledger and weights as an uninterrupted one; ``stage()`` turns the finished run into its
ledger stage, audit included (and the average's decay among its hyper-parameters).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from vip_hub.errors import AccountingError, CheckpointError, ConfigError, DataError
from vip_hub.models.encoders import EncoderSpec
from vip_hub.privacy.accounting import (
    NOISE_SAMPLER,
    ZIGGURAT_SAMPLER,
    Accountant,
    calibrate,
    check_delta,
    composed_epsilon,
    max_steps_within,
    resolve_delta,
)
from vip_hub.privacy.ledger import Dataset, DPStage, NonPrivateStage, PrivacyLedger
from vip_hub.privacy.sensitivity import FP32_BLOCKED, FP64_CAPPED, ROUNDING_SUM, sample_bound
from vip_hub.repo_format import ENCODER

from ..skeleton.config import DPRunConfig
from ..skeleton.distributed import Dist
from ..skeleton.run import Run
from .canaries import DiracCanaries
from .clipping import ClipResult
from .sampling import (
    NOISE,
    NOISE_CHUNK,
    micro_batches,
    poisson_sample,
    rank_share,
    standard_normal,
)

__all__ = ["EMPTY", "Budget", "Clipper", "DPEngine", "StepBatch", "StepStats", "add_gaussian_noise"]

EMPTY = -1
"""The index a sampler yields for a step whose Poisson sample is empty on this rank."""


class Clipper(Protocol):
    """What the engine needs of a clipper: the parameters it trains, its clip bound, one
    micro-batch's clipped sum added into its fp64 sum, and that sum taken once per step."""

    params: list[nn.Parameter]
    max_norm: float

    @property
    def accumulate(self) -> Callable[..., ClipResult]:
        """Its method on a micro-batch's tensors, as many as it takes (PairClipper: two views)."""
        ...

    def take_sum(self, *tail: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Budget:
    """The run's privacy parameters, fixed before training: q, sigma, delta, and the number of
    steps that stays within the target epsilon (at most the steps asked for)."""

    dataset_size: int
    expected_batch_size: float
    noise_multiplier: float
    delta: float
    accountant: Accountant
    steps: int
    requested_steps: int
    target_epsilon: float | None

    @property
    def sample_rate(self) -> float:
        return self.expected_batch_size / self.dataset_size

    @classmethod
    def plan(
        cls,
        *,
        dataset_size: int,
        batch_size: int,
        steps: int,
        epsilon: float | None,
        sigma: float | None,
        delta: float | None,
        accountant: Accountant | str,
        allow_weak_delta: bool = False,
    ) -> Budget:
        """Calibrate sigma from ``epsilon`` (unless given) and find the last step within it; a
        ``delta`` above 1/n is refused unless ``allow_weak_delta``."""
        n = dataset_size
        if not 0 < batch_size <= n:
            raise ConfigError(f"--batch-size must be in [1, n={n}], got {batch_size}")
        if sigma is None and epsilon is None:
            raise ConfigError("give --epsilon (sigma is calibrated) or --sigma")
        kind = Accountant(accountant)
        q = batch_size / n
        delta = resolve_delta(delta, n)
        check_delta(delta, n, allow_weak_delta)
        if sigma is None:
            assert epsilon is not None  # checked above: one of them is given
            sigma = calibrate(epsilon, delta, q, steps, kind)
        within = (
            steps if epsilon is None else max_steps_within(epsilon, sigma, q, delta, steps, kind)
        )
        if within == 0:
            raise AccountingError(
                f"a single step at sigma {sigma:g}, q {q:.4g} already exceeds epsilon {epsilon}"
            )
        return cls(n, float(batch_size), float(sigma), float(delta), kind, within, steps, epsilon)

    @classmethod
    def for_config(cls, cfg: DPRunConfig, dataset_size: int) -> Budget:
        """The budget a DP recipe's configuration asks for, on a dataset of ``dataset_size``
        examples (checked against ``--dataset-size`` when given)."""
        if cfg.dataset_size is not None and cfg.dataset_size != dataset_size:
            raise DataError(
                f"--dataset-size {cfg.dataset_size} but {cfg.data} holds {dataset_size} examples"
            )
        planned = {
            "batch_size",
            "steps",
            "epsilon",
            "sigma",
            "delta",
            "accountant",
            "allow_weak_delta",
        }
        return cls.plan(dataset_size=dataset_size, **cfg.model_dump(include=planned))

    def stop_message(self) -> str | None:
        """Why the run stops early, when it does."""
        if self.steps == self.requested_steps:
            return None
        return (
            f"budget: stopping after step {self.steps} of {self.requested_steps}; step "
            f"{self.steps + 1} would exceed epsilon {self.target_epsilon} "
            f"({self.accountant.value}, delta {self.delta:.3g})"
        )


@dataclass
class StepBatch:
    """One physical micro-batch from the loader: its logical step and its tensors (none when
    the step's sample is empty on this rank)."""

    step: int
    tensors: tuple[torch.Tensor, ...]


class _StepItems(torch.utils.data.Dataset):
    """The items the engine's sampler names: ``(step, index)`` -> ``(step, *load(index, step))``."""

    def __init__(self, load: Callable[[int, int], tuple[torch.Tensor, ...]]):
        self.load = load

    def __getitem__(self, item: tuple[int, int]) -> tuple[Any, ...]:
        step, index = item
        return (step, None) if index == EMPTY else (step, *self.load(index, step))


def _collate(items: list[tuple[Any, ...]]) -> StepBatch:
    rows = [item[1:] for item in items if item[1] is not None]
    return StepBatch(
        items[0][0],
        tuple(torch.stack(column) for column in zip(*rows, strict=True)) if rows else (),
    )


@dataclass(frozen=True)
class StepStats:
    """What one logical step did, summed over ranks."""

    sampled: int
    loss: float


_CPU_NOISE_DRAW = 1 << 18
"""Coordinates per draw on the CPU (its float64 draw stays in cache while it is added); on a
device a whole chunk at once."""


def add_gaussian_noise(flat: torch.Tensor, std: float, seed: int, step: int) -> None:
    """``flat += N(0, std^2)`` per coordinate: chunk k of ``NOISE_CHUNK`` coordinates from its own
    stream ``(seed, NOISE, step, k)`` (``standard_normal``: Philox4x64-10 keyed by the whole secret,
    Box-Muller, support 8.57 sigma), drawn in float64 on ``flat``'s device, added in float64 and
    rounded once to ``flat``'s dtype; the chunks are drawn in parallel on the CPU's threads, and
    the noise does not depend on their number."""
    cpu = flat.device.type == "cpu"
    size = _CPU_NOISE_DRAW if cpu else NOISE_CHUNK
    chunks = flat.split(NOISE_CHUNK)
    in_numpy = cpu and flat.dtype in (torch.float32, torch.float64)

    def chunk(k: int) -> None:
        for start in range(0, len(chunks[k]), size):
            piece = chunks[k][start : start + size]
            z = standard_normal(seed, NOISE, step, k, start, len(piece), flat.device)
            z *= std
            if in_numpy:  # numpy's buffered cast: 9x faster than torch's mixed-dtype add_
                out = piece.numpy()
                np.add(out, z.numpy(), out=out, casting="unsafe")
            else:
                piece.add_(z)

    threads = torch.get_num_threads()
    workers = min(threads, len(chunks)) if cpu else 1
    if workers > 1:
        torch.set_num_threads(1)  # each worker's ops on its own thread, not a team of its own
        try:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(chunk, range(len(chunks))))
        finally:
            torch.set_num_threads(threads)
    else:
        for k in range(len(chunks)):
            chunk(k)


class DPEngine:
    """Owns a run's DP logical steps (see the module docstring)."""

    def __init__(
        self,
        clipper: Clipper,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        budget: Budget,
        *,
        sensitivity: float,
        clipping_norm: float,
        seed: int,
        dist: Dist,
        micro_batch_size: int | None,
        audit_canaries: int = 0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        ema_decay: float = 0.0,
    ):
        """``sensitivity``: the stated sensitivity (the noise is sigma times it) of the mechanism
        with clip bound ``clipping_norm`` (as the ledger records it; linear in it);
        ``ema_decay``: the iterates' moving average's decay (0: none, the last iterate)."""
        if micro_batch_size is not None and micro_batch_size <= 0:
            raise ConfigError(f"micro-batch size must be positive, got {micro_batch_size}")
        if not 0 <= ema_decay < 1:
            raise ConfigError(f"--ema-decay must be in [0, 1), got {ema_decay}")
        self.clipper, self.optimizer, self.scheduler, self.budget = (
            clipper,
            optimizer,
            scheduler,
            budget,
        )
        self.sensitivity, self.seed, self.dist, self.micro_batch_size = (
            float(sensitivity),
            seed,
            dist,
            micro_batch_size,
        )
        self.clipping_norm = float(clipping_norm)
        self.params = list(clipper.params)
        self.autocast = autocast
        self.max_sample = sample_bound(budget.dataset_size, budget.sample_rate)
        bound = self.sensitivity * clipper.max_norm / self.clipping_norm
        self.canaries = (
            DiracCanaries(
                audit_canaries, budget.sample_rate, seed, self.sensitivity, bound, dist.main
            )
            if audit_canaries
            else None
        )
        self.steps_done = 0
        self.ema_decay = float(ema_decay)
        self.average = [p.detach().clone() for p in self.params] if ema_decay else None

    @classmethod
    def for_run(
        cls,
        clipper: Clipper,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        budget: Budget,
        run: Run,
        cfg: DPRunConfig,
        *,
        sensitivity: float,
        clipping_norm: float,
        micro_batch_size: int | None = None,
    ) -> DPEngine:
        """The engine of a recipe's run: the run's seed, ranks and autocast, the configuration's
        micro-batch size (unless given: None for clippers that need the whole sample) and
        canaries."""
        return cls(
            clipper,
            optimizer,
            scheduler,
            budget,
            sensitivity=sensitivity,
            clipping_norm=clipping_norm,
            seed=run.seed,
            dist=run.dist,
            micro_batch_size=cfg.micro_batch_size if micro_batch_size is None else micro_batch_size,
            audit_canaries=cfg.audit_canaries,
            autocast=run.autocast,
            ema_decay=cfg.ema_decay,
        )

    def checkpointed(self, model: nn.Module) -> dict[str, Any]:
        """What a checkpoint of this run holds: the model, the optimiser, the scheduler, the
        engine."""
        objects: dict[str, Any] = {"model": model, "optimizer": self.optimizer, "engine": self}
        if self.scheduler is not None:
            objects["scheduler"] = self.scheduler
        return objects

    def train(
        self,
        run: Run,
        model: nn.Module,
        load: Callable[[int, int], tuple[torch.Tensor, ...]],
        *,
        desc: str,
        evaluate: Callable[[], dict[str, Any]],
        prepare: Callable[
            [Iterator[tuple[torch.Tensor, ...]]], Iterable[Sequence[torch.Tensor]]
        ] = lambda m: m,
    ) -> list[dict[str, Any]]:
        """Resume ``run`` and train to the budget's last step: examples from ``load(index, step)``,
        each step's micro-batches through ``prepare``, ``evaluate()`` (public data only) and ε at
        the evaluation cadence (with ``ema_decay``, ``evaluate()`` of the average too, its keys
        ending ``_average``), and the average in the model at the end. Returns the run's log
        records."""
        objects = self.checkpointed(model)
        start = run.resume(objects)

        def steps() -> Iterator[tuple[int, Callable[[], tuple[dict[str, Any], int]]]]:
            for step, micro in self.batches(load, start, run.cfg.workers):

                def do(
                    step: int = step, micro: Iterator[tuple[torch.Tensor, ...]] = micro
                ) -> tuple[dict[str, Any], int]:
                    stats = self.step(step, prepare(micro))
                    record = {
                        "train_loss": stats.loss,
                        "sampled": stats.sampled,
                        "lr": self.optimizer.param_groups[0]["lr"],
                    }
                    return record, stats.sampled

                yield step, do

        def evaluated() -> dict[str, Any]:
            record = evaluate()
            if self.average is not None:
                with self.averaged():
                    record.update({f"{k}_average": v for k, v in evaluate().items()})
            return {**record, "epsilon": self.epsilon()}

        records = run.loop(
            start,
            self.budget.steps,
            steps(),
            desc=desc,
            objects=objects,
            evaluate=evaluated,
            stop_message=self.budget.stop_message(),
        )
        if self.average is not None:
            self.use_average()
        return records

    # ------------------------------------------------------------ the average
    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """The trained parameters hold the iterates' average inside the block (an evaluation of
        it), the iterate again after."""
        self._swap_average()
        try:
            yield
        finally:
            self._swap_average()

    @torch.no_grad()
    def use_average(self) -> None:
        """Leave the iterates' average in the trained parameters: the weights the run releases."""
        assert self.average is not None
        for p, a in zip(self.params, self.average, strict=True):
            p.copy_(a)

    @torch.no_grad()
    def _swap_average(self) -> None:
        """Exchange the trained parameters' values with the average's."""
        assert self.average is not None
        for p, a in zip(self.params, self.average, strict=True):
            iterate = p.detach().clone()
            p.copy_(a)
            a.copy_(iterate)

    # ---------------------------------------------------------------- sampling
    def plan(self, step: int) -> np.ndarray:
        """This rank's Poisson sample at ``step``: dataset indices, sorted."""
        return self._draw(step)[0]

    def _draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's part of the step's one Poisson sample over the dataset and the canaries in
        the data: its share of the dataset indices, and (rank 0) the canary ids, each sorted. A pure
        function of (seed, step, rank), the same sample whatever the number of ranks."""
        members = (
            self.canaries.members if self.canaries is not None else np.zeros(0, dtype=np.int64)
        )
        n = self.budget.dataset_size
        drawn = poisson_sample(n + len(members), self.budget.sample_rate, self.seed, step)
        cut = int(np.searchsorted(drawn, n))
        canaries = members[drawn[cut:] - n] if self.dist.main else members[:0]
        return rank_share(drawn[:cut], self.dist.rank, self.dist.world), canaries

    def sampler(self, start: int) -> Iterator[list[tuple[int, int]]]:
        """A DataLoader batch sampler: ``(step, index)`` items per micro-batch from ``start`` to the
        budget's last step, each step planned once (``(step, EMPTY)`` for an empty sample)."""
        for step in range(start, self.budget.steps):
            local = self.plan(step)
            for part in micro_batches(local, self.micro_batch_size or max(1, len(local))):
                yield [(step, int(i)) for i in part] or [(step, EMPTY)]

    def batches(
        self, load: Callable[[int, int], tuple[torch.Tensor, ...]], start: int, workers: int
    ) -> Iterator[tuple[int, Iterator[tuple[torch.Tensor, ...]]]]:
        """Each step from ``start`` with an iterator over its non-empty micro-batches, loaded by
        ``load(index, step)`` in ``workers`` processes (pass them to ``step``)."""
        loader = torch.utils.data.DataLoader(
            _StepItems(load),
            batch_sampler=self.sampler(start),
            collate_fn=_collate,
            num_workers=workers,
            pin_memory=self.params[0].device.type == "cuda",
        )
        for step, group in itertools.groupby(loader, key=lambda b: b.step):
            yield step, (b.tensors for b in group if b.tensors)

    # ------------------------------------------------------------------ a step
    def step(self, step: int, micro_batches: Iterable[Sequence[torch.Tensor]]) -> StepStats:
        """Run one logical step on this rank's micro-batches (from ``batches``)."""
        if step != self.steps_done:
            raise RuntimeError(f"step {step} out of order: {self.steps_done} steps done")
        sampled, loss = 0, torch.zeros((), dtype=torch.float64)
        device = self.params[0].device
        for inputs in micro_batches:
            with self.autocast():
                result = self.clipper.accumulate(*(t.to(device, non_blocking=True) for t in inputs))
            sampled += len(result.losses)
            loss += result.losses.double().sum().cpu()
        totals = self._privatise(
            step, torch.tensor([float(sampled), float(loss)], dtype=torch.float64)
        )
        count = int(round(totals[0].item()))
        if count > self.max_sample:
            raise AccountingError(
                f"step {step} sampled {count} examples, more than the {self.max_sample} the "
                "sensitivity's rounding allowance covers; the run stops before this update"
            )
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.average is not None:
            get_ema_multi_avg_fn(self.ema_decay)(
                self.average, [p.detach() for p in self.params], self.steps_done
            )
        self.steps_done += 1
        return StepStats(count, totals[1].item() / max(count, 1))

    def _privatise(self, step: int, stats: torch.Tensor) -> torch.Tensor:
        """One all-reduce, noise once, division by B, one rounding; returns the summed ``stats``.

        One flat fp64 buffer holds the clipped sum, the canary block and ``stats`` (copied in
        once); noise goes on all but ``stats``, in fp64; the gradients handed to the optimiser
        are that sum divided by B, each rounded once to its parameter's dtype."""
        device = self.params[0].device
        tail = [stats.to(device=device, dtype=torch.float64)]
        if self.canaries is not None:  # the sampler's draw, again
            tail.insert(0, self.canaries.clipped_sum(self._draw(step)[1], device))
        buffer = self.clipper.take_sum(*tail)
        del tail
        flat = buffer[: -len(stats)]
        self.dist.all_reduce_sum(buffer)
        # After the all-reduce, every rank adds the same keyed noise to the same sum: the noisy
        # buffer is alike everywhere and no rounding of the sum depends on the noise.
        add_gaussian_noise(flat, self.budget.noise_multiplier * self.sensitivity, self.seed, step)
        size = sum(p.numel() for p in self.params)
        if self.canaries is not None:
            self.canaries.observe(
                flat[size : size + self.canaries.count], self.budget.noise_multiplier
            )
        flat[:size].div_(self.budget.expected_batch_size)
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        return buffer[-len(stats) :].cpu()

    # ---------------------------------------------------------------- accounting
    @property
    def history(self) -> list[tuple[float, float, int]]:
        """The accountant's view of the steps done: [(sigma, q, steps)]."""
        return (
            [(self.budget.noise_multiplier, self.budget.sample_rate, self.steps_done)]
            if self.steps_done
            else []
        )

    def epsilon(self) -> float:
        """Epsilon spent so far under the run's accountant, at its delta."""
        return composed_epsilon(self.history, self.budget.delta, self.budget.accountant)

    def stage(
        self, *, audit_delta: float, released: dict[str, nn.Module], **fields: Any
    ) -> DPStage:
        """The finished run's ledger stage (``fields``: name, dataset, mechanism, descriptions...),
        with its audit when it ran canaries. ``released``: each repo weights file (or
        ``NOT_RELEASED``) and the module whose parameters it holds under their names there, in
        order; each noised parameter is recorded under the first that holds it, the canaries
        beside them (``noised_tensors``: what the noised dimension counts)."""
        from vip_hub.privacy.ledger import NOISED_CANARIES, noised_key

        if self.steps_done != self.budget.steps:
            raise RuntimeError(
                f"{self.steps_done} steps done, the budget planned {self.budget.steps}"
            )
        b = self.budget
        names: dict[int, str] = {}
        for file, module in released.items():
            for name, p in module.named_parameters():
                names.setdefault(id(p), noised_key(file, name))
        unnamed = [tuple(p.shape) for p in self.params if id(p) not in names]
        if unnamed:
            raise RuntimeError(f"noised parameters of shapes {unnamed} are in no released module")
        noised = {names[id(p)]: p.numel() for p in self.params}
        if self.canaries is not None:
            noised[NOISED_CANARIES] = self.canaries.count
        audit = (
            self.canaries.audit(self.history[0], audit_delta) if self.canaries is not None else None
        )
        if self.average is not None:
            averaged = {"ema_decay": self.ema_decay}
            fields["hyperparameters"] = {**fields.get("hyperparameters", {}), **averaged}
        return DPStage.from_parameters(
            sample_rate=b.sample_rate,
            noise_multiplier=b.noise_multiplier,
            steps=b.steps,
            sensitivity=self.sensitivity,
            clipping_norm=self.clipping_norm,
            noised_tensors=noised,
            delta=b.delta,
            accountant=b.accountant,
            audit=audit,
            **fields,
        )

    def export(
        self,
        run: Run,
        cfg: DPRunConfig,
        encoder: VisionTransformer,
        spec: EncoderSpec,
        init: PrivacyLedger,
        *,
        records: list[dict[str, Any]],
        mechanism: str,
        curve_label: str,
        dataset_description: str,
        summary: str,
        files: dict[str, Any] | None = None,
        earlier: Sequence[DPStage] = (),
        **stage_fields: Any,
    ) -> Path:
        """Export the released repo: the init repo's encoder stages, the ``earlier`` DP stages of
        this run on the same data (a DP linear probe whose head the model started from), then this
        run's ``stage`` (named ``mechanism``, on ``cfg``'s dataset) and the curve of its
        ``public_loss``."""

        def stages() -> list[NonPrivateStage | DPStage]:
            dataset = Dataset(
                name=cfg.dataset_name,
                size=self.budget.dataset_size,
                description=dataset_description,
            )
            stage = self.stage(
                audit_delta=cfg.audit_delta,
                mechanism=mechanism,
                dataset=dataset,
                run_id=run.run_id(),
                **stage_fields,
            )
            return [*(s for s in init.stages if s.component == ENCODER), *earlier, stage]

        curve = ("public_loss", curve_label, f"{mechanism} on {cfg.dataset_name}")
        return run.export_encoder(
            encoder, spec, stages, records=records, curve=curve, summary=summary, **(files or {})
        )

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "steps_done": self.steps_done,
            "history": self.history,
            "noise_sampler": NOISE_SAMPLER,
            ROUNDING_SUM: FP64_CAPPED,
        }
        if self.canaries is not None:
            state["canaries"] = self.canaries.state_dict()
        if self.average is not None:
            state["average"] = [a.cpu() for a in self.average]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``; a checkpoint whose steps drew another noise sampler, or formed
        their clipped sums by another rule, is refused (one stage records one sampler's support
        and one rounding rule)."""
        sampler = state.get("noise_sampler", ZIGGURAT_SAMPLER)  # unrecorded before it
        summation = state.get(ROUNDING_SUM, FP32_BLOCKED)  # unrecorded before issue 52
        for what, theirs, ours in (
            ("drew their noise from the {} sampler", sampler, NOISE_SAMPLER),
            ("formed their clipped sums by the rule {}", summation, FP64_CAPPED),
        ):
            if theirs != ours:
                raise CheckpointError(
                    f"the checkpoint was written by another vip-hub: its {state['steps_done']} "
                    f"steps {what.format(theirs)}, this one's {ours}, and a run's stage "
                    "records one: pass --restart to start over"
                )
        self.steps_done = int(state["steps_done"])
        if [tuple(h) for h in state["history"]] != self.history:
            raise CheckpointError(
                f"checkpoint accountant history {state['history']} does not match "
                f"{self.steps_done} steps at sigma {self.budget.noise_multiplier}, "
                f"q {self.budget.sample_rate} (q = B/n: were records added to or removed from "
                "the data?): resume on the same data, or pass --restart to start over"
            )
        if self.canaries is not None:
            self.canaries.load_state_dict(state["canaries"])
        if self.average is not None:
            for a, saved in zip(self.average, state["average"], strict=True):
                a.copy_(saved)
