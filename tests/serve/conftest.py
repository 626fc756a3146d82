"""A tiny served model for the serve tests: a random tiny Qwen3 with a word tokenizer, trained for a few seconds to
answer one tool-using prompt with a `search` call, saved as a checkpoint and served on 127.0.0.1 with a free port."""

import jax
import jax.numpy as jnp
import optax
import pytest

from trace_jax import models
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer

from serve_helpers import SEARCH_TOOL, TOOL_ARGUMENTS, TOOL_QUESTION, WORDS


def _memorise(config, params, sequence, start, steps=150):
    """Fit the model to `sequence[start:]` given its prefix (so greedy decoding of the prefix reproduces it)."""
    tokens = jnp.asarray([sequence], jnp.int32)
    mask = jnp.zeros(tokens.shape, jnp.float32).at[0, start - 1:len(sequence) - 1].set(1.0)

    def loss(p):
        return -(models.token_logprobs(config, p, tokens) * mask).sum() / mask.sum()

    optimizer = optax.adam(3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(p, s):
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    for _ in range(steps):
        params, state, value = step(params, state)
    assert float(value) < 0.05, f"the tiny model did not memorise the tool call (loss {float(value):.3f})"
    return params


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """(directory, tool prompt messages, expected tool-call continuation ids) of the served tiny model."""
    directory = tmp_path_factory.mktemp("serve_tiny")
    build_word_tokenizer(WORDS, directory)
    tokenizer = load_tokenizer(directory)
    chat = ChatFormat(tokenizer)
    config = models.get_preset("tiny-qwen3", vocab_size=-(-len(tokenizer) // 64) * 64, max_position_embeddings=512)
    params = models.init_params(config, jax.random.PRNGKey(0))
    messages = [{"role": "user", "content": TOOL_QUESTION}]
    prompt = chat.render(messages, tools=[SEARCH_TOOL]).ids
    answer = chat.assistant_content_ids(None, [{"name": "search", "arguments": TOOL_ARGUMENTS}]) + [chat.im_end_id]
    params = _memorise(config, params, prompt + answer, len(prompt))
    models.save_pretrained(directory, config, params)
    return directory


@pytest.fixture(scope="session")
def served(tiny_checkpoint):
    """A running server on the tiny checkpoint: (base_url, backend). Shut down when the session ends."""
    from trace_jax.serve import EngineConfig, ModelBackend, ServeConfig, ServerThread, create_app

    backend = ModelBackend.from_checkpoint(str(tiny_checkpoint), name="tiny",
                                           engine=EngineConfig(max_batch=8, max_context=512, max_queue=64))
    server = ServerThread(create_app(backend, ServeConfig()), "127.0.0.1").start(timeout=60)
    try:
        yield server.url, backend
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(served):
    import openai

    url, _ = served
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0) as api:
        yield api

