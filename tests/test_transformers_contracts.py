"""transformers' own contracts on wrapped models, on the tiny model of every supported class.

With ``keep=1.0`` every hook runs and nothing is dropped, so every API must behave exactly as
unwrapped. Pruned runs keep each contract that does not depend on the sequence length:
continuing from a returned cache, ``use_cache=False``, assisted decoding, beam search,
sampling, ``num_return_sequences``, ``labels`` (the masked reference's loss and gradients; on
Qwen3.5's hybrid decoder the hand-dropped forward's) and ``inputs_embeds``. The images give
every row 16 or more visual tokens, so keep 0.5 really drops some.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from reference import ATOL, masked_reference
from reference_hybrid import HybridReference
from tiny_models import KINDS, NEW_KINDS, make_case, make_model

import vlm_focus as vf
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.tiny import VIDEO

NEWER = ("gemma3", "gemma4", "qwen3_5")  # their own test files build their inputs
ALL_KINDS = KINDS + NEW_KINDS + ("internvl",) + NEWER
PIXEL_KEYS = ("pixel_values", "image_", "video_", "batch_num")


def _model(kind: str, seed: int = 0):
    return make_model(kind, seed=seed).eval()


def _inputs(kind: str, model, batch: int = 1):
    """One image per row, or the newer classes' own batch 2 (several images, left padding)."""
    if kind == "gemma3":
        from test_gemma3 import gemma_inputs

        return gemma_inputs(batch=batch, images=1)
    if kind == "gemma4":
        from test_gemma4 import gemma4_inputs

        return gemma4_inputs(model, batch=batch)
    if kind == "qwen3_5":
        from test_qwen3_5 import _two_images

        return _two_images(model, batch=batch)
    return make_case(kind, "image", model, batch=batch)


def _greedy(model, inputs, steps: int, **kwargs):
    out = model.generate(
        **inputs,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )
    return out, torch.stack(out.scores, 1).nan_to_num(0, 0, 0)


def _text_part(inputs: dict, sequences: torch.Tensor) -> dict:
    """The inputs of a continued generation: the returned sequences, their mask, no images
    (they are in the cache)."""
    extra = sequences.shape[1] - inputs["input_ids"].shape[1]
    out = {k: v for k, v in inputs.items() if not k.startswith(PIXEL_KEYS)}
    out["input_ids"] = sequences
    ones = torch.ones(sequences.shape[0], extra, dtype=torch.long)
    out["attention_mask"] = torch.cat([inputs["attention_mask"], ones], 1)
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in out:
            out[key] = torch.cat([inputs[key], 0 * ones], 1)
    return out


# --- 1. continuing from a returned cache ---------------------------------------------------
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_continuing_a_returned_cache_equals_one_generation(kind, layer):
    """Generate 3 tokens, continue the returned cache for 1 more: the scores equal one
    4-token generation (a later chat turn on the cache). At layer 0 every cache layer is
    pruned, and generate() slices the continued prompt by the cache's length."""
    model = _model(kind)
    inputs = _inputs(kind, model, batch=2)
    with torch.no_grad(), vf.wrap(model, keep=0.5, layer=layer) as handle:
        _, whole = _greedy(model, inputs, 4)
        first, _ = _greedy(model, inputs, 3)
        assert all(k < n for k, n in zip(handle.last_trace.n_kept, handle.last_trace.n_visual))
        cache = first.past_key_values
        _, more = _greedy(model, _text_part(inputs, first.sequences), 1, past_key_values=cache)
    torch.testing.assert_close(more[:, 0], whole[:, 3], atol=ATOL, rtol=0)


