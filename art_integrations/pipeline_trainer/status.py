"""The pipeline's progress: a line per trained step and per eval, a line on the three stages every
`log_interval_seconds` while no step lands, and a summary at the end."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class PipelineStatus:
    total_scenarios: int | None = None
    ewa_alpha: float = 0.2
    started: float = field(default_factory=time.monotonic)
    rolling_out: int = 0
    queued: int = 0
    training: int = 0  # groups in the step being trained
    scenarios_started: int = 0
    rollouts_done: int = 0
    rollouts_failed: int = 0
    groups_trained: int = 0
    steps: int = 0
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> groups
    step_seconds_ewa: float | None = None
    train_seconds: list[float] = field(default_factory=list)
    last_eval: str = "none yet"
    _last_line: float = field(default_factory=time.monotonic)

    def note_step(self, step: int, groups: int, reward: float, seconds: float, train_seconds: float,
                  waited: float, off_policy: float) -> None:
        self.steps += 1
        self.groups_trained += groups
        self.train_seconds.append(train_seconds)
        a = self.ewa_alpha
        self.step_seconds_ewa = seconds if self.step_seconds_ewa is None else a * seconds + (1 - a) * self.step_seconds_ewa
        self.say(f"step {step}: {groups} groups, reward {reward:.3f}, {off_policy:.2f} steps off-policy; trained "
                 f"in {train_seconds:.1f} s after waiting {waited:.1f} s for the batch")

    def note_eval(self, step: int, reward: float | None, seconds: float) -> None:
        self.last_eval = f"step {step}" + (f" val reward {reward:.3f}" if reward is not None else "")
        self.say(f"eval of step {step}: " + (f"val reward {reward:.3f}" if reward is not None else "no trajectories")
                 + f" in {seconds:.1f} s")

    def stages(self) -> str:
        scenarios = f" of {self.total_scenarios}" if self.total_scenarios is not None else ""
        dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(self.dropped.items())) or "none"
        return (f"rollouts: {self.rolling_out} groups running, {self.scenarios_started}{scenarios} scenarios started, "
                f"{self.rollouts_done} rollouts done ({self.rollouts_failed} failed), {self.queued} groups queued | train: {self.training} groups in "
                f"step, {self.groups_trained} trained | eval: {self.last_eval} | dropped: {dropped}")

    def say(self, text: str) -> None:
        print(f"[pipeline {time.monotonic() - self.started:6.0f}s] {text} | {self.stages()}", flush=True)
        self._last_line = time.monotonic()

    def due(self, interval: float) -> bool:
        return time.monotonic() - self._last_line >= interval

    def summary(self, first_step: int, last_step: int, why: str) -> str:
        minutes = (time.monotonic() - self.started) / 60
        rate = self.steps / minutes if minutes > 0 else 0.0
        train = f", median train {statistics.median(self.train_seconds):.1f} s" if self.train_seconds else ""
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.dropped.items()))
        dropped = f"{sum(self.dropped.values())} dropped" + (f" ({reasons})" if reasons else "")
        return (f"pipeline: {self.steps} steps ({first_step} -> {last_step}) in {minutes:.1f} min, {rate:.2f} steps/min"
                f"{train}; {self.groups_trained} groups trained, {dropped}, {self.rollouts_done} rollouts "
                f"({self.rollouts_failed} failed); stopped because {why}")
