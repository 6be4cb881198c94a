"""One image in any of the common forms, as the RGB PIL image a processor takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

ACCEPTED = (
    "a PIL image, a path, or one image as a numpy array or torch tensor: [H, W], [H, W, C] or "
    "[C, H, W] with C in (1, 3, 4); uint8 (or integers in [0, 255]) or floats in [0, 1] or "
    "[0, 255]"
)
_CHANNELS = (1, 3, 4)


def _hwc(array: np.ndarray, name: str) -> np.ndarray:
    """``[H, W]``, ``[H, W, C]`` or ``[C, H, W]`` as ``[H, W, C]``; an array whose first and last
    axes could both be channels is refused."""
    if array.ndim == 2:
        return array[:, :, None]
    if array.ndim != 3:
        raise ValueError(f"{name} has shape {list(array.shape)}; accepted: {ACCEPTED}")
    last, first = array.shape[2] in _CHANNELS, array.shape[0] in _CHANNELS
    if last and first:
        raise ValueError(
            f"{name} has shape {list(array.shape)}: both its first and last axes could be the "
            "colour channels; pass [H, W, C] with H and W larger than 4, or a PIL image"
        )
    if last:
        return array
    if first:
        return np.moveaxis(array, 0, -1)
    raise ValueError(f"{name} has shape {list(array.shape)}; accepted: {ACCEPTED}")


def _uint8(array: np.ndarray, name: str) -> np.ndarray:
    """Pixel values as uint8: integers in [0, 255] as they are; floats with a maximum of at most
    1 scaled by 255 (the [0, 1] convention), others in [0, 255] rounded."""
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise TypeError(f"{name} has dtype {array.dtype}; accepted: {ACCEPTED}")
    values = array.astype(np.float64)
    if not np.isfinite(values).all():
        raise ValueError(f"{name} holds NaN or infinite values")
    low, high = float(values.min()), float(values.max())
    if low < 0 or high > 255:
        raise ValueError(
            f"{name} has values in [{low:g}, {high:g}]; accepted: [0, 1] (floats) or [0, 255]"
        )
    if np.issubdtype(array.dtype, np.floating) and high <= 1.0:
        values = values * 255.0
    return np.round(values).astype(np.uint8)


def as_picture(image: Any, *, name: str = "image") -> Any:
    """An RGB PIL image from ``image`` (see :data:`ACCEPTED`); ``TypeError``/``ValueError``
    naming what was given and what is accepted."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, str | Path):
        from ..loading import load_image

        return load_image(image)
    if type(image).__module__.startswith("torch") and hasattr(image, "detach"):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise TypeError(f"{name} of type {type(image).__name__}; accepted: {ACCEPTED}")
    array = _uint8(_hwc(image, name), name)
    if min(array.shape[:2]) < 1:
        raise ValueError(f"{name} has no pixels (shape {list(image.shape)})")
    if array.shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(array)).convert("RGB")
