"""`trace-jax serve`: an OpenAI-compatible HTTP API over any checkpoint `trace_jax.models.load_pretrained` reads.

  engine    the batching generation engine (the paged KV cache of `rollout.paged`, requests decoded together in
            slices)
  backend   what a served model is: `ModelBackend` (checkpoint + chat format + engine) or `ScriptedBackend`
  app       the FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health
  server    uvicorn in the foreground or on a background thread (`ServerThread`)
  cli       the `trace-jax serve` command

This package knows nothing about credit assignment, training or the search environment. See docs/serve.md.
"""

from trace_jax.serve.app import ServeConfig, create_app
from trace_jax.serve.backend import GenerationParams, ModelBackend, RequestError, ScriptedBackend
from trace_jax.serve.engine import Engine, EngineConfig, QueueFull
from trace_jax.serve.server import ServerThread, free_port

__all__ = ["Engine", "EngineConfig", "GenerationParams", "ModelBackend", "QueueFull", "RequestError",
           "ScriptedBackend", "ServeConfig", "ServerThread", "create_app", "free_port"]
