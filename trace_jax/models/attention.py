"""Attention: one API (`attention`) for every caller, over a mask described by per-query key ranges.

Every mask the models need is a `KeyRanges`: query i of row b may attend key j iff

    key_start[b, i] <= j < key_end[b, i]   and, when segments are given, q_segment[b, i] == k_segment[b, j].

Causal self-attention is `key_end = i + 1`; a KV cache with per-query limits is `key_end = limit`; single-token
decode is `key_end = length + 1`; packed sequences add segments (and `key_start` = the segment's first token, so
tiles before it are skipped); a Hugging Face key-validity mask `[B, S]` is a segment test (invalid keys get a
segment no query has). Only an arbitrary user-supplied boolean `[B, Q, T]` mask is not a `KeyRanges`: it takes
the dense path.

Implementations (`ModelConfig.attention_impl`):
  * "dense": `dense_attention`, the whole score matrix (query-chunked when `attention_query_chunk` is set); the
    test reference.
  * "xla": `flash_attention`, tiles of `q_block x k_block` with an online float32 softmax; a query block visits
    only the key tiles that intersect its rows' ranges. Its backward is flash-style (`jax.custom_vjp`): the
    forward saves the output and the per-row log-sum-exp, the backward recomputes each visited tile's scores and
    skips the tiles the forward skipped.
  * "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` for causal self-attention without segments
    (GPU only); other masks fall back to "xla".
  * "pallas_tpu": the Pallas TPU splash-attention kernel for causal self-attention, with or without segments;
    other masks fall back to "xla".
  * "auto": "cudnn" on GPU, "pallas_tpu" on TPU where they cover the mask, else "xla".

A query with no visible key gets a finite, meaningless output (0 from the tiled kernel, a uniform average from the
dense one). Softmax statistics are float32 whatever the input dtype.

This module knows nothing about layers, parameters, caches or sampling.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from trace_jax.models.config import ATTENTION_IMPLS as IMPLEMENTATIONS  # noqa: E402  (one list of names)

_NEG_INF = -1e30  # finite, so fully masked rows stay finite


class KeyRanges(NamedTuple):
    """A mask given by key ranges per query (see the module doc). Shapes: key_start, key_end int [B, Q];
    q_segment int [B, Q] and k_segment int [B, T] (both or neither). key_start None means 0."""

    key_end: jax.Array
    key_start: jax.Array | None = None
    q_segment: jax.Array | None = None
    k_segment: jax.Array | None = None

    def dense(self, num_keys: int) -> jax.Array:
        """The boolean [B, Q, T] mask these ranges describe."""
        j = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]
        mask = j < self.key_end[:, :, None]
        if self.key_start is not None:
            mask &= j >= self.key_start[:, :, None]
        if self.q_segment is not None:
            mask &= self.q_segment[:, :, None] == self.k_segment[:, None, :]
        return mask


def causal_ranges(batch: int, length: int, *, segment_ids=None, key_valid=None) -> KeyRanges:
    """`KeyRanges` of causal self-attention over [B, S] tokens, optionally packed (`segment_ids [B, S]`, contiguous
    or not) and with a Hugging Face key-validity mask (`key_valid` bool [B, S], False = padding key)."""
    key_end = jnp.broadcast_to(jnp.arange(1, length + 1, dtype=jnp.int32), (batch, length))
    if segment_ids is None and key_valid is None:
        return KeyRanges(key_end)
    q_seg = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    k_seg = q_seg
    key_start = None
    if segment_ids is not None:
        # First index of each query's run of equal segment ids: tiles before it hold no key of its segment when
        # segments are contiguous, and skipping them is then exact; non-contiguous ids keep key_start = 0.
        idx = jnp.arange(length, dtype=jnp.int32)
        new_run = jnp.concatenate([jnp.ones((batch, 1), bool), q_seg[:, 1:] != q_seg[:, :-1]], axis=1)
        run_start = jax.lax.cummax(jnp.where(new_run, idx, 0), axis=1)
        contiguous = jnp.all(jnp.sum(new_run, axis=1) == _num_distinct(q_seg), axis=0)
        key_start = jnp.where(contiguous, run_start, 0)
    if key_valid is not None:
        k_seg = jnp.where(key_valid.astype(bool), k_seg, jnp.iinfo(jnp.int32).min)
    return KeyRanges(key_end, key_start, q_seg, k_seg)


def _num_distinct(x):  # per row, for contiguity: a row is contiguous iff #runs == #distinct values
    s = jnp.sort(x, axis=1)
    return 1 + jnp.sum(s[:, 1:] != s[:, :-1], axis=1)


# ---------------------------------------------------------------------------------------------------- dense
def dense_attention(q, k, v, mask, *, query_chunk: int = 0, block=None):
    """Reference grouped-query attention. q [B, Q, H, Dh]; k, v [B, T, K, Dh]; mask bool [B, Q, T] (True = may
    attend) or a function `(q_start, q_len) -> [B, q_len, T]`. `block`: optional `(k2, v2, mask2)`, more keys
    `[B, T2, K, Dh]` under a boolean `mask2 [B, Q, T2]`, in the same softmax (no concatenated copy of k). With
    `query_chunk` < Q, queries run in blocks under `lax.map` (score memory [B, H, chunk, T + T2]).
    Returns [B, Q, H, Dh] in v's dtype."""
    B, Q = q.shape[:2]
    rows = mask if callable(mask) else (lambda start, size: jax.lax.dynamic_slice_in_dim(mask, start, size, 1))

    def parts(start, size):
        main = [(k, v, rows(start, size))]
        if block is None:
            return main
        k2, v2, mask2 = block
        return main + [(k2, v2, jax.lax.dynamic_slice_in_dim(mask2.astype(bool), start, size, 1))]

    if not query_chunk or Q <= query_chunk:
        return _dense_block(q, parts(0, Q))
    c = query_chunk
    n, rest = divmod(Q, c)
    qs = jnp.moveaxis(q[:, :n * c].reshape(B, n, c, *q.shape[2:]), 1, 0)
    out = jax.lax.map(lambda iq: _dense_block(iq[1], parts(iq[0] * c, c)), (jnp.arange(n), qs))
    out = jnp.moveaxis(out, 0, 1).reshape(B, n * c, *q.shape[2:])
    if rest:
        out = jnp.concatenate([out, _dense_block(q[:, n * c:], parts(n * c, rest))], axis=1)
    return out


