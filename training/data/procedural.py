"""Procedural images for (Syn)-ViP pretraining: our own stand-in for Shaders21k.

Every image is a small random program: one or two scalar *fields* drawn from six families
(spectral noise, dead leaves, cellular/Voronoi, waves and spirals, kaleidoscopic tilings,
plasma-like warped sinusoids), optionally domain-warped and blended, then painted with a
random cosine colour palette. Fields are functions of continuous coordinates, so any
resolution works; an image depends only on ``(seed, index)``, so a dataset is infinite,
needs no storage and is identical across processes, resumes and machines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from vip_hub.errors import ConfigError

__all__ = [
    "FAMILIES",
    "ProceduralPictures",
    "SyntheticImages",
    "check_families",
    "contact_sheet",
    "render",
]

Field = np.ndarray  # (H, W) float32 in [0, 1]
Grid = tuple[np.ndarray, np.ndarray]  # x, y in [0, 1), shape (H, W)


def _normalise(f: np.ndarray) -> Field:
    lo, hi = np.percentile(f, 1), np.percentile(f, 99)
    return np.clip((f - lo) / max(hi - lo, 1e-6), 0.0, 1.0).astype(np.float32)


def spectral_noise(rng: np.random.Generator, grid: Grid) -> Field:
    """Fractal noise with a 1/f^alpha spectrum (clouds, terrain, marble)."""
    h, w = grid[0].shape
    fy = np.fft.fftfreq(h)[:, None] * h
    fx = np.fft.rfftfreq(w)[None, :] * w
    f = np.sqrt(fx**2 + fy**2)
    f[0, 0] = 1.0
    alpha = rng.uniform(1.2, 3.0)
    spectrum = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f**alpha
    spectrum[0, 0] = 0
    field = np.fft.irfft2(spectrum, s=(h, w))
    if rng.random() < 0.3:  # ridged variant
        field = -np.abs(field)
    return _normalise(field)


def dead_leaves(rng: np.random.Generator, grid: Grid) -> Field:
    """Occluding discs and boxes with power-law sizes, painted back to front."""
    x, y = grid
    out = np.full(x.shape, rng.random(), dtype=np.float32)
    for _ in range(int(rng.integers(20, 60))):
        r = 0.03 / rng.uniform(0.05, 1.0) ** 0.7
        cx, cy = rng.random(2)
        if rng.random() < 0.6:
            mask = (x - cx) ** 2 + (y - cy) ** 2 < r * r
        else:
            a = rng.uniform(0, np.pi)
            u = (x - cx) * np.cos(a) + (y - cy) * np.sin(a)
            v = -(x - cx) * np.sin(a) + (y - cy) * np.cos(a)
            mask = (np.abs(u) < r) & (np.abs(v) < r * rng.uniform(0.2, 1.0))
        out[mask] = rng.random()
    return out


def cellular(rng: np.random.Generator, grid: Grid) -> Field:
    """Voronoi cells: nearest-point distance, edge distance (F2 - F1) or flat cell colours."""
    x, y = grid
    pts = rng.random((int(rng.integers(6, 40)), 2))
    # Tile the points so cells wrap around the edges smoothly.
    offsets = np.array([(i, j) for i in (-1, 0, 1) for j in (-1, 0, 1)], dtype=np.float64)
    pts = (pts[None] + offsets[:, None]).reshape(-1, 2)
    d = np.sqrt((x[..., None] - pts[:, 0]) ** 2 + (y[..., None] - pts[:, 1]) ** 2)
    mode = rng.integers(3)
    if mode == 0:
        return _normalise(d.min(-1))
    if mode == 1:
        two = np.partition(d, 1, axis=-1)[..., :2]
        return _normalise(two[..., 1] - two[..., 0])
    colours = rng.random(len(pts) // 9)
    return colours[d.argmin(-1) % len(colours)].astype(np.float32)


def waves(rng: np.random.Generator, grid: Grid) -> Field:
    """Sums of oriented sinusoids, optionally with a logarithmic spiral or rings."""
    x, y = grid
    f = np.zeros_like(x)
    for _ in range(int(rng.integers(1, 5))):
        a, k, p = rng.uniform(0, np.pi), rng.uniform(2, 25), rng.uniform(0, 2 * np.pi)
        f += np.sin(2 * np.pi * k * (x * np.cos(a) + y * np.sin(a)) + p)
    if rng.random() < 0.5:
        cx, cy = rng.uniform(0.2, 0.8, 2)
        r = np.sqrt((x - cx) ** 2 + (y - cy) ** 2) + 1e-3
        t = np.arctan2(y - cy, x - cx)
        arms, tight = int(rng.integers(0, 7)), rng.uniform(5, 40)
        f += 2 * np.sin(arms * t + tight * (np.log(r) if rng.random() < 0.5 else r))
    return _normalise(f)


def kaleidoscope(rng: np.random.Generator, grid: Grid) -> Field:
    """An n-fold mirror-symmetric tiling of another family's pattern."""
    x, y = grid
    n = int(rng.integers(3, 9))
    cx, cy = 0.5 + rng.uniform(-0.1, 0.1, 2)
    r = np.sqrt((x - cx) ** 2 + (y - cy) ** 2)
    t = np.abs(np.mod(np.arctan2(y - cy, x - cx), 2 * np.pi / n) - np.pi / n)
    scale = rng.uniform(1.0, 3.0)
    u, v = np.mod(scale * r * np.cos(t), 1.0), np.mod(scale * r * np.sin(t), 1.0)
    base = FAMILIES[rng.choice(["waves", "cellular", "plasma"])]
    return base(rng, (u, v))


