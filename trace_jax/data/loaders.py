"""Loaders: tfds data sources of search tasks -> ``Task`` objects, and a grain loader over them.

``task_source(split, data_dir=..., config="tiny")`` prepares the procedural dataset if needed and returns a random-
access source of ``Task``; ``grain_task_loader(source, seed=...)`` iterates it (shuffled, sharded, checkpointable
through grain's iterator state). ``world_of(task)`` regenerates the world (and corpus) a procedural task belongs to.

This module knows about tasks, tfds and grain; not about tools, models or training.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping, Sequence

import grain

from trace_jax.envs.tasks import Clue, Task
from trace_jax.envs.world import World, WorldConfig, build_world


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def example_to_task(example: Mapping[str, Any]) -> Task:
    """Decode one tfds example (bytes for text, dict of lists for the clue sequence) into a ``Task``."""
    clues_columns = example["clues"]
    clues = tuple(
        Clue(docid=_text(d), entity=_text(e), relation=_text(r), value=_text(v), kind=_text(k))
        for d, e, r, v, k in zip(clues_columns["docid"], clues_columns["entity"], clues_columns["relation"],
                                 clues_columns["value"], clues_columns["kind"]))
    return Task(task_id=_text(example["task_id"]), question=_text(example["question"]),
                answer=_text(example["answer"]), aliases=tuple(_text(a) for a in example["aliases"]),
                qtype=_text(example["qtype"]), hops=int(example["hops"]), clues=clues,
                program=json.loads(_text(example["program"]) or "{}"), source=_text(example["source"]),
                world=json.loads(_text(example["world"]) or "{}"))


class TaskSource(Sequence[Task]):
    """Random access over a tfds data source, decoding each record into a ``Task`` (a grain ``RandomAccessDataSource``)."""

    def __init__(self, data_source: Any):
        self.data_source = data_source

    def __len__(self) -> int:
        return len(self.data_source)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} tasks")  # ends Sequence iteration
        return example_to_task(self.data_source[index])

    def __repr__(self) -> str:
        return f"TaskSource({self.data_source!r})"


def prepare(config: Any = "tiny", data_dir: str | os.PathLike | None = None):
    """Prepare (once) the procedural dataset for ``config`` (a config name or ``SearchTasksConfig``); returns the
    builder."""
    from trace_jax.data.search_tasks import TraceJaxSearchTasks

    builder = TraceJaxSearchTasks(config=config, data_dir=os.fspath(data_dir) if data_dir else None,
                                  file_format="array_record")
    builder.download_and_prepare()
    return builder


def task_source(split: str = "train", *, data_dir: str | os.PathLike | None = None, config: Any = "tiny",
                prepare_if_missing: bool = True) -> TaskSource:
    """A ``TaskSource`` over one split of the procedural dataset, read through ``tfds.data_source``."""
    import tensorflow_datasets as tfds

    if prepare_if_missing:
        builder = prepare(config, data_dir)
    else:
        from trace_jax.data.search_tasks import TraceJaxSearchTasks

        builder = TraceJaxSearchTasks(config=config, data_dir=os.fspath(data_dir) if data_dir else None,
                                      file_format="array_record")
    if isinstance(config, str):
        sources = tfds.data_source(f"{builder.name}/{config}", data_dir=os.fspath(data_dir) if data_dir else None,
                                   download=False)
    else:  # custom config objects are not in the registry: read through the builder itself
        sources = builder.as_data_source()
    if split not in sources:
        raise KeyError(f"split {split!r} not in {sorted(sources)}.")
    return TaskSource(sources[split])


def _task_to_record(task: Task) -> dict[str, Any]:
    return task.to_dict()


def grain_task_loader(source: Sequence[Task], *, seed: int = 0, shuffle: bool = True, num_epochs: int | None = 1,
                      shard_index: int = 0, shard_count: int = 1, as_dicts: bool = False) -> grain.DataLoader:
    """A grain ``DataLoader`` over ``source`` yielding ``Task`` objects (or their dicts with ``as_dicts``).

    Shuffling is by ``seed`` and epoch; ``shard_index``/``shard_count`` split records across data-parallel hosts.
    The loader's iterator state (``iter(loader).get_state()``) restores the exact position on resume.
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}.")
    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shuffle=shuffle, seed=seed, num_epochs=num_epochs,
        shard_options=grain.sharding.ShardOptions(shard_index=shard_index, shard_count=shard_count,
                                                  drop_remainder=False))
    operations = [_ToDict()] if as_dicts else []
    return grain.DataLoader(data_source=source, sampler=sampler, operations=operations, worker_count=0)


class _ToDict(grain.transforms.Map):
    def map(self, element: Task) -> dict[str, Any]:
        return element.to_dict()


@functools.lru_cache(maxsize=8)
def _world_from_json(world_json: str) -> World:
    return build_world(WorldConfig.from_dict(json.loads(world_json)))


def world_of(task: Task) -> World:
    """The world (and so the corpus, ``world.documents``) of a procedural task, regenerated from ``task.world``."""
    if not task.world:
        raise ValueError(f"task {task.task_id} has no world config (source {task.source!r}); external tasks come "
                         "with their own corpus, see trace_jax.data.external.")
    return _world_from_json(json.dumps(dict(task.world), sort_keys=True))
