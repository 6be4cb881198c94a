"""The transformers side of the vLLM LLaVA tests on the embedded default model; runs in the
MAIN environment, called by the tests in the vLLM environment as a script:

    python tests/vllm_serving/transformers_llava.py CASES.json OUT.json

Each case is ``{"image": path, "question": str, "pruner": str | null, "keep": float,
"positions": "original" | "compact" (default "original")}``; per case it writes the chat prompt
(text), its token ids with the image as one placeholder (what vLLM expands), the greedy
continuation of ``vf.wrap(model, pruner, keep, layer=0, positions=positions)`` (unwrapped for
``pruner: null``) and the kept cells (raster order of the 12 x 12 grid).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

MAX_NEW_TOKENS = 12


def run(cases: list[dict]) -> list[dict]:
    import vlm_focus as vf
    from vlm_focus.loading import build_inputs, load_image, load_model

    model, processor = load_model("embedded", dtype=torch.float32)
    model.generation_config.eos_token_id = None  # exactly MAX_NEW_TOKENS, as vLLM's ignore_eos
    image_id = model.config.image_token_index
    out = []
    for case in cases:
        inputs = build_inputs(processor, load_image(case["image"]), case["question"])
        ids = inputs["input_ids"][0].tolist()
        at = ids.index(image_id)
        n_cells = ids.count(image_id)
        text = processor.tokenizer.decode(ids[:at] + [image_id] + ids[at + n_cells :])
        generate = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        with torch.no_grad():
            if case["pruner"] is None:
                tokens = model.generate(**inputs, **generate)
                kept = list(range(n_cells))
            else:
                with vf.wrap(
                    model,
                    pruner=case["pruner"],
                    keep=case["keep"],
                    layer=0,
                    positions=case.get("positions", "original"),
                ) as handle:
                    tokens = model.generate(**inputs, **generate)
                    kept = (handle.last_trace.kept[0] - at).tolist()
        kept_ids = ids[:at] + [image_id] * len(kept) + ids[at + n_cells :]
        out.append(
            dict(
                case,
                prompt=text,
                prompt_ids=ids[:at] + [image_id] + ids[at + n_cells :],
                pruned_ids=kept_ids,
                tokens=tokens[0, len(ids) :].tolist(),
                kept=kept,
                n=n_cells,
            )
        )
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(cases)))
