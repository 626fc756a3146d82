"""Task sources: where a run's training and held-out tasks come from, the corpus they are asked over, and the
seeded, checkpointable order (grain) in which training draws them.

A source is named by one string (`DataConfig.source`, and each value of `EvalConfig.sets`):

    procedural                      the procedural world's generated splits (`DataConfig.world`, `.tasks`, `.seed`)
    tfds:<builder>[/<config>]       a tensorflow-datasets builder in the project's features layout
                                    (`trace_jax_search_tasks`, prepared on first use since it downloads nothing, or
                                    any registered builder with the same features, prepared beforehand)
    external                        BrowseComp-Plus-style JSONL: `DataConfig.queries` and `DataConfig.corpus`
    external:<queries>[:<corpus>]   (evaluation sets only) an external set with its files named inline
    heldout                         (evaluation sets only) the run's own held-out split

`parse_source` checks the form and is what the configs call to validate themselves (before any compute).
`procedural_splits`, `tfds_splits` and `external_splits` read a source into `TaskSplits` (train and held-out
tasks, plus the world or corpus that the browser runs over). `epoch_batches` is the training order:
a grain `MapDataset` of endless seeded per-epoch shuffles cut into fixed-size batches, of which each process
takes its own block; `BatchStream` iterates it and hands grain's iterator state to the checkpoint.

This module knows tasks, corpora, tfds and grain; not browsers, models or training.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trace_jax.envs.corpus import Corpus
from trace_jax.envs.tasks import Task

SOURCE_KINDS = ("procedural", "tfds", "external", "heldout")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class SourceError(ValueError):
    """A task source is named wrongly or cannot be read; the message names the field or file and the fix."""


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A parsed source string (see the module docstring). `builder`/`config` for tfds, `queries`/`corpus` for an
    external set named inline (empty when the files come from `DataConfig`)."""

    kind: str
    builder: str = ""
    config: str = ""
    queries: str = ""
    corpus: str = ""

    @property
    def tfds_name(self) -> str:
        return f"{self.builder}/{self.config}" if self.config else self.builder


def parse_source(text: Any, where: str, *, inline: bool = False) -> SourceSpec:
    """Parse a source string; `where` names the field in errors (e.g. "DataConfig.source"). `inline` allows the
    evaluation-set forms (`heldout`, `external:<queries>[:<corpus>]`)."""
    forms = "'procedural', 'tfds:<builder>[/<config>]', 'external'"
    if inline:
        forms += ", 'external:<queries.jsonl>[:<corpus.jsonl>]', 'heldout'"
    if not isinstance(text, str) or not text.strip():
        raise SourceError(f"{where} must be one of {forms}; got {text!r}")
    text = text.strip()
    if text == "procedural":
        return SourceSpec("procedural")
    if text == "heldout" and inline:
        return SourceSpec("heldout")
    if text == "external":
        return SourceSpec("external")
    if text.startswith("tfds:"):
        name = text[len("tfds:"):]
        builder, _, config = name.partition("/")
        if not _NAME.fullmatch(builder) or (config and not _NAME.fullmatch(config)) or "/" in config:
            raise SourceError(f"{where} = {text!r}: expected 'tfds:<builder>[/<config>]', e.g. "
                              "'tfds:trace_jax_search_tasks/tiny'")
        return SourceSpec("tfds", builder=builder, config=config)
    if text.startswith("external:"):
        if not inline:
            raise SourceError(f"{where} = {text!r}: name the files with DataConfig.queries and DataConfig.corpus and "
                              "set the source to 'external'")
        queries, _, corpus = text[len("external:"):].partition(":")
        if not queries:
            raise SourceError(f"{where} = {text!r}: expected 'external:<queries.jsonl>[:<corpus.jsonl>]'")
        return SourceSpec("external", queries=queries, corpus=corpus)
    raise SourceError(f"{where} = {text!r}: unknown source; use one of {forms}")


@dataclasses.dataclass
class TaskSplits:
    """Training and held-out tasks of one source and what they are asked over: a procedural `world` (whose
    documents are the corpus) or an external `corpus`."""

    train: list[Task]
    heldout: list[Task]
    world: Any = None
    corpus: Corpus | None = None


