"""Count, on CPU, the places where vlm_focus would make the host wait for a GPU.

Inputs wrapped as :class:`OnDevice` stand for tensors on an accelerator: every tensor computed
from them stays ``OnDevice`` (torch's subclass propagation), and a call that reads one back on
the host (``item``, ``bool``, ``int``, ``float``, ``tolist``, ``cpu``, ``numpy``, ``nonzero``,
boolean-mask indexing) counts when it comes from vlm_focus code. Copying to the host gives a
plain tensor, so work done there afterwards costs nothing, as on a real device.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path

import torch

import vlm_focus

WATCHED = [str(Path(vlm_focus.__file__).parent)]  # callers whose reads count
_TORCH = str(Path(torch.__file__).parent)
_READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "argwhere"}
_TO_HOST = {"cpu", "numpy", "tolist"}

reads: Counter = Counter()  # "name file:line" -> count


def _vlm_focus_caller() -> str | None:
    frame = sys._getframe(2)  # 0: here, 1: __torch_function__, 2: the caller (or torch)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(tuple(WATCHED)):
        return None
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _bool_index(args: tuple) -> bool:
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _is_read(name: str, args: tuple) -> bool:
    if name in _READS or name in _DATA_DEPENDENT:
        return True
    return name in ("__getitem__", "__setitem__") and _bool_index(args)


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on an accelerator (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if _is_read(name, args):
            where = _vlm_focus_caller()
            if where is not None:
                reads[f"{name} {where}"] += 1
        out = super().__torch_function__(func, types, args, kwargs)
        if name in _TO_HOST and isinstance(out, torch.Tensor):
            return out.as_subclass(torch.Tensor)
        return out


def on_device(inputs: dict) -> dict:
    return {
        k: v.as_subclass(OnDevice) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
    }


def total() -> int:
    return sum(reads.values())


@contextlib.contextmanager
def per_forward(model: torch.nn.Module):
    """Yields a list that receives the running read count before each forward of ``model``
    (after the hooks registered before this one), plus the final count on exit."""
    reads.clear()
    marks: list[int] = []
    handle = model.register_forward_pre_hook(lambda *a, **k: marks.append(total()))
    try:
        yield marks
    finally:
        handle.remove()
        marks.append(total())