# --- 2. generate(use_cache=False) -----------------------------------------------------------
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_generate_without_cache(kind):
    """Without a cache, generate() re-runs the whole sequence each step with the images it
    encoded once. keep=1.0 equals unwrapped; pruned, every step scores with the prompt's rows
    (as the cached prefill does), so the tokens equal cached pruned decoding."""
    model = _model(kind)
    inputs = _inputs(kind, model, batch=2)
    with torch.no_grad():
        plain, _ = _greedy(model, inputs, 3, use_cache=False)
        with vf.wrap(model, keep=1.0, layer=1):
            hooked, _ = _greedy(model, inputs, 3, use_cache=False)
        assert torch.equal(plain.sequences, hooked.sequences)
        with vf.wrap(model, keep=0.5, layer=1) as handle:
            cached, cached_scores = _greedy(model, inputs, 3)
            kept = handle.last_trace.kept
            pruned, scores = _greedy(model, inputs, 3, use_cache=False)
            for a, b in zip(kept, handle.last_trace.kept):
                assert torch.equal(a, b) and a.numel() < handle.last_trace.n_visual[0]
    assert torch.equal(pruned.sequences, cached.sequences)
    torch.testing.assert_close(scores, cached_scores, atol=ATOL, rtol=0)


# --- 3. assisted decoding -------------------------------------------------------------------
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_assisted_decoding_equals_greedy(kind, layer):
    """Greedy assisted decoding returns what greedy decoding returns, with the model as its
    own assistant (two generations interleave on one wrapped model) and with a separate
    wrapped assistant (whose drafts are mostly rejected: the cache is cropped back)."""
    model = _model(kind)
    assistant = _model(kind, seed=1)
    inputs = _inputs(kind, model)
    with torch.no_grad(), vf.wrap(model, keep=0.5, layer=layer):
        greedy, _ = _greedy(model, inputs, 6)
        own = model.generate(
            **inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, assistant_model=model
        )
        with vf.wrap(assistant, keep=0.5, layer=layer):
            other = model.generate(
                **inputs,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                assistant_model=assistant,
            )
    assert torch.equal(own, greedy.sequences)
    assert torch.equal(other, greedy.sequences)


# --- beam search, sampling, several sequences: equal to the masked reference ------------------
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl", "llava_onevision"])
def test_search_modes_equal_the_masked_reference(kind, layer):
    model = _model(kind)
    inputs = _inputs(kind, model, batch=2)
    layers = get_adapter(model).decoder_layers(model)
    modes = [
        dict(num_beams=3, do_sample=False),
        dict(do_sample=True, num_return_sequences=2, top_k=0),
        dict(num_beams=2, num_return_sequences=2, do_sample=False),
    ]
    with torch.no_grad():
        for mode in modes:
            with vf.wrap(model, keep=0.5, layer=layer) as handle:
                torch.manual_seed(0)
                out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, **mode)
            trace = handle.last_trace  # the prompt's rows, as generate() expanded them
            with masked_reference(model, layers, trace):
                torch.manual_seed(0)
                ref = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, **mode)
            assert torch.equal(out, ref), mode


# --- 4. labels: the masked reference's loss and gradients -------------------------------------
def _answer_labels(inputs: dict, answer: int = 4) -> torch.Tensor:
    """Labels on each row's last ``answer`` tokens only, the prompt masked (-100)."""
    labels = torch.full_like(inputs["input_ids"], -100)
    labels[:, -answer:] = inputs["input_ids"][:, -answer:]
    return labels


