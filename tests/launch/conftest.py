"""Fixtures of the launch-script tests: the scripts' environment, and a fake `gcloud` that records its calls.

Nothing here reaches the network or needs gcloud, srun or a GPU: the fake gcloud is first on PATH, and the scripts
are otherwise run with --dry-run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"


class FakeGcloud:
    """The fake's scenario and call log (see fake_gcloud.py)."""

    def __init__(self, root: Path):
        self.bin = root / "bin"
        self.bin.mkdir()
        self.log = root / "gcloud_calls.jsonl"
        self.scenario = root / "scenario.json"
        self.worker_home = root / "worker"
        self.worker_home.mkdir()
        script = (Path(__file__).parent / "fake_gcloud.py").read_text(encoding="utf-8")
        for name in ("gcloud", "sbatch"):
            (self.bin / name).write_text(f"#!{sys.executable}\n{script}", encoding="utf-8")
            (self.bin / name).chmod(0o755)
        self.answer([])

    def answer(self, rules):
        """rules: [(regex, [response, ...]), ...], first match answers."""
        self.scenario.write_text(json.dumps({"rules": [{"match": m, "responses": r} for m, r in rules]}),
                                 encoding="utf-8")

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def fake_gcloud(tmp_path):
    return FakeGcloud(tmp_path)


@pytest.fixture
def launch(fake_gcloud, tmp_path):
    """Run a launch script: launch("tpu_vm/tpu.sh", "create", ...[, cwd=DIR]) -> CompletedProcess (text, not
    checked)."""
    env = {**os.environ, "PATH": f"{fake_gcloud.bin}{os.pathsep}{os.environ['PATH']}",
           "FAKE_GCLOUD_LOG": str(fake_gcloud.log), "FAKE_GCLOUD_SCENARIO": str(fake_gcloud.scenario),
           "FAKE_WORKER_HOME": str(fake_gcloud.worker_home), "TMPDIR": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}

    def run(script, *args, timeout=120, cwd=REPO):
        return subprocess.run([str(LAUNCH / script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)

    return run
