"""lmms-eval plugin: ``python -m lmms_eval --model vlm_focus`` on the embedded organism against
``vlm-focus eval pope`` on the same questions, argument checks before weights load, and the
yes-ratio of the shipped POPE variant."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms

from organism import default_model_path, qwen_model_path
from vlm_focus.integrations import lmms_eval_tasks_path, split_model_args
from vlm_focus.integrations.lmms_eval_tasks import organism_yes_ratio, predicted_yes_ratio
from vlm_focus.loading import build_inputs, decode_new_tokens, load_model

QUESTIONS = Path(default_model_path()).parent / "heldout" / "pope_adversarial.jsonl"
TASK = "vf_pope_organism_adversarial"
LIMIT = 60
PRUNED = "pruner=fastv,keep=0.11,layer=0"  # 0.25 changes none of these answers
METRICS = ("accuracy", "precision", "recall", "f1", "yes_ratio", "unparseable")


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HOME=str(home / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _run(cmd: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _lmms_eval(
    out: Path, env: dict[str, str], extra: str, limit: int = LIMIT
) -> tuple[dict, list[dict]]:
    args = "pretrained=embedded" + (f",{extra}" if extra else "")
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vlm_focus", "--model_args", args]
    cmd += ["--tasks", TASK, "--include_path", lmms_eval_tasks_path(), "--limit", str(limit)]
    cmd += ["--batch_size", "1", "--output_path", str(out), "--log_samples"]
    _run(cmd, env)
    (results,) = out.rglob("*_results.json")
    (samples,) = out.rglob(f"*_samples_{TASK}.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return json.loads(results.read_text()), rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both paths, unpruned and pruned: lmms-eval through the plugin and ``vlm-focus eval``."""
    root = tmp_path_factory.mktemp("lmms_eval")
    env = _env(root)
    out = {}
    for name, extra in (("unpruned", ""), ("pruned", PRUNED)):
        out[name] = _lmms_eval(root / f"lmms-{name}", env, extra)
    sweep = ["--sweep", "keep=0.11", "--pruners", "fastv", "--layer", "0"]
    for name, tag in (("unpruned", "unpruned"), ("pruned", "fastv-k0.11-l0")):
        out[f"vf-{name}"] = _vlm_focus_eval(root / "vf", env, sweep, tag)
    return out


def _vlm_focus_eval(
    out: Path, env: dict[str, str], args: list[str], tag: str, limit: int = LIMIT
) -> tuple[dict, list[dict]]:
    """``vlm-focus eval pope`` on the same question file (resumable: a second call for another
    setting of the same run only reads its results)."""
    cmd = [sys.executable, "-m", "vlm_focus.cli", "eval", "pope", "--questions", str(QUESTIONS)]
    cmd += ["--limit", str(limit), "--batch-size", "1", "--threads", "1", "--out", str(out)]
    _run(cmd + args, env)
    folder = out / "pope" / "embedded" / "adversarial"
    records = [json.loads(x) for x in (folder / f"{tag}.jsonl").read_text().splitlines()]
    return json.loads((folder / f"{tag}.json").read_text()), records


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["unpruned", "pruned"])
def test_lmms_eval_answers_and_metrics_equal_vlm_focus_eval(runs, setting):
    results, samples = runs[setting]
    summary, records = runs[f"vf-{setting}"]
    assert len(samples) == len(records) == LIMIT
    ours = {s["accuracy"]["question_id"]: s for s in samples}
    theirs = {r["question_id"]: r for r in records}
    assert sorted(ours) == sorted(theirs) == list(range(1, LIMIT + 1))
    for qid, record in theirs.items():
        logged = ours[qid]["accuracy"]
        assert (logged["answer"], logged["pred"], logged["parseable"]) == (
            record["answer"],
            record["pred"],
            record["parseable"],
        ), f"question {qid}"
        assert logged["label"] == record["label"]
    metrics = results["results"][TASK]
    for name in METRICS:
        assert metrics[f"{name},none"] == pytest.approx(summary[name], abs=1e-12), name
    if setting == "pruned":  # the pruned setting must actually change some answers
        unpruned = {r["question_id"]: r["answer"] for r in runs["vf-unpruned"][1]}
        assert any(unpruned[q] != theirs[q]["answer"] for q in theirs)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["unpruned", "pruned"])
