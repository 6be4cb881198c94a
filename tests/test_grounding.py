"""Grounding: probe rows against eager attention, map geometry for all four adapters (planted
peaks), boxes on synthetic blobs (a Box is the geometry's one rectangle type with a score), MTLA
region scores, localization heads, the one-pass API and its refused old argument names."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import KINDS, make_inputs, make_model

import vlm_focus.core.layer_view as layer_view_module
from vlm_focus import grounding as G
from vlm_focus.core.probe import AttentionProbe
from vlm_focus.geometry import Frame, Size, rule_frame
from vlm_focus.model_adapters import get_adapter


def processed_sizes(kind: str, inputs: dict) -> list[Size] | None:
    """Original sizes equal to the processed frames of the tiny inputs (8 pixels per cell) for
    the layouts that do not carry a size (LLaVA, Qwen); ``None`` for LLaVA-NeXT."""
    batch = inputs["input_ids"].shape[0]
    if kind == "llava":
        return [Size(32, 32)] * batch
    if "image_grid_thw" in inputs:
        return [Size(int(w) // 2 * 8, int(h) // 2 * 8) for _, h, w in inputs["image_grid_thw"]]
    return None


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

    monkeypatch.setattr(layer_view_module, "attention_probs", fake)


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
    maps = G.heatmap(model, inputs, sizes=processed_sizes(kind, inputs))
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
        x_lo, y_lo, x_hi, y_hi = heat.frames[-1].cells(tuple(grid.shape))[cells[b]].tolist()
        y, x = divmod(int(heat.pixels.argmax()), heat.size.width)
        assert x_lo <= x + 0.5 <= x_hi and y_lo <= y + 0.5 <= y_hi
        px, py = G.point(heat, sigma=0)
        assert x_lo <= px <= x_hi and y_lo <= py <= y_hi
        assert heat.pixels.shape == (heat.size.height, heat.size.width)
        if heat.layout.image_size is not None:
            assert heat.size == heat.layout.image_size


@pytest.mark.parametrize("kind", KINDS)
def test_sdpa_and_eager_give_the_same_maps(kind):
    maps = {}
    for attn in ("sdpa", "eager"):
        model = make_model(kind, attn)
        inputs = make_inputs(kind, model, batch=2)
        maps[attn] = G.heatmap(model, inputs, layers=[0, 2], sizes=processed_sizes(kind, inputs))
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
    c = G.heatmap(model, single, phrase, processor=tok)
    d = G.heatmap(model, single, single["input_ids"][0, -2:].tolist())
    torch.testing.assert_close(c[0][0].grid, a[0][0].grid, atol=1e-6, rtol=0)
    torch.testing.assert_close(d[0][0].grid, a[0][0].grid, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="empty"):
        G.heatmap(model, single, "  ", processor=tok)
    with pytest.raises(ValueError, match="not found in row 0 of the prompt's text$"):
        G.heatmap(model, single, "xjjj", processor=tok)  # token 999, no answer: the prompt
    with pytest.raises(ValueError, match="processor="):
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
    x_lo, y_lo, x_hi, y_hi = heat.frames[1].cells(tuple(heat.grid.shape))[1, 2].tolist()
    assert heat.size == Size(width=70, height=40)  # image_sizes [[40, 70]] are (height, width)
    assert G.iou(box, [x_lo, y_lo, x_hi - x_lo, y_hi - y_lo]) >= 0.5


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

    monkeypatch.setattr(layer_view_module, "attention_probs", fake)


def test_region_score_matches_hand_computation(monkeypatch):
    model = make_model("llava")  # 4x4 grid, 8 px cells on a 32x32 image
    inputs = make_inputs("llava", model, batch=1)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)[0][0]
    cell_a = int(layout.positions[0])  # cell (0, 0)
    cell_b = int(layout.positions[15])  # cell (3, 3)
    _plant_rows(monkeypatch, {0: {cell_a: 0.5}, 1: {cell_b: 0.3, cell_a: 0.1}})
    seq = inputs["input_ids"].shape[1]
    tokens = torch.tensor([[seq - 2, seq - 1]])
    gp = G.GroundingPass(model, inputs, sizes=Size(32, 32), rows=tokens)  # planted rows 0, 1
    inside_a = gp.region_score(tokens, [0, 0, 8, 8])
    assert float(inside_a) == pytest.approx(0.6 / 0.9, abs=1e-6)
    half_b = gp.region_score(tokens, [24, 24, 4, 8])
    assert float(half_b) == pytest.approx(0.5 * 0.3 / 0.9, abs=1e-6)
    disjoint = gp.region_score(tokens, [8, 8, 16, 16])
    assert float(disjoint) == pytest.approx(0.0, abs=1e-7)
    assert float(gp.region_score(tokens, [0, 0, 32, 32])) == pytest.approx(1.0)
    direct = G.region_score(model, inputs, [0, 0, 8, 8], tokens, sizes=Size(32, 32))
    assert float(direct) == pytest.approx(float(inside_a), abs=1e-7)
    with pytest.raises(ValueError, match="outside"):
        gp.region_score(tokens, [20, 20, 16, 16])
    with pytest.raises(ValueError, match="non-positive"):
        gp.region_score(tokens, [0, 0, 0, 5])
    with pytest.raises(TypeError):
        gp.region_score(tokens, [0, 0, 5])
    with pytest.raises(ValueError, match="Pass images="):  # LLaVA inputs carry no size
        G.region_score(model, inputs, [0, 0, 8, 8], tokens)


def test_region_score_planted_box_beats_disjoint_and_ignores_token_order(monkeypatch):
    model = make_model("qwen2_5_vl")
    inputs = make_inputs("qwen2_5_vl", model, batch=2)
    seq = inputs["input_ids"].shape[1]
    forward = torch.tensor([[seq - 3, seq - 2, seq - 1]] * 2)
    backward = forward.flip(1)
    box = [0, 0, 12, 16]
    sizes = processed_sizes("qwen2_5_vl", inputs)
    a = G.region_score(model, inputs, box, forward, sizes=sizes)
    b = G.region_score(model, inputs, box, backward, sizes=sizes)
    torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    # plant: row b's image token at cell (0, 0) gets 0.7 of each query row
    targets = [int(layout[b][0].positions[0]) for b in range(2)]
    _plant(monkeypatch, targets, mass=0.7)
    holding = G.region_score(model, inputs, [0, 0, 8, 8], forward, sizes=sizes)
    disjoint = G.region_score(model, inputs, [16, 8, 8, 8], forward, sizes=sizes)
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
    sizes = Size(32, 32)
    results = G.describe_and_ground(
        model,
        inputs,
        processor=tok,
        objects=[name],
        max_new_tokens=4,
        sizes=sizes,
        generate_kwargs={"min_new_tokens": 4},
    )
    assert torch.equal(results[0].answer_ids, answer[0])
    phrase = next(p for p in results[0].phrases if p.text == name)
    assert phrase.positions[0] >= inputs["input_ids"].shape[1] + 1
    assert phrase.box is not None and 0 < phrase.score <= 1
    mask = torch.zeros(2, inputs["input_ids"].shape[1] + 4, dtype=torch.bool)
    mask[0, phrase.positions] = True
    mask[1, -1] = True
    direct = G.region_score(model, inputs, phrase.box, mask, answer=answer, sizes=sizes)
    assert float(direct[0]) == pytest.approx(phrase.score, abs=1e-6)
    maps = G.heatmap(model, inputs, mask, answer=answer)
    torch.testing.assert_close(maps[0][0].grid, phrase.map.grid, atol=1e-7, rtol=0)
    # a phrase of the answer found by text
    by_text = G.heatmap(
        model, {k: v[:1] for k, v in inputs.items()}, name, processor=tok, answer=answer[:1]
    )
    torch.testing.assert_close(by_text[0][0].grid, phrase.map.grid, atol=1e-6, rtol=0)


# --- localization heads ---------------------------------------------------------------------
def test_localization_heads_pick_the_planted_heads(monkeypatch, tmp_path):
    model = make_model("llava")
    layers = list(model.model.language_model.layers)
    planted = {(1, 2), (3, 0)}
    diffuse = {(0, 1), (2, 3)}
    real = layer_view_module.layer_attention_rows

    def fake(adapter, layer, hidden, kwargs, local, rows, *rest):
        probs = real(adapter, layer, hidden, kwargs, local, rows, *rest)
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

    monkeypatch.setattr(layer_view_module, "layer_attention_rows", fake)
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
    monkeypatch.setattr(layer_view_module, "layer_attention_rows", real)
    inputs = calibration[0]
    by_heads = G.heatmap(model, inputs, heads=loaded)
    by_dict = G.heatmap(model, inputs, heads={3: [0], 1: [2]})
    torch.testing.assert_close(by_heads[1][0].grid, by_dict[1][0].grid, atol=0, rtol=0)
    with pytest.raises(ValueError, match="outside"):
        G.heatmap(model, inputs, heads={1: [9]})


def test_without_a_processor_the_adapters_fallback_places_the_grid():
    model = make_model("llava")  # LLaVA's fallback: CLIP-style shortest-side resize + centre crop
    inputs = make_inputs("llava", model, batch=1)
    size = Size(width=60, height=40)
    cropped = G.heatmap(model, inputs, sizes=size)[0][0]
    assert cropped.size == size and cropped.pixels.shape == (40, 60)
    assert cropped.frames == [Frame(10.0, 0.0, 40.0, 40.0)]
    assert float(cropped.pixels[:, :10].abs().sum()) == 0.0  # outside the central square
    padded = G.heatmap(model, inputs, sizes=size, geometry="pad")[0][0]
    assert padded.frames == [rule_frame(size, "pad")]
    torch.testing.assert_close(padded.grid, cropped.grid, atol=0, rtol=0)
    # no size: the grid is there, pixels raise and say what to pass
    bare = G.heatmap(model, inputs)[0][0]
    torch.testing.assert_close(bare.grid, cropped.grid, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"unknown .*'llava'.*Pass images="):
        _ = bare.pixels
    with pytest.raises(ValueError, match="Pass images="):
        G.point(bare)
    qwen = make_model("qwen2_vl")
    q_inputs = make_inputs("qwen2_vl", qwen, batch=1)  # merged grid 4 x 3 (rows x cols)
    heat = G.heatmap(qwen, q_inputs, sizes=Size(width=30, height=40))[0][0]
    assert heat.frames == [Frame(0.0, 0.0, 30.0, 40.0)]
    with pytest.raises(ValueError, match="swapped"):
        G.heatmap(qwen, q_inputs, sizes=Size(width=40, height=30))
    with pytest.raises(TypeError, match="ambiguous"):
        G.heatmap(qwen, q_inputs, sizes=(30, 40))


def test_layers_before_the_pruning_layer_read_as_unpruned():
    import vlm_focus as vf

    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    plain = G.heatmap(model, inputs, layers=[0, 1])
    with vf.wrap(model, pruner="fastv", keep=0.5, layer=2):
        same = G.heatmap(model, inputs, layers=[0, 1])
    for a, b in zip(plain, same, strict=True):
        torch.testing.assert_close(a[0].grid, b[0].grid, atol=1e-6, rtol=0)


def test_describe_and_ground_without_a_vocabulary_grounds_each_content_word():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    results = G.describe_and_ground(
        model,
        inputs,
        processor=WordTokenizer(),
        max_new_tokens=3,
        sizes=processed_sizes("qwen2_vl", inputs),
        generate_kwargs={"min_new_tokens": 3},
    )
    seq = inputs["input_ids"].shape[1]
    for b, described in enumerate(results):
        assert len(described.answer_ids) == 3 and len(described.answer.split()) == 3
        assert [p.positions for p in described.phrases] == [[seq], [seq + 1], [seq + 2]]
        for phrase in described.phrases:
            assert phrase.map.row == b and phrase.map.grid.shape == ((4, 3) if b == 0 else (2, 4))
            assert phrase.box is not None
            assert phrase.score == pytest.approx(G.box_share(phrase.map, phrase.box))


# --- the one-pass API -----------------------------------------------------------------------
class UnkTokenizer(WordTokenizer):
    """A WordTokenizer that spells words it cannot parse as its unknown token (id 2)."""

    unk_token_id, unk_token = 2, "<unk>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for w in text.split():
            try:
                out.append(int("".join(str(self.letters.index(c)) for c in w[1:])))
            except ValueError:
                out.append(self.unk_token_id)
        return out


def test_one_pass_serves_every_query_and_equals_the_wrappers():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    sizes = processed_sizes("qwen2_vl", inputs)
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        gp = G.GroundingPass(model, inputs, sizes=sizes, layers=[1, 2])
        seq = inputs["input_ids"].shape[1]
        last_two = torch.tensor([[seq - 2, seq - 1]] * 2)
        maps = gp.maps(last_two)
        instruction = gp.maps()
        assert len(calls) == 1  # one forward for every query
    finally:
        hook.remove()
    ref = G.heatmap(model, inputs, last_two, sizes=sizes, layers=[1, 2])
    default = G.heatmap(model, inputs, sizes=sizes, layers=[1, 2])  # the instruction
    for b in range(2):
        torch.testing.assert_close(maps[b][0].grid, ref[b][0].grid, atol=1e-6, rtol=0)
        torch.testing.assert_close(maps[b][0].pixels, ref[b][0].pixels, atol=1e-6, rtol=0)
        torch.testing.assert_close(instruction[b][0].grid, default[b][0].grid, atol=1e-6, rtol=0)
        one = gp.map(last_two, row=b)
        torch.testing.assert_close(one.grid, maps[b][0].grid, atol=0, rtol=0)
        assert gp.point(last_two, row=b) == G.point(maps[b][0])
        assert gp.boxes(last_two, row=b) == G.boxes(maps[b][0])
    box = [0, 0, 8, 8]
    torch.testing.assert_close(
        gp.region_score(last_two, box),
        G.region_score(model, inputs, box, last_two, sizes=sizes, layers=[1, 2]),
        atol=1e-6,
        rtol=0,
    )
    with pytest.raises(ValueError, match="not recorded"):
        G.GroundingPass(model, inputs, rows=last_two[:, 1:]).maps(last_two)


def test_removed_argument_names_are_refused():
    model = make_model("llava")
    inputs = {k: v[:1] for k, v in make_inputs("llava", model, batch=1).items()}
    tok = WordTokenizer()
    phrase = tok.decode(inputs["input_ids"][0, -2:].tolist())
    heat = G.heatmap(model, inputs, phrase, processor=tok, sizes=Size(width=48, height=32))[0][0]
    assert heat.size == Size(48, 32) and not hasattr(heat, "image_size")
    with pytest.raises(TypeError, match="tokenizer"):
        G.heatmap(model, inputs, phrase, tokenizer=tok, sizes=Size(48, 32))
    with pytest.raises(TypeError, match="image_size"):
        G.GroundingPass(model, inputs, processor=tok, image_size=(32, 48))
    with pytest.raises(TypeError, match="tokens"):
        G.region_score(model, inputs, [8, 4, 16, 16], tokens=phrase, processor=tok)
    with pytest.raises(TypeError, match="tokenizer"):
        G.select_localization_heads(model, [inputs], tokenizer=tok)
    with pytest.raises(TypeError, match="tokenizer"):
        G.describe_and_ground(model, inputs, processor=tok, tokenizer=tok)


def test_error_messages_name_the_place_and_the_unknown_token():
    model = make_model("llava")
    inputs = {k: v[:1] for k, v in make_inputs("llava", model, batch=1).items()}
    gp = G.GroundingPass(model, inputs, processor=UnkTokenizer())
    with pytest.raises(ValueError, match="not found in row 0 of the prompt's text") as err:
        gp.map("xjjj")
    assert "answer" not in str(err.value)
    with pytest.raises(ValueError, match="unknown token '<unk>' \\(id 2\\)"):
        gp.map("red_circle")
    with pytest.raises(ValueError, match="source='answer' needs answer="):
        gp.map("xab", source="answer")


def test_answer_is_trimmed_at_its_first_end_of_sequence_token():
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    eos = int(model.generation_config.eos_token_id or 2)
    model.generation_config.eos_token_id = eos
    answer = torch.tensor([[5, 6, eos, 7, 8], [9, 10, 11, 12, 13]])
    trimmed = G.GroundingPass(model, inputs, answer=answer)
    assert trimmed.answer_ids(0).tolist() == [5, 6] and trimmed.answer_ids(1).tolist() == [
        9,
        10,
        11,
        12,
        13,
    ]
    short = G.GroundingPass(model, {k: v[:1] for k, v in inputs.items()}, answer=answer[:1, :2])
    torch.testing.assert_close(trimmed.map(row=0).grid, short.map().grid, atol=1e-6, rtol=0)


def test_mentions_of_the_answer_and_the_prompt():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=1)
    tok = WordTokenizer()
    answer = torch.tensor([[57, 5, 63]])  # xfh, xf (too short for a content word), xgd
    gp = G.GroundingPass(model, inputs, processor=tok, answer=answer, sizes=Size(24, 32))
    seq = inputs["input_ids"].shape[1]
    (found,) = gp.mentions()
    assert [(m.text, m.positions, m.source) for m in found] == [
        ("xfh", (seq,), "answer"),
        ("xgd", (seq + 2,), "answer"),
    ]
    assert [m.positions for m in gp.mentions(objects=["xgd"])[0]] == [(seq + 2,)]
    torch.testing.assert_close(
        gp.map(found[1]).grid, gp.map(torch.tensor([[seq + 2]])).grid, atol=0, rtol=0
    )
    both = gp.map(found)  # several mentions of one row: one map of all their tokens
    torch.testing.assert_close(
        both.grid, gp.map(torch.tensor([[seq, seq + 2]])).grid, atol=0, rtol=0
    )
    last = inputs["input_ids"][0, -1:].tolist()
    within = gp.mentions(source="prompt", within=tok.decode(last))[0]
    assert [m.positions for m in within] == [(seq - 1,)]
    assert gp.answer_text() == "xfh xf xgd"


def test_places_and_question_words_are_not_mentions():
    """Without a vocabulary a mention is a content word: places (`top_right`, one token in a
    word-level vocabulary, `center`) and question words (`where`) name no object."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vlm_focus.grounding._words import find_mentions

    words = "<unk> where is the red_circle top_right center middle_left , green_square".split()
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    text = "where is the red_circle top_right , green_square center , red_circle middle_left"
    ids = tok.encode(text, add_special_tokens=False)
    found = find_mentions(ids, tok, None)
    assert found == [("red_circle", [3]), ("green_square", [6]), ("red_circle", [9])]


