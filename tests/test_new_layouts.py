"""Qwen3-VL (DeepStack), LLaVA-OneVision, videos and several images per prompt.

The masked-reference matrix of ``test_core_equivalence.py`` over the newer layouts: a pruned run
equals the unpruned model with the pruned visual keys masked out from the stage layer on, in
prefill and 8 cached decode steps, SDPA and eager, batch 1 and a left-padded batch 2. Then the
layouts against the models' own features, per-frame grounding, the frame budget and the
temporal baseline, decoding that emits an image-token id, a later chat turn with a new image,
and exact restore.
"""

from __future__ import annotations

import pytest
import torch
from pruner_inputs import make_ctx
from reference import ATOL, assert_pruned_equals_masked, greedy_generate, masked_reference
from tiny_models import CASES, IMAGE, NEW_KINDS, VIDEO, make_case, make_model
from transformers import LogitsProcessor, LogitsProcessorList

import vlm_focus as vf
from vlm_focus import grounding as G
from vlm_focus.model_adapters import ImageLayout, get_adapter
from vlm_focus.model_adapters.base import grid_cells
from vlm_focus.pruners.baselines import TemporalOptions, TemporalPruner

# Qwen3-VL adds DeepStack features after layers 0, 1 and 2: prune before, between and after.
LAYERS = {("qwen3_vl", "image"): (0, 2, 3)}


def _matrix():
    for kind, case in CASES:
        for layer in LAYERS.get((kind, case), (0, 2)):
            for pruner in ("fastv", "pyramid", "random"):
                yield kind, case, layer, pruner


def _check(kind, case, attn, batch, layer, pruner="fastv", keep=0.5, steps=8, **options):
    model = make_model(kind, attn=attn)
    inputs = make_case(kind, case, model, batch=batch)
    # the named pruner on videos too (the video default has its own tests)
    wrap = dict(pruner=pruner, keep=keep, layer=layer, video_pruner=None, **options)
    return model, inputs, assert_pruned_equals_masked(model, inputs, steps, **wrap)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind,case,layer,pruner", list(_matrix()))
def test_pruned_equals_masked_reference(kind, case, layer, pruner, attn, batch):
    _, _, trace = _check(kind, case, attn, batch, layer, pruner)
    assert [s.layer for s in trace.stages] == [layer]


# --- layouts against the models' own features ---------------------------------------------
@pytest.mark.parametrize("case", ["image", "video"])
def test_onevision_newlines_sit_where_the_model_puts_them(case):
    model = make_model("llava_onevision")
    inputs = make_case("llava_onevision", case, model, batch=2)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    with torch.no_grad():
        if case == "image":
            features = model.model.get_image_features(
                inputs["pixel_values"],
                inputs["image_sizes"],
                vision_feature_layer=-1,
                vision_feature_select_strategy="default",
                batch_num_images=inputs["batch_num_images"],
            ).pooler_output
        else:
            features = model.model.get_video_features(
                inputs["pixel_values_videos"],
                vision_feature_layer=-1,
                vision_feature_select_strategy="default",
            ).pooler_output
    newline = model.model.image_newline
    for b, (image,) in enumerate(layout):
        assert image.cells.shape[0] == features[b].shape[0]
        is_newline = (features[b] == newline).all(-1)
        assert torch.equal(is_newline, image.cells[:, 1] < 0)
    if case == "image":  # 40x70 keeps its 10x16 unpadded grid; 128x120 is downscaled to 12x12
        assert [im.grids for (im,) in layout] == [[(4, 4), (10, 16)], [(4, 4), (12, 12)]]
    else:  # three pooled 2x2 frames, one newline after the last
        assert layout[0][0].grids == [(2, 2)] * 3 and layout[0][0].kind == "video"


def test_onevision_several_images_in_one_prompt_are_base_grids():
    model = make_model("llava_onevision")
    ids = torch.tensor([[1, 5] + [IMAGE] * 17 + [6, 7] + [IMAGE] * 17 + [8]])
    inputs = {"image_sizes": torch.tensor([[40, 70], [64, 30]]), "batch_num_images": [2]}
    (row,) = get_adapter(model).layout(model, ids, inputs)
    assert [im.grids for im in row] == [[(4, 4)], [(4, 4)]]
    assert row[1].positions[0] == 21


