"""InternVL (``internvl``): tiled images, several images per prompt and videos, through the real
``InternVLProcessor`` built offline (``tiny_processors.py``).

The layout against the processor (one layout per ``<img>`` block, a view per tile plus the
thumbnail) and against the model's own pixel shuffle (which patches each token reads); a pruned
run equals the unpruned model with the pruned visual keys masked out (``reference.py``), prefill
and 6 cached decode steps, SDPA and eager, K = 0 and K = 2, every pruner, a multi-stage
pyramid, left-padded batches of 2 whose images have different tile counts; ``remove()``;
``positions="compact"``; the static cache, compiled decode steps, no host reads per decode step;
the tile arithmetic against the processor's; a map and a box on a non-square image in its
pixels; ``vlm-focus run`` and ``bench`` and lmms-eval's InternVL chat class on a saved
checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import host_reads
import pytest
import torch
from host_reads import on_device, per_forward
from reference import (
    ATOL,
    assert_pruned_equals_masked,
    fixation_reference,
    greedy_generate,
    masked_reference,
)
from test_compact_positions import _pruned_prompt
from test_static_cache import compiled
from tiny_processors import (
    IMG_END,
    IMG_START,
    INTERNVL_MAX_TILES,
    noise_image,
    noise_video,
    ramp_image,
    tiny_processor,
)
from torch._dynamo.utils import counters

import vlm_focus as vf
from vlm_focus import geometry as geo
from vlm_focus import grounding as G
from vlm_focus.geometry import Size
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.internvl import tile_side
from vlm_focus.model_adapters.tiny import IMAGE, tiny_model

STEPS = 6
#: (width, height) of the pictures: with up to 6 tiles, 3x1 tiles; 1x2; 3x2; one tile; 2x1
WIDE, TALL, BROAD, SQUARE, LOW = Size(100, 40), Size(40, 90), Size(45, 30), Size(30, 30), (70, 30)


def _processor_inputs(processor, rows: list[list]) -> dict:
    """A left-padded batch: each row's pictures (PIL images; arrays are videos) then its text."""
    texts, images, videos = [], [], []
    for row in rows:
        text = ""
        for item in row:
            if isinstance(item, str):
                text += item
            elif hasattr(item, "ndim"):
                text += "<video>\n"
                videos.append(item)
            else:
                text += "<IMG_CONTEXT>\n"
                images.append(item)
        texts.append(text)
    out = processor(
        text=texts,
        images=images or None,
        videos=videos or None,
        padding=True,
        return_tensors="pt",
    )
    return dict(out)


def make_internvl_case(case: str, model, processor=None) -> dict:
    """The processor's inputs of one case (``images``, ``two_images``, ``video``): a
    left-padded batch of 2; made once per case (they depend on the config, not the weights)."""
    if case not in _CASES:
        _CASES[case] = _make_case(case, processor or tiny_processor(model))
    return dict(_CASES[case])


_CASES: dict[str, dict] = {}


def _make_case(case: str, processor) -> dict:
    if case == "images":  # rows of different tile counts: 3 tiles + thumbnail; 2 + thumbnail
        rows = [
            [noise_image(*WIDE, seed=0), "describe the image"],
            [noise_image(*TALL, seed=1), "what is in this image ?"],
        ]
    elif case == "two_images":
        rows = [
            [noise_image(*SQUARE, seed=2), noise_image(*LOW, seed=3), "compare these two"],
            [noise_image(*BROAD, seed=4), "describe the image"],
        ]
    elif case == "video":
        rows = [
            [noise_video(3, 40, 30, seed=5), "describe the video"],
            [noise_video(3, 50, 50, seed=6), "what is in this video ?"],
        ]
    else:
        raise ValueError(f"no case {case!r}")
    inputs = _processor_inputs(processor, rows)
    assert (inputs["attention_mask"][:, 0] == 0).any()  # left padding
    return inputs


@pytest.fixture(scope="module")
def processor():
    return tiny_processor(tiny_model("internvl"))


# --- the layout ----------------------------------------------------------------------------
def _tiles(processor, size: Size) -> int:
    """Views the processor gives a ``size`` image: its tiles plus the thumbnail, or one."""
    settings = {"crop_to_patches": True}
    return processor.image_processor.get_number_of_image_patches(size.height, size.width, settings)


