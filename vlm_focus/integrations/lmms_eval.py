"""``--model vlm_focus`` for lmms-eval: its own model class, pruned by :func:`vlm_focus.wrap`.

::

    lmms-eval --model vlm_focus \\
        --model_args pretrained=llava-hf/llava-1.5-7b-hf,pruner=fastv,keep=0.25,layer=2 \\
        --tasks pope,mme --log_samples --output_path results/

Every model type of :func:`vlm_focus.supported_models` runs except those :data:`DELEGATES`
leaves out, with the reason (the error says it before any weights load). The class reads the
checkpoint's ``model_type`` from its config (no weights), takes vlm_focus's own arguments out
of ``--model_args`` and checks them (:mod:`vlm_focus.integrations.model_args`), then builds
lmms-eval's HF class for that model type with the rest (``pretrained``, ``batch_size``,
``device``, ...) and wraps its model. Prompt building, image processing,
decoding and batching stay lmms-eval's.

What pruning did is recorded per request in ``token_counts`` of the ``--log_samples`` output
(``visual_kept``, ``visual_total``, ``prefill_s``, ``vlm_focus``: the setting) and, as run
means, in the results' ``throughput`` section (``avg_vlm_focus_kept_ratio``,
``avg_vlm_focus_prefill_s``, ``avg_vlm_focus_visual_kept``, ``avg_vlm_focus_visual_total``);
the full setting is in the results' ``model_args`` and in the log.

``prefill_s`` is the wall time of the model's prefill forward (vision tower included) for the
request's batch, divided evenly over its rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from loguru import logger

from ..loading import declared_tokenizer, resolve_model_path
from ..model_adapters import get_adapter
from .model_args import FocusArgs, split_model_args


@dataclass(frozen=True)
class Delegate:
    """lmms-eval's class for one model type: its import path, whether it takes chat requests,
    and the largest batch it runs (``None``: any); or, with no class, why the model type is
    left out (``left_out``)."""

    class_path: str | None
    chat: bool = True
    max_batch: int | None = None
    left_out: str | None = None
    #: the lmms-eval module whose ``_resolve_model_class(pretrained, is_moe)`` picks the HF
    #: class, where lmms-eval decides ``is_moe`` from the checkpoint's name (``None``: no such)
    class_by_name: str | None = None


# lmms-eval 0.7.3's Qwen3-VL and Qwen3.5 classes load the mixture-of-experts model when the
# checkpoint's name has a part like "A3B" (:func:`_class_from_config` decides from the config).
QWEN3_CLASSES = "lmms_eval.models.simple.qwen3_vl"

# Every model type vlm_focus supports, with lmms-eval 0.7.3's HF class or why there is none.
# The llava chat class and the simple qwen2_vl class answer one request per generate() call.
DELEGATES: dict[str, Delegate] = {
    "llava": Delegate("lmms_eval.models.chat.llava_hf.LlavaHf", max_batch=1),
    "llava_next": Delegate("lmms_eval.models.chat.llava_hf.LlavaHf", max_batch=1),
    "llava_onevision": Delegate("lmms_eval.models.chat.llava_hf.LlavaHf", max_batch=1),
    "qwen2_vl": Delegate("lmms_eval.models.simple.qwen2_vl.Qwen2_VL", chat=False, max_batch=1),
    "qwen2_5_vl": Delegate("lmms_eval.models.chat.qwen2_5_vl.Qwen2_5_VL"),
    "qwen3_vl": Delegate("lmms_eval.models.chat.qwen3_vl.Qwen3_VL", class_by_name=QWEN3_CLASSES),
    # its processor output (token_type_ids included) goes straight to generate()
    "gemma3": Delegate("lmms_eval.models.simple.gemma3.Gemma3", chat=False, max_batch=1),
    # its chat-template output (mm_token_type_ids and image_position_ids included) goes
    # straight to generate(), a batch of requests at a time
    "gemma4": Delegate("lmms_eval.models.simple.gemma4.Gemma4", chat=False),
    "qwen3_vl_moe": Delegate(
        "lmms_eval.models.chat.qwen3_vl.Qwen3_VL", class_by_name=QWEN3_CLASSES
    ),
    "internvl": Delegate("lmms_eval.models.chat.internvl_hf.InternVLHf", max_batch=1),
    # the Qwen3-VL chat class with Qwen3.5's defaults; it batches like Qwen3-VL's
    "qwen3_5": Delegate("lmms_eval.models.chat.qwen3_5.Qwen3_5", class_by_name=QWEN3_CLASSES),
    "qwen3_5_moe": Delegate("lmms_eval.models.chat.qwen3_5.Qwen3_5", class_by_name=QWEN3_CLASSES),
}


@dataclass
class FocusTokenCounts(TokenCounts):
    """lmms-eval's per-request token counts plus what pruning did to the request."""

    visual_kept: int | None = None
    visual_total: int | None = None
    prefill_s: float | None = None
    setting: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = super().to_dict()
        for key in ("visual_kept", "visual_total", "prefill_s"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.setting is not None:
            out["vlm_focus"] = self.setting
        return out


@dataclass
class _Row:
    """One request of the current generate() call: its index and its chat messages."""

    index: int
    messages: Any = None


class VlmFocus(lmms):
    """lmms-eval model ``vlm_focus``; see the module docstring. ``pretrained`` is a path, a hub
    id, or ``embedded`` (the organism model shipped with vlm_focus)."""

    is_simple = False

    def __init__(self, pretrained: str = "embedded", **kwargs: Any) -> None:
        super().__init__()
        from transformers import AutoConfig

        path = resolve_model_path(pretrained)
        trust = bool(kwargs.get("trust_remote_code", False))
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        model_type = getattr(config, "model_type", None)
        spec = _delegate(model_type, pretrained)
        module_name, class_name = spec.class_path.rsplit(".", 1)
        delegate_cls = getattr(importlib.import_module(module_name), class_name)
        accepted = _init_parameters(delegate_cls)
        self.focus, rest = split_model_args(kwargs, other=accepted)
        _check_layers(self.focus, getattr(config.get_text_config(), "num_hidden_layers", None))
        batch = _batch_size(rest.get("batch_size"))
        if spec.max_batch is not None and batch is not None and batch > spec.max_batch:
            raise ValueError(
                f"batch_size={batch}: lmms-eval's {class_name} for {model_type} runs "
                f"{spec.max_batch} request per batch"
            )
        if not torch.cuda.is_available():
            if "device" in accepted:
                rest.setdefault("device", "cpu")
                if rest["device"] is None:
                    rest["device"] = "cpu"
            if "device_map" in accepted:
                rest.setdefault("device_map", rest.get("device", "cpu"))
        self.spec = spec
        self.model_type = model_type
        with _class_from_config(spec, model_type):
            self.delegate = delegate_cls(pretrained=path, **rest)
        _read_declared_tokenizer(self.delegate, path)
        self.run_setting = self.focus.setting()
        self.setting = self.run_setting.tag
        self._rows: list[_Row] = []
        self._current: list[_Row] = []
        self._facts: dict[int, dict[str, Any]] = {}
        self._prefill: dict[str, Any] | None = None
        model = self.delegate.model
        self._sync = torch.cuda.synchronize if _device_of(model).type == "cuda" else _no_sync
        self.guide = self.run_setting.load_guide(str(_device_of(model)))
        # the pruning stays attached until remove(); the mitigation runs per generate_until
        self._wrapped = contextlib.ExitStack()
        self.handle = self._wrapped.enter_context(
            self.run_setting.wrapped(model, guide=self.guide, guide_rows=self._guide_rows)
        )
        with self._mitigation():  # checks the options against the model (its layer count)
            pass
        self._hooks = [
            model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]
        logger.info(f"vlm_focus on {class_name} ({model_type}): {self.focus.describe()}")

    # --- the harness's interface ------------------------------------------------------------
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        self._facts, self._rows = {}, []
        proxies = [self._proxy(i, req) for i, req in enumerate(requests)]
        with self._mitigation():
            outputs = self.delegate.generate_until(proxies)
        results = []
        for i, output in enumerate(outputs):
            text, counts = _unwrap(output)
            fact = self._facts.get(i, {})
            results.append(
                GenerationResult(
                    text=text,
                    token_counts=FocusTokenCounts(
                        input_tokens=_first(getattr(counts, "input_tokens", None), fact, "input"),
                        output_tokens=getattr(counts, "output_tokens", None),
                        reasoning_tokens=getattr(counts, "reasoning_tokens", None),
                        visual_kept=fact.get("kept"),
                        visual_total=fact.get("total"),
                        prefill_s=fact.get("prefill_s"),
                        setting=self.setting,
                    ),
                )
            )
        self._log_summary()
        return results

    def generate_until_multi_round(self, requests: list[Instance]) -> list[Any]:
        with self._mitigation():
            return self.delegate.generate_until_multi_round(requests)

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        with self._mitigation():
            return self.delegate.loglikelihood(requests)

    def set_cache_hook(self, cache_hook: Any) -> None:
        self.cache_hook = cache_hook
        self.delegate.set_cache_hook(cache_hook)

    def clean(self) -> None:
        self.remove()
        self.guide = None
        self.delegate.clean()

    def remove(self) -> None:
        """Take vlm_focus's hooks off the model (the model is then exactly lmms-eval's)."""
        for hook in self.__dict__.get("_hooks", []):
            hook.remove()
        self._hooks = []
        if self.__dict__.get("_wrapped") is not None:
            self._wrapped.close()  # removes the pruning handle

    @property
    def task_dict(self) -> dict:
        return self.delegate.task_dict

    @task_dict.setter
    def task_dict(self, value: dict) -> None:
        if "delegate" in self.__dict__:  # lmms.__init__ sets it before the delegate exists
            self.delegate.task_dict = value

    @property
    def rank(self) -> int:
        return self.delegate.rank

    @property
    def world_size(self) -> int:
        return self.delegate.world_size

    def __getattr__(self, name: str) -> Any:
        delegate = self.__dict__.get("delegate")
        if delegate is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(delegate, name)

    # --- per-request records ---------------------------------------------------------------
    def _proxy(self, index: int, request: Instance) -> Instance:
        """The request as the delegate takes it, with its media callable noting the row order
        in which the delegate builds each batch."""
        ctx, to_messages, gen_kwargs, doc_id, task, split = request.args
        if self.spec.chat:
            noted = self._noting(index, to_messages)
            new = (ctx, noted, gen_kwargs, doc_id, task, split)
        else:  # a simple class takes (context, gen_kwargs, doc_to_visual, doc_id, task, split)
            noted = self._noting(index, to_messages, visuals=True)
            new = (ctx, gen_kwargs, noted, doc_id, task, split)
        return dataclasses.replace(request, arguments=new)

    def _noting(self, index: int, to_messages: Any, *, visuals: bool = False) -> Any:
        def call(doc: Any, *args: Any, **kwargs: Any) -> Any:
            messages = to_messages(doc, *args, **kwargs)
            self._rows.append(_Row(index, messages))
            return _media(messages) if visuals else messages

        return call

    def _before(self, module: Any, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not self._rows or input_ids is None:
            return None  # a decode step, or a call the harness did not announce
        batch = input_ids.shape[0]
        rows = self._rows[-batch:] if len(self._rows) >= batch else list(self._rows)
        self._rows = []
        beams = batch // len(rows) if batch % len(rows) == 0 else 1
        adapter = get_adapter(module)
        visual = adapter.visual_mask(module, input_ids)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape == visual.shape:
            visual = visual & mask.bool()
            lengths = mask.sum(1)
        else:
            lengths = torch.full((batch,), input_ids.shape[1])
        self._current = rows
        self._sync()
        self._prefill = {
            "rows": rows,
            "beams": beams,
            "total": visual.sum(1).tolist(),
            "lengths": lengths.tolist(),
            "trace": self.handle.last_trace if self.handle is not None else None,
            "start": time.perf_counter(),
        }
        return None

    def _after(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        state, self._prefill = self._prefill, None
        if state is None:
            return None
        self._sync()
        seconds = time.perf_counter() - state["start"]
        rows, beams = state["rows"], state["beams"]
        trace = self.handle.last_trace if self.handle is not None else None
        pruned = trace is not None and trace is not state["trace"]
        for r, row in enumerate(rows):
            b = r * beams
            total = int(state["total"][b])
            self._facts[row.index] = {
                "kept": int(trace.n_kept[b]) if pruned else total,
                "total": total,
                "input": int(state["lengths"][b]),
                "prefill_s": seconds / len(rows),
            }
        return None

    def _guide_rows(self) -> tuple[list, list[str]]:
        """The images and instruction texts of the batch being prefilled, from which the
        setting builds the guide model's inputs."""
        images, prompts = [], []
        for row in self._current:
            media, text = _media(row.messages), _text(row.messages)
            if len(media) != 1:
                raise ValueError(
                    f"pruner 'guided' here takes one image per request, got {len(media)}"
                )
            images.append(media[0])
            prompts.append(text)
        return images, prompts

    def _mitigation(self) -> Any:
        """The setting's mitigation (its defaults, the model arguments overriding), or none."""
        return self.run_setting.mitigated(self.delegate.model)

    def _log_summary(self) -> None:
        facts = [f for f in self._facts.values() if f.get("total")]
        if not facts:
            return
        n = len(facts)
        log_metrics(
            total_elapsed_time=0.0,  # the delegate logs its own generation time and tokens
            total_gen_tokens=0,
            avg_speed=0.0,
            additional_metrics={
                "vlm_focus_kept_ratio": sum(f["kept"] / f["total"] for f in facts) / n,
                "vlm_focus_visual_kept": sum(f["kept"] for f in facts) / n,
                "vlm_focus_visual_total": sum(f["total"] for f in facts) / n,
                "vlm_focus_prefill_s": sum(f["prefill_s"] for f in facts) / n,
            },
        )


def _delegate(model_type: str | None, pretrained: str) -> Delegate:
    """The delegate of ``model_type``; ``ValueError`` saying first why there is none."""
    runs = ", ".join(sorted(t for t, d in DELEGATES.items() if d.class_path is not None))
    spec = DELEGATES.get(model_type)
    if spec is None:
        raise ValueError(
            f"--model vlm_focus does not run model_type {model_type!r} (pretrained="
            f"{pretrained!r}); it runs: {runs}"
        )
    if spec.class_path is None:
        raise ValueError(
            f"--model vlm_focus does not run model_type {model_type!r} (pretrained="
            f"{pretrained!r}): {spec.left_out}. It runs: {runs}"
        )
    return spec


@contextlib.contextmanager
def _class_from_config(spec: Delegate, model_type: str):
    """While the delegate loads, its HF class is the mixture-of-experts one exactly when the
    config's ``model_type`` says so, whatever the checkpoint's name (a local folder, a renamed
    copy)."""
    if spec.class_by_name is None:
        yield
        return
    module = importlib.import_module(spec.class_by_name)
    by_name = module._resolve_model_class
    is_moe = model_type.endswith("_moe")
    module._resolve_model_class = lambda pretrained, _guess: by_name(pretrained, is_moe)
    try:
        yield
    finally:
        module._resolve_model_class = by_name


def _read_declared_tokenizer(delegate: Any, path: str) -> None:
    """Give the delegate the tokenizer its folder declares where transformers would build
    another (:func:`vlm_focus.loading.declared_tokenizer`: organism-qwen35's word tokenizer)."""
    tokenizer = declared_tokenizer(path)
    if tokenizer is None:
        return
    processor = getattr(delegate, "processor", None)
    if processor is not None and hasattr(processor, "tokenizer"):
        processor.tokenizer = tokenizer
    if hasattr(delegate, "_tokenizer"):
        delegate._tokenizer = tokenizer


def _init_parameters(cls: type) -> list[str]:
    """Keyword arguments a delegate's constructor names (its ``**kwargs`` must stay empty).
    A constructor that passes ``**kwargs`` on to its parent's (lmms-eval's Qwen3.5 class over
    Qwen3-VL's) takes the parent's names too."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is lmms:
            continue
        forwards = False
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif p.name != "self" and p.kind is not p.VAR_POSITIONAL and p.name not in names:
                names.append(p.name)
        if not forwards:
            break
    return names


def _check_layers(focus: FocusArgs, n_layers: int | None) -> None:
    """Pruning and mitigation layers inside the decoder's ``[0, n_layers)``, from the config."""
    if n_layers is None:
        return
    config = focus.config()
    stages = [("layer", layer) for layer, _ in config.stages] if config is not None else []
    stages += [("mitigate_layers", layer) for layer in focus.mitigate_options.get("layers", [])]
    for name, layer in stages:
        if layer >= n_layers:
            raise ValueError(
                f"{name}: layer {layer} is out of range; this model has layers [0, {n_layers})"
            )


def _batch_size(value: Any) -> int | None:
    """The harness's ``batch_size`` as an int (``None`` for ``auto`` and the like)."""
    try:
        return int(value) if value is not None else 1
    except (TypeError, ValueError):
        return None


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _no_sync() -> None:
    return None


def _unwrap(output: Any) -> tuple[Any, TokenCounts | None]:
    if isinstance(output, GenerationResult):
        return output.text, output.token_counts
    return output, None


def _first(value: Any, fact: dict, key: str) -> Any:
    return value if value is not None else fact.get(key)


def _media(messages: Any) -> list:
    """The images of chat messages (lmms-eval's ``{"type": "image", "url": ...}`` items)."""
    out = []
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        for item in content if isinstance(content, list) else []:
            if isinstance(item, dict) and item.get("type") == "image":
                out.append(item.get("url", item.get("image")))
    return out


def _text(messages: Any) -> str:
    parts = []
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        for item in content if isinstance(content, list) else []:
            if isinstance(item, dict) and item.get("type") == "text":
                parts.append(item["text"])
    return "\n".join(parts)


__all__ = ["DELEGATES", "Delegate", "FocusArgs", "FocusTokenCounts", "VlmFocus"]
