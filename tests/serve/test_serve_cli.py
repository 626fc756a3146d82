"""`trace-jax serve CHECKPOINT` as a real child process on 127.0.0.1, its key in a file: it answers the official
client, and its greedy tool call is the one the in-process server gives."""

import importlib.util
import json
import os
import sys

import openai

from serve_helpers import SEARCH_TOOL, TOOL_ARGUMENTS, TOOL_QUESTION

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serve_bench.py")


def _bench():
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    return bench


def test_serve_command_serves_the_checkpoint_to_the_openai_client(tiny_checkpoint, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")  # the key from a file (a command line shows in `ps`)
    server = _bench().ServeProcess(str(tiny_checkpoint), "--max-context", "512", "--api-key-file", str(key_file))
    try:
        server.wait_ready(timeout=120)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="k3y", timeout=120, max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            reply = client.chat.completions.create(model="tiny", tools=[SEARCH_TOOL], temperature=0, max_tokens=40,
                                                   messages=[{"role": "user", "content": TOOL_QUESTION}])
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "search" and json.loads(call.function.arguments) == TOOL_ARGUMENTS
    finally:
        server.stop()
    assert server.process.returncode is not None  # it shut down when asked


def test_a_page_pool_below_one_row_exits_2_naming_the_fix(tiny_checkpoint, capsys):
    from trace_jax.cli import main

    assert main(["serve", str(tiny_checkpoint), "--max-context", "512", "--num-pages", "3"]) == 2
    assert "num_pages = 3 pages of 16 tokens hold less than one row of max_context = 512" in capsys.readouterr().err