def test_logged_kept_counts_equal_the_wrap_trace(runs, setting):
    results, samples = runs[setting]
    _, records = runs[f"vf-{setting}"]
    trace = {r["question_id"]: (r["visual_kept"], r["visual_total"]) for r in records}
    for s in samples:
        (counts,) = s["token_counts"]
        qid = s["accuracy"]["question_id"]
        assert (counts["visual_kept"], counts["visual_total"]) == trace[qid], f"question {qid}"
        assert counts["prefill_s"] > 0
        assert counts["vlm_focus"] == ("fastv-k0.11-l0" if setting == "pruned" else "unpruned")
    total = 144  # the embedded model's 12 x 12 grid
    kept = round(0.11 * total) if setting == "pruned" else total
    assert {trace[q] for q in trace} == {(kept, total)}
    throughput = results["throughput"]
    assert throughput["avg_vlm_focus_kept_ratio"] == pytest.approx(kept / total)
    assert throughput["avg_vlm_focus_visual_kept"] == pytest.approx(kept)
    assert throughput["avg_vlm_focus_prefill_s"] > 0
    assert results["config"]["model"] == "vlm_focus"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, args, tag",
    [
        (
            "pruner=guided,guide=embedded,keep=0.25,layer=0",
            ["--pruner", "guided", "--keep", "0.25", "--layer", "0"],
            "guided-k0.25-l0",
        ),
        (
            "mitigate=attention_reweight,strength=1.0",
            ["--mitigate", "attention_reweight"],
            "unpruned-attention_reweight",
        ),
    ],
)
def test_guided_pruning_and_mitigation_equal_vlm_focus_eval(tmp_path, extra, args, tag):
    """The guide model's inputs are built from lmms-eval's messages; the mitigation runs around
    lmms-eval's generate(); both give ``vlm-focus eval pope``'s answers and kept counts."""
    env = _env(tmp_path)
    results, samples = _lmms_eval(tmp_path / "lmms", env, extra, limit=12)
    summary, records = _vlm_focus_eval(tmp_path / "vf", env, args, tag, limit=12)
    logged = {
        s["accuracy"]["question_id"]: (s["accuracy"]["answer"], s["token_counts"][0]["visual_kept"])
        for s in samples
    }
    assert logged == {r["question_id"]: (r["answer"], r["visual_kept"]) for r in records}
    assert results["results"][TASK]["f1,none"] == pytest.approx(summary["f1"], abs=1e-12)


QWEN_PRUNED = "pruner=fastv,keep=0.25,layer=0"


def _answers_and_counts(tmp_path, env, args: str, batch: int, limit: int) -> dict:
    """Run lmms-eval's `vlm_focus` model on `limit` questions of TASK at `batch`; per question
    id, the answer and the first row's visual tokens kept and total."""
    out = tmp_path / f"b{batch}"
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vlm_focus", "--model_args", args]
    cmd += ["--tasks", TASK, "--include_path", lmms_eval_tasks_path(), "--limit", str(limit)]
    cmd += ["--batch_size", str(batch), "--output_path", str(out)]
    _run([*cmd, "--log_samples"], env)
    (samples,) = out.rglob(f"*_samples_{TASK}.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return {
        s["accuracy"]["question_id"]: (
            s["accuracy"]["answer"],
            s["token_counts"][0]["visual_kept"],
            s["token_counts"][0]["visual_total"],
        )
        for s in rows
    }


@pytest.mark.slow
def test_qwen_chat_class_batch_4_equals_batch_1(tmp_path):
    """lmms-eval's batched Qwen2.5-VL chat class under the plugin, on organism-qwen: batch 4
    (rows of different lengths, left-padded together) gives batch 1's answers and kept counts,
    pruned."""
    env = _env(tmp_path)
    runs = {}
    for batch in (1, 4):
        args = f"pretrained={qwen_model_path()},{QWEN_PRUNED}"
        runs[batch] = _answers_and_counts(tmp_path, env, args, batch, limit=24)
    assert len(runs[1]) == 24 and runs[4] == runs[1]
    answers = [a for a, _, _ in runs[1].values()]
    assert {"yes", "no"} <= {a.strip().lower() for a in answers}  # the model answers, both ways
    assert all(kept < total for _, kept, total in runs[1].values())


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 (hybrid decoder) saved with its real processor. Patch 16, as the real
    checkpoints: lmms-eval's Qwen3-VL chat class sizes images for it before the processor."""
    from tiny_processors import hybrid_processor

    from vlm_focus.model_adapters.tiny import tiny_model

    path = tmp_path_factory.mktemp("qwen3_5") / "model"
    model = tiny_model("qwen3_5", vision={"patch_size": 16})
    model.save_pretrained(path)
    hybrid_processor(model).save_pretrained(path)
    return path