def test_ground_gives_the_map_point_and_boxes_in_the_images_pixels():
    from PIL import Image
    from transformers import LlavaForConditionalGeneration

    import vlm_focus as vf
    from organism.vocab import SPECS, build_config, build_processor

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    processor = build_processor(SPECS["tiny"])
    image = Image.new("RGB", (120, 80), (128, 128, 128))
    with pytest.warns(G.UnseenRegionWarning, match=r"x 20-100, y 0-80 of the 120x80 image"):
        found = vf.ground(model, processor, image, "red_circle", presence_threshold=0.0)
    assert found.present and 0.0 < found.presence < 1.0
    assert found.map.size == Size(120, 80) and found.map.pixels.shape == (80, 120)
    # the organism's processor centre-crops: the frame is the central 80 x 80 square
    assert found.map.frames == [Frame(20.0, 0.0, 80.0, 80.0)]
    assert found.seen == found.map.seen == Frame(20.0, 0.0, 80.0, 80.0)
    assert found.map.seen_share == pytest.approx(80 / 120)
    assert 20 <= found.point[0] <= 100 and 0 <= found.point[1] <= 80
    assert found.boxes and found.scores == [G.box_share(found.map, b) for b in found.boxes]
    assert all(20 <= b.x0 and b.x1 <= 100 for b in found.boxes)
    from vlm_focus.loading import build_inputs

    inputs = build_inputs(processor, image, "Is there a red_circle in the image?")
    with pytest.warns(G.UnseenRegionWarning):
        gp = G.GroundingPass(model, inputs, processor=processor, images=[image])
    assert gp.seen() == found.seen and gp.layers == G.default_layers(model) == [0]
    with pytest.warns(G.UnseenRegionWarning):
        ref = G.heatmap(model, inputs, "red_circle", processor=processor, images=[image])[0][0]
    torch.testing.assert_close(found.map.pixels, ref.pixels, atol=1e-6, rtol=0)
    # the presence score read from the same pass equals the one of its own forward pass
    assert found.presence == pytest.approx(
        G.presence(model, processor, image, ["red_circle"])[0], abs=1e-6
    )
    with pytest.raises(ValueError, match="does not contain"):
        vf.ground(model, processor, image, "red_circle", prompt="Describe it.")
    with pytest.raises(ValueError, match=r"presence_threshold=1.5 must be a number in \[0, 1\)"):
        vf.ground(model, processor, image, "red_circle", presence_threshold=1.5)
    square = Image.new("RGB", (80, 80), (128, 128, 128))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", G.UnseenRegionWarning)  # all of it seen: no warning
        assert vf.ground(model, processor, square, "red_circle").seen == Frame(0, 0, 80, 80)


