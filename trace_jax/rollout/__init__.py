"""Rollouts: the episode rules, the paged rollout engine and the `TrajectoryBatch` they produce.

Public API (see docs/rollout.md):
  TrajectoryBatch, EpisodeRecord, STATUSES, build_batch, EpisodeView, episode_view (batch)
  SamplingConfig, STOP_REASONS, sample_from_logits, StopStrings             (sampler: the sampling rules)
  RolloutConfig, Rollout, run_episodes, ScriptedPolicy                        (agent)
  kv_bytes_per_row                                                            (budget)
  SearchState, search_state, render_record, compacted_context                 (context: context management)
  PagedConfig, PagedState, PageAllocator, paged_attention, the paged programs   (paged: import trace_jax.rollout.paged)
  run_paged_episodes, PagedRollout, EngineStats   (engine: what `run_episodes` runs; import the module)

This package knows nothing about credit assignment or training; it only produces their input.
"""

from trace_jax.rollout.agent import DEFAULT_SYSTEM_PROMPT, Rollout, RolloutConfig, ScriptedPolicy, run_episodes
from trace_jax.rollout.batch import (STATUS_CODES, STATUSES, EpisodeRecord, EpisodeView, TrajectoryBatch, build_batch,
                                     episode_view)
from trace_jax.rollout.budget import kv_bytes_per_row
from trace_jax.rollout.context import SearchState, compacted_context, render_record, search_state
from trace_jax.rollout.sampler import STOP_REASONS, SamplingConfig, StopStrings, sample_from_logits

__all__ = [
    "DEFAULT_SYSTEM_PROMPT", "EpisodeRecord", "EpisodeView", "Rollout", "RolloutConfig", "STATUSES", "STATUS_CODES",
    "STOP_REASONS", "SamplingConfig", "ScriptedPolicy", "SearchState", "StopStrings", "TrajectoryBatch",
    "build_batch", "compacted_context", "episode_view", "kv_bytes_per_row", "render_record", "run_episodes",
    "sample_from_logits", "search_state",
]