def test_the_qwen3_5_class_takes_the_arguments_of_the_class_it_extends():
    from lmms_eval.models.chat.qwen3_5 import Qwen3_5

    from vlm_focus.integrations.lmms_eval import DELEGATES, _init_parameters

    assert DELEGATES["qwen3_5"].class_path == "lmms_eval.models.chat.qwen3_5.Qwen3_5"
    names = _init_parameters(Qwen3_5)
    # its own (Qwen3.5's pixel budget and thinking) and Qwen3-VL's, which it forwards to
    assert {"pretrained", "min_pixels", "enable_thinking", "batch_size", "device"} <= set(names)


@pytest.mark.slow
def test_lmms_eval_runs_the_qwen3_5_chat_class_pruned_batch_2_equals_batch_1(
    qwen3_5_checkpoint, tmp_path
):
    """lmms-eval's Qwen3.5 chat class under the plugin on a saved tiny hybrid checkpoint,
    offline, pruned at the full-attention layer: batch 2 (left-padded rows) gives batch 1's
    answers and kept counts, half of each row's visual tokens."""
    env = _env(tmp_path)
    args = f"pretrained={qwen3_5_checkpoint},pruner=fastv,keep=0.5,layer=2"
    runs = {}
    for batch in (1, 2):
        runs[batch] = _answers_and_counts(tmp_path, env, args, batch, limit=4)
    assert len(runs[1]) == 4 and runs[2] == runs[1]
    assert all(2 * kept == total > 0 for _, kept, total in runs[1].values())


@pytest.mark.slow
def test_lmms_eval_runs_the_gemma4_class_pruned_batch_2_equals_batch_1(tmp_path):
    """lmms-eval's Gemma 4 class under the plugin on a saved tiny checkpoint with its real
    processor, offline: batch 2 gives batch 1's answers and kept counts, half of each row's
    visual tokens (the class's own ``max_soft_tokens`` passed through)."""
    from tiny_processors import gemma4_processor

    from vlm_focus.model_adapters.tiny import tiny_model

    path = tmp_path / "gemma4"
    model = tiny_model("gemma4")
    model.save_pretrained(path)
    gemma4_processor(model).save_pretrained(path)
    env = _env(tmp_path)
    args = f"pretrained={path},pruner=fastv,keep=0.5,layer=1,max_soft_tokens=70"
    runs = {batch: _answers_and_counts(tmp_path, env, args, batch, limit=4) for batch in (1, 2)}
    assert len(runs[1]) == 4 and runs[2] == runs[1]
    assert all(2 * kept == total > 0 for _, kept, total in runs[1].values())


def test_entry_point_registers_the_model():
    (ep,) = [e for e in entry_points(group="lmms_eval.models") if e.name == "vlm_focus"]
    from lmms_eval.models import get_model

    from vlm_focus.integrations.lmms_eval import VlmFocus

    assert ep.load()().chat_class_path == "vlm_focus.integrations.lmms_eval.VlmFocus"
    assert ep.value == "vlm_focus.integrations:lmms_eval_manifest"
    assert get_model("vlm_focus") is VlmFocus


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"kep": 0.25}, "'kep' (did you mean 'keep'?)"),
        ({"pruner": "fastv", "keep": 0}, "keep=0"),
        ({"pruner": "nope"}, "unknown pruner 'nope'"),
        ({"pruner": "fastv", "alpha": 0.5}, "option 'alpha' is not an option of pruner 'fastv'"),
        ({"pruner": "debiased", "trend": "cubic"}, "trend"),
        ({"layer": "2:x"}, "layer='2:x'"),
        ({"layer": "8:2", "keep": "0.5:0.25"}, "strictly increasing"),
        ({"mitigate": "visual_beam"}, "mitigate='visual_beam'"),
        ({"mitigate": "nothing"}, "mitigate='nothing'"),
        ({"strength": 2.0}, "strength set without mitigate="),
        ({"mitigate": "attention_reweight", "pruner": "fixation"}, "does not combine with pruner"),
        ({"mitigate": "attention_reweight", "mitigate_layers": "0:9"}, "mitigate_layers: layer 9"),
        ({"pruner": "fastv", "layer": 9}, "layer: layer 9 is out of range"),
        ({"pruner": "guided"}, "guide=PATH"),
        ({"guide": "/no/such/model"}, "guide='/no/such/model'"),
        ({"pruner": "fastv", "batch_size": 4}, "batch_size=4"),
    ],
)
def test_bad_model_args_fail_before_weights_load(monkeypatch, bad, needle):
    from transformers import PreTrainedModel

    from vlm_focus.integrations.lmms_eval import VlmFocus

    def no_weights(*args, **kwargs):
        raise AssertionError("model weights were loaded before the arguments were checked")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(no_weights))
    with pytest.raises(ValueError) as err:
        VlmFocus(pretrained="embedded", **bad)
    assert needle in str(err.value)


