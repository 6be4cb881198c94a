"""Hallucination mitigation: each method changes logits only while active, restores exactly on
exit, runs generate() on a left-padded batch of 2; VAS and IAVA against their formulas."""

from __future__ import annotations

import re

import pytest
import torch
from reference import greedy_scores
from tiny_models import KINDS, make_inputs, make_model

import vlm_focus as vf
from vlm_focus import hallucination as H
from vlm_focus.config import keep_count
from vlm_focus.hallucination._reweight import relevant_tokens
from vlm_focus.model_adapters import get_adapter


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _generate(model, inputs, steps=4, **kwargs):
    return greedy_scores(model, inputs, steps, **kwargs)


def _last_visual(model, inputs):
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    index = torch.arange(visual.shape[1]).expand_as(visual)
    return torch.where(visual, index, -1).amax(1)  # [B]


# --- VAS ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_vas_equals_visual_share_of_eager_attention(kind):
    model = make_model(kind, "eager")
    inputs = make_inputs(kind, model, batch=2)
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"]).float()
    want = torch.stack(
        [torch.einsum("bhs,bs->bh", a[:, :, -1], visual).mean(-1) for a in attentions], 1
    )  # [B, L]
    got = H.vas(model, inputs)
    torch.testing.assert_close(got.per_layer, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.overall, want.mean(1), atol=1e-5, rtol=0)
    assert got.per_head.shape == (2, 4, 4)
    sdpa = make_model(kind, "sdpa")
    torch.testing.assert_close(H.vas(sdpa, inputs).per_layer, want, atol=1e-5, rtol=0)
    text = H.vas(model, inputs, query_rows="text", layers=[1])
    assert text.per_layer.shape == (2, 1) and text.layers == [1]


# --- attention reweighting ------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_attention_reweight_changes_text_rows_only_while_active(kind):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    valid = inputs["attention_mask"].bool()
    base = _logits(model, inputs)
    base_seq, base_scores = _generate(model, inputs)
    with H.attention_reweight(model, strength=3.0, layers=[0, 2], ratio=0.25) as rw:
        boosted = _logits(model, inputs)
        seq, scores = _generate(model, inputs)
        relevant = rw.relevant[0]
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    n_visual = visual.sum(1).tolist()
    assert relevant.sum(1).tolist() == [keep_count(0.25, n) for n in n_visual]
    assert bool((relevant <= visual).all())
    last = _last_visual(model, inputs)
    for b in range(2):
        prefix = valid[b].clone()
        prefix[last[b] + 1 :] = False
        # rows up to the image are untouched; the instruction rows change
        torch.testing.assert_close(boosted[b][prefix], base[b][prefix], atol=1e-5, rtol=0)
        assert float((boosted[b, last[b] + 1 :] - base[b, last[b] + 1 :]).abs().max()) > 1e-3
    assert float((scores - base_scores).abs().max()) > 1e-3  # decode steps are biased too
    assert seq.shape == base_seq.shape
    # exact restore
    assert torch.equal(_logits(model, inputs), base)
    after_seq, after_scores = _generate(model, inputs)
    assert torch.equal(after_seq, base_seq) and torch.equal(after_scores, base_scores)
    with H.attention_reweight(model, strength=0.0):
        assert torch.equal(_logits(model, inputs), base)


