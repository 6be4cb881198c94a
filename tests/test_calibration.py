"""Content-free calibration: the first token against its hand formula from two independent
forward passes, one cached pass per image, later tokens untouched, batches, pruned models."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from reference import greedy_out
from tiny_models import make_case, make_inputs, make_model

import vlm_focus as vf
from vlm_focus import hallucination as H
from vlm_focus.config import keep_count
from vlm_focus.eval.pope import question_text
from vlm_focus.hallucination._calibrate import CONTENT_FREE_CACHE, ContentFreeCache
from vlm_focus.setting import RunSetting

PIXEL_KEYS = ("pixel_values", "image_sizes", "image_grid_thw")


@pytest.fixture(autouse=True)
def _empty_cache():
    CONTENT_FREE_CACHE.clear()
    yield
    CONTENT_FREE_CACHE.clear()


def _pair(kind, model, batch=1, seed=0):
    """A prompt and its content-free counterpart: the same images under other text."""
    inputs = make_inputs(kind, model, batch=batch, seed=seed)
    generic = make_inputs(kind, model, batch=batch, seed=100 + seed, prompt_len=4)
    for key in PIXEL_KEYS:
        if key in inputs:
            generic[key] = inputs[key]
    return inputs, generic


def _last_logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits[:, -1].float()


def _formula(full, content_free, strength, beta):
    """l_f - strength * l_cf on {p_f >= beta * max p_f}, -inf elsewhere."""
    l_f, l_cf = full.log_softmax(-1), content_free.log_softmax(-1)
    probs = full.softmax(-1)
    out = l_f - strength * l_cf
    return out.masked_fill(probs < beta * probs.amax(-1, keepdim=True), float("-inf"))


def _generate(model, inputs, steps=3, **kwargs):
    out = greedy_out(model, inputs, steps, min_new_tokens=0, **kwargs)
    return out.sequences, torch.stack(out.scores, 1), torch.stack(out.logits, 1)


def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


def _row(kind, inputs, b):
    """Row ``b`` of a left-padded batch of :func:`tiny_models.make_inputs`, alone."""
    keep = inputs["attention_mask"][b].bool()
    out = {k: inputs[k][b : b + 1, keep] for k in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = inputs["mm_token_type_ids"][b : b + 1, keep]
    if "image_grid_thw" in inputs:
        sizes = inputs["image_grid_thw"].prod(-1).tolist()
        start = sum(sizes[:b])
        out["pixel_values"] = inputs["pixel_values"][start : start + sizes[b]]
        out["image_grid_thw"] = inputs["image_grid_thw"][b : b + 1]
    else:
        out["pixel_values"] = inputs["pixel_values"][b : b + 1]
        if "image_sizes" in inputs:
            out["image_sizes"] = inputs["image_sizes"][b : b + 1]
    return out


# --- the formula --------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_first_token_equals_the_formula_from_two_forward_passes(attn):
    model = make_model("llava", attn)
    inputs, generic = _pair("llava", model, batch=2)
    full, content_free = _last_logits(model, inputs), _last_logits(model, generic)
    want = _formula(full, content_free, 0.7, 0.8)
    assert bool(torch.isinf(want).any()) and bool(torch.isfinite(want).any())
    with H.content_free(model, inputs, generic, strength=0.7, beta=0.8) as proc:
        torch.testing.assert_close(proc(inputs["input_ids"], full), want, atol=1e-5, rtol=0)
        seq, scores, logits = _generate(model, inputs, logits_processor=[proc])
    # inside generate(): the first step is the formula of generate's own logits
    torch.testing.assert_close(logits[:, 0].float(), full, atol=1e-4, rtol=0)
    first = _formula(logits[:, 0].float(), content_free, 0.7, 0.8)
    torch.testing.assert_close(scores[:, 0], first, atol=1e-4, rtol=0)
    assert torch.equal(seq[:, inputs["input_ids"].shape[1]], first.argmax(-1))
    assert torch.equal(proc(inputs["input_ids"], full), full)  # inactive after exit


def test_a_video_is_calibrated_against_the_same_video():
    model = make_model("qwen2_5_vl")
    inputs = make_case("qwen2_5_vl", "video", model)
    generic = make_case("qwen2_5_vl", "video", model, seed=7, prompt_len=3)
    for key in ("pixel_values_videos", "video_grid_thw"):
        generic[key] = inputs[key]
    full, content_free = _last_logits(model, inputs), _last_logits(model, generic)
    with H.content_free(model, inputs, generic, beta=0.8) as proc:
        got = proc(inputs["input_ids"], full)
    torch.testing.assert_close(got, _formula(full, content_free, 1.0, 0.8), atol=1e-5, rtol=0)


def test_yes_no_is_divided_by_the_content_free_probability():
    # two answers: the calibrated choice is argmax p_f(y) / p_cf(y), the paper's diagonal W
    model = make_model("llava")
    inputs, generic = _pair("llava", model)
    full = torch.full((1, model.config.text_config.vocab_size), -30.0)
    full[0, 5], full[0, 7] = 2.0, 1.0  # "yes" 0.73, "no" 0.27
    with H.content_free(model, inputs, generic, beta=0.0) as proc:
        proc.content_free = torch.full_like(full, -30.0)
        proc.content_free[0, 5], proc.content_free[0, 7] = torch.tensor([0.9, 0.1]).log()
        out = proc(inputs["input_ids"], full)
    p_f = full.softmax(-1)[0, [5, 7]]
    ratio = p_f / torch.tensor([0.9, 0.1])
    torch.testing.assert_close(out[0, [5, 7]].exp(), ratio, atol=1e-5, rtol=1e-5)
    assert int(out.argmax()) == 7 and int(full.argmax()) == 5


# --- later tokens, strength 0, exit ---------------------------------------------------------------
def test_later_tokens_are_the_models_own_logits():
    model = make_model("qwen2_vl")
    inputs, generic = _pair("qwen2_vl", model, batch=2)
    with H.content_free(model, inputs, generic, strength=2.0) as proc:
        seq, scores, logits = _generate(model, inputs, steps=4, logits_processor=[proc])
        longer = torch.cat([inputs["input_ids"], seq[:, -1:]], 1)
        raw = torch.randn(2, logits.shape[-1])
        assert proc(longer, raw) is raw
    torch.testing.assert_close(scores[:, 1:], logits[:, 1:], atol=0, rtol=0)
    # and those logits are a plain teacher-forced pass over the calibrated sequence
    seq_len = inputs["input_ids"].shape[1]
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(seq[:, seq_len:])], 1)
    forced = dict(inputs, input_ids=seq, attention_mask=mask)
    forced["mm_token_type_ids"] = torch.cat(
        [inputs["mm_token_type_ids"], torch.zeros_like(seq[:, seq_len:])], 1
    )
    with torch.no_grad():
        plain = model(**forced).logits[:, seq_len:-1]
    torch.testing.assert_close(logits[:, 1:], plain, atol=1e-4, rtol=0)


def test_strength_zero_is_the_plain_generation():
    model = make_model("llava_next")
    inputs, generic = _pair("llava_next", model, batch=2)
    base_seq, _, base_logits = _generate(model, inputs, steps=4)
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    with H.content_free(model, inputs, generic, strength=0.0, beta=0.0) as proc:
        seq, scores, _ = _generate(model, inputs, steps=4, logits_processor=[proc])
    assert torch.equal(seq, base_seq)
    torch.testing.assert_close(scores[:, 0], base_logits[:, 0].log_softmax(-1), atol=1e-5, rtol=0)
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    assert torch.equal(_generate(model, inputs, steps=4)[0], base_seq)


# --- the cache --------------------------------------------------------------------------------
def test_one_content_free_pass_per_image_across_questions():
    model = make_model("llava")
    _, generic = _pair("llava", model)
    calls, hook = _count_forwards(model)
    try:
        firsts = []
        for seed in range(6):  # six questions about one image
            inputs, _ = _pair("llava", model, seed=seed)
            inputs["pixel_values"] = generic["pixel_values"]
            proc = H.content_free(model, inputs, generic)
            firsts.append(proc.content_free)
        assert len(calls) == 1 and len(CONTENT_FREE_CACHE) == 1
        assert all(first is firsts[0] for first in firsts)
        torch.testing.assert_close(
            firsts[0], _last_logits(model, generic).log_softmax(-1), atol=1e-5, rtol=0
        )
        other = dict(generic, pixel_values=torch.randn_like(generic["pixel_values"]))
        H.content_free(model, inputs, other)  # another image: one more pass
        assert len(calls) == 3 and len(CONTENT_FREE_CACHE) == 2  # (with the reference pass)
    finally:
        hook.remove()


def test_the_cache_is_bounded_and_does_not_hold_the_model():
    cache = ContentFreeCache(size=2)
    model = torch.nn.Linear(1, 1)
    for key in "abc":
        cache.put(model, key, torch.zeros(1))
    assert len(cache) == 2 and cache.get(model, "a") is None
    assert cache.get(model, "b") is not None  # now the most recent
    cache.put(model, "d", torch.zeros(1))
    assert cache.get(model, "c") is None and cache.get(model, "b") is not None

    tiny = make_model("llava")
    _, generic = _pair("llava", tiny)
    H.content_free(tiny, generic, generic)
    assert len(CONTENT_FREE_CACHE) == 1
    ref = weakref.ref(tiny)
    del tiny
    gc.collect()
    assert ref() is None and len(CONTENT_FREE_CACHE) == 0


# --- batches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llava_next", "qwen2_vl"])
def test_a_left_padded_batch_equals_its_rows_alone(kind):
    model = make_model(kind)
    inputs, generic = _pair(kind, model, batch=2)
    with H.content_free(model, inputs, generic, beta=0.8) as proc:
        seq, scores, _ = _generate(model, inputs, logits_processor=[proc])
    seq_len = inputs["input_ids"].shape[1]
    for b in range(2):
        alone, generic_alone = _row(kind, inputs, b), _row(kind, generic, b)
        with H.content_free(model, alone, generic_alone, beta=0.8) as proc:
            seq_b, scores_b, _ = _generate(model, alone, logits_processor=[proc])
        assert torch.equal(seq[b, seq_len:], seq_b[0, alone["input_ids"].shape[1] :])
        assert torch.equal(torch.isinf(scores[b, 0]), torch.isinf(scores_b[0, 0]))
        finite = torch.isfinite(scores_b[0, 0])
        torch.testing.assert_close(scores[b, 0][finite], scores_b[0, 0][finite], atol=1e-4, rtol=0)


def test_sdpa_and_eager_agree():
    out = []
    for attn in ("sdpa", "eager"):
        CONTENT_FREE_CACHE.clear()
        model = make_model("qwen2_5_vl", attn)
        inputs, generic = _pair("qwen2_5_vl", model, batch=2)
        with H.content_free(model, inputs, generic) as proc:
            out.append(_generate(model, inputs, logits_processor=[proc])[:2])
    assert torch.equal(out[0][0], out[1][0])
    finite = torch.isfinite(out[0][1])
    assert torch.equal(finite, torch.isfinite(out[1][1]))
    torch.testing.assert_close(out[0][1][finite], out[1][1][finite], atol=1e-4, rtol=0)


# --- pruned models ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_on_a_pruned_model_the_pass_leaves_the_pruning_alone(kind):
    model = make_model(kind)
    inputs, generic = _pair(kind, model, batch=2)
    unpruned_cf = _last_logits(model, generic)
    with vf.wrap(model, pruner="fastv", keep=0.25, layer=1) as handle:
        base_seq, _, base_logits = _generate(model, inputs)
        trace = handle.last_trace
        kept = [k.clone() for k in trace.kept]
        with H.content_free(model, inputs, generic, beta=0.0) as proc:
            # the content-free pass ran unpruned, and the engine's record is untouched
            assert handle.last_trace is trace
            torch.testing.assert_close(
                proc.content_free, unpruned_cf.log_softmax(-1), atol=1e-5, rtol=0
            )
            seq, scores, logits = _generate(model, inputs, logits_processor=[proc])
        assert all(torch.equal(a, b) for a, b in zip(handle.last_trace.kept, kept, strict=True))
        assert handle.last_trace.n_visual == trace.n_visual
        # the pruned model's own first logits, calibrated
        torch.testing.assert_close(logits[:, 0], base_logits[:, 0], atol=1e-5, rtol=0)
        want = _formula(logits[:, 0].float(), unpruned_cf, 1.0, 0.0)
        torch.testing.assert_close(scores[:, 0], want, atol=1e-4, rtol=0)
        with H.content_free(model, inputs, generic, strength=0.0, beta=0.0) as proc:
            assert torch.equal(_generate(model, inputs, logits_processor=[proc])[0], base_seq)


# --- by name, through RunSetting --------------------------------------------------------------
def test_registered_with_pope_s_content_free_question():
    cls = H.get_mitigation("content_free")
    assert cls is H.ContentFree and cls.generic_prompt == H.CONTENT_FREE_PROMPT
    assert H.CONTENT_FREE_PROMPT == question_text("N/A") == "Is there a N/A in the image?"
    assert cls.parameters() == {"strength": 1.0, "beta": 0.01}
    setting = RunSetting(mitigation="content_free", mitigation_options={"strength": 0.5})
    assert setting.generic_prompt == H.CONTENT_FREE_PROMPT
    assert setting.tag == "unpruned-content_free-strength_0.5"
    model = make_model("llava")
    inputs, generic = _pair("llava", model, batch=2)
    with pytest.raises(ValueError, match="needs inputs and generic_inputs"):
        with H.mitigate(model, "content_free", inputs):
            pass
    with H.mitigate(model, "content_free", inputs, generic_inputs=generic, beta=0.0) as active:
        (proc,) = active.generate_kwargs()["logits_processor"]
        assert isinstance(proc, H.ContentFree) and proc.beta == 0.0
    with torch.no_grad():
        seq = setting.generate(model, inputs, generic_inputs=generic, max_new_tokens=2)
    with H.content_free(model, inputs, generic, strength=0.5) as proc:
        assert torch.equal(seq, _generate(model, inputs, steps=2, logits_processor=[proc])[0])


def test_a_pruned_run_setting_answers_with_one_content_free_pass_per_batch():
    from PIL import Image

    from organism.scenes import heldout_scenes
    from vlm_focus.config import FocusConfig
    from vlm_focus.generation import greedy_generate
    from vlm_focus.loading import build_inputs, load_model, to_model

    model, processor = load_model(None, dtype=torch.float32)
    images = [Image.fromarray(s.image()) for s in heldout_scenes(2, min_objects=2)]
    prompts = [question_text("circle"), question_text("red square")]
    inputs = to_model(model, build_inputs(processor, images, prompts))
    generic = to_model(model, build_inputs(processor, images, [H.CONTENT_FREE_PROMPT] * 2))
    focus = FocusConfig(keep=0.25, layer=0)
    setting = RunSetting(focus=focus, mitigation="content_free", max_new_tokens=3)
    with vf.wrap(model, config=focus), torch.no_grad():
        with H.content_free(model, inputs, generic) as proc:
            expected = greedy_generate(model, inputs, max_new_tokens=3, logits_processor=[proc])[0]
    CONTENT_FREE_CACHE.clear()
    calls, hook = _count_forwards(model)
    try:
        first = setting.answer(model, processor, images, prompts)
        n_first = len(calls)
        again = setting.answer(model, processor, images, prompts)  # the same images again
    finally:
        hook.remove()
    assert torch.equal(first.sequences, expected) and torch.equal(again.sequences, expected)
    assert len(calls) - n_first == n_first - 1  # no second content-free pass
    assert first.visual_kept == [keep_count(0.25, n) for n in first.visual_total]


# --- bad input --------------------------------------------------------------------------------
def test_bad_options_and_inputs_raise():
    cls = H.get_mitigation("content_free")
    with pytest.raises(ValueError, match="strength must be >= 0, got -1"):
        cls.options(strength=-1)
    with pytest.raises(ValueError, match=r"beta \(plausibility cutoff\) must lie in \[0, 1\)"):
        cls.options(beta=1.0)
    with pytest.raises(TypeError, match="strength must be a number, got 'x'"):
        cls.options(strength="x")
    with pytest.raises(TypeError, match="beta must be a number, got True"):
        cls.options(beta=True)
    with pytest.raises(ValueError, match="unknown parameter 'alpha' for mitigation"):
        cls.options(alpha=1.0)
    model = make_model("qwen2_vl")
    inputs, generic = _pair("qwen2_vl", model, batch=2)
    with pytest.raises(TypeError, match="generic_inputs must be the processor's output"):
        H.content_free(model, inputs, None)
    with pytest.raises(ValueError, match="same images as inputs, row for row"):
        H.content_free(model, inputs, _row("qwen2_vl", generic, 0))
    right = {
        k: v.flip(1) if k in ("input_ids", "attention_mask") else v for k, v in generic.items()
    }
    with pytest.raises(ValueError, match="left-padded"):
        H.content_free(model, inputs, right)
    with H.content_free(model, inputs, generic) as proc:
        other = torch.zeros_like(inputs["input_ids"])
        with pytest.raises(ValueError, match="serves the prompt it was built for"):
            proc(other, torch.zeros(2, model.config.text_config.vocab_size))


def test_the_content_free_question_keeps_each_prompts_answer_instruction():
    from vlm_focus.grounding import GENERIC_PROMPT

    suffix = "\nAnswer the question using a single word or phrase."
    prompts = [question_text("dog") + suffix, question_text("cat"), "Describe the image."]
    assert H.ContentFree.generic_prompts(prompts) == [
        H.CONTENT_FREE_PROMPT + suffix,
        H.CONTENT_FREE_PROMPT,
        H.CONTENT_FREE_PROMPT,
    ]
    assert H.InstructionContrast.generic_prompts(prompts) == [GENERIC_PROMPT] * 3
