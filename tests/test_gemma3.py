"""Gemma 3 (``gemma3``): bidirectional image blocks, sliding-window layers with their own RoPE,
q/k norms and ``query_pre_attn_scalar`` scaling, against the masked reference.

The tiny model alternates sliding-window (window 8) and full layers, so every prompt here is
longer than the window and every decode step reads a sliding cache that dropped keys."""

from __future__ import annotations

import host_reads
import pytest
import torch
from host_reads import on_device, per_forward
from reference import ATOL, assert_pruned_equals_masked, greedy_generate, masked_reference
from tiny_processors import ramp_image, tiny_processor

import vlm_focus as vf
from vlm_focus.core.attention import allowed_keys, image_blocks
from vlm_focus.core.probe import AttentionProbe
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.tiny import BOS, IMAGE, IMAGE_END, IMAGE_START, PAD, tiny_model

TOKENS = 16  # the tiny model's pooled 4x4 grid


def gemma_model(attn: str = "sdpa", **text) -> torch.nn.Module:
    return tiny_model("gemma3", attn=attn, text=text or None)


def gemma_inputs(batch: int = 2, images: int = 2, seed: int = 0) -> dict:
    """A left-padded batch: row b has text, ``images`` image blocks with text between them,
    then ``4 + b`` instruction tokens; ``token_type_ids`` mark the image tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        row = [BOS] + torch.randint(3, 100, (3,), generator=gen).tolist()
        for _ in range(images):
            row += [IMAGE_START] + [IMAGE] * TOKENS + [IMAGE_END]
            row += torch.randint(3, 100, (2,), generator=gen).tolist()
        rows.append(row + torch.randint(3, 100, (4 + b,), generator=gen).tolist())
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(batch * images, 3, 32, 32, generator=gen),
    }


def test_layout_one_grid_per_block():
    model = gemma_model()
    inputs = gemma_inputs()
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    for b, images in enumerate(layout):
        assert len(images) == 2
        visual = torch.nonzero(inputs["input_ids"][b] == IMAGE).flatten()
        assert torch.equal(torch.cat([i.positions for i in images]), visual)
        assert all(i.grids == [(4, 4)] for i in images)
        assert torch.equal(images[1].cells[5], torch.tensor([0, 1, 1]))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize(
    "pruner,options",
    [
        ("fastv", {}),
        ("random", {}),
        ("debiased", {}),
        ("diverse", {}),
        ("pyramid", {}),
        ("pool", {}),
        ("text", {}),
    ],
)
def test_pruned_equals_masked_reference(pruner, options, layer, attn):
    """Every pruner, one stage (pyramid: two, at K and K + 1), at K = 0 (layer 0 is a
    sliding one) and K = 2: prefill logits, 6 cached greedy steps and their logits."""
    model = gemma_model(attn)
    wrap = dict(pruner=pruner, keep=0.5, layer=layer, **options)
    if pruner == "pyramid":
        wrap.update(layer=(layer, layer + 1), keep=(0.5, 0.25))
    trace = assert_pruned_equals_masked(model, gemma_inputs(), steps=6, **wrap)
    assert len(trace.stages) == (2 if pruner == "pyramid" else 1)


def _eager_attentions(model, inputs) -> tuple[torch.Tensor, ...]:
    """The unwrapped model's own attention probabilities per layer, ``[B, H, S, S]``, from
    eager attention with the model's own masks."""
    with torch.no_grad():
        return model(**inputs, output_attentions=True).attentions


def test_stage_scores_equal_the_models_attention_with_its_window():
    """fastv's scores at a sliding layer are the instruction rows' head-mean attention that
    the model itself computes (eager, its own mask): keys beyond the window score 0. With a
    window of 12 the instruction sees part of the second image and none of the first."""
    model = gemma_model("eager", sliding_window=12)
    inputs = gemma_inputs()
    attentions = _eager_attentions(model, inputs)
    layer = 2  # a sliding-window layer
    wrap = dict(pruner="fastv", keep=0.5, layer=layer, reduce="mean", query_rows="text")
    with torch.no_grad(), vf.wrap(model, **wrap) as handle:
        model(**inputs)
        stage = handle.last_trace.stages[0]
    visual = inputs["input_ids"] == IMAGE
    for b in range(2):
        text = torch.nonzero(visual[b]).max() < torch.arange(visual.shape[1])
        text &= inputs["attention_mask"][b].bool()
        expected = attentions[layer][b].mean(0)[text].mean(0)[visual[b]]  # [n_visual]
        torch.testing.assert_close(stage.scores[b], expected, atol=1e-6, rtol=0)
        assert (stage.scores[b] == 0).sum() >= TOKENS  # the first image: out of the window
        assert (stage.scores[b] > 0).any()


