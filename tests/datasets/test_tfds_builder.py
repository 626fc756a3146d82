"""Specification of the procedural task tfds builder (array_record, no TensorFlow) and its loaders."""

import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from trace_jax.data.loaders import grain_task_loader, prepare, task_source, world_of  # noqa: E402
from trace_jax.data.search_tasks import SearchTasksConfig, TraceJaxSearchTasks  # noqa: E402
from trace_jax.envs.tasks import evaluate_program  # noqa: E402
from trace_jax.envs.world import WorldConfig, build_world  # noqa: E402


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    prepare("tiny", path)
    return path


def test_builder_prepares_every_split_in_array_record(data_dir):
    builder = TraceJaxSearchTasks(config="tiny", data_dir=str(data_dir), file_format="array_record")
    assert {name: info.num_examples for name, info in builder.info.splits.items()} == {
        "train": 32, "validation": 8, "test": 8}
    assert list((data_dir / "trace_jax_search_tasks" / "tiny" / "1.1.0").glob("*.array_record*"))


@pytest.mark.parametrize("split, size", [("train", 32), ("validation", 8), ("test", 8)])
def test_every_split_reads_back_through_tfds_data_source(data_dir, split, size):
    raw = tfds.data_source("trace_jax_search_tasks/tiny", data_dir=str(data_dir), download=False)[split]
    assert len(raw) == size
    tasks = list(task_source(split, data_dir=data_dir, config="tiny", prepare_if_missing=False))
    assert len(tasks) == size and len({t.task_id for t in tasks}) == size
    for task in tasks:
        assert evaluate_program(world_of(task), task.program) == {task.answer}
        assert task.clues and all(c.docid for c in task.clues)


def test_splits_are_disjoint(data_dir):
    questions = [{t.question for t in task_source(s, data_dir=data_dir, prepare_if_missing=False)}
                 for s in ("train", "validation", "test")]
    assert sum(map(len, questions)) == len(set().union(*questions))


def test_world_of_regenerates_the_corpus_the_tasks_were_made_over(data_dir):
    task = task_source("test", data_dir=data_dir, prepare_if_missing=False)[0]
    world = world_of(task)
    assert world.fingerprint() == build_world(WorldConfig.from_dict(task.world)).fingerprint()
    for clue in task.clues:
        assert clue.value in world.document(clue.docid)["text"]


def test_grain_loader_yields_each_task_once_per_epoch_in_seeded_order(data_dir):
    source = task_source("train", data_dir=data_dir, prepare_if_missing=False)
    first = [t.task_id for t in grain_task_loader(source, seed=3)]
    assert sorted(first) == sorted(t.task_id for t in source)
    assert first == [t.task_id for t in grain_task_loader(source, seed=3)]
    assert first != [t.task_id for t in grain_task_loader(source, seed=4)]


def test_grain_loader_shards_and_resumes_from_its_state(data_dir):
    source = task_source("train", data_dir=data_dir, prepare_if_missing=False)
    shards = [[t.task_id for t in grain_task_loader(source, seed=1, shard_index=i, shard_count=2)] for i in range(2)]
    assert not set(shards[0]) & set(shards[1]) and len(shards[0]) + len(shards[1]) == 32
    iterator = iter(grain_task_loader(source, seed=1, as_dicts=True))
    [next(iterator) for _ in range(5)]
    state = iterator.get_state()
    rest = [r["task_id"] for r in iterator]
    resumed = iter(grain_task_loader(source, seed=1, as_dicts=True))
    resumed.set_state(state)
    assert [r["task_id"] for r in resumed] == rest


def test_custom_config_object_builds_and_reads(tmp_path):
    config = SearchTasksConfig(name="custom_test", world=dict(seed=5, num_people=30, num_cities=8, num_rivers=2,
                                                               num_universities=3, num_companies=8, noise_docs=0),
                               train_size=6, validation_size=3, test_size=3, min_hops=2, max_hops=3)
    source = task_source("validation", data_dir=tmp_path, config=config)
    assert len(source) == 3 and all(2 <= t.hops <= 3 for t in source)