def _loss_and_grads(model, inputs, labels):
    model.zero_grad()
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same_grads(grads: dict, ref_grads: dict) -> None:
    """Equal up to float32 summation order, measured against each tensor's own scale (a tiny
    random Gemma 3's projector gradient reaches 1e7)."""
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1.0)
        torch.testing.assert_close(grads[name] / scale, ref / scale, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("kind", [k for k in ALL_KINDS if k != "qwen3_5"])
def test_training_loss_and_gradients_equal_the_masked_reference(kind, layer):
    model = _model(kind)
    model.train()
    inputs = _inputs(kind, model, batch=2)
    labels = _answer_labels(inputs)
    layers = get_adapter(model).decoder_layers(model)
    with vf.wrap(model, keep=0.5, layer=layer) as handle:
        loss, grads = _loss_and_grads(model, inputs, labels)
    trace = handle.last_trace
    assert all(k < n for k, n in zip(trace.n_kept, trace.n_visual))
    with masked_reference(model, layers, trace):
        ref_loss, ref_grads = _loss_and_grads(model, inputs, labels)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("layer", [0, 2])
def test_training_loss_and_gradients_on_a_hybrid_decoder_equal_the_hybrid_reference(layer):
    """Qwen3.5's linear layers cannot mask a token out, so its reference is the forward that
    drops the same rows by hand (``reference_hybrid``); the loss of its held rows, with the
    labels they hold, and every gradient equal the pruned training step's."""
    from test_qwen3_5 import _stage_rows

    model = _model("qwen3_5")
    model.train()
    inputs = _inputs("qwen3_5", model, batch=2)
    labels = _answer_labels(inputs)
    with vf.wrap(model, keep=0.5, layer=layer) as handle:
        loss, grads = _loss_and_grads(model, inputs, labels)
    trace = handle.last_trace
    assert all(k < n for k, n in zip(trace.n_kept, trace.n_visual))
    model.zero_grad()
    reference = HybridReference(model, inputs, _stage_rows(trace, labels.shape[1]))
    logits = reference.prefill()
    held = reference.held[len(reference.types) - 1]
    vocab = model.config.text_config.vocab_size
    ref_loss = model.loss_function(logits, labels.gather(1, held), vocab)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=0)
    _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_keep_one_training_equals_unwrapped(kind):
    """keep=1.0: labels (every position labelled, as transformers' own tests do), shift_labels
    and return_dict=False give the unwrapped loss and gradients exactly."""
    model = _model(kind)
    model.train()
    inputs = _inputs(kind, model, batch=2)
    labels = inputs["input_ids"].clone()
    loss, grads = _loss_and_grads(model, inputs, labels)
    with vf.wrap(model, keep=1.0, layer=1):
        hooked_loss, hooked_grads = _loss_and_grads(model, inputs, labels)
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        shifted = model(**inputs, labels=labels, shift_labels=shift).loss
        as_tuple = model(**inputs, labels=labels, return_dict=False)[0]
    assert torch.equal(loss, hooked_loss)
    assert torch.equal(shifted.detach(), loss)
    assert torch.equal(as_tuple.detach(), loss)
    for name, grad in grads.items():
        assert torch.equal(grad, hooked_grads[name]), name


def test_pruned_loss_takes_shift_labels_and_tuples_and_warns_on_lost_targets():
    model = _model("llava")
    inputs = _inputs("llava", model, batch=2)
    labels = _answer_labels(inputs)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    with torch.no_grad(), vf.wrap(model, keep=0.5, layer=1) as handle:
        loss = model(**inputs, labels=labels).loss
        assert torch.equal(model(**inputs, shift_labels=shift, labels=labels).loss, loss)
        assert torch.equal(model(**inputs, labels=labels, return_dict=False)[0], loss)
        with pytest.warns(UserWarning, match="next-token target"):
            model(**inputs, labels=inputs["input_ids"])  # image tokens labelled too
        # shift_labels aligned with the returned logits (a trainer that read their shape)
        sequence = handle.last_trace.sequence
        aligned = shift.gather(1, sequence)
        assert torch.equal(model(**inputs, shift_labels=aligned, labels=labels).loss, loss)
        with pytest.raises(ValueError, match="one per returned logit"):
            model(**inputs, shift_labels=shift[:, :-1], labels=labels)


