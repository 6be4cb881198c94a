"""Asking a saved organism questions, shared by every measurement of both architectures: greedy
answers through the evaluations' ``Generator`` and POPE-style yes/no scoring (no prompt suffix).
"""

from __future__ import annotations

from PIL import Image

from vlm_focus.config import FocusConfig
from vlm_focus.eval.generation import Generator
from vlm_focus.eval.pope import PopeResult
from vlm_focus.eval.pope import evaluate as evaluate_pope
from vlm_focus.loading import build_inputs
from vlm_focus.setting import RunSetting

from .scenes import Scene

QUESTION_SEED = 777
#: New tokens per short answer (the yes/no rule and the two-hop forms read the first word).
ANSWER_TOKENS = 2
BATCH = 32


def picture(scene: Scene) -> Image.Image:
    return Image.fromarray(scene.image())


def model_inputs(processor, scenes: list[Scene], questions: list[str]) -> dict:
    """Model inputs of (scene, question) rows in the chat template, for forward passes."""
    return build_inputs(processor, [picture(s) for s in scenes], list(questions))


def answer(
    model,
    processor,
    scenes,
    questions,
    max_new_tokens: int = ANSWER_TOKENS,
    batch: int = BATCH,
    setting: RunSetting | None = None,
    guide=None,
    guide_processor=None,
) -> list[str]:
    """Greedy answers to (scene, question) pairs through the evaluations' Generator, decoded
    without special tokens; under ``setting`` (default: unpruned, ``max_new_tokens``), with
    ``guide``/``guide_processor`` the guide model of a pruner that needs one."""
    setting = setting or RunSetting(max_new_tokens=max_new_tokens)
    generator = Generator(model, processor, setting, guide=guide, guide_processor=guide_processor)
    out: list[str] = []
    for i in range(0, len(questions), batch):
        pictures = [picture(s) for s in scenes[i : i + batch]]
        out += generator(pictures, list(questions[i : i + batch]))[0]
    return out


def pope_rows(
    scenes: list[Scene], questions: list[str], labels: list[str], split: str | None = None
):
    """POPE rows of (scene, question, yes/no label) triples, the image named as the held-out
    set's files are."""
    rows = []
    for i, (s, q, a) in enumerate(zip(scenes, questions, labels, strict=True)):
        row = {"question_id": i, "image_id": s.seed, "image": f"scene_{s.seed}.png"}
        rows.append({**row, "text": q, "label": a, **({"split": split} if split else {})})
    return rows


def yes_no(
    model, processor, rows: list[dict], scenes: list[Scene], focus: FocusConfig | None = None
) -> PopeResult:
    """:func:`vlm_focus.eval.pope.evaluate` of POPE rows on their scenes (no prompt suffix,
    short greedy answers), pruned by ``focus`` if given."""
    by_seed = {s.seed: s for s in scenes}
    return evaluate_pope(
        model,
        processor,
        rows,
        RunSetting(focus=focus, max_new_tokens=ANSWER_TOKENS),
        images=lambda row: picture(by_seed[row["image_id"]]),
        suffix="",
        batch_size=BATCH,
    )
