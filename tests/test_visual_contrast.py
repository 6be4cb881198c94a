"""visual_contrast (VCD / M3ID): each branch's logits against the model run by hand on the
degraded prompt, one step against the formula, generate() in batches, SDPA and eager, pruned,
restored on exit, and its options and registry entry."""

from __future__ import annotations

import math

import pytest
import torch
from reference import greedy_out, masked_reference
from tiny_models import make_inputs, make_model
from tiny_processors import PLACEHOLDERS, noise_image, ramp_image, tiny_processor

import vlm_focus as vf
from vlm_focus import hallucination as H
from vlm_focus.generation import extend_with_answer
from vlm_focus.hallucination._visual_contrast import alpha_bar
from vlm_focus.model_adapters import get_adapter
from vlm_focus.setting import RunSetting
from vlm_focus.trace import FocusTrace

ATOL = 1e-4


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits[:, -1]


def _generate(model, inputs, steps=4, **kwargs):
    out = greedy_out(model, inputs, steps, **kwargs)
    return out.sequences, torch.stack(out.scores, 1)


def _alpha_bar(step, schedule):
    """VCD's code (sigmoid) or DDPM's linear schedule, written out."""
    if schedule == "sigmoid":
        x = torch.linspace(-6, 6, 1000, dtype=torch.float64)
        betas = 1 / (1 + torch.exp(-x)) * (0.5e-2 - 1e-5) + 1e-5
    else:
        betas = 0.0001 + (0.02 - 0.0001) * torch.arange(1000, dtype=torch.float64) / 999
    return math.prod((1 - betas[: step + 1]).tolist())


def _noised(kind, inputs, step, schedule):
    """The prompt's pixels after forward diffusion, the noise drawn per image with seed 0."""
    pixels = inputs["pixel_values"]
    if kind.startswith("qwen"):
        sizes = inputs["image_grid_thw"].prod(-1).tolist()
        eps = torch.cat(
            [
                torch.randn(n, pixels.shape[1], generator=torch.Generator().manual_seed(0))
                for n in sizes
            ]
        )
    else:  # [B, 3, H, W]: one draw per image, the same for every image
        one = torch.randn(pixels.shape[1:], generator=torch.Generator().manual_seed(0))
        eps = one.expand_as(pixels)
    abar = _alpha_bar(step, schedule)
    return {**inputs, "pixel_values": math.sqrt(abar) * pixels + math.sqrt(1 - abar) * eps}


def _processor_inputs(kind, model, image: bool):
    """Two left-padded chats built by the real processor, with their images or without."""
    processor = tiny_processor(model)
    placeholder = PLACEHOLDERS[kind][0] if image else ""
    texts = [
        f"USER: {placeholder} what is in this image ? ASSISTANT:",
        f"USER: {placeholder} describe the image ASSISTANT:",
    ]
    images = [ramp_image(40, 30), noise_image(30, 50, 1)] if image else None
    return dict(processor(text=texts, images=images, padding=True, return_tensors="pt"))