def test_gradient_checkpointing_recomputes_the_same_pruned_layers():
    """Checkpointed layers run their hooks again in backward: they slice the same tokens."""
    model = _model("qwen2_5_vl")
    model.train()
    inputs = _inputs("qwen2_5_vl", model, batch=2)
    labels = _answer_labels(inputs)
    with vf.wrap(model, keep=0.5, layer=1):
        loss, grads = _loss_and_grads(model, inputs, labels)
        model.gradient_checkpointing_enable({"use_reentrant": False})
        try:
            ckpt_loss, ckpt_grads = _loss_and_grads(model, inputs, labels)
        finally:
            model.gradient_checkpointing_disable()
    torch.testing.assert_close(ckpt_loss, loss, atol=ATOL, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


# --- 5. inputs_embeds -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_inputs_embeds_run_unpruned(kind):
    """Without input_ids the visual tokens cannot be found: the call runs exactly as
    unwrapped, silently at keep=1.0 and with a warning when pruning was asked for."""
    model = _model(kind)
    inputs = _inputs(kind, model)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    call = {k: v for k, v in inputs.items() if k != "input_ids"}
    with torch.no_grad():
        plain = model(inputs_embeds=embeds, **call).logits
        with vf.wrap(model, keep=1.0, layer=1), warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(model(inputs_embeds=embeds, **call).logits, plain)
        with vf.wrap(model, keep=0.5, layer=1) as handle:
            with pytest.warns(UserWarning, match="inputs_embeds without input_ids"):
                assert torch.equal(model(inputs_embeds=embeds, **call).logits, plain)
            assert handle.last_trace is None


# --- 6. nothing allocated at import -----------------------------------------------------------
def test_import_allocates_no_tensor():
    """Importing every module of vlm_focus creates no tensor; imported under
    torch.device("meta"), a later OneVision prefill still runs on the CPU."""
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys, torch
        sys.path.insert(0, "tests")
        made = []
        originals = {}
        for name in ("tensor", "zeros", "ones", "arange", "full", "empty", "randn", "eye"):
            originals[name] = getattr(torch, name)
            def spy(*a, _n=name, **k):
                made.append(_n)
                return originals[_n](*a, **k)
            setattr(torch, name, spy)
        with torch.device("meta"):
            import vlm_focus
            for info in pkgutil.walk_packages(vlm_focus.__path__, "vlm_focus."):
                if ".organism" in info.name or ".demo" in info.name:
                    continue
                if ".integrations.vllm." in info.name:
                    continue
                importlib.import_module(info.name)
        for name, fn in originals.items():
            setattr(torch, name, fn)
        assert not made, made
        from tiny_models import make_case, make_model
        model = make_model("llava_onevision").eval()
        inputs = make_case("llava_onevision", "image", model)
        with torch.no_grad(), vlm_focus.wrap(model, keep=0.5, layer=1) as handle:
            model(**inputs)
        print("kept", handle.last_trace.n_kept)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kept" in out.stdout


# --- 7. handles ------------------------------------------------------------------------------
def test_a_removed_handle_cannot_be_entered_again():
    model = _model("llava")
    inputs = _inputs("llava", model)
    handle = vf.wrap(model, keep=0.5, layer=1)
    with torch.no_grad():
        with handle:
            model(**inputs)
        kept = handle.last_trace.n_kept
        with pytest.raises(ValueError, match="was removed"):
            with handle:
                model(**inputs)
        assert handle.last_trace.n_kept == kept  # still the pruned run it describes
        again = vf.wrap(model, keep=0.5, layer=1)
        again.remove()
        with pytest.raises(ValueError, match="vf.wrap"):
            again.__enter__()


# --- 8. smaller ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llava_onevision", "qwen2_5_vl", "qwen3_vl"])
def test_a_video_token_id_in_an_image_prompt_is_text(kind):
    """A video-token id written in the text of an image prompt is text to the model; the
    wrapper prunes the image as usual (it used to refuse the prompt)."""
    model = _model(kind)
    inputs = _inputs(kind, model)
    ids = inputs["input_ids"].clone()
    ids[:, -2] = VIDEO
    inputs = {**inputs, "input_ids": ids}
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad():
        with vf.wrap(model, keep=1.0, layer=1):
            hooked = model(**inputs).logits
        assert torch.equal(hooked, model(**inputs).logits)
        with vf.wrap(model, keep=0.5, layer=1) as handle:
            pruned = model(**inputs).logits[:, -1]
        trace = handle.last_trace
        assert trace.n_kept[0] < trace.n_visual[0]
        with masked_reference(model, layers, trace):
            ref = model(**inputs).logits[:, -1]
    torch.testing.assert_close(pruned, ref, atol=ATOL, rtol=0)


def test_keep_one_needs_no_layout_input():
    """keep=1.0 asks for nothing the model does not: Qwen2.5-VL without mm_token_type_ids
    runs as unwrapped; pruning without it names the missing input."""
    model = _model("qwen2_5_vl")
    inputs = {k: v for k, v in _inputs("qwen2_5_vl", model).items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        plain = model(**inputs).logits
        with vf.wrap(model, keep=1.0, layer=1):
            assert torch.equal(model(**inputs).logits, plain)
        with vf.wrap(model, keep=0.5, layer=1), pytest.raises(ValueError, match="mm_token_type"):
            model(**inputs)


@pytest.mark.parametrize("layer", [0, 2])
def test_hidden_states_and_attentions_line_up_with_positions_at(layer):
    """``output_hidden_states`` / ``output_attentions`` of a pruned prefill: layer i's entries
    hold the tokens at ``last_trace.positions_at(i)``, equal to the masked reference there."""
    model = make_model("llava", attn="eager").eval()
    inputs = _inputs("llava", model, batch=2)
    layers = get_adapter(model).decoder_layers(model)
    with torch.no_grad():
        with vf.wrap(model, keep=0.5, layer=layer) as handle:
            out = model(**inputs, output_hidden_states=True, output_attentions=True)
        trace = handle.last_trace
        with masked_reference(model, layers, trace):
            ref = model(**inputs, output_hidden_states=True)
    full = inputs["input_ids"].shape[1]
    first = trace.positions_at(0)  # hidden_states[0] is layer 0's input, as layer 0 reads it
    assert out.hidden_states[0].shape[1] == (full if first is None else first.shape[1])
    for i in range(len(layers)):
        held = trace.positions_at(i)
        if i < layer:
            assert held is None and out.hidden_states[i + 1].shape[1] == full
            continue
        assert out.attentions[i].shape[-2:] == (held.shape[1], held.shape[1])
        # the last layer's output is normed before it is returned, in both runs alike
        expected = ref.hidden_states[i + 1].gather(
            1, held[..., None].expand(-1, -1, ref.hidden_states[0].shape[-1])
        )
        real = inputs["attention_mask"].gather(1, held).bool()  # padding rows are not compared
        torch.testing.assert_close(
            out.hidden_states[i + 1][real], expected[real], atol=1e-4, rtol=0
        )
    assert torch.equal(trace.positions_at(len(layers) - 1), trace.sequence)


# --- keep=1.0 on the newer classes -----------------------------------------------------------
@pytest.mark.parametrize("kind", NEWER)
def test_keep_1_changes_nothing_on_the_newer_classes(kind):
    """With nothing pruned, labels (the loss), ``use_cache=False`` and ``generate()`` with and
    without a cache give the unwrapped model's results, on batch 2 with left padding."""
    model = _model(kind)
    inputs = _inputs(kind, model, batch=2)
    labels = inputs["input_ids"].clone()

    def run():
        with torch.no_grad():
            scored = model(**inputs, labels=labels)
            uncached = model(**inputs, use_cache=False).logits
            greedy = dict(max_new_tokens=4, do_sample=False)
            plain = model.generate(**inputs, use_cache=False, **greedy)
            cached = model.generate(**inputs, **greedy)
        return scored.loss, scored.logits, uncached, plain, cached

    want = run()
    with vf.wrap(model, pruner="fastv", keep=1.0, layer=1):
        got = run()
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=ATOL, rtol=0)
    assert torch.equal(got[3], want[3]) and torch.equal(got[4], want[4])