def test_ground_accepts_arrays_and_tensors_and_says_what_it_accepts():
    from PIL import Image
    from transformers import LlavaForConditionalGeneration

    import vlm_focus as vf
    from organism.vocab import SPECS, build_config, build_processor

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
    processor = build_processor(SPECS["tiny"])
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(48, 48, 3), dtype=np.uint8)
    ref = vf.ground(model, processor, Image.fromarray(pixels), "red_circle", presence_threshold=0)
    unit = pixels.astype(np.float32) / 255
    forms = {
        "float [0, 1] HWC": unit,
        "float [0, 255] HWC": pixels.astype(np.float64),
        "uint8 CHW tensor": torch.from_numpy(pixels).permute(2, 0, 1),
        "float [0, 1] CHW tensor": torch.from_numpy(unit).permute(2, 0, 1),
        "float HWC tensor": torch.from_numpy(unit),
    }
    for name, image in forms.items():
        found = vf.ground(model, processor, image, "red_circle", presence_threshold=0)
        assert found.map.size == Size(48, 48), name
        torch.testing.assert_close(found.map.pixels, ref.map.pixels, atol=1e-6, rtol=0)
        assert found.presence == pytest.approx(ref.presence, abs=1e-6), name
    grey = vf.ground(model, processor, pixels[:, :, 0], "red_circle")  # [H, W]
    assert grey.map.size == Size(48, 48)
    bad = {
        "dtype bool": (np.zeros((8, 8, 3), bool), TypeError),
        r"values in \[-1, -1\]; accepted": (np.full((8, 8, 3), -1.0), ValueError),
        r"values in \[300, 300\]": (np.full((8, 8, 3), 300.0), ValueError),
        "NaN": (np.full((8, 8, 3), np.nan), ValueError),
        r"shape \[1, 3, 8, 8\]; accepted": (torch.zeros(1, 3, 8, 8), ValueError),
        "both its first and last axes": (np.zeros((3, 8, 3), np.uint8), ValueError),
        "of type list; accepted: a PIL image, a path": ([[0, 1], [2, 3]], TypeError),
    }
    for message, (image, kind) in bad.items():
        with pytest.raises(kind, match=message):
            vf.ground(model, processor, image, "red_circle")