def test_probe_rows_of_image_tokens_see_their_block_both_ways():
    """Attention rows the probes compute for image-token queries equal the model's own (eager)
    rows at every layer: the block is bidirectional (an image token attends to later tokens of
    its block) and sliding layers cut at the window."""
    model = gemma_model("eager")
    inputs = gemma_inputs()
    attentions = _eager_attentions(model, inputs)
    rows = inputs["input_ids"] == IMAGE
    with torch.no_grad(), AttentionProbe(model, layers=None, rows=rows) as probe:
        model(**inputs)
    assert len(probe.records) == 4
    for record in probe.records:
        for b in range(2):
            positions = record.positions[b][record.mask[b]]
            expected = attentions[record.layer][b][:, positions]  # [H, Tq, S]
            got = record.probs[b][:, record.mask[b]]
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    first = torch.nonzero(rows[0]).min()
    ahead = attentions[1][0][:, first, first + 1 : first + TOKENS]
    assert (ahead > 0).all()  # bidirectional: the block's first token sees the rest


def test_allowed_keys_image_blocks_and_window_by_hand():
    """The rule by hand: positions 0..7, an image block at 2..4 and one at 6..7, window 3."""
    visual = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    blocks = image_blocks(visual)
    assert blocks.tolist() == [[-1, -1, 0, 0, 0, -1, 1, 1]]
    valid = torch.ones(1, 8, dtype=torch.bool)
    query = torch.tensor([[2, 5, 6]])
    rule = allowed_keys(valid, query, rule="image_blocks", blocks=(blocks.gather(1, query), blocks))
    assert rule[0].long().tolist() == [
        [1, 1, 1, 1, 1, 0, 0, 0],  # an image token sees its whole block
        [1, 1, 1, 1, 1, 1, 0, 0],  # text: causal
        [1, 1, 1, 1, 1, 1, 1, 1],  # the second block, and everything before it
    ]
    windowed = allowed_keys(
        valid, query, rule="image_blocks", window=3, blocks=(blocks.gather(1, query), blocks)
    )
    assert windowed[0].long().tolist() == [
        [1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]
    with pytest.raises(ValueError, match="needs blocks="):
        allowed_keys(valid, query, rule="image_blocks")


def test_remove_restores_logits_exactly():
    model = gemma_model()
    inputs = gemma_inputs()
    with torch.no_grad():
        before = model(**inputs).logits
        handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=1)
        pruned = model(**inputs).logits
        handle.remove()
        after = model(**inputs).logits
    assert pruned.shape[1] < before.shape[1]
    assert torch.equal(before, after)


@pytest.mark.parametrize("pruner,layer", [("fastv", 1), ("pyramid", 0), ("debiased", 1)])
def test_no_host_reads_per_decode_step(pruner, layer):
    model = gemma_model()
    inputs = on_device(gemma_inputs())
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=0.5, layer=layer):
        with per_forward(model) as marks:
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert marks[1:] == [marks[1]] * (len(marks) - 1), f"{marks} {dict(host_reads.reads)}"


def test_pruning_needs_token_type_ids():
    model = gemma_model()
    inputs = gemma_inputs()
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=2):
        without = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        with pytest.raises(ValueError, match="needs `token_type_ids`"):
            model(**without)


def test_one_image_and_a_long_decode_past_the_window():
    """One image per prompt, 12 decode steps: the sliding caches roll over more than once."""
    model = gemma_model()
    assert_pruned_equals_masked(
        model, gemma_inputs(images=1, seed=3), steps=12, pruner="fastv", keep=0.25, layer=1
    )