def test_qwen3_video_spans_its_timestamp_blocks_one_view_per_frame():
    model = make_model("qwen3_vl")
    inputs = make_case("qwen3_vl", "video", model, batch=2)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    (video,) = layout[0]
    assert video.kind == "video" and video.grids == [(2, 2)] * 3
    assert torch.equal(video.positions, torch.nonzero(inputs["input_ids"][0] == VIDEO).flatten())
    gaps = (video.positions[1:] - video.positions[:-1] > 1).sum()
    assert int(gaps) == 2  # timestamp + vision_end/start between the three temporal groups
    assert video.cells[4].tolist() == [1, 0, 0]  # token 4 opens frame 1


# --- DeepStack, remove() and keep=1.0 ------------------------------------------------------
@pytest.mark.parametrize("kind,case", [c for c in CASES if c[0] in NEW_KINDS])
def test_remove_restores_logits_exactly_and_keep_all_changes_nothing(kind, case):
    model = make_model(kind)
    inputs = make_case(kind, case, model, batch=2)
    with torch.no_grad():
        before = model(**inputs).logits
        with vf.wrap(model, pruner="fastv", keep=1.0, layer=0):
            full = model(**inputs).logits
        with vf.wrap(model, pruner="fastv", keep=0.25, layer=1):
            pruned = model(**inputs).logits
        after = model(**inputs).logits
    assert torch.equal(before, after)
    torch.testing.assert_close(full, before, atol=1e-6, rtol=0)
    assert pruned.shape[1] < before.shape[1]


@pytest.mark.parametrize("case", ["image", "video"])
def test_qwen3_moe_shares_the_qwen3_layout(case):
    _check("qwen3_vl_moe", case, "sdpa", 2, 0, "fastv", steps=4)
    model = make_model("qwen3_vl_moe")
    inputs = make_case("qwen3_vl_moe", case, model, batch=2)
    with torch.no_grad():
        before = model(**inputs).logits
        with vf.wrap(model, pruner="random", keep=0.5, layer=2):
            model(**inputs)
        assert torch.equal(model(**inputs).logits, before)


def test_qwen3_deepstack_reaches_the_kept_tokens():
    """DeepStack matters in this model (zeroing its features changes the logits), and pruning
    at K = 0 still adds each kept token's own features: equal to the masked reference."""
    model = make_model("qwen3_vl")
    inputs = make_case("qwen3_vl", "image", model, batch=2)
    with torch.no_grad():
        plain = model(**inputs).logits
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.bias.add_(1.0)
        shifted = model(**inputs).logits
    assert (plain - shifted).abs().max() > 1e-3
    _check("qwen3_vl", "image", "sdpa", 2, 0, "fastv", keep=0.25, steps=2)


# --- per-frame grounding ---------------------------------------------------------------------
def _plant(monkeypatch, targets):
    import vlm_focus.core.layer_view as layer_view_module

    def fake(q, k, scaling, allowed):
        batch, heads, n_query, _ = q.shape
        probs = torch.zeros(batch, heads, n_query, k.shape[2])
        for b in range(batch):
            probs[b, :, :, targets[b]] = 1.0
        return probs

    monkeypatch.setattr(layer_view_module, "attention_probs", fake)