def plasma(rng: np.random.Generator, grid: Grid) -> Field:
    """Iterated domain warping of sinusoids (the 'plasma' look of many shaders)."""
    x, y = grid
    u, v = x.copy(), y.copy()
    for _ in range(int(rng.integers(2, 5))):
        k = rng.uniform(2, 9, 4)
        p = rng.uniform(0, 2 * np.pi, 4)
        u, v = (
            u + 0.15 * np.sin(2 * np.pi * k[0] * v + p[0]) * np.cos(k[1] * u + p[1]),
            v + 0.15 * np.sin(2 * np.pi * k[2] * u + p[2]) * np.cos(k[3] * v + p[3]),
        )
    return _normalise(
        np.sin(2 * np.pi * rng.uniform(1, 6) * u) + np.cos(2 * np.pi * rng.uniform(1, 6) * v)
    )


FAMILIES: dict[str, Callable[[np.random.Generator, Grid], Field]] = {
    "spectral": spectral_noise,
    "dead_leaves": dead_leaves,
    "cellular": cellular,
    "waves": waves,
    "kaleidoscope": kaleidoscope,
    "plasma": plasma,
}


def _palette(rng: np.random.Generator, t: Field) -> np.ndarray:
    """A random cosine palette a + b cos(2 pi (c t + d)), applied to a field: (H, W, 3)."""
    a, b = rng.uniform(0.2, 0.8, 3), rng.uniform(0.2, 0.6, 3)
    c, d = rng.uniform(0.3, 2.0, 3), rng.random(3)
    return a + b * np.cos(2 * np.pi * (c * t[..., None] + d))


def check_families(families: Sequence[str]) -> tuple[str, ...]:
    """``families`` as a tuple if each is one of ``FAMILIES`` (and there is one), else a
    ConfigError naming the unknown ones."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        raise ConfigError(f"unknown procedural families {unknown}: choose among {list(FAMILIES)}")
    return tuple(families)


def render(
    seed: int, index: int, size: int, families: tuple[str, ...] = tuple(FAMILIES)
) -> np.ndarray:
    """Image ``index`` of stream ``seed`` as an (size, size, 3) uint8 array, its programs drawn
    from ``families`` (the masks and warps keep their own)."""
    check_families(families)
    rng = np.random.default_rng([seed, index])
    ys, xs = np.meshgrid(np.arange(size) / size, np.arange(size) / size, indexing="ij")
    grid: Grid = (xs, ys)
    if rng.random() < 0.3:  # domain warp by a smooth field
        warp = spectral_noise(rng, grid) - 0.5
        grid = (xs + 0.2 * warp, ys + 0.2 * np.roll(warp, size // 3, axis=0))
    names = list(families)
    field = FAMILIES[names[rng.integers(len(names))]](rng, grid)
    rgb = _palette(rng, field)
    if rng.random() < 0.5:  # blend a second program through a third field's mask
        other = _palette(rng, FAMILIES[names[rng.integers(len(names))]](rng, grid))
        mask = FAMILIES[rng.choice(["dead_leaves", "cellular", "waves"])](rng, grid)[..., None]
        soft = rng.uniform(0.02, 0.3)
        alpha = 1 / (1 + np.exp(-(mask - 0.5) / soft))
        rgb = alpha * rgb + (1 - alpha) * other
    if rng.random() < 0.5:
        rgb = rgb[:, ::-1]
    return (np.clip(rgb, 0, 1) * 255).astype(np.uint8)


class SyntheticImages(torch.utils.data.Dataset):
    """An (effectively infinite) dataset of procedural images, as normalised tensors."""

    def __init__(
        self,
        size: int,
        seed: int = 0,
        length: int = 2**31 - 1,
        mean: tuple[float, ...] = (0.485, 0.456, 0.406),
        std: tuple[float, ...] = (0.229, 0.224, 0.225),
        families: tuple[str, ...] = tuple(FAMILIES),
    ):
        self.size, self.seed, self.length, self.families = size, seed, length, tuple(families)
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        img = torch.from_numpy(render(self.seed, int(index), self.size, self.families))
        img = img.permute(2, 0, 1)
        return (img.float() / 255 - self.mean) / self.std


class ProceduralPictures:
    """The same stream as PIL pictures (``load(index)``), for augmentation pipelines."""

    def __init__(self, size: int, seed: int = 0, families: tuple[str, ...] = tuple(FAMILIES)):
        self.size, self.seed, self.families = size, seed, tuple(families)

    def __len__(self) -> int:
        return 2**31 - 1

    def load(self, index: int) -> Image.Image:
        return Image.fromarray(render(self.seed, int(index), self.size, self.families))


def contact_sheet(seed: int = 0, count: int = 64, size: int = 96, columns: int = 8) -> Image.Image:
    """A grid of ``count`` samples, for a person to look at."""
    rows = -(-count // columns)
    sheet = Image.new("RGB", (columns * (size + 4) + 4, rows * (size + 4) + 4), "white")
    for i in range(count):
        r, c = divmod(i, columns)
        sheet.paste(
            Image.fromarray(render(seed, i, size)), (4 + c * (size + 4), 4 + r * (size + 4))
        )
    return sheet
