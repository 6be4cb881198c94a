"""The transformers side of the vLLM plugin tests; runs in the MAIN environment (the
transformers vlm_focus supports), called by the tests in the vLLM environment as a script:

    python tests/vllm_serving/transformers_side.py build DIR [FAMILY]  # tiny model + processor
    python tests/vllm_serving/transformers_side.py run DIR CASES.json OUT.json
    python tests/vllm_serving/transformers_side.py run-inputs DIR CASES.pt OUT.json

``build`` saves a random-weight Qwen2.5-VL, or ``FAMILY`` (one of ``BUILDERS``), (text hidden
128, head_dim 32: the smallest head vLLM's CPU attention takes) with ``save_pretrained``, a
word-level tokenizer with Qwen's special tokens and a chat template, the image processor's
config, and ``image.png`` (48 x 64 px, so the merged grid is 8 rows x 6 columns and the
processor does not resize it).

``run`` reads cases ``[{"prompt": str, "pruner": str | null, "keep": float}]`` (optionally
``"images"``: file names, one per placeholder of the prompt, default ``["image.png"]``, and
``"budget"``, default ``"frame"``) and writes, per case, the greedy continuation of
``vf.wrap(model, pruner, keep, layer=0, budget=budget, video_pruner=None)`` (the plugin runs one
pruner for images and videos; ``alpha=0`` for ``pyramid``; unwrapped
for ``pruner: null``) with each step's gap between its two best logits, and the kept cells of
each image (indices into its merged grid, raster order).

``run-inputs`` reads cases ``[{"inputs": {...}, "pruner": str | null, "keep", "budget"}]`` whose
inputs another environment's processor made (a video's: its pixels and the unpruned prompt ids)
and writes, per case, the greedy continuation with its logit gaps and the kept tokens (indices
into the prompt's visual tokens, in prompt order).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

SPECIAL = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<|image_pad|>": 120,
    "<|video_pad|>": 121,
    "<|vision_start|>": 122,
    "<|vision_end|>": 123,
}
WORDS = (
    "user assistant system describe the picture what is in image where are shapes colour "
    "red green blue yellow square circle triangle left right top bottom small large a an of "
    "and there any how many count objects answer yes no one two three four"
).split()
VOCAB = 128
MAX_NEW_TOKENS = 12
IMAGE_SIZE = (48, 64)  # (width, height) in pixels: patches 12 x 16, merged grid 6 x 8
#: Images saved by ``build``, (width, height) in pixels, none resized by the processor: merged
#: grids of 8 x 6, 4 x 4 and 6 x 10 cells.
IMAGES = {"image.png": IMAGE_SIZE, "square.png": (32, 32), "wide.png": (80, 48)}
#: The video processor's pixel budget: a video's frames together (Qwen3-VL counts them all), so
#: that the test videos are not resized.
VIDEO_PIXELS = 128 * 128
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] in ['image', 'image_url'] %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def word_tokenizer(special: dict[str, int], **roles: str):
    """A word-level tokenizer over ``WORDS`` (and fillers up to ``VOCAB`` ids) with the
    ``special`` tokens at their ids; ``roles`` names the pad/bos/eos tokens among them, and the
    others are additional special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(special)
    free = [i for i in range(VOCAB) if i not in special.values()]
    filler = [f"w{i}" for i in range(len(free) - len(WORDS) - 1)]
    for token_id, word in zip(free, [*WORDS, *filler, "<unk>"], strict=True):
        vocab[word] = token_id
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        additional_special_tokens=[t for t in special if t not in roles.values()],
        **roles,
    )