def test_model_args_split_and_schedules():
    focus, rest = split_model_args(
        {"pretrained": "x", "batch_size": 2, "pruner": "debiased", "base": "text", "keep": 0.5}
    )
    assert rest == {"pretrained": "x", "batch_size": 2}
    assert focus.wrap == {"pruner": "debiased", "base": "text", "keep": 0.5}
    assert focus.tag() == "debiased-k0.5-l2-base_text"  # FocusConfig's default layer
    focus, _ = split_model_args({"layer": "2:8:16", "keep": "0.5:0.25:64", "query_rows": "last"})
    assert focus.config().stages == [(2, 0.5), (8, 0.25), (16, 64)]
    assert focus.tag() == "fastv-k0.5:0.25:64-l2:8:16-qlast"
    with pytest.raises(ValueError, match="unknown model argument 'query'"):  # an earlier name
        split_model_args({"layer": "2", "keep": "0.5", "query": "last"}, other=["pretrained"])
    focus, _ = split_model_args(
        {"mitigate": "attention_reweight", "strength": 2, "mitigate_layers": "0:1"}
    )
    assert not focus.pruned and focus.mitigate == "attention_reweight"
    assert focus.mitigate_options == {"strength": 2.0, "layers": [0, 1]}
    assert focus.tag() == "unpruned-attention_reweight-layers_0_1-strength_2.0"
    focus, _ = split_model_args({"guide": "embedded", "keep": 0.5, "layer": 0})
    assert focus.wrap["pruner"] == "guided" and Path(focus.guide, "config.json").is_file()


def test_yes_ratio_is_the_share_of_predicted_yes():
    """A hand-made balanced split where the model says yes 3 times out of 4."""
    from lmms_eval.tasks.pope.utils import pope_aggregate_yes_ratio, pope_process_results

    docs = [
        {"question_id": i, "answer": label}
        for i, label in enumerate(["yes", "yes", "no", "no"], start=1)
    ]
    answers = ["Yes", "yes", " yes ", "no"]
    records = [pope_process_results(d, [a])["pope_yes_ratio"] for d, a in zip(docs, answers)]
    assert predicted_yes_ratio(records) == 0.75
    assert pope_aggregate_yes_ratio(records) == 0.5  # lmms-eval 0.7.3 averages the labels
    assert predicted_yes_ratio([]) == 0.0
    ours = [
        {"label": d["answer"], "pred": p, "parseable": True}
        for d, p in zip(docs, ["yes", "yes", "yes", "no"])
    ]
    assert organism_yes_ratio(ours) == 0.75


def test_shipped_task_yamls_load_in_lmms_eval():
    """lmms-eval indexes the shipped tasks; ``vf_pope`` is lmms-eval's POPE but for yes_ratio."""
    from lmms_eval import utils
    from lmms_eval.tasks import TaskManager
    from lmms_eval.tasks.pope import utils as pope

    names = TaskManager(include_path=lmms_eval_tasks_path()).all_tasks
    splits = [f"vf_pope_organism_{s}" for s in ("random", "popular", "adversarial")]
    assert {"vf_pope", "vf_pope_organism", *splits} <= set(names)
    config = utils.load_yaml_config(str(Path(lmms_eval_tasks_path()) / "vf_pope.yaml"))
    aggregations = {m["metric"]: m["aggregation"] for m in config["metric_list"]}
    assert aggregations.pop("pope_yes_ratio") is predicted_yes_ratio
    assert aggregations["pope_f1_score"] is pope.pope_aggregate_f1_score
    assert config["process_results"] is pope.pope_process_results
    organism = utils.load_yaml_config(str(Path(lmms_eval_tasks_path()) / f"{splits[0]}.yaml"))
    (data,) = organism["dataset_kwargs"]["data_files"].values()
    assert Path(data).resolve() == QUESTIONS.with_name("pope_random.jsonl").resolve()


