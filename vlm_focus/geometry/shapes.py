"""The package's two small types: :class:`Size` (``(width, height)``, PIL's order) and
:class:`Frame`, the one rectangle type, ``(x0, y0, width, height)`` in original pixels."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class Size(NamedTuple):
    """An image size in pixels, named: ``Size(width, height)`` (PIL's ``image.size`` order)."""

    width: int
    height: int


@dataclass(frozen=True)
class Frame:
    """A rectangle in original image pixels: top-left corner ``(x0, y0)``, ``width`` and
    ``height`` (COCO's ``[x, y, w, h]`` order); the bottom-right corner is ``(x1, y1)``.

    The one rectangle type: a view's grid frame (floats, may reach outside the image), the seen
    region, a zoom crop (whole pixels) and, with a score, a grounding
    :class:`~vlm_focus.grounding.Box`. The fields are named after what they hold: ``x0``/``y0``
    say "corner" (``x1``/``y1`` are the other one), ``width``/``height`` are spelled as in
    :class:`Size`. Every value must be a finite number, ``width`` and ``height`` at least 0;
    anything else raises when the frame is built.
    """

    x0: float
    y0: float
    width: float
    height: float

    def __post_init__(self) -> None:
        for name in ("x0", "y0", "width", "height"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"{type(self).__name__}: {name}={value!r} must be a number (image pixels)"
                )
            if not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}: {name}={value!r} must be finite")
        if self.width < 0 or self.height < 0:
            raise ValueError(
                f"{type(self).__name__}: width={self.width!r} and height={self.height!r} must "
                "be >= 0"
            )

    @property
    def x1(self) -> float:
        """The right edge, ``x0 + width``."""
        return self.x0 + self.width

    @property
    def y1(self) -> float:
        """The bottom edge, ``y0 + height``."""
        return self.y0 + self.height

    @property
    def xywh(self) -> list[float]:
        """``[x0, y0, width, height]`` (COCO's ``bbox``)."""
        return [self.x0, self.y0, self.width, self.height]

    @property
    def xyxy(self) -> tuple[float, float, float, float]:
        """``(x0, y0, x1, y1)``: the corners, what ``PIL.Image.crop`` takes."""
        return self.x0, self.y0, self.x1, self.y1

    @property
    def area(self) -> float:
        return self.width * self.height

    def contains(self, x: float, y: float) -> bool:
        """Whether the point ``(x, y)`` lies inside the rectangle (edges included)."""
        return self.x0 <= x <= self.x1 and self.y0 <= y <= self.y1

    def covers(self, other: Any) -> bool:
        """Whether the whole rectangle ``other`` (a frame or ``[x, y, w, h]``) lies inside."""
        other = as_frame(other)
        return (
            self.x0 <= other.x0
            and self.y0 <= other.y0
            and other.x1 <= self.x1
            and other.y1 <= self.y1
        )

    def is_whole(self, size: Size) -> bool:
        """Whether the rectangle is exactly the whole ``size`` image."""
        return self.xywh == [0, 0, size.width, size.height]

    def cells(self, grid: tuple[int, int]) -> torch.Tensor:
        """``[rows, cols, 4]`` float64 pixel rectangles ``(x_lo, y_lo, x_hi, y_hi)`` of a
        ``(rows, cols)`` grid's cells."""
        rows, cols = _grid(grid)
        xs = self.x0 + torch.arange(cols + 1, dtype=torch.float64) * self.width / cols
        ys = self.y0 + torch.arange(rows + 1, dtype=torch.float64) * self.height / rows
        lo_x, hi_x = xs[None, :-1].expand(rows, cols), xs[None, 1:].expand(rows, cols)
        lo_y, hi_y = ys[:-1, None].expand(rows, cols), ys[1:, None].expand(rows, cols)
        return torch.stack([lo_x, lo_y, hi_x, hi_y], dim=-1)

    def cell_centre(self, row: int, col: int, grid: tuple[int, int]) -> tuple[float, float]:
        """``(x, y)`` in original pixels of the centre of cell ``(row, col)``."""
        rows, cols = _grid(grid)
        return (
            self.x0 + (col + 0.5) * self.width / cols,
            self.y0 + (row + 0.5) * self.height / rows,
        )

    def cell_at(self, x: float, y: float, grid: tuple[int, int]) -> tuple[int, int] | None:
        """``(row, col)`` of the cell holding original pixel point ``(x, y)``, or ``None``
        outside the frame."""
        rows, cols = _grid(grid)
        u, v = (x - self.x0) / self.width, (y - self.y0) / self.height
        if not (0 <= u < 1 and 0 <= v < 1):
            return None
        return int(v * rows), int(u * cols)


def _grid(grid: Any) -> tuple[int, int]:
    rows, cols = (int(v) for v in grid)
    if rows < 1 or cols < 1:
        raise ValueError(f"a grid is (rows, cols) >= 1, got {grid!r}")
    return rows, cols


def as_frame(value: Any, *, name: str = "box") -> Frame:
    """``value`` as a :class:`Frame`: a frame (or a grounding ``Box``) as it is, else four
    numbers ``[x, y, w, h]`` in image pixels (a sequence, a tensor or an array), checked by the
    frame's constructor. ``TypeError`` names ``name`` and what was given."""
    if isinstance(value, Frame):
        return value
    if hasattr(value, "tolist") and not isinstance(value, list | tuple):
        value = value.tolist()
    if (
        isinstance(value, str)
        or not isinstance(value, Sequence)
        or len(value) != 4
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(
            f"{name} must be [x, y, w, h] in image pixels or a vlm_focus.geometry.Frame, got "
            f"{value!r}"
        )
    try:
        return Frame(*(float(v) for v in value))
    except ValueError as err:
        raise ValueError(f"{name}={list(value)!r}: {err}") from None
