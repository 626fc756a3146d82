"""The HTML receipt of one ABC-scored trajectory (`trace-jax abc-score`): the question, gold answer and clues, then
per step its tool call, an observation excerpt, the rubric counts, the step reward, the ABC-SFT weight and the
ABC-GRPO advantage (as a bar), with flagged steps (judge failures scored neutral) marked and their note shown.

All record text is HTML-escaped. This module knows nothing about judges or models; it formats what it is given.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping, Sequence

from trace_jax.scoring.receipts import RECEIPT_STYLE, credit_bar, excerpt, meta_table_rows


def render_abc_receipt(result: Mapping[str, Any], steps: Sequence[Mapping[str, Any]], *, question: str = "",
                       excerpt_chars: int = 160) -> str:
    """HTML for one trajectory.

    Args:
      result: the `abc.jsonl` record (id, answer, clues, counts, step_rewards, sft_weights, advantages, flagged,
        notes).
      steps: per step {"call": str, "observation": str | None, "assistant": str}.
      question: the question text.
    """
    esc = html.escape
    advantages = list(result.get("advantages", []))
    scale = max([abs(a) for a in advantages] or [0.0])
    rows = []
    for k, step in enumerate(steps):
        counts = result["counts"][k]
        flagged = result["flagged"][k]
        note = result["notes"][k]
        what = step.get("call") or excerpt(step.get("assistant", ""), excerpt_chars)
        observation = "" if step.get("observation") is None else excerpt(step["observation"], excerpt_chars)
        mark = f' <span style="color:#c0392b" title="{esc(note)}">&#9873; {esc(note)}</span>' if flagged else ""
        advantage = advantages[k] if k < len(advantages) else 0.0
        rows.append(
            f"<tr><td>{k}</td><td><code>{esc(what)}</code></td><td>{esc(observation)}</td>"
            f"<td>{counts['n_found']}</td><td>{counts['n_excluded']}</td><td>{counts['n_rejected']}</td>"
            f"<td>{counts['ans']:+d}</td><td>{result['step_rewards'][k]:.2f}{mark}</td>"
            f"<td>{result['sft_weights'][k]:.4f}</td><td>{credit_bar(advantage, scale)}</td>"
            f"<td>{advantage:+.4f}</td></tr>")
    clue_rows = "".join(
        f"<tr><td>{i + 1}</td><td>{esc(c.get('kind', ''))}</td><td>{esc(c.get('docid', ''))}</td>"
        f"<td>{esc(c.get('entity', ''))}</td><td>{esc(c.get('relation', ''))}</td><td>{esc(c.get('value', ''))}</td></tr>"
        for i, c in enumerate(result.get("clues", [])))
    meta = [("id", result.get("id")), ("line", result.get("line")), ("question", question),
            ("gold answer", result.get("answer")), ("group", result.get("group")),
            ("clues from", result.get("clue_source")), ("scorer", result.get("scorer")),
            ("flagged steps", sum(result.get("flagged", [])))]
    meta_rows = meta_table_rows(meta)
    title = esc(f"ABC receipt: {result.get('id')}")
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
        f"<style>{RECEIPT_STYLE}</style>"
        f"</head><body><h2>{title}</h2><table class=\"meta\">{meta_rows}</table><h3>Clues</h3>"
        "<table><tr><th>#</th><th>kind</th><th>docid</th><th>entity</th><th>relation</th><th>value</th></tr>"
        f"{clue_rows}</table><h3>Steps</h3>"
        "<table><tr><th>t</th><th>tool call / answer</th><th>observation (excerpt)</th><th>found</th>"
        "<th>excluded</th><th>rejected</th><th>ans</th><th>reward r_t</th><th>SFT weight</th><th>ABC-GRPO</th>"
        "<th></th></tr>" + "".join(rows) + "</table></body></html>\n")


def write_abc_receipt(path: Path, result, steps, *, question: str = "", excerpt_chars: int = 160) -> None:
    path.write_text(render_abc_receipt(result, steps, question=question, excerpt_chars=excerpt_chars),
                    encoding="utf-8")
