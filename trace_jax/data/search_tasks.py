"""tensorflow-datasets builder for the procedural multi-hop search tasks (array_record; TensorFlow not needed).

Dataset name ``trace_jax_search_tasks``; configs ``tiny`` (tests), ``small`` and ``large`` (see ``BUILDER_CONFIGS``), or
any ``SearchTasksConfig`` passed as ``config=``. Each config fixes one world (``WorldConfig``) and yields
``train``/``validation``/``test`` splits of distinct questions over that world. The corpus is not stored: every
example carries its ``world`` config as JSON, and ``world.build_world`` regenerates the corpus byte for byte
(``loaders.world_of``).

Prepare and read::

    builder = TraceJaxSearchTasks(config="tiny", data_dir=DIR, file_format="array_record")
    builder.download_and_prepare()
    source = tfds.data_source("trace_jax_search_tasks/tiny", data_dir=DIR)["train"]

This module knows about tasks and tfds; not about tools, models or training.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
from etils import epath
import tensorflow_datasets as tfds

from trace_jax.envs.tasks import Task, TaskConfig, generate_splits
from trace_jax.envs.world import WorldConfig, build_world

DATASET_NAME = "trace_jax_search_tasks"
SPLITS = ("train", "validation", "test")


@dataclasses.dataclass(eq=False)
class SearchTasksConfig(tfds.core.BuilderConfig):
    """A world and split sizes. ``world`` holds ``WorldConfig`` fields (missing ones take their defaults)."""

    world: dict = dataclasses.field(default_factory=dict)
    task_seed: int = 0
    train_size: int = 2000
    validation_size: int = 200
    test_size: int = 200
    min_hops: int = 1
    max_hops: int = 4

    def world_config(self) -> WorldConfig:
        return WorldConfig.from_dict(self.world)

    def task_config(self) -> TaskConfig:
        return TaskConfig(min_hops=self.min_hops, max_hops=self.max_hops)

    def split_sizes(self) -> dict[str, int]:
        return {"train": self.train_size, "validation": self.validation_size, "test": self.test_size}


TINY_WORLD = dict(seed=0, num_people=40, num_cities=10, num_rivers=3, num_universities=4, num_companies=12,
                  noise_docs=4)

BUILDER_CONFIGS = [
    SearchTasksConfig(name="tiny", description="Tests: 32/8/8 questions over a 73-page world.",
                      world=TINY_WORLD, train_size=32, validation_size=8, test_size=8),
    SearchTasksConfig(name="small", description="2000/200/200 questions over the default ~300-page world.",
                      world=dict(seed=0), train_size=2000, validation_size=200, test_size=200),
    SearchTasksConfig(name="large", description="20000/1000/1000 questions over a ~10000-page world.",
                      world=WorldConfig.from_corpus_size(10000, seed=0).to_dict(), train_size=20000,
                      validation_size=1000, test_size=1000),
]


def task_features() -> tfds.features.FeaturesDict:
    text = tfds.features.Text()
    return tfds.features.FeaturesDict({
        "task_id": text,
        "question": text,
        "answer": text,
        "aliases": tfds.features.Sequence(text),
        "qtype": text,
        "hops": np.int32,
        "clues": tfds.features.Sequence({"docid": text, "entity": text, "relation": text, "value": text,
                                         "kind": text}),
        "program": text,  # JSON
        "source": text,
        "world": text,  # JSON of the WorldConfig that regenerates the corpus
    })


def task_to_example(task: Task) -> dict[str, Any]:
    return {"task_id": task.task_id, "question": task.question, "answer": task.answer,
            "aliases": list(task.aliases), "qtype": task.qtype, "hops": task.hops,
            "clues": [c.to_dict() for c in task.clues],
            "program": json.dumps(task.program, sort_keys=True), "source": task.source,
            "world": json.dumps(dict(task.world), sort_keys=True)}


class TraceJaxSearchTasks(tfds.core.GeneratorBasedBuilder):
    """Procedural multi-hop search questions with gold answers and clue chains."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {"1.0.0": "Initial release.",
                     "1.1.0": "Examples in generation order (no shuffling), as the procedural source makes them."}
    BUILDER_CONFIGS = BUILDER_CONFIGS
    DEFAULT_CONFIG_NAME = "tiny"

    # tfds's default lookup of this file touches `importlib_resources`, which tfds does not declare as a dependency.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        # generation order kept: the source then lists a split's questions as `generate_splits` made them, so a run
        # on 'tfds:trace_jax_search_tasks/<config>' trains what the procedural source over the same world does
        return tfds.core.DatasetInfo(builder=self, description=__doc__.split("\n\n")[0], features=task_features(),
                                     supervised_keys=None, disable_shuffling=True)

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing is downloaded
        config: SearchTasksConfig = self.builder_config
        world = build_world(config.world_config())
        splits = generate_splits(world, config.split_sizes(), seed=config.task_seed, config=config.task_config())
        return {name: self._generate_examples(tasks) for name, tasks in splits.items()}

    def _generate_examples(self, tasks):
        for task in tasks:
            yield task.task_id, task_to_example(task)
