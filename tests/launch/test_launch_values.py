"""Hostile values in the launchers: what reaches an #SBATCH line is read back by sbatch exactly as given (spaces, '#',
quotes, backslashes; '%' doubled where sbatch expands filename patterns), a newline is refused, ports are 1-65535,
`--python` is quoted for the workers' shell, and `stop` signals only the trainer its pid file names.

`sbatch_words` reads an #SBATCH line the way Slurm's sbatch does (src/sbatch/opt.c: whitespace separates words,
single or double quotes group, a backslash escapes the next character, an unquoted '#' starts a comment), so the
tests check what sbatch would see, not the text the script happened to print."""

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.gin")
HOSTILE = 'a b#c%d"e\\f\'g'  # a space, '#', '%', both quotes and a backslash


def sbatch_words(line: str) -> list[str]:
    """The option words sbatch reads from one `#SBATCH ...` line."""
    assert line.startswith("#SBATCH ")
    words, word, in_word, quote, escaped = [], [], False, "", False
    for char in line[len("#SBATCH "):]:
        if escaped:
            word.append(char)
            escaped, in_word = False, True
        elif char == "\\":
            escaped, in_word = True, True
        elif quote:
            if char == quote:
                quote = ""
            else:
                word.append(char)
        elif char in "\"'":
            quote, in_word = char, True
        elif char == "#":
            break
        elif char.isspace():
            if in_word:
                words.append("".join(word))
                word, in_word = [], False
        else:
            word.append(char)
            in_word = True
    assert not quote and not escaped, f"unterminated quote or escape in {line!r}"
    if in_word:
        words.append("".join(word))
    return words


def sbatch_options(script: list[str]) -> dict[str, str]:
    options = {}
    for line in script:
        if line.startswith("#SBATCH "):
            for word in sbatch_words(line):
                name, _, value = word.partition("=")
                options[name] = value
    return options


def expand_pattern(value: str, job: str = "123", task: str = "0") -> str:
    """sbatch/srun filename patterns: %% is a literal %, %j the job id, %t the task id."""
    return re.sub(r"%(%|j|t)", lambda m: {"%": "%", "j": job, "t": task}[m.group(1)], value)


def slurm(launch, *args, cwd=REPO):
    return launch("gpu/slurm.sh", "--nodes", "1", "--gpus-per-node", "1", "--python", "/opt/venv/bin/python",
                  "--gin-file", TINY, *args, "--dry-run", cwd=cwd)


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """The dry-run batch script of a run from a checkout path with a space and '#', every free-text value hostile."""
    return tmp_path_factory.mktemp("values") / "check out#1", "/shared/runs/" + HOSTILE


def test_every_value_written_to_sbatch_lines_reads_back_exactly(launch, hostile_run):
    checkout, run_dir = hostile_run
    checkout.mkdir(exist_ok=True)
    result = slurm(launch, "--run-dir", run_dir, "--partition", HOSTILE, "--account", HOSTILE,
                   "--sbatch-arg", f"--comment={HOSTILE}", cwd=checkout)
    assert result.returncode == 0, result.stderr
    script = result.stdout.splitlines()
    options = sbatch_options(script)
    assert options["--partition"] == HOSTILE and options["--account"] == HOSTILE
    assert options["--comment"] == HOSTILE  # an --sbatch-arg value is passed as given, quoted
    assert options["--chdir"] == str(checkout)
    assert expand_pattern(options["--output"]) == f"{run_dir}/logs/slurm-123.out"  # '%' of the path doubled
    srun = next(line for line in script if line.startswith("srun "))
    srun_output = next(w for w in shlex.split(srun) if w.startswith("--output="))[len("--output="):]
    assert expand_pattern(srun_output, task="1") == f"{run_dir}/logs/slurm-123-1.log"
    assert shlex.split(srun)[-3:] == ["--run-dir", run_dir, "--no-progress"]


@pytest.mark.parametrize("flag", ["--run-dir", "--partition", "--account", "--job-name", "--time", "--sbatch-arg"])
def test_a_newline_in_any_value_for_an_sbatch_line_is_refused(launch, fake_gcloud, flag):
    value = "--comment=a\n#SBATCH --exclusive" if flag == "--sbatch-arg" else "gpu\n#SBATCH --exclusive"
    args = ["--run-dir", "/shared/r"] if flag != "--run-dir" else []
    result = slurm(launch, *args, flag, value)
    assert result.returncode == 2 and result.stdout == ""
    assert flag in result.stderr
    assert fake_gcloud.calls() == []


@pytest.mark.parametrize("value", ["trace jax", "trace%j", "run#1"])
def test_a_job_name_outside_letters_digits_and_dot_dash_underscore_is_refused(launch, value):
    result = slurm(launch, "--run-dir", "/shared/r", "--job-name", value)
    assert result.returncode == 2 and "--job-name" in result.stderr


@pytest.mark.parametrize("value", ["1 day", "10%", "24:00:00 --exclusive"])
def test_a_time_limit_not_in_a_slurm_form_is_refused(launch, value):
    result = slurm(launch, "--run-dir", "/shared/r", "--time", value)
    assert result.returncode == 2 and "--time" in result.stderr and "HH:MM:SS" in result.stderr


