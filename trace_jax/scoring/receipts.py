"""Human-readable output of `trace-jax credit`: an HTML receipt per trajectory and a PNG plot of credit by turn.

A receipt lists each turn's tool call(s), a short excerpt of the observation it fetched, the value of the state it
led to, its TD and its credit as a coloured bar (green positive, red negative, width relative to the largest
|credit| of the trajectory). All text from the record is HTML-escaped.

This module knows nothing about models or scoring; it formats numbers it is given.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

RECEIPT_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; vertical-align: top; text-align: left; font-size: 13px; }
code { white-space: pre-wrap; word-break: break-all; }
.bar-wrap { width: 160px; background: #f2f2f2; height: 12px; position: relative; }
.bar { height: 12px; position: absolute; top: 0; }
.pos { background: #2a9d4a; left: 50%; } .neg { background: #c0392b; right: 50%; }
.mid { position: absolute; left: 50%; top: 0; width: 1px; height: 12px; background: #888; }
.meta td { border: none; padding: 2px 8px; }
"""


def excerpt(text: str, limit: int) -> str:
    """Whitespace-collapsed text cut to `limit` characters (with an ellipsis when cut)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: max(0, limit - 1)] + "\u2026"


def safe_filename(name: str, suffix: str) -> str:
    """A file name made of [A-Za-z0-9._-] only, so record ids cannot escape the output directory."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._") or "record"
    return f"{stem[:80]}{suffix}"


def meta_table_rows(meta: Sequence[tuple[str, Any]]) -> str:
    """The `<tr>` rows of a receipt's header table, HTML-escaped; a field whose value is None or empty is left out
    (a receipt shows what it knows, never "None")."""
    esc = html.escape
    return "".join(f"<tr><td><b>{esc(str(k))}</b></td><td>{esc(str(v))}</td></tr>" for k, v in meta
                   if v is not None and v != "")


def credit_bar(credit: float, scale: float) -> str:
    width = 0.0 if scale <= 0 else min(50.0, 50.0 * abs(credit) / scale)
    kind = "pos" if credit >= 0 else "neg"
    return (f'<div class="bar-wrap"><div class="bar {kind}" style="width:{width:.1f}%"></div>'
            f'<div class="mid"></div></div>')


def render_receipt(result: Mapping[str, Any], turns: Sequence[Mapping[str, Any]], *, question: str = "") -> str:
    """The HTML receipt of one scored trajectory.

    Args:
      result: the output record (id, answer, reward, estimator, flags, outcome_advantage, answer_scores, values,
        td, turn_credit, turn_advantage); any number may be None (shown as "-"); header fields that are missing or
        None (line, num_turns: then the number of turns given) are left out.
      turns: per tool-calling turn k, {"calls": [str, ...], "observation": str} (already excerpted or not).
      question: the user's question (shown at the top).
    """
    esc = html.escape
    credit = list(result.get("turn_credit") or result.get("turn_advantage") or [])
    scale = max([abs(c) for c in credit if c is not None] or [0.0])
    scores, values, tds = (list(result.get(key) or []) for key in ("answer_scores", "values", "td"))

    def number(values, k, spec):
        value = values[k] if k < len(values) else None
        return "-" if value is None else format(value, spec)

    rows = []
    for k, turn in enumerate(turns):
        calls = "<br>".join(f"<code>{esc(c)}</code>" for c in turn.get("calls", [])) or "<em>(none)</em>"
        r = credit[k] if k < len(credit) else None
        rows.append(
            f"<tr><td>{k}</td><td>{calls}</td><td>{esc(turn.get('observation', ''))}</td>"
            f"<td>{number(scores, k + 1, '.4f')}</td><td>{number(values, k + 1, '.4f')}</td>"
            f"<td>{number(tds, k, '+.4f')}</td><td>{credit_bar(r or 0.0, scale)}</td>"
            f"<td>{number(credit, k, '+.4f')}</td></tr>"
        )
    reward = result.get("reward")
    meta = [
        ("id", result.get("id")), ("line", result.get("line")), ("question", question),
        ("gold answer", result.get("answer")), ("reward", "-" if reward is None else f"{reward:g}"),
        ("estimator", result.get("estimator", "trace")),
        ("outcome advantage", number([result.get("outcome_advantage")], 0, "+.4f")),
        ("tool calls (T)", result.get("num_turns", len(turns))), ("score at S_0", number(scores, 0, ".4f")),
        ("flags", ", ".join(result.get("flags") or []) or "-"),
    ]
    meta_rows = meta_table_rows(meta)
    title = esc(f"Credit receipt: {result.get('id')}")
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
        f"<style>{RECEIPT_STYLE}</style>"
        f"</head><body><h2>{title}</h2><table class=\"meta\">{meta_rows}</table><h3>Turns</h3>"
        "<table><tr><th>k</th><th>tool call</th><th>observation (excerpt)</th><th>score after</th>"
        "<th>V after</th><th>TD</th><th>credit</th><th></th></tr>" + "".join(rows) + "</table></body></html>\n"
    )


def write_receipt(path: Path, result, turns, *, question: str = "") -> None:
    path.write_text(render_receipt(result, turns, question=question), encoding="utf-8")


def plot_credit_by_turn(results: Sequence[Mapping[str, Any]], path: Path) -> None:
    """PNG: each trajectory's turn credit by turn position (dots) and the mean per position (line)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    by_position: dict[int, list[float]] = {}
    rng = np.random.default_rng(0)
    for result in results:
        credit = [c for c in (result.get("turn_credit") or result.get("turn_advantage") or []) if c is not None]
        if not credit:
            continue
        xs = np.arange(len(credit)) + rng.uniform(-0.15, 0.15, len(credit))
        ax.scatter(xs, credit, s=10, alpha=0.5)
        for k, c in enumerate(credit):
            by_position.setdefault(k, []).append(float(c))
    if by_position:
        positions = sorted(by_position)
        ax.plot(positions, [np.mean(by_position[k]) for k in positions], color="black", lw=2, label="mean")
        ax.legend(loc="best")
    ax.axhline(0.0, color="#888", lw=0.8)
    ax.set_xlabel("turn position k (tool call k)")
    estimator = next((r.get("estimator") for r in results if r.get("estimator")), "trace")
    ax.set_ylabel(f"{estimator} turn credit")
    ax.set_title(f"Credit by turn position ({len(results)} trajectories)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
