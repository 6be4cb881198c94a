"""Visual contrastive decoding (VCD, M3ID): contrast the model against itself on a degraded
image."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, LogitsProcessor

from ..core.options import check_choices, option
from ..generation import extend_with_answer
from ..model_adapters import get_adapter
from ._side_pass import side_logits, side_pass
from .registry import Mitigation, check_numbers, register_mitigation

#: What the contrast branch sees instead of the prompt's image.
BRANCHES = ("noise", "blank", "text")
#: Forward-diffusion beta schedules over 1000 steps: VCD's released code uses the sigmoid one.
SCHEDULES = ("sigmoid", "linear")
DIFFUSION_STEPS = 1000
#: The noise is a fixed draw, so that runs repeat.
NOISE_SEED = 0


@dataclass
class VisualContrastOptions:
    """The options of :func:`visual_contrast`."""

    branch: str = option(
        "noise",
        "what the contrast run sees: 'noise' (the image after forward diffusion, VCD), "
        "'blank' (zero pixel values: the processor's mean colour) or 'text' (no image)",
        choices=BRANCHES,
    )
    weight: float = option(1.0, "contrast weight alpha in l_f + w (l_f - l_b - c), >= 0")
    growth: float = option(
        0.0,
        "M3ID's lambda: the weight at generated token t is weight * (exp(growth t) - 1); "
        "0 keeps it constant (VCD), >= 0",
    )
    beta: float = option(0.1, "plausibility cutoff: tokens below beta * the top probability drop")
    noise_step: int = option(500, "the noise branch's diffusion step t, in [0, 999]")
    schedule: str = option(
        "sigmoid",
        "the noise branch's beta schedule: 'sigmoid' (VCD's code) or 'linear' (DDPM's, "
        "1e-4 to 0.02)",
        choices=SCHEDULES,
    )
    centre: torch.Tensor | str | None = option(
        None,
        "c, subtracted from l_f - l_b: the [vocab] tensor of contrast_centre() or the path of "
        "one saved with torch.save (none: no centring)",
    )

    def __post_init__(self) -> None:
        check_choices(self, VisualContrastOptions)
        check_numbers(self, "weight", "growth", "beta", "noise_step")
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if self.growth < 0:
            raise ValueError(f"growth must be >= 0, got {self.growth}")
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta (plausibility cutoff) must lie in [0, 1), got {self.beta}")
        if not isinstance(self.noise_step, int) or not 0 <= self.noise_step < DIFFUSION_STEPS:
            raise ValueError(
                f"noise_step must be an int in [0, {DIFFUSION_STEPS - 1}], got {self.noise_step!r}"
            )
        centre = self.centre
        if isinstance(centre, torch.Tensor):
            if centre.dim() != 1 or not centre.is_floating_point():
                raise ValueError(
                    f"centre must be a 1-D float tensor over the vocabulary, got "
                    f"{centre.dtype} of shape {list(centre.shape)}"
                )
        elif centre is not None and not isinstance(centre, str | os.PathLike):
            raise TypeError(
                f"centre must be a tensor, the path of a torch.save file or None, got {centre!r}"
            )


def alpha_bar(step: int, schedule: str = "sigmoid") -> float:
    """``abar_t = prod_{s <= t} (1 - beta_s)`` of a 1000-step schedule: ``"sigmoid"``
    ``beta = sigmoid(linspace(-6, 6)) * (5e-3 - 1e-5) + 1e-5`` (VCD's code), ``"linear"``
    ``beta = linspace(1e-4, 0.02)`` (DDPM)."""
    if schedule == "sigmoid":
        betas = torch.sigmoid(torch.linspace(-6, 6, DIFFUSION_STEPS, dtype=torch.float64))
        betas = betas * (5e-3 - 1e-5) + 1e-5
    elif schedule == "linear":
        betas = torch.linspace(1e-4, 0.02, DIFFUSION_STEPS, dtype=torch.float64)
    else:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    return float(torch.cumprod(1 - betas, 0)[step])


def _draw(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def diffusion_noise(pixels: torch.Tensor, patches: list[int] | None = None) -> torch.Tensor:
    """The standard normal noise ``eps`` for ``pixels``, drawn per image so that an image gets
    the same noise in any batch: patch rows (``patches``, rows per image) get one draw per
    image; a ``[..., C, H, W]`` input one draw per crop or frame index (seed + index), shared
    by the images; any other input one draw."""
    if patches is not None:
        return torch.cat([_draw((n, *pixels.shape[1:]), NOISE_SEED) for n in patches])
    if pixels.dim() >= 4:
        inner = pixels.shape[1:-3]  # crops or frames per image
        units = [_draw(pixels.shape[-3:], NOISE_SEED + i) for i in range(math.prod(inner))]
        one = torch.stack(units).view(*inner, *pixels.shape[-3:])
        return one.expand(pixels.shape).contiguous()
    return _draw(pixels.shape, NOISE_SEED)


def branch_inputs(
    model: nn.Module,
    inputs: Mapping[str, Any],
    branch: str,
    *,
    noise_step: int = VisualContrastOptions.noise_step,
    schedule: str = VisualContrastOptions.schedule,
) -> dict[str, Any]:
    """The inputs of the contrast branch of a prompt (see :func:`visual_contrast`)."""
    if branch not in BRANCHES:
        raise ValueError(f"branch {branch!r} is not one of {BRANCHES}")
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise TypeError("inputs must be the processor's output mapping with input_ids")
    adapter = get_adapter(model)
    if branch == "text":
        return _without_images(model, inputs)
    out = dict(inputs)
    pixel_keys = [k for k in adapter.pixel_inputs if inputs.get(k) is not None]
    if not pixel_keys:
        raise ValueError(f"the {branch!r} branch needs the prompt's images (no pixel inputs)")
    scale = alpha_bar(noise_step, schedule)
    for key in pixel_keys:
        pixels = inputs[key]
        if branch == "blank":
            out[key] = torch.zeros_like(pixels)
            continue
        eps = diffusion_noise(pixels, adapter.patches_per_image(key, inputs))
        noised = math.sqrt(scale) * pixels.float() + math.sqrt(1 - scale) * eps.to(pixels.device)
        out[key] = noised.to(pixels.dtype)
    return out


def _without_images(model: nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The prompt with its visual tokens (and their markers) removed and padding, re-padded on
    the left; only the per-token inputs stay (no image inputs)."""
    input_ids = inputs["input_ids"]
    batch, seq = input_ids.shape
    mask = inputs.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    keep = valid & ~get_adapter(model).image_span_mask(model, input_ids, inputs)
    counts = keep.sum(1)
    width = int(counts.max())
    # kept tokens in order, right-aligned: row b's j-th kept token lands at width - n_b + j
    order = torch.sort(keep.int(), dim=1, descending=True, stable=True).indices[:, :width]
    slots = torch.arange(width, device=input_ids.device)[None] - (width - counts[:, None])
    filled = slots >= 0
    source = order.gather(1, slots.clamp(min=0))
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        per_token = (
            isinstance(value, torch.Tensor)
            and value.dim() == 2
            and tuple(value.shape) == (batch, seq)
            and not value.is_floating_point()
        )
        if not per_token:
            continue
        fill = (pad or 0) if key == "input_ids" else 0
        out[key] = torch.where(filled, value.gather(1, source), fill)
    out["attention_mask"] = filled.long()
    return out


def _load_centre(centre: torch.Tensor | str | os.PathLike | None) -> torch.Tensor | None:
    if centre is None or isinstance(centre, torch.Tensor):
        return centre
    if not os.path.isfile(centre):
        raise ValueError(f"centre file {os.fspath(centre)!r} does not exist")
    loaded = torch.load(centre, map_location="cpu", weights_only=True)
    if not isinstance(loaded, torch.Tensor) or loaded.dim() != 1:
        raise ValueError(f"centre file {os.fspath(centre)!r} holds no 1-D tensor")
    return loaded


@register_mitigation
class VisualContrast(Mitigation, LogitsProcessor):
    """A ``LogitsProcessor`` and context manager; see :func:`visual_contrast`."""

    name = "visual_contrast"
    Options = VisualContrastOptions
    summary = "contrast against a run that sees a noised or blank image, or none (VCD, M3ID)"
    reads_inputs = True

    def __init__(
        self, model: nn.Module, inputs: Mapping[str, Any], options: VisualContrastOptions
    ) -> None:
        self.model = model
        self.inputs = dict(inputs)
        self.branch = options.branch
        self.weight, self.growth = float(options.weight), float(options.growth)
        self.beta = float(options.beta)
        self.centre = _load_centre(options.centre)
        self.branch_inputs = branch_inputs(
            model, inputs, options.branch, noise_step=options.noise_step, schedule=options.schedule
        )
        self.active = False
        self.last_branch_logits: torch.Tensor | None = None
        self._cache: DynamicCache | None = None  # the noise or blank branch's own KV cache
        self._fed: torch.Tensor | None = None  # the tokens in it
        self._logits: torch.Tensor | None = None  # its logits after them

    def attach(self) -> None:
        self.active = True
        self._cache = None

    def remove(self) -> None:
        self.active = False
        self._cache = self._fed = self._logits = None  # free the branch's cache

    def weight_at(self, step: int) -> float:
        """The contrast weight at generated token ``step`` (0 for the first)."""
        if self.growth == 0:
            return self.weight
        return self.weight * math.expm1(self.growth * step)

    def branch_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, V]`` of the branch for the sequence so far."""
        prompt = self.inputs["input_ids"]
        batch, seq = prompt.shape
        if input_ids.shape[0] != batch or not torch.equal(input_ids[:, :seq], prompt):
            raise ValueError(
                "visual_contrast serves the prompt it was built for, one sequence per row "
                "(no beams or num_return_sequences)"
            )
        if self.branch == "text":  # a short prompt of its own layout: rerun it whole
            inputs, _ = extend_with_answer(self.branch_inputs, input_ids[:, seq:])
            return side_logits(self.model, inputs, same_prompt=False)
        # The same layout as the prompt: the branch keeps its own cache, so each step feeds
        # only the new tokens, without pixels (a generated image-token id stays text).
        length = input_ids.shape[1]
        fed = self._fed
        if (
            fed is None
            or fed.shape[1] > length
            or not torch.equal(input_ids[:, : fed.shape[1]], fed)
        ):
            self._cache = DynamicCache()  # a new sequence (another generate() call)
            out = side_pass(self.model, self.branch_inputs, cache=self._cache)
            self._fed, self._logits = prompt, out.logits[:, -1]
        seen = self._fed.shape[1]
        if seen < length:
            mask = self.inputs.get("attention_mask")
            mask = torch.ones_like(prompt) if mask is None else mask
            grown = torch.ones(batch, length - seq, dtype=mask.dtype, device=mask.device)
            mask = torch.cat([mask, grown], 1)
            # positioned as the model positions a decode call on its cache (M-RoPE included)
            positions = torch.arange(seen, length, device=input_ids.device)
            step = {
                "input_ids": input_ids[:, seen:],
                "attention_mask": mask,
                "position_ids": get_adapter(self.model).decode_positions(
                    self.model, positions.expand(batch, -1), mask
                ),
            }
            out = side_pass(self.model, step, cache=self._cache)
            self._fed, self._logits = input_ids, out.logits[:, -1]
        return self._logits

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.active:
            return scores
        step = input_ids.shape[1] - self.inputs["input_ids"].shape[1]
        return contrast(
            scores,
            lambda: self._branch(input_ids),
            self.weight_at(step),
            self.beta,
            self.centre,
        )

    def _branch(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.last_branch_logits = self.branch_logits(input_ids).float()
        return self.last_branch_logits


def contrast(
    scores: torch.Tensor,
    branch: Any,
    weight: float,
    beta: float,
    centre: torch.Tensor | None = None,
) -> torch.Tensor:
    """``l_f + weight * (l_f - l_b - centre)`` on ``{y : p_f(y) >= beta * max p_f}``, ``-inf``
    elsewhere, with ``l = log_softmax``; ``branch()`` gives the branch's logits (called only
    when ``weight > 0``)."""
    full = torch.log_softmax(scores.float(), dim=-1)
    out = full
    if weight > 0:
        diff = full - torch.log_softmax(branch().float(), dim=-1)
        if centre is not None:
            if centre.shape[-1] != diff.shape[-1]:
                raise ValueError(
                    f"centre has {centre.shape[-1]} entries, the logits {diff.shape[-1]}"
                )
            diff = diff - centre.to(diff.device, diff.dtype)
        out = full + weight * diff
    if beta > 0:
        cutoff = full.amax(-1, keepdim=True) + math.log(beta)
        out = out.masked_fill(full < cutoff, float("-inf"))
    return out.to(scores.dtype)


def contrast_centre(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    branch: str = VisualContrastOptions.branch,
    noise_step: int = VisualContrastOptions.noise_step,
    schedule: str = VisualContrastOptions.schedule,
) -> torch.Tensor:
    """The centring ``c`` of :func:`visual_contrast`: the mean over every row of ``batches``
    (processor outputs, e.g. calibration scenes) of ``l_f - l_b`` at the answer position (the
    prompt's last token), ``[V]`` float32 on the CPU. Save it with ``torch.save`` and pass the
    path (or the tensor) as ``centre``."""
    VisualContrastOptions(branch=branch, noise_step=noise_step, schedule=schedule)  # checked
    total, rows = None, 0
    for inputs in batches:
        built = branch_inputs(model, inputs, branch, noise_step=noise_step, schedule=schedule)
        call = {k: v for k, v in inputs.items() if k != "labels"}
        with torch.no_grad():
            full = model(**call, logits_to_keep=1).logits[:, -1]
        side = side_logits(model, built, same_prompt=branch != "text")
        diff = torch.log_softmax(full.float(), -1) - torch.log_softmax(side.float(), -1)
        part = diff.sum(0).cpu()
        total = part if total is None else total + part
        rows += diff.shape[0]
    if total is None:
        raise ValueError("contrast_centre needs at least one batch of inputs")
    return total / rows


def visual_contrast(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    branch: str = VisualContrastOptions.branch,
    weight: float = VisualContrastOptions.weight,
    growth: float = VisualContrastOptions.growth,
    beta: float = VisualContrastOptions.beta,
    noise_step: int = VisualContrastOptions.noise_step,
    schedule: str = VisualContrastOptions.schedule,
    centre: torch.Tensor | str | None = VisualContrastOptions.centre,
) -> VisualContrast:
    """Visual contrastive decoding (VCD; M3ID with ``growth``).

    At generated token ``t`` (0 for the first), with ``l_f`` the log-softmax of the model's
    logits and ``l_b`` that of a branch run on a degraded image::

        l = l_f + w_t * (l_f - l_b - c)   on {y : p_f(y) >= beta * max p_f},  -inf elsewhere

    ``w_t = weight`` (VCD), or with ``growth = lambda > 0`` M3ID's
    ``w_t = weight * (exp(lambda t) - 1)``, i.e. ``(1 - gamma_t) / gamma_t`` with
    ``gamma_t = exp(-lambda t)``: no contrast at the first token, more along a long caption,
    where the image's pull fades. Tokens the image makes likelier than the branch does gain;
    those the language prior alone supports lose.

    The branch (``branch``):

    - ``"noise"``: the prompt's pixel values after forward diffusion,
      ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps`` at ``t = noise_step`` of a 1000-step
      ``schedule`` (:func:`alpha_bar`), ``eps`` a fixed draw per image
      (:func:`diffusion_noise`), so runs repeat and a row's answer does not depend on its batch;
    - ``"blank"``: pixel values of zeros, i.e. after the processor's normalisation an image of
      its mean colour;
    - ``"text"``: no image: the prompt without its visual tokens (and markers such as Qwen's
      vision start and end), re-padded on the left.

    ``c`` (``centre``) is 0 unless given. ``l_f - l_b`` is not zero on average even where the
    image says nothing about a token (the branch shifts some tokens everywhere); centring
    removes that average, measured on calibration scenes: ``c = contrast_centre(model,
    calibration_batches, branch=...)``, saved with ``torch.save`` and passed as ``centre=PATH``
    (a run's record then names the file). Measure it with the same branch and noise settings
    and the same model (pruned as it will run).

    The noise and blank branches keep their own KV cache (one extra prefill, then one token
    per step); the text branch, whose prompt has no visual tokens, reruns its whole sequence
    at each step. On a pruned model (``vf.wrap``) the noise and blank branches run
    unpruned with the keys each layer of the pruned prompt lacks masked from that layer on, so
    the two runs differ only in the image; the text branch has no visual tokens to prune.
    One sequence per prompt row (greedy or sampling; no beams or ``num_return_sequences``)::

        with visual_contrast(model, inputs) as proc:
            model.generate(**inputs, do_sample=False, logits_processor=[proc])
    """
    options = VisualContrastOptions(
        branch=branch,
        weight=weight,
        growth=growth,
        beta=beta,
        noise_step=noise_step,
        schedule=schedule,
        centre=centre,
    )
    return VisualContrast(model, inputs, options)
