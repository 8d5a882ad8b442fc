"""The run skeleton every recipe shares: the run folder ``<out>.run/`` (settings, secret seed,
run id, checkpoint, JSONL log; owner-only: the folder 0700 and every file 0600 from its creation,
since the seed and the checkpoints give away the noise, the sampling and the audit's canary
bits), resume, checkpoint and evaluation cadence, autocast, the progress bar, AdamW from the
recipe's fields, and the export at the end (rank 0, then every rank waits)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from timm.models.vision_transformer import VisionTransformer
from tqdm.auto import tqdm

from vip_hub.errors import CheckpointError, ConfigError
from vip_hub.models.encoders import EncoderSpec
from vip_hub.paths import make_private_dir, remove_temporaries, write_private
from vip_hub.privacy.ledger import RUN_ID_PATTERN, DPStage, NonPrivateStage, new_run_id
from vip_hub.repo.files import check_replaceable, export_encoder
from vip_hub.repo.signing import SIGNING_KEY_ENV, load_signing_key
from vip_hub.repo_format import CURVES_FILE

from ..dp.sampling import SECRET_BITS, new_secret
from .checkpoint import check_settings, load_checkpoint, save_checkpoint
from .config import RunConfig, run_folder
from .distributed import Dist
from .optim import make_adamw, warmup_cosine
from .runlog import RunLog, plot_curves

__all__ = ["Run", "Stateful"]


class Stateful(Protocol):
    """What a run checkpoints: a model, an optimiser, a scheduler, the DP engine."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


SETTINGS_FILE, RUN_ID_FILE, LOCK_FILE = "settings.json", "run_id", "lock"
"""The run folder's settings but the seed, its run id and the file that the process running it
holds locked (``flock``) until it exits."""

_HELD: dict[Path, int] = {}
"""This process's locked run folders: the descriptor of each one's ``LOCK_FILE``."""


def _hold(folder: Path) -> None:
    """Lock ``folder``'s ``LOCK_FILE`` for this process until it exits (a crash frees it), or
    refuse while another process holds it."""
    folder = folder.absolute()
    held = _HELD.get(folder)
    if held is not None:
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(held), os.stat(folder / LOCK_FILE)):
                return  # this process's earlier run of the folder: still its own
        os.close(_HELD.pop(folder))  # the folder was replaced (--restart) since
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"another process is running the run folder {folder}: two would interleave its "
            "checkpoints and replace its seed under each other; wait for it to end"
        ) from None
    _HELD[folder] = fd


