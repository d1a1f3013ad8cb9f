"""What the pipeline keeps to resume after a crash, committed with each step (its record's
`client_state`): which scenarios are done and which steps were evaluated.

A scenario is done once its group is trained in a committed step or dropped (stale, no signal,
every rollout failed). Groups still rolling out or queued when the process dies are not done:
after a restart those scenarios run again, so nothing a committed step did not take is lost,
and nothing it took is trained twice. (ART's pipeline keeps the count of scenarios started, so
what was in flight is skipped.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATE_VERSION = 1


@dataclass
class ScenarioLedger:
    """The done scenarios by index in the scenario stream: all below `done_below`, and the
    scattered ones above it (groups finish out of order)."""

    done_below: int = 0
    done_above: set[int] = field(default_factory=set)

    def mark(self, index: int) -> None:
        if index >= self.done_below:
            self.done_above.add(index)
        while self.done_below in self.done_above:
            self.done_above.remove(self.done_below)
            self.done_below += 1

    def is_done(self, index: int) -> bool:
        return index < self.done_below or index in self.done_above

    def __len__(self) -> int:
        return self.done_below + len(self.done_above)


@dataclass
class PipelineState:
    ledger: ScenarioLedger = field(default_factory=ScenarioLedger)
    evaluated: set[int] = field(default_factory=set)  # steps whose eval_fn finished

    def to_record(self) -> dict[str, Any]:
        return {"pipeline_trainer": {"version": STATE_VERSION, "scenarios_done_below": self.ledger.done_below,
                                     "scenarios_done_above": sorted(self.ledger.done_above),
                                     "evaluated_steps": sorted(self.evaluated)}}

    @classmethod
    def from_history(cls, history: list[dict[str, Any]], step: int) -> PipelineState | None:
        """The state committed with train step `step`, if the pipeline trained it."""
        for record in reversed(history):
            if record.get("split") == "train" and record.get("step") == step:
                saved = (record.get("client_state") or {}).get("pipeline_trainer")
                if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
                    return None
                return cls(ScenarioLedger(int(saved["scenarios_done_below"]),
                                          {int(i) for i in saved["scenarios_done_above"]}),
                           {int(s) for s in saved["evaluated_steps"]})
        return None
