"""ABC's rule-based step scorer for procedural tasks, whose clue chain is known exactly, and the helpers that turn an
episode (an `EpisodeRecord`, a `trace-jax credit` JSONL record or an oracle trajectory) into `Step`s.

The rubric (credit-spec.md section 3) is counted from the tool observations alone, never from what the assistant
claims, so a scorer cannot be talked into credit:

- **n_found**: support clues (`kind == "support"`) *first* revealed by this step's observation (`clue_matches`), on
  the clue's own page: the step's `docid` when known, else the page the observation shows (its title is the clue's
  entity; search-result pages reveal nothing). A clue seen again later counts once, at its first step.
- **n_excluded**: exclude clues (`kind == "exclude"`: a candidate's fact that rules it out, counting questions)
  first revealed by this step, under the same rule.
- **n_rejected**: see `RuleBasedStepScorer`.
- **ans**: on the last step only (`answer_outcome`), when it holds an `<answer>` tag: +1 for an exact match with the
  gold answer or an alias (`answers.answer_reward`), -1 otherwise. A trajectory that ended without an answer (turn
  cap, context overflow: its last step has an observation or no `<answer>`) has failed: `no_answer` (-1 by default,
  as a wrong answer; 0 = the old neutral reading, under which running out of turns scores 1.0 and a wrong answer 0).
- **tool_error**: a step whose tool call failed (its observation is an error, `is_tool_error`) is marked, and with
  `error_step = 0` (default) its counts are 0, so it scores the rubric's floor `r = 0`; `error_step = 'neutral'`
  scores it like any other step (1.0 unless it reveals something, which an error message never does).
  Both options are our reading of "irrelevant or harmful actions get zero or negative scores" (credit-spec
  section 3, docs/abc.md).

This module knows tasks' clue records, answer checking and the browser's observation layout; it knows nothing about
models, tokenizers or the credit arithmetic (`trace_jax.credit.abc_step_rewards` turns the counts into rewards).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from trace_jax.abc.scorer import Step, StepCounts
from trace_jax.envs.answers import answer_reward, extract_answer, normalize_answer
from trace_jax.envs.browser import ERROR_PREFIX
from trace_jax.envs.tasks import Clue, clue_matches

NO_ANSWER_CHOICES = (-1, 0)  # `ans` of the last step of a trajectory that ended without an answer
ERROR_STEP_CHOICES = (0, "neutral")  # a failed tool call's step: the rubric's floor r = 0, or scored as usual

# The browser's page header: "[3] Selru (https://wiki.local/Selru)" and, for find results,
# "[4] Find results for text: `born` in `Selru` (https://wiki.local/Selru/find?pattern=born)".
_HEADER = re.compile(r"^\[\d+\] (?P<title>.*) \((?P<url>[^()\s]*)\)\s*$")
_FIND_TITLE = re.compile(r"^Find results for text: `.*` in `(?P<title>.*)`$")
_VIEWING = re.compile(r"^\*\*viewing lines .*\*\*\s*$")


def check_episode_options(owner: str, no_answer: Any, error_step: Any) -> None:
    """ValueError naming `owner.no_answer` / `owner.error_step` when either is not one of its choices."""
    if isinstance(no_answer, bool) or no_answer not in NO_ANSWER_CHOICES:
        raise ValueError(f"{owner}.no_answer must be -1 (an episode that ends without an answer has failed, as a "
                         f"wrong answer) or 0 (neutral), got {no_answer!r}")
    if isinstance(error_step, bool) or error_step not in ERROR_STEP_CHOICES:
        raise ValueError(f"{owner}.error_step must be 0 (a failed tool call scores the floor r = 0) or 'neutral', "
                         f"got {error_step!r}")


def answer_outcome(gold: Sequence[str], steps: Sequence[Step], k: int, *, no_answer: int = -1) -> int:
    """`ans` of step `k`: 0 before the last step; on the last step +1/-1 for a correct/wrong `<answer>` on a step
    without an observation, and `no_answer` when the trajectory ended without one (turn cap, context overflow)."""
    if k != len(steps) - 1:
        return 0
    step = steps[k]
    if step.observation is not None or extract_answer(step.assistant) is None:
        return no_answer
    return 1 if answer_reward(step.assistant, list(gold)).exact else -1


def is_tool_error(step: Step) -> bool:
    """Whether the step's tool call failed: it could not be parsed or run, and its observation is the error
    (`trace_jax.rollout.agent.error_observation` and the browser's errors share `ERROR_PREFIX`)."""
    return step.observation is not None and step.observation.startswith(ERROR_PREFIX)


def observation_page(observation: str) -> tuple[str | None, str]:
    """`(title of the document the observation shows, or None; the observation body without its header lines)`.

    Search-result pages and error messages give None: their text is snippets or messages, not a page's facts.
    """
    lines = observation.split("\n")
    match = _HEADER.match(lines[0]) if lines else None
    if match is None:
        return None, observation
    body_lines = lines[1:]
    if body_lines and _VIEWING.match(body_lines[0]):
        body_lines = body_lines[1:]
    body = "\n".join(body_lines)
    title = match.group("title")
    if title.startswith("Search results for"):
        return None, body
    find = _FIND_TITLE.match(title)
    return (find.group("title") if find else title), body


def clues_from_records(records: Sequence[Any]) -> tuple[Clue, ...]:
    """Clue chain from `Clue`s or their dicts (`Clue.to_dict`, as oracle records and task files carry them)."""
    clues = []
    for index, clue in enumerate(records or ()):
        if isinstance(clue, Clue):
            clues.append(clue)
        elif isinstance(clue, Mapping) and isinstance(clue.get("docid"), str):
            clues.append(Clue(docid=clue["docid"], entity=str(clue.get("entity", "")),
                              relation=str(clue.get("relation", "")), value=str(clue.get("value", "")),
                              kind=str(clue.get("kind", "support"))))
        else:
            raise ValueError(f"clues[{index}] is {clue!r:.80}; expected a Clue or a dict with a string 'docid' "
                             "(and entity, relation, value, kind)")
    return tuple(clues)


def _tool_call(call: Any) -> tuple[str, dict] | None:
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    return (function["name"], arguments) if isinstance(arguments, dict) else None


def message_text(content: Any) -> str:
    """The text of an OpenAI message `content` (a string, or a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def steps_from_messages(messages: Sequence[Mapping[str, Any]]) -> list[Step]:
    """Steps of an OpenAI-format trajectory (a `trace-jax credit` record's or an oracle's `messages`).

    Every assistant message opens a step; the tool messages that follow it (one observation, joined by blank
    lines) close it. A final assistant message without tool calls is the answer step (no observation). A record
    that ends on a tool message (cut at max turns) ends on a tool step, so its last step has no answer.
    """
    steps: list[dict] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            calls = message.get("tool_calls") or ()
            steps.append({"assistant": message_text(message.get("content")), "observation": None,
                          "tool_call": _tool_call(calls[0]) if calls else None})
        elif role == "tool" and steps:
            previous = steps[-1]["observation"]
            text = message_text(message.get("content"))
            steps[-1]["observation"] = text if previous is None else previous + "\n\n" + text
    return [Step(**step) for step in steps]


def steps_from_episode(episode: Any) -> list[Step]:
    """Steps of a rollout `EpisodeRecord`: one per generated turn; turn `k < len(observations)` got observation k."""
    steps = []
    for k, text in enumerate(episode.turn_texts):
        call = episode.tool_calls[k] if k < len(episode.tool_calls) else None
        steps.append(Step(assistant=text,
                          observation=episode.observations[k] if k < len(episode.observations) else None,
                          tool_call=tuple(call) if isinstance(call, tuple) and len(call) == 2 else None))
    return steps


def steps_from(episode: Any) -> list[Step]:
    """Steps of any episode form: a rollout `EpisodeRecord`, a `trace-jax credit` / oracle JSONL record (a dict
    with `messages`), an `OracleResult`, or a bare message list."""
    if hasattr(episode, "turn_texts"):
        return steps_from_episode(episode)
    if isinstance(episode, Mapping) and isinstance(episode.get("messages"), list):
        return steps_from_messages(episode["messages"])
    if isinstance(getattr(episode, "messages", None), list):
        return steps_from_messages(episode.messages)
    if isinstance(episode, list):
        return steps_from_messages(episode)
    raise TypeError(f"cannot read steps from a {type(episode).__name__}; pass an EpisodeRecord, a record dict with "
                    "'messages', an OracleResult or a list of chat messages")


class RuleBasedStepScorer:
    """ABC step counts from the clue chain's matches in tool observations (see the module docstring).

    `n_rejected` (a correct clue wrongly rejected) is scored by one conservative rule, on the answer step only:
    it is 1 when the final answer is wrong (including "unknown") although an earlier observation had already
    revealed, on its own page, a support clue whose value *is* the gold answer (or an alias, compared after
    `answers.normalize_answer`). The agent read the answer where it stands and answered something else. Nothing
    else counts as a rejection: abandoning a search path, re-reading a page or a wrong answer to a question whose
    answer is not itself a clue value (comparisons, counts) is not scored as rejecting a clue, because the text
    alone cannot tell a rejection from an unfinished search. So `n_rejected` is 0 or 1, and a correct answer
    never has one.

    Example (a bridge question whose last clue's value is the answer `Kaol`): steps `search`, `open` the page
    showing the clue, answer `Selru` -> counts `(0,0,0,0)`, `(1,0,0,0)`, `(0,0,1,-1)` -> rewards `1.0, 1.8, 0.0`.

    Args:
      no_answer: `ans` of the last step of a trajectory that ended without an answer (-1 default, or 0).
      error_step: 0 (default): a step whose tool call failed is marked `tool_error` and scores the floor r = 0;
        'neutral': it is scored as any other step.
    """

    name = "rules"

    def __init__(self, *, no_answer: int = -1, error_step: int | str = 0):
        check_episode_options("RuleBasedStepScorer", no_answer, error_step)
        self.no_answer, self.error_step = no_answer, error_step

    def score(self, *, question: str, gold: Sequence[str], clues: Sequence[Any],
              steps: Sequence[Step]) -> list[StepCounts]:
        """One `StepCounts` per step (see `trace_jax.abc.scorer.StepScorer`)."""
        del question  # the rules read observations only
        gold = [gold] if isinstance(gold, str) else list(gold)
        chain = clues_from_records(clues)
        gold_norm = {normalize_answer(g) for g in gold if normalize_answer(g)}
        seen: set[int] = set()
        answer_seen = False
        out = []
        for index, step in enumerate(steps):
            revealed = self._revealed(chain, step) - seen
            seen |= revealed
            n_found = sum(chain[i].kind != "exclude" for i in revealed)
            n_excluded = sum(chain[i].kind == "exclude" for i in revealed)
            ans = answer_outcome(gold, steps, index, no_answer=self.no_answer)
            n_rejected = 0
            if index == len(steps) - 1 and step.observation is None and extract_answer(step.assistant) is not None:
                n_rejected = int(ans == -1 and answer_seen)
            answer_seen = answer_seen or any(chain[i].kind != "exclude" and normalize_answer(chain[i].value)
                                             in gold_norm for i in revealed)
            if self.error_step == 0 and is_tool_error(step):  # an error message reveals nothing anyway
                out.append(StepCounts(ans=ans, tool_error=True))
                continue
            out.append(StepCounts(n_found=n_found, n_excluded=n_excluded, n_rejected=n_rejected, ans=ans))
        return out

    @staticmethod
    def _revealed(chain: Sequence[Clue], step: Step) -> set[int]:
        if not step.observation:
            return set()
        title, body = observation_page(step.observation)
        if step.docid is not None:
            return set(clue_matches(chain, body, docid=step.docid))
        if title is None:
            return set()
        return {i for i in clue_matches(chain, body) if chain[i].entity and chain[i].entity == title}
