"""Gradio demo: ask a question about an image (or a short video), see the answer, the attention
maps with boxes and region scores (one map per frame of a video), which visual tokens pruning
kept, and the prefill speed-up.

    vlm-focus demo                      # embedded model on http://127.0.0.1:7860
    vlm-focus demo --model PATH_OR_ID --port 8000

The request function (:func:`run_request`) needs no gradio; the app (``vlm_focus.demo.app``) does.
"""

from .inputs import MITIGATIONS
from .request import run_request
from .result import DemoResult, FrameMap, GroundedMap

__all__ = ["MITIGATIONS", "DemoResult", "FrameMap", "GroundedMap", "run_request"]
