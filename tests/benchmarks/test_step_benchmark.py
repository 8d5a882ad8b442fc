"""The DP step benchmark (``benchmarks/dp_step.py``) on a tiny MAE: its DP steps take the engine's
own Poisson samples, and a run over two batch sizes prints every variant's figures."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from support.helpers import ROOT, load_benchmark

from training.dp.clipping import PerExampleClipper

SCRIPT = ROOT / "benchmarks" / "dp_step.py"
sys.path.insert(0, str(SCRIPT.parent))  # dp_step.py imports own_process.py as a script does
dp_step = load_benchmark("dp_step")

TINY = argparse.Namespace(arch="vip-nano", img_size=32, device="cpu")


def test_a_dp_step_takes_the_engines_poisson_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = dp_step.make_bench(TINY, 16)
    assert len(bench.inputs[0]) == 16 + 24  # room for a sample above B: B + 6 sqrt(B)
    sizes: list[int] = []
    accumulate = PerExampleClipper.accumulate
    monkeypatch.setattr(
        PerExampleClipper,
        "accumulate",
        lambda self, *inputs: sizes.append(len(inputs[0])) or accumulate(self, *inputs),
    )
    step = dp_step.VARIANTS["b"].build(bench)
    for _ in range(6):
        step()
    assert len(set(sizes)) > 1 and all(0 < k <= 40 for k in sizes), sizes
    fixed = dp_step.VARIANTS["b"].build(dp_step.make_bench(TINY, 16, poisson=False))  # exact B
    sizes.clear()
    fixed()
    assert sizes == [16]


def test_a_run_over_two_batch_sizes_prints_each_variants_figures() -> None:
    tiny = [
        sys.executable,
        str(SCRIPT),
        "--arch",
        "vip-nano",
        "--img-size",
        "32",
        "--device",
        "cpu",
    ]
    cmd = [*tiny, "--batch", "4,8", "--rounds", "1", "--variants", "abd"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    for batch in (4, 8):
        section = out.split(f"batch {batch} ")[1]
        for label in ("(a) non-private AdamW", "(b) DP-AdamW", "(d) (b) + audit"):
            assert label in section and "peak +" in section, out
        assert "b/a: time" in section and "d/b: time" in section, out
        assert "noise alone (add_gaussian_noise" in section and "% of (b)" in section, out
    with pytest.raises(SystemExit, match="needs a GPU"):  # what --batch max does on the CPU
        dp_step.largest_batch(TINY, 8)
