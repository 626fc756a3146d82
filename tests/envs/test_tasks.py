"""Specification of procedural questions: determinism, verified unique answers, clue chains, type and hop coverage."""

import collections
import json

import pytest

from trace_jax.envs.tasks import (QUESTION_TYPES, Clue, Task, TaskConfig, TaskError, clue_matches, evaluate_program,
                                  generate_splits, generate_tasks, tasks_fingerprint, verify_task)
from trace_jax.envs.world import WorldConfig, build_world, vocabulary, words


@pytest.fixture(scope="module")
def world():
    return build_world(WorldConfig(seed=1))


@pytest.fixture(scope="module")
def tasks(world):
    return generate_tasks(world, 600, seed=7)


def test_same_seed_gives_identical_questions(world, tasks):
    again = generate_tasks(build_world(WorldConfig(seed=1)), 600, seed=7)
    assert tasks_fingerprint(again) == tasks_fingerprint(tasks)


def test_different_task_seeds_give_different_questions(world, tasks):
    assert tasks_fingerprint(generate_tasks(world, 600, seed=8)) != tasks_fingerprint(tasks)


def test_every_answer_is_the_unique_answer_of_its_program(world, tasks):
    for task in tasks:
        assert evaluate_program(world, task.program) == {task.answer}, task.question


def test_questions_are_distinct(tasks):
    assert len({t.question for t in tasks}) == len(tasks)


def test_all_five_types_and_all_hop_counts_appear(tasks):
    assert {t.qtype for t in tasks} == set(QUESTION_TYPES)
    assert {t.hops for t in tasks} == {1, 2, 3, 4}
    hops_by_type = collections.defaultdict(set)
    for t in tasks:
        hops_by_type[t.qtype].add(t.hops)
    assert hops_by_type["bridge"] == {1, 2, 3, 4}


def test_clue_chain_values_are_written_on_their_pages(world, tasks):
    for task in tasks:
        assert task.clues
        for clue in task.clues:
            assert clue.kind in ("support", "exclude")
            page = world.document(clue.docid)
            assert clue.value in page["text"], (task.question, clue)
            assert clue.entity == page["title"]


def test_bridge_chain_ends_at_the_answer_and_links_hop_to_hop(world, tasks):
    for task in (t for t in tasks if t.qtype == "bridge"):
        assert len(task.clues) == task.hops
        assert task.clues[-1].value == task.answer
        for previous, following in zip(task.clues, task.clues[1:]):
            assert following.entity == previous.value


def test_counting_answer_equals_number_of_supporting_filter_clues(tasks):
    for task in (t for t in tasks if t.qtype == "counting"):
        filters = [c for c in task.clues if not c.relation.startswith("list:")]
        listed = [c for c in task.clues if c.relation.startswith("list:")]
        assert int(task.answer) == sum(c.kind == "support" for c in filters[-len(listed):])
        assert task.aliases  # the number word


def test_question_and_answer_tokens_are_in_the_vocabulary(tasks):
    vocab = set(vocabulary())
    for task in tasks:
        text = " ".join([task.question, task.answer, *task.aliases] + [c.value for c in task.clues])
        assert set(words(text)) <= vocab, task.question


def test_task_round_trips_through_json(tasks):
    for task in tasks[:50]:
        assert Task.from_dict(json.loads(task.to_json())) == task


def test_verify_task_rejects_a_wrong_gold_answer(world, tasks):
    wrong = Task(**{**{f: getattr(tasks[0], f) for f in Task.__dataclass_fields__}, "answer": "Nobody"})
    with pytest.raises(TaskError, match="gold answer"):
        verify_task(world, wrong)


def test_hop_range_knob_restricts_hops(world):
    config = TaskConfig(min_hops=3, max_hops=4)
    assert {t.hops for t in generate_tasks(world, 100, seed=1, config=config)} <= {3, 4}


def test_type_weights_knob_selects_types(world):
    config = TaskConfig(type_weights=(("comparative", 1.0),))
    assert {t.qtype for t in generate_tasks(world, 50, seed=1, config=config)} == {"comparative"}


def test_splits_are_disjoint_by_question(world):
    splits = generate_splits(world, {"train": 200, "validation": 50, "test": 50}, seed=2)
    questions = [set(t.question for t in split) for split in splits.values()]
    assert sum(map(len, questions)) == len(set().union(*questions)) == 300


def test_too_many_questions_for_a_tiny_world_raise_a_clear_error():
    tiny = build_world(WorldConfig(num_people=4, num_cities=2, num_rivers=1, num_universities=1, num_companies=1,
                                   noise_docs=0))
    with pytest.raises(TaskError, match="enlarge the world"):
        generate_tasks(tiny, 5000, seed=0)


def test_invalid_task_config_is_rejected():
    with pytest.raises(ValueError, match="hops"):
        TaskConfig(min_hops=0)
    with pytest.raises(ValueError, match="type_weights"):
        TaskConfig(type_weights=(("trivia", 1.0),))


def test_clue_from_dict_requires_docid():
    with pytest.raises(TaskError, match="clues\\[0\\]"):
        Task.from_dict({"task_id": "t", "question": "q", "answer": "a", "clues": [{"value": "x"}]})
    assert Task.from_dict({"task_id": "t", "question": "q", "answer": "a",
                           "clues": [{"docid": "d"}]}).clues == (Clue("d", "", "", ""),)


def test_task_fingerprint_is_pinned_for_the_default_world():
    # Same seed -> same questions across processes and Python sessions (not only within one test run).
    tasks = generate_tasks(build_world(WorldConfig(seed=0)), 50, seed=0)
    assert tasks_fingerprint(tasks)[:16] == PINNED_TASKS_FINGERPRINT


def test_clue_matches_finds_values_even_across_wrapped_lines():
    clues = (Clue("d1", "Kalo", "on_river", "Venmir River"), Clue("d2", "Venmir River", "length_km", "812"),
             Clue("d3", "", "gold_doc", ""))
    assert clue_matches(clues, "L3: Kalo lies on the Venmir\nL4: River. It is 812 km") == [0, 1]
    assert clue_matches(clues, "the Venmir River", docid="d2") == []
    assert clue_matches(clues, "anything", docid="d3") == [2]


PINNED_TASKS_FINGERPRINT = "105c43458ec655f5"
