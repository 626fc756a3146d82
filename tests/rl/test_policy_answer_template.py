"""The policy's own answer opening: for the embedded policies it is the text right before the gold answer in the
warm-start demonstrations they were trained on (real ones, token ids included); the run config chooses it by name."""

import dataclasses

import pytest

from trace_jax.envs import oracle
from trace_jax.models.chat import EMPTY_THINK_BLOCK, ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rl import gin_setup
from trace_jax.rl.loop import build_tasks, demonstrable_tasks
from trace_jax.rl.pipeline import DEFAULT_ANSWER_TEMPLATE, RLPipeline, UpdateConfig
from trace_jax.rl.warmstart import (ANSWER_TEMPLATE_NAMES, oracle_trajectories, policy_answer_template,
                                    resolve_answer_template, sft_arrays)
from trace_jax.scoring.continuation import ANSWER_TAG_TEMPLATE, build_answer_continuation

EMBEDDED = ("configs/tiny.gin", "configs/study.gin")


@pytest.fixture(scope="module")
def word_chat(tmp_path_factory):
    """The embedded policies' chat format: the word tokenizer over the trajectory vocabulary (as a run builds it)."""
    directory = build_word_tokenizer(oracle.trajectory_vocabulary(), tmp_path_factory.mktemp("tokenizer"))
    return ChatFormat(load_tokenizer(directory))


def demonstration_answer_turns(config_file: str, chat: ChatFormat, count: int = 24):
    """`(gold, final-turn ids)` of real warm-start demonstrations of `config_file`, rendered by the warm start's
    own code (`oracle_trajectories` + `sft_arrays`, with the run's settings) as the policy was trained on them."""
    run_config = gin_setup.parse([config_file])
    assert run_config.warm_started
    splits, browser, _ = build_tasks(run_config)
    warm = dataclasses.replace(run_config.warmstart, num_trajectories=count)
    results = oracle_trajectories(demonstrable_tasks(splits.train), browser, warm)
    arrays = sft_arrays(chat, warm.render_rollout(run_config.rollout), browser, results,
                        length_multiple=warm.length_multiple, max_length=warm.max_length)
    golds = {r.task.task_id: r.task.answer for r in results}
    turns = []
    for row, task_id in enumerate(arrays.task_ids):
        final = (arrays.turn_index[row] == arrays.turn_index[row].max()) & (arrays.loss_mask[row] > 0)
        ids = [int(i) for i in arrays.tokens[row][final]]
        assert ids[-1] == chat.im_end_id
        turns.append((golds[task_id], ids[:-1]))
    return turns


@pytest.mark.parametrize("config_file", EMBEDDED)
def test_policy_opening_is_the_text_before_the_gold_answer_in_the_warm_start_demonstrations(word_chat,
                                                                                          config_file):
    tokenizer = word_chat.tokenizer
    template = resolve_answer_template("policy", word_chat, warm_started=True)
    turns = demonstration_answer_turns(config_file, word_chat)
    assert len(turns) >= 16
    for gold, ids in turns:
        text = tokenizer.decode(ids)
        assert word_chat.assistant_content_ids(text) == ids  # the text below is exactly these ids
        # the gold answer the policy writes last before its answer tag, and the token where it starts
        at = text.rfind(gold, 0, text.rindex("<answer>"))
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        first = next(k for k, (a, b) in enumerate(offsets) if b > at)
        continuation = build_answer_continuation(tokenizer, word_chat, gold, template=template)
        opening, answer = continuation.template_ids, continuation.answer_ids
        assert ids[first - len(opening): first + len(answer)] == opening + answer, (text, template)
        assert text[:at].endswith(continuation.text[:-len(gold)])
        # the opening starts where the oracle's notes end: it is the whole of what precedes the answer sentence
        assert tokenizer.decode(ids[:first - len(opening)]).endswith(".")


def test_the_oracles_opening_is_what_its_final_message_writes_before_the_answer():
    note = "Kalo lies on the Venmir River."
    with_note = oracle.final_message([note], "Venmir River")
    assert with_note.startswith(note + oracle.answer_template().format(answer="Venmir River") + ".\n<answer>")
    assert oracle.answer_template() == " The answer is {answer}"
    without = oracle.final_message([], "Venmir River")
    assert without.startswith(oracle.answer_template(after_notes=False).format(answer="Venmir River") + ".")
    assert oracle.final_message([note], None) == note + " " + oracle.SAY_GIVE_UP


def test_a_warm_started_policy_opens_as_the_oracle_and_a_chat_model_with_the_tag(word_chat):
    assert policy_answer_template(word_chat, warm_started=True) == oracle.answer_template()
    assert policy_answer_template(word_chat, warm_started=False) == ANSWER_TAG_TEMPLATE


