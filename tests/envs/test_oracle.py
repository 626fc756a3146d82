"""Specification of the oracle agent: it solves generated tasks through the browser tools and records chat
trajectories in the OpenAI messages format."""

import json
import time

import pytest

from trace_jax.envs.oracle import (OracleConfig, make_browser, message_words, retrieval_noise_filter, solve,
                                   solve_all, solve_rate, trajectory_vocabulary)
from trace_jax.envs.tasks import Clue, Task, generate_tasks
from trace_jax.envs.world import WorldConfig, build_world


@pytest.fixture(scope="module")
def world():
    return build_world(WorldConfig(seed=11))


@pytest.fixture(scope="module")
def browser(world):
    return make_browser(world)


@pytest.fixture(scope="module")
def sample(world, browser):
    tasks = generate_tasks(world, 1000, seed=5)
    start = time.perf_counter()
    results = solve_all(browser, tasks)
    print(f"oracle: {solve_rate(results):.4f} of {len(tasks)} solved in {time.perf_counter() - start:.1f} s")
    return results


def test_oracle_solves_at_least_99_percent_of_1000_questions(sample):
    assert len(sample) == 1000
    assert solve_rate(sample) >= 0.99


def test_every_question_type_is_solved(sample):
    by_type = {}
    for result in sample:
        by_type.setdefault(result.task.qtype, []).append(result.solved)
    assert len(by_type) == 5
    assert all(sum(v) / len(v) >= 0.98 for v in by_type.values())


def test_trajectory_is_in_openai_chat_format(sample):
    for result in sample[:100]:
        messages = result.messages
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        assert messages[1]["content"] == result.task.question
        pending = None
        for message in messages[2:-1]:
            if message["role"] == "assistant":
                assert pending is None and len(message["tool_calls"]) == 1
                call = message["tool_calls"][0]
                assert call["type"] == "function" and call["function"]["name"] in ("search", "open", "find")
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
                pending = call["id"]
            else:
                assert message["role"] == "tool" and message["tool_call_id"] == pending
                pending = None
        assert messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]
        assert f"<answer>{result.task.answer}</answer>" in messages[-1]["content"]


def test_record_carries_gold_answer_and_clues(sample):
    record = json.loads(json.dumps(sample[0].to_record()))
    assert record["answer"] == sample[0].task.answer and record["solved"] is True
    assert record["clues"] and record["tools"] and record["messages"]


def test_clue_progress_rises_to_one_on_solved_tasks(sample):
    for result in sample[:200]:
        progress = result.clue_progress
        assert progress == sorted(progress) and len(progress) == result.num_tool_calls
        if result.solved:
            assert progress[-1] == 1.0 and all(result.confirmed)


def test_oracle_is_deterministic(world, browser, sample):
    again = solve(browser, sample[3].task)
    assert again.messages == sample[3].messages


def test_trajectory_words_are_in_the_closed_vocabulary(sample, world, browser):
    vocab = set(trajectory_vocabulary())
    detoured = solve_all(browser, [r.task for r in sample[:100]], OracleConfig(detour_prob=1.0))
    for result in sample[:300] + detoured:
        assert set(message_words(result.messages)) <= vocab


def test_detours_take_wrong_turns_and_still_solve(world, browser, sample):
    results = solve_all(browser, [r.task for r in sample[:60]], OracleConfig(detour_prob=1.0, seed=1))
    assert solve_rate(results) >= 0.98
    tool_texts = [m["content"] for r in results for m in r.messages if m["role"] == "tool"]
    assert any("No `find` results" in text for text in tool_texts)
    calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for r in results for m in r.messages
             if m.get("tool_calls")]
    assert any("cursor" in c and "id" in c for c in calls)  # back to an earlier results page by cursor
    assert sum(r.num_tool_calls for r in results) > sum(r.num_tool_calls for r in sample[:60])


def test_deep_facts_lie_beyond_the_first_view_and_are_still_found():
    world = build_world(WorldConfig(seed=2, deep_fact_prob=1.0, num_people=40, num_cities=10, num_rivers=3,
                                    num_universities=4, num_companies=10, noise_docs=0))
    browser = make_browser(world)
    for document in world.documents:
        browser.reset()
        first_view = browser.step("open", {"id": document["url"]})
        blank_lines = [n for n, line in enumerate(first_view.page.lines) if not line]
        # Paragraphs: intro, two background paragraphs, then all facts: the facts start after the third blank line.
        assert len(blank_lines) == 3 and blank_lines[2] > first_view.last_line
    results = solve_all(browser, generate_tasks(world, 40, seed=0))
    assert solve_rate(results) == 1.0
    for result in results:
        assert any(m["tool_calls"][0]["function"]["name"] == "find" for m in result.messages if m.get("tool_calls"))


