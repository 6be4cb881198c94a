"""The transformers side of the vLLM LLaVA-NeXT tests; runs in the MAIN environment:

    python tests/vllm_serving/transformers_next.py build DIR [llava_onevision]
    python tests/vllm_serving/transformers_next.py run DIR INPUTS.pt OUT.json

``build`` saves a random-weight LLaVA-NeXT, or LLaVA-OneVision (CLIP 32 px / patch 8, so a 4 x 4
base grid; anyres pinpoints 32x64, 64x32, 64x64; Llama text, Qwen2 for OneVision, with head_dim 32,
the smallest vLLM's CPU attention takes), a word-level tokenizer, the processor's configs and two
images (64 x 32 px, and 50 x 38 px, whose unpadded grid is cut). ``run`` reads the processor
outputs the vLLM environment's own processor made (``INPUTS.pt``: ``[{"inputs": {...}, "pruner",
"keep", "positions" (default "original")}]``; the same pixels vLLM sees) and writes, per case,
the greedy continuation of ``vf.wrap(model, pruner, keep, layer=0, positions=positions)`` and
the kept tokens (indices into the image's tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers_side import text_config, word_tokenizer

IMAGE_TOKEN, VIDEO_TOKEN = 120, 121
MAX_NEW_TOKENS = 12  # as vllm_offline.py
IMAGES = {"wide.png": (64, 32), "odd.png": (50, 38)}  # (width, height) in pixels
PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def build(path: Path, family: str = "llava_next", seed: int = 0) -> None:
    from PIL import Image
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
    )

    onevision = family == "llava_onevision"
    path.mkdir(parents=True, exist_ok=True)
    special = {"<pad>": 0, "<s>": 1, "</s>": 2, "<image>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN}
    roles = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    word_tokenizer(special, **roles).save_pretrained(path)
    torch.manual_seed(seed)
    config_class = LlavaOnevisionConfig if onevision else LlavaNextConfig
    extra = dict(video_token_index=VIDEO_TOKEN, vision_aspect_ratio="anyres_max_9")
    config = config_class(
        vision_config=dict(
            model_type="clip_vision_model",
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            projection_dim=32,
        ),
        text_config=text_config(
            model_type="qwen2" if onevision else "llama", head_dim=32, bos_token_id=1
        ),
        image_token_index=IMAGE_TOKEN,
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        **(extra if onevision else {}),
    )
    model_class = (
        LlavaOnevisionForConditionalGeneration if onevision else LlavaNextForConditionalGeneration
    )
    model_class(config).eval().save_pretrained(path)
    kind = "LlavaOnevision" if onevision else "LlavaNext"
    image_processor = {
        "image_processor_type": f"{kind}ImageProcessor",
        "size": {"shortest_edge": 32},
        "crop_size": {"height": 32, "width": 32},
        "image_grid_pinpoints": PINPOINTS,
        "do_resize": True,
        "do_center_crop": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_pad": True,
        "do_convert_rgb": True,
        "resample": 3,
    }
    processor = {
        "processor_class": f"{kind}Processor",
        "image_token": "<image>",
        "vision_feature_select_strategy": "default",
    }
    if onevision:
        processor.update(
            video_token="<video>", num_image_tokens=16, vision_aspect_ratio="anyres_max_9"
        )
        video = dict(image_processor, video_processor_type="LlavaOnevisionVideoProcessor")
        video.pop("image_processor_type")
        (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    else:
        processor.update(patch_size=8, num_additional_image_tokens=1)
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    preprocessor = dict(image_processor, processor_class=f"{kind}Processor")
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    rng = np.random.default_rng(seed)
    for name, (width, height) in IMAGES.items():
        array = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        Image.fromarray(array).save(path / name)


def run(path: Path, cases: list[dict]) -> list[dict]:
    from transformers import AutoModelForImageTextToText

    import vlm_focus as vf

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly MAX_NEW_TOKENS, as vLLM's ignore_eos
    if model.config.model_type == "llava_onevision":
        from vlm_focus.model_adapters.llava_onevision import image_cells

        def tokens_of(size):
            return image_cells(model, size)[0].shape[0]
    else:
        from vlm_focus.model_adapters.llava_next import image_cells

        def tokens_of(size):
            return image_cells(model, size, anyres=True)[0].shape[0]

    out = []
    for case in cases:
        # One image per prompt. Its placeholder run is as long as the model's own features (the
        # vLLM environment's older processor may count one fewer for OneVision).
        inputs = {k: v for k, v in case["inputs"].items() if k != "batch_num_images"}
        ids = inputs["input_ids"][0].tolist()
        start = ids.index(IMAGE_TOKEN)
        n = tokens_of(inputs["image_sizes"][0].tolist())
        ids = ids[:start] + [IMAGE_TOKEN] * n + ids[start + ids.count(IMAGE_TOKEN) :]
        inputs["input_ids"] = torch.tensor([ids])
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        with (
            torch.no_grad(),
            vf.wrap(
                model,
                pruner=case["pruner"],
                keep=case["keep"],
                layer=0,
                positions=case.get("positions", "original"),
            ) as handle,
        ):
            tokens = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            kept = (handle.last_trace.kept[0] - start).tolist()
        out.append({"tokens": tokens[0, len(ids) :].tolist(), "kept": kept, "n": n})
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"] and len(sys.argv) in (3, 4):
        build(Path(sys.argv[2]), *sys.argv[3:])
    elif sys.argv[1:2] == ["run"] and len(sys.argv) == 5:
        result = run(Path(sys.argv[2]), torch.load(sys.argv[3]))
        Path(sys.argv[4]).write_text(json.dumps(result))
    else:
        raise SystemExit(__doc__)
