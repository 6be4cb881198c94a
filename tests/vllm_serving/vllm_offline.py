"""One offline vLLM engine on the tiny model, in its own process (an engine per process):

    python tests/vllm_serving/vllm_offline.py MODEL_DIR CASES.json OUT.json \
        [HF_OVERRIDES_JSON [ENGINE_KWARGS_JSON]]

Each case is ``{"prompt" or "prompt_token_ids", "request": {mm_processor_kwargs} | null}``,
with ``"image"`` (a path; default MODEL_DIR/image.png) or ``"images"`` (paths, one per
placeholder); all cases go to one ``LLM.generate`` call (one batch), on an engine that takes as
many images per prompt as the largest case has. Writes the greedy tokens and prompt token ids
per case, the kept sets the pruning model recorded (if any), and whether the plugin module was
loaded before this script imported anything of vlm_focus (it imports only ``recorded_kept``,
after the run): vLLM finds the plugin through its entry point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_NEW_TOKENS = 12


def main(
    model_dir: str,
    cases_path: str,
    out_path: str,
    overrides: str | None = None,
    engine: str | None = None,
) -> None:
    from PIL import Image
    from vllm import LLM, SamplingParams

    cases = json.loads(Path(cases_path).read_text())
    settings = dict(
        model=model_dir,
        dtype="float32",
        hf_overrides=json.loads(overrides) if overrides else None,
        max_model_len=512,
        max_num_seqs=16,
        limit_mm_per_prompt={"image": max(len(c.get("images", [0])) for c in cases)},
        enforce_eager=True,
        seed=0,
    )
    llm = LLM(**{**settings, **json.loads(engine or "{}")})
    requests = []
    for case in cases:
        paths = case.get("images") or [case.get("image") or Path(model_dir) / "image.png"]
        images = [Image.open(p).convert("RGB") for p in paths]
        prompt = {k: case[k] for k in ("prompt", "prompt_token_ids") if k in case}
        request = {
            **prompt,
            "multi_modal_data": {"image": images if "images" in case else images[0]},
        }
        if case.get("request"):
            request["mm_processor_kwargs"] = case["request"]
        requests.append(request)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(requests, params, use_tqdm=False)
    plugin_loaded = "vlm_focus.integrations.vllm" in sys.modules  # by vLLM, not by this script
    from vlm_focus.integrations.vllm import recorded_kept  # by reference, for the worker

    per_rank = llm.apply_model(recorded_kept)  # one list per worker
    result = {
        "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "prompt_token_ids": list(o.prompt_token_ids)}
            for o in outputs
        ],
        "kept": per_rank[0],
        "kept_per_rank": per_rank,
        "plugin_loaded": plugin_loaded,
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
