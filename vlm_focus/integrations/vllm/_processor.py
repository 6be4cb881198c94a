"""The processor behaviour every pruning class shares: which requests it takes, how many
placeholders each image of a prompt gets, what the model is handed with the pixels, and the
cache identity that goes with all of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import PromptReplacement

from ...config import keep_count
from ._layer0 import ATTENTION_PRUNERS
from ._request import (
    KEEP_FIELD,
    PROMPT_FIELD,
    PRUNER_FIELD,
    serve_options,
    split_request,
)
from ._scores import frame_counts

NO_VIDEO = (
    "vlm_focus's vLLM plugin prunes images only: this model's vlm_focus class takes no video; "
    "serve videos with vLLM's own class (no vlm_focus architecture override)"
)
#: Pruners whose choice for one image reads every image of its prompt at once, which vLLM's
#: per-image encoder outputs cannot give them: they serve prompts with one image.
ONE_IMAGE = (*ATTENTION_PRUNERS, "pyramid")


def prompt_counts(keep: float | int, sizes: Sequence[int]) -> list[int]:
    """Placeholders for the images of one prompt of ``sizes`` tokens each: the prompt keeps
    ``keep_count(keep, sum(sizes), clamp=True)``, shared out by ``budget="frame"``'s rule
    (:func:`._scores.frame_counts`). ``ValueError`` when an image would keep nothing."""
    counts = frame_counts(list(sizes), keep_count(keep, sum(sizes), clamp=True))
    if 0 in counts:
        raise ValueError(
            f"vlm_focus keep={keep!r} leaves an image of this prompt without a token "
            f"(images of {list(sizes)} tokens keep {counts}); keep more"
        )
    return counts


class PruningProcessorMixin:
    """Mixed into a vLLM multimodal processor. The subclass sets ``pruners`` (what its class
    serves, default first) and implements ``_image_token()`` and ``_image_sizes(data)`` (tokens
    per image of the processed batch).

    - :meth:`apply` refuses what the class cannot serve with a message that names the setting,
      and for an attention pruner adds the prompt's token ids to the request's
      ``mm_processor_kwargs`` before vLLM hashes the images: the selection reads the prompt, so
      the prompt is part of each image's cache identity.
    - Each image gets :func:`prompt_counts` placeholders and three per-image fields: that count,
      the pruner and the prompt. A count depends on the other images of its prompt, so a prompt
      with several images bypasses the processor cache (which processes only the images it
      lacks), and each of its images' cache identity adds its place and count to vLLM's hash.
    """

    pruners: tuple[str, ...]
    #: why the class serves one image per prompt whatever the pruner (``None``: it need not)
    one_image_only: str | None = None

    def _serve_options(self):
        return serve_options(self.info.get_hf_config(), self.pruners)

    def _split(self, kwargs):
        return split_request(kwargs, self._serve_options(), self.pruners)

    def apply(self, inputs, timing_ctx):
        pruner, _, _ = self._split(inputs.hf_processor_mm_kwargs)
        n_images = inputs.mm_data_items.get_all_counts().get("image", 0)
        if self.one_image_only and n_images > 1:
            raise ValueError(
                f"vlm_focus serves one image per prompt for this model ({self.one_image_only}); "
                f"this prompt has {n_images} images"
            )
        if pruner in ONE_IMAGE and n_images > 1:
            raise ValueError(
                f"vlm_focus pruner={pruner!r} chooses from every image of a prompt at once, "
                f"which vLLM's per-image encoder outputs cannot give it; this prompt has "
                f"{n_images} images: use pruner 'pool' for it"
            )
        if pruner in ATTENTION_PRUNERS:
            ids = list(inputs.prompt)
            if pruner == "text" and ids[-1:] == [self._image_token()]:
                raise ValueError(
                    "vlm_focus pruner='text' scores the image with the instruction after it, "
                    "but the prompt ends with its image"
                )
            kwargs = {**inputs.hf_processor_mm_kwargs, PROMPT_FIELD: tuple(ids)}
            inputs = replace(inputs, hf_processor_mm_kwargs=kwargs)
        return super().apply(inputs, timing_ctx)

    def _apply_hf_processor_main(self, mm_items, hf_kwargs):
        pruner, keep, rest = self._split(hf_kwargs)
        data = super()._apply_hf_processor_main(mm_items, rest)
        n_images = mm_items.get_all_counts().get("image", 0)
        if n_images:
            prompt = list(hf_kwargs.get(PROMPT_FIELD, ()))
            data[KEEP_FIELD] = torch.tensor(prompt_counts(keep, self._image_sizes(data)))
            data[PRUNER_FIELD] = torch.full((n_images,), self.pruners.index(pruner))
            data[PROMPT_FIELD] = torch.tensor([prompt] * n_images, dtype=torch.long)
        return data

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        _, _, rest = self._split(hf_processor_mm_kwargs)
        fields = dict(super()._get_mm_fields_config(hf_inputs, rest))
        for name in (KEEP_FIELD, PRUNER_FIELD, PROMPT_FIELD):
            fields[name] = MultiModalFieldConfig.batched("image", keep_on_cpu=True)
        return fields

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        """vLLM's updates, with each image's placeholder run cut to its kept count."""
        _, _, rest = self._split(hf_processor_mm_kwargs)
        updates = super()._get_prompt_updates(mm_items, rest, out_mm_kwargs)
        token = self._image_token()

        def kept_placeholders(item_idx: int) -> list[int]:
            return [token] * int(out_mm_kwargs["image"][item_idx][KEEP_FIELD].data)

        image = PromptReplacement("image", target=[token], replacement=kept_placeholders)
        return [image if update.modality == "image" else update for update in updates]

    def _cached_apply_hf_processor(self, inputs, timing_ctx):
        if inputs.mm_data_items.get_all_counts().get("image", 0) > 1:
            return self._apply_hf_processor(inputs, timing_ctx)
        return super()._cached_apply_hf_processor(inputs, timing_ctx)

    def _apply_hf_processor(self, inputs, timing_ctx):
        result = super()._apply_hf_processor(inputs, timing_ctx)
        items = result.kwargs.get("image") or []
        if len(items) < 2:
            return result
        algorithm = self.info.ctx.get_mm_config().mm_hasher_algorithm
        hashes = dict(result.hashes)
        hashes["image"] = [
            MultiModalHasher.hash_kwargs(
                algorithm, image=parent, index=i, keep=int(item[KEEP_FIELD].data)
            )
            for i, (parent, item) in enumerate(zip(result.hashes["image"], items, strict=True))
        ]
        return result._replace(hashes=hashes)


class ImagesOnlyInfo:
    """Mixed in before the processing info of a vLLM class that also takes videos: the pruning
    class serves images, and a request with a video gets the plugin's own message (not vLLM's
    "At most 0 video(s)") before any processing."""

    def get_supported_mm_limits(self):
        return {"image": None}

    def validate_num_items(self, modality: str, num_items: int) -> None:
        if modality == "video" and num_items:
            raise ValueError(NO_VIDEO)
        super().validate_num_items(modality, num_items)