def test_one_layout_per_img_block_with_the_processors_tile_count(processor):
    model = tiny_model("internvl")
    inputs = make_internvl_case("two_images", model, processor)
    layouts = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    side = tile_side(model)
    assert side * side == model.config.image_seq_length == 16
    expected = [[SQUARE, Size(*LOW)], [BROAD]]
    ids = inputs["input_ids"]
    for b, (row, sizes) in enumerate(zip(layouts, expected, strict=True)):
        assert [len(layout.grids) for layout in row] == [_tiles(processor, s) for s in sizes]
        for layout in row:
            assert layout.grids == [(side, side)] * len(layout.grids)
            first, last = int(layout.positions[0]), int(layout.positions[-1])
            assert ids[b, first - 1] == IMG_START and ids[b, last + 1] == IMG_END
            assert torch.equal(layout.positions, torch.arange(first, last + 1))
        visual = torch.cat([layout.positions for layout in row])
        assert torch.equal(visual, torch.nonzero(ids[b] == IMAGE).flatten())
    assert sum(len(layout.grids) for row in layouts for layout in row) == len(
        inputs["pixel_values"]
    )


def test_a_video_is_one_single_view_layout_per_frame(processor):
    model = tiny_model("internvl")
    inputs = make_internvl_case("video", model, processor)
    layouts = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    assert [[len(layout.grids) for layout in row] for row in layouts] == [[1, 1, 1]] * 2
    assert inputs["pixel_values"].shape[0] == 6  # the frames, merged into pixel_values


def test_cells_follow_the_models_pixel_shuffle():
    """Each token reads the 2x2 tower patches under its cell: the tower's output is replaced by
    each patch's (row, col), and the projector's input shows which patches every token holds."""
    model = tiny_model("internvl")
    vision = model.config.vision_config
    patches = vision.image_size[0] // vision.patch_size[0]  # 8 per side
    seen = {}

    def tower(module, args, kwargs, output):
        hidden = output.last_hidden_state  # [tiles, 1 + patches^2, C]
        r, c = torch.meshgrid(torch.arange(patches), torch.arange(patches), indexing="ij")
        fake = torch.zeros_like(hidden)
        fake[:, 1:, 0] = r.flatten().float()
        fake[:, 1:, 1] = c.flatten().float()
        output.last_hidden_state = fake
        return output

    def projector(module, args):
        seen["features"] = args[0]  # [tiles, tokens, 4 * C]

    handles = [
        model.model.vision_tower.register_forward_hook(tower, with_kwargs=True),
        model.model.multi_modal_projector.register_forward_pre_hook(projector),
    ]
    try:
        with torch.no_grad():
            model.model.get_image_features(pixel_values=torch.randn(2, 3, 32, 32))
    finally:
        for handle in handles:
            handle.remove()
    features = seen["features"]
    width = vision.hidden_size
    groups = features.reshape(*features.shape[:2], -1, width)[..., :2]  # [tiles, n, 4, (r, c)]
    layout = get_adapter(model).layout(
        model, torch.tensor([[5] + [IMAGE] * 32 + [6]]), {"pixel_values": None}
    )[0][0]
    side = tile_side(model)
    for token, (view, row, col) in enumerate(layout.cells.tolist()):
        read = groups[view, token % (side * side)].long()
        assert set(read[:, 0].tolist()) == {2 * row, 2 * row + 1}
        assert set(read[:, 1].tolist()) == {2 * col, 2 * col + 1}


def test_a_block_that_is_not_whole_tiles_is_refused():
    model = tiny_model("internvl")
    ids = torch.tensor([[5, IMG_START] + [IMAGE] * 20 + [IMG_END, 6]])
    with pytest.raises(ValueError, match="not a whole number of tiles of 16 tokens"):
        get_adapter(model).layout(model, ids, {})


# --- pruning equals the masked reference ----------------------------------------------------
def _single_stage():
    """fastv under SDPA and eager, before the first layer and after two; the other scoring
    pruners under SDPA at both layers; the baselines that ignore the scores at one layer."""
    for attn in ("sdpa", "eager"):
        for layer in (0, 2):
            yield "fastv", layer, attn
    for pruner in ("random", "debiased", "diverse"):
        for layer in (0, 2):
            yield pruner, layer, "sdpa"
    for pruner in ("pool", "text", "temporal"):
        yield pruner, 2, "sdpa"


