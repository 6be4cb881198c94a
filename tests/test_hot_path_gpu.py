"""The hot path on real GPUs: a model split over two devices by accelerate.

Deselected by default (``-m 'not gpu'``); run on a CUDA machine with
``python -m pytest -m gpu tests/test_hot_path_gpu.py -q``. The split test needs two GPUs.
"""

from __future__ import annotations

import pytest
import torch
from reference import greedy_generate, masked_reference
from tiny_models import KINDS, make_inputs, make_model

import vlm_focus as vf

pytestmark = pytest.mark.gpu


def _to(inputs: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_split_over_two_gpus_equals_the_reference(kind):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from accelerate import dispatch_model

    model = make_model(kind)
    inputs = make_inputs(kind, model, batch=2)
    n_layers = len(model.model.language_model.layers)
    device_map = {"lm_head": 1, "model.language_model.norm": 1}
    for name, _ in model.named_children():
        device_map.setdefault(name, 0)
    device_map.pop("model")
    for name, _ in model.model.named_children():
        if name != "language_model":
            device_map[f"model.{name}"] = 0
    for name, _ in model.model.language_model.named_children():
        if name != "layers":
            device_map.setdefault(f"model.language_model.{name}", 0)
    for i in range(n_layers):  # the stage layer (K = 2) is the first on GPU 1
        device_map[f"model.language_model.layers.{i}"] = 0 if i < 2 else 1
    dispatch_model(model, device_map=device_map)
    inputs = _to(inputs, "cuda:0")
    layers = model.model.language_model.layers
    with torch.no_grad(), vf.wrap(model, pruner="fastv", keep=0.5, layer=2) as handle:
        sequences, logits = greedy_generate(model, inputs, 4)
        trace = handle.last_trace
    with torch.no_grad(), masked_reference(model, layers, trace):
        ref_sequences, ref_logits = greedy_generate(model, inputs, 4)
    assert torch.equal(sequences.cpu(), ref_sequences.cpu())
    torch.testing.assert_close(logits.cpu(), ref_logits.cpu(), atol=1e-4, rtol=0)