class BatchedChat(lmms):
    """Stands in for lmms-eval's batched chat classes (``chat/qwen2_5_vl.py``): it reorders the
    requests, calls each request's ``doc_to_messages`` in batch-row order, left-pads a batch and
    generates it in one call, and returns the answers in the requests' order."""

    is_simple = False

    def __init__(self, pretrained, batch_size=1, device="cpu", device_map="cpu"):
        super().__init__()
        self.model, self.processor = load_model(pretrained, device=device)
        self.batch_size = int(batch_size)

    def generate_until(self, requests):
        order = sorted(range(len(requests)), key=lambda i: -requests[i].args[3])
        out = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            images, prompts = [], []
            for i in chunk:
                _, to_messages, _, doc_id, task, split = requests[i].args
                (message,) = to_messages(self.task_dict[task][split][doc_id])
                images.append(message["content"][0]["url"])
                prompts.append(message["content"][1]["text"])
            inputs = build_inputs(self.processor, images, prompts)
            sequences = self.model.generate(**inputs, max_new_tokens=4, do_sample=False)
            texts = decode_new_tokens(self.processor, inputs, sequences)
            for i, text in zip(chunk, texts):
                out[i] = GenerationResult(text=text, token_counts=TokenCounts(output_tokens=1))
        return out

    def loglikelihood(self, requests):
        raise NotImplementedError

    def generate_until_multi_round(self, requests):
        raise NotImplementedError


def test_batches_map_each_row_back_to_its_request(monkeypatch):
    """Batch 3 over 7 requests, reordered by the delegate: every request gets its own row's
    prompt length, its batch's prefill share and the kept count of a direct wrap."""
    import types

    from vlm_focus.eval import read_questions
    from vlm_focus.integrations import lmms_eval as plugin
    from vlm_focus.integrations.lmms_eval_tasks import organism_doc_to_text
    from vlm_focus.integrations.lmms_eval_tasks import organism_doc_to_visual as to_visual

    module = types.ModuleType("_fake_lmms_chat")
    module.BatchedChat = BatchedChat
    monkeypatch.setitem(sys.modules, "_fake_lmms_chat", module)
    monkeypatch.setitem(plugin.DELEGATES, "llava", plugin.Delegate("_fake_lmms_chat.BatchedChat"))
    lm = plugin.VlmFocus(pretrained="embedded", batch_size=3, pruner="fastv", keep=0.25, layer=0)
    docs = read_questions(QUESTIONS)[:7]
    lm.task_dict["t"] = {"test": docs}

    def to_messages(doc):
        content = [{"type": "image", "url": to_visual(doc)[0]}]
        return [{"role": "user", "content": content + [{"type": "text", "text": ask(doc)}]}]

    def ask(doc):  # prompts of three lengths
        return organism_doc_to_text(doc, {"pre_prompt": doc["text"] * (doc["question_id"] % 3)})

    requests = [
        Instance(
            "generate_until",
            ("", to_messages, {}, i, "t", "test"),
            0,
            metadata={"task": "t", "doc_id": i, "repeats": 1},
        )
        for i in range(len(docs))
    ]
    counts = [r.token_counts for r in lm.generate_until(requests)]
    processor = lm.delegate.processor
    lengths = [
        int(build_inputs(processor, to_visual(d), [ask(d)])["attention_mask"].sum()) for d in docs
    ]
    assert len(set(lengths)) > 1  # rows differ, so a mix-up would show
    assert [c.input_tokens for c in counts] == lengths
    assert {(c.visual_kept, c.visual_total) for c in counts} == {(36, 144)}
    chunks = [[6, 5, 4], [3, 2, 1], [0]]  # the delegate's batches (descending doc id)
    for chunk in chunks:
        assert len({counts[i].prefill_s for i in chunk}) == 1
    assert len({c.prefill_s for c in counts}) == len(chunks)
    assert all(c.output_tokens == 1 for c in counts)
    lm.remove()
    assert not hasattr(lm.delegate.model, "_vlm_focus_handle")


