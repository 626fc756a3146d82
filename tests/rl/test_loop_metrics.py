"""Run-directory writer: strict-JSON metrics lines, resume truncation, TensorBoard events, plots, phase timer."""

import json
import math
import struct

import numpy as np
import pytest

from trace_jax.rl.metrics import PhaseTimer, RunWriter, encode_line, read_metrics, write_plots


def synthetic_history(steps=12):
    rng = np.random.default_rng(0)
    history = []
    for step in range(1, steps + 1):
        record = {"step": step, "wall_time": 3.0 * step, "reward": 0.2 + 0.03 * step + 0.02 * rng.standard_normal(),
                  "turns": 3 + rng.random(), "tool_calls": 2 + rng.random(), "credit/mean_abs_turn_credit": rng.random(),
                  "credit/terminal_fill_share": 0.1 * rng.random(), "time/rollout": 2.0, "time/scoring": 0.3,
                  "time/credit": 0.01, "time/update": 0.7}
        if step % 4 == 0:
            record.update({"eval/accuracy": 0.3 + 0.02 * step, "eval/accuracy_se": 0.04})
        history.append(record)
    return history


def test_non_finite_values_are_never_written_as_bare_nan():
    line = encode_line(3, 1.5, {"loss": float("nan"), "kl": float("inf"), "reward": np.float32(0.5)})
    assert "NaN" not in line and "Infinity" not in line
    record = json.loads(line)  # strict JSON parsers accept it
    assert record["loss"] is None and record["nonfinite"] == {"loss": "nan", "kl": "inf"}
    assert record["reward"] == 0.5 and record["step"] == 3


def test_read_metrics_restores_non_finite_values(tmp_path):
    with RunWriter(tmp_path, tensorboard=False, progress=False) as writer:
        writer.log(1, {"loss": float("nan"), "grad_norm": -float("inf"), "reward": 1.0})
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["loss"]) and record["grad_norm"] == -float("inf") and record["reward"] == 1.0


def test_one_line_per_logged_step_with_wall_time(tmp_path):
    with RunWriter(tmp_path, tensorboard=False, progress=False) as writer:
        for step in range(1, 4):
            writer.log(step, {"reward": step / 10})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    times = [json.loads(line)["wall_time"] for line in lines]
    assert times == sorted(times) and times[0] >= 0


def test_non_scalar_metric_is_an_error_naming_it(tmp_path):
    with RunWriter(tmp_path, tensorboard=False, progress=False) as writer:
        with pytest.raises(ValueError, match="'reward'"):
            writer.log(1, {"reward": [1.0, 2.0]})


def test_resume_keeps_steps_up_to_the_checkpoint_and_continues_wall_time(tmp_path):
    with RunWriter(tmp_path, tensorboard=False, progress=False) as writer:
        for step in range(1, 6):
            writer.log(step, {"reward": float(step)})
    last_kept_time = read_metrics(tmp_path)[2]["wall_time"]
    with RunWriter(tmp_path, resume_step=3, tensorboard=False, progress=False) as writer:
        writer.log(4, {"reward": 40.0})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["reward"] == 40.0 and records[-1]["wall_time"] >= last_kept_time


def read_scalars(run_dir):
    """{tag: [(step, value)]} from the TFRecord event files (length, crc, Event proto, crc per record)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            length = struct.unpack("<Q", data[offset:offset + 8])[0]
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_events_hold_every_logged_scalar(tmp_path):
    with RunWriter(tmp_path, progress=False) as writer:
        writer.log(1, {"reward": 0.25, "eval/accuracy": 0.5})
        writer.log(2, {"reward": 0.75})
    scalars = read_scalars(tmp_path)
    assert scalars["reward"] == [(1, 0.25), (2, 0.75)]
    assert scalars["eval/accuracy"] == [(1, 0.5)]


def test_plots_are_written_for_the_logged_metric_families(tmp_path):
    paths = write_plots(synthetic_history(), tmp_path)
    assert sorted(p.name for p in paths) == ["credit.png", "episodes.png", "phase_times.png", "reward_accuracy.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_several_evaluation_sets_get_a_plot_of_their_own(tmp_path):
    history = [{"step": s, "wall_time": float(s), "eval/accuracy": 0.1 * s, "eval/bcp/accuracy": 0.1 * s,
                "eval/bcp/accuracy_se": 0.02, "eval/procedural/accuracy": 0.2, "eval/procedural/accuracy_se": 0.03,
                "eval/average/accuracy": 0.05 * s + 0.1, "eval/average/accuracy_se": 0.02,
                "eval/status/answered": 1.0} for s in (0, 2, 4)]
    paths = write_plots(history, tmp_path)
    assert "eval_sets.png" in [p.name for p in paths]
    assert (tmp_path / "eval_sets.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_skip_families_that_were_never_logged(tmp_path):
    paths = write_plots([{"step": 1, "wall_time": 1.0, "reward": 0.5}], tmp_path)
    assert [p.name for p in paths] == ["reward_accuracy.png"]


def test_summary_is_strict_json(tmp_path):
    with RunWriter(tmp_path, tensorboard=False, progress=False) as writer:
        path = writer.write_summary({"accuracy": np.float64(0.5), "kl": float("nan"), "runs": (1, 2)})
    assert json.loads(path.read_text()) == {"accuracy": 0.5, "kl": None, "runs": [1, 2]}


def test_phase_timer_adds_repeated_phases_and_totals_the_step():
    clock = iter([0.0, 1.0, 1.0, 3.5, 4.0, 4.5])
    timer = PhaseTimer()
    timer._clock = lambda: next(clock)
    with timer.phase("rollout"):
        pass
    with timer.phase("update"):
        pass
    with timer.phase("update"):
        pass
    assert timer.metrics() == {"time/rollout": 1.0, "time/update": 3.0, "time/step": 4.0, "compile_seconds": 0.0}
    timer.reset()
    assert timer.metrics() == {"time/step": 0, "compile_seconds": 0.0}


def test_phase_timer_counts_the_seconds_jax_spends_compiling_inside_its_phases():
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.0)
    timer = PhaseTimer()
    x = jnp.ones((5, 7))
    with timer.phase("rollout"):  # traces, lowers and compiles f for (5, 7)
        jax.block_until_ready(f(x))
    first = timer.metrics()
    assert 0.0 < first["compile_seconds"] <= first["time/rollout"]
    timer.reset()
    with timer.phase("rollout"):  # the cached program: no compile
        jax.block_until_ready(f(x))
    jax.block_until_ready(f(jnp.ones((6, 7))))  # outside any phase: not counted
    assert timer.metrics()["compile_seconds"] == 0.0


def test_progress_bar_shows_step_reward_accuracy_and_seconds_per_step(tmp_path, capsys):
    with RunWriter(tmp_path, total_steps=3, tensorboard=False, progress=True) as writer:
        writer.log(1, {"reward": 0.5})
        writer.log(2, {"reward": 0.625, "eval/accuracy": 0.25})
        postfix = writer._bar.postfix
        assert writer._bar.n == 2
    assert "reward=0.625" in postfix and "acc=0.25" in postfix and "s/step=" in postfix
