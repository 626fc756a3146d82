"""The `trace-jax` command line: one entry point, one sub-command per job.

Each sub-command lives in the module that owns the job and exposes two functions,
`add_arguments(parser: argparse.ArgumentParser) -> None` and `run(args: argparse.Namespace) -> int`.
This module only dispatches; it imports a sub-command's module when that sub-command is asked for,
so `trace-jax --help` stays fast and a broken optional part cannot break the others.

A command whose module runs parts of a package above its own gets them from `EXTENSIONS`: the named function
returns keyword arguments for its `run`. So `trace_jax.scoring` and `trace_jax.serve` never import `trace_jax.abc`
(`tests/test_cli_layers.py`), yet `trace-jax credit` scores ABC estimators and `trace-jax serve` serves ABC's
scripted judge.

Every command's flags are `--kebab-case`; a multi-word flag also takes its snake_case spelling (`--run-dir` and
`--run_dir`), listed second (`tests/test_cli_flags.py` checks every command).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module implementing add_arguments/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "credit": ("trace_jax.scoring.cli", "TRACE credit for existing trajectories (JSONL in, JSONL + receipts out)"),
    "convert-gguf": ("trace_jax.models.gguf", "dequantise a GGUF checkpoint into a Hugging Face safetensors directory"),
    "make-tasks": ("trace_jax.envs.cli", "generate procedural multi-hop search tasks and their corpus"),
    "serve": ("trace_jax.serve.cli", "serve a checkpoint behind an OpenAI-compatible API (loopback by default)"),
    "abc-score": ("trace_jax.abc.cli", "ABC step rewards for existing trajectories with an LLM judge (JSONL in)"),
    "train": ("trace_jax.rl.cli", "RL of a search agent on gin configs (no arguments: the embedded default)"),
    "eval": ("trace_jax.rl.cli", "held-out evaluation of a saved step of a training run"),
    "sweep": ("trace_jax.rl.cli", "expand a sweep gin file into runs; run them in sequence or print commands"),
    "study": ("trace_jax.rl.study", "methods x seeds (+ ablations) as resumable runs; results.json and plots"),
    "credit-quality": ("trace_jax.rl.credit_quality", "every estimator's credit on the same sampled episodes: value "
                       "jumps, correct-vs-wrong separation, progress correlation, with bootstrap CIs"),
    "plan": ("trace_jax.plan", "AOT-compile a config's train/score/decode programs for a TPU topology: HBM fit"),
}
# name -> (module, function) giving keyword arguments of the command's `run`, composed here (see the docstring).
EXTENSIONS: dict[str, tuple[str, str]] = {
    "credit": ("trace_jax.abc.cli", "credit_extensions"),
    "serve": ("trace_jax.abc.cli", "serve_extensions"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The full parser; only the sub-command named by `argv[0]` imports its module and adds its arguments."""
    parser = argparse.ArgumentParser(prog="trace-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv else None
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command_parser.set_defaults(_module=module_name)
        if name == wanted:
            importlib.import_module(module_name).add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    extras = {}
    if args.command in EXTENSIONS:
        module_name, function = EXTENSIONS[args.command]
        extras = getattr(importlib.import_module(module_name), function)()
    return int(importlib.import_module(args._module).run(args, **extras) or 0)


if __name__ == "__main__":
    sys.exit(main())
