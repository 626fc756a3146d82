"""What a new user sees during a run (issue 29.12): the RL progress bar counts RL steps only (the warm start has a
bar of its own), transformers' "PyTorch was not found" notice is not shown, and receipts print no `None`."""

import logging
import types

from trace_jax.abc.receipts import render_abc_receipt
from trace_jax.rl import metrics
from trace_jax.rl.metrics import RunWriter, progress_bar
from trace_jax.scoring.receipts import render_receipt


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_the_rl_bar_starts_after_the_warm_start_and_times_rl_steps_only(tmp_path, monkeypatch, capsys):
    clock = _Clock()
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    writer = RunWriter(tmp_path, total_steps=18, tensorboard=False, progress=True)
    clock.now = 290.0  # the warm start and the first evaluation took 290 s
    writer.log(0, {"warmstart/final_loss": 0.5, "eval/accuracy": 0.25})
    assert "train" not in capsys.readouterr().err  # no RL bar yet
    clock.now = 300.0
    writer.start_progress()
    clock.now = 310.0
    writer.log(1, {"reward": 0.5})
    shown = capsys.readouterr().err
    writer.close()
    assert "train" in shown and "s/step=10" in shown and "s/step=310" not in shown


def test_what_the_run_prints_after_its_last_step_starts_on_a_line_of_its_own(tmp_path, capsys):
    writer = RunWriter(tmp_path, total_steps=2, tensorboard=False, progress=True)
    writer.start_progress()
    writer.log(1, {"reward": 0.5})
    writer.log(2, {"reward": 0.5})
    writer.end_progress()  # the loop calls it before the end-of-run hooks (final evaluation, summary)
    assert capsys.readouterr().err.endswith("\n")  # the bar's line is finished
    writer.log(2, {"eval/accuracy": 0.5})  # the final evaluation's metrics do not reopen the bar
    writer.close()
    assert "train" not in capsys.readouterr().err


def test_the_warm_start_has_a_bar_of_its_own(capsys):
    bar = progress_bar(3, "warm start")
    bar.update(1)
    bar.close()
    assert "warm start" in capsys.readouterr().err
    silent = progress_bar(3, "warm start", enabled=False)
    silent.update(1)
    silent.close()
    assert capsys.readouterr().err == ""


def test_transformers_pytorch_notice_is_not_shown_but_its_other_warnings_are():
    import trace_jax.models.tokenizer  # noqa: F401  (installs the filter before transformers is imported)

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        logger.warning("PyTorch was not found. Models won't be available and only tokenizers, configuration and "
                       "file/data utilities can be used.")
        logger.warning("some other transformers warning")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["some other transformers warning"]


def test_credit_receipts_print_no_none_fields():
    result = {"id": "q1-sample0", "answer": "Paris", "reward": 1.0, "estimator": "grpo", "flags": ["answered"],
              "outcome_advantage": 0.5, "answer_scores": [-2.0, -1.0], "values": [0.0, 0.6], "td": [0.6],
              "turn_credit": None, "turn_advantage": [0.5]}
    html = render_receipt(result, [{"calls": ["search(Paris)"], "observation": "..."}], question="Where?")
    assert "None" not in html
    assert "<b>tool calls (T)</b></td><td>1</td>" in html  # the number of turns, when the record has no num_turns
    assert "<b>line</b>" not in html


def test_abc_receipts_print_no_none_fields():
    result = {"id": "r1", "answer": "Paris", "group": None, "line": None, "clue_source": "task", "scorer": "rules",
              "clues": [], "counts": [{"n_found": 0, "n_excluded": 0, "n_rejected": 0, "ans": 1}],
              "flagged": [False], "notes": [""], "step_rewards": [2.0], "sft_weights": [1.76], "advantages": [0.0]}
    html = render_abc_receipt(result, [{"call": "", "observation": None, "assistant": "<answer>Paris</answer>"}])
    assert "None" not in html and "<b>group</b>" not in html