def _row(kind, inputs, b):
    """Row ``b`` of a left-padded batch alone, its padding stripped."""
    keep = inputs["attention_mask"][b].bool()
    out = {k: inputs[k][b : b + 1, keep] for k in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = inputs["mm_token_type_ids"][b : b + 1, keep]
    if kind.startswith("qwen"):
        sizes = inputs["image_grid_thw"].prod(-1).tolist()
        start = sum(sizes[:b])
        out["pixel_values"] = inputs["pixel_values"][start : start + sizes[b]]
        out["image_grid_thw"] = inputs["image_grid_thw"][b : b + 1]
    else:
        out["pixel_values"] = inputs["pixel_values"][b : b + 1]
    return out


# --- each branch against the model run by hand ---------------------------------------------
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
@pytest.mark.parametrize(
    ("branch", "schedule"), [("blank", "sigmoid"), ("noise", "sigmoid"), ("noise", "linear")]
)
def test_image_branches_equal_the_model_on_the_degraded_pixels(kind, branch, schedule):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    if branch == "blank":
        degraded = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    else:
        degraded = _noised(kind, inputs, 300, schedule)
    proc = H.visual_contrast(model, inputs, branch=branch, noise_step=300, schedule=schedule)
    answer = torch.randint(3, 100, (2, 3), generator=torch.Generator().manual_seed(1))
    # the branch keeps its own cache: the prompt, one token, then two at once, then another
    # answer (a new generate() call) from the start
    for n, tokens in ((0, answer), (1, answer), (3, answer), (2, answer.flip(0))):
        sequence = torch.cat([inputs["input_ids"], tokens[:, :n]], 1)
        want = _logits(model, extend_with_answer(degraded, tokens[:, :n])[0])
        torch.testing.assert_close(proc.branch_logits(sequence), want, atol=ATOL, rtol=0)
    answer = answer.flip(0)[:, :2]
    assert float((want - _logits(model, extend_with_answer(inputs, answer)[0])).abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_text_branch_equals_the_prompt_built_without_the_image(kind):
    model = make_model(kind)
    inputs = _processor_inputs(kind, model, image=True)
    text = _processor_inputs(kind, model, image=False)
    proc = H.visual_contrast(model, inputs, branch="text")
    answer = torch.randint(3, 100, (2, 2), generator=torch.Generator().manual_seed(2))
    for n in (0, 2):
        sequence = torch.cat([inputs["input_ids"], answer[:, :n]], 1)
        want = _logits(model, extend_with_answer(text, answer[:, :n])[0])
        torch.testing.assert_close(proc.branch_logits(sequence), want, atol=ATOL, rtol=0)
    # the re-padded prompt is the processor's, token for token
    assert torch.equal(proc.branch_inputs["attention_mask"], text["attention_mask"])
    valid = text["attention_mask"].bool()
    assert torch.equal(proc.branch_inputs["input_ids"][valid], text["input_ids"][valid])


def test_noise_is_drawn_per_image_and_repeats():
    model = make_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, batch=2)
    once = H.visual_contrast(model, inputs).branch_inputs["pixel_values"]
    again = H.visual_contrast(model, inputs).branch_inputs["pixel_values"]
    assert torch.equal(once, again)
    alone = H.visual_contrast(model, _row("qwen2_vl", inputs, 1)).branch_inputs["pixel_values"]
    assert torch.equal(alone, once[-alone.shape[0] :])  # row 1's image, noised as in the batch
    assert alpha_bar(0, "linear") == pytest.approx(1 - 1e-4)
    assert alpha_bar(500) == pytest.approx(_alpha_bar(500, "sigmoid"), rel=1e-9)


# --- one step against the formula -------------------------------------------------------------
def test_one_step_equals_the_formula_by_hand(tmp_path):
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    answer = torch.randint(3, 100, (2, 2), generator=torch.Generator().manual_seed(3))
    sequence = torch.cat([inputs["input_ids"], answer], 1)  # t = 2
    scores = torch.randn(2, 128, generator=torch.Generator().manual_seed(4)) * 3
    centre = torch.randn(128, generator=torch.Generator().manual_seed(5)) * 0.1
    branch = _logits(model, extend_with_answer(blank, answer)[0])
    l_f = scores - scores.logsumexp(-1, keepdim=True)
    l_b = branch - branch.logsumexp(-1, keepdim=True)
    w = 0.7 * (math.exp(0.3 * 2) - 1)
    p_f = scores.softmax(-1)
    want = (l_f + w * (l_f - l_b - centre)).masked_fill(
        p_f < 0.2 * p_f.amax(-1, keepdim=True), float("-inf")
    )
    path = tmp_path / "centre.pt"
    torch.save(centre, path)
    for given in (centre, str(path)):
        options = dict(branch="blank", weight=0.7, growth=0.3, beta=0.2, centre=given)
        with H.visual_contrast(model, inputs, **options) as proc:
            got = proc(sequence, scores)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert bool(torch.isinf(got).any()) and bool(torch.isfinite(got).any())
    assert torch.equal(proc(sequence, scores), scores)  # inactive after exit
    # beta 0 keeps every token; growth 0 is VCD's constant weight
    with H.visual_contrast(model, inputs, branch="blank", weight=2.0, beta=0.0) as proc:
        got = proc(sequence, scores)
    torch.testing.assert_close(got, l_f + 2.0 * (l_f - l_b), atol=ATOL, rtol=0)


def test_contrast_centre_is_the_mean_difference_at_the_answer_position():
    model = make_model("llava")
    batches = [make_inputs("llava", model, batch=2, seed=s) for s in (0, 1)]
    got = H.contrast_centre(model, batches, branch="blank")
    rows = []
    for inputs in batches:
        blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
        rows.append(_logits(model, inputs).log_softmax(-1) - _logits(model, blank).log_softmax(-1))
    torch.testing.assert_close(got, torch.cat(rows).mean(0), atol=ATOL, rtol=0)
    assert got.shape == (128,) and got.device.type == "cpu"
    with pytest.raises(ValueError, match="at least one batch"):
        H.contrast_centre(model, [])


# --- generate() ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_weight_zero_and_the_first_token_under_growth_are_unchanged(kind):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    base_seq, base_scores = _generate(model, inputs)
    with H.visual_contrast(model, inputs, weight=0.0) as proc:
        seq, _ = _generate(model, inputs, logits_processor=[proc])
    assert torch.equal(seq, base_seq) and proc.last_branch_logits is None  # never ran
    with H.visual_contrast(model, inputs, growth=1.0, beta=0.0) as proc:
        seq, scores = _generate(model, inputs, logits_processor=[proc])
    prompt = inputs["input_ids"].shape[1]
    assert torch.equal(seq[:, prompt], base_seq[:, prompt])
    torch.testing.assert_close(scores[:, 0], base_scores[:, 0].log_softmax(-1), atol=1e-5, rtol=0)
    later = scores[:, 1:] - base_scores[:, 1:].log_softmax(-1)
    assert float(later.nan_to_num(0.0).abs().max()) > 1e-3  # -inf - -inf: min_new_tokens' EOS


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("branch", ["noise", "blank", "text"])
def test_a_left_padded_batch_equals_each_row_alone(kind, branch):
    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    with H.visual_contrast(model, inputs, branch=branch, beta=0.0) as proc:
        seq, scores = _generate(model, inputs, logits_processor=[proc])
    width = inputs["input_ids"].shape[1]
    for b in range(2):
        row = _row(kind, inputs, b)
        with H.visual_contrast(model, row, branch=branch, beta=0.0) as proc:
            seq_b, scores_b = _generate(model, row, logits_processor=[proc])
        assert torch.equal(seq[b, width:], seq_b[0, row["input_ids"].shape[1] :])
        torch.testing.assert_close(scores[b], scores_b[0], atol=ATOL, rtol=0)


def test_sdpa_and_eager_agree_and_exit_restores_the_model():
    out = {}
    for attn in ("sdpa", "eager"):
        model = make_model("llava_next", attn)
        inputs = make_inputs("llava_next", model, batch=2)
        base = _logits(model, inputs)
        base_seq, base_scores = _generate(model, inputs)
        with H.mitigate(model, "visual_contrast", inputs, branch="noise") as active:
            out[attn] = _generate(model, inputs, **active.generate_kwargs())
        assert torch.equal(_logits(model, inputs), base)
        after_seq, after_scores = _generate(model, inputs)
        assert torch.equal(after_seq, base_seq) and torch.equal(after_scores, base_scores)
    assert torch.equal(out["sdpa"][0], out["eager"][0])
    torch.testing.assert_close(out["sdpa"][1], out["eager"][1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("kind", "branch"), [("llava", "blank"), ("llava", "text"), ("qwen2_vl", "noise")]
)
def test_on_a_pruned_model_the_branch_equals_the_masked_reference(kind, branch):

    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    layers = get_adapter(model).decoder_layers(model)
    with vf.wrap(model, pruner="fastv", keep=0.5, layer=2) as handle:
        with H.visual_contrast(model, inputs, branch=branch, beta=0.0) as proc:
            seq, _ = _generate(model, inputs, logits_processor=[proc])
        trace = handle.last_trace
    assert isinstance(trace, FocusTrace) and trace.stages
    answer = seq[:, inputs["input_ids"].shape[1] : -1]  # the last step's sequence
    if branch != "text":
        degraded = extend_with_answer(proc.branch_inputs, answer)[0]
        with masked_reference(model, layers, trace):
            want = _logits(model, degraded)
        unmasked = _logits(model, degraded)  # the pruning shows in the branch
        assert float((unmasked - want).abs().max()) > 1e-3
    else:  # no visual tokens: nothing to prune
        want = _logits(model, extend_with_answer(proc.branch_inputs, answer)[0])
    torch.testing.assert_close(proc.last_branch_logits, want, atol=ATOL, rtol=0)


# --- errors, registry, tables --------------------------------------------------------------------
def test_bad_options_and_misuse_raise():
    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    cases = [
        (dict(branch="grey"), ValueError, "branch='grey' is not one of"),
        (dict(weight=-1.0), ValueError, "weight must be >= 0"),
        (dict(growth=-0.1), ValueError, "growth must be >= 0"),
        (dict(beta=1.0), ValueError, r"beta \(plausibility cutoff\) must lie in \[0, 1\)"),
        (dict(noise_step=1000), ValueError, r"noise_step must be an int in \[0, 999\]"),
        (dict(noise_step=2.5), ValueError, "noise_step must be an int"),
        (dict(schedule="cosine"), ValueError, "schedule='cosine' is not one of"),
        (dict(weight="1"), TypeError, "weight must be a number"),
        (dict(centre=torch.zeros(2, 3)), ValueError, "centre must be a 1-D float tensor"),
        (dict(centre=3), TypeError, "centre must be a tensor, the path"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            H.get_mitigation("visual_contrast").options(**options)
    with pytest.raises(ValueError, match="does not exist"):
        H.visual_contrast(model, inputs, centre="/nonexistent/centre.pt")
    with pytest.raises(ValueError, match="needs the prompt's inputs"):
        with H.mitigate(model, "visual_contrast"):
            pass
    with pytest.raises(ValueError, match="needs the prompt's images"):
        H.visual_contrast(model, {k: inputs[k] for k in ("input_ids", "attention_mask")})
    with pytest.raises(ValueError, match="centre has 5 entries"):
        with H.visual_contrast(model, inputs, branch="blank", centre=torch.zeros(5)) as proc:
            proc(inputs["input_ids"], torch.zeros(2, 128))
    with pytest.raises(ValueError, match="one sequence per row"):
        with H.visual_contrast(model, inputs) as proc:
            _generate(model, inputs, num_beams=2, logits_processor=[proc])


def test_run_setting_passes_the_inputs_and_the_tables_list_it(capsys):
    from vlm_focus import cli

    model = make_model("llava")
    inputs = make_inputs("llava", model, batch=2)
    setting = RunSetting(
        mitigation="visual_contrast", mitigation_options={"branch": "blank"}, max_new_tokens=3
    )
    got = setting.generate(model, inputs)
    with H.visual_contrast(model, inputs, branch="blank") as proc:
        want, _ = _generate(model, inputs, steps=3, logits_processor=[proc])
    assert torch.equal(got, want)
    assert setting.tag == "unpruned-visual_contrast-branch_blank"
    with pytest.raises(ValueError, match="centre=Tensor cannot be recorded with a run"):
        RunSetting(mitigation="visual_contrast", mitigation_options={"centre": torch.zeros(128)})
    described = RunSetting(
        mitigation="visual_contrast", mitigation_options={"centre": "calib/centre.pt"}
    ).describe()
    assert described["mitigation_parameters"]["centre"] == "calib/centre.pt"
    assert "visual_contrast" in H.mitigations()
    table = H.mitigation_options_markdown()
    for name in ("branch", "weight", "growth", "beta", "noise_step", "schedule", "centre"):
        assert f"| `visual_contrast` | `{name}` |" in table
    assert cli.main(["mitigations"]) == 0
    out = capsys.readouterr().out
    assert f"visual_contrast: {H.VisualContrast.summary}" in out