# --- the embedded organisms: default layers, presence ---------------------------------------
@pytest.fixture(scope="module")
def organism():
    from vlm_focus.loading import load_model

    return load_model(dtype=torch.float32)


@pytest.mark.slow  # five forward passes over ~36 rows: about 30 s on two busy cores
def test_default_layers_point_as_well_as_the_best_layer_on_unseen_scenes(organism):
    """Held-out scenes (never trained on), square, padded to 2:1 and stretched to 2:1 (only the
    objects inside the centre the processor keeps), all in one batch: the default map points
    as well as the best single layer, and better than every layer averaged (the old default)."""
    import warnings

    from PIL import Image

    from organism.scenes import CATEGORIES, heldout_scenes
    from vlm_focus.loading import build_inputs

    model, processor = organism
    n_layers = len(get_adapter(model).decoder_layers(model))
    assert G.default_layers(model) == model.config.vlm_focus_grounding["layers"]
    pictures, names, targets, kinds = [], [], [], []
    for s in heldout_scenes(4, min_objects=3):
        square = Image.fromarray(s.image())
        padded = Image.new("RGB", (2 * s.size, s.size), s.background)
        padded.paste(square, (s.size // 2, 0))
        stretched = square.resize((2 * s.size, s.size), Image.Resampling.BICUBIC)
        for obj in s.objects:
            x, y, w, h = obj.box(s.size)
            boxes = {
                "square": (square, (x, y, w, h)),
                "padded": (padded, (x + s.size // 2, y, w, h)),
                "stretched": (stretched, (2 * x, y, 2 * w, h)),
            }
            for kind, (image, box) in boxes.items():
                if box[0] < s.size // 2 and kind == "stretched":
                    continue  # outside the part the processor keeps
                if box[0] + box[2] > 3 * s.size // 2 and kind == "stretched":
                    continue
                pictures.append(image)
                names.append(CATEGORIES[obj.category])
                targets.append(box)
                kinds.append(kind)
    inputs = build_inputs(processor, pictures, [f"Is there a {n} in the image?" for n in names])
    ids = torch.tensor([processor.tokenizer.convert_tokens_to_ids(n) for n in names])
    query = inputs["input_ids"] == ids[:, None]  # [B, S]: each row's category token
    hits = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", G.UnseenRegionWarning)  # the wide ones: expected
        for layers in [None] + [[i] for i in range(n_layers)]:
            gp = G.GroundingPass(
                model, inputs, processor=processor, images=pictures, layers=layers, rows=query
            )
            hits[str(layers)] = [gp.map(query, row=b) for b in range(len(names))]
    # every layer averaged: the mean of the single layers' maps (a map is linear in them)
    every = []
    for b in range(len(names)):
        parts = [hits[str([i])][b] for i in range(n_layers)]
        every.append(
            dataclasses.replace(
                parts[0],
                grid=torch.stack([m.grid for m in parts]).mean(0),
                views=[torch.stack([m.views[0] for m in parts]).mean(0)],
                _pixels=None,
            )
        )
    hits["every"] = every

    def inside(pt, box):
        return box[0] <= pt[0] <= box[0] + box[2] and box[1] <= pt[1] <= box[1] + box[3]

    for kind in ("square", "padded", "stretched"):
        rows = [b for b, k in enumerate(kinds) if k == kind]
        assert len(rows) >= 6, kind
        rate = {
            name: float(np.mean([inside(G.point(maps[b]), targets[b]) for b in rows]))
            for name, maps in hits.items()
        }
        best = max(rate[str([i])] for i in range(n_layers))
        assert rate["None"] >= best, (kind, rate)
        assert rate["None"] > rate["every"] or kind == "stretched", (kind, rate)
        assert rate["None"] >= rate["every"], (kind, rate)


def test_absent_and_unknown_phrases_get_no_point_present_ones_do(organism):
    """scene_9000001: a green_square, purple_circle, red_triangle and purple_square; no
    red_circle; the tokenizer does not know "elephant"."""
    from pathlib import Path

    from PIL import Image

    import vlm_focus as vf

    model, processor = organism
    image = Image.open(Path(__file__).parents[1] / "vlm_focus/assets/samples/scene_9000001.png")
    threshold = G.presence_threshold(model)
    assert threshold == model.config.vlm_focus_grounding["presence_threshold"]
    square = vf.ground(model, processor, image, "green_square")  # every layer: (167.5, 26.5)
    assert square.present and square.presence > threshold and square.threshold == threshold
    x, y = square.point
    assert 92 <= x <= 125 and 62 <= y <= 94  # inside the square's box (92, 62, 33, 32)
    assert square.boxes and square.seen == Frame(0, 0, 192, 192)
    circle = vf.ground(model, processor, image, "red_circle")
    with pytest.warns(G.UnknownWordWarning, match="'elephant'"):
        elephant = vf.ground(model, processor, image, "elephant")
    for found in (circle, elephant):
        assert not found.present and found.presence <= threshold, found.phrase
        assert found.point is None and found.boxes == [] and found.scores == [], found.phrase
        assert found.map.mass > 0  # the map is still there to look at
    assert elephant.presence == 0.0 and elephant.unknown_words == ["elephant"]  # never read
    # a custom prompt asks the presence question in a pass of its own
    custom = vf.ground(model, processor, image, "green_square", prompt="Where is the green_square?")
    assert custom.presence == pytest.approx(square.presence, abs=1e-6) and custom.present


def test_words_the_tokenizer_cannot_read_are_named_in_a_warning_and_the_result(organism):
    """The organism's tokenizer spells `green_square` as one word and knows neither `green`
    nor `square`: the phrase scores 0 and the warning and the result say which words."""
    import warnings
    from pathlib import Path

    from PIL import Image

    import vlm_focus as vf

    model, processor = organism
    image = Image.open(Path(__file__).parents[1] / "vlm_focus/assets/samples/scene_9000001.png")
    with pytest.warns(G.UnknownWordWarning, match=r"does not know 'green', 'square'"):
        found = vf.ground(model, processor, image, "green square")
    assert found.unknown_words == ["green", "square"]
    assert found.presence == 0.0 and not found.present
    long = "a large green_square, sitting near the top of this picture"  # ten words
    with pytest.warns(G.UnknownWordWarning, match="'large', 'sitting', 'near', 'this', 'picture'"):
        found = vf.ground(model, processor, image, long)
    assert found.unknown_words == ["large", "sitting", "near", "this", "picture"]
    assert found.presence == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", G.UnknownWordWarning)
        square = vf.ground(model, processor, image, "green_square")
    assert square.unknown_words == [] and square.present


def test_unknown_words_are_the_words_that_encode_to_the_unknown_token():
    """The rule reads the tokenizer, not a word list: a word is unknown when every way the
    tokenizer spells it holds its unknown token; a tokenizer without one knows every word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "is": 1, "there": 2, "a": 3, "red_circle": 4, "or": 5, "?": 6, ",": 7}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    text = "Is there a red circle, a red_circle or a red circle?"
    assert G.unknown_words(text, tok) == ["Is", "red", "circle"]  # once each, in order
    assert G.unknown_words("is there a red_circle ?", tok) == []
    assert G.unknown_words("anything at all", WordTokenizer()) == []  # no unknown token
    assert G.unknown_words("x xb", UnkTokenizer()) == ["x"]  # "x" spells no number


def test_an_unknown_config_value_raises_naming_the_key(organism):
    import copy

    model, _ = organism
    other = copy.copy(model)
    other.config = copy.deepcopy(model.config)
    other.config.vlm_focus_grounding = {"layers": [9], "presence_threshold": 0.5}
    with pytest.raises(ValueError, match=r"vlm_focus_grounding\['layers'\]=\[9\] does not fit"):
        G.default_layers(other)
    other.config.vlm_focus_grounding = {"presence_threshold": 2}
    with pytest.raises(ValueError, match=r"must be a number in \(0, 1\)"):
        G.presence_threshold(other)
    del other.config.vlm_focus_grounding
    assert G.default_layers(other) == G.rule_layers(4) == [0]
    assert G.presence_threshold(other) == G.PRESENCE_THRESHOLD
    assert [G.rule_layers(n) for n in (1, 3, 8, 32)] == [[0], [0], [0, 1], list(range(8))]


def test_import_vlm_focus_loads_neither_opencv_nor_a_modeling_module():
    import subprocess
    import sys

    code = (
        "import sys, vlm_focus as vf; assert callable(vf.ground); "
        "bad = sorted(m for m in sys.modules if m == 'cv2' or m.startswith('cv2.') or "
        "(m.startswith('transformers.models.') and '.modeling_' in m)); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_readme_grounding_example_gives_the_pixels_of_a_non_square_photo(tmp_path):
    from pathlib import Path

    from PIL import Image

    readme = (Path(__file__).parents[1] / "docs" / "grounding.md").read_text()
    section = readme[readme.index("# Grounding and hallucination mitigation") :]
    code = section[section.index("```python") + len("```python") : section.index("```\n", 10)]
    code = code[: code.index("with hallucination.")]  # the grounding part
    sample = "vlm_focus/assets/samples/scene_9000001.png"
    assert sample in code
    square = Image.open(Path(__file__).parents[1] / sample).convert("RGB")
    wide = Image.new("RGB", (square.width * 3 // 2, square.height), square.getpixel((0, 0)))
    left = (wide.width - square.width) // 2
    wide.paste(square, (left, 0))
    wide.save(tmp_path / "wide.png")
    runs = {}
    for name, path in (
        ("square", Path(__file__).parents[1] / sample),
        ("wide", tmp_path / "wide.png"),
    ):
        scope: dict = {}
        if name == "wide":  # the processor centre-crops: the padding is never seen, and says so
            with pytest.warns(G.UnseenRegionWarning, match="saw only part of the image"):
                exec(compile(code.replace(sample, str(path)), "README.md", "exec"), scope)
        else:
            exec(compile(code.replace(sample, str(path)), "README.md", "exec"), scope)
        runs[name] = scope
    sq, wd = runs["square"], runs["wide"]
    assert sq["found"].present and sq["found"].seen == Frame(0, 0, square.width, square.height)
    assert wd["found"].seen == Frame(left, 0, square.width, square.height)
    assert wd["heat"].size == Size(wide.width, wide.height)
    assert wd["heat"].frames == [Frame(float(left), 0.0, square.width, square.height)]
    assert wd["x"] == pytest.approx(sq["x"] + left) and wd["y"] == pytest.approx(sq["y"])
    assert wd["found"].point == pytest.approx((sq["found"].point[0] + left, sq["found"].point[1]))
    assert wd["best"].x0 == pytest.approx(sq["best"].x0 + left)
    assert wd["best"].width == sq["best"].width
    assert float(wd["conf"][0]) == pytest.approx(float(sq["conf"][0]), abs=1e-6)


def test_seen_region_is_the_covered_pixels_bounding_rectangle_and_share():
    from vlm_focus.geometry import coverage, seen_region

    rng = np.random.default_rng(0)
    for _ in range(200):
        size = Size(int(rng.integers(1, 50)), int(rng.integers(1, 50)))
        frames = [
            Frame(*rng.uniform(-30, 40, 2), *rng.uniform(0.5, 80, 2))
            for _ in range(int(rng.integers(1, 4)))
        ]
        region, share = seen_region(size, frames)
        mask = coverage(size, frames)
        assert share == pytest.approx(float(mask.double().mean()), abs=1e-12)
        rows, cols = torch.nonzero(mask.any(1)).flatten(), torch.nonzero(mask.any(0)).flatten()
        if rows.numel() == 0:
            assert region == Frame(0, 0, 0, 0)
            continue
        x0, y0 = int(cols[0]), int(rows[0])
        assert region == Frame(x0, y0, int(cols[-1]) + 1 - x0, int(rows[-1]) + 1 - y0)
    # a centre crop of a 2:1 photo: the central square, half of it
    assert seen_region(Size(384, 192), [Frame(96, 0, 192, 192)]) == (Frame(96, 0, 192, 192), 0.5)
