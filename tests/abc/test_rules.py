"""The rule-based ABC step scorer: hand-computed counts and rewards on hand-made oracle and detour trajectories."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import credit
from trace_jax.abc import Step, StepScorer, counts_to_arrays
from trace_jax.abc.rules import (RuleBasedStepScorer, observation_page, steps_from, steps_from_episode,
                                 steps_from_messages)
from trace_jax.envs.tasks import Clue
from trace_jax.rollout.batch import EpisodeRecord


def call(name, **arguments):
    return {"role": "assistant", "content": f"I will {name}.",
            "tool_calls": [{"id": "c", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def tool(text):
    return {"role": "tool", "tool_call_id": "c", "content": text}


def page(cursor, title, *lines):
    body = "\n".join(f"L{i}: {line}" for i, line in enumerate(lines))
    header = f"[{cursor}] {title} (https://wiki.local/{title.replace(' ', '_')})"
    return f"{header}\n**viewing lines [0 - {len(lines) - 1}] of {len(lines)}**\n\n{body}"


def results(cursor, query, *titles):
    lines = "\n".join(f"L{i}: 【{i}†{t}†wiki.local】" for i, t in enumerate(titles))
    header = f"[{cursor}] Search results for `{query}`"
    return f"{header}\n**viewing lines [0 - {len(titles) - 1}] of {len(titles)}**\n\n{lines}"


def answer(text):
    return {"role": "assistant", "content": f"The answer is {text}.\n<answer>{text}</answer>"}


BRIDGE_CLUES = (Clue("person-1", "Halbo Selni", "studied_at", "Sika Institute"),
                Clue("university-2", "Sika Institute", "university_founded_year", "1786"))
BRIDGE_QUESTION = "In what year was the university where Halbo Selni studied founded?"


def rewards_of(counts):
    arrays = counts_to_arrays([counts])
    return np.asarray(credit.abc_step_rewards(arrays["n_found"], arrays["n_excluded"], arrays["n_rejected"],
                                              arrays["ans"], arrays["tool_error"]))[0]


def score(messages, clues, gold, **options):
    return RuleBasedStepScorer(**options).score(question="q", gold=gold, clues=clues,
                                                steps=steps_from_messages(messages))


# An episode cut at the turn cap: its last turn is a tool call that got no observation (the rollout stopped it).
CUT_AT_CAP = [call("search", query="Halbo Selni"), tool(results(0, "Halbo Selni", "Halbo Selni")),
              call("open", id=0)]
WITH_ERROR = [call("search", query="Halbo Selni"), tool("Error: No pages are open yet; call search first."),
              answer("1786")]


def test_rule_scorer_implements_the_step_scorer_interface():
    scorer = RuleBasedStepScorer()
    assert isinstance(scorer, StepScorer) and scorer.name == "rules"


def test_oracle_bridge_trajectory_gets_the_hand_computed_rewards():
    messages = [
        {"role": "user", "content": BRIDGE_QUESTION},
        call("search", query="Halbo Selni"), tool(results(0, "Halbo Selni", "Halbo Selni", "Sika Institute")),
        call("open", id=0), tool(page(1, "Halbo Selni", "Halbo Selni studied at Sika Institute. He likes tea.")),
        call("search", query="Sika Institute"), tool(results(2, "Sika Institute", "Sika Institute")),
        call("open", id=0), tool(page(3, "Sika Institute", "Sika Institute was founded in 1786.")),
        answer("1786"),
    ]
    counts = score(messages, BRIDGE_CLUES, ["1786"])
    assert [(c.n_found, c.n_excluded, c.n_rejected, c.ans) for c in counts] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 1)]
    np.testing.assert_allclose(rewards_of(counts), [1.0, 1.8, 1.0, 1.8, 2.0], atol=1e-6)


def test_detour_trajectory_counts_each_clue_once_on_its_own_page_and_a_rejected_answer():
    messages = [
        {"role": "user", "content": BRIDGE_QUESTION},
        call("search", query="Halbo Selni"),
        # a snippet that states the fact is not the clue's page: nothing found on a results page
        tool(results(0, "Halbo Selni", "Halbo Selni studied at Sika Institute", "Travel notes 3")),
        call("open", id=1),  # detour: a noise page that mentions the value
        tool(page(1, "Travel notes 3", "Halbo Selni studied at Sika Institute, people say.")),
        call("open", id=0, cursor=0), tool(page(2, "Halbo Selni", "Halbo Selni studied at Sika Institute.")),
        call("find", pattern="studied", cursor=2),  # the same fact again: not new
        tool("[3] Find results for text: `studied` in `Halbo Selni` "
             "(https://wiki.local/Halbo_Selni/find?pattern=studied)\n"
             "**viewing lines [0 - 0] of 1**\n\nL0: # 【0†match at L0】\nHalbo Selni studied at Sika Institute."),
        answer("Halbo University"),
    ]
    counts = score(messages, BRIDGE_CLUES, ["1786"])
    assert [(c.n_found, c.n_excluded, c.n_rejected, c.ans) for c in counts] == [
        (0, 0, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, -1)]
    np.testing.assert_allclose(rewards_of(counts), [1.0, 1.0, 1.8, 1.0, 0.0], atol=1e-6)


def test_wrong_answer_after_reading_the_gold_value_on_its_page_is_a_rejection():
    clues = (Clue("person-1", "Halbo Selni", "born_in", "Kaol"),)
    messages = [call("open", id=0), tool(page(0, "Halbo Selni", "Halbo Selni was born in Kaol.")), answer("Selru")]
    counts = score(messages, clues, ["Kaol"])
    assert [(c.n_found, c.n_rejected, c.ans) for c in counts] == [(1, 0, 0), (0, 1, -1)]
    np.testing.assert_allclose(rewards_of(counts), [1.8, 0.0], atol=1e-6)
    # answering right, or never having seen the value, is no rejection
    assert score(messages[:2] + [answer("kaol")], clues, ["Kaol"])[-1].n_rejected == 0
    assert score([answer("Selru")], clues, ["Kaol"])[-1].n_rejected == 0


def test_counting_question_counts_members_found_and_candidates_excluded():
    clues = (Clue("city-1", "Lenlu", "list:born_in", "Lumir Zugor"),
             Clue("city-1", "Lenlu", "list:born_in", "Vesha Shamir"),
             Clue("city-1", "Lenlu", "list:born_in", "Pabel Ruol"),
             Clue("person-2", "Lumir Zugor", "works_for", "Dordor Trading", "exclude"),
             Clue("person-3", "Vesha Shamir", "works_for", "Gorvas Company"),
             Clue("person-4", "Pabel Ruol", "works_for", "Ganlo Works", "exclude"))
    messages = [
        {"role": "user", "content": "How many people born in Lenlu work for Gorvas Company?"},
        call("open", id=0), tool(page(0, "Lenlu", "Notable natives of Lenlu are Lumir Zugor, Vesha Shamir and",
                                      "Pabel Ruol.")),  # a value wrapped across display lines still matches
        call("open", id=1), tool(page(1, "Lumir Zugor", "Lumir Zugor works for Dordor Trading.")),
        call("open", id=2), tool(page(2, "Vesha Shamir", "Vesha Shamir works for Gorvas Company.")),
        call("open", id=3), tool(page(3, "Pabel Ruol", "Pabel Ruol works for Ganlo Works.")),
        answer("1"),
    ]
    counts = score(messages, clues, ["1", "one"])
    assert [(c.n_found, c.n_excluded, c.n_rejected, c.ans) for c in counts] == [
        (3, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1)]
    rewards = rewards_of(counts)
    np.testing.assert_allclose(rewards, [2.0, 1.4, 1.8, 1.4, 2.0], atol=1e-6)  # 1 + 0.8*3 clipped to 2
    np.testing.assert_allclose(credit.abc_sft_weights(jnp.asarray(rewards)),
                               [1.7616, 1.3799, 1.6640, 1.3799, 1.7616], atol=1e-4)
    # ABC-GRPO with a second trajectory of the group that only read the list and answered wrong (2.0, 0.0)
    group = jnp.asarray([[*rewards], [2.0, 0.0, 0.0, 0.0, 0.0]], jnp.float32)[None]
    advantages = np.asarray(credit.abc_grpo_advantages(group, jnp.asarray([[5, 2]])))[0]
    flat = np.array([*rewards, 2.0, 0.0])
    normed = (flat - flat.mean()) / (flat.std() + 1e-6)
    want_second = [normed[5] + 0.25 * normed[6], normed[6]]
    np.testing.assert_allclose(advantages[1, :2], want_second, atol=1e-5)


def test_known_docid_replaces_the_page_title_rule():
    clues = (Clue("person-1", "Halbo Selni", "born_in", "Kaol"),)
    text = page(0, "Some other title", "Halbo Selni was born in Kaol.")
    scorer = RuleBasedStepScorer()
    def found(step):
        return scorer.score(question="", gold=["Kaol"], clues=clues, steps=[step])[0].n_found

    assert found(Step("x", text, docid="person-1")) == 1
    assert found(Step("x", text, docid="person-9")) == 0
    assert found(Step("x", text)) == 0


def test_a_record_cut_on_a_tool_message_has_no_answer_step_and_has_failed():
    messages = [call("open", id=0), tool(page(0, "Halbo Selni", "Halbo Selni studied at Sika Institute."))]
    steps = steps_from_messages(messages)
    assert len(steps) == 1 and steps[0].tool_call == ("open", {"id": 0})
    assert [c.ans for c in score(messages, BRIDGE_CLUES, ["1786"])] == [-1]


def test_clue_dicts_from_records_are_accepted_and_bad_ones_named():
    counts = score([call("open", id=0), tool(page(0, "Halbo Selni", "Halbo Selni studied at Sika Institute."))],
                   [c.to_dict() for c in BRIDGE_CLUES], ["1786"])
    assert counts[0].n_found == 1
    with pytest.raises(ValueError, match=r"clues\[0\]"):
        score([], [{"entity": "x"}], ["1786"])


def test_steps_from_an_episode_record():
    episode = EpisodeRecord(task_id="t", question="q", gold=("1786",),
                            turn_texts=["<tool_call>a</tool_call>", "<answer>1786</answer>"],
                            tool_calls=[("open", {"id": 0})],
                            observations=[page(0, "Sika Institute", "Sika Institute was founded in 1786.")])
    steps = steps_from_episode(episode)
    assert steps_from(episode) == steps
    assert [s.observation is None for s in steps] == [False, True] and steps[0].tool_call == ("open", {"id": 0})
    counts = RuleBasedStepScorer().score(question="q", gold=episode.gold, clues=BRIDGE_CLUES, steps=steps)
    assert [(c.n_found, c.ans) for c in counts] == [(1, 0), (0, 1)]


def test_observation_page_reads_document_and_find_titles_only():
    assert observation_page(page(2, "Kaol", "x"))[0] == "Kaol"
    assert observation_page(results(0, "Kaol", "Kaol"))[0] is None
    assert observation_page("Error: no page is open")[0] is None


def test_on_oracle_trajectories_the_rules_find_exactly_the_clues_the_oracle_confirmed():
    from trace_jax.envs.oracle import OracleConfig, make_browser, solve
    from trace_jax.envs.tasks import TaskConfig, generate_tasks
    from trace_jax.envs.world import WorldConfig, build_world

    world = build_world(WorldConfig.from_corpus_size(60, seed=1))
    browser = make_browser(world, view_lines=8)
    scorer = RuleBasedStepScorer()
    for task in generate_tasks(world, 12, seed=1, config=TaskConfig(min_hops=1, max_hops=2)):
        result = solve(browser, task, OracleConfig(detour_prob=0.3, seed=2))
        record = result.to_record()
        assert steps_from(record) == steps_from(result) == steps_from_messages(result.messages)
        counts = scorer.score(question=task.question, gold=task.gold_answers, clues=record["clues"],
                              steps=steps_from(result))
        assert sum(c.n_found + c.n_excluded for c in counts) == sum(result.confirmed), task.question
        assert counts[-1].ans == (1 if result.solved else -1)


def test_an_episode_that_runs_out_of_turns_scores_its_last_step_as_a_wrong_answer_by_default():
    counts = score(CUT_AT_CAP, BRIDGE_CLUES, ["1786"])
    assert [c.ans for c in counts] == [0, -1]
    np.testing.assert_allclose(rewards_of(counts), [1.0, 0.0])


def test_no_answer_zero_scores_an_episode_that_runs_out_of_turns_neutral():
    counts = score(CUT_AT_CAP, BRIDGE_CLUES, ["1786"], no_answer=0)
    assert [c.ans for c in counts] == [0, 0]
    np.testing.assert_allclose(rewards_of(counts), [1.0, 1.0])


def test_a_final_turn_without_an_answer_tag_has_not_answered():
    messages = CUT_AT_CAP[:2] + [{"role": "assistant", "content": "I think it is 1786."}]
    assert [c.ans for c in score(messages, BRIDGE_CLUES, ["1786"])] == [0, -1]
    assert [c.ans for c in score(messages, BRIDGE_CLUES, ["1786"], no_answer=0)] == [0, 0]


def test_a_failed_tool_call_scores_the_floor_by_default():
    counts = score(WITH_ERROR, BRIDGE_CLUES, ["1786"])
    assert [c.tool_error for c in counts] == [True, False]
    np.testing.assert_allclose(rewards_of(counts), [0.0, 2.0])


def test_error_step_neutral_scores_a_failed_tool_call_like_any_step():
    counts = score(WITH_ERROR, BRIDGE_CLUES, ["1786"], error_step="neutral")
    assert [c.tool_error for c in counts] == [False, False]
    np.testing.assert_allclose(rewards_of(counts), [1.0, 2.0])


def test_a_failed_tool_call_folded_with_the_answer_keeps_the_answers_sign():
    # the error floor is a -1 term: with the answer turn folded in, a correct answer lifts it back to 1.0
    counts = score(WITH_ERROR, BRIDGE_CLUES, ["1786"])
    arrays = counts_to_arrays([counts])
    *folded, num_steps = credit.fold_answer_steps(arrays["n_found"], arrays["n_excluded"], arrays["n_rejected"],
                                                  arrays["ans"], arrays["num_steps"], np.array([1]))
    rewards = credit.abc_step_rewards(*folded, arrays["tool_error"])
    assert int(num_steps[0]) == 1 and float(rewards[0, 0]) == pytest.approx(1.0)


@pytest.mark.parametrize("options, field", [({"no_answer": 1}, "no_answer"), ({"no_answer": True}, "no_answer"),
                                            ({"error_step": "zero"}, "error_step"), ({"error_step": 1}, "error_step")])
def test_bad_episode_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=f"RuleBasedStepScorer.{field}"):
        RuleBasedStepScorer(**options)
