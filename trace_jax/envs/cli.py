"""`trace-jax make-tasks`: generate a procedural world, its corpus and verified questions (and oracle trajectories).

Writes to ``--out``:
  corpus.jsonl        one ``{docid, url, title, text}`` per line (the world's documents)
  tasks.jsonl         one task per line (``tasks.Task.to_dict``: question, answer, aliases, qtype, hops, clues, ...)
  trajectories.jsonl  with ``--oracle``: one oracle episode per line (OpenAI chat messages + gold answer); with
                      ``--group-size G``, G runs per task sharing a ``group``
  manifest.json       the knobs, the world fingerprint and, with ``--oracle``, the oracle solve rate
  vocabulary.txt      the closed word vocabulary (``oracle.trajectory_vocabulary``), one word per line

This module only parses arguments and writes files; generation lives in world.py, tasks.py and oracle.py.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from trace_jax.envs.oracle import OracleConfig
from trace_jax.envs.tasks import QUESTION_TYPES, TaskConfig, generate_tasks
from trace_jax.envs.world import WorldConfig, build_world


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--num", type=int, default=1000, help="number of questions")
    parser.add_argument("--seed", type=int, default=0, help="question seed (and world seed unless --world-seed)")
    parser.add_argument("--world-seed", "--world_seed", type=int, default=None, help="world seed (default: --seed)")
    world = parser.add_argument_group("world knobs")
    world.add_argument("--corpus-size", "--corpus_size", type=int, default=None,
                       help="about this many entity documents, in fixed type proportions (default: WorldConfig's)")
    world.add_argument("--distractors", type=int, default=WorldConfig.distractors_per_doc,
                       help="distractor sentences per document")
    world.add_argument("--filler", type=int, default=WorldConfig.filler_per_doc, help="filler sentences per document")
    world.add_argument("--deep-fact-prob", "--deep_fact_prob", type=float, default=WorldConfig.deep_fact_prob,
                       help="probability that a fact is placed beyond the first view")
    world.add_argument("--deep-offset", "--deep_offset", type=int, default=WorldConfig.deep_offset,
                       help="filler sentences before deep facts")
    world.add_argument("--lookalike-rate", "--lookalike_rate", type=float, default=WorldConfig.lookalike_rate,
                       help="probability of a name one syllable away from an existing one")
    world.add_argument("--noise-docs", "--noise_docs", type=int, default=WorldConfig.noise_docs,
                       help="extra pages that mention many entities (retrieval noise)")
    questions = parser.add_argument_group("question knobs")
    questions.add_argument("--min-hops", "--min_hops", type=int, default=1)
    questions.add_argument("--max-hops", "--max_hops", type=int, default=4)
    questions.add_argument("--types", default=",".join(QUESTION_TYPES),
                           help=f"comma-separated question types from {','.join(QUESTION_TYPES)}")
    oracle = parser.add_argument_group("oracle")
    oracle.add_argument("--oracle", action="store_true", help="also solve every task and write trajectories.jsonl")
    oracle.add_argument("--detour-prob", "--detour_prob", type=float, default=OracleConfig.detour_prob,
                        help="probability of a wrong click / failed find")
    oracle.add_argument("--snippet-chars", "--snippet_chars", type=int, default=160,
                        help="search result snippet length")
    oracle.add_argument("--view-lines", "--view_lines", type=int, default=30, help="lines per browser view")
    oracle.add_argument("--retrieval-noise", "--retrieval_noise", type=float, default=0.0,
                        help="probability that a search result is replaced by a random page")
    oracle.add_argument("--group-size", "--group_size", type=int, default=1,
                        help="oracle runs per task, each with its own detour and retrieval-noise seed; records of one "
                             "task share a 'group' (for group-relative credit)")
    oracle.add_argument("--max-steps", "--max_steps", type=int, default=OracleConfig.max_steps,
                        help="tool calls after which the oracle gives up (answers 'unknown')")


def _world_config(args: argparse.Namespace) -> WorldConfig:
    knobs = dict(seed=args.seed if args.world_seed is None else args.world_seed,
                 distractors_per_doc=args.distractors, filler_per_doc=args.filler, deep_fact_prob=args.deep_fact_prob,
                 deep_offset=args.deep_offset, lookalike_rate=args.lookalike_rate, noise_docs=args.noise_docs)
    if args.corpus_size is not None:
        return WorldConfig.from_corpus_size(args.corpus_size, **knobs)
    return WorldConfig(**knobs)


def run(args: argparse.Namespace) -> int:
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    try:
        world_config = _world_config(args)
        task_config = TaskConfig(min_hops=args.min_hops, max_hops=args.max_hops,
                                 type_weights=tuple((t, 1.0) for t in types))
    except ValueError as error:
        print(f"make-tasks: {error}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    world = build_world(world_config)
    tasks = generate_tasks(world, args.num, seed=args.seed, config=task_config)
    (out / "corpus.jsonl").write_bytes(world.corpus_jsonl())
    with (out / "tasks.jsonl").open("w", encoding="utf-8") as handle:
        for task in tasks:
            handle.write(task.to_json() + "\n")
    manifest = {"world": world_config.to_dict(), "world_fingerprint": world.fingerprint(),
                "tasks": {"num": len(tasks), "seed": args.seed, "min_hops": args.min_hops, "max_hops": args.max_hops,
                          "types": types},
                "num_documents": len(world.documents)}
    print(f"make-tasks: {len(world.documents)} documents, {len(tasks)} tasks in {time.perf_counter() - start:.1f} s")

    from trace_jax.envs.oracle import group_browsers, solve_group, trajectory_vocabulary

    if args.oracle:
        start = time.perf_counter()
        try:
            config = OracleConfig(detour_prob=args.detour_prob, seed=args.seed, max_steps=args.max_steps)
            browsers = group_browsers(world, args.group_size, retrieval_noise=args.retrieval_noise, seed=args.seed,
                                      snippet_chars=args.snippet_chars, view_lines=args.view_lines)
        except ValueError as error:
            print(f"make-tasks: {error}")
            return 2
        solved = tool_calls = runs = mixed_groups = 0
        with (out / "trajectories.jsonl").open("w", encoding="utf-8") as handle:
            for task in tasks:
                results = solve_group(browsers, task, config)
                mixed_groups += len({r.solved for r in results}) > 1
                for g, result in enumerate(results):
                    solved += result.solved
                    tool_calls += result.num_tool_calls
                    runs += 1
                    record = (result.to_record(record_id=f"{task.task_id}-g{g}", group=task.task_id)
                              if args.group_size > 1 else result.to_record())
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        seconds = time.perf_counter() - start
        rate = solved / max(1, runs)
        manifest["oracle"] = {"solved": solved, "num": runs, "solve_rate": rate,
                              "mean_tool_calls": tool_calls / max(1, runs), "seconds": round(seconds, 2),
                              "detour_prob": args.detour_prob, "snippet_chars": args.snippet_chars,
                              "view_lines": args.view_lines, "retrieval_noise": args.retrieval_noise,
                              "group_size": args.group_size, "max_steps": args.max_steps,
                              "groups_with_mixed_outcomes": mixed_groups}
        print(f"make-tasks: oracle solved {solved}/{runs} ({rate:.2%}), {tool_calls / max(1, runs):.1f} "
              f"tool calls per run, {tool_calls / max(seconds, 1e-9):.0f} tool calls/s, {seconds:.1f} s"
              + (f"; {mixed_groups} of {len(tasks)} groups mix solved and failed runs" if args.group_size > 1 else ""))
    (out / "vocabulary.txt").write_text("\n".join(trajectory_vocabulary()) + "\n", encoding="utf-8")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"make-tasks: wrote {out}")
    return 0