def build(path: Path, family: str = "qwen2_5_vl", seed: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    fast = word_tokenizer(SPECIAL, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    model = BUILDERS[family](seed)
    model.save_pretrained(path)
    if family == "qwen3_vl_moe":
        _released_expert_layout(path)
    pixels = {"min_pixels": 16, "max_pixels": 64 * 64}
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": PROCESSORS[family],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]},
        **pixels,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    kind = "Qwen2VLVideoProcessor" if family.startswith("qwen2") else "Qwen3VLVideoProcessor"
    video = dict(processor, video_processor_type=kind, max_pixels=VIDEO_PIXELS)
    video["size"] = {"shortest_edge": pixels["min_pixels"], "longest_edge": VIDEO_PIXELS}
    video.pop("image_processor_type")
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, (width, height) in IMAGES.items():
        array = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        Image.fromarray(array).save(path / name)


def _released_expert_layout(path: Path) -> None:
    """Store Qwen3-VL-MoE's fused expert weights as the released checkpoints do (``gate_up_proj``
    ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``): vLLM loads only that layout, transformers
    loads both (it transposes on load) and saves its own (``[E, 2I, H]``, ``[E, H, I]``)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in tensors:
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


#: What vLLM's CPU backend needs on top of the tiny configs
#: (:mod:`vlm_focus.model_adapters.tiny`): text hidden 128 with head_dim 32, the smallest head
#: its attention takes, over 2 layers, and untied embeddings.
VLLM_TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def text_config(**extra) -> dict:
    """The tiny Llama text config (:mod:`vlm_focus.model_adapters.tiny`) at vLLM's sizes."""
    from vlm_focus.model_adapters.tiny import tiny_config

    text = tiny_config("llava").text_config.to_dict()
    return {
        **{k: text[k] for k in ("vocab_size", "num_attention_heads", "num_key_value_heads")},
        "pad_token_id": 0,
        "eos_token_id": 2,
        **VLLM_TEXT,
        **extra,
    }


def qwen2_vl_model(seed: int = 0):
    """The tiny Qwen2-VL at vLLM's sizes (M-RoPE sections of its 16 rotary frequencies; the
    tower's merger projects to the text width, its ``hidden_size``)."""
    from vlm_focus.model_adapters.tiny import tiny_model

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    return tiny_model(
        "qwen2_vl",
        seed=seed,
        text=dict(VLLM_TEXT, rope_parameters=rope),
        vision=dict(hidden_size=VLLM_TEXT["hidden_size"]),
        tie_word_embeddings=False,
    )


def qwen2_5_vl_model(seed: int = 0):
    """The tiny Qwen2.5-VL at vLLM's sizes (M-RoPE sections of its 16 rotary frequencies)."""
    from vlm_focus.model_adapters.tiny import tiny_model

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    return tiny_model(
        "qwen2_5_vl",
        seed=seed,
        text=dict(VLLM_TEXT, rope_parameters=rope),
        vision=dict(out_hidden_size=VLLM_TEXT["hidden_size"]),
        tie_word_embeddings=False,
    )


def qwen3_vl_model(seed: int = 0):
    """The tiny Qwen3-VL at vLLM's sizes: interleaved M-RoPE, per-head q/k norms, DeepStack
    after layers 0 and 1 (the vision tower's two layers, patch 4 as the processor cuts)."""
    return _qwen3_vl("qwen3_vl", seed)


def qwen3_vl_moe_model(seed: int = 0):
    """:func:`qwen3_vl_model` with a mixture-of-experts MLP in every layer (4 experts, 2 per
    token). transformers always renormalises the top experts' weights and has dropped
    ``norm_topk_prob`` from this config; vLLM 0.32's MoE block still reads it (and fails
    without it), so the saved config sets it to ``true``, which is what transformers does."""
    # 2 x 32 != 128: no expert matrix is square, so its layout on disk is unambiguous
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return _qwen3_vl("qwen3_vl_moe", seed, norm_topk_prob=True, **moe)


def _qwen3_vl(model_type: str, seed: int, **extra):
    from vlm_focus.model_adapters.tiny import tiny_model

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    return tiny_model(
        model_type,
        seed=seed,
        text=dict(VLLM_TEXT, head_dim=32, rope_parameters=rope, **extra),
        vision=dict(
            depth=2,
            patch_size=4,
            out_hidden_size=VLLM_TEXT["hidden_size"],
            deepstack_visual_indexes=[0, 1],
        ),
        tie_word_embeddings=False,
    )


def qwen3_5_model(seed: int = 0):
    """The tiny Qwen3.5 at vLLM's sizes: Gated DeltaNet layers 0, 2 and 3 around full-attention
    layer 1 (gated queries, q/k norms, RoPE over half the head dim, interleaved M-RoPE), the
    Qwen3-VL tower without DeepStack. Layer 0 is linear, so attention pruners score with
    layer 1 (the adapter's ``"next_full"`` rule)."""
    return _qwen3_5("qwen3_5", seed)


def qwen3_5_moe_model(seed: int = 0):
    """:func:`qwen3_5_model` with a mixture-of-experts MLP in every layer (4 experts, 2 per
    token, and the shared expert)."""
    moe = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )
    return _qwen3_5("qwen3_5_moe", seed, **moe)


def _qwen3_5(model_type: str, seed: int, **extra):
    from vlm_focus.model_adapters.tiny import tiny_model

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    }
    text = dict(
        VLLM_TEXT,
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        rope_parameters=rope,
        **extra,
    )
    return tiny_model(
        model_type,
        seed=seed,
        text=text,
        vision=dict(depth=2, patch_size=4, out_hidden_size=VLLM_TEXT["hidden_size"]),
        tie_word_embeddings=False,
    )


#: ``build``'s families: the tiny model of each.
BUILDERS = {
    "qwen2_vl": qwen2_vl_model,
    "qwen2_5_vl": qwen2_5_vl_model,
    "qwen3_vl": qwen3_vl_model,
    "qwen3_vl_moe": qwen3_vl_moe_model,
    "qwen3_5": qwen3_5_model,
    "qwen3_5_moe": qwen3_5_moe_model,
}
#: The processor class ``build`` names for each family (the Qwen3 ones share Qwen3-VL's).
PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    **{
        family: "Qwen3VLProcessor"
        for family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
    },
}


