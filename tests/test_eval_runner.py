"""Resumable JSONL runs: interrupted runs resume without loss or duplicates, partial lines are
repaired, shards cover the items and merge in order (simulated and real 2-process runs)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vlm_focus.eval.runner import (
    append_jsonl,
    merge,
    read_jsonl,
    run_items,
    shard,
    shard_path,
    shard_paths,
)

ITEMS = [{"id": f"q{i}", "x": i} for i in range(23)]


def square(batch):
    return [{"id": it["id"], "y": it["x"] ** 2} for it in batch]


class Interrupt(Exception):
    pass


def stopping_after(n):
    done = []

    def process(batch):
        if len(done) >= n:
            raise Interrupt
        out = square(batch)
        done.extend(out)
        return out

    return process, done


class FakeState:
    def __init__(self, index, count):
        self.process_index, self.num_processes = index, count
        self.is_main_process = index == 0

    def wait_for_everyone(self):
        pass


def test_uninterrupted_run_writes_every_item_in_order(tmp_path):
    out = tmp_path / "run.jsonl"
    records = run_items(ITEMS, square, out, key="id", batch_size=4)
    assert records == square(ITEMS)
    assert read_jsonl(out) == records and shard_paths(out) == []


@pytest.mark.parametrize("stop_after", [0, 4, 12, 20])
def test_interrupted_run_resumes_to_the_same_result(tmp_path, stop_after):
    out = tmp_path / "run.jsonl"
    process, _ = stopping_after(stop_after)
    with pytest.raises(Interrupt):
        run_items(ITEMS, process, out, key="id", batch_size=4)
    assert len(read_jsonl(shard_path(out, 0))) == stop_after  # finished items are on disk
    calls = []

    def counting(batch):
        calls.extend(it["id"] for it in batch)
        return square(batch)

    records = run_items(ITEMS, counting, out, key="id", batch_size=4)
    assert records == square(ITEMS)
    assert read_jsonl(out) == square(ITEMS)  # no duplicates, item order
    assert len(calls) == len(ITEMS) - stop_after  # finished items were skipped
    assert run_items(ITEMS, counting, out, key="id") == records
    assert len(calls) == len(ITEMS) - stop_after  # a finished run does nothing


def test_partial_trailing_line_is_dropped_and_repaired(tmp_path):
    out = tmp_path / "run.jsonl"
    log = shard_path(out, 0)
    for r in square(ITEMS[:3]):
        append_jsonl(log, r)
    with open(log, "a") as f:
        f.write('{"id": "q3", "y"')  # a kill in the middle of a write
    assert [r["id"] for r in read_jsonl(log)] == ["q0", "q1", "q2"]
    assert log.read_text().endswith("\n")  # truncated to the last complete line
    records = run_items(ITEMS, square, out, key="id", batch_size=5)
    assert records == square(ITEMS)


def test_corrupt_complete_line_is_reported(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(path)


def test_shards_are_disjoint_and_cover():
    for count in (1, 2, 3, 5):
        parts = [shard(ITEMS, i, count) for i in range(count)]
        ids = [it["id"] for p in parts for it in p]
        assert sorted(ids) == sorted(it["id"] for it in ITEMS) and len(set(ids)) == len(ITEMS)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        shard(ITEMS, 2, 2)


def test_simulated_two_process_run_merges_in_order(tmp_path):
    out = tmp_path / "run.jsonl"
    run_items(ITEMS, square, out, key="id", batch_size=3, state=FakeState(1, 2))
    assert not out.exists() and len(read_jsonl(shard_path(out, 1))) == 11
    merged = run_items(ITEMS, square, out, key="id", batch_size=3, state=FakeState(0, 2))
    assert merged == square(ITEMS) and read_jsonl(out) == square(ITEMS)
    assert shard_paths(out) == []
    # resuming with a different process count reuses everything
    assert run_items(ITEMS, pytest.fail, out, key="id", state=FakeState(0, 3)) == merged


def test_merge_keeps_extra_finished_items_and_drops_duplicates(tmp_path):
    out = tmp_path / "run.jsonl"
    for r in square(ITEMS[5:8]) + square(ITEMS[5:6]):
        append_jsonl(shard_path(out, 1), r)
    for r in square(ITEMS[:2]):
        append_jsonl(shard_path(out, 0), r)
    wanted = merge(out, [it["id"] for it in ITEMS[:6]], "id")
    assert [r["id"] for r in wanted] == ["q0", "q1", "q5"]
    assert [r["id"] for r in read_jsonl(out)] == ["q0", "q1", "q5", "q6", "q7"]


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vlm_focus.eval.runner import process_state, run_items
    state = process_state()
    items = [{"id": i, "x": i} for i in range(10)]
    def process(batch):
        return [{"id": it["id"], "y": it["x"] * 3, "rank": state.process_index} for it in batch]
    records = run_items(items, process, sys.argv[1], key="id", batch_size=2, state=state)
    with open(f"{sys.argv[2]}.{state.process_index}", "w") as f:
        json.dump([r["id"] for r in records], f)
    """
)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_through_accelerate_launch(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run.jsonl"
    # without CUDA, --multi_gpu starts torchrun processes that join over gloo as CPU processes
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
    ]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--main_process_port", str(_free_port())]  # not the shared default 29500
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # the children import this checkout's vlm_focus whether or not it is installed
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # each process reports through its own file: a launcher may not pass children's stdout on
    report = tmp_path / "result"
    done = subprocess.run(
        [*cmd, str(script), str(out), str(report)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):
        reported = tmp_path / f"result.{rank}"
        assert reported.exists(), f"process {rank} reported nothing:\n{done.stderr[-2000:]}"
        assert json.loads(reported.read_text()) == list(range(10))
    records = read_jsonl(out)
    assert [r["id"] for r in records] == list(range(10))
    assert [r["y"] for r in records] == [3 * i for i in range(10)]
    assert {r["rank"] for r in records} == {0, 1}  # both processes did work
    assert [r["rank"] for r in records] == [i % 2 for i in range(10)]  # strided shards


def test_a_different_configuration_is_not_resumed(tmp_path):
    out = tmp_path / "run.jsonl"
    config = {"model": "m", "prompt_suffix": "\nAnswer.", "decoding": "greedy"}
    run_items(ITEMS[:4], square, out, key="id", config=config)
    assert run_items(ITEMS[:4], pytest.fail, out, key="id", config=dict(config)) == square(
        ITEMS[:4]
    )
    with pytest.raises(ValueError, match="differs in prompt_suffix"):
        run_items(ITEMS, square, out, key="id", config={**config, "prompt_suffix": ""})