def procedural_splits(world_config, task_config, *, num_train: int, num_eval: int, seed: int) -> TaskSplits:
    """The procedural world and its disjoint train / held-out splits (`tasks.generate_splits`)."""
    from trace_jax.envs.tasks import generate_splits
    from trace_jax.envs.world import build_world

    world = build_world(world_config)
    splits = generate_splits(world, {"train": num_train, "eval": num_eval}, seed=seed, config=task_config)
    return TaskSplits(splits["train"], splits["eval"], world=world)


def _tfds_builder(spec: SourceSpec, data_dir: str, where: str):
    import tensorflow_datasets as tfds

    from trace_jax.data.search_tasks import DATASET_NAME  # registers the project's builder with tfds

    try:
        builder = tfds.builder(spec.tfds_name, data_dir=data_dir or None, file_format="array_record")
    except Exception as error:  # tfds raises DatasetNotFoundError, ValueError, ... with long messages
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SourceError(f"{where} = 'tfds:{spec.tfds_name}': tfds cannot make this builder ({first[:200]}); "
                          f"use a registered builder name (e.g. 'tfds:{DATASET_NAME}/tiny')") from None
    if not builder.is_prepared():
        if spec.builder != DATASET_NAME:  # others may download: never at run time
            raise SourceError(f"{where} = 'tfds:{spec.tfds_name}': not prepared in {builder.data_dir_root}; "
                              f"prepare it first (`tfds build {spec.tfds_name} --file_format=array_record`) or set "
                              "DataConfig.data_dir to where it is")
        builder.download_and_prepare()  # generated from its world; nothing is downloaded
    return builder


def tfds_splits(spec: SourceSpec, *, train_split: str, eval_split: str, num_train: int, num_eval: int,
                data_dir: str = "", corpus: str = "", where: str = "DataConfig.source") -> TaskSplits:
    """The first `num_train` tasks of `train_split` and `num_eval` of `eval_split` of a tfds builder (array_record
    data source, read in file order). Tasks that carry their world (the project's builder) regenerate its
    corpus; others need `corpus` (a corpus file)."""
    from trace_jax.data.loaders import TaskSource, world_of

    builder = _tfds_builder(spec, data_dir, where)
    sources = builder.as_data_source()
    out = {}
    for field, split, count in (("train_split", train_split, num_train), ("eval_split", eval_split, num_eval)):
        if split not in sources:
            raise SourceError(f"DataConfig.{field} = {split!r}: 'tfds:{spec.tfds_name}' has splits "
                              f"{sorted(sources)}; pick one of them")
        source = TaskSource(sources[split])
        out[field] = [source[i] for i in range(min(count, len(source)))]
    tasks = out["train_split"] + out["eval_split"]
    if corpus:
        return TaskSplits(out["train_split"], out["eval_split"], corpus=_read_corpus(corpus, "DataConfig.corpus"))
    worlds = {repr(sorted(dict(t.world).items())) for t in tasks}
    if not tasks or "[]" in worlds:
        raise SourceError(f"{where} = 'tfds:{spec.tfds_name}': its tasks carry no world config, so there is no corpus "
                          "to browse; set DataConfig.corpus to the corpus file of these tasks")
    if len(worlds) > 1:
        raise SourceError(f"{where} = 'tfds:{spec.tfds_name}': its tasks come from {len(worlds)} different worlds; "
                          "one run browses one corpus")
    return TaskSplits(out["train_split"], out["eval_split"], world=world_of(tasks[0]))


def _read_corpus(path: str, field: str) -> Corpus:
    from trace_jax.data.external import load_external_corpus

    if not Path(path).is_file():
        raise SourceError(f"{field} = {path!r}: no such file; point it at the corpus JSONL (one object per line "
                          "with 'docid' and 'text')")
    return load_external_corpus(path)