# At most this many queries (single-token decode), `_dense_block` runs `_dense_block_few`: plain batched dots over
# the keys and values in their cached [B, T, K, Dh] layout, read as [B, T*K, Dh] and [B, T, K*Dh] without a copy.
# A dot with the KV heads as a batch dimension (the form above) makes XLA CPU first copy the cache into a
# [B, K, T, Dh] layout; a broadcast-multiply-reduce avoided the copy but runs as a slow reduction (measured on
# SmolLM2's 30 layers, 4 rows, 544 slots: 36 ms against 22 ms for `_dense_block_few`).
REDUCE_QUERIES = 2


def _dense_block(q, parts):
    """parts: [(k [B, T, K, Dh], v, mask bool [B, Q, T]), ...], one softmax over all of their keys."""
    B, Q, H, Dh = q.shape
    K = parts[0][0].shape[2]
    v_dtype = parts[0][1].dtype
    qg = (q * jnp.asarray(Dh ** -0.5, q.dtype)).reshape(B, Q, K, H // K, Dh)
    if Q <= REDUCE_QUERIES:
        return _dense_block_few(qg, parts).astype(v_dtype).reshape(B, Q, H, Dh)
    scores = [jnp.where(mask[:, None, None, :, :],
                        jnp.einsum("bqkgd,btkd->bkgqt", qg, k, preferred_element_type=jnp.float32), _NEG_INF)
              for k, _, mask in parts]
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    probs = [jnp.exp(s - top) for s in scores]
    denom = sum(jnp.sum(p, axis=-1) for p in probs)  # [B, K, G, Q]; normalising after the value product is cheaper
    out = sum(jnp.einsum("bkgqt,btkd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
              for p, (_, v, _) in zip(probs, parts))
    out = out / jnp.transpose(denom, (0, 3, 1, 2))[..., None]
    return out.astype(v_dtype).reshape(B, Q, H, Dh)


def _dense_block_few(qg, parts):
    """`_dense_block` for a few queries: float32 [B, Q, K, G, Dh] from qg [B, Q, K, G, Dh] (scaled).

    Every query head is scored against every KV head's keys in one batched dot ([B, Q*K*G, Dh] x [B, T*K, Dh]),
    and each head keeps its own group's block (a diagonal); the value product likewise. K times the minimal
    arithmetic and score memory ([B, Q*H, T*K]), for reading the cache once, in place, with no transposed copy.
    """
    B, Q, K, G, Dh = qg.shape
    qs = qg.reshape(B, Q * K * G, Dh)
    scores = []
    for k, _, mask in parts:
        T = k.shape[1]
        s = jnp.einsum("bqd,bsd->bqs", qs.astype(k.dtype), k.reshape(B, T * K, Dh),
                       preferred_element_type=jnp.float32).reshape(B, Q, K, G, T, K)
        s = jnp.moveaxis(jnp.diagonal(s, axis1=2, axis2=5), -1, 2)  # [B, Q, K, G, T]: query head k x key head k
        scores.append(jnp.where(mask[:, :, None, None, :], s, _NEG_INF))
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    probs = [jnp.exp(s - top) for s in scores]
    denom = sum(jnp.sum(p, axis=-1) for p in probs)  # [B, Q, K, G]
    out = 0.0
    for p, (_, v, _) in zip(probs, parts):
        T = v.shape[1]
        o = jnp.einsum("bqt,btd->bqd", p.reshape(B, Q * K * G, T).astype(v.dtype), v.reshape(B, T, K * Dh),
                       preferred_element_type=jnp.float32).reshape(B, Q, K, G, K, Dh)
        out = out + jnp.moveaxis(jnp.diagonal(o, axis1=2, axis2=4), -1, 2)  # [B, Q, K, G, Dh]
    return out / denom[..., None]


# ---------------------------------------------------------------------------------------------------- tiled
def default_q_block(head_dim: int) -> int:
    """Query rows per tile when the config leaves it automatic: measured on the 2-core CPU, narrow heads
    (head_dim <= 32) do best with 32 rows, wider ones with 128."""
    return 32 if head_dim <= 32 else 128


def flash_attention(q, k, v, ranges: KeyRanges, *, q_block: int = 0, k_block: int = 128, block=None,
                    block_band: int | None = None):
    """Tiled attention over `ranges` with a flash-style backward. q [B, Q, H, Dh]; k, v [B, T, K, Dh].

    Query blocks of `q_block` rows (0: `default_q_block`) run under `lax.map`; each walks only the key tiles
    `[min key_start, max key_end)` of its rows (a `while_loop`, so skipped tiles cost nothing), keeping float32
    running max / sum / output. Work is about `sum_i (key_end[i] - key_start[i])` scores. Returns [B, Q, H, Dh].

    `block`: optional `(k2, v2, mask2)`: more keys `[B, T2, K, Dh]` attended under a boolean `mask2 [B, Q, T2]`
    in the same softmax (a query block's own new tokens next to a cache: `cache.extend`, `attend_cached_block`).
    Each query block scores them densely before walking its tiles. `block_band` (static) promises
    `mask2[b, i, j]` is False whenever `|i - j| >= block_band` (needs T2 == Q): each query block then scores only
    the `q_block + 2 (block_band - 1)` block keys around it. Gradients flow to k2 and v2 too.
    """
    B, Q, H, Dh = q.shape
    T = k.shape[1]
    qb = min(q_block or default_q_block(Dh), Q)
    kb = min(k_block, T) if T else 1
    key_start = jnp.zeros((B, Q), jnp.int32) if ranges.key_start is None else ranges.key_start.astype(jnp.int32)
    key_end = jnp.minimum(ranges.key_end.astype(jnp.int32), T)
    segments = ranges.q_segment is not None
    q_seg = ranges.q_segment.astype(jnp.int32) if segments else jnp.zeros((B, Q), jnp.int32)
    k_seg = ranges.k_segment.astype(jnp.int32) if segments else jnp.zeros((B, T), jnp.int32)
    k2 = v2 = mask2 = None
    if block is not None:
        k2, v2, mask2 = block
        mask2 = mask2.astype(bool)
        if block_band and k2.shape[1] != Q:
            raise ValueError(f"block_band needs as many block keys as queries, got {k2.shape[1]} and {Q}")
    return _flash(q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, qb, kb, segments,
                  block_band if block is not None else None)


def _tiles(q, k, v, key_start, key_end, q_seg, k_seg, qb, kb):
    """Pad to whole tiles and lay queries out block-major. Padded queries see nothing; padded keys nobody."""
    B, Q, H, Dh = q.shape
    T, K = k.shape[1], k.shape[2]
    nq, nk = -(-Q // qb), -(-T // kb)
    pq, pk = nq * qb - Q, nk * kb - T
    qs = (q * jnp.asarray(Dh ** -0.5, q.dtype)).reshape(B, Q, K, H // K, Dh)
    qs = jnp.pad(qs, ((0, 0), (0, pq), (0, 0), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, pk), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pk), (0, 0), (0, 0)))
    key_start = jnp.pad(key_start, ((0, 0), (0, pq)), constant_values=T)
    key_end = jnp.pad(key_end, ((0, 0), (0, pq)))
    q_seg = jnp.pad(q_seg, ((0, 0), (0, pq)))
    k_seg = jnp.pad(k_seg, ((0, 0), (0, pk)))
    block = lambda x: jnp.moveaxis(x.reshape(B, nq, qb, *x.shape[2:]), 1, 0)  # noqa: E731
    return block(qs), k, v, block(key_start), block(key_end), block(q_seg), k_seg, nq, nk


def _block_keys(k2, v2, mask2, Q, nq, qb, band):
    """Pad the block keys for per-query-block windows. Returns (k2, v2, mask2, width, window_start(index))."""
    pq = nq * qb - Q
    mask2 = jnp.pad(mask2, ((0, 0), (0, pq), (0, 0)))
    if not band:
        return k2, v2, mask2, k2.shape[1], lambda index: 0
    # Padding so every block's window [start - band + 1, start + qb + band - 1) is in range.
    pads = (band - 1, band - 1 + pq)
    k2 = jnp.pad(k2, ((0, 0), pads, (0, 0), (0, 0)))
    v2 = jnp.pad(v2, ((0, 0), pads, (0, 0), (0, 0)))
    return k2, v2, jnp.pad(mask2, ((0, 0), (0, 0), pads)), qb + 2 * (band - 1), lambda index: index * qb


def _block_window(k2, v2, mask2, width, start, index, qb):
    """The block keys, values and mask rows [B, qb, width] one query block scores."""
    rows = jax.lax.dynamic_slice_in_dim(mask2, index * qb, qb, axis=1)
    window = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, width, axis=axis)  # noqa: E731
    return window(k2, 1), window(v2, 1), window(rows, 2)


def _tile_range(starts, ends, kb, nk):
    """The key tiles [lo, hi) a query block must visit (rows with an empty range do not widen it)."""
    live = ends > starts
    lo = jnp.min(jnp.where(live, starts, jnp.iinfo(jnp.int32).max)) // kb
    hi = jnp.minimum((jnp.max(jnp.where(live, ends, 0)) + kb - 1) // kb, nk)
    return jnp.minimum(lo, hi), hi


def _visible(j, kb, starts, ends, qsg, k_seg, segments):
    """bool [B, qb, kb]: which keys of tile j each query of the block sees."""
    idx = j * kb + jnp.arange(kb, dtype=jnp.int32)
    vis = (idx[None, None, :] >= starts[:, :, None]) & (idx[None, None, :] < ends[:, :, None])
    if segments:
        ks = jax.lax.dynamic_slice_in_dim(k_seg, j * kb, kb, axis=1)
        vis &= qsg[:, :, None] == ks[:, None, :]
    return vis


def _flash_forward(q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, qb, kb, segments, band):
    B, Q, H, Dh = q.shape
    K = k.shape[2]
    G = H // K
    qs, kp, vp, starts, ends, qsegs, k_seg_p, nq, nk = _tiles(q, k, v, key_start, key_end, q_seg, k_seg, qb, kb)
    if k2 is not None:
        k2p, v2p, mask2p, width, window_start = _block_keys(k2, v2, mask2, Q, nq, qb, band)

    def query_block(xs):
        index, qi, st, en, qsg = xs  # qi [B, qb, K, G, Dh]
        lo, hi = _tile_range(st, en, kb, nk)
        m = jnp.full((B, K, G, qb), _NEG_INF, jnp.float32)
        l = jnp.zeros((B, K, G, qb), jnp.float32)
        o = jnp.zeros((B, K, G, qb, Dh), jnp.float32)
        if k2 is not None:  # the block keys first, densely: they seed the running statistics
            kw, vw, rows = _block_window(k2p, v2p, mask2p, width, window_start(index), index, qb)
            vis = rows[:, None, None]
            s = jnp.where(vis, jnp.einsum("bqkgd,btkd->bkgqt", qi, kw, preferred_element_type=jnp.float32),
                          _NEG_INF)
            m = jnp.max(s, axis=-1)
            p = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
            l = jnp.sum(p, axis=-1)
            o = jnp.einsum("bkgqt,btkd->bkgqd", p.astype(vw.dtype), vw, preferred_element_type=jnp.float32)

        def tile(carry):
            j, m, l, o = carry
            kj = jax.lax.dynamic_slice_in_dim(kp, j * kb, kb, axis=1)
            vj = jax.lax.dynamic_slice_in_dim(vp, j * kb, kb, axis=1)
            s = jnp.einsum("bqkgd,btkd->bkgqt", qi, kj, preferred_element_type=jnp.float32)
            vis = _visible(j, kb, st, en, qsg, k_seg_p, segments)[:, None, None]
            s = jnp.where(vis, s, _NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
            scale = jnp.exp(m - m_new)
            o = o * scale[..., None] + jnp.einsum("bkgqt,btkd->bkgqd", p.astype(vj.dtype), vj,
                                                  preferred_element_type=jnp.float32)
            return j + 1, m_new, l * scale + jnp.sum(p, axis=-1), o

        _, m, l, o = jax.lax.while_loop(lambda c: c[0] < hi, tile, (lo, m, l, o))
        seen = l > 0
        o = o / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)  # inf: backward gives p = 0
        return o, lse

    o, lse = jax.lax.map(query_block, (jnp.arange(nq), qs, starts, ends, qsegs))  # [nq, B, K, G, qb, Dh], [.., qb]
    out = jnp.transpose(o, (1, 0, 4, 2, 3, 5)).reshape(B, nq * qb, H, Dh)[:, :Q].astype(v.dtype)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13))