def test_probe_rows_of_a_pruned_run_equal_the_masked_reference():
    """Probes read the pruned layers' attention in original positions, prefill and decode,
    sliding caches included: each record equals the same probe on the masked reference."""
    model = gemma_model()
    inputs = gemma_inputs()
    layers = get_adapter(model).decoder_layers(model)
    probe = dict(layers=None, rows="text", decode=True)
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=1) as handle:
        with AttentionProbe(model, **probe) as pruned:
            greedy_generate(model, inputs, 4)
        trace = handle.last_trace
    with torch.no_grad(), masked_reference(model, layers, trace):
        with AttentionProbe(model, **probe) as reference:
            greedy_generate(model, inputs, 4)
    assert len(pruned.records) == len(reference.records) == 4 * 4
    for got, want in zip(pruned.records, reference.records, strict=True):
        assert (got.layer, got.step) == (want.layer, want.step)
        assert torch.equal(got.positions, want.positions)
        torch.testing.assert_close(got.probs, want.probs, atol=ATOL, rtol=0)


PAN_AND_SCAN = dict(
    do_pan_and_scan=True,
    pan_and_scan_min_crop_size=8,
    pan_and_scan_max_num_crops=4,
    pan_and_scan_min_ratio_to_activate=1.2,
)


def test_pan_and_scan_prompt_prunes_as_the_masked_reference():
    """The real processor with pan-and-scan: a wide image becomes itself plus 3 crops, each its
    own image block (so 4 bidirectional blocks); a square one stays whole. Batch 2, padded."""
    model = gemma_model()
    processor = tiny_processor(model)
    wide, square = ramp_image(60, 20), ramp_image(30, 30)
    inputs = processor(
        images=[[wide, square], [square]],
        text=["describe <start_of_image> and <start_of_image> ?", "what <start_of_image> is"],
        padding=True,
        return_tensors="pt",
        **PAN_AND_SCAN,
    )
    assert inputs["pixel_values"].shape[0] == 4 + 1 + 1  # wide + 3 crops, square, square
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    assert [len(row) for row in layout] == [5, 1]
    assert (inputs["token_type_ids"] == (inputs["input_ids"] == IMAGE)).all()
    for layer in (0, 2):
        assert_pruned_equals_masked(model, inputs, steps=6, pruner="fastv", keep=0.25, layer=layer)


def test_grounding_map_on_a_non_square_image_in_its_pixels():
    """Gemma 3's processor squashes the image to the square side: the map's one frame is the
    whole 60 x 20 image, its pixels are the image's, and the peak cell's pixels hold the peak."""
    from vlm_focus import grounding as G
    from vlm_focus.geometry import Frame

    model = gemma_model()
    processor = tiny_processor(model)
    image = ramp_image(60, 20)
    inputs = processor(
        images=[[image]], text=["describe <start_of_image> the image"], return_tensors="pt"
    )
    heat = G.heatmap(model, inputs, processor=processor, images=[image])[0][0]
    assert heat.frames == [Frame(0.0, 0.0, 60.0, 20.0)]
    assert heat.pixels.shape == (20, 60) and tuple(heat.grid.shape) == (4, 4)
    cell = divmod(int(heat.grid.argmax()), 4)
    x_lo, y_lo, x_hi, y_hi = heat.frames[0].cells((4, 4))[cell].tolist()
    assert (x_lo, x_hi) == (15.0 * cell[1], 15.0 * (cell[1] + 1))  # 60 / 4 wide cells
    y, x = divmod(int(heat.pixels.argmax()), 60)
    assert x_lo <= x + 0.5 <= x_hi and y_lo <= y + 0.5 <= y_hi


def test_pan_and_scan_frames_are_where_the_processor_cut_the_crops():
    """Each crop's pixels (the ramp's red and green encode the original x and y) decode to the
    centre of the frame :func:`pan_and_scan_frames` gives it; too small or square: no crops."""
    from vlm_focus.geometry import Frame, Size, pan_and_scan_frames

    processor = tiny_processor(gemma_model())
    part = processor.image_processor
    for size, n in ((Size(60, 20), 3), (Size(20, 50), 3), (Size(70, 20), 4)):
        frames = pan_and_scan_frames(size, part, **PAN_AND_SCAN)
        assert len(frames) == n
        pixels = part(ramp_image(*size), return_tensors="pt", **PAN_AND_SCAN)["pixel_values"]
        assert pixels.shape[0] == 1 + n  # the image, then its crops
        for frame, crop in zip(frames, pixels[1:], strict=True):
            colour = (crop[:2].mean((1, 2)) * 0.5 + 0.5) * 255  # back to the ramp's 0..255
            x, y = colour[0] / 255 * size.width, colour[1] / 255 * size.height
            assert abs(x - (frame.x0 + frame.width / 2)) < 0.6, (size, frame, x)
            assert abs(y - (frame.y0 + frame.height / 2)) < 0.6, (size, frame, y)
    assert pan_and_scan_frames(Size(60, 20), part) == []  # the processor's own default: off
    assert pan_and_scan_frames(Size(30, 30), part, **PAN_AND_SCAN) == []
    assert (
        pan_and_scan_frames(
            Size(60, 20), part, **{**PAN_AND_SCAN, "pan_and_scan_min_crop_size": 25}
        )
        == []
    )
    assert pan_and_scan_frames(Size(60, 20), part, **PAN_AND_SCAN)[2] == Frame(
        40.0, 0.0, 20.0, 20.0
    )