@pytest.mark.parametrize("pruner,layer,attn", list(_single_stage()))
def test_tiled_images_prune_as_the_masked_reference(pruner, layer, attn, processor):
    model = tiny_model("internvl", attn=attn)
    inputs = make_internvl_case("images", model, processor)
    trace = assert_pruned_equals_masked(model, inputs, STEPS, pruner=pruner, keep=0.5, layer=layer)
    assert [s.layer for s in trace.stages] == [layer]
    assert trace.n_visual == [64, 48]  # (3 tiles + thumbnail) and (2 + thumbnail) x 16


@pytest.mark.parametrize(
    "pruner,attn", [("pyramid", "sdpa"), ("pyramid", "eager"), ("debiased", "sdpa")]
)
def test_a_multi_stage_schedule_matches_the_reference(pruner, attn, processor):
    model = tiny_model("internvl", attn=attn)
    inputs = make_internvl_case("images", model, processor)
    wrap = dict(pruner=pruner, layer=(0, 1, 3), keep=(0.75, 0.5, 0.25))
    trace = assert_pruned_equals_masked(model, inputs, STEPS, **wrap)
    assert [s.layer for s in trace.stages] == [0, 1, 3]


@pytest.mark.parametrize(
    "pruner,layer,attn",
    [("fastv", 0, "sdpa"), ("fastv", 2, "eager"), ("pyramid", 2, "sdpa"), ("random", 0, "eager")],
)
@pytest.mark.parametrize("case", ["two_images", "video"])
def test_two_images_and_videos_prune_as_the_masked_reference(pruner, case, layer, attn, processor):
    model = tiny_model("internvl", attn=attn)
    inputs = make_internvl_case(case, model, processor)
    assert_pruned_equals_masked(model, inputs, STEPS, pruner=pruner, keep=0.5, layer=layer)


def test_a_frame_budget_keeps_the_same_share_of_every_frame(processor):
    model = tiny_model("internvl")
    inputs = make_internvl_case("video", model, processor)
    trace = assert_pruned_equals_masked(
        model, inputs, STEPS, pruner="fastv", keep=0.5, layer=2, budget="frame"
    )
    layouts = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    for b, row in enumerate(layouts):
        kept = [int(torch.isin(frame.positions, trace.kept[b]).sum()) for frame in row]
        assert kept == [8, 8, 8]  # 16 tokens per frame, keep 0.5


def test_guided_pruning_before_the_llm_matches_the_reference(processor):
    guide = tiny_model("internvl", seed=3)
    model = tiny_model("internvl")
    inputs = make_internvl_case("images", model, processor)
    options = dict(guide=guide, guide_inputs=make_internvl_case("images", guide, processor))
    assert_pruned_equals_masked(model, inputs, STEPS, pruner="guided", keep=0.5, layer=0, **options)


def test_fixation_equals_its_reference(processor):
    model = tiny_model("internvl")
    inputs = make_internvl_case("images", model, processor)
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad(), vf.wrap(model, pruner="fixation", keep=0.25, layer=1) as handle:
        sequences, logits = greedy_generate(model, inputs, STEPS)
        trace = handle.last_trace
    assert len(trace.fixations) == STEPS - 1
    with torch.no_grad(), fixation_reference(model, layers, 1, trace):
        ref_sequences, ref_logits = greedy_generate(model, inputs, STEPS)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def test_remove_restores_logits_exactly(processor):
    model = tiny_model("internvl")
    inputs = make_internvl_case("two_images", model, processor)
    with torch.no_grad():
        before = model(**inputs).logits
        handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=2)
        pruned = model(**inputs).logits
        handle.remove()
        after = model(**inputs).logits
    assert pruned.shape[1] < before.shape[1]
    assert torch.equal(before, after)


