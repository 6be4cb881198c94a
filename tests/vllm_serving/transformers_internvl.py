"""The transformers side of the vLLM InternVL test; runs in the MAIN environment:

    python tests/vllm_serving/transformers_internvl.py build DIR
    python tests/vllm_serving/transformers_internvl.py run DIR INPUTS.pt OUT.json

``build`` saves a random-weight InternVL (vlm_focus's tiny config: InternViT of 32 px tiles and
4 px patches, pixel-shuffled to a 4 x 4 grid, 16 tokens per tile; a Qwen2 decoder at
``transformers_side.VLLM_TEXT``'s sizes, head_dim 32, the smallest vLLM's CPU attention takes),
a word-level tokenizer with InternVL's ``<img>``, ``</img>`` and ``<IMG_CONTEXT>``, the
processor (up to 6 tiles plus a thumbnail) and three images: 64 x 32 px (2 tiles + thumbnail),
50 x 38 px (3 x 2 tiles + thumbnail) and 32 x 32 px (one tile, no thumbnail). ``run`` reads the
processor outputs the vLLM environment's own processor made (``INPUTS.pt``: ``[{"inputs": {...},
"pruner", "keep", "positions" (default "original")}]``, the pixels vLLM sees) and writes, per
case, the greedy continuation (tokens and their logprobs) of ``vf.wrap(model, pruner, keep,
layer=0, budget="frame", positions=positions)`` (``alpha=0`` for ``pyramid``), the kept tokens
(indices into the prompt's image tokens, in prompt order), each image's token count and the
pruned prompt's ids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers_side import VLLM_TEXT, word_tokenizer

MAX_NEW_TOKENS = 12  # as vllm_offline.py
IMAGES = {"wide.png": (64, 32), "odd.png": (50, 38), "square.png": (32, 32)}  # (width, height)
MAX_TILES = 6


def build(path: Path, seed: int = 0) -> None:
    import transformers
    from PIL import Image

    from vlm_focus.model_adapters.tiny import BOS, EOS, IMAGE, PAD, VIDEO, tiny_model

    path.mkdir(parents=True, exist_ok=True)
    model = tiny_model("internvl", seed=seed, text=VLLM_TEXT, tie_word_embeddings=False)
    model.save_pretrained(path)
    special = {
        "<pad>": PAD,
        "<s>": BOS,
        "</s>": EOS,
        "<IMG_CONTEXT>": IMAGE,
        "<video>": VIDEO,
        "<img>": 126,
        "</img>": 127,
    }
    words = word_tokenizer(special, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    # the processor reads its markers from the tokenizer's named special tokens
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )
    pixels = model.config.vision_config.image_size[0]
    square = {"height": pixels, "width": pixels}
    transformers.InternVLProcessor(
        image_processor=transformers.GotOcr2ImageProcessor(
            size=square, crop_to_patches=True, min_patches=1, max_patches=MAX_TILES
        ),
        video_processor=transformers.InternVLVideoProcessor(size=square),
        tokenizer=tokenizer,
        image_seq_length=model.config.image_seq_length,
    ).save_pretrained(path)
    rng = np.random.default_rng(seed)
    for name, (width, height) in IMAGES.items():
        array = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        Image.fromarray(array).save(path / name)


def run(path: Path, cases: list[dict]) -> list[dict]:
    from transformers import AutoModelForImageTextToText

    import vlm_focus as vf
    from vlm_focus.model_adapters.base import runs

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly MAX_NEW_TOKENS, as vLLM's ignore_eos
    image = model.config.image_token_id
    out = []
    for case in cases:
        inputs = case["inputs"]
        ids = inputs["input_ids"][0]
        where = torch.nonzero(ids == image).flatten()
        wrap = dict(pruner=case["pruner"], keep=case["keep"], layer=0, budget="frame")
        wrap["positions"] = case.get("positions", "original")
        if case["pruner"] == "pyramid":  # the plugin's before-LLM pyramid: alpha=0
            wrap["alpha"] = 0.0
        with torch.no_grad(), vf.wrap(model, **wrap) as handle:
            generated = model.generate(
                **inputs,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            kept_at = handle.last_trace.kept[0]
        tokens = generated.sequences[0, len(ids) :]
        logits = torch.stack(generated.logits)[:, 0].float()  # [steps, vocab]
        logprobs = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        dropped = ids == image
        dropped[kept_at] = False
        out.append(
            {
                "tokens": tokens.tolist(),
                "logprobs": logprobs.tolist(),
                "kept": torch.searchsorted(where, kept_at).tolist(),
                "n": len(where),
                "sizes": [len(run) for run in runs(where)],  # image tokens per image
                "pruned_ids": ids[~dropped].tolist(),
            }
        )
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"] and len(sys.argv) == 3:
        build(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["run"] and len(sys.argv) == 5:
        result = run(Path(sys.argv[2]), torch.load(sys.argv[3]))
        Path(sys.argv[4]).write_text(json.dumps(result))
    else:
        raise SystemExit(__doc__)
