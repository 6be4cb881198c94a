"""Grounding: probe rows against eager attention, map geometry for all four adapters (planted
peaks), pixel alignment, boxes on synthetic blobs, MTLA region scores, localization heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import KINDS, make_inputs, make_model

import vlm_focus._probe as probe_module
from vlm_focus import grounding as G
from vlm_focus._probe import AttentionProbe
from vlm_focus.grounding._maps import build_map, cell_rectangles, view_frame
from vlm_focus.model_adapters import ImageLayout, get_adapter
from vlm_focus.model_adapters.base import grid_cells


class WordTokenizer:
    """Token id ``i`` <-> the word ``x`` + its digits spelled as letters (``57`` -> ``xfh``)."""

    letters = "abcdefghij"

    def word(self, i: int) -> str:
        return "x" + "".join(self.letters[int(d)] for d in str(i))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for w in text.split():
            out.append(int("".join(str(self.letters.index(c)) for c in w[1:])))
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(self.word(int(i)) for i in ids)


def _plant(monkeypatch, targets: list[int], mass: float = 1.0):
    """Every query row of every layer and head puts ``mass`` on key ``targets[b]`` (rest on
    the row's own position)."""

    def fake(q, k, scaling, allowed):
        batch, heads, n_query, _ = q.shape
        probs = torch.zeros(batch, heads, n_query, k.shape[2])
        own = allowed.float().cumsum(-1).argmax(-1)  # last allowed key = the row itself
        for b in range(batch):
            probs[b, :, :, targets[b]] += mass
            probs[b, :, torch.arange(n_query), own[b]] += 1.0 - mass
        return probs

    monkeypatch.setattr(probe_module, "attention_probs", fake)


# --- the probe equals the model's own attention --------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_probe_rows_equal_eager_attention_prefill_and_decode(kind):
    model = make_model(kind, "eager")
    inputs = make_inputs(kind, model, batch=2)
    with torch.no_grad(), AttentionProbe(model, layers=[0, 3], rows="text") as probe:
        out = model(**inputs, output_attentions=True)
    assert len(probe.records) == 2
    for rec in probe.records:
        ref = out.attentions[rec.layer]  # [B, H, S, S]
        for b in range(2):
            rows = rec.positions[b][rec.mask[b]]
            torch.testing.assert_close(
                rec.probs[b][:, rec.mask[b]], ref[b][:, rows], atol=1e-5, rtol=0
            )
    with torch.no_grad(), AttentionProbe(model, layers=[1], rows=None, decode=True) as probe:
        gen = model.generate(
            **inputs,
            max_new_tokens=3,
            do_sample=False,
            output_attentions=True,
            return_dict_in_generate=True,
        )
    assert [r.step for r in probe.records] == [1, 2]
    for rec in probe.records:
        ref = gen.attentions[rec.step][1][:, :, -1]  # [B, H, L]
        torch.testing.assert_close(rec.probs[:, :, 0], ref, atol=1e-5, rtol=0)


# --- map geometry ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_planted_peak_lands_on_its_cell_and_pixels(kind, monkeypatch):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    targets, cells = [], []
    for b in range(2):
        image = layout[b][0]
        view = len(image.grids) - 1  # LLaVA-NeXT: the anyres composite, else the only view
        rows, cols = image.grids[view]
        want = torch.tensor([view, rows // 2, cols - 1])
        idx = int(torch.nonzero((image.cells == want).all(1)).flatten()[0])
        targets.append(int(image.positions[idx]))
        cells.append((rows // 2, cols - 1))
    _plant(monkeypatch, targets)
    maps = G.heatmap(model, inputs)
    if kind == "qwen2_vl":  # a non-square merged grid in both rows
        assert [tuple(m[0].grid.shape) for m in maps] == [(4, 3), (2, 4)]
    if kind == "llava_next":  # base 4x4 plus unpadded multi-crop grids
        assert [len(m[0].views) for m in maps] == [2, 2]
        assert [tuple(m[0].grid.shape) for m in maps] == [(4, 8), (8, 4)]
    for b in range(2):
        heat = maps[b][0]
        grid = heat.grid
        assert divmod(int(grid.argmax()), grid.shape[1]) == cells[b]
        assert heat.mass == pytest.approx(1.0, abs=1e-5)
        # the pixel peak lies inside the cell's pixel rectangle
        rect = cell_rectangles(tuple(grid.shape), heat.frames[-1])[cells[b]]
        y, x = divmod(int(heat.pixels.argmax()), heat.image_size[1])
        assert rect[0] <= y + 0.5 <= rect[2] and rect[1] <= x + 0.5 <= rect[3]
        px, py = G.point(heat, sigma=0)
        assert rect[0] <= py <= rect[2] and rect[1] <= px <= rect[3]
        if heat.layout.image_size is not None:
            assert heat.image_size == tuple(heat.layout.image_size)


@pytest.mark.parametrize("geometry", ["resize", "crop", "pad"])
def test_upsampled_map_aligns_with_image_pixels(geometry):
    rows, cols, size = 3, 4, (45, 80)  # a wide image
    layout = ImageLayout(torch.arange(rows * cols), grid_cells(rows, cols), [(rows, cols)])
    y0, x0, fh, fw = view_frame(size, geometry)
    rects = cell_rectangles((rows, cols), (y0, x0, fh, fw))
    for r, c in [(1, 1), (1, 2)]:
        values = torch.zeros(rows * cols)
        values[r * cols + c] = 1.0
        heat = build_map(values, layout, size, geometry)
        y, x = divmod(int(heat.pixels.argmax()), size[1])
        lo_y, lo_x, hi_y, hi_x = rects[r, c].tolist()
        assert lo_y <= y + 0.5 <= hi_y and lo_x <= x + 0.5 <= hi_x
        # density integrates to the cell's mass (an interior cell, frame inside the image)
        if geometry != "pad":
            assert float(heat.pixels.sum()) == pytest.approx(1.0, rel=0.03)
    if geometry == "crop":  # outside the central square nothing is seen
        assert x0 == pytest.approx(17.5) and fw == 45
        assert float(heat.pixels[:, :17].abs().sum()) == 0.0
        assert float(heat.pixels[:, 63:].abs().sum()) == 0.0
    if geometry == "pad":
        assert y0 == pytest.approx(-17.5) and fh == 80


@pytest.mark.parametrize("kind", KINDS)
def test_sdpa_and_eager_give_the_same_maps(kind):
    maps = {}
    for attn in ("sdpa", "eager"):
        model = make_model(kind, attn)
        inputs = make_inputs(kind, model, batch=2)
        maps[attn] = G.heatmap(model, inputs, layers=[0, 2])
    for row_s, row_e in zip(maps["sdpa"], maps["eager"], strict=True):
        for a, b in zip(row_s, row_e, strict=True):
            torch.testing.assert_close(a.grid, b.grid, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.pixels, b.pixels, atol=1e-5, rtol=1e-4)


def test_query_forms_agree_and_bad_queries_raise():
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    ids = inputs["input_ids"]
    tok = WordTokenizer()
    # a phrase present in both rows: the last two tokens of each row differ, so use each row's
    # own tokens as positions and compare with a mask
    positions = torch.tensor([[ids.shape[1] - 2, ids.shape[1] - 1]] * 2)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, -2:] = True
    a = G.heatmap(model, inputs, positions)
    b = G.heatmap(model, inputs, mask)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x[0].grid, y[0].grid, atol=0, rtol=0)
    single = {k: v[:1] for k, v in inputs.items()}
    phrase = tok.decode(single["input_ids"][0, -2:].tolist())
    c = G.heatmap(model, single, phrase, tokenizer=tok)
    d = G.heatmap(model, single, single["input_ids"][0, -2:].tolist())
    torch.testing.assert_close(c[0][0].grid, a[0][0].grid, atol=1e-6, rtol=0)
    torch.testing.assert_close(d[0][0].grid, a[0][0].grid, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="empty"):
        G.heatmap(model, single, "  ", tokenizer=tok)
    with pytest.raises(ValueError, match="not found"):
        G.heatmap(model, single, "xjjj", tokenizer=tok)  # token 999
    with pytest.raises(ValueError, match="tokenizer"):
        G.heatmap(model, single, "xab")
    with pytest.raises(TypeError):
        G.heatmap(model, single, 3.5)
    with pytest.raises(ValueError, match="geometry"):
        G.heatmap(model, single, geometry="stretch")
    with pytest.raises(ValueError, match="layer"):
        G.heatmap(model, single, layers=[7])


def test_relative_attention_divides_by_the_generic_map(monkeypatch):
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    plain = G.heatmap(model, inputs, layers=[1])
    generic = make_inputs("qwen2_vl", model, batch=2, seed=0, prompt_len=3)
    generic_maps = G.heatmap(model, generic, layers=[1])
    rel = G.heatmap(model, inputs, layers=[1], relative_to=generic)
    for b in range(2):
        g = generic_maps[b][0].grid
        want = plain[b][0].grid / (g + 0.05 * g.mean() + 1e-12)
        torch.testing.assert_close(rel[b][0].grid, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="same images"):
        G.heatmap(model, inputs, relative_to=make_inputs("qwen2_vl", model, batch=1))


# --- points and boxes -----------------------------------------------------------------------
def _blobs(shape, rects, values, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    m = rng.uniform(0, noise, size=shape)
    for (x, y, w, h), v in zip(rects, values, strict=True):
        m[y : y + h, x : x + w] = v
    return m


@pytest.mark.parametrize("threshold", [0.5, "otsu"])
def test_boxes_recover_synthetic_blobs(threshold):
    rects = [[10, 8, 20, 16], [50, 30, 30, 20], [5, 44, 12, 12]]
    values = [1.0, 0.8, 0.9]
    m = _blobs((64, 96), rects, values)
    found = G.boxes(torch.from_numpy(m), threshold=threshold, sigma=1.0)
    assert len(found) == 3
    masses = [v * w * h for (_, _, w, h), v in zip(rects, values, strict=True)]
    order = np.argsort(masses)[::-1]
    assert [b.score for b in found] == sorted([b.score for b in found], reverse=True)
    for box, i in zip(found, order, strict=True):
        assert G.iou(box, rects[i]) >= 0.9
        assert box.score == pytest.approx(masses[i], rel=0.05)
    assert G.boxes(torch.from_numpy(m), threshold=0.5, sigma=1.0, max_boxes=1)[0] == found[0]
    x, y = G.point(torch.from_numpy(m), sigma=1.0)
    assert 10 <= x <= 30 and 8 <= y <= 24  # the highest blob
    with pytest.raises(ValueError):
        G.boxes(torch.zeros(3, 3, 3))
    with pytest.raises(ValueError):
        G.boxes(torch.from_numpy(m), threshold=1.5)
    assert G.boxes(torch.zeros(8, 8)) == []


def test_boxes_of_a_heatmap_are_in_image_pixels(monkeypatch):
    model = make_model("llava_next")
    inputs = make_inputs("llava_next", model, batch=1)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)[0][0]
    idx = int(torch.nonzero((layout.cells == torch.tensor([1, 1, 2])).all(1)).flatten()[0])
    _plant(monkeypatch, [int(layout.positions[idx])])
    heat = G.heatmap(model, inputs)[0][0]
    (box,) = G.boxes(heat, threshold=0.5, sigma=0)
    rect = cell_rectangles(tuple(heat.grid.shape), heat.frames[1])[1, 2].tolist()  # y0 x0 y1 x1
    cell_box = [rect[1], rect[0], rect[3] - rect[1], rect[2] - rect[0]]
    assert heat.image_size == (40, 70)
    assert G.iou(box, cell_box) >= 0.5


# --- region scores (MTLA) -------------------------------------------------------------------
def _plant_rows(monkeypatch, per_row: dict[int, dict[int, float]]):
    """Query row ``t`` (in order) puts ``per_row[t][key]`` on each key, the rest on itself."""

    def fake(q, k, scaling, allowed):
        batch, heads, n_query, _ = q.shape
        probs = torch.zeros(batch, heads, n_query, k.shape[2])
        own = allowed.float().cumsum(-1).argmax(-1)
        for t in range(n_query):
            spent = 0.0
            for key, value in per_row[t].items():
                probs[:, :, t, key] += value
                spent += value
            probs[:, :, t, own[:, t]] += 1.0 - spent
        return probs

    monkeypatch.setattr(probe_module, "attention_probs", fake)


def test_region_score_matches_hand_computation(monkeypatch):
    model = make_model("llava")  # 4x4 grid, 8 px cells on a 32x32 image
    inputs = make_inputs("llava", model, batch=1)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)[0][0]
    cell_a = int(layout.positions[0])  # cell (0, 0)
    cell_b = int(layout.positions[15])  # cell (3, 3)
    _plant_rows(monkeypatch, {0: {cell_a: 0.5}, 1: {cell_b: 0.3, cell_a: 0.1}})
    seq = inputs["input_ids"].shape[1]
    tokens = torch.tensor([[seq - 2, seq - 1]])
    inside_a = G.region_score(model, inputs, [0, 0, 8, 8], tokens)
    assert float(inside_a) == pytest.approx(0.6 / 0.9, abs=1e-6)
    half_b = G.region_score(model, inputs, [24, 24, 4, 8], tokens)
    assert float(half_b) == pytest.approx(0.5 * 0.3 / 0.9, abs=1e-6)
    disjoint = G.region_score(model, inputs, [8, 8, 16, 16], tokens)
    assert float(disjoint) == pytest.approx(0.0, abs=1e-7)
    assert float(G.region_score(model, inputs, [0, 0, 32, 32], tokens)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="outside"):
        G.region_score(model, inputs, [20, 20, 16, 16], tokens)
    with pytest.raises(ValueError, match="non-positive"):
        G.region_score(model, inputs, [0, 0, 0, 5], tokens)
    with pytest.raises(TypeError):
        G.region_score(model, inputs, [0, 0, 5], tokens)


def test_region_score_planted_box_beats_disjoint_and_ignores_token_order(monkeypatch):
    model = make_model("qwen2_5_vl")
    inputs = make_inputs("qwen2_5_vl", model, batch=2)
    seq = inputs["input_ids"].shape[1]
    forward = torch.tensor([[seq - 3, seq - 2, seq - 1]] * 2)
    backward = forward.flip(1)
    box = [0, 0, 12, 16]
    a = G.region_score(model, inputs, box, forward)
    b = G.region_score(model, inputs, box, backward)
    torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    # plant: row b's image token at cell (0, 0) gets 0.7 of each query row
    targets = [int(layout[b][0].positions[0]) for b in range(2)]
    _plant(monkeypatch, targets, mass=0.7)
    holding = G.region_score(model, inputs, [0, 0, 8, 8], forward)
    disjoint = G.region_score(model, inputs, [16, 8, 8, 8], forward)
    assert bool((holding > 0.99).all()) and bool((disjoint < 1e-6).all())


def test_region_score_of_generated_tokens_equals_describe_and_ground():
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    tok = WordTokenizer()
    with torch.no_grad():
        answer = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)[
            :, inputs["input_ids"].shape[1] :
        ]
    name = tok.word(int(answer[0, 1]))
    results = G.describe_and_ground(
        model, inputs, tokenizer=tok, objects=[name], max_new_tokens=4,
        generate_kwargs={"min_new_tokens": 4},
    )  # fmt: skip
    assert torch.equal(results[0].answer_ids, answer[0])
    phrase = next(p for p in results[0].phrases if p.text == name)
    assert phrase.positions[0] >= inputs["input_ids"].shape[1] + 1
    assert phrase.box is not None and 0 < phrase.score <= 1
    mask = torch.zeros(2, inputs["input_ids"].shape[1] + 4, dtype=torch.bool)
    mask[0, phrase.positions] = True
    mask[1, -1] = True
    direct = G.region_score(model, inputs, phrase.box, mask, answer=answer)
    assert float(direct[0]) == pytest.approx(phrase.score, abs=1e-6)
    maps = G.heatmap(model, inputs, mask, answer=answer)
    torch.testing.assert_close(maps[0][0].grid, phrase.map.grid, atol=1e-7, rtol=0)
    # a phrase of the answer found by text
    by_text = G.heatmap(model, {k: v[:1] for k, v in inputs.items()}, name, tokenizer=tok,
                        answer=answer[:1])  # fmt: skip
    torch.testing.assert_close(by_text[0][0].grid, phrase.map.grid, atol=1e-6, rtol=0)


# --- localization heads ---------------------------------------------------------------------
def test_localization_heads_pick_the_planted_heads(monkeypatch, tmp_path):
    model = make_model("llava")
    layers = list(model.model.language_model.layers)
    planted = {(1, 2), (3, 0)}
    diffuse = {(0, 1), (2, 3)}
    real = probe_module.layer_attention_rows

    def fake(adapter, layer, hidden, kwargs, local, rows, past, valid):
        probs = real(adapter, layer, hidden, kwargs, local, rows, past, valid)
        index = layers.index(layer)
        visual = adapter.visual_mask(model, fake.input_ids)  # [B, S]
        out = torch.zeros_like(probs)
        own = rows  # each row's own position
        for b in range(probs.shape[0]):
            vis = torch.nonzero(visual[b]).flatten()
            peak = vis[(fake.seed * 5 + b) % vis.numel()]
            for h in range(probs.shape[1]):
                if (index, h) in planted:
                    out[b, h, :, peak] = 0.9
                    mass = 0.9
                elif (index, h) in diffuse:
                    out[b, h, :, vis] = 0.9 / vis.numel()
                    mass = 0.9
                else:
                    out[b, h, :, vis] = 0.1 / vis.numel()
                    mass = 0.1
                out[b, h, torch.arange(own.shape[1]), own[b]] += 1 - mass
        return out

    monkeypatch.setattr(probe_module, "layer_attention_rows", fake)
    calibration = []
    for seed in range(3):
        calibration.append(make_inputs("llava", model, batch=2, seed=seed))

    def stream():
        for seed, item in enumerate(calibration):
            fake.seed, fake.input_ids = seed, item["input_ids"]
            yield item

    heads = G.select_localization_heads(model, stream(), top_k=2)
    assert set(heads.heads) == planted
    assert heads.elbow == 4
    path = G.save_heads(heads, tmp_path / "heads.json")
    loaded = G.load_heads(path, model)
    assert loaded.heads == heads.heads and loaded.by_layer() == {1: [2], 3: [0]}
    with pytest.raises(ValueError, match="do not fit"):
        G.load_heads(path, make_model("qwen2_vl"))
    monkeypatch.setattr(probe_module, "layer_attention_rows", real)
    inputs = calibration[0]
    by_heads = G.heatmap(model, inputs, heads=loaded)
    by_dict = G.heatmap(model, inputs, heads={3: [0], 1: [2]})
    torch.testing.assert_close(by_heads[1][0].grid, by_dict[1][0].grid, atol=0, rtol=0)
    with pytest.raises(ValueError, match="outside"):
        G.heatmap(model, inputs, heads={1: [9]})


def test_default_geometry_follows_the_adapter_and_can_be_overridden():
    model = make_model("llava")  # its adapter declares the base view square-padded
    inputs = make_inputs("llava", model, batch=1)
    padded = G.heatmap(model, inputs, image_size=(40, 60))[0][0]
    assert padded.image_size == (40, 60)
    assert padded.frames == [view_frame((40, 60), "pad")]
    cropped = G.heatmap(model, inputs, image_size=(40, 60), geometry="crop")[0][0]
    assert cropped.frames == [view_frame((40, 60), "crop")]
    torch.testing.assert_close(padded.grid, cropped.grid, atol=0, rtol=0)
    assert float(cropped.pixels[:, :10].abs().sum()) == 0.0  # outside the central square
    next_model = make_model("qwen2_vl")
    heat = G.heatmap(next_model, make_inputs("qwen2_vl", next_model, batch=1))[0][0]
    assert heat.frames == [(0.0, 0.0, 32.0, 24.0)] and heat.image_size == (32, 24)


def test_probing_a_pruned_layer_raises_and_earlier_layers_work():
    import vlm_focus as vf

    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    plain = G.heatmap(model, inputs, layers=[0, 1])
    with vf.wrap(model, pruner="fastv", keep=0.5, layer=2):
        same = G.heatmap(model, inputs, layers=[0, 1])
        with pytest.raises(ValueError, match="unpruned"):
            G.heatmap(model, inputs, layers=[3])
    for a, b in zip(plain, same, strict=True):
        torch.testing.assert_close(a[0].grid, b[0].grid, atol=1e-6, rtol=0)


def test_describe_and_ground_without_a_vocabulary_grounds_each_content_word():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    results = G.describe_and_ground(
        model, inputs, tokenizer=WordTokenizer(), max_new_tokens=3,
        generate_kwargs={"min_new_tokens": 3},
    )  # fmt: skip
    seq = inputs["input_ids"].shape[1]
    for b, described in enumerate(results):
        assert len(described.answer_ids) == 3 and len(described.answer.split()) == 3
        assert [p.positions for p in described.phrases] == [[seq], [seq + 1], [seq + 2]]
        for phrase in described.phrases:
            assert phrase.map.row == b and phrase.map.grid.shape == ((4, 3) if b == 0 else (2, 4))
            assert phrase.box is not None
            assert phrase.score == pytest.approx(G.box_share(phrase.map, phrase.box))