def prompt_text(question: str, images: int = 1) -> str:
    """The prompt the chat template makes for ``images`` images and ``question``."""
    return (
        "<|im_start|>user "
        + "<|vision_start|><|image_pad|><|vision_end|>" * images
        + f"{question}<|im_end|><|im_start|>assistant "
    )


def greedy(model, inputs: dict) -> tuple[list[int], list[float]]:
    """The greedy continuation of one prompt and, per step, the gap between its two highest
    logits (how far the step is from a tie, for a reference in another precision)."""
    out = model.generate(
        **inputs,
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values  # [steps, 2]
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, (top2[:, 0] - top2[:, 1]).tolist()


def run(path: Path, cases: list[dict]) -> list[dict]:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessor

    import vlm_focus as vf

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly MAX_NEW_TOKENS, as vLLM's ignore_eos
    model.generation_config.pad_token_id = 0
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = Qwen2VLImageProcessor.from_pretrained(path)
    image_id = model.config.image_token_id
    out = []
    for case in cases:
        names = case.get("images", ["image.png"])
        images = [Image.open(path / name).convert("RGB") for name in names]
        visual = processor(images=images, return_tensors="pt")
        grid = visual["image_grid_thw"]
        cells = (grid.prod(-1) // 4).tolist()  # merged cells per image
        ids = tokenizer(case["prompt"], add_special_tokens=False)["input_ids"]
        expanded, starts = [], []
        for token in ids:
            if token == image_id:
                starts.append(len(expanded))
                expanded += [image_id] * cells[len(starts) - 1]
            else:
                expanded.append(token)
        if len(starts) != len(images):
            raise ValueError(f"{len(starts)} image placeholders for {len(images)} images")
        input_ids = torch.tensor([expanded])
        inputs = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == image_id).long(),
            pixel_values=visual["pixel_values"],
            image_grid_thw=grid,
        )
        with torch.no_grad():
            if case["pruner"] is None:
                tokens, margins = greedy(model, inputs)
                kept_positions = torch.nonzero(input_ids[0] == image_id).flatten()
            else:
                options = {"alpha": 0.0} if case["pruner"] == "pyramid" else {}
                with vf.wrap(
                    model,
                    pruner=case["pruner"],
                    keep=case["keep"],
                    layer=0,
                    budget=case.get("budget", "frame"),
                    video_pruner=None,
                    **options,
                ) as handle:
                    tokens, margins = greedy(model, inputs)
                    kept_positions = handle.last_trace.kept[0]
        kept = [
            [p - start for p in kept_positions.tolist() if start <= p < start + n]
            for start, n in zip(starts, cells, strict=True)
        ]
        out.append(
            dict(
                case,
                tokens=tokens,
                margins=margins,
                kept=kept[0],
                n=cells[0],
                kept_per_image=kept,
                n_per_image=cells,
            )
        )
    return out


def run_inputs(path: Path, cases: list[dict]) -> list[dict]:
    from transformers import AutoModelForImageTextToText

    import vlm_focus as vf

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly MAX_NEW_TOKENS, as vLLM's ignore_eos
    model.generation_config.pad_token_id = 0
    config = model.config
    out = []
    for case in cases:
        inputs = dict(case["inputs"])
        ids = inputs["input_ids"]
        image, video = ids == config.image_token_id, ids == config.video_token_id
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["mm_token_type_ids"] = image.long() + 2 * video.long()
        visual = torch.nonzero(image[0] | video[0]).flatten().tolist()
        with torch.no_grad():
            if case["pruner"] is None:
                tokens, margins = greedy(model, inputs)
                kept = visual
            else:
                # the plugin's one pruner for images and videos (ServeOptions.video_pruner)
                wrap = dict(pruner=case["pruner"], keep=case["keep"], layer=0, video_pruner=None)
                with vf.wrap(model, **wrap, budget=case["budget"]) as handle:
                    tokens, margins = greedy(model, inputs)
                    kept = handle.last_trace.kept[0].tolist()
        out.append(
            {
                "tokens": tokens,
                "margins": margins,
                "kept": [visual.index(p) for p in kept],
                "n": len(visual),
            }
        )
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["build"] and len(argv) in (2, 3):
        build(Path(argv[1]), *argv[2:])
    elif argv[:1] == ["run-inputs"] and len(argv) == 4:
        cases = torch.load(argv[2], weights_only=False)
        Path(argv[3]).write_text(json.dumps(run_inputs(Path(argv[1]), cases)))
    elif argv[:1] == ["run"] and len(argv) == 4:
        cases = json.loads(Path(argv[2]).read_text())
        Path(argv[3]).write_text(json.dumps(run(Path(argv[1]), cases)))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
