"""Layering: the core and the evaluations reach the shipped assets without the organism
package, the eval runners sit below the eval command line, and the mitigations have one
registry (one set of names and defaults) that the evaluations use."""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_focus import hallucination as hal
from vlm_focus.asset_paths import (
    CAPTION_PROMPT,
    default_model_path,
    guide_model_path,
    heldout_path,
    sample_scene_paths,
    write_heldout_set,
)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_core_and_eval_never_import_the_organism_package():
    loaded = _modules_after(
        "import vlm_focus, vlm_focus.loading, vlm_focus.cli, vlm_focus.asset_paths\n"
        "import vlm_focus.eval.cli, vlm_focus.eval.data, vlm_focus.eval.generation\n"
        "from vlm_focus.loading import resolve_model_path; resolve_model_path(None)"
    )
    assert "vlm_focus.eval.chair_run" in loaded  # the runners did load
    assert not [m for m in loaded if m.startswith("vlm_focus.organism")]


def test_eval_runners_do_not_import_the_eval_command_line():
    loaded = _modules_after(
        "import vlm_focus.eval.pope_run, vlm_focus.eval.coco_run, vlm_focus.eval.chair_run"
    )
    assert "vlm_focus.eval.common" in loaded and "vlm_focus.eval.cli" not in loaded


def test_organism_re_exports_the_asset_functions():
    import vlm_focus.organism as organism
    from vlm_focus.organism.vocab import CAPTION_PROMPT as organism_prompt

    assert organism.default_model_path() == default_model_path()
    assert organism.guide_model_path() == guide_model_path()
    assert organism.sample_scene_paths() == sample_scene_paths() and sample_scene_paths()
    assert organism_prompt == CAPTION_PROMPT
    assert (default_model_path() / "config.json").is_file()


def test_written_heldout_set_equals_the_organism_scenes(tmp_path):
    from vlm_focus.organism.scenes import caption, coco_instances, heldout_scenes

    path = write_heldout_set(tmp_path, n_images=3)
    scenes = heldout_scenes(3, min_objects=3)
    assert json.loads(path.read_text()) == coco_instances(scenes)
    captions = json.loads((tmp_path / "captions.json").read_text())
    assert captions == [{"image_id": s.seed, "caption": caption(s)} for s in scenes]
    for scene in scenes:
        with Image.open(tmp_path / f"scene_{scene.seed}.png") as png:
            assert np.array_equal(np.asarray(png), scene.image())
    assert len(json.loads(heldout_path("instances.json").read_text())["images"]) == 500
    with pytest.raises(ValueError, match="the held-out set has 500 images"):
        write_heldout_set(tmp_path, n_images=501)
    with pytest.raises(ValueError, match="not a held-out file; allowed: instances.json"):
        heldout_path("train.json")


def test_one_registry_of_mitigations_with_one_set_of_defaults():
    assert hal.mitigations() == ["attention_reweight", "instruction_contrast", "visual_beam"]
    assert hal.mitigation_choices()[0] == "none"
    beam = hal.get_mitigation("visual_beam")
    assert beam.build is hal.visual_beam and beam.generate == {"num_beams": 3}
    assert hal.get_mitigation("attention_reweight").defaults == {
        "strength": 1.0,
        "layers": None,
        "ratio": 0.25,
    }
    contrast = hal.get_mitigation("instruction_contrast")
    from vlm_focus.grounding import GENERIC_PROMPT

    assert contrast.generic_prompt == GENERIC_PROMPT and contrast.processor
    for old, new in [("reweight", "attention_reweight"), ("beam", "visual_beam"),
                     ("contrast", "instruction_contrast")]:  # fmt: skip
        with pytest.warns(DeprecationWarning, match=f"mitigation '{old}' is deprecated; use"):
            assert hal.mitigation_name(old) == new
    with pytest.raises(ValueError, match="unknown mitigation 'vcd'; allowed: none, attention_"):
        hal.mitigation_name("vcd")
    with pytest.raises(ValueError, match="unknown parameter 'width' for mitigation 'visual_beam'"):
        beam.parameters(width=4)
    with pytest.raises(ValueError, match="already registered"):
        hal.register_mitigation(beam)
    with pytest.raises(ValueError, match="reserved"):
        hal.register_mitigation(hal.Mitigation("beam", hal.visual_beam))


def test_the_eval_setting_records_the_registry_defaults():
    from vlm_focus.eval.generation import Setting

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = Setting(mitigate="beam")
    assert old.mitigate == "visual_beam" and old.tag == "unpruned-visual_beam"
    described = old.describe()
    assert described["mitigation_parameters"] == {"weight": 1.0, "layers": None, "num_beams": 3}
    assert described["decoding"].startswith("beam search, num_beams=3")


def test_mitigate_runs_the_registered_method_with_generate():
    from tiny_models import make_inputs, make_model

    model = make_model("llava")
    inputs = make_inputs("llava", model)
    gen = dict(max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        with hal.mitigate(model, "visual_beam", inputs) as active:
            assert isinstance(active.handle, hal.VisualBeam)
            kwargs = active.generate_kwargs()
            assert kwargs["num_beams"] == 3 and kwargs["logits_processor"] == [active.handle]
            by_name = model.generate(**inputs, **kwargs, **gen)
        with hal.visual_beam(model, weight=1.0) as proc:
            direct = model.generate(**inputs, num_beams=3, logits_processor=[proc], **gen)
        with hal.mitigate(model, "none") as active:
            assert active.generate_kwargs() == {}
    assert torch.equal(by_name, direct)
    with pytest.raises(ValueError, match="needs inputs and generic_inputs"):
        with hal.mitigate(model, "instruction_contrast", inputs):
            pass
