"""What ``vlm-focus run`` reports for a pruner that picks visual tokens per decode step
(fixation): what the prompt keeps and what each decode step reads, from the trace."""

from __future__ import annotations

import json

import torch
from PIL import Image

import vlm_focus as vf
from vlm_focus import cli
from vlm_focus.asset_paths import sample_scene_paths
from vlm_focus.loading import build_inputs, load_model

RUN = ["run", "--pruner", "fixation", "--keep", "0.25", "--max-new-tokens", "4", "--repeats", "1"]


def test_the_trace_counts_what_each_decode_step_reads():
    model, processor = load_model()  # the embedded organism: 144 visual tokens
    image = Image.open(sample_scene_paths()[0])
    inputs = build_inputs(processor, [image, image], ["Describe the image.", "Is it red?"])
    with torch.inference_mode(), vf.wrap(model, pruner="fixation", keep=0.25, layer=2) as h:
        model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        assert h.last_trace.n_fixated == [36, 36] and h.last_trace.n_kept == [144, 144]
    with vf.wrap(model, pruner="fastv", keep=0.25, layer=2) as h:
        model.generate(**inputs, max_new_tokens=2)
    assert h.last_trace.n_fixated == []


def test_run_says_what_the_decode_steps_read_under_fixation(capsys):
    assert cli.main(RUN) == 0
    out = capsys.readouterr().out
    assert "visual tokens kept 144/144 by the prompt; each of " in out
    assert " decode steps reads 36/144" in out
    assert "nothing pruned" not in out and "prefill unpruned, nothing to time there" in out
    assert cli.main([*RUN, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["visual_kept"], report["visual_per_decode_step"]) == (144, 36)