def test_a_percent_sign_in_the_checkout_path_is_refused_as_an_sbatch_chdir(launch, tmp_path):
    checkout = tmp_path / "100%"
    checkout.mkdir()
    result = slurm(launch, "--run-dir", "/shared/r", cwd=checkout)
    assert result.returncode == 2 and "holds a '%'" in result.stderr


@pytest.mark.parametrize("port, ok", [("1", True), ("65535", True), ("0", False), ("65536", False),
                                      ("99999", False), ("-1", False), ("80a", False), ("", False)])
def test_the_coordinator_port_must_be_from_1_to_65535(launch, port, ok):
    result = slurm(launch, "--run-dir", "/shared/r", "--mode", "env", "--port", port)
    if ok:
        assert result.returncode == 0, result.stderr
        assert f'1p):{port}"' in result.stdout
    else:
        assert result.returncode == 2 and "--port must be a port number from 1 to 65535" in result.stderr


def test_the_workers_python_is_quoted_for_their_shell(launch):
    python = "3.11; touch /tmp/owned"
    result = launch("tpu_vm/tpu.sh", "setup", "--name", "t", "--zone", "z", "--python", python, "--dry-run")
    assert result.returncode == 0, result.stderr
    setup = next(line for line in result.stdout.splitlines() if "uv venv" in line)
    remote = shlex.split(setup)[-1]  # the --command the workers' shell runs
    words = list(shlex.shlex(remote, posix=True, punctuation_chars=";"))
    assert words[words.index("--python") + 1] == python


# -- the pid file `stop` and babysit's cleanup read on each worker


@pytest.fixture
def worker(fake_gcloud):
    """One fake worker that really runs the stop command (bash, HOME = the fake worker's home)."""
    fake_gcloud.answer([("--command pid=", [{"exec": True}])])
    return fake_gcloud.worker_home


def _stop(launch):
    """(exit status, the worker's messages: its stderr lines, not the launcher's echo of the command)."""
    result = launch("tpu_vm/tpu.sh", "stop", "--name", "t", "--zone", "z")
    return result.returncode, [line for line in result.stderr.splitlines() if line.startswith("trace-jax: ")]


def _sleeper(*argv):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])
    time.sleep(0.2)
    return process


def test_stop_signals_the_trainer_its_pid_file_names(launch, worker):
    trainer = _sleeper(f"{worker}/trace-jax-venv/bin/python", "-m", "trace_jax.cli", "train", "--run-dir", "/r")
    try:
        (worker / "trace-jax-train.pid").write_text(f"{trainer.pid}\n", encoding="utf-8")
        assert _stop(launch) == (0, [])
        assert trainer.wait(timeout=30) == -15  # SIGTERM
    finally:
        trainer.kill()


def test_stop_leaves_alone_a_process_that_reused_the_trainers_pid(launch, worker):
    other = _sleeper()  # e.g. gcsfuse, started after the trainer exited, with the trainer's old pid
    try:
        (worker / "trace-jax-train.pid").write_text(f"{other.pid}\n", encoding="utf-8")
        assert _stop(launch) == (0, [f"trace-jax: process {other.pid} is not the trainer (it has exited); "
                                     "nothing signalled"])
        assert other.poll() is None
    finally:
        other.kill()


@pytest.mark.parametrize("content", ["", "abc", "-1", "1 2", "$(touch owned)"])
def test_stop_refuses_a_pid_file_that_does_not_hold_a_process_id(launch, worker, content):
    (worker / "trace-jax-train.pid").write_text(content, encoding="utf-8")
    assert _stop(launch) == (0, ["trace-jax: ~/trace-jax-train.pid does not hold a process id; nothing signalled"])
    assert not (worker / "owned").exists()


def test_stop_without_a_pid_file_does_nothing(launch, worker):
    assert _stop(launch) == (0, [])


# -- launch/lib.sh reads check.py's output as data


def _preflight(tmp_path, output: bytes, script: str):
    """Run lib.sh's preflight against a stand-in check.py that prints `output`, then `script`."""
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir()
    (launch_dir / "lib.sh").write_text((REPO / "launch" / "lib.sh").read_text(encoding="utf-8"), encoding="utf-8")
    (launch_dir / "check.py").write_text(f"import sys\nsys.stdout.buffer.write({output!r})\n", encoding="utf-8")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{launch_dir}/lib.sh"; RUN_NAMES=(); '
                                         f"preflight; {script}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_preflight_assigns_values_literally_without_running_them(tmp_path):
    result = _preflight(tmp_path, b"MESH\0$(touch owned) `touch owned2`\0RUN_NAMES[]\0a b\0RUN_NAMES[]\0c\nd\0",
                        'printf "%s|" "$MESH" "${#RUN_NAMES[@]}" "${RUN_NAMES[@]}"')
    assert result.returncode == 0, result.stderr
    assert result.stdout == "$(touch owned) `touch owned2`|2|a b|c\nd|"
    assert not (tmp_path / "owned").exists() and not (tmp_path / "owned2").exists()


def test_preflight_refuses_a_name_it_does_not_know(tmp_path):
    result = _preflight(tmp_path, b"PATH\0/tmp/evil\0", 'echo "$PATH"')
    assert result.returncode == 2 and "unexpected name PATH" in result.stderr