def test_cli_run_and_bench_on_a_saved_checkpoint(tmp_path, capsys):
    """``vlm-focus run`` and ``bench --model <path>`` on a saved tiny Gemma 3 and its
    processor."""
    import json

    from vlm_focus import cli

    model = gemma_model()
    model.save_pretrained(tmp_path / "model")
    tiny_processor(model).save_pretrained(tmp_path / "model")
    ramp_image(60, 20).save(tmp_path / "wide.png")
    argv = ["run", "--model", str(tmp_path / "model"), "--image", str(tmp_path / "wide.png")]
    argv += ["--keep", "0.5", "--repeats", "1", "--max-new-tokens", "2", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["model"] == "gemma3" and report["pruned"]
    assert (report["visual_total"], report["visual_kept"]) == (TOKENS, TOKENS // 2)
    bench = ["bench", *argv[1:5], "--keeps", "1.0,0.5", "--repeats", "1"]
    assert cli.main(bench) == 0
    out = capsys.readouterr().out
    assert f"kept {TOKENS:>4}/{TOKENS}" in out and f"kept {TOKENS // 2:>4}/{TOKENS}" in out, out


def test_refusals_name_the_problem():
    """Compact positions (the masks count original ones), a decode-time pruner (its steps read
    a layer's whole cache) and soft-capped attention logits (which the attention math does not
    apply) are refused with the reason."""
    model = gemma_model()
    with pytest.raises(ValueError, match="positions='compact' renumbers the kept tokens"):
        vf.wrap(model, pruner="fastv", keep=0.5, layer=0, positions="compact")
    with pytest.raises(ValueError, match="sliding-window layers among layers >= 1"):
        vf.wrap(model, pruner="fixation", keep=0.25, layer=1)
    capped = tiny_model("gemma3", text=dict(attn_logit_softcapping=50.0))
    with torch.no_grad(), vf.wrap(capped, pruner="fastv", keep=0.5, layer=2):
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            capped(**gemma_inputs())


def test_score_and_select_with_a_layer_mask_runs_on_the_torch_twin():
    """``allowed=`` equal to the causal rule gives the causal scores; a windowed one zeroes
    the keys out of the window; the Triton kernel, causal only, refuses it when forced."""
    from vlm_focus.kernels import score_and_select

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 16, generator=gen), torch.randn(2, 2, 11, 16, generator=gen)
    visual = torch.zeros(2, 11, dtype=torch.bool)
    visual[:, 2:8] = True
    rows = torch.tensor([[8, 9, 10]]).expand(2, -1)
    valid = torch.ones(2, 11, dtype=torch.bool)
    args = dict(scaling=0.3, query_pos=rows, reduce="mean", backend="torch")
    causal, _ = score_and_select(q, k, visual, 3, **args)
    same, _ = score_and_select(q, k, visual, 3, allowed=allowed_keys(valid, rows), **args)
    torch.testing.assert_close(same, causal, atol=0, rtol=0)
    windowed = allowed_keys(valid, rows, window=5)
    scores, _ = score_and_select(q, k, visual, 3, allowed=windowed, **args)
    assert (scores[:, 2:4] == 0).all() and (scores[:, 6:8] > 0).all()  # 10 - 5 < key
    with pytest.raises(ValueError, match="causal masks only"):
        score_and_select(q, k, visual, 3, allowed=windowed, **{**args, "backend": "triton"})