def test_chat_models_open_with_the_answer_tag_after_a_closed_think_block(word_chat):
    assert oracle.chat_answer_template() == ANSWER_TAG_TEMPLATE  # what the system prompt asks for, scored as is
    assert "<answer>your answer</answer>" in oracle.SYSTEM_PROMPT
    hybrid = ChatFormat(word_chat.tokenizer, thinking="hybrid")
    template = resolve_answer_template("policy", hybrid, warm_started=False)
    continuation = build_answer_continuation(word_chat.tokenizer, hybrid, "Venzu", template=template)
    assert continuation.text == EMPTY_THINK_BLOCK + "<answer>Venzu"


def test_a_warm_started_policy_on_a_thinking_format_opens_with_the_formats_answer_tag(word_chat):
    """The oracle's demonstrations hold no think block, so no template reproduces its opening after one: 'policy'
    falls back to the format's own opening there, so the default works with every shipped format."""
    hybrid = ChatFormat(word_chat.tokenizer, thinking="hybrid")
    assert resolve_answer_template("policy", hybrid, warm_started=True) == ANSWER_TAG_TEMPLATE
    assert resolve_answer_template("answer_tag", hybrid, warm_started=True) == ANSWER_TAG_TEMPLATE


def test_named_and_literal_templates_resolve(word_chat):
    assert ANSWER_TEMPLATE_NAMES == ("answer_tag", "policy")
    assert resolve_answer_template("answer_tag", word_chat, warm_started=True) == "<answer>{answer}"
    assert resolve_answer_template("policy", word_chat, warm_started=True) == " The answer is {answer}"
    assert resolve_answer_template("policy", word_chat, warm_started=False) == "<answer>{answer}"
    assert resolve_answer_template("Answer: {answer}", word_chat, warm_started=False) == "Answer: {answer}"


@pytest.mark.parametrize("value, message", [
    ("policies", "neither a named template"), ("{answer} and {answer}", "2 times"),
    ("{answer}.", "text after"), ("{answr} {answer}", "braces"), (3, "must be a string")])
def test_update_config_rejects_a_bad_answer_template_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message) as error:
        UpdateConfig(answer_template=value)
    assert "UpdateConfig.answer_template" in str(error.value)


def test_the_default_answer_template_is_one_named_constant():
    assert UpdateConfig().answer_template == DEFAULT_ANSWER_TEMPLATE == "policy"


def test_gin_binds_the_answer_template_and_run_config_knows_warm_starts():
    run_config = gin_setup.parse(["configs/tiny.gin"], ["UpdateConfig.answer_template = 'policy'"])
    assert run_config.update.answer_template == "policy" and run_config.warm_started
    cold = gin_setup.parse(["configs/tiny.gin"], ["WarmStartConfig.steps = 0"])
    assert not cold.warm_started and cold.update.answer_template == DEFAULT_ANSWER_TEMPLATE
    with pytest.raises(gin_setup.ConfigError, match="answer_template"):
        gin_setup.parse(["configs/tiny.gin"], ["UpdateConfig.answer_template = 'The answer'"])


def _pipeline(chat, estimator, answer_template, warm_started):
    from trace_jax.credit.config import CreditConfig
    from trace_jax.rollout import RolloutConfig
    from trace_jax.train.config import LossConfig

    return RLPipeline(None, chat, None, RolloutConfig(), CreditConfig(estimator=estimator), LossConfig(),
                      UpdateConfig(answer_template=answer_template), None, train_step=lambda *args: None,
                      warm_started=warm_started)


def test_the_pipeline_scores_the_gold_after_the_configured_template(word_chat):
    tokenizer = word_chat.tokenizer
    policy = _pipeline(word_chat, "trace", "policy", warm_started=True).continuation("Venzu")
    tag = _pipeline(word_chat, "trace", "answer_tag", warm_started=True).continuation("Venzu")
    assert policy.text == " The answer is Venzu" and tag.text == "<answer>Venzu"
    # the same gold, as each opening makes the policy write it: a word after a space, or right after the tag
    assert policy.answer_ids == tokenizer.encode(" Venzu", add_special_tokens=False)
    assert tag.answer_ids == tokenizer.encode("Venzu", add_special_tokens=False)


def test_a_warm_started_pipeline_on_a_thinking_format_scores_after_the_closed_think_block(word_chat):
    hybrid = ChatFormat(word_chat.tokenizer, thinking="hybrid")
    continuation = _pipeline(hybrid, "trace", "policy", warm_started=True).continuation("Venzu")
    assert continuation.text == EMPTY_THINK_BLOCK + "<answer>Venzu"
