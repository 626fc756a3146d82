"""Datasets: the procedural search-task tfds builder, loaders (tfds data source, grain), external QA import, and the
task sources a run trains and evaluates on (``sources``: procedural, tfds, external; the grain training order).

Exports resolve lazily, so ``import trace_jax.data.external`` does not import tensorflow-datasets or grain.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TraceJaxSearchTasks": "trace_jax.data.search_tasks",
    "SearchTasksConfig": "trace_jax.data.search_tasks",
    "DATASET_NAME": "trace_jax.data.search_tasks",
    "task_to_example": "trace_jax.data.search_tasks",
    "TaskSource": "trace_jax.data.loaders",
    "example_to_task": "trace_jax.data.loaders",
    "grain_task_loader": "trace_jax.data.loaders",
    "prepare": "trace_jax.data.loaders",
    "task_source": "trace_jax.data.loaders",
    "world_of": "trace_jax.data.loaders",
    "ExternalDataset": "trace_jax.data.external",
    "ExternalDataError": "trace_jax.data.external",
    "load_external": "trace_jax.data.external",
    "load_external_corpus": "trace_jax.data.external",
    "load_external_tasks": "trace_jax.data.external",
    "corpus_from_queries": "trace_jax.data.external",
    "BatchStream": "trace_jax.data.sources",
    "SourceError": "trace_jax.data.sources",
    "SourceSpec": "trace_jax.data.sources",
    "TaskSplits": "trace_jax.data.sources",
    "epoch_batches": "trace_jax.data.sources",
    "external_splits": "trace_jax.data.sources",
    "parse_source": "trace_jax.data.sources",
    "procedural_splits": "trace_jax.data.sources",
    "tfds_splits": "trace_jax.data.sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trace_jax.data' has no attribute {name!r}")
