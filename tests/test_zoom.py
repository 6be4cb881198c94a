"""Attention-guided zoom: crop boxes on constructed maps (wide and tall images), the re-ask's
inputs against hand-built multi-image inputs of the real LLaVA and Qwen2-VL processors (built
offline), routing at thresholds 0 and 1, the conformal calibration on a hand-made score list,
the zoom on a pruned model, and the high-resolution organism scenes' exact boxes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import IMAGE, VIDEO, VISION_END, VISION_START, make_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessorPil,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import vlm_focus as vf
from vlm_focus import geometry as geo
from vlm_focus import zoom
from vlm_focus.geometry import Frame, Size
from vlm_focus.grounding import Box, HeatMap
from vlm_focus.model_adapters import get_adapter

QUESTION = "Is there a red_circle in the image?"
WORDS = "USER ASSISTANT : ? . , Is there a an red_circle blue_square in the image yes no".split()
LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}USER: {% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %} ASSISTANT:{% endfor %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


# --- processors built offline ------------------------------------------------------------------
def _tokenizer(special: dict[str, int]) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer whose special tokens carry the tiny models' ids."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for word in WORDS:
        vocab[word] = len(vocab)
    vocab.update(special)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


class _QwenProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor (that one needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _processor(kind: str):
    if kind == "llava":  # the tiny CLIP tower: 32 px, patch 8 -> 16 tokens
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return LlavaProcessor(
            image_processor=image_processor,
            tokenizer=_tokenizer({"<image>": IMAGE}),
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=LLAVA_TEMPLATE,
        )
    special = {
        "<|image_pad|>": IMAGE,
        "<|video_pad|>": VIDEO,
        "<|vision_start|>": VISION_START,
        "<|vision_end|>": VISION_END,
        "<|im_start|>": 124,
        "<|im_end|>": 125,
    }
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 16 * 16, "longest_edge": 32 * 32},
    )
    return _QwenProcessor(
        image_processor=image_processor, tokenizer=_tokenizer(special), chat_template=QWEN_TEMPLATE
    )


def _hand_text(kind: str, question: str, n_images: int) -> str:
    """The chat prompt written out by hand."""
    if kind == "llava":
        return "<s>USER: " + "<image>\n" * n_images + f"{question} ASSISTANT:"
    images = "<|vision_start|><|image_pad|><|vision_end|>" * n_images
    return f"<|im_start|>user\n{images}{question}<|im_end|>\n<|im_start|>assistant\n"


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _hand_inputs(processor, texts, images):
    processor.tokenizer.padding_side = "left"
    return dict(processor(images=images, text=texts, return_tensors="pt", padding=True))


def _assert_same_inputs(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


class _Recorder:
    """Records the inputs of every ``generate()`` call of a model."""

    def __init__(self, model, monkeypatch):
        self.calls: list[dict] = []
        original = model.generate

        def generate(**kwargs):
            self.calls.append({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            return original(**kwargs)

        monkeypatch.setattr(model, "generate", generate)


# --- crop boxes on constructed maps ------------------------------------------------------------
def _map(size: Size, rule: str, x: float, y: float, grid=(12, 12)) -> tuple[HeatMap, tuple]:
    """A map with one hot cell at the cell holding pixel (x, y), on a ``rule`` frame."""
    frame = geo.rule_frame(size, rule)
    cell = frame.cell_at(x, y, grid)
    assert cell is not None
    values = torch.full(grid, 1e-3)
    values[cell] = 1.0
    return HeatMap(values, [values], size, [frame]), cell


SHAPES = {"wide": Size(360, 120), "tall": Size(120, 360)}
PEAKS = [(0.05, 0.05), (0.95, 0.9), (0.5, 0.5), (0.1, 0.85)]


@pytest.mark.parametrize("rule", ["resize", "crop"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("margin, min_size", [(0.25, 64), (0.5, 100), (0.0, 200)])
def test_crop_holds_the_peak_with_margin_and_minimum_inside_the_image(
    rule, shape, margin, min_size
):
    size = SHAPES[shape]
    shares = PEAKS if rule == "resize" else [(0.5, 0.5), (0.45, 0.4), (0.55, 0.6)]
    for fx, fy in shares:
        x, y = fx * size.width, fy * size.height
        heat, cell = _map(size, rule, x, y)
        found, crops = zoom.choose_crops(heat, margin=margin, min_size=min_size, aspect="view")
        (box,), (crop,) = found, crops
        frame = heat.frames[0]
        aspect = frame.width / frame.height  # 1 for the centre crop, the image's for resize
        assert crop.contains(x, y)
        cell_box = frame.cells((12, 12))[cell].tolist()  # x_lo y_lo x_hi y_hi of the hot cell
        cx, cy = (cell_box[0] + cell_box[2]) / 2, (cell_box[1] + cell_box[3]) / 2
        assert crop.contains(cx, cy)
        # inside the image
        assert Frame(0, 0, size.width, size.height).covers(crop)
        # the margin box (clipped to the image) lies inside the crop
        x0, y0 = max(box.x0 - margin * box.width, 0), max(box.y0 - margin * box.height, 0)
        x1 = min(box.x1 + box.width * margin, size.width)
        y1 = min(box.y1 + box.height * margin, size.height)
        need_w, need_h = (
            min(box.width * (1 + 2 * margin), size.width),
            min(box.height * (1 + 2 * margin), size.height),
        )
        assert crop.width >= need_w - 1e-6 and crop.height >= need_h - 1e-6
        assert crop.covers(box)
        assert (x1 - x0) <= crop.width + 1e-6 and (y1 - y0) <= crop.height + 1e-6
        # minimum size, as far as a crop of this aspect fits in the image
        fit_w = min(size.width, size.height * aspect)
        fit_h = fit_w / aspect
        assert crop.width >= min(min_size, fit_w) - 1e-6
        assert crop.height >= min(min_size, fit_h) - 1e-6
        # aspect kept (whole pixels) where the margin box allows it
        if need_w <= fit_w and need_h <= fit_h:
            assert abs(crop.width - aspect * crop.height) <= 1 + aspect


def test_crop_box_arithmetic():
    size = Size(200, 100)
    # margin 0.5 on a 30 x 10 box centred (25, 25): 60 x 20, shifted right to x = 0
    crop = zoom.crop_box([10, 20, 30, 10], size, margin=0.5)
    assert crop == Frame(0, 15, 60, 20) and all(isinstance(v, int) for v in crop.xywh)
    assert zoom.union_box([crop, Box(100, 0, 10, 5, 0.5)]) == Frame(0, 0, 110, 35)
    # minimum side 50, then square: 50 x 50 centred on (100, 50), inside the image
    assert zoom.crop_box([95, 45, 10, 10], size, margin=0, min_size=50, aspect=1.0) == Frame(
        75, 25, 50, 50
    )
    # a box reaching outside the image is clipped first; a box larger than it gives the image
    assert zoom.crop_box([-50, -50, 400, 300], size).is_whole(size)
    # tall image, square crop, minimum 192: the largest square that fits (aspect over minimum)
    tall = Size(120, 300)
    crop = zoom.crop_box([50, 140, 20, 20], tall, margin=0.25, min_size=192, aspect=1.0)
    assert crop == Frame(0, 90, 120, 120)
    # the box wins over the aspect: an 8:1 crop of a 110 x 20 box is 160 wide, more than the
    # image; shrunk to 120 x 15 it would cut the box, so it is 120 x 20
    crop = zoom.crop_box([5, 10, 110, 20], tall, margin=0.0, aspect=8.0)
    assert crop == Frame(0, 10, 120, 20)
    with pytest.raises(ValueError, match="margin"):
        zoom.crop_box([0, 0, 1, 1], size, margin=-1)
    with pytest.raises(ValueError, match="aspect"):
        zoom.crop_box([0, 0, 1, 1], size, aspect=0)
    with pytest.raises(TypeError, match=r"\[x, y, w, h\]"):
        zoom.crop_box("box", size)


def test_several_regions_merge_into_one_crop_for_a_one_image_prompt():
    size = Size(240, 240)
    frame = geo.rule_frame(size, "resize")
    values = torch.full((12, 12), 1e-3)
    values[1, 1] = values[10, 9] = 1.0
    heat = HeatMap(values, [values], size, [frame])
    found, crops = zoom.choose_crops(heat, regions=2, min_size=40, mode="both")
    assert len(found) == 2 and len(crops) == 2
    _, (merged,) = zoom.choose_crops(heat, regions=2, min_size=40, mode="crop")
    assert all(merged.covers(c.xywh) for c in crops)
    # peak anchor: a point box at the map's peak; an empty map anchors at the centre
    (peak,), (crop,) = zoom.choose_crops(heat, anchor="peak", min_size=40)
    assert peak.width == 1 and crop.width >= 40
    empty = HeatMap(torch.zeros(12, 12), [torch.zeros(12, 12)], size, [frame])
    (centre,), _ = zoom.choose_crops(empty, min_size=40)
    assert (centre.x0 + 0.5, centre.y0 + 0.5) == (120, 120)


def test_native_side_reads_the_processor():
    assert zoom.native_side(_processor("llava")) == 32  # the centre crop
    assert zoom.native_side(_processor("qwen2_vl")) == 32  # sqrt(max_pixels)
    assert (
        zoom.native_side(
            CLIPImageProcessorPil(size={"height": 48, "width": 64}, do_center_crop=False)
        )
        == 48
    )
    with pytest.raises(ValueError, match="native_side needs the processor"):
        zoom.native_side(None)


# --- the re-ask's inputs ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("mode", ["both", "crop"])
def test_reask_builds_the_processors_multi_image_inputs(kind, mode, monkeypatch):
    model = make_model(kind)
    processor = _processor(kind)
    images = [_photo(64, 48, 0), _photo(40, 56, 1)]
    questions = [QUESTION, "Is there a blue_square ?"]
    crops = [[Frame(8, 4, 32, 32)], [Frame(0, 20, 40, 30)]]
    spy = _Recorder(model, monkeypatch)
    answers = zoom.reask(model, processor, images, questions, crops, mode=mode, max_new_tokens=3)
    cut = [images[0].crop((8, 4, 40, 36)), images[1].crop((0, 20, 40, 50))]
    n = 2 if mode == "both" else 1
    flat = [images[0], cut[0], images[1], cut[1]] if mode == "both" else cut
    want = _hand_inputs(processor, [_hand_text(kind, q, n) for q in questions], flat)
    (got,) = spy.calls
    _assert_same_inputs(got, want)
    per_image = 16 if kind == "llava" else None
    if per_image is not None:
        assert int((want["input_ids"] == IMAGE).sum()) == per_image * len(flat)
    else:
        grids = want["image_grid_thw"]
        assert grids.shape[0] == len(flat)
        assert int((want["input_ids"] == IMAGE).sum()) == int(grids.prod(-1).sum()) // 4
    with torch.no_grad():
        sequences = model.generate(**want, max_new_tokens=3, do_sample=False)
    texts = processor.batch_decode(
        sequences[:, want["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert answers == [t.strip() for t in texts]


def test_reask_refuses_crops_that_are_not_frames_inside_the_image():
    model = make_model("llava")
    image = _photo(64, 48, 0)
    with pytest.raises(TypeError, match="vlm_focus.geometry.Frame"):
        zoom.reask(model, _processor("llava"), image, QUESTION, [[8, 4, 32, 32]])
    with pytest.raises(ValueError, match="does not lie inside the 64 x 48 image"):
        zoom.reask(model, _processor("llava"), image, QUESTION, [Frame(40, 4, 32, 32)])


def test_default_modes_come_from_the_model_type():
    assert zoom.default_mode(make_model("llava")) == "crop"
    assert zoom.default_mode(make_model("qwen2_vl")) == "both"
    both = {
        "gemma3",
        "gemma4",
        "internvl",
        "llava_onevision",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_vl",
        "qwen3_vl_moe",
    }
    for model_type in vf.supported_models():  # the adapters' multi_image_views decide
        adapter = get_adapter(SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
        assert zoom.mode_for(adapter) == ("both" if model_type in both else "crop"), model_type


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_look_closer_reasks_with_its_chosen_crop(kind, monkeypatch):
    model = make_model(kind)
    processor = _processor(kind)
    image = _photo(96, 64, 2)
    spy = _Recorder(model, monkeypatch)
    found = zoom.look_closer(
        model, processor, image, QUESTION, max_new_tokens=2, min_size=24, anchor="peak"
    )
    assert found.routed and found.zoomed and found.plain_answer is None
    (crop,) = found.crops
    assert found.map is not None and found.map.size == Size(96, 64)
    assert crop.width >= 24 and crop.height >= 24 and not crop.is_whole(Size(96, 64))
    mode = zoom.default_mode(model)
    n = 2 if mode == "both" else 1
    flat = [image, image.crop(crop.xyxy)] if mode == "both" else [image.crop(crop.xyxy)]
    want = _hand_inputs(processor, [_hand_text(kind, QUESTION, n)], flat)
    (reasked,) = spy.calls  # route="always": no plain pass, one re-ask
    _assert_same_inputs(reasked, want)
    assert set(found.seconds) == {"plain", "map", "reask", "total"}
    assert found.seconds["plain"] == 0 and found.seconds["total"] == pytest.approx(
        found.seconds["map"] + found.seconds["reask"]
    )


# --- routing and calibration -----------------------------------------------------------------
def test_route_thresholds():
    conf = [0.0, 0.3, 0.999, 1.0]
    assert zoom.route(conf, 0.0) == [False] * 4
    assert zoom.route(conf, 1.0) == [True] * 4
    assert zoom.route(conf, 0.5) == [True, True, False, False]
    with pytest.raises(ValueError, match=r"threshold=1.5 must lie in \[0, 1\]"):
        zoom.route(conf, 1.5)
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    p = torch.tensor([2.0, 0.0, 0.0]).exp() / (math.exp(2.0) + 2)
    top1 = zoom.first_token_confidence(logits, "top1")
    margin = zoom.first_token_confidence(logits, "margin")
    assert top1.tolist() == pytest.approx([float(p[0]), 1 / 3])
    assert margin.tolist() == pytest.approx([float(p[0] - p[1]), 0.0])


@pytest.mark.parametrize("threshold, expect", [(0.0, False), (1.0, True)])
def test_adaptive_threshold_zero_zooms_nothing_and_one_everything(threshold, expect):
    model = make_model("llava")
    processor = _processor("llava")
    images = [_photo(96, 64, 3), _photo(64, 96, 4), _photo(80, 80, 5)]
    questions = [QUESTION, "Is there a blue_square ?", QUESTION]
    found = zoom.look_closer(
        model,
        processor,
        images,
        questions,
        route="adaptive",
        threshold=threshold,
        max_new_tokens=2,
        min_size=24,
        anchor="peak",
    )
    plain, conf = zoom.first_pass(model, processor, images, questions, max_new_tokens=2)
    assert [f.routed for f in found] == [expect] * 3
    assert [f.plain_answer for f in found] == plain
    assert [f.confidence for f in found] == pytest.approx(conf)
    if not expect:
        assert [f.answer for f in found] == plain
        assert all(f.map is None and not f.crops and f.seconds["map"] == 0 for f in found)
    else:
        assert all(f.zoomed and f.map is not None and len(f.crops) == 1 for f in found)


def test_an_image_the_processor_does_not_shrink_is_not_zoomed(monkeypatch):
    model = make_model("llava")
    processor = _processor("llava")  # the encoder's input is 32 x 32
    images = [_photo(32, 32, 8), _photo(30, 24, 9)]
    questions = [QUESTION, QUESTION]
    plain, _ = zoom.first_pass(model, processor, images, questions, max_new_tokens=2)
    spy = _Recorder(model, monkeypatch)
    found = zoom.look_closer(
        model, processor, images, questions, route="adaptive", threshold=1.0, max_new_tokens=2
    )
    assert len(spy.calls) == 1  # the plain pass only: no map, no re-ask
    assert [f.answer for f in found] == plain
    assert all(f.routed and not f.zoomed and f.map is None for f in found)
    assert [f.crops for f in found] == [[Frame(0, 0, 32, 32)], [Frame(0, 0, 30, 24)]]
    again = zoom.look_closer(model, processor, images, questions, max_new_tokens=2)
    assert [f.answer for f in again] == plain  # route="always" asks them plainly


def test_a_look_that_does_not_zoom_asks_and_times_one_plain_pass(monkeypatch):
    """route="always" on images the processor does not shrink: nothing to crop, so the one
    pass is the plain one, labelled and timed as such (no re-ask), and mixed with a zoomed row
    the batch asks the zoomed row alone with its crop."""
    model = make_model("llava")
    processor = _processor("llava")
    small, large = _photo(32, 32, 8), _photo(96, 64, 2)
    plain, _ = zoom.first_pass(model, processor, [small], [QUESTION], max_new_tokens=2)
    found = zoom.look_closer(model, processor, [small], [QUESTION], max_new_tokens=2)[0]
    assert found.routed and not found.zoomed
    assert found.answer == found.plain_answer == plain[0]
    assert found.seconds["reask"] == 0 and found.seconds["plain"] > 0
    assert found.seconds["total"] == pytest.approx(found.seconds["plain"])
    spy = _Recorder(model, monkeypatch)
    mixed = zoom.look_closer(
        model,
        processor,
        [small, large],
        [QUESTION, QUESTION],
        max_new_tokens=2,
        anchor="peak",
    )
    assert [f.zoomed for f in mixed] == [False, True]
    assert mixed[0].answer == mixed[0].plain_answer == plain[0]
    assert mixed[1].plain_answer is None
    assert [f.seconds["reask"] > 0 for f in mixed] == [False, True]
    assert [len(c["input_ids"]) for c in spy.calls] == [1, 1]  # the plain row, the crop's row


def test_calibration_picks_the_conformal_quantile():
    # 9 hard cases (scores 0.1 ... 0.9 shuffled) among 12; recall 0.8 -> k = ceil(10 * 0.8) = 8
    scores = [0.5, 0.2, 0.95, 0.9, 0.3, 0.7, 0.99, 0.6, 0.4, 0.8, 0.1, 0.97]
    hard = [True, True, False, True, True, True, False, True, True, True, True, False]
    cal = zoom.calibrate(scores, hard, recall=0.8)
    assert (cal.n, cal.n_hard, cal.k) == (12, 9, 8)
    assert cal.quantile == 0.8
    assert cal.threshold == float(np.nextafter(0.8, 1.0))
    assert cal.hard_routed == pytest.approx(8 / 9)  # every hard score <= 0.8
    assert cal.routed == pytest.approx(8 / 12)
    # recall 0.95 -> k = ceil(9.5) = 10 > 9: everything is routed
    everything = zoom.calibrate(scores, hard, recall=0.95)
    assert everything.quantile == math.inf and everything.threshold == 1.0
    assert everything.routed == 1.0
    with pytest.raises(ValueError, match="no hard case"):
        zoom.calibrate([0.5, 0.6], [False, False])
    with pytest.raises(ValueError, match=r"recall=1 must lie in \(0, 1\)"):
        zoom.calibrate(scores, hard, recall=1)


def test_calibration_round_trips_and_calibrates_a_model(tmp_path):
    cal = zoom.calibrate([0.2, 0.4], [True, True], recall=0.5, statistic="margin")
    cal.save(tmp_path / "cal.json")
    assert zoom.Calibration.load(tmp_path / "cal.json") == cal
    model = make_model("llava")
    processor = _processor("llava")
    images = [_photo(64, 64, s) for s in range(4)]
    questions = [QUESTION] * 4
    plain, conf = zoom.first_pass(model, processor, images, questions, max_new_tokens=2)
    refs = ["never-said"] * 4  # every plain answer is wrong: all four are hard
    cal, records = zoom.calibrate_model(
        model, processor, images, questions, refs, recall=0.5, batch_size=3, max_new_tokens=2
    )
    assert [r["answer"] for r in records] == plain
    assert [r["confidence"] for r in records] == pytest.approx(conf)
    assert cal.n_hard == 4 and cal.quantile == pytest.approx(sorted(conf)[math.ceil(5 * 0.5) - 1])
    assert zoom.answers_match("Yes, there is.", "yes") and not zoom.answers_match("no", "yes")


def test_map_statistics_arithmetic():
    cells = torch.tensor([[1.0, 1.0], [2.0, 0.0]])  # p = 1/4, 1/4, 1/2, 0 over n = 4 cells
    assert zoom.cell_statistic(cells, "peak") == pytest.approx(0.5)
    h = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    assert zoom.cell_statistic(cells, "entropy") == pytest.approx(h / math.log(4))
    uniform = torch.ones(3, 4)
    assert zoom.cell_statistic(uniform, "entropy") == pytest.approx(1.0)
    assert zoom.cell_statistic(uniform, "peak") == pytest.approx(11 / 12)
    assert zoom.cell_statistic(torch.zeros(2, 2), "peak") == 1.0  # no mass: never routed below 1
    assert zoom.cell_statistic(torch.zeros(2, 2), "entropy") == 1.0
    assert zoom.cell_statistic(torch.tensor([3.0]), "entropy") == 0.0
    with pytest.raises(ValueError, match="finite and >= 0"):
        zoom.cell_statistic(torch.tensor([1.0, -1.0]), "peak")
    pixels = torch.zeros(4, 6)
    pixels[0, 0], pixels[3, 5], pixels[1, 1] = 1.0, 2.0, 1.0
    assert zoom.outside_share(pixels, [Frame(0, 0, 2, 2)]) == pytest.approx(0.5)
    # overlapping crops count their union once; together they hold everything
    both = [Frame(0, 0, 2, 2), Frame(1, 1, 5, 3)]
    assert zoom.outside_share(pixels, both) == pytest.approx(0.0)
    assert zoom.outside_share(torch.zeros(4, 6), [Frame(0, 0, 2, 2)]) == 1.0
    # a map of two views: peak and entropy read every view's cells, outside the pixel density
    size = Size(48, 48)
    views = [torch.tensor([[3.0, 1.0], [0.0, 0.0]]), torch.zeros(4, 4)]
    heat = HeatMap(views[0], views, size, [Frame(0, 0, 48, 48), Frame(0, 0, 48, 48)])
    assert zoom.map_statistic(heat, "peak") == pytest.approx(0.25)
    assert zoom.map_statistic(heat, "entropy") == pytest.approx(
        -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(20)
    )
    inside = float(heat.pixels[:24, :24].sum() / heat.pixels.sum())
    assert zoom.map_statistic(heat, "outside", [Frame(0, 0, 24, 24)]) == pytest.approx(1 - inside)
    with pytest.raises(ValueError, match="needs the zoom's crops"):
        zoom.map_statistic(heat, "outside")
    with pytest.raises(ValueError, match="attention-map statistics"):
        zoom.map_statistic(heat, "top1")


def test_routing_statistic_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"statistic='peak_share'; allowed: \('top1'"):
        zoom.ZoomOptions(statistic="peak_share")
    with pytest.raises(ValueError, match="is read from the attention map"):
        zoom.first_token_confidence(torch.zeros(1, 3), "entropy")
    with pytest.raises(ValueError, match="statistic='bogus'"):
        zoom.calibrate([0.1], [True], statistic="bogus")
    assert zoom.ZoomOptions(route="adaptive", threshold=0.5, statistic="outside").statistic == (
        "outside"
    )
    cal = zoom.calibrate([0.2, 0.4, 0.9], [True, True, False], recall=0.5, statistic="entropy")
    cal.save(tmp_path / "cal.json")
    assert zoom.Calibration.load(tmp_path / "cal.json") == cal and cal.statistic == "entropy"


@pytest.mark.parametrize("statistic", ["peak", "outside"])
def test_map_routing_reads_the_map_first_and_asks_only_what_it_does_not_route(statistic):
    model = make_model("llava")
    processor = _processor("llava")  # the encoder's input is 32 x 32
    images = [_photo(96, 64, 3), _photo(32, 32, 8), _photo(80, 80, 5)]
    questions = [QUESTION, QUESTION, "Is there a blue_square ?"]
    kwargs = dict(max_new_tokens=2, anchor="peak", statistic=statistic)
    plain, scores = zoom.first_pass(model, processor, images, questions, **kwargs)
    assert scores[1] is None  # 32 x 32: the zoom cannot crop it
    assert all(0.0 <= scores[b] <= 1.0 for b in (0, 2))
    never = zoom.look_closer(
        model, processor, images, questions, route="adaptive", threshold=0.0, **kwargs
    )
    assert [f.routed for f in never] == [False] * 3
    assert [f.answer for f in never] == [f.plain_answer for f in never] == plain
    assert [f.confidence for f in never] == pytest.approx(scores)
    assert never[0].map is not None and never[1].map is None and not never[0].crops
    every = zoom.look_closer(
        model, processor, images, questions, route="adaptive", threshold=1.0, **kwargs
    )
    assert [f.routed for f in every] == [True, False, True]
    assert [f.plain_answer for f in every] == [None, plain[1], None]  # routed: zoomed only
    assert every[0].zoomed and every[2].zoomed and every[1].answer == plain[1]
    always = zoom.look_closer(model, processor, images, questions, **kwargs)
    assert [every[b].crops == always[b].crops for b in (0, 2)] == [True, True]
    cal, records = zoom.calibrate_model(
        model, processor, images, questions, ["never-said"] * 3, recall=0.5, **kwargs
    )
    assert [r["confidence"] for r in records] == pytest.approx(scores)
    assert (cal.n, cal.n_hard, cal.statistic) == (2, 2, statistic)  # the 32 x 32 row left out


def test_options_are_checked():
    with pytest.raises(ValueError, match="route='adaptive' needs threshold="):
        zoom.ZoomOptions(route="adaptive")
    with pytest.raises(ValueError, match="mode='tiles'; allowed"):
        zoom.ZoomOptions(mode="tiles")
    with pytest.raises(ValueError, match="min_size=1.5: a share"):
        zoom.ZoomOptions(min_size=1.5)
    with pytest.raises(ValueError, match=r"unknown zoom option\(s\) \['zoom_factor'\]"):
        zoom.look_closer(
            make_model("llava"), _processor("llava"), _photo(32, 32), QUESTION, zoom_factor=2
        )
    assert zoom.ZoomOptions(route="adaptive", threshold=0.9).to_json()["threshold"] == 0.9
    with pytest.raises(ValueError, match=r"route='sometimes'; allowed: \('never', 'always'"):
        zoom.ZoomOptions(route="sometimes")


def test_the_zoom_options_are_one_table_that_the_evaluations_read():
    import dataclasses

    from vlm_focus.core.options import options
    from vlm_focus.eval.generation import ZOOMS

    infos = zoom.zoom_options()
    assert infos == options(zoom.ZoomOptions) and all(info.help for info in infos)
    assert [info.name for info in infos][:3] == ["route", "threshold", "statistic"]
    (route,) = [f for f in dataclasses.fields(zoom.ZoomOptions) if f.name == "route"]
    assert route.metadata["choices"] == zoom.ROUTES == ZOOMS == ("never", "always", "adaptive")


# --- with vf.wrap(): prune the full view, zoom on a second pass -----------------------------------
def test_zoom_on_a_pruned_model(monkeypatch):
    model = make_model("llava")
    processor = _processor("llava")
    images = [_photo(96, 64, 6), _photo(64, 96, 7)]
    questions = [QUESTION, "Is there a blue_square ?"]
    kwargs = dict(layers=[0], max_new_tokens=3, min_size=24, anchor="peak")
    plain = zoom.look_closer(model, processor, images, questions, **kwargs)
    with vf.wrap(model, pruner="fastv", keep=0.5, layer=2) as handle:
        spy = _Recorder(model, monkeypatch)
        pruned = zoom.look_closer(model, processor, images, questions, **kwargs)
        trace = handle.last_trace
        (reasked,) = spy.calls
        with torch.no_grad():
            sequences = model.generate(**reasked, max_new_tokens=3, do_sample=False)
    # layer 0 runs before the pruning stage: the same map, the same crops
    for a, b in zip(plain, pruned, strict=True):
        assert torch.allclose(a.map.grid, b.map.grid, atol=1e-6)
        assert a.crops == b.crops
    want = _hand_inputs(
        processor,
        [_hand_text("llava", q, 1) for q in questions],
        [im.crop(f.crops[0].xyxy) for im, f in zip(images, pruned)],
    )
    _assert_same_inputs(reasked, want)
    assert [int(k.numel()) for k in trace.kept] == [8, 8]  # the re-ask ran pruned (16 -> 8)
    texts = processor.batch_decode(
        sequences[:, want["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert [f.answer for f in pruned] == [t.strip() for t in texts]


# --- the high-resolution organism set -----------------------------------------------------------
@pytest.mark.parametrize("layout", ["tile", "spread"])
def test_highres_scenes_keep_exact_boxes(layout):
    from organism import highres

    (scene,) = highres.highres_scenes(1, canvas=576, layout=layout)
    image = scene.image()
    assert image.shape == (576, 576, 3) and scene.downscale == 3
    ox, oy = scene.offset
    for native, placed in zip(scene.native.objects, scene.objects, strict=True):
        mask = placed.mask(576)
        box = placed.box(576)
        if layout == "tile":
            nx, ny, nw, nh = native.box(192)
            assert box == (nx + ox, ny + oy, nw, nh)
            assert np.array_equal(mask[oy : oy + 192, ox : ox + 192], native.mask(192))
        ys, xs = np.nonzero(mask)
        assert box == (xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1)
        # the object falls to about one 16-pixel cell or less in the 192-pixel view
        assert max(box[2], box[3]) / scene.downscale <= 18
        # its pixels carry the object's colour, not the background's
        inside = image[mask].astype(float).mean(0)
        assert np.abs(inside - np.asarray(scene.native.background, float)).max() > 40
    rows = highres.highres_pope([scene], "random")
    assert len(rows) == 6 and {r["label"] for r in rows} == {"yes", "no"}
    for r in rows:
        assert (scene.box(r["category_id"] - 1) is not None) == (r["label"] == "yes")


def test_an_evaluation_routes_on_the_statistic_its_calibration_was_made_with(tmp_path):
    from vlm_focus.eval.pope_run import PopeConfig, parse_sweep

    path = tmp_path / "cal.json"
    zoom.calibrate([0.2, 0.4], [True, True], recall=0.5, statistic="margin").save(path)
    (setting,) = parse_sweep(PopeConfig(zoom="adaptive", zoom_calibration=path))
    assert setting.zoom.statistic == "margin"
    assert setting.zoom.threshold == zoom.Calibration.load(path).threshold


def test_the_calibrate_command_takes_the_zoom_options_defaults(tmp_path, monkeypatch, capsys):
    import json

    import vlm_focus.loading
    from vlm_focus.zoom import __main__ as command

    rows = [{"image": "a.png", "text": QUESTION, "label": "yes"}]
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    seen = {}

    def calibrate_model(model, processor, images, questions, labels, **kwargs):
        seen.update(kwargs)
        return zoom.calibrate([0.5], [True], recall=kwargs["recall"]), []

    monkeypatch.setattr(vlm_focus.loading, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(command, "calibrate_model", calibrate_model)
    argv = ["calibrate", "--questions", str(questions), "--image-dir", str(tmp_path)]
    assert command.main(argv) == 0
    defaults = zoom.ZoomOptions()
    assert (seen["statistic"], seen["max_new_tokens"]) == (
        defaults.statistic,
        defaults.max_new_tokens,
    )
    assert command.main([*argv, "--statistic", "peak", "--max-new-tokens", "4"]) == 0
    assert (seen["statistic"], seen["max_new_tokens"]) == ("peak", 4)
    assert '"threshold"' in capsys.readouterr().out