class Run:
    """One training run of ``cfg`` on the process group ``dist``."""

    def __init__(self, cfg: RunConfig, dist: Dist):
        self.cfg, self.dist = cfg, dist
        out = Path(cfg.out)
        self.dir = run_folder(out)
        self.checkpoint_path = self.dir / "checkpoint.pt"
        # on every rank: one refusing alone would leave the others at the barrier
        check_replaceable(out)
        if self.dir.is_symlink():  # on every rank, as check_replaceable
            raise ConfigError(
                f"{self.dir} is a symbolic link: a run folder holds the run's secret seed, "
                "written where it is; give an --out whose run folder is a plain folder"
            )
        if dist.main:
            if key := self.signing_key():
                load_signing_key(key, out)  # refused now, not once the export replaced --out
            if cfg.restart and self.dir.exists():
                _hold(self.dir)  # not under a process still running it
                # the seed first: a restart killed part way leaves no secret without its settings
                (self.dir / "seed").unlink(missing_ok=True)
                shutil.rmtree(self.dir)
            make_private_dir(self.dir)
            _hold(self.dir)
            remove_temporaries(self.dir)  # a checkpoint write a kill cut short: as large as one
            if not self.checkpoint_path.exists():
                # a start from step 0 is a new release, keyed by a new secret: under an earlier
                # release's (its checkpoint deleted after its export), its noise and samples would
                # come again, on data that may have changed, where composition counts them fresh
                (self.dir / "seed").unlink(missing_ok=True)
            if self.dir.stat().st_mode & 0o077:  # a run folder made before it was owner-only
                os.chmod(self.dir, 0o700)
        dist.barrier()
        self.seed = self._resolve_seed(cfg.seed)
        self.settings = {**cfg.run_settings(), "seed": self.seed}
        self.log: RunLog | None = None

    def _resolve_seed(self, seed: int | None) -> int:
        """The given seed, else the secret kept in the run folder (``SECRET_BITS`` bits, in hex)
        for its checkpoint, else a new one; rank 0 decides and every rank gets the same (as 32-bit
        words)."""
        if seed is not None:
            return seed
        words = SECRET_BITS // 32
        chosen = torch.zeros(words, dtype=torch.int64, device=self.dist.device)
        if self.dist.main:
            saved = self.dir / "seed"
            if not saved.exists():
                write_private(saved, f"{new_secret():0{SECRET_BITS // 4}x}".encode())
            text = saved.read_bytes().decode("utf-8", errors="replace").strip()
            if not re.fullmatch(f"[0-9a-f]{{{SECRET_BITS // 4}}}", text):
                raise CheckpointError(
                    f"{saved} holds no {SECRET_BITS}-bit secret: the run folder was written "
                    "by an earlier vip-hub, whose noise and sampling were keyed by 32 bits; it "
                    "cannot resume under the new streams: pass --restart to start over"
                )
            secret = int(text, 16)
            chosen.copy_(torch.tensor([(secret >> (32 * i)) & 0xFFFFFFFF for i in range(words)]))
        self.dist.broadcast_([chosen])
        return sum(int(w) << (32 * i) for i, w in enumerate(chosen.tolist()))

    def run_id(self) -> str:
        """This run's random id for its ledger stage (``new_run_id``), drawn once and kept in the
        run folder so a resumed run records the same one (rank 0, which exports)."""
        path = self.dir / RUN_ID_FILE
        if not path.exists():
            write_private(path, new_run_id().encode())
        run_id = path.read_bytes().decode("utf-8", errors="replace")
        if not re.fullmatch(RUN_ID_PATTERN, run_id):
            raise CheckpointError(f"{path} holds no run id: pass --restart to start over")
        return run_id

    def resume(self, objects: dict[str, Stateful]) -> int:
        """Load the checkpoint (checked against this run's settings) into ``objects``; the step to
        start from (0 without a checkpoint)."""
        if not self.checkpoint_path.exists():
            self._fresh_start()
            return 0
        state = load_checkpoint(self.checkpoint_path, self.settings, self.cfg.run_defaults())
        missing = [key for key in (*objects, "step") if key not in state]
        if missing:
            raise CheckpointError(f"checkpoint {self.checkpoint_path} has no {', '.join(missing)}")
        for key, obj in objects.items():
            obj.load_state_dict(state[key])
        return int(state["step"])

    def unseeded_settings(self) -> dict[str, Any]:
        """The run's settings but its seed (kept in its own file): ``SETTINGS_FILE``'s."""
        return {k: v for k, v in self.settings.items() if k != "seed"}

    def _fresh_start(self) -> None:
        """A start from step 0 (under a new secret, ``__init__``): the folder's settings, if a run
        started in it (its checkpoint since removed), must be this run's, as a checkpoint's (one
        folder, one run; --restart starts another); and any earlier export's run id is dropped,
        so this run's release is not counted as that one."""
        path = self.dir / SETTINGS_FILE
        if self.cfg.seed is None and path.exists():
            try:
                saved = json.loads(path.read_bytes())
            except ValueError as e:  # not UTF-8, not JSON
                saved = e
            if not isinstance(saved, dict):
                raise CheckpointError(
                    f"{path} holds no run's settings ({saved!r:.80}): pass --restart to start over"
                )
            check_settings(
                f"{path}, of the run started in this folder,",
                saved,
                self.unseeded_settings(),
                self.cfg.run_defaults(),
            )
        self.dist.barrier()  # every rank checked before rank 0 drops the run id
        if self.dist.main:
            (self.dir / RUN_ID_FILE).unlink(missing_ok=True)

    def adamw(
        self, model: torch.nn.Module, horizon: int | None = None
    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over ``model``'s trainable parameters from the configuration's AdamW fields
        (``training.skeleton.config.with_adamw``), and its warm-up + cosine schedule over
        ``horizon`` steps (default: the run's)."""
        cfg: Any = self.cfg
        optimizer = make_adamw(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        return optimizer, warmup_cosine(optimizer, cfg.warmup(), horizon or cfg.steps)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast on CUDA unless the run's ``bf16`` is off; nothing on the CPU."""
        if self.dist.device.type == "cuda" and self.cfg.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loop(
        self,
        start: int,
        total: int,
        steps: Iterator[tuple[int, Callable[[], tuple[dict[str, Any], int]]]],
        *,
        desc: str,
        objects: dict[str, Stateful],
        evaluate: Callable[[], dict[str, Any]] | None = None,
        stop_message: str | None = None,
    ) -> list[dict[str, Any]]:
        """Run ``steps`` (pairs of a step number and a function doing it, returning its log record
        and its number of examples) from ``start`` to ``total``: evaluation, the JSONL log and the
        progress bar on rank 0, checkpoints of ``objects``. Returns every log record."""
        eval_every = self.cfg.eval_every or max(1, total // 20)
        t0, images = time.perf_counter(), 0
        bar = None
        if self.dist.main:
            settings = json.dumps(self.unseeded_settings(), indent=2) + "\n"
            write_private(self.dir / SETTINGS_FILE, settings.encode())
            self.log = RunLog(self.dir / "log.jsonl", start)
            if stop_message:
                print(stop_message, file=sys.stderr)
            if start == 0 and evaluate is not None:
                self.log.write({"step": 0, **evaluate()})
            bar = tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True)
        try:
            for step, do in steps:
                record, count = do()
                images += count
                done = step + 1
                if evaluate is not None and (done % eval_every == 0 or done == total):
                    record.update(evaluate())
                if self.log is not None and bar is not None:
                    rate = images / max(time.perf_counter() - t0, 1e-9)
                    self.log.write({"step": done, **record, "images_per_s": round(rate, 2)})
                    bar.set_postfix(
                        {k: f"{v:.4g}" for k, v in record.items() if isinstance(v, float)}
                        | {"img/s": f"{rate:.1f}"},
                        refresh=False,
                    )
                    bar.update(1)
                if done % self.cfg.checkpoint_every == 0 or done == total:
                    if self.dist.main:
                        save_checkpoint(
                            self.checkpoint_path,
                            {
                                "config": self.settings,
                                "step": done,
                                **{k: o.state_dict() for k, o in objects.items()},
                            },
                        )
                    self.dist.barrier()
        finally:
            if bar is not None:
                bar.close()
            if self.log is not None:
                self.log.close()
        return self.log.records() if self.log is not None else []

    def signing_key(self) -> str | None:
        """The private key the export signs with: ``signing_key``, else ``VIP_HUB_SIGNING_KEY``,
        else None (unsigned)."""
        return self.cfg.signing_key or os.environ.get(SIGNING_KEY_ENV) or None

    def export(self, write: Callable[[str | None], Any]) -> Path:
        """Write the released repo on rank 0 with ``write(key)``, which signs it with ``key``
        (``signing_key``) before it replaces ``--out``; every rank waits for it. Returns its
        folder."""
        if self.dist.main:
            write(self.signing_key())
        self.dist.barrier()
        return Path(self.cfg.out)

    def export_encoder(
        self,
        encoder: VisionTransformer,
        spec: EncoderSpec,
        stages: Callable[[], Sequence[NonPrivateStage | DPStage]],
        *,
        records: list[dict[str, Any]],
        curve: tuple[str, str, str],
        summary: str,
        **files: Any,
    ) -> Path:
        """``export`` of the released encoder repo: the ledger of ``stages()``, the ``curve`` of
        ``records`` (``plot_curves``' key, label, title) as ``CURVES_FILE``, and ``files``."""

        def write(key: str | None) -> None:
            cfg, name = self.cfg, self.cfg.model_name or Path(self.cfg.out).name
            export_encoder(
                cfg.out,
                encoder,
                spec,
                stages(),
                model_name=name,
                repo_id=cfg.repo_id,
                summary=summary,
                overwrite=True,
                extra_files={CURVES_FILE: plot_curves(records, *curve)},
                signing_key=key,
                **files,
            )

        return self.export(write)
