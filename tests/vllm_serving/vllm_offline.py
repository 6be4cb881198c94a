"""One offline vLLM engine on the tiny model, in its own process (an engine per process):

    python tests/vllm_serving/vllm_offline.py MODEL_DIR CASES.json OUT.json \
        [HF_OVERRIDES_JSON [ENGINE_KWARGS_JSON]]

Each case is ``{"prompt" or "prompt_token_ids", "request": {mm_processor_kwargs} | null}``, with
``"image"`` (a path; default MODEL_DIR/image.png), ``"images"`` (paths, one per placeholder) or
``"video"`` (a ``.npy`` of ``[frames, height, width, 3]`` uint8 frames taken at ``VIDEO_FPS``);
all cases go to one ``LLM.generate`` call (one batch), on an engine that takes as many images
per prompt as the largest case has. A case with ``"expect_error": true`` runs alone afterwards,
and its error message is written instead of its tokens. Writes the greedy tokens, their logprobs
and the prompt token ids per case, the kept sets the pruning model recorded (if any), and
whether the plugin module was loaded before this script imported anything of vlm_focus (it
imports only ``recorded_kept``, after the run): vLLM finds the plugin through its entry point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_NEW_TOKENS = 12
VIDEO_FPS = 2.0


def video_item(path: str):
    """``(frames, metadata)`` of a ``.npy`` video, every frame kept, as vLLM takes a video."""
    import numpy as np

    frames = np.load(path)
    metadata = {
        "fps": VIDEO_FPS,
        "duration": len(frames) / VIDEO_FPS,
        "total_num_frames": len(frames),
        "frames_indices": list(range(len(frames))),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }
    return frames, metadata


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
        limit_mm_per_prompt={
            "image": max(len(c.get("images", [0])) for c in cases),
            **({"video": 1} if any("video" in c for c in cases) else {}),
        },
        enforce_eager=True,
        seed=0,
    )
    llm = LLM(**{**settings, **json.loads(engine or "{}")})
    requests = []
    for case in cases:
        prompt = {k: case[k] for k in ("prompt", "prompt_token_ids") if k in case}
        if "video" in case:
            data = {"video": video_item(case["video"])}
        else:
            paths = case.get("images") or [case.get("image") or Path(model_dir) / "image.png"]
            images = [Image.open(p).convert("RGB") for p in paths]
            data = {"image": images if "images" in case else images[0]}
        request = {**prompt, "multi_modal_data": data}
        if case.get("request"):
            request["mm_processor_kwargs"] = case["request"]
        requests.append(request)
    # logprobs=0: each step's chosen token's logprob
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    good = [r for r, c in zip(requests, cases, strict=True) if not c.get("expect_error")]
    outputs = iter(llm.generate(good, params, use_tqdm=False))
    results = []
    for request, case in zip(requests, cases, strict=True):
        if not case.get("expect_error"):
            o = next(outputs)
            results.append(
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "prompt_token_ids": list(o.prompt_token_ids),
                    "logprobs": [
                        step[token].logprob
                        for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)
                    ],
                }
            )
            continue
        try:
            llm.generate([request], params, use_tqdm=False)
            results.append({"error": None})
        except Exception as err:  # the message the user would see
            results.append({"error": str(err)})
    plugin_loaded = "vlm_focus.integrations.vllm" in sys.modules  # by vLLM, not by this script
    from vlm_focus.integrations.vllm import recorded_kept  # by reference, for the worker

    per_rank = llm.apply_model(recorded_kept)  # one list per worker
    result = {
        "outputs": results,
        "kept": per_rank[0],
        "kept_per_rank": per_rank,
        "plugin_loaded": plugin_loaded,
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
