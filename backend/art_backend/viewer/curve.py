"""The reward curve: mean reward per step, one line per split, drawn as inline SVG on the
server (the viewer fetches no script or stylesheet from anywhere)."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

from art_backend.viewer.store import finite

# Fixed colours per split, so train and val look the same on every page (and a test can find them).
SPLIT_COLOURS = {"train": "#2563eb", "val": "#ea580c"}
_OTHER_COLOURS = ["#16a34a", "#9333ea", "#0891b2", "#be123c"]


def split_colour(split: str, splits: list[str]) -> str:
    if split in SPLIT_COLOURS:
        return SPLIT_COLOURS[split]
    others = [s for s in splits if s not in SPLIT_COLOURS]
    return _OTHER_COLOURS[others.index(split) % len(_OTHER_COLOURS)] if split in others else _OTHER_COLOURS[0]


@dataclass(frozen=True)
class RewardPoint:
    step: int
    reward: float
    trajectories: int


def reward_series(history: list[dict[str, Any]]) -> dict[str, list[RewardPoint]]:
    """Mean reward per (split, step) from the history records. A split logged several times at
    one step (several `model.log` calls) has one record per call; their means are combined
    weighted by trajectory count, which is the mean over all of that step's trajectories."""
    totals: dict[str, dict[int, tuple[float, int]]] = {}
    for record in history:
        mean, count = finite(record.get("reward/mean")), record.get("trajectories")
        if mean is None or not isinstance(count, int) or count <= 0:
            continue
        reward_sum, trajectories = totals.setdefault(record["split"], {}).get(record["step"], (0.0, 0))
        totals[record["split"]][record["step"]] = (reward_sum + mean * count, trajectories + count)
    ordered = sorted(totals, key=lambda split: (split != "train", split))
    return {split: [RewardPoint(step, total / count, count) for step, (total, count) in sorted(totals[split].items())]
            for split in ordered}


def _ticks(low: float, high: float, count: int) -> list[float]:
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def _step_ticks(first: int, last: int) -> list[int]:
    span = last - first
    stride = max(1, -(-span // 10))  # at most about 10 labels
    return list(range(first, last + 1, stride))


def reward_curve_svg(series: dict[str, list[RewardPoint]], marked_step: int | None = None,
                     width: int = 720, height: int = 260) -> str:
    """The SVG markup (escaped here; safe to insert as is). `marked_step` draws a vertical line,
    the step a page is about."""
    points = [p for ps in series.values() for p in ps]
    if not points:
        return ('<p class="empty">No reward recorded yet: the curve appears after the first '
                '<code>model.train()</code> or <code>model.log()</code>.</p>')
    left, right, top, bottom = 56, 110, 14, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    steps = [p.step for p in points] + ([marked_step] if marked_step is not None else [])
    first, last = min(steps), max(steps)
    rewards = [p.reward for p in points]
    low, high = min(rewards), max(rewards)
    if 0.0 <= low and high <= 1.0:  # the usual reward range: keep the scale fixed across pages
        low, high = 0.0, 1.0
    elif high - low < 1e-9:
        low, high = low - 0.5, high + 0.5

    def x(step: float) -> float:
        return left + (plot_w / 2 if last == first else (step - first) / (last - first) * plot_w)

    def y(reward: float) -> float:
        return top + (high - reward) / (high - low) * plot_h

    parts = [(f'<svg class="curve" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
              f'xmlns="http://www.w3.org/2000/svg"><title>mean reward per step and split</title>')]
    for value in _ticks(low, high, 5):
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}" class="grid"/>'
                     f'<text x="{left - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.2f}</text>')
    for step in _step_ticks(first, last):
        parts.append(f'<text x="{x(step):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{step}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 2}" text-anchor="middle" class="axis">step</text>')
    if marked_step is not None:
        parts.append(f'<line x1="{x(marked_step):.1f}" x2="{x(marked_step):.1f}" y1="{top}" y2="{top + plot_h}" '
                     'class="marker"/>')
    splits = list(series)
    for index, (split, split_points) in enumerate(series.items()):
        colour = split_colour(split, splits)
        if len(split_points) > 1:
            coordinates = " ".join(f"{x(p.step):.1f},{y(p.reward):.1f}" for p in split_points)
            parts.append(f'<polyline points="{coordinates}" fill="none" stroke="{colour}" stroke-width="2.5"/>')
        for p in split_points:
            parts.append(f'<circle cx="{x(p.step):.1f}" cy="{y(p.reward):.1f}" r="5" fill="{colour}">'
                         f'<title>{escape(split)} step {p.step}: mean reward {p.reward:.3f} '
                         f'({p.trajectories} trajectories)</title></circle>')
        legend_y = top + 8 + index * 20
        parts.append(f'<rect x="{left + plot_w + 14}" y="{legend_y - 6}" width="14" height="12" fill="{colour}"/>'
                     f'<text x="{left + plot_w + 34}" y="{legend_y + 4}">{escape(split)}</text>')
    parts.append("</svg>")
    return "".join(parts)