def test_the_harness_takes_its_mitigations_and_names_from_the_registry(monkeypatch):
    from vlm_focus import hallucination as hal
    from vlm_focus.integrations import model_args

    assert model_args.harness_mitigations() == ["attention_reweight"]
    assert "num_beams" in model_args.harness_limit(hal.get_mitigation("visual_beam"))
    with pytest.raises(ValueError, match="unknown mitigation 'reweight'"):  # an earlier name
        split_model_args({"mitigate": "reweight"})
    assert split_model_args({"mitigate": "none"})[0].mitigate is None
    monkeypatch.setattr(hal.registry, "_MITIGATIONS", dict(hal.registry._MITIGATIONS))

    @dataclasses.dataclass
    class GentleOptions(hal.AttentionReweightOptions):
        strength: float = 0.5
        warmup: int = dataclasses.field(default=0, metadata={"help": "steps before it acts"})

    @hal.register_mitigation  # a new hook-only mitigation runs in the harness too
    class GentleReweight(hal.AttentionReweight):
        name, Options = "gentle_reweight", GentleOptions

    assert split_model_args({"mitigate": "gentle_reweight"})[0].mitigate == "gentle_reweight"
    # its options are model arguments, read by their declared types, with no code of their own
    gentle = split_model_args({"mitigate": "gentle_reweight", "warmup": "3"})[0]
    assert gentle.mitigate_options == {"warmup": 3}
    with pytest.raises(ValueError, match="warmup is not an option of mitigate='attention_"):
        split_model_args({"mitigate": "attention_reweight", "warmup": 3})


def test_delegates_cover_every_supported_model_or_say_why_not():
    import vlm_focus as vf
    from vlm_focus.integrations.lmms_eval import DELEGATES

    assert sorted(DELEGATES) == sorted(vf.supported_models())
    for model_type, spec in DELEGATES.items():
        assert (spec.class_path is None) == bool(spec.left_out), model_type
    # every supported model type has an lmms-eval class (the MoE ones through the config)
    assert [t for t, spec in DELEGATES.items() if spec.class_path is None] == []


def test_a_left_out_model_type_says_why_before_weights_load(monkeypatch, tmp_path):
    from transformers import PreTrainedModel, Qwen3VLMoeConfig

    from vlm_focus.integrations import lmms_eval

    def no_weights(*args, **kwargs):
        raise AssertionError("model weights were loaded before the model type was checked")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(no_weights))
    why = "no lmms-eval class reads this checkpoint"
    delegates = {**lmms_eval.DELEGATES, "qwen3_vl_moe": lmms_eval.Delegate(None, left_out=why)}
    monkeypatch.setattr(lmms_eval, "DELEGATES", delegates)
    Qwen3VLMoeConfig().save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        lmms_eval.VlmFocus(pretrained=str(tmp_path))
    message = str(err.value)
    assert message.startswith("--model vlm_focus does not run model_type 'qwen3_vl_moe'")
    assert why in message
    assert "It runs: gemma3, gemma4, internvl, llava, " in message
    assert "qwen3_vl_moe" not in message.split("It runs:")[1]


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_vl_moe", "qwen3_5"])
def test_the_moe_class_is_chosen_by_the_config_not_the_checkpoint_name(tmp_path, model_type):
    """lmms-eval 0.7.3 loads the MoE model only when the path has a part like 'A3B': a local
    folder without one still loads as what its config says, and a dense one named like an MoE
    loads dense."""
    from tiny_processors import hybrid_processor

    from vlm_focus.integrations.lmms_eval import VlmFocus
    from vlm_focus.model_adapters.tiny import tiny_model

    name = "Dense-A3B" if model_type == "qwen3_5" else "model"
    path = tmp_path / name
    model = tiny_model(model_type, vision={"patch_size": 16})
    model.save_pretrained(path)
    hybrid_processor(model).save_pretrained(path)  # Qwen3-VL's processor, all three classes'
    lm = VlmFocus(pretrained=str(path), pruner="fastv", keep=0.5, layer=0)
    assert type(lm.delegate.model) is type(model)
    lm.remove()


def test_a_folder_declaring_the_generic_tokenizer_keeps_it_in_the_delegate():
    """transformers gives a qwen3_5 folder Qwen3.5's BPE tokenizer whatever it declares; the
    delegate gets organism-qwen35's word tokenizer, as ``load_processor`` reads it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from vlm_focus.asset_paths import qwen35_model_path
    from vlm_focus.integrations.lmms_eval import _read_declared_tokenizer
    from vlm_focus.loading import load_processor

    path = str(qwen35_model_path())
    guessed = AutoTokenizer.from_pretrained(path)
    delegate = SimpleNamespace(processor=SimpleNamespace(tokenizer=guessed), _tokenizer=guessed)
    _read_declared_tokenizer(delegate, path)
    text = "is there a red_circle in the image ?"
    want = load_processor(path).tokenizer(text)["input_ids"]
    assert guessed(text)["input_ids"] != want
    assert delegate.processor.tokenizer(text)["input_ids"] == want
    assert delegate._tokenizer(text)["input_ids"] == want