@pytest.mark.parametrize("kind,case", CASES)
def test_planted_peak_lands_on_its_cell_and_frame(kind, case, monkeypatch):
    model = make_model(kind)
    inputs = make_case(kind, case, model, batch=2)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    targets, wanted = [], []
    for b in range(2):
        image = layout[b][-1]
        view = len(image.grids) - 1  # the last frame, the anyres grid, or the only view
        rows, cols = image.grids[view]
        want = torch.tensor([view, rows // 2, cols - 1])
        idx = int(torch.nonzero((image.cells == want).all(1)).flatten()[0])
        targets.append(int(image.positions[idx]))
        wanted.append((len(layout[b]) - 1, view, (rows // 2, cols - 1)))
    _plant(monkeypatch, targets)
    maps = G.heatmap(model, inputs)
    for b, (image_index, view, cell) in enumerate(wanted):
        heat = maps[b][image_index]
        frames = heat.frame_maps
        if heat.layout.kind == "video":
            assert len(frames) == len(heat.layout.grids)
            assert [round(f.mass, 5) for f in frames[:-1]] == [0.0] * (len(frames) - 1)
            heat = frames[view]
        grid = heat.grid
        assert divmod(int(grid.argmax()), grid.shape[1]) == cell
        assert heat.mass == pytest.approx(1.0, abs=1e-5)


# --- keep for a video: the whole span, or a per-frame budget; the temporal baseline ----------
def _per_frame(trace, layout, b):
    (video,) = layout[b]
    kept = torch.isin(video.positions, trace.kept[b])
    return torch.bincount(video.cells[kept, 0], minlength=len(video.grids)).tolist()


def test_frame_budget_keeps_the_same_share_of_every_frame():
    model, inputs, trace = _check("qwen3_vl", "video", "sdpa", 2, 2, "fastv", budget="frame")
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    assert _per_frame(trace, layout, 0) == [2, 2, 2]  # three frames of 4 tokens, keep 0.5
    assert _per_frame(trace, layout, 1) == [3, 3]  # two frames of 6


def test_temporal_uniform_keeps_whole_evenly_spaced_frames():
    model, inputs, trace = _check("qwen2_5_vl", "video", "eager", 1, 0, "temporal", keep=8)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    assert sorted(_per_frame(trace, layout, 0)) == [0, 4, 4]  # two whole frames of 4


def test_temporal_dedup_drops_the_near_duplicate_frame():
    cells = torch.cat([grid_cells(2, 2, view=f) for f in range(3)])
    video = ImageLayout(torch.arange(2, 14), cells, [(2, 2)] * 3, kind="video")
    hidden = torch.randn(1, 16, 10, generator=torch.Generator().manual_seed(0))
    hidden[0, 6:10] = hidden[0, 2:6] * 1.01  # frame 1 repeats frame 0
    ctx = make_ctx(hidden, [[video]])
    scores = TemporalPruner(vf.FocusConfig(), TemporalOptions(mode="dedup")).select(ctx, 8).scores
    kept = scores[0].topk(8).indices
    assert set(kept.tolist()) == set(range(2, 6)) | set(range(10, 14))  # frames 0 and 2
    with pytest.raises(ValueError, match="mode="):
        TemporalOptions(mode="every")


# --- decoding meets an image token; a later turn brings a new image --------------------------
class ForceAt(LogitsProcessor):
    def __init__(self, prompt_len: int, step: int, token: int) -> None:
        self.at, self.token = prompt_len + step, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.at:
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.token] = 0.0
            return forced
        return scores


@pytest.mark.parametrize("kind,case", [("llava", "two_images"), ("qwen3_vl", "image")])
@pytest.mark.parametrize("layer", [0, 2])
def test_generate_emitting_the_image_token_equals_the_reference(kind, case, layer):
    model = make_model(kind)
    inputs = make_case(kind, case, model, batch=2)
    force = LogitsProcessorList([ForceAt(inputs["input_ids"].shape[1], 3, IMAGE)])
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    kwargs.update(output_logits=True, logits_processor=force)
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer) as handle:
        out = model.generate(**inputs, **kwargs)
        trace = handle.last_trace
    assert (out.sequences[:, -3] == IMAGE).all()
    with torch.no_grad(), masked_reference(model, model.model.language_model.layers, trace):
        ref = model.generate(**inputs, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=ATOL, rtol=0)


def test_a_later_turn_with_a_new_image_names_the_workaround():
    model = make_model("llava")
    first = make_case("llava", "image", model, batch=1)
    with torch.no_grad():
        cache = model(**first, use_cache=True).past_key_values
        turn = torch.tensor([[5, 6] + [IMAGE] * 16 + [7, 8]])
        second = dict(
            input_ids=turn,
            attention_mask=torch.ones(1, first["input_ids"].shape[1] + turn.shape[1]),
            pixel_values=torch.randn(1, 3, 32, 32),
        )
        model(**second, cache=cache)  # the unwrapped model accepts it
        with vf.wrap(model, pruner="fastv", keep=0.5, layer=2):
            cache = model(**first, use_cache=True).past_key_values
            with pytest.raises(ValueError, match="Run the whole conversation as one prompt"):
                model(**second, cache=cache)


@pytest.mark.parametrize("kind,case", [("llava", "two_images"), ("qwen3_vl", "image")])
@pytest.mark.parametrize("layer", [0, 2])
def test_a_text_turn_on_the_pruned_cache_equals_the_reference(kind, case, layer):
    model = make_model(kind)
    inputs = make_case(kind, case, model, batch=2)
    follow = torch.tensor([[9, 10, 11, 12]] * 2)
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(follow)], 1)
    # Qwen3-VL itself positions a masked multi-token chunk on a cache over the whole mask width
    # (and fails), so that turn goes without a mask, positioned from the cache length.
    turn = (
        dict(input_ids=follow)
        if kind.startswith("qwen")
        else dict(input_ids=follow, attention_mask=mask)
    )

    def two_turns():
        cache = model(**inputs, use_cache=True).past_key_values
        return model(**turn, cache=cache).logits

    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=layer) as handle:
        logits = two_turns()
        trace = handle.last_trace
    with torch.no_grad(), masked_reference(model, model.model.language_model.layers, trace):
        ref = two_turns()
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen2_5_vl"])
def test_guided_pruning_of_a_video_matches_the_reference(kind):
    guide = make_model("qwen2_5_vl", seed=3)
    options = dict(guide=guide, guide_inputs=make_case("qwen2_5_vl", "video", guide, batch=2))
    _check(kind, "video", "sdpa", 2, 0, "guided", steps=4, **options)


