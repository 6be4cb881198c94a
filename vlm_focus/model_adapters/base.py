"""What the pruning machinery needs to know about one VLM family, declared as data.

An adapter names where the decoder stack lives, which token ids mark visual tokens, how to lay
each image's tokens out on its 2-D grid, and how decode calls are positioned (1-D RoPE or
M-RoPE). Where the grids sit in the photo is :mod:`vlm_focus.geometry`'s arithmetic; an adapter
says which arithmetic its processor follows and its fallback for when no processor is at hand,
and :meth:`ModelAdapter.frames` is the one entry that asks. It never copies model code: the
layout functions read ``input_ids``, the config and the processor outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.attention import check_mask_rule
from ..geometry import (
    Frame,
    Size,
    as_size,
    check_processor_rule,
    check_size,
    image_processor_of,
    view_frames,
)


@dataclass
class ImageLayout:
    """Where one image (or video) sits in one batch row.

    ``positions[i]`` is the sequence position of the image's i-th visual token and ``cells[i]`` its
    ``(view, row, col)``: view 0 is the base image (or the first video frame), view 1 an anyres
    high-resolution composite or the next frame. Tokens with no grid cell (LLaVA-NeXT row
    newlines, a CLS token) have ``row = col = -1``. ``grids[v]`` is ``(rows, cols)`` of view ``v``.
    ``image_size`` is the original :class:`~vlm_focus.geometry.Size` (width, height) when the
    inputs carry it (LLaVA-NeXT's and LLaVA-OneVision's ``image_sizes``), else ``None``.
    """

    positions: torch.Tensor  # [n] int64, ascending
    cells: torch.Tensor  # [n, 3] int64: view, row, col
    grids: list[tuple[int, int]]
    kind: str = "image"  # "image" or "video"
    image_size: Size | None = None  # original (width, height) in pixels when known
    #: ``[n, 2]`` (crop, patch): the vision-encoder crop (0 = base image) and the patch index
    #: inside that crop each token comes from, ``-1`` where none (newlines, merged patches).
    patches: torch.Tensor | None = None
    n_crops: int = 1  # encoder crops this image used (base image + anyres crops)

    def __post_init__(self) -> None:
        if self.positions.shape[0] != self.cells.shape[0]:
            raise ValueError("positions and cells must describe the same number of tokens")
        if self.image_size is not None and not isinstance(self.image_size, Size):
            raise TypeError(
                f"ImageLayout(image_size={self.image_size!r}): pass a "
                "vlm_focus.geometry.Size(width, height) or None; a bare pair could be (width, "
                "height) or (height, width)"
            )


def text_positions(
    model: nn.Module, positions: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """1-D RoPE: a decoder called without ``position_ids`` counts on from its cache length
    (padding included), so the ids are ``positions`` themselves, ``[B, T]``."""
    return positions


def has_video(inputs: Mapping[str, Any]) -> bool:
    """The call carries video inputs (pixels, grids or generate()'s encoded videos)."""
    encoded = inputs.get("mm_encoder_outputs") or {}
    return "video" in encoded or any(
        "video" in key and value is not None for key, value in inputs.items()
    )


LayoutFn = Callable[[nn.Module, torch.Tensor, Mapping[str, Any]], list[list[ImageLayout]]]


@dataclass(frozen=True)
class ModelAdapter:
    """Declarative description of one ``config.model_type``.

    Attributes:
        model_type: the ``config.model_type`` this adapter serves.
        language_model: dotted path from the wrapped model to the text decoder (``.layers`` and
            ``.rotary_emb`` hang under it).
        layers, attention, input_norm: attribute names inside the decoder.
        image_token_attrs / video_token_attrs: config attributes holding the token ids, first
            one present wins.
        layout: ``layout(model, input_ids, inputs) -> [[ImageLayout per image] per row]``.
        required_with_images: forward inputs that must accompany images (clear error if absent).
        layout_inputs: image inputs the layout needs (``image_sizes``, ``image_grid_thw``).
            ``generate()`` encodes images before prefill and drops these from the forward call,
            so the engine records them from the model's ``encoders`` methods.
        vision_layers: dotted path to the vision encoder's layer list when it has a [CLS]
            token whose attention scores patches (CLIP); ``None`` where there is no CLS.
        vision_attention, vision_norm: attribute names inside one vision encoder layer.
        feature_layer_attr: config attribute naming the hidden-state index the LLM reads.
        fallback_geometry: how the views' grids sit on the image when no processor is given
            (:func:`vlm_focus.geometry.view_frames`): one rule of
            :data:`vlm_focus.geometry.RULES` per view (the last repeats), keyed by the number
            of views an image has, ``0`` for any other count. A guess about the processor:
            with ``processor=`` its own settings decide.
        mask_rule: which keys a query may attend to, one of
            :data:`vlm_focus.core.attention.MASK_RULES` (``"causal"``); every reader of the
            model's attention rows builds its mask from it
            (:func:`vlm_focus.core.attention.allowed_keys`).
        attention_window: attribute of a decoder layer's attention module holding its sliding
            window (``None`` there on a full-attention layer), or ``None`` when the family has
            no sliding-window layers (Gemma 3's ``"sliding_window"``).
        video: the family reads videos (its processor takes ``videos=`` and the model encodes
            them); it then names its video token in ``video_token_attrs``.
        processor_rule: the arithmetic the family's image processor places the image by, one
            of :data:`vlm_focus.geometry.PROCESSOR_RULES` (``"single"``, ``"anyres"``,
            ``"dynamic"``, ``"tiled"``, ``"pan_and_scan"``); the processor's settings give the
            numbers.
        aspect_grids: the grid's rows and columns follow the image's aspect ratio (dynamic
            resolution), so a size with width and height swapped can be caught.
        multi_image_views: the family was trained on conversations with several images, so it
            can relate an image to a crop of it in one prompt (the zoom's ``"both"`` re-ask).
            Families trained on one image per conversation answer a crop alone better, though
            their processors accept several images.
        qk_norms: attribute names of the per-head RMSNorms the attention applies to q and k
            before RoPE (Qwen3), or ``None``.
        sequence_hooks: ``(model, tokens_after) -> hook handles`` for decoder inputs laid out on
            the full sequence that must follow the pruned tokens (Qwen3-VL's DeepStack).
            ``tokens_after(i)`` is ``[B, S']``: the original positions of the tokens decoder
            layer ``i`` outputs in the current prefill, or ``None`` when nothing was pruned.
        visual_marker_attrs: config attributes of the tokens around an image that go with it
            when a prompt loses its images (:meth:`image_span_mask`).
        patch_grids: pixel inputs of patch rows, to the grid input that counts each image's
            rows (:meth:`patches_per_image`).
    """

    model_type: str
    layout: LayoutFn
    language_model: str = "model.language_model"
    layers: str = "layers"
    attention: str = "self_attn"
    input_norm: str = "input_layernorm"
    image_token_attrs: tuple[str, ...] = ("image_token_id", "image_token_index")
    video_token_attrs: tuple[str, ...] = ()
    pixel_inputs: tuple[str, ...] = ("pixel_values",)
    required_with_images: tuple[str, ...] = ()
    #: inputs the layout reads; generate() hands them to the image encoder, not to forward.
    layout_inputs: tuple[str, ...] = ()
    encoders: tuple[str, ...] = ("get_image_features",)
    vision_layers: str | None = None
    vision_attention: str = "self_attn"
    vision_norm: str = "layer_norm1"
    feature_layer_attr: str = "vision_feature_layer"
    fallback_geometry: Mapping[int, tuple[str, ...]] = field(
        default_factory=lambda: {0: ("resize",)}
    )
    mask_rule: str = "causal"
    attention_window: str | None = None
    video: bool = False
    processor_rule: str = "single"
    aspect_grids: bool = False
    multi_image_views: bool = False
    #: ``(model, positions [B, T], attention_mask [B, L] | None) -> position_ids`` for decode
    #: calls the engine must position itself (pruning before layer 0 leaves every cache short):
    #: the ids the model would give with its unpruned cache, whose length ``positions`` counts on.
    decode_positions: Callable[..., torch.Tensor] = text_positions
    #: the model numbers a prompt's tokens with one 1-D count per row, so the kept tokens can
    #: be renumbered consecutively (``positions="compact"``); ``False`` for M-RoPE, where a
    #: visual token's position is its grid cell's and the text after an image counts on from
    #: the grid's extent.
    consecutive_positions: bool = True
    qk_norms: tuple[str, str] | None = None
    sequence_hooks: Callable[[nn.Module, Callable[[int], torch.Tensor | None]], list] | None = None
    #: config attributes of the tokens that mark where an image or video sits (Qwen's
    #: ``<vision_start>`` and ``<vision_end>``): a prompt without its images loses them too.
    visual_marker_attrs: tuple[str, ...] = ()
    #: pixel inputs that hold one row per patch, every image's rows concatenated, each named
    #: with the grid input whose rows' products count the patches per image (Qwen's
    #: ``pixel_values`` and ``image_grid_thw``); any other pixel input has one entry per image.
    patch_grids: Mapping[str, str] = field(default_factory=dict)
    #: the engine prunes on a static cache (``cache_implementation="static"``); ``False`` where
    #: the engine refuses it for this model class
    static_cache: bool = True

    def __post_init__(self) -> None:
        check_processor_rule(self.processor_rule)
        check_mask_rule(self.mask_rule)
        if self.video and not self.video_token_attrs:
            raise ValueError(
                f"adapter '{self.model_type}' declares video=True but no video_token_attrs: "
                "name the config attribute holding the video token id"
            )

    def check(self, model: nn.Module, stages: Sequence[int]) -> None:
        """``ValueError`` naming why when this adapter cannot prune ``model`` exactly at the
        stage layers ``stages`` (``vf.wrap`` asks before it attaches anything). Every
        configuration and stage layer can be, by default."""

    def key_source(self, model: nn.Module, index: int) -> int:
        """The decoder layer whose cache holds the keys and values layer ``index`` attends to:
        the layer itself by default. A KV-shared layer (Gemma 4's last layers) reads another
        layer's and holds no cache of its own."""
        return index

    # --- geometry -----------------------------------------------------------------------------
    def frames(
        self, layout: ImageLayout, size: Size, *, processor: Any = None, rule: str | None = None
    ) -> list[Frame]:
        """Per view of ``layout``, the frame its grid spans on the ``size`` image
        (:func:`vlm_focus.geometry.view_frames`): ``rule`` (one of
        :data:`vlm_focus.geometry.RULES`) for every view, else ``processor``'s settings by this
        adapter's ``processor_rule``, else its ``fallback_geometry``. ``ValueError`` when
        ``size`` cannot be the image's (a grid that does not follow its aspect ratio)."""
        size = as_size(size)
        check_size(
            layout,
            size,
            image_processor=image_processor_of(processor),
            processor_rule=self.processor_rule,
            aspect=self.aspect_grids,
        )
        table = self.fallback_geometry
        fallback = table.get(len(layout.grids), table.get(0)) or ()
        return view_frames(
            layout,
            size,
            processor=processor,
            processor_rule=self.processor_rule,
            rule=rule,
            fallback=fallback,
        )

    def crop_groups(
        self, layouts: list[list[ImageLayout]], images: list[int] | None
    ) -> list[list[list[int]]] | None:
        """Per row, per image, the indices of the image blocks that show it, when the processor
        writes an image's crops as image blocks of their own (``processor_rule="pan_and_scan"``)
        and ``images`` (images per row, as the caller gave them) counts fewer images than
        blocks: in a row of one image the first block is the image and the rest its crops.
        ``None`` when every block is an image of its own (or ``images`` counts more images than
        a row has blocks). Which crops belong to which image of a row of several is not in the
        inputs, so such a row raises."""
        blocks = [len(row) for row in layouts]
        if self.processor_rule != "pan_and_scan" or images is None or images == blocks:
            return None
        if len(images) != len(blocks) or any(i > n for i, n in zip(images, blocks, strict=True)):
            return None  # more images than blocks: the sizes' own check says so
        groups = []
        for b, (n_images, n_blocks) in enumerate(zip(images, blocks, strict=True)):
            if n_images == n_blocks:
                groups.append([[i] for i in range(n_blocks)])
            elif n_images == 1 and n_blocks > 1:
                groups.append([list(range(n_blocks))])
            else:
                raise ValueError(
                    f"row {b}: {n_images} images given for {n_blocks} image blocks. With "
                    f"pan-and-scan, {self.model_type}'s processor writes each image's crops as "
                    "image blocks of their own after it, and the inputs do not say which crops "
                    "are whose: ground one image per row (its crops follow from the count), or "
                    "call the processor without do_pan_and_scan"
                )
        return groups

    # --- resolution helpers -------------------------------------------------------------------
    def decoder(self, model: nn.Module) -> nn.Module:
        """The text decoder module (owner of ``layers`` and ``rotary_emb``)."""
        module = model
        for part in self.language_model.split("."):
            if not hasattr(module, part):
                raise ValueError(
                    f"{type(model).__name__} has no '{self.language_model}' for model_type "
                    f"'{self.model_type}': pass the *ForConditionalGeneration model"
                )
            module = getattr(module, part)
        return module

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self.decoder(model), self.layers)

    def vision_encoder_layers(self, model: nn.Module) -> nn.ModuleList | None:
        """The vision encoder's layers (``None`` when the adapter declares none)."""
        if self.vision_layers is None:
            return None
        module = model
        for part in self.vision_layers.split("."):
            module = getattr(module, part, None)
            if module is None:
                return None
        return module

    def project_qk(
        self, attention: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, H, Tq, Dh]`` and k ``[B, Hkv, S, Dh]`` before RoPE from the normed hidden
        states ``q_in [B, Tq, D]`` and ``k_in [B, S, D]``, as the attention module projects them."""
        head_dim = attention.head_dim
        q = attention.q_proj(q_in).view(*q_in.shape[:2], -1, head_dim)  # [B, Tq, H, Dh]
        k = attention.k_proj(k_in).view(*k_in.shape[:2], -1, head_dim)  # [B, S, Hkv, Dh]
        if self.qk_norms is not None:
            q_norm, k_norm = (getattr(attention, name) for name in self.qk_norms)
            q, k = q_norm(q), k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2)

    def recurrent_layers(self, model: nn.Module) -> frozenset[int]:
        """Indices of the decoder layers whose token mixer keeps a recurrent state instead of
        attending over cached keys (a hybrid decoder's linear-attention layers). Such a layer
        reads every token it is given, so it cannot mask a key out. None by default."""
        return frozenset()

    def scoring_layer(self, model: nn.Module, index: int) -> nn.Module:
        """The module whose input norm and attention score a pruning stage at decoder layer
        ``index``: the layer itself by default. A stand-in that computes its own q/k defines
        ``query_key(hidden, cos, sin, rows)`` (:func:`vlm_focus.core.attention.layer_qk`)."""
        return self.scoring_layer_of(self.decoder_layers(model), index)

    def scoring_layer_of(self, layers: Sequence[nn.Module], index: int) -> nn.Module:
        """:meth:`scoring_layer` among the decoder ``layers`` themselves (another runtime's
        modules of the same model, e.g. vLLM's, named as this adapter names them)."""
        return layers[index]

    def token_ids(self, model: nn.Module) -> tuple[int | None, int | None]:
        """(image token id, video token id or None)."""
        config = model.config
        image = next(
            (getattr(config, a) for a in self.image_token_attrs if hasattr(config, a)), None
        )
        video = next(
            (getattr(config, a) for a in self.video_token_attrs if hasattr(config, a)), None
        )
        if image is None:
            raise ValueError(f"config of '{self.model_type}' has none of {self.image_token_attrs}")
        return image, video

    def visual_mask(
        self, model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any] | None = None
    ) -> torch.Tensor:
        """``[B, S]`` bool: which positions hold visual tokens. With the call's ``inputs``, a
        video-token id in a prompt without video inputs is text, as the model reads it."""
        image, video = self.token_ids(model)
        mask = input_ids == image
        if video is not None and (inputs is None or has_video(inputs)):
            mask |= input_ids == video
        return mask

    def image_span_mask(
        self, model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any] | None = None
    ) -> torch.Tensor:
        """``[B, S]`` bool: the tokens a prompt loses with its images, the visual tokens and
        the markers around them (:attr:`visual_marker_attrs`)."""
        mask = self.visual_mask(model, input_ids, inputs)
        for attr in self.visual_marker_attrs:
            token = getattr(model.config, attr, None)
            if token is None:
                raise ValueError(f"config of '{self.model_type}' has no {attr}")
            mask |= input_ids == token
        return mask

    def patches_per_image(self, key: str, inputs: Mapping[str, Any]) -> list[int] | None:
        """Rows of ``inputs[key]`` per image (or video) when that input holds patch rows of
        concatenated images (:attr:`patch_grids`), else ``None``: its first dimension then
        indexes the images."""
        grid = self.patch_grids.get(key)
        if grid is None:
            return None
        if inputs.get(grid) is None:
            raise ValueError(f"{key} needs {grid} (pass the processor's output)")
        return [int(n) for n in torch.as_tensor(inputs[grid]).prod(-1).tolist()]