def _flash(q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, qb, kb, segments, band):
    return _flash_forward(q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, qb, kb, segments, band)[0]


def _flash_fwd(q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, qb, kb, segments, band):
    out, lse = _flash_forward(q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, qb, kb, segments, band)
    return out, (q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, out, lse)


def _flash_bwd(qb, kb, segments, band, res, d_out):
    """dq, dk, dv by recomputing each visited tile: p = exp(s - lse), dv += p^T dO, dp = dO V^T,
    ds = p (dp - rowsum(dO * O)), dq += ds K, dk += ds^T q (q pre-scaled, so dq picks up the scale).
    The block keys, when given, are recomputed the same way once per query block."""
    q, k, v, k2, v2, mask2, key_start, key_end, q_seg, k_seg, out, lse = res
    B, Q, H, Dh = q.shape
    T, K = k.shape[1], k.shape[2]
    G = H // K
    qs, kp, vp, starts, ends, qsegs, k_seg_p, nq, nk = _tiles(q, k, v, key_start, key_end, q_seg, k_seg, qb, kb)
    pq = nq * qb - Q
    to_blocks = lambda x: jnp.moveaxis(  # noqa: E731  [B, Q, H, Dh] -> [nq, B, K, G, qb, Dh]
        jnp.pad(x, ((0, 0), (0, pq), (0, 0), (0, 0))).reshape(B, nq, qb, K, G, Dh), 1, 0).transpose(0, 1, 3, 4, 2, 5)
    dos = to_blocks(d_out.astype(jnp.float32))
    delta = jnp.sum(dos * to_blocks(out.astype(jnp.float32)), axis=-1)  # [nq, B, K, G, qb]
    if k2 is not None:
        k2p, v2p, mask2p, width, window_start = _block_keys(k2, v2, mask2, Q, nq, qb, band)

    def query_block(carry, xs):
        dk, dv, dk2, dv2 = carry
        index, qi, st, en, qsg, do, dl, ls = xs
        lo, hi = _tile_range(st, en, kb, nk)
        do_c = do.astype(v.dtype)
        dq = jnp.zeros((B, qb, K, G, Dh), jnp.float32)
        if k2 is not None:
            start = window_start(index)
            kw, vw, rows = _block_window(k2p, v2p, mask2p, width, start, index, qb)
            s = jnp.einsum("bqkgd,btkd->bkgqt", qi, kw, preferred_element_type=jnp.float32)
            p = jnp.where(rows[:, None, None], jnp.exp(s - ls[..., None]), 0.0)
            dp = jnp.einsum("bkgqd,btkd->bkgqt", do_c, vw, preferred_element_type=jnp.float32)
            ds = p * (dp - dl[..., None])
            dvw = jnp.einsum("bkgqt,bkgqd->btkd", p.astype(v2.dtype), do_c, preferred_element_type=jnp.float32)
            dkw = jnp.einsum("bkgqt,bqkgd->btkd", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32)
            dq = jnp.einsum("bkgqt,btkd->bqkgd", ds.astype(k2.dtype), kw, preferred_element_type=jnp.float32)
            dk2 = jax.lax.dynamic_update_slice_in_dim(
                dk2, jax.lax.dynamic_slice_in_dim(dk2, start, width, axis=1) + dkw, start, axis=1)
            dv2 = jax.lax.dynamic_update_slice_in_dim(
                dv2, jax.lax.dynamic_slice_in_dim(dv2, start, width, axis=1) + dvw, start, axis=1)

        def tile(c):
            j, dq, dk, dv = c
            kj = jax.lax.dynamic_slice_in_dim(kp, j * kb, kb, axis=1)
            vj = jax.lax.dynamic_slice_in_dim(vp, j * kb, kb, axis=1)
            s = jnp.einsum("bqkgd,btkd->bkgqt", qi, kj, preferred_element_type=jnp.float32)
            vis = _visible(j, kb, st, en, qsg, k_seg_p, segments)[:, None, None]
            p = jnp.where(vis, jnp.exp(s - ls[..., None]), 0.0)
            dp = jnp.einsum("bkgqd,btkd->bkgqt", do_c, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - dl[..., None])
            dvj = jnp.einsum("bkgqt,bkgqd->btkd", p.astype(v.dtype), do_c, preferred_element_type=jnp.float32)
            dkj = jnp.einsum("bkgqt,bqkgd->btkd", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32)
            dq = dq + jnp.einsum("bkgqt,btkd->bqkgd", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32)
            dk = jax.lax.dynamic_update_slice_in_dim(
                dk, jax.lax.dynamic_slice_in_dim(dk, j * kb, kb, axis=1) + dkj, j * kb, axis=1)
            dv = jax.lax.dynamic_update_slice_in_dim(
                dv, jax.lax.dynamic_slice_in_dim(dv, j * kb, kb, axis=1) + dvj, j * kb, axis=1)
            return j + 1, dq, dk, dv

        _, dq, dk, dv = jax.lax.while_loop(lambda c: c[0] < hi, tile, (lo, dq, dk, dv))
        return (dk, dv, dk2, dv2), dq

    zeros = jnp.zeros((B, nk * kb, K, Dh), jnp.float32)
    zeros2 = None if k2 is None else jnp.zeros(k2p.shape, jnp.float32)
    (dk, dv, dk2, dv2), dq = jax.lax.scan(query_block, (zeros, zeros, zeros2, zeros2),
                                          (jnp.arange(nq), qs, starts, ends, qsegs, dos, delta, lse))
    dq = jnp.moveaxis(dq, 0, 1).reshape(B, nq * qb, H, Dh)[:, :Q] * (Dh ** -0.5)
    grads = (dq.astype(q.dtype), dk[:, :T].astype(k.dtype), dv[:, :T].astype(v.dtype))
    if k2 is None:
        return grads + (None,) * 7
    lead = band - 1 if band else 0
    T2 = k2.shape[1]
    return grads + (dk2[:, lead:lead + T2].astype(k2.dtype), dv2[:, lead:lead + T2].astype(v2.dtype)) + (None,) * 5


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------------- platform
def _cudnn_causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _pallas_tpu_causal(q, k, v, segment_ids, *, q_block: int, k_block: int):
    """Splash attention (Pallas TPU) for causal self-attention; segment_ids [B, S] or None.

    The Mosaic kernel is per-device: GSPMD cannot partition it. Under a mesh set with `jax.set_mesh` (the train
    step and the reference scorer trace their programs under their mesh) it runs inside `jax.shard_map`, rows
    split over the mesh axes of the "batch" rule and heads over those of "heads" (`sharding.DEFAULT_RULES`:
    data/fsdp/expert and tensor; an axis that does not divide the dimension is dropped, so that dimension is
    replicated over it), each device running the kernel on its own rows and heads. Without a mesh (one device)
    it runs as is.
    """
    from trace_jax.models.sharding import logical_to_mesh_spec

    B, S, H, Dh = q.shape
    K = k.shape[2]
    qh = jnp.transpose(q * jnp.asarray(Dh ** -0.5, q.dtype), (0, 2, 1, 3))  # [B, H, S, Dh]
    kh, vh = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
    if K not in (1, H):  # grouped-query: repeat keys and values per query head (then heads shard like q's)
        kh, vh = jnp.repeat(kh, H // K, axis=1), jnp.repeat(vh, H // K, axis=1)
    if K == 1:  # multi-query: one key/value head, replicated over the head shards
        kh, vh = kh[:, 0], vh[:, 0]
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    kernel = functools.partial(_splash_local, q_block=q_block, k_block=k_block, mqa=K == 1)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        out = kernel(qh, kh, vh, seg)
    else:
        spec = logical_to_mesh_spec(jax.sharding.PartitionSpec("batch", "heads", None, None), mesh, shape=qh.shape)
        P = jax.sharding.PartitionSpec
        rows = spec[0]
        kv_spec = P(rows, None, None) if K == 1 else spec
        seg_spec = None if seg is None else P(rows, None)
        out = jax.shard_map(kernel, mesh=mesh, in_specs=(spec, kv_spec, kv_spec, seg_spec), out_specs=spec,
                            check_vma=False)(qh, kh, vh, seg)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(v.dtype)


def _splash_local(qh, kh, vh, seg, *, q_block: int, k_block: int, mqa: bool):
    """The splash kernel over one device's rows and heads: qh [b, h, S, Dh]; kh, vh [b, h, S, Dh] (or [b, S, Dh]
    when `mqa`); seg int32 [b, S] or None. Returns [b, h, S, Dh]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    _, H, S, _ = qh.shape
    bq, bk = min(q_block or 128, S), min(k_block or 128, S)
    mask = sm.MultiHeadMask([sm.CausalMask((S, S)) for _ in range(H)])
    sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes) if mqa else \
        sk.make_splash_mha_single_device(mask, block_sizes=sizes)
    segments = None if seg is None else sk.SegmentIds(q=seg, kv=seg)
    return jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=s))(qh, kh, vh, segments)


# Below this many queries (single-token decode, short appends) one dense pass over the keys beats walking tiles:
# measured on SmolLM2-135M decode (4 rows, 1024-slot cache, 2-core CPU) at 153 ms/step dense vs 300 ms tiled.
FEW_QUERIES = 16


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """The implementation "auto" means on `platform` (default: the default backend)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    return {"gpu": "cudnn", "cuda": "cudnn", "tpu": "pallas_tpu"}.get(platform, "xla")


def attention(q, k, v, mask, *, impl: str = "auto", q_block: int = 0, k_block: int = 128, query_chunk: int = 0,
              self_attention: bool = False, segment_ids=None, block=None, block_band: int | None = None):
    """Grouped-query attention, the one entry point. q [B, Q, H, Dh]; k, v [B, T, K, Dh] -> [B, Q, H, Dh].

    mask: a `KeyRanges` (every mask the models build) or a boolean [B, Q, T] array / row function (a user mask:
    always the dense path). On "xla", fewer than `FEW_QUERIES` queries (decode) also take the dense path.
    `self_attention=True` says q and k are the same tokens with purely causal ranges
    (plus `segment_ids` when packed): only then can "cudnn" and "pallas_tpu" run; otherwise they fall back to
    "xla". `query_chunk` bounds the dense path's score memory; `q_block`/`k_block` are the tiles.

    `block`: optional `(k2, v2, mask2)`: more keys `[B, T2, K, Dh]` under a boolean `mask2 [B, Q, T2]`, merged
    into the same softmax (a KV cache's new tokens next to its cached keys; an answer block next to a cached
    prefix), with optional static `block_band` (see `flash_attention`). Only the "xla" and "dense" paths take it.
    """
    impl = resolve_impl(impl)
    few_queries = q.shape[1] < FEW_QUERIES
    if block is not None and not isinstance(mask, KeyRanges):
        raise ValueError("attention: `block` keys need a KeyRanges mask for the main keys")
    if not isinstance(mask, KeyRanges) or impl == "dense" or (impl == "xla" and few_queries):
        dense = mask.dense(k.shape[1]) if isinstance(mask, KeyRanges) else mask
        return dense_attention(q, k, v, dense, query_chunk=query_chunk, block=block)
    if impl == "cudnn" and self_attention and segment_ids is None and block is None:
        return _cudnn_causal(q, k, v)
    if impl == "pallas_tpu" and self_attention and block is None:
        return _pallas_tpu_causal(q, k, v, segment_ids, q_block=q_block, k_block=k_block)
    return flash_attention(q, k, v, mask, q_block=q_block, k_block=k_block, block=block, block_band=block_band)