def test_a_text_only_row_beside_an_image_row_runs_unpruned_with_a_warning():
    model = make_model("llava")
    inputs = make_case("llava", "image", model, batch=2)
    gen = torch.Generator().manual_seed(1)
    inputs["input_ids"][0] = torch.randint(3, 100, inputs["input_ids"][0].shape, generator=gen)
    inputs["pixel_values"] = inputs["pixel_values"][1:]
    with torch.no_grad():
        plain = model(**inputs).logits
        with vf.wrap(model, pruner="fastv", keep=0.5, layer=2) as handle:
            with pytest.warns(UserWarning, match="text-only row has nothing to drop"):
                logits = model(**inputs).logits
    torch.testing.assert_close(logits, plain, atol=1e-6, rtol=0)
    assert handle.last_trace.n_kept == handle.last_trace.n_visual == [0, 16]


@pytest.mark.parametrize(
    "kind,case", [("llava_next", "image"), ("qwen2_vl", "image"), ("llava_onevision", "image")]
)
def test_beam_search_copies_share_their_prompts_images(kind, case):
    """generate() repeats each prompt per beam while the encoder saw each image once."""
    model = make_model(kind)
    inputs = make_case(kind, case, model, batch=2)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, num_beams=2, do_sample=False)
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=2) as handle:
        out = model.generate(**inputs, **kwargs)
        trace = handle.last_trace
    assert len(trace.kept) == 4 and torch.equal(trace.kept[0], trace.kept[1])
    with torch.no_grad(), masked_reference(model, model.model.language_model.layers, trace):
        ref = model.generate(**inputs, **kwargs)
    assert torch.equal(out, ref)


def test_qwen3_prompt_with_an_image_and_a_video_under_generate():
    """Qwen3-VL's video encoder calls its image encoder: the image grid recorded for the layout
    must stay the image's, not the video's."""
    model = make_model("qwen3_vl")
    image = make_case("qwen3_vl", "image", model, batch=1)
    video = make_case("qwen3_vl", "video", model, batch=1)
    ids = torch.cat([image["input_ids"][:, :-6], video["input_ids"][:, 1:]], dim=1)
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=torch.cat(
            [image["mm_token_type_ids"][:, :-6], video["mm_token_type_ids"][:, 1:]], dim=1
        ),
        pixel_values=image["pixel_values"],
        image_grid_thw=image["image_grid_thw"],
        pixel_values_videos=video["pixel_values_videos"],
        video_grid_thw=video["video_grid_thw"],
    )
    layers = model.model.language_model.layers
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=0) as handle:
        sequences, logits = greedy_generate(model, inputs, 4)
        trace = handle.last_trace
    assert trace.n_visual == [12 + 12]  # the 4x3 image grid and three 2x2 frames
    with torch.no_grad(), masked_reference(model, layers, trace):
        ref_sequences, ref_logits = greedy_generate(model, inputs, 4)
    assert torch.equal(sequences, ref_sequences)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    with torch.no_grad(), vf.wrap(model, pruner="pool", keep=0.5, layer=0) as handle:
        model.generate(**inputs, max_new_tokens=1)
        used = handle._engine.state.layout[0]  # the layout generate()'s prefill was pruned by
    assert [(im.kind, im.grids) for im in used] == [
        ("image", [(4, 3)]),
        ("video", [(2, 2)] * 3),
    ]
