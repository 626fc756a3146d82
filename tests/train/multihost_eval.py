"""A held-out evaluation of a tiny policy, greedy and sampled (pass@k), run by every process of a (possibly
multi-process) run. Each task's episodes are scripted by the task (whichever process or chunk runs them), so the
tasks' outcomes differ: correct or not, tool calls, turns, statuses and correct samples.

`python tests/train/multihost_eval.py OUT_DIR` is what each process of tests/train/test_multihost.py runs (the
`TRACE_JAX_*` variables make it join the run); `run_eval(out_dir)` is the same evaluation in the calling process.
Every process builds the same policy, tasks and browser from fixed seeds and calls `evaluate` with every task; each
writes OUT_DIR/process<i>.json: the result it got (`EvalResult.to_json`, without its wall time) and the task ids of
each `run_episodes` call it made (what it evaluated itself).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

WORDS = ["Alpha", "river", "flows", "through", "Paris", "Rome", "Lina", "Voss", "search", "query", "answer", "The",
         "is", "<answer>", "</answer>"]
QUESTIONS = [("Where does the Alpha river flow?", "Paris"), ("Who is the mayor?", "Lina Voss"),
             ("Which city?", "Rome"), ("Which river?", "Alpha"), ("Where is Rome?", "Rome")]


def run_eval(out_dir: str | Path) -> dict:
    import jax

    from trace_jax import models
    from trace_jax.envs.browser import Browser
    from trace_jax.envs.corpus import Corpus
    from trace_jax.models.chat import ChatFormat
    from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
    from trace_jax.rl import evaluate as evaluate_lib
    from trace_jax.rollout import RolloutConfig, ScriptedPolicy
    from trace_jax.train import distributed

    out_dir = Path(out_dir)
    tokenizer = load_tokenizer(build_word_tokenizer(WORDS, out_dir / f"tokenizer{jax.process_index()}"))
    chat = ChatFormat(tokenizer)
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    browser = Browser(Corpus.from_records([{"docid": "d1", "url": "https://wiki.example/alpha",
                                            "title": "Alpha river", "text": "The Alpha river flows through Paris."}]))
    tasks = [types.SimpleNamespace(task_id=f"q{i}", question=q, answer=a, aliases=())
             for i, (q, a) in enumerate(QUESTIONS)]
    rollout = RolloutConfig(max_turns=2, max_context=512, turn_token_budget=32, system_prompt="Use tools.",
                            with_tools=False, sync_every=1)

    def answer(text):
        return chat.assistant_content_ids(f"The answer is {text}.\n<answer>{text}</answer>") + [chat.im_end_id]

    search = chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": "Alpha river"}}])
    # greedy: right after a search, wrong, right, the turn cap (3 searches), wrong
    greedy = {"q0": [search, answer("Paris")], "q1": [answer("Rome")], "q2": [answer("Rome")],
              "q3": [search, search, search], "q4": [answer("Paris")]}
    gold = {t.task_id: t.answer for t in tasks}

    def sampled(task_id, sample):  # task qi: its first i % 3 samples right
        return [answer(gold[task_id] if sample < int(task_id[1:]) % 3 else "Voss")]

    calls = []
    run_episodes = evaluate_lib.run_episodes

    def recording(model_config, params, chat, chunk, browser, rollout, rng, **kwargs):
        calls.append([t.task_id for t in chunk])
        scripts = [greedy[t.task_id] if rollout.group_size == 1 else sampled(t.task_id, g)
                   for t in chunk for g in range(rollout.group_size)]
        kwargs["logits_hook"] = ScriptedPolicy(scripts, config.vocab_size)
        return run_episodes(model_config, params, chat, chunk, browser, rollout, rng, **kwargs)

    evaluate_lib.run_episodes = recording
    try:
        result = evaluate_lib.evaluate(config, params, chat, tasks, browser, rollout,
                                       evaluate_lib.EvalConfig(batch_size=8, pass_k=2, pass_samples=2))
    finally:
        evaluate_lib.run_episodes = run_episodes
    record = {"result": {k: v for k, v in result.to_json().items() if k != "seconds"}, "calls": calls,
              "processes": jax.process_count()}
    (out_dir / f"process{jax.process_index()}.json").write_text(json.dumps(record), encoding="utf-8")
    distributed.barrier("multihost_eval written")
    return json.loads(json.dumps(record))  # as the files read back (lists, not tuples)


if __name__ == "__main__":
    from trace_jax.train import distributed

    distributed.initialize(distributed.DistributedConfig(initialization_timeout_s=60))
    run_eval(sys.argv[1])