def merge_views(blocks: list[ImageLayout]) -> ImageLayout:
    """One image of several views from image blocks laid out one view each (an image and the
    pan-and-scan crops written after it): block ``v``'s grid becomes view ``v``."""
    cells = []
    for v, block in enumerate(blocks):
        if len(block.grids) != 1:
            raise ValueError(f"block {v} has {len(block.grids)} views; merge_views takes one each")
        cells.append(torch.cat([torch.full_like(block.cells[:, :1], v), block.cells[:, 1:]], 1))
    return ImageLayout(
        torch.cat([block.positions for block in blocks]),
        torch.cat(cells),
        [block.grids[0] for block in blocks],
        image_size=blocks[0].image_size,
        n_crops=len(blocks),
    )


def runs(positions: torch.Tensor) -> list[torch.Tensor]:
    """Split ascending positions into maximal runs of consecutive integers."""
    if positions.numel() == 0:
        return []
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    return list(torch.tensor_split(positions, breaks.tolist()))


def grid_cells(rows: int, cols: int, view: int = 0) -> torch.Tensor:
    """``[rows*cols, 3]`` cells of a row-major grid."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([torch.full_like(r, view), r, c], dim=-1).reshape(-1, 3)


def chunk_positions(row_positions: torch.Tensor, sizes: list[int], what: str) -> list[torch.Tensor]:
    """Split one row's visual positions into consecutive chunks of the given sizes."""
    if sum(sizes) != row_positions.numel():
        raise ValueError(
            f"{what}: the prompt holds {row_positions.numel()} visual tokens but the images "
            f"need {sum(sizes)} ({sizes}); input_ids and the image inputs disagree"
        )
    return list(torch.split(row_positions, sizes))


def rows_per_prompt(needed: int, described: int, batch: int, what: str, source: str) -> int:
    """How many consecutive rows share one prompt's images: ``generate()`` repeats each
    prompt ``k`` times for beam search or ``num_return_sequences`` while the image encoder saw
    each image once, so the rows need ``k`` times the visual tokens the image inputs describe."""
    if needed == described or needed == 0 or described == 0:
        return 1
    k = needed // described
    if k >= 1 and needed % described == 0 and batch % k == 0:
        return k
    raise ValueError(
        f"the prompt holds {needed} {what} but {source} describes {described}; pass the "
        f"processor's {source} for these input_ids"
    )
