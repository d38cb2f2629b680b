"""Procedural CLEVR-like scenes: shapes, digits and letters on a 3×3 grid, with captions and
question–answer pairs derived from the scene graph.

Everything is drawn with numpy (4× supersampled, then box-filtered for anti-aliasing) from a
built-in 5×7 bitmap font, so an image depends only on (seed, split, index) — not on the Pillow
version or the fonts installed. Scene ``i`` of a split is drawn from its own ``random.Random``
seeded by the string ``"{seed}:{split}:{i}"`` (string seeds hash with SHA-512, stable across
runs and Python versions), so the set has any size, can be indexed or streamed, and the
``train`` and ``val`` splits never share a scene by construction (they are independent draws; a
val scene can equal a train scene only by chance).

Simplification: objects sit in distinct cells of a 3×3 grid, so they never overlap and every
position has a name ("top left" … "bottom right"). Exercised by ``pytest tests/test_vision_data.py``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import numpy as np

SHAPES = ("circle", "square", "triangle")
DIGITS = "0123456789"
LETTERS = "AEHKLMRTXZ"
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 45, 45),
    "green": (50, 175, 70),
    "blue": (55, 95, 230),
    "yellow": (235, 215, 50),
    "purple": (160, 70, 200),
    "orange": (245, 145, 35),
}
SIZES = ("small", "large")
ROWS = ("top", "middle", "bottom")
COLS = ("left", "center", "right")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
QUESTION_KINDS = ("count", "color", "position", "digit")
_BACKGROUND = (38, 38, 42)
_SUPERSAMPLE = 4

# 5×7 bitmap glyphs (rows top to bottom, '#' = ink): a fixed font keeps images identical everywhere.
_FONT: dict[str, tuple[str, ...]] = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("####.", "....#", "....#", ".###.", "....#", "....#", "####."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "E": ("#####", "#....", "#....", "####.", "#....", "#....", "#####"),
    "H": ("#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "K": ("#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"),
    "L": ("#....", "#....", "#....", "#....", "#....", "#....", "#####"),
    "M": ("#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"),
    "R": ("####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "X": ("#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"),
    "Z": ("#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"),
}


@dataclasses.dataclass(frozen=True)
class SceneObject:
    """One object of a scene: a shape or a glyph (digit/letter), its colour, size and grid cell."""

    kind: str
    "circle, square, triangle, digit or letter"
    color: str
    "a key of COLORS"
    size: str
    "small or large"
    row: int
    "grid row 0..2 (top to bottom)"
    col: int
    "grid column 0..2 (left to right)"
    glyph: str = ""
    "the character drawn when kind is digit or letter"

    @property
    def name(self) -> str:
        """How captions and questions refer to the object: "circle", "digit 7", "letter K"."""
        return f"{self.kind} {self.glyph}" if self.glyph else self.kind

    @property
    def position(self) -> str:
        """Grid cell as words: "top left", "middle center", …"""
        return f"{ROWS[self.row]} {COLS[self.col]}"


@dataclasses.dataclass(frozen=True)
class QA:
    """A question about a scene, its answer, and which ability it tests (a QUESTION_KINDS entry)."""

    question: str
    answer: str
    kind: str


@dataclasses.dataclass(frozen=True)
class Scene:
    """A scene graph: its objects in reading order (by row, then column)."""

    objects: tuple[SceneObject, ...]

    def caption(self) -> str:
        """Every object with its attributes and position, and the object count."""
        n = len(self.objects)
        parts = [f"a {o.size} {o.color} {o.name} at the {o.position}" for o in self.objects]
        noun = "object" if n == 1 else "objects"
        return f"{NUMBER_WORDS[n]} {noun} : " + " and ".join(parts) + " ."

    def questions(self) -> list[QA]:
        """Question–answer pairs whose answers follow from the scene graph without ambiguity.

        count: always; color: for each object whose name is unique in the scene; position: for
        each object whose colour + name is unique; digit: for each digit (asked by position).
        """
        out = [QA("how many objects are there ?", NUMBER_WORDS[len(self.objects)], "count")]
        names = [o.name for o in self.objects]
        described = [f"{o.color} {o.name}" for o in self.objects]
        for o, name, desc in zip(self.objects, names, described, strict=True):
            if names.count(name) == 1:
                out.append(QA(f"what color is the {name} ?", o.color, "color"))
            if described.count(desc) == 1:
                out.append(QA(f"where is the {desc} ?", o.position, "position"))
            if o.kind == "digit":
                out.append(QA(f"which digit is at the {o.position} ?", o.glyph, "digit"))
        return out


def vocabulary() -> list[str]:
    """Every word a procedural caption, question or answer can contain (sorted)."""
    words = {"a", "at", "the", "and", ":", "?", ".", "object", "objects", "digit", "letter"}
    words |= {"how", "many", "are", "there", "what", "color", "is", "where", "which"}
    words |= set(SHAPES) | set(DIGITS) | set(LETTERS) | set(COLORS) | set(SIZES)
    words |= set(ROWS) | set(COLS) | set(NUMBER_WORDS)
    return sorted(words)


def sample_scene(rng: random.Random, max_objects: int = 3) -> Scene:
    """Draw 1..max_objects objects in distinct cells (a scene graph, no pixels)."""
    n = rng.randint(1, max_objects)
    cells = sorted(rng.sample(range(9), n))
    objects = []
    for cell in cells:
        kind = rng.choice(("circle", "square", "triangle", "digit", "digit", "letter"))
        glyph = (
            rng.choice(DIGITS)
            if kind == "digit"
            else rng.choice(LETTERS)
            if kind == "letter"
            else ""
        )
        objects.append(
            SceneObject(
                kind=kind,
                color=rng.choice(tuple(COLORS)),
                size=rng.choice(SIZES),
                row=cell // 3,
                col=cell % 3,
                glyph=glyph,
            )
        )
    return Scene(tuple(objects))


def _draw(canvas: np.ndarray, obj: SceneObject, rng: random.Random) -> None:
    """Paint ``obj`` into ``canvas`` (S, S, 3) float, in place; jitter comes from ``rng``."""
    s = canvas.shape[0]
    cell = s / 3
    half = cell * (0.42 if obj.size == "large" else 0.24)
    jitter = cell / 2 - half
    cy = (obj.row + 0.5) * cell + rng.uniform(-jitter, jitter) * 0.8
    cx = (obj.col + 0.5) * cell + rng.uniform(-jitter, jitter) * 0.8
    # only the object's bounding box is evaluated (h, w); the rest of the canvas is untouched
    y0, y1 = max(0, int(cy - half) - 1), min(s, int(cy + half) + 2)
    x0, x1 = max(0, int(cx - half) - 1), min(s, int(cx + half) + 2)
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32) + 0.5  # (h, w) pixel centres
    dy, dx = (yy - cy) / half, (xx - cx) / half  # (h, w) in units of the half-size
    if obj.kind == "circle":
        mask = dy**2 + dx**2 <= 1.0
    elif obj.kind == "square":
        mask = (np.abs(dy) <= 0.82) & (np.abs(dx) <= 0.82)
    elif obj.kind == "triangle":  # apex up: inside the base and both slanted edges
        mask = (dy <= 0.8) & (dy >= -1.0 + 2 * np.abs(dx))
    else:
        rows = _FONT[obj.glyph]
        gy = np.floor((dy + 1.0) / 2.0 * 7).astype(int)  # (h, w) font row, 7 rows over the box
        gx = np.floor((dx + 0.72) / 1.44 * 5).astype(int)  # (h, w) font column, 5 narrower ones
        inside = (gy >= 0) & (gy < 7) & (gx >= 0) & (gx < 5)
        bitmap = np.array([[c == "#" for c in r] for r in rows])  # (7, 5)
        mask = np.zeros_like(inside)
        mask[inside] = bitmap[gy[inside], gx[inside]]
    canvas[y0:y1, x0:x1][mask] = COLORS[obj.color]


def render(scene: Scene, image_size: int = 64, seed: str = "") -> np.ndarray:
    """The scene as a (image_size, image_size, 3) uint8 RGB array.

    ``seed`` drives the sub-cell jitter of each object (the same scene graph can be drawn at
    slightly different places); drawn at 4× and box-filtered down for smooth edges.
    """
    rng = random.Random(f"jitter:{seed}")
    big = image_size * _SUPERSAMPLE
    canvas = np.empty((big, big, 3), np.float32)
    canvas[:] = _BACKGROUND
    for obj in scene.objects:
        _draw(canvas, obj, rng)
    # box filter: (S·4, S·4, 3) -> (S, 4, S, 4, 3) -> mean over the 4×4 blocks, as sums of
    # strided slices (every value is an integer colour, so the sums are exact in any order;
    # 17× faster than ndarray.mean over axes (1, 3), which dominated drawing a scene)
    blocks = canvas.reshape(image_size, _SUPERSAMPLE, image_size, _SUPERSAMPLE, 3)
    rows = sum(blocks[:, i] for i in range(_SUPERSAMPLE))  # (S, S, 4, 3)
    small = sum(rows[:, :, j] for j in range(_SUPERSAMPLE)) / _SUPERSAMPLE**2  # (S, S, 3)
    return np.clip(np.rint(small), 0, 255).astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class SceneSample:
    """One rendered scene with its text."""

    image: np.ndarray
    "(S, S, 3) uint8 RGB"
    scene: Scene
    caption: str
    qa: tuple[QA, ...]


@dataclasses.dataclass(frozen=True)
class ProceduralScenes:
    """An unbounded, deterministic image–text set of procedural scenes.

    ``ProceduralScenes(seed=0)[i]`` is always the same sample; iterate for a stream starting at
    ``start``. Use ``split="val"`` (any other string works too) for held-out scenes.
    """

    seed: int = 0
    "base seed"
    split: str = "train"
    "independent streams per split name"
    image_size: int = 64
    "side of the square images in pixels"
    max_objects: int = 3
    "objects per scene are drawn uniformly from 1..max_objects (at most 9)"

    def __post_init__(self) -> None:
        if not 1 <= self.max_objects <= 9:
            raise ValueError(f"max_objects must be in 1..9, got {self.max_objects}")
        if self.image_size < 12:
            raise ValueError(f"image_size must be at least 12 pixels, got {self.image_size}")

    def __getitem__(self, index: int) -> SceneSample:
        key = f"{self.seed}:{self.split}:{index}"
        scene = sample_scene(random.Random(key), self.max_objects)
        image = render(scene, self.image_size, key)
        return SceneSample(image, scene, scene.caption(), tuple(scene.questions()))

    def stream(self, start: int = 0) -> Iterator[SceneSample]:
        """Samples start, start+1, … forever."""
        i = start
        while True:
            yield self[i]
            i += 1
