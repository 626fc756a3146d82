"""A stand-in for `gcloud` (and `sbatch`) in the launch-script tests: it records every call and answers from a script.

Installed as `gcloud` on PATH ahead of any real one. Every call appends its argv (JSON) to $FAKE_GCLOUD_LOG. The
answer comes from $FAKE_GCLOUD_SCENARIO, a JSON file `{"rules": [{"match": REGEX, "responses": [RESPONSE, ...]}]}`:
the first rule whose regex matches the space-joined arguments answers with its first response, which is consumed
unless it is the last one (the last repeats). A RESPONSE holds `stdout`, `stderr`, `rc` (default 0) and optionally
`exec: true`: run the ssh `--command` with bash here, as one TPU worker whose home is $FAKE_WORKER_HOME, or
`copy: true`: copy the scp source into $FAKE_WORKER_HOME. No rule matching = success with no output.

It knows the gcloud argument shapes the launchers use; it never touches the network.
"""

import json
import os
import re
import shutil
import subprocess
import sys


def main() -> int:
    args = sys.argv[1:]
    with open(os.environ["FAKE_GCLOUD_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps(args) + "\n")
    path = os.environ["FAKE_GCLOUD_SCENARIO"]
    with open(path, encoding="utf-8") as f:
        scenario = json.load(f)
    response = {}
    for rule in scenario["rules"]:
        if re.search(rule["match"], " ".join(args)):
            responses = rule["responses"]
            if len(responses) > 1:  # consumed: rewrite the scenario (a rule with one response is never rewritten,
                response = responses.pop(0)  # so concurrent callers can share it)
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(scenario, f)
            else:
                response = responses[0]
            break
    sys.stdout.write(response.get("stdout", ""))
    sys.stderr.write(response.get("stderr", ""))
    home = os.environ.get("FAKE_WORKER_HOME", "")
    if response.get("exec"):
        command = args[args.index("--command") + 1]
        return subprocess.call(["bash", "-c", command], env={**os.environ, "HOME": home})
    if response.get("copy"):  # gcloud compute tpus tpu-vm scp SOURCE NAME:DEST ...
        shutil.copy(args[4], os.path.join(home, args[5].split(":", 1)[1]))
    return int(response.get("rc", 0))


if __name__ == "__main__":
    sys.exit(main())
