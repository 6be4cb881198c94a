"""The re-ask: the question again, with the original image and the crops (``"both"``, a
multi-image prompt) or with the crops alone (``"crop"``).

The default mode comes from the model's adapter (``ModelAdapter.multi_image_views``): ``"both"``
for the families trained on multi-image conversations (LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL,
Qwen3-VL), ``"crop"`` for those trained on one image per conversation (LLaVA-1.5 and the embedded
organisms, LLaVA-NeXT): their processors accept several images, but the models were never taught
to relate two views. ``"crop"`` is what every single-image VLM can answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..geometry import Frame
from ..model_adapters import ModelAdapter, get_adapter

MODES = ("both", "crop")


def mode_for(adapter: ModelAdapter) -> str:
    """``"both"`` where the family relates several images in one prompt, else ``"crop"``."""
    return "both" if adapter.multi_image_views else "crop"


def default_mode(model: nn.Module) -> str:
    """The default re-ask mode of ``model``'s type (from its adapter's ``multi_image_views``)."""
    return mode_for(get_adapter(model))


def resolve_mode(model: nn.Module, mode: str | None) -> str:
    if mode is None:
        return default_mode(model)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {MODES} or None (the model's default)")
    return mode


def chat_text(processor: Any, question: str, n_images: int) -> str:
    """One user turn holding ``n_images`` images, then the question, in the processor's chat
    template with the generation prompt (without a template: one image token per image, a
    newline, the question)."""
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": question}]
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": content}]
        return processor.apply_chat_template(messages, add_generation_prompt=True)
    token = getattr(processor, "image_token", "<image>")
    return f"{token * n_images}\n{question}"


def multi_image_inputs(
    processor: Any, images: Sequence[Sequence[Any]], questions: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Processor inputs for rows of several images each (``images[b]``, in order) and one
    question per row, left-padded for generation. The images go to the processor as one flat
    list in row order, as its image tokens appear in the text."""
    if len(images) != len(questions):
        raise ValueError(f"{len(images)} image rows but {len(questions)} questions")
    if any(len(row) == 0 for row in images):
        raise ValueError("every row needs at least one image")
    texts = [chat_text(processor, q, len(row)) for row, q in zip(images, questions, strict=True)]
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    flat = [image for row in images for image in row]
    return dict(processor(images=flat, text=texts, return_tensors="pt", padding=True))


def reask_images(image: Any, crops: Sequence[Frame], mode: str) -> list[Any]:
    """The re-ask's images for one row: ``[image, crop_1, ...]`` (``both``) or the crops
    (``crop``), each crop (a :class:`~vlm_focus.geometry.Frame` inside the image) cut from
    ``image`` at full resolution."""
    width, height = image.size
    whole = Frame(0, 0, width, height)
    for c in crops:
        if c.width < 1 or c.height < 1 or not whole.covers(c):
            raise ValueError(f"crop {c} does not lie inside the {width} x {height} image")
    cut = [image.crop(c.xyxy) for c in crops]
    return [image, *cut] if mode == "both" else cut
