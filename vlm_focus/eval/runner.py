"""Resumable, data-parallel item runs: an append-only JSONL log per process, merged in order.

Every finished item is one line, written with a single ``write()`` of the complete line, then
``flush()`` and ``fsync()``. A run killed mid-write can leave at most one partial line at the end
of a file; :func:`read_jsonl` drops it (and truncates the file), so the next run starts cleanly
and redoes only that item. Items are keyed by a stable id; a re-run skips every id found in the
merged file or in any shard file.

Under ``accelerate launch`` each process takes a strided shard ``items[rank::world]`` and
appends to its own ``<name>.shard<rank>.jsonl``; after ``wait_for_everyone()`` the main process
merges all shards into ``<name>.jsonl`` in item order (atomic replace), removes the shards, and
every process returns the same merged list. With one process (CPU) the path is the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

Record = dict[str, Any]


def read_jsonl(path: str | Path, *, repair: bool = True) -> list[Record]:
    """Records of a JSONL log. A trailing line without its newline is an interrupted write: it is
    ignored and, with ``repair``, cut from the file. A malformed complete line raises
    ``ValueError`` naming the file and line number."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and repair:
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    records = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{number} is not valid JSON ({err}); fix or delete it"
            ) from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number} is not a JSON object")
        records.append(record)
    return records


def append_jsonl(path: str | Path, record: Record) -> None:
    """Append one record as one complete line: a single ``write()``, ``flush()``, ``fsync()``."""
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def write_jsonl_atomic(path: str | Path, records: Iterable[Record]) -> None:
    """Write a whole JSONL file through a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard(items: Sequence[Any], index: int, count: int) -> list[Any]:
    """Strided shard ``items[index::count]``: shards are disjoint, cover every item, and differ in
    size by at most one."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard index {index} of {count}: need 0 <= index < count")
    return list(items[index::count])


def shard_paths(out: str | Path) -> list[Path]:
    """Existing shard logs of the merged log ``out`` (any process count)."""
    out = Path(out)
    return sorted(out.parent.glob(f"{out.stem}.shard*.jsonl"))


def shard_path(out: str | Path, index: int) -> Path:
    out = Path(out)
    return out.with_name(f"{out.stem}.shard{index}.jsonl")


def finished(out: str | Path, key: str, own: Path | None = None) -> dict[Any, Record]:
    """Every finished record of ``out`` and its shards, first occurrence of each id kept.

    Only the ``own`` shard is repaired (truncated); other processes may be writing theirs.
    """
    done: dict[Any, Record] = {}
    for path in [Path(out), *shard_paths(out)]:
        for record in read_jsonl(path, repair=own is not None and path == own):
            if key not in record:
                raise ValueError(f"{path}: a record has no {key!r} field")
            done.setdefault(record[key], record)
    return done


def merge(out: str | Path, order: Sequence[Any], key: str) -> list[Record]:
    """Merge ``out`` and its shards into ``out``: the ids of ``order`` first, in that order, then
    any other finished ids in the order found; no duplicates. Shards are removed afterwards.
    Returns the records of ``order`` that are finished, in order."""
    out = Path(out)
    done = finished(out, key)
    wanted = [done[k] for k in order if k in done]
    seen = set(order)
    rest = [r for k, r in done.items() if k not in seen]
    write_jsonl_atomic(out, wanted + rest)
    for path in shard_paths(out):
        path.unlink(missing_ok=True)
    return wanted


def check_config(out: str | Path, config: dict, *, write: bool = True) -> None:
    """Store ``config`` beside the log ``out``, or check it against the stored one."""
    path = Path(out).with_suffix(".config.json")
    config = json.loads(json.dumps(config, default=str))
    if path.exists():
        stored = json.loads(path.read_text())
        if stored != config:
            diff = sorted(k for k in set(stored) | set(config) if stored.get(k) != config.get(k))
            raise ValueError(
                f"{out} holds results of another configuration (differs in {', '.join(diff)}); "
                "use another --out or delete these files to start again"
            )
    elif write:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(config, indent=1))
        os.replace(tmp, path)


class _SingleProcess:
    """The subset of ``accelerate.PartialState`` used here, for plain single-process runs."""

    process_index = 0
    num_processes = 1
    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


def process_state() -> Any:
    """``accelerate.PartialState()`` (rank, world size, device, barriers). Without CUDA the
    processes of ``accelerate launch --multi_gpu`` (or ``torchrun``) join as CPU processes over
    gloo instead of each running alone."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def run_items(
    items: Sequence[Record],
    process: Callable[[list[Record]], list[Record]],
    out: str | Path,
    *,
    key: str,
    batch_size: int = 8,
    state: Any = None,
    desc: str = "eval",
    metric: Callable[[list[Record]], str] | None = None,
    config: dict | None = None,
) -> list[Record]:
    """Run ``process`` over ``items`` in batches, resumably, on this process's shard.

    ``process(batch)`` returns one record per item, each carrying the item's ``key``. Records are
    appended to this process's shard log as they come. When every process is done, the main
    process merges the logs into ``out`` in item order; all processes return the merged records
    of ``items`` (in order). ``metric(records)`` is shown next to the progress bar.

    ``config`` (JSON-serialisable: model, prompt, decoding, question source...) is stored in
    ``<name>.config.json`` by the first run; a later run with a different one raises
    ``ValueError`` instead of resuming from answers to something else.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = [it[key] for it in items]
    if len(set(ids)) != len(ids):
        raise ValueError(f"the items' {key!r} values are not unique")
    state = state or _SingleProcess()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if config is not None:
        check_config(out, config, write=state.is_main_process)
    log = shard_path(out, state.process_index)
    done = finished(out, key, own=log)
    mine = shard(list(items), state.process_index, state.num_processes)
    todo = [it for it in mine if it[key] not in done]
    seen = [done[it[key]] for it in mine if it[key] in done]
    bar = tqdm(
        total=len(mine),
        initial=len(mine) - len(todo),
        desc=desc,
        disable=not state.is_main_process,
        dynamic_ncols=True,
    )
    try:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            records = process(batch)
            if len(records) != len(batch):
                raise RuntimeError(f"process() returned {len(records)} records for {len(batch)}")
            for record in records:
                append_jsonl(log, record)
            seen.extend(records)
            bar.update(len(batch))
            if metric is not None and seen:
                bar.set_postfix_str(metric(seen), refresh=False)
    finally:
        bar.close()
    state.wait_for_everyone()
    if state.is_main_process:
        merge(out, ids, key)
    state.wait_for_everyone()
    done = {r[key]: r for r in read_jsonl(out, repair=False)}
    return [done[k] for k in ids if k in done]