# --- compact positions, the static cache, compiled decode steps, the hot path ---------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compact_positions_equal_the_unwrapped_model_on_the_pruned_prompt(attn, processor):
    model = tiny_model("internvl", attn=attn)
    inputs = make_internvl_case("images", model, processor)
    prompt = inputs["input_ids"].shape[1]
    with (
        torch.no_grad(),
        vf.wrap(model, pruner="fastv", keep=0.5, layer=0, positions="compact") as h,
    ):
        logits = model(**inputs).logits
        kept = h.last_trace.sequence
        sequences, step_logits = greedy_generate(model, inputs, STEPS)
    with torch.no_grad():
        pruned = _pruned_prompt(model, inputs, kept)
        ref_logits = model(**pruned).logits
        ref_sequences, ref_step_logits = greedy_generate(model, pruned, STEPS)
    assert kept.shape[1] < prompt
    valid = pruned["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=ATOL, rtol=0)
    assert torch.equal(sequences[:, prompt:], ref_sequences[:, -STEPS:])
    torch.testing.assert_close(step_logits, ref_step_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("layer", [0, 2])
def test_static_cache_equals_the_masked_reference(layer, backend, processor):
    model = tiny_model("internvl")
    inputs = make_internvl_case("images", model, processor)
    layers = get_adapter(model).decoder_layers(model)
    static = {"cache_implementation": "static"}
    if backend is not None:
        static.update(compiled(backend))
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer) as handle:
        sequences, logits = greedy_generate(model, inputs, STEPS, **static)
        trace = handle.last_trace
    if backend is not None:  # each hooked frame and the forward compiled once, for every step
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    with torch.no_grad(), masked_reference(model, layers, trace):
        ref_sequences, ref_logits = greedy_generate(model, inputs, STEPS)  # dynamic cache
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("pruner", ["fastv", "pyramid", "debiased"])
def test_no_host_reads_per_decode_step(pruner, processor):
    model = tiny_model("internvl")
    inputs = on_device(make_internvl_case("images", model, processor))
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=0.5, layer=2):
        with per_forward(model) as marks:
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert marks[1:] == [marks[1]] * (len(marks) - 1), f"{marks} {dict(host_reads.reads)}"


# --- geometry and grounding -----------------------------------------------------------------
def test_tile_grid_is_the_processors_and_a_wrong_size_is_caught(processor):
    model = tiny_model("internvl")
    image_processor = processor.image_processor
    adapter = get_adapter(model)
    for size in (WIDE, TALL, BROAD, SQUARE, Size(*LOW), Size(200, 20), Size(20, 200)):
        inputs = _processor_inputs(processor, [[ramp_image(*size), "describe"]])
        ((layout,),) = adapter.layout(model, inputs["input_ids"], inputs)
        rows, cols = geo.tile_grid(size, image_processor)
        views = len(layout.grids)
        assert views == _tiles(processor, size) == (1 if rows * cols == 1 else rows * cols + 1)
        assert rows * cols <= INTERNVL_MAX_TILES
        if views > 1:  # without the processor, the token count picks the same canvas
            assert geo.tile_grid(size, tiles=views - 1) == (rows, cols)
            assert adapter.frames(layout, size) == adapter.frames(layout, size, processor=processor)
        geo.check_size(layout, size, image_processor=image_processor, processor_rule="tiled")
    inputs = _processor_inputs(processor, [[ramp_image(*WIDE), "describe"]])
    ((layout,),) = adapter.layout(model, inputs["input_ids"], inputs)
    with pytest.raises(ValueError, match=r"cuts it into 1x1 tiles, but the image has 3"):
        adapter.frames(layout, SQUARE, processor=processor)


def test_tile_frames_squash_the_image_onto_the_canvas():
    frames = geo.tile_frames(Size(90, 40), (1, 3), 4)
    assert [f.xywh for f in frames] == [
        [0.0, 0.0, 30.0, 40.0],
        [30.0, 0.0, 30.0, 40.0],
        [60.0, 0.0, 30.0, 40.0],
        [0.0, 0.0, 90.0, 40.0],  # the thumbnail
    ]
    with pytest.raises(ValueError, match="gives 3 tiles plus a thumbnail, but the image has 3"):
        geo.tile_frames(Size(90, 40), (1, 3), 3)