def external_splits(queries: str, corpus: str, *, eval_fraction: float, seed: int, num_train: int, num_eval: int,
                    skip_bad_lines: bool = False, fields: tuple[str, str] = ("DataConfig.queries",
                                                                             "DataConfig.corpus")) -> TaskSplits:
    """An external set (`data.external.load_external`) split into train and held-out by a seeded fraction: the
    held-out tasks are a `default_rng(seed)` draw of `round(eval_fraction * n)` queries (at least one when the
    fraction is > 0), both splits in file order, cut to `num_eval` / `num_train`.

    Every problem is found here, before any compute: a missing file (naming the field), and, unless
    `skip_bad_lines`, every line the importer would skip (file, line, field, fix), e.g. a query whose evidence doc
    is not in the corpus.
    """
    from trace_jax.data.external import ExternalDataError, ExternalDataWarning, load_external

    for field, path in zip(fields, (queries, corpus)):
        if path and not Path(path).is_file():
            raise SourceError(f"{field} = {path!r}: no such file; point it at the "
                              f"{'queries' if field == fields[0] else 'corpus'} JSONL of the set")
    if not queries:
        raise SourceError(f"{fields[0]} is empty: the 'external' source needs the queries JSONL")
    with warnings.catch_warnings():
        if not skip_bad_lines:  # raised below, with the fix
            warnings.simplefilter("ignore", ExternalDataWarning)
        dataset = load_external(queries, corpus or None)
    if dataset.skipped and not skip_bad_lines:
        shown = "\n".join(f"  {s}" for s in dataset.skipped[:20])
        more = f"\n  ... and {len(dataset.skipped) - 20} more" if len(dataset.skipped) > 20 else ""
        raise ExternalDataError(f"{len(dataset.skipped)} bad line(s) in the external set:\n{shown}{more}\nfix them, "
                                "or set DataConfig.skip_bad_lines = True to train on the rest")
    n = len(dataset.tasks)
    held = 0 if eval_fraction <= 0 else min(n - 1, max(1, round(eval_fraction * n)))
    if eval_fraction > 0 and held < 1:
        raise SourceError(f"{fields[0]} = {queries!r}: {n} usable quer{'y' if n == 1 else 'ies'} cannot be split into "
                          "train and held-out; add queries or set DataConfig.eval_fraction = 0")
    chosen = set(np.random.default_rng(seed).permutation(n)[:held].tolist())
    train = [t for i, t in enumerate(dataset.tasks) if i not in chosen][:num_train]
    heldout = [t for i, t in enumerate(dataset.tasks) if i in chosen][:num_eval]
    return TaskSplits(train, heldout, corpus=dataset.corpus)


# ------------------------------------------------------------------------------------------------ training order
def epoch_batches(records: Sequence[Any], batch_size: int, *, seed: int, shard_index: int = 0,
                  shard_count: int = 1):
    """The training order as a grain `MapDataset`: element `b` is this shard's block of the `b`-th global batch of
    `batch_size` records, cut from an endless sequence of epochs, each a seeded shuffle of `records` (grain
    reseeds the shuffle per epoch; a batch may span two epochs). Shard `i` of `k` takes rows
    `[i * batch_size / k, (i + 1) * batch_size / k)` of every batch, so the shards of one step are the global batch
    in order, whatever the number of processes."""
    import grain

    if not records:
        raise SourceError("no training records to draw batches from")
    if batch_size < 1 or batch_size % shard_count:
        raise SourceError(f"a batch of {batch_size} cannot be split evenly into {shard_count} process shards")
    if not 0 <= seed < 2**32:
        raise SourceError(f"the shuffle seed must be in [0, 2**32), got {seed}")
    per = batch_size // shard_count
    first = shard_index * per
    return (grain.MapDataset.source(list(records)).shuffle(seed).repeat().batch(batch_size, batch_fn=list)
            .map(lambda batch: batch[first:first + per]))


class BatchStream:
    """An iterator over `epoch_batches` whose position is grain's iterator state (`state()`, a small JSON dict for
    the checkpoint's host state; `BatchStream(dataset, state)` resumes there)."""

    def __init__(self, dataset, state: dict | None = None):
        import grain

        # no threads, no prefetch: the state then names exactly the next batch
        self._iterator = iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
        if state:
            self._iterator.set_state(dict(state))

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> list:
        return next(self._iterator)

    def state(self) -> dict:
        return dict(self._iterator.get_state())


def check_name(name: Any, where: str) -> str:
    """An evaluation set's name: letters, digits, `_ . -` (it becomes a metric prefix and a file-name part)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == "average":
        raise SourceError(f"{where}: set name {name!r} must be letters, digits, '_', '.' or '-' (not 'average', "
                          "the column of their mean)")
    return name


__all__ = ["SOURCE_KINDS", "BatchStream", "SourceError", "SourceSpec", "TaskSplits", "check_name", "epoch_batches",
           "external_splits", "parse_source", "procedural_splits", "tfds_splits"]