def test_unreachable_clue_makes_the_oracle_answer_unknown(world, browser):
    task = Task(task_id="bad", question="In which city was Nobody born?", answer="Nowhere",
                clues=(Clue(docid=world.documents[0]["docid"], entity=world.documents[0]["title"],
                            relation="born_in", value="a value that is on no page"),))
    result = solve(browser, task, OracleConfig(max_steps=30))
    assert not result.solved and result.answer == "unknown"
    assert "<answer>unknown</answer>" in result.messages[-1]["content"]


def test_retrieval_noise_is_deterministic_per_query_and_replaces_results():
    docids = [f"d{i}" for i in range(100)]
    noisy = retrieval_noise_filter(docids, rate=0.5, seed=3)
    results = [(f"d{i}", 1.0) for i in range(10)]
    assert noisy("q", list(results)) == noisy("q", list(results))
    assert noisy("q", list(results)) != results
    assert retrieval_noise_filter(docids, rate=0.0)("q", list(results)) == results


def test_oracle_copes_with_retrieval_noise_and_short_snippets(world):
    browser = make_browser(world, retrieval_noise=0.1, snippet_chars=40)
    results = solve_all(browser, generate_tasks(world, 100, seed=9))
    assert solve_rate(results) >= 0.97


def test_make_tasks_cli_writes_corpus_tasks_trajectories_and_manifest(tmp_path, capsys):
    from trace_jax.cli import main

    out = tmp_path / "tasks"
    assert main(["make-tasks", "--out", str(out), "--num", "30", "--seed", "4", "--oracle", "--detour-prob", "0.2",
                 "--corpus-size", "200"]) == 0
    tasks = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    documents = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(tasks) == len(trajectories) == 30 and documents
    assert [Task.from_dict(t) for t in tasks][0].answer == trajectories[0]["answer"]
    assert manifest["oracle"]["solve_rate"] >= 0.96
    assert "oracle solved" in capsys.readouterr().out
    assert (out / "vocabulary.txt").read_text().split("\n")[0]


def test_make_tasks_cli_rejects_unknown_question_types(tmp_path, capsys):
    from trace_jax.cli import main

    assert main(["make-tasks", "--out", str(tmp_path), "--num", "3", "--types", "trivia"]) == 2
    assert "type_weights" in capsys.readouterr().out


def test_initial_messages_match_the_start_of_oracle_trajectories(sample):
    from trace_jax.envs.oracle import initial_messages

    assert sample[0].messages[:2] == initial_messages(sample[0].task)


def test_a_wrong_page_failure_answers_the_title_of_a_wrong_result_it_opened(browser, sample):
    results = solve_all(browser, [r.task for r in sample[:40]], OracleConfig(failure="wrong_page", seed=3))
    assert not any(r.solved for r in results)
    answered = [r for r in results if r.answer != "unknown"]
    assert len(answered) >= 30  # the few without another search result give up instead
    for result in answered:
        opened = [m["content"] for m in result.messages if m["role"] == "tool"][-1]
        assert opened.split("\n", 1)[0].startswith("[") and result.answer in opened.split("\n", 1)[0]
        assert f"<answer>{result.answer}</answer>" in result.messages[-1]["content"]


def test_a_give_up_failure_stops_before_the_last_clue_and_answers_unknown(browser, sample):
    tasks = [r.task for r in sample[:40]]
    results = solve_all(browser, tasks, OracleConfig(failure="give_up", seed=3))
    assert not any(r.solved for r in results) and {r.answer for r in results} == {"unknown"}
    assert all(not all(r.confirmed) for r in results)
    # it stops somewhere along the chain: sometimes at once, sometimes after some of it
    assert {0} < {r.num_tool_calls for r in results}


def test_failures_are_seeded_and_in_the_closed_vocabulary(browser, sample):
    tasks = [r.task for r in sample[:30]]
    vocab = set(trajectory_vocabulary())
    for failure in ("wrong_page", "give_up"):
        first = solve_all(browser, tasks, OracleConfig(failure=failure, seed=4))
        assert [r.messages for r in first] == [r.messages for r in solve_all(browser, tasks,
                                                                              OracleConfig(failure=failure, seed=4))]
        assert [r.messages for r in first] != [r.messages for r in solve_all(browser, tasks,
                                                                              OracleConfig(failure=failure, seed=5))]
        assert all(set(message_words(r.messages)) <= vocab for r in first)


def test_an_unknown_failure_names_the_field():
    with pytest.raises(ValueError, match="OracleConfig.failure"):
        OracleConfig(failure="crash")
