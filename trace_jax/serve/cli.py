"""`trace-jax serve CHECKPOINT`: serve a checkpoint behind the OpenAI API on loopback (see docs/serve.md).

Host code only: argument checking, loading, and handing the app to uvicorn. `--scripted-judge` serves a reply
function this package does not own (ABC's rubric judge): the `trace-jax` dispatcher passes it to `run`
(`trace_jax.abc.cli.serve_extensions`), so this package never imports `trace_jax.abc`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", default=None,
                        help="Hugging Face checkpoint directory (config.json + model.safetensors), anything "
                             "load_pretrained reads")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint directory)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", "--model_name", default=None,
                        help="the id clients pass as `model` (default: the checkpoint directory's name)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key-file", "--api_key_file", default=None, metavar="PATH",
                      help="require 'Authorization: Bearer KEY', KEY read from this file (its first line); the "
                           "way to pass a key, since other users see command lines in `ps`")
    keys.add_argument("--api-key", "--api_key", default=None,
                      help="the key itself (visible in `ps`: prefer --api-key-file or $TRACE_JAX_SERVE_API_KEY; "
                           "default: $TRACE_JAX_SERVE_API_KEY, else no key)")
    parser.add_argument("--allowed-host", "--allowed_host", action="append", default=[], metavar="NAME",
                        help="a Host name a loopback-bound server answers to besides 127.0.0.1, localhost and ::1 "
                             "(repeatable; other names are refused against DNS rebinding)")
    parser.add_argument("--max-body-mib", "--max_body_mib", type=float, default=4.0,
                        help="request bodies larger than this many MiB get a 413")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-batch", "--max_batch", type=int, default=16,
                        help="rows decoded together (concurrency limit)")
    parser.add_argument("--max-queue", "--max_queue", type=int, default=256, help="waiting requests before 429")
    parser.add_argument("--max-context", "--max_context", type=int, default=None,
                        help="tokens per row, prompt + completion (default: min(model maximum, 4096))")
    parser.add_argument("--slice-tokens", "--slice_tokens", type=int, default=16,
                        help="decode steps between admissions of waiting requests")
    parser.add_argument("--no-batching", "--no_batching", action="store_true", help="serve one request at a time")
    parser.add_argument("--batch-wait-ms", "--batch_wait_ms", type=float, default=5.0,
                        help="when idle, wait this long for more requests to batch with the first one")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", "--num_pages", type=int, default=None,
                      help="pages of the KV page pool (default: --max-batch rows of --max-context)")
    pool.add_argument("--kv-budget-gib", "--kv_budget_gib", type=float, default=None,
                      help="size the KV page pool to this many GiB of the device instead")
    parser.add_argument("--page-size", "--page_size", type=int, default=16, help="tokens per page of the KV pool")
    parser.add_argument("--warmup-tokens", "--warmup_tokens", type=int, default=0,
                        help="before serving, compile the prefill of every batch shape for prompts up to this many "
                             "tokens (0: compile each shape when first met)")
    parser.add_argument("--log-level", "--log_level", choices=("critical", "error", "warning", "info", "debug"),
                        default="info", help="uvicorn's log level; 'info' logs every request")
    parser.add_argument("--scripted-judge", "--scripted_judge", action="store_true",
                        help="serve the deterministic rubric judge of ABC (trace_jax.abc) instead of a checkpoint "
                             "(offline dry runs of `trace-jax abc-score` on tasks with known clue chains)")


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or $TRACE_JAX_SERVE_API_KEY (None: no authentication). An empty key
    from any of them is an error: it would otherwise silently mean "no authentication"."""
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as handle:
                key = handle.readline().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--api-key-file {args.api_key_file!r} cannot be read: {error}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key (its first line is empty); write "
                             "the key into it")
        return key
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ValueError("--api-key is empty: an empty key does not turn authentication off; pass a key (better "
                             "with --api-key-file) or leave the flag out")
        return args.api_key
    key = os.environ.get("TRACE_JAX_SERVE_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("$TRACE_JAX_SERVE_API_KEY is set but empty; set a key or unset the variable")
    return key


def run(args: argparse.Namespace, *, scripted_reply: Callable[[dict], Any] | None = None) -> int:
    """`trace-jax serve` (see the module docstring); `scripted_reply` is the reply function `--scripted-judge`
    serves (a `ScriptedBackend` reply)."""
    from trace_jax.serve.app import ServeConfig, create_app
    from trace_jax.serve.backend import ModelBackend, ScriptedBackend
    from trace_jax.serve.engine import EngineConfig

    try:
        api_key = _api_key(args)
        config = ServeConfig(host=args.host, port=args.port, api_key=api_key,
                             max_body_bytes=int(args.max_body_mib * (1 << 20)),
                             allowed_hosts=tuple(args.allowed_host))
    except ValueError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 2
    if args.scripted_judge:
        if scripted_reply is None:
            print("serve: --scripted-judge needs the rubric judge's reply function; run it as `trace-jax serve`, "
                  "which passes it in", file=sys.stderr)
            return 2
        backend = ScriptedBackend(scripted_reply, name=args.model_name or "scripted-judge")
    else:
        if args.checkpoint is None or not os.path.isdir(args.checkpoint):
            print(f"serve: checkpoint {args.checkpoint!r} is not a directory; pass a Hugging Face checkpoint "
                  "directory (config.json + model.safetensors), or --scripted-judge", file=sys.stderr)
            return 2
        try:
            engine = None
            if args.max_context is not None or args.max_batch != 16 or args.no_batching or args.max_queue != 256 \
                    or args.slice_tokens != 16 or args.batch_wait_ms != 5.0 or args.warmup_tokens \
                    or args.num_pages is not None or args.kv_budget_gib is not None or args.page_size != 16:
                from trace_jax.models.config import ModelConfig

                limit = ModelConfig.from_hf(args.checkpoint).max_position_embeddings
                engine = EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                      max_context=args.max_context or min(limit, 4096),
                                      slice_tokens=args.slice_tokens, batching=not args.no_batching,
                                      batch_wait_s=args.batch_wait_ms / 1000, warmup_tokens=args.warmup_tokens,
                                      page_size=args.page_size, num_pages=args.num_pages,
                                      kv_budget_gib=args.kv_budget_gib)
            backend = ModelBackend.from_checkpoint(args.checkpoint, tokenizer_path=args.tokenizer,
                                                   name=args.model_name, dtype=args.dtype, engine=engine)
        except (ValueError, FileNotFoundError, OSError) as error:
            print(f"serve: {error}", file=sys.stderr)
            return 2
    import uvicorn

    if config.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"serve: listening on {config.host}, not loopback: other machines can reach it"
              + ("" if api_key else " and no --api-key is set"), file=sys.stderr)
    print(f"serve: {backend.name} on http://{config.host}:{config.port}/v1", file=sys.stderr)
    uvicorn.run(create_app(backend, config), host=config.host, port=config.port, log_level=args.log_level)
    return 0
