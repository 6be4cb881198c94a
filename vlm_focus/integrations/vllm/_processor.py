"""The processor behaviour every pruning class shares: which requests it takes, how many
placeholders each image or video of a prompt gets, what the model is handed with the pixels, and
the cache identity that goes with all of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property

import torch
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import PromptReplacement, PromptUpdateDetails

from ...config import keep_count
from ...core.before_llm import frame_counts
from ...model_adapters.base import runs
from ...pruners import get_pruner
from . import BUDGETS, MODELS, model_type_of, served_pruners, video_pruners
from ._request import PROMPT_FIELD, item_fields, serve_options, split_request

NO_VIDEO = (
    "vlm_focus's vLLM plugin prunes images only for this model: its vlm_focus class takes no "
    "video; serve videos with vLLM's own class (no vlm_focus architecture override)"
)


def prompt_counts(keep: float | int, sizes: Sequence[int]) -> list[int]:
    """Placeholders for the units (images, or video frames) of one prompt of ``sizes`` tokens
    each: the prompt keeps ``keep_count(keep, sum(sizes), clamp=True)``, shared out by
    ``budget="frame"``'s rule (:func:`vlm_focus.core.before_llm.frame_counts`). ``ValueError``
    when a unit would keep nothing."""
    counts = frame_counts(list(sizes), keep_count(keep, sum(sizes), clamp=True))
    if 0 in counts:
        raise ValueError(
            f"vlm_focus keep={keep!r} leaves an image or video frame of this prompt without a "
            f"token (units of {list(sizes)} tokens keep {counts}); keep more"
        )
    return counts


def video_counts(
    keep: float | int, budget: str, frames: Sequence[tuple[int, int]]
) -> list[list[int]]:
    """Placeholders per frame of each video of one prompt, the videos ``(frames, tokens per
    frame)``: every frame its share of the prompt's count (``"frame"``), or, for a prompt's one
    video, its whole count as one entry (``"span"``: the pruner chooses where)."""
    if budget == "span":
        (t, n), *more = frames
        if more:
            raise ValueError("budget='span' prunes prompts with one video")
        return [[keep_count(keep, t * n, clamp=True)]]
    flat = prompt_counts(keep, [n for t, n in frames for _ in range(t)])
    out, start = [], 0
    for t, _ in frames:
        out.append(flat[start : start + t])
        start += t
    return out


def token_runs(seq: list[int], token: int) -> list[torch.Tensor]:
    """The maximal runs of ``token`` in ``seq``, each as its positions."""
    return runs(torch.nonzero(torch.tensor(seq) == token).flatten())


def cut_runs(seq: list[int], token: int, counts: Sequence[int]) -> list[int]:
    """``seq`` with its runs of ``token`` cut to ``counts`` tokens each (one count per run, or
    one count for a sequence that is a single run)."""
    found = token_runs(seq, token)
    if len(found) != len(counts):
        raise ValueError(f"{len(found)} runs of token {token} for {len(counts)} counts")
    out, start = [], 0
    for run, count in zip(found, counts, strict=True):
        out += [*seq[start : int(run[0])], *[token] * count]
        start = int(run[-1]) + 1
    return out + seq[start:]


def replace_once(seq: list[int], target: Sequence[int], replacement: Sequence[int]) -> list[int]:
    """``seq`` with the first occurrence of ``target`` replaced by ``replacement``."""
    n = len(target)
    for i in range(len(seq) - n + 1):
        if seq[i : i + n] == list(target):
            return [*seq[:i], *replacement, *seq[i + n :]]
    raise ValueError(f"the prompt has no placeholder {list(target)}")


class PruningProcessorMixin:
    """Mixed into a vLLM multimodal processor of the module that :data:`MODELS` names for a
    ``model_type`` (what it serves follows from that entry and the pruner registry). The
    subclass implements ``_image_token()`` and ``_image_sizes(data)`` (tokens per image of the
    processed batch); a class that prunes videos (``video_budgets`` in its entry) implements
    ``_video_token()``, ``_video_frames(data)`` (``(frames, tokens per frame)`` per video) and
    ``_unpruned_video(data, i)`` (the placeholder a video replaces in the prompt, and the tokens
    that replace it, unpruned).

    - :meth:`apply` refuses what the class cannot serve with a message that names the setting,
      and for an attention pruner adds the prompt's token ids to the request's
      ``mm_processor_kwargs`` before vLLM hashes the items: the selection reads the prompt, so
      the prompt is part of each item's cache identity.
    - Each image gets :func:`prompt_counts` placeholders, each video frame its
      :func:`video_counts` share (or the video its whole count, for ``"span"``), and the model
      gets per-item fields (:func:`._request.item_fields`): that count, the pruner, the budget,
      the prompt and the item's unpruned token count. A count depends on the other items of
      its prompt, so a prompt with several items bypasses the processor cache (which processes
      only the items it lacks), and each of its items' cache identity adds its place and count
      to vLLM's hash.
    """

    #: why the class serves one image per prompt whatever the pruner (``None``: it need not)
    one_image_only: str | None = None

    @cached_property
    def pruners(self) -> tuple[str, ...]:
        """The pruners the class serves, its default first."""
        return served_pruners(model_type_of(type(self).__module__))

    @cached_property
    def video_budgets(self) -> tuple[str, ...]:
        """The budgets the class prunes videos with, default first (empty: no video)."""
        return MODELS[model_type_of(type(self).__module__)].video_budgets

    def _serve_options(self):
        return serve_options(self.info.get_hf_config(), self.pruners)

    def _split(self, kwargs):
        return split_request(kwargs, self._serve_options(), self.pruners)

    def _video_token(self) -> int | None:
        return None

    def apply(self, inputs, timing_ctx):
        pruner, _, budget, _ = self._split(inputs.hf_processor_mm_kwargs)
        counts = inputs.mm_data_items.get_all_counts()
        n_images, n_videos = counts.get("image", 0), counts.get("video", 0)
        if self.one_image_only and n_images > 1:
            raise ValueError(
                f"vlm_focus serves one image per prompt for this model ({self.one_image_only}); "
                f"this prompt has {n_images} images"
            )
        if n_videos:
            self._check_video(pruner, budget, n_images)
        chosen = get_pruner(pruner)
        if chosen.reads_whole_prompt and n_images + n_videos > 1:
            raise ValueError(
                f"vlm_focus pruner={pruner!r} chooses from every image or video of a prompt at "
                f"once, which vLLM's per-item encoder outputs cannot give it; this prompt has "
                f"{n_images} images and {n_videos} videos: use one of "
                f"{tuple(p for p in self.pruners if not get_pruner(p).reads_whole_prompt)}"
            )
        if chosen.reads_layer_attention:
            ids = list(inputs.prompt)
            ends_with_item = ids[-1:] in ([self._image_token()], [self._video_token()])
            if chosen.needs_instruction and ends_with_item:
                raise ValueError(
                    f"vlm_focus pruner={pruner!r} scores the image or video with the instruction "
                    "after it, but the prompt ends with its image or video"
                )
            kwargs = {**inputs.hf_processor_mm_kwargs, PROMPT_FIELD: tuple(ids)}
            inputs = replace(inputs, hf_processor_mm_kwargs=kwargs)
        return super().apply(inputs, timing_ctx)

    def _check_video(self, pruner: str, budget: str, n_images: int) -> None:
        if not self.video_budgets:
            raise ValueError(NO_VIDEO)
        if pruner not in video_pruners(self.pruners):
            raise ValueError(
                f"vlm_focus pruner={pruner!r} does not prune videos; use one of "
                f"{video_pruners(self.pruners)}"
            )
        if budget not in self.video_budgets:
            raise ValueError(
                f"vlm_focus budget={budget!r} cannot prune this model's videos: it writes text "
                f"before every frame, so each frame's count is fixed before the encoder runs; "
                f"use budget in {self.video_budgets}"
            )
        if n_images:
            raise ValueError(
                "vlm_focus prunes a prompt's images or its videos, not both at once: this "
                f"prompt has {n_images} images and a video"
            )

    def _apply_hf_processor_main(self, mm_items, hf_kwargs):
        pruner, keep, budget, rest = self._split(hf_kwargs)
        data = super()._apply_hf_processor_main(mm_items, rest)
        counts = mm_items.get_all_counts()
        prompt = list(hf_kwargs.get(PROMPT_FIELD, ()))
        if counts.get("image", 0):
            sizes = self._image_sizes(data)
            kept = prompt_counts(keep, sizes)
            prompts = self._image_prompts(prompt, sizes)
            self._put_fields(data, "image", kept, sizes, pruner, budget, prompts)
        if counts.get("video", 0):
            frames = self._video_frames(data)
            kept = [sum(c) for c in video_counts(keep, budget, frames)]
            prompts = [
                replace_once(prompt, *self._unpruned_video(data, i)) if prompt else []
                for i in range(len(kept))
            ]
            sizes = [t * n for t, n in frames]
            self._put_fields(data, "video", kept, sizes, pruner, budget, prompts)
        return data

    def _image_prompts(self, prompt: list[int], sizes: list[int]) -> list[list[int]]:
        """The prompt each image's selection reads, one per image of ``sizes`` tokens: the
        prompt as written (a class whose images bring text of their own writes it in)."""
        return [prompt] * len(sizes)

    def _kept_image(self, count: int):
        """What replaces an image's placeholder: ``count`` image tokens (a class whose images
        bring text of their own returns :class:`PromptUpdateDetails` selecting them)."""
        return [self._image_token()] * count

    def _put_fields(self, data, modality, kept, sizes, pruner, budget, prompts) -> None:
        keep_name, pruner_name, budget_name, prompt_name, tokens_name = item_fields(modality)
        n = len(kept)
        data[keep_name] = torch.tensor(kept)
        data[tokens_name] = torch.tensor(sizes)
        data[pruner_name] = torch.full((n,), self.pruners.index(pruner))
        data[budget_name] = torch.full((n,), BUDGETS.index(budget))
        width = max(len(p) for p in prompts)
        if any(len(p) != width for p in prompts):
            raise ValueError("the items of one prompt carry prompts of different lengths")
        data[prompt_name] = torch.tensor(prompts, dtype=torch.long).reshape(n, width)

    def _modalities(self) -> tuple[str, ...]:
        return ("image", "video") if self.video_budgets else ("image",)

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        *_, rest = self._split(hf_processor_mm_kwargs)
        fields = dict(super()._get_mm_fields_config(hf_inputs, rest))
        for modality in self._modalities():
            for name in item_fields(modality):
                fields[name] = MultiModalFieldConfig.batched(modality, keep_on_cpu=True)
        return fields

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        """vLLM's updates, with each image's placeholder run cut to its kept count, and each
        video's runs cut to its frames' counts (one run: the video's count)."""
        _, _, budget, rest = self._split(hf_processor_mm_kwargs)
        updates = super()._get_prompt_updates(mm_items, rest, out_mm_kwargs)
        token = self._image_token()
        keep_name = item_fields("image")[0]

        def kept_placeholders(item_idx: int):
            return self._kept_image(int(out_mm_kwargs["image"][item_idx][keep_name].data))

        out = []
        for update in updates:
            if update.modality == "image":
                update = PromptReplacement("image", target=[token], replacement=kept_placeholders)
            elif update.modality == "video" and self.video_budgets:
                update = PromptReplacement(
                    "video",
                    target=update.target,
                    replacement=self._kept_video(update.replacement, out_mm_kwargs),
                )
            out.append(update)
        return out

    def _kept_video(self, unpruned, out_mm_kwargs):
        """The replacement of a video with its kept count of placeholders, from vLLM's
        unpruned one (``unpruned(item_idx)``: token ids or :class:`PromptUpdateDetails`)."""
        token = self._video_token()
        keep_name, _, budget_name, *_ = item_fields("video")

        def kept(item_idx: int):
            item = out_mm_kwargs["video"][item_idx]
            full = unpruned(item_idx) if callable(unpruned) else unpruned
            seq = list(full.full if isinstance(full, PromptUpdateDetails) else full)
            total = int(item[keep_name].data)
            budget = BUDGETS[int(item[budget_name].data)]
            n_runs = len(token_runs(seq, token))
            if budget == "span" or n_runs == 1:
                counts = [total]
            else:
                counts = frame_counts([seq.count(token) // n_runs] * n_runs, total)
            return PromptUpdateDetails.select_token_id(cut_runs(seq, token, counts), token)

        return kept

    def _cached_apply_hf_processor(self, inputs, timing_ctx):
        if sum(inputs.mm_data_items.get_all_counts().values()) > 1:
            return self._apply_hf_processor(inputs, timing_ctx)
        return super()._cached_apply_hf_processor(inputs, timing_ctx)

    def _apply_hf_processor(self, inputs, timing_ctx):
        result = super()._apply_hf_processor(inputs, timing_ctx)
        if sum(len(result.kwargs.get(m) or []) for m in self._modalities()) < 2:
            return result
        algorithm = self.info.ctx.get_mm_config().mm_hasher_algorithm
        hashes = dict(result.hashes)
        for modality in self._modalities():
            items = result.kwargs.get(modality) or []
            keep_name = item_fields(modality)[0]
            hashes[modality] = [
                MultiModalHasher.hash_kwargs(
                    algorithm, item=parent, index=i, keep=int(item[keep_name].data)
                )
                for i, (parent, item) in enumerate(
                    zip(result.hashes.get(modality, []), items, strict=True)
                )
            ]
        return result._replace(hashes=hashes)


class ImagesOnlyInfo:
    """Mixed in before the processing info of a pruning class that serves images only (the
    LLaVA classes): a request with a video gets the plugin's own message (not vLLM's "At most 0
    video(s)") before any processing, in the chat server's message parsing and offline."""

    def get_supported_mm_limits(self):
        return {"image": None}

    def validate_num_items(self, modality: str, num_items: int) -> None:
        if modality == "video" and num_items:
            raise ValueError(NO_VIDEO)
        super().validate_num_items(modality, num_items)
