"""Qwen3-VL served by vLLM with each image and video pruned before the LLM.

Imported by vLLM's model registry (see :func:`vlm_focus.integrations.vllm.register`). Each piece
subclasses vLLM's own Qwen3-VL class: the processor places each image's and video frame's kept
count of placeholders (:class:`._processor.PruningProcessorMixin`; a frame's count is fixed
before the encoder runs, since a timestamp precedes every frame, so videos are pruned with
``budget="frame"``), and the model selects the kept cells and gives them their original
(interleaved) M-RoPE positions
(:class:`._mrope.MRopePruningModel`). vLLM packs each image token's DeepStack features after its
main features in one row, so they follow the kept tokens; the scores read the main features
only, which is what the LLM's first layer receives.
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ._mrope import MRopeImageProcessor, MRopePruningModel


class VlmFocusQwen3VLMultiModalProcessor(MRopeImageProcessor, Qwen3VLMultiModalProcessor):
    """vLLM's Qwen3-VL processor with each image's and video frame's kept count of
    placeholders (each frame after its timestamp, as vLLM writes it)."""

    def _unpruned_video(self, data, i: int) -> tuple[list[int], list[int]]:
        config = self.info.get_hf_config()
        t, n = self._video_frames(data)[i]
        video = self.get_video_repl(
            tokens_per_frame=[n] * t,
            timestamps=data["timestamps"][i],
            tokenizer=self.info.get_tokenizer(),
            vision_start_token_id=config.vision_start_token_id,
            vision_end_token_id=config.vision_end_token_id,
            video_token_id=config.video_token_id,
            select_token_id=True,
        )
        if self._expands_only_video_token(self.info.get_hf_processor()):
            return [config.video_token_id], list(video.full)
        start, end = config.vision_start_token_id, config.vision_end_token_id
        return [start, config.video_token_id, end], list(video.full)


@MULTIMODAL_REGISTRY.register_processor(
    VlmFocusQwen3VLMultiModalProcessor,
    info=Qwen3VLProcessingInfo,
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class VlmFocusQwen3VLForConditionalGeneration(MRopePruningModel, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL whose images and videos reach the LLM pruned."""

    frames_apart = True

    @property
    def scored_width(self) -> int | None:
        return self.visual_dim if self.use_deepstack else None