def _plant(monkeypatch, targets: list[int]):
    """Every query row puts all its attention on key ``targets[b]``."""
    import vlm_focus.core.layer_view as layer_view_module

    def fake(q, k, scaling, allowed):
        probs = torch.zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        for b, target in enumerate(targets):
            probs[b, :, :, target] = 1.0
        return probs

    monkeypatch.setattr(layer_view_module, "attention_probs", fake)


@pytest.mark.parametrize("with_processor", [True, False])
def test_a_planted_peak_lands_in_its_tiles_pixels_map_point_and_box(
    monkeypatch, processor, with_processor
):
    """On a 100x40 image cut into 3x1 tiles, a peak on cell (1, 2) of the last tile lands in
    the pixels of that cell: the tile spans x in [200 / 3, 100), its cell (1, 2) x in
    [250 / 3, 275 / 3) and y in [10, 20)."""
    model = tiny_model("internvl")
    inputs = _processor_inputs(processor, [[ramp_image(*WIDE), "describe the image"]])
    ((layout,),) = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    assert len(layout.grids) == 4  # 3 tiles + thumbnail
    idx = int(torch.nonzero((layout.cells == torch.tensor([2, 1, 2])).all(1)).flatten()[0])
    _plant(monkeypatch, [int(layout.positions[idx])])
    options = dict(processor=processor) if with_processor else {}
    heat = G.heatmap(model, inputs, images=[ramp_image(*WIDE)], **options)[0][0]
    assert heat.size == WIDE and heat.mass == pytest.approx(1.0, abs=1e-5)
    assert heat.frames[2] == geo.Frame(200 / 3, 0.0, 100 / 3, 40.0)
    x_lo, y_lo, x_hi, y_hi = heat.frames[2].cells((4, 4))[1, 2].tolist()
    assert (y_lo, y_hi) == (10.0, 20.0)
    y, x = divmod(int(heat.pixels.argmax()), WIDE.width)
    assert x_lo <= x + 0.5 <= x_hi and y_lo <= y + 0.5 <= y_hi
    px, py = G.point(heat, sigma=0)
    assert x_lo <= px <= x_hi and y_lo <= py <= y_hi
    (box,) = G.boxes(heat, threshold=0.5, sigma=0)
    assert G.iou(box, [x_lo, y_lo, x_hi - x_lo, y_hi - y_lo]) >= 0.5
    assert float(heat.pixels.sum()) == pytest.approx(1.0, abs=1e-2)  # a density of mass 1


# --- the command line and lmms-eval on a saved checkpoint -----------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny InternVL saved with its real processor, and a wide picture beside it."""
    path = tmp_path_factory.mktemp("internvl")
    model = tiny_model("internvl")
    model.save_pretrained(path / "model")
    tiny_processor(model).save_pretrained(path / "model")
    noise_image(*WIDE, seed=1).save(path / "image.png")
    return path


def test_run_and_bench_on_a_saved_checkpoint(checkpoint, capsys):
    from vlm_focus import cli

    argv = ["--model", str(checkpoint / "model"), "--image", str(checkpoint / "image.png")]
    run = ["run", *argv, "--keep", "0.5", "--repeats", "1", "--max-new-tokens", "2", "--json"]
    assert cli.main(run) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "internvl" and report["pruned"]
    assert (report["visual_kept"], report["visual_total"]) == (32, 64)  # 3 tiles + thumbnail
    assert cli.main(["bench", *argv, "--keeps", "1.0,0.5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept   64/64" in out and "kept   32/64" in out


@pytest.mark.slow
def test_lmms_eval_runs_the_internvl_chat_class_pruned(checkpoint, tmp_path):
    from vlm_focus.integrations import lmms_eval_tasks_path

    task = "vf_pope_organism_adversarial"
    env = dict(
        os.environ,
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    args = f"pretrained={checkpoint / 'model'},pruner=fastv,keep=0.5,layer=2"
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vlm_focus", "--model_args", args]
    cmd += ["--tasks", task, "--include_path", lmms_eval_tasks_path(), "--limit", "2"]
    cmd += ["--batch_size", "1", "--output_path", str(tmp_path / "out"), "--log_samples"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob(f"*_samples_{task}.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    counts = [row["token_counts"][0] for row in rows]
    assert len(counts) == 2
    assert all(2 * c["visual_kept"] == c["visual_total"] > 0 for c in counts)