def test_attention_reweight_is_the_same_under_sdpa_and_eager():
    out = {}
    for attn in ("sdpa", "eager"):
        model = make_model("llava_next", attn)
        inputs = make_inputs("llava_next", model, batch=2)
        with H.attention_reweight(model, strength=2.0, layers=[1, 3]):
            out[attn] = _generate(model, inputs)
    assert torch.equal(out["sdpa"][0], out["eager"][0])
    torch.testing.assert_close(out["sdpa"][1], out["eager"][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("n_visual", "ratio", "want"), [(5, 0.25, 1), (10, 0.25, 2), (6, 0.25, 2)])
def test_relevant_tokens_count_by_the_keep_rule(n_visual, ratio, want):
    # vf.wrap's rule, round(ratio * n) with halves to even (ceil would give 2, 3 and 2)
    visual = torch.zeros(2, 12, dtype=torch.bool)
    visual[:, 3 : 3 + n_visual] = True
    scores = torch.arange(12, dtype=torch.float32).flip(0).expand(2, 12)  # earlier is higher
    relevant = relevant_tokens(scores, visual, ratio)
    assert relevant.sum(1).tolist() == [want, want] == [keep_count(ratio, n_visual)] * 2
    assert torch.nonzero(relevant[0]).flatten().tolist() == list(range(3, 3 + want))


def test_attention_reweight_checks_its_arguments():
    model = make_model("llava")
    with pytest.raises(ValueError, match="ratio"):
        H.attention_reweight(model, ratio=0.0)
    with pytest.raises(ValueError, match="layer"):
        H.attention_reweight(model, layers=[9])
    with pytest.raises(TypeError):
        H.attention_reweight(model, strength="high")
    flash = make_model("llava")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        H.attention_reweight(flash)


# --- visual beam ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
def test_visual_beam_adds_the_visual_share_and_restores(kind):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    base_seq, base_scores = _generate(model, inputs, num_beams=2)
    with H.visual_beam(model, weight=0.0) as proc:
        seq0, scores0 = _generate(model, inputs, num_beams=2, logits_processor=[proc])
    assert torch.equal(seq0, base_seq)
    torch.testing.assert_close(scores0, base_scores, atol=1e-6, rtol=0)
    with H.visual_beam(model, weight=5.0, layers=[0, 1]) as proc:
        seq, _ = _generate(model, inputs, num_beams=2, logits_processor=[proc])
        first = proc.history[0]
        scores = torch.randn(4, 7)
        torch.testing.assert_close(proc(None, scores), scores + 5.0 * proc.current[:, None])
    # the first step's term is the prompt's last-token VAS (per beam row)
    want = H.vas(model, inputs, layers=[0, 1]).overall.repeat_interleave(2)
    torch.testing.assert_close(first, want, atol=1e-5, rtol=0)
    assert len(proc.history) == 4 and seq.shape == base_seq.shape
    after_seq, after_scores = _generate(model, inputs, num_beams=2)
    assert torch.equal(after_seq, base_seq) and torch.equal(after_scores, base_scores)
    with pytest.raises(RuntimeError, match="context manager"):
        proc(None, scores)


# --- instruction contrast (IAVA) ------------------------------------------------------------
def test_instruction_contrast_equals_its_formula():
    model = make_model("llava", "eager")
    inputs = make_inputs("llava", model, batch=1)
    generic = make_inputs("llava", model, batch=1, seed=1)
    generic["pixel_values"] = inputs["pixel_values"]  # same image, another instruction
    proc = H.instruction_contrast(model, inputs, generic, alpha=0.7, beta=0.9, ratio=0.5)
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    assert int(proc.irrelevant.sum()) == 8 and bool((proc.irrelevant <= visual).all())
    full = _logits(model, inputs)[:, -1]
    # reference: the relevant visual tokens hidden through the ordinary 2-D attention mask
    hidden_mask = inputs["attention_mask"].clone()
    hidden_mask[proc.blocked] = 0
    irrelevant = _logits(model, {**inputs, "attention_mask": hidden_mask})[:, -1]
    probs = full.softmax(-1)
    want = (1.7 * full - 0.7 * irrelevant).masked_fill(
        probs < 0.9 * probs.amax(-1, keepdim=True), float("-inf")
    )
    with proc:
        got = proc(inputs["input_ids"], full)
    torch.testing.assert_close(proc.last_irrelevant_logits, irrelevant, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert bool(torch.isinf(got).any()) and bool(torch.isfinite(got).any())
    assert torch.equal(proc(inputs["input_ids"], full), full)  # inactive after exit


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_instruction_contrast_generates_a_batch_and_restores(kind):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    generic = make_inputs(kind, model, batch=2, prompt_len=3, seed=5)
    for key in ("pixel_values", "image_grid_thw"):
        if key in inputs:
            generic[key] = inputs[key]
    base_seq, base_scores = _generate(model, inputs)
    with H.instruction_contrast(model, inputs, generic, alpha=1.0, beta=0.0) as proc:
        seq, scores = _generate(model, inputs, logits_processor=[proc])
    assert seq.shape == base_seq.shape
    assert float((scores - base_scores).abs().max()) > 1e-3
    # step 0 equals the formula with the processor's own contrast logits
    after_seq, after_scores = _generate(model, inputs)
    assert torch.equal(after_seq, base_seq) and torch.equal(after_scores, base_scores)
    with pytest.raises(ValueError, match="beta"):
        H.instruction_contrast(model, inputs, generic, beta=1.0)
    with pytest.raises(TypeError):
        H.instruction_contrast(model, inputs, None)


# --- names and keywords -----------------------------------------------------------------------
@pytest.mark.parametrize("old", ["reweight", "beam", "contrast"])
def test_only_the_registry_names_are_mitigations(old):
    allowed = "none, attention_reweight, content_free, instruction_contrast, visual_beam"
    with pytest.raises(ValueError, match=f"unknown mitigation '{old}'; allowed: {allowed}"):
        H.mitigation_name(old)
    with pytest.raises(ValueError, match="unknown mitigation"):
        H.get_mitigation(old)
    with pytest.raises(ValueError, match=f"mitigation name '{old}' is reserved"):
        H.register_mitigation(type("Old", (H.VisualBeam,), {"name": old}))  # never another


def test_vas_takes_query_rows_only():
    model = make_model("llava")
    inputs = make_inputs("llava", model)
    with pytest.raises(TypeError, match="query"):
        H.vas(model, inputs, query="text")


# --- one registration shape: typed options, a checking decorator, generated tables -----------
def test_mitigation_options_are_each_options_dataclass_as_pruner_options_are():
    from vlm_focus.core.options import options

    for name in H.mitigations():
        cls = H.get_mitigation(name)
        infos = vf.mitigation_options(name)
        assert infos == options(cls.Options) and all(info.help for info in infos)
        assert cls.parameters() == {info.name: info.default for info in infos}
    strength, layers, ratio, placement, *_ = vf.mitigation_options("attention_reweight")
    assert (strength.name, strength.type, strength.default) == ("strength", "float", 1.0)
    assert (layers.name, layers.type, ratio.default) == ("layers", "list[int] | None", 0.25)
    assert (placement.name, placement.default) == ("placement", "relevant")
    assert H.get_mitigation("visual_beam").describe(weight=2.0) == {
        "mitigation": "visual_beam",
        "weight": 2.0,
        "layers": None,
        "num_beams": 3,
    }
    with pytest.raises(ValueError, match="unknown mitigation 'nope'; allowed: none"):
        vf.mitigation_options("nope")


def test_mitigation_options_are_checked_by_their_dataclass_before_any_model():
    from vlm_focus.setting import RunSetting

    with pytest.raises(ValueError, match=r"ratio must lie in \(0, 1\], got 0"):
        RunSetting(mitigation="attention_reweight", mitigation_options={"ratio": 0})
    with pytest.raises(ValueError, match=r"beta \(plausibility cutoff\) must lie in \[0, 1\)"):
        H.get_mitigation("instruction_contrast").parameters(beta=1.0)
    with pytest.raises(TypeError, match="weight must be a number, got 'x'"):
        H.get_mitigation("visual_beam").options(weight="x")
    with pytest.raises(TypeError, match="ratio must be a number, got '0.5'"):
        H.get_mitigation("instruction_contrast").options(ratio="0.5")
    with pytest.raises(ValueError, match="unknown parameter 'width' for mitigation 'visual_beam'"):
        H.get_mitigation("visual_beam").options(width=4)


def test_register_mitigation_checks_what_it_registers(monkeypatch):
    monkeypatch.setattr(H.registry, "_MITIGATIONS", dict(H.registry._MITIGATIONS))
    with pytest.raises(ValueError, match="'attention_reweight' is already registered"):
        H.register_mitigation(H.AttentionReweight)
    assert H.register_mitigation(H.AttentionReweight, replace=True) is H.AttentionReweight
    with pytest.raises(ValueError, match="'Odd-Name' must be a lowercase identifier"):
        H.register_mitigation(type("Odd", (H.AttentionReweight,), {"name": "Odd-Name"}))
    with pytest.raises(TypeError, match="expects a Mitigation subclass"):
        H.register_mitigation(H.attention_reweight)
    with pytest.raises(TypeError, match="Options must be a dataclass"):
        H.register_mitigation(type("Loose", (H.Mitigation,), {"name": "loose", "Options": dict}))
    assert H.mitigations() == [
        "attention_reweight",
        "content_free",
        "instruction_contrast",
        "visual_beam",
        "visual_contrast",
    ]


def test_the_mitigations_command_prints_every_option(capsys):
    from vlm_focus import cli

    assert cli.main(["mitigations"]) == 0
    out = capsys.readouterr().out
    for name in H.mitigations():
        summary = H.get_mitigation(name).summary
        assert re.search(rf"^{name}: {re.escape(summary)}$", out, re.M)
        for info in H.mitigation_options(name):
            line = f"    {info.name}"
            assert re.search(rf"^{line} +{re.escape(info.type)} = {info.default_text}  ", out, re.M)
            assert info.help in out
    assert "    and generate() with num_beams=3" in out
