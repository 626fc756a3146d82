"""`trace-jax train | eval | sweep`: bad bindings fail before compute, sweeps expand, a short run writes its run dir."""

from __future__ import annotations

import json
import shlex

import pytest

from trace_jax.cli import main
from trace_jax.rl import cli as train_cli

from tests.rl.test_rl_pipeline import SMALL, WARM_START_TURNS


def test_unknown_binding_fails_before_compute_naming_the_binding(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("trace_jax.rl.loop.train", lambda *a, **k: pytest.fail("train ran"))
    status = main(["train", "--gin-param", "CreditConfig.alpha_trun = 0.1", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert status == 2
    assert "CreditConfig.alpha_trun" in err and "alpha_turn" in err
    assert not (tmp_path / "r").exists()


def test_invalid_value_fails_naming_the_binding(capsys, tmp_path):
    status = main(["train", "--gin-param", "RolloutConfig.group_size = 0", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert status == 2 and "RolloutConfig.group_size" in err


def test_estimator_loss_mismatch_fails_before_compute(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("trace_jax.rl.loop.train", lambda *a, **k: pytest.fail("train ran"))
    status = main(["train", "--gin-file", "configs/tiny.gin", "--gin-param", "CreditConfig.estimator = 'gspo'",
                   "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert status == 2 and "LossConfig.ratio_level" in err


def test_a_kv_budget_that_holds_no_row_fails_before_any_rollout(tmp_path, monkeypatch):
    monkeypatch.setattr("trace_jax.rl.loop.RLPipeline", lambda *a, **k: pytest.fail("the pipeline was built"))
    gin_file = tmp_path / "small.gin"
    gin_file.write_text(SMALL + "RolloutConfig.kv_budget_gib = 1e-9\n")
    with pytest.raises(ValueError, match=r"RolloutConfig.kv_budget_gib = 1e-09 gives a pool of 0 pages of 16 "
                                         r"tokens .*one row of max_context = 512 needs 32: raise it"):
        train_cli.run_train([str(gin_file)], [], str(tmp_path / "run"), progress=False)


def test_no_arguments_trains_the_embedded_default(monkeypatch, tmp_path):
    seen = {}

    def fake_train(config, run_dir, **kwargs):
        seen["config"], seen["run_dir"] = config, run_dir

    monkeypatch.setattr("trace_jax.rl.loop.train", fake_train)
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 0
    assert seen["config"].train.model.hidden_size == 128 and seen["config"].warmstart.steps > 0
    assert str(seen["run_dir"]).startswith("runs/tiny-")


def test_sweep_print_expands_a_two_by_two_sweep_into_four_commands(capsys):
    assert main(["sweep", "configs/sweeps/horizon_alpha.gin", "--print"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 4
    bindings = set()
    for line in lines:
        words = shlex.split(line)
        assert words[:4] == ["python", "-m", "trace_jax.cli", "train"]
        params = [words[i + 1] for i, w in enumerate(words) if w == "--gin-param"]
        bindings.add(tuple(p for p in params if p.startswith("CreditConfig")))
    assert bindings == {("CreditConfig.horizon = 1", "CreditConfig.alpha_turn = 0.1"),
                        ("CreditConfig.horizon = 1", "CreditConfig.alpha_turn = 0.2"),
                        ("CreditConfig.horizon = 3", "CreditConfig.alpha_turn = 0.1"),
                        ("CreditConfig.horizon = 3", "CreditConfig.alpha_turn = 0.2")}


def test_sweep_runs_its_four_runs_in_sequence(monkeypatch, tmp_path):
    runs = []

    def fake_train(config, run_dir, **kwargs):
        runs.append((str(run_dir), config.credit.horizon, config.credit.alpha_turn, config.train.steps))

    monkeypatch.setattr("trace_jax.rl.loop.train", fake_train)
    assert main(["sweep", "configs/sweeps/horizon_alpha.gin", "--runs-root", str(tmp_path), "--no-progress"]) == 0
    assert [(h, a) for _, h, a, _ in runs] == [(1, 0.1), (1, 0.2), (3, 0.1), (3, 0.2)]
    assert len({d for d, *_ in runs}) == 4 and all(d.startswith(str(tmp_path / "horizon_alpha")) for d, *_ in runs)
    assert all(steps == 20 for *_, steps in runs)


@pytest.mark.slow
def test_train_then_eval_write_the_run_directory(tmp_path):
    gin_file = tmp_path / "small.gin"
    gin_file.write_text(SMALL + WARM_START_TURNS + "TrainConfig.steps = 2\nTrainConfig.receipts = 1\nWarmStartConfig.steps = 2\n"
                        "WarmStartConfig.num_trajectories = 4\nWarmStartConfig.batch_size = 2\n"
                        "UpdateConfig.kl_metric = True\n")
    run_dir = tmp_path / "run"
    assert train_cli.run_train([str(gin_file)], [], str(run_dir), progress=False) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward" in line]
    assert [line["step"] for line in steps] == [1, 2]
    for name in ("reward", "accuracy", "turns", "tool_calls", "zero_signal_groups", "credit/mean_abs_turn_credit",
                 "credit/terminal_fill_share", "credit/last_state_value", "kl_ref", "clip_frac_high", "grad_norm",
                 "entropy", "sampler_trainer_gap", "time/rollout", "time/scoring", "time/credit", "time/update",
                 "rollout_tokens_per_s", "update_tflops", "mfu"):
        assert name in steps[-1], name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"before", "initial", "final"} <= set(summary["evaluations"])
    assert "difference" in summary["comparison"] and summary["receipts"]
    assert (run_dir / "plots" / "reward_accuracy.png").exists() and (run_dir / "config.gin").exists()
    # every evaluation keeps each task's outcome, in the same task order
    fields = {"task_id", "correct", "reward", "tool_calls", "turns", "tool_errors", "status", "samples_correct"}
    assert set(summary["outcomes"]) == set(summary["evaluations"])
    for label, sets in summary["outcomes"].items():
        (outcomes,) = sets.values()
        assert len(outcomes) == 2 and all(set(o) == fields for o in outcomes), label
        assert sum(o["status"] == name for o in outcomes for name in ("answered", "max_turns", "malformed_answer",
                                                                     "context_overflow", "running")) == 2
    assert main(["eval", "--run-dir", str(run_dir), "--step", "2"]) == 0
    written = json.loads((run_dir / "eval_step2.json").read_text())
    assert written["num_tasks"] == 2
    final = summary["outcomes"]["final"]["heldout"]
    assert [o["task_id"] for o in written["outcomes"]] == [o["task_id"] for o in final]
    assert written["sets"]["heldout"]["outcomes"] == written["outcomes"]


def test_the_compilation_cache_is_the_flag_else_jax_compilation_cache_dir_else_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert train_cli.compilation_cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")
    assert train_cli.compilation_cache_dir(None) == str(tmp_path / "env")
    assert train_cli.compilation_cache_dir("off") is None
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.delenv("TRACE_JAX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert train_cli.compilation_cache_dir(None) == str(tmp_path / "xdg" / "trace_jax" / "xla")
    monkeypatch.setenv("TRACE_JAX_CACHE", str(tmp_path / "tj"))
    assert train_cli.compilation_cache_dir(None) == str(tmp_path / "tj" / "xla")


def test_the_cache_keeps_programs_too_small_for_jaxs_default_threshold(tmp_path):
    """JAX writes only programs that took a second or more to compile; the commands keep every one (a CPU run's
    are mostly smaller), for the next process to load instead of compiling."""
    import os
    import subprocess
    import sys

    script = ("import sys, jax, jax.numpy as jnp\n"
              "from trace_jax.rl.cli import enable_compilation_cache\n"
              "enable_compilation_cache(sys.argv[1])\n"
              "jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(5)).block_until_ready()\n")
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], env=env, check=True, timeout=120)
    assert [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("jit_")]
