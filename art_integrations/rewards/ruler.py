"""RULER: an LLM judge scores a group's trajectories relative to each other (no reward
function needed; GRPO's advantages are relative anyway). One call per group: the shared
messages once, then each distinct remainder under an id ("t1", ...). The answer's JSON schema
goes in `response_format`, so a constrained-decoding backend (ours, vLLM) cannot break it;
scores are applied by id, never by position. The judge is any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Union

from openai import APIError, AsyncOpenAI
from pydantic import BaseModel, ValidationError

from art_integrations.backend import Backend
from art_integrations.model import TrainableModel
from art_integrations.trajectory import Trajectory, TrajectoryGroup

logger = logging.getLogger(__name__)

DEFAULT_RUBRIC = """\
- A trajectory that reaches the user's goal scores higher than one that does not.
- Among those that reach it, the more efficient (fewer steps, fewer wasted or failed tool
  calls, shorter without losing substance) scores higher.
- Give partial credit: one that makes real progress beats one that makes none, and a
  confident wrong answer scores lower than an honest partial one.
- Use the range: the best trajectory of the group should score near 1, the worst near 0."""

_INSTRUCTIONS = """\
You are a strict judge. Several trajectories of an AI agent attempted the same task. Compare
them with each other and give each a score between 0 and 1 following the rubric. Answer with
JSON only: {"scores": [{"trajectory_id": "t1", "explanation": "<why this score>",
"score": <0 to 1>}, ...]}, naming every trajectory id exactly once."""

ENV_BASE_URL, ENV_MODEL, ENV_API_KEY = "ART_JUDGE_BASE_URL", "ART_JUDGE_MODEL", "ART_JUDGE_API_KEY"
_OPENAI_API = "https://api.openai.com/v1"


class RulerError(RuntimeError):
    """The judge could not be reached, or answered badly twice."""


@dataclass
class Judge:
    """An OpenAI-compatible endpoint as judge; `base_url` as the `openai` client takes it (most end
    in /v1). `max_tokens=None` budgets from the ids and `max_explanation_chars` (also in the schema),
    capped to fit `context_window` when it is known."""

    base_url: str
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    max_tokens: int | None = None
    max_explanation_chars: int | None = 400
    context_window: int | None = None
    client: AsyncOpenAI | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_client(cls, client: AsyncOpenAI, model: str, **settings: Any) -> Judge:
        return cls(base_url=str(client.base_url), model=model, api_key=client.api_key, client=client, **settings)

    @classmethod
    def from_env(cls) -> Judge:
        base_url, model = os.environ.get(ENV_BASE_URL), os.environ.get(ENV_MODEL)
        if not base_url or not model:
            raise RulerError(
                f"No RULER judge configured: pass judge=Judge(base_url=..., model=...), a Backend or TrainableModel, "
                f"or set {ENV_BASE_URL} (an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1) and "
                f"{ENV_MODEL} (plus {ENV_API_KEY} if the endpoint needs a key).")
        return cls(base_url=base_url, model=model, api_key=os.environ.get(ENV_API_KEY))

    @classmethod
    def from_name(cls, name: str) -> Judge:
        """ART's `judge_model="openai/o4-mini"`: with ART_JUDGE_BASE_URL set, `name` is a model served
        there (any OpenAI-compatible endpoint; its key in ART_JUDGE_API_KEY); otherwise `provider/model`,
        reached at `<PROVIDER>_BASE_URL` with `<PROVIDER>_API_KEY` (for openai the base URL defaults to
        OpenAI's own API)."""
        if os.environ.get(ENV_BASE_URL):
            return cls(base_url=os.environ[ENV_BASE_URL], model=name, api_key=os.environ.get(ENV_API_KEY))
        provider, _, model = name.partition("/")
        if not model:
            raise RulerError(f"judge_model={name!r}: name it as provider/model (e.g. 'openai/o4-mini'), or set "
                             f"{ENV_BASE_URL} to the OpenAI-compatible endpoint that serves {name!r}.")
        prefix = provider.upper().replace("-", "_")
        base_url = os.environ.get(f"{prefix}_BASE_URL") or (_OPENAI_API if provider == "openai" else None)
        if base_url is None:
            raise RulerError(f"judge_model={name!r}: set {prefix}_BASE_URL to {provider}'s OpenAI-compatible "
                             f"endpoint (and {prefix}_API_KEY), or {ENV_BASE_URL} to an endpoint serving {name!r}.")
        return cls(base_url=base_url, model=model, api_key=os.environ.get(f"{prefix}_API_KEY"))

    def openai_client(self) -> AsyncOpenAI:
        if self.client is None:
            self.client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused")
        return self.client


JudgeLike = Union[Judge, str, tuple[AsyncOpenAI, str], Backend, TrainableModel, None]
_backend_judges: weakref.WeakKeyDictionary[Backend, Judge] = weakref.WeakKeyDictionary()
_env_judges: dict[tuple[str | None, ...], Judge] = {}  # one client per configuration, not per group


async def resolve_judge(judge: JudgeLike) -> Judge:
    """A `Judge` from any accepted form: None reads ART_JUDGE_*, a name is ART's `judge_model`
    (`Judge.from_name`), a Backend/TrainableModel judges with the backend's base model (no adapter).
    Any served name: `Judge.from_client(backend.openai_client(), name)`."""
    if isinstance(judge, Judge):
        return judge
    if isinstance(judge, str):
        key = (judge, *(os.environ.get(name) for name in (ENV_BASE_URL, ENV_API_KEY)))
        if key not in _env_judges:
            named = Judge.from_name(judge)
            named.context_window = await _served_context_window(named)
            _env_judges[key] = named
        return _env_judges[key]
    if judge is None:
        key = tuple(os.environ.get(name) for name in (ENV_BASE_URL, ENV_MODEL, ENV_API_KEY))
        if key not in _env_judges:
            _env_judges[key] = Judge.from_env()
        return _env_judges[key]
    if isinstance(judge, tuple):
        return Judge.from_client(*judge)
    backend = judge.backend if isinstance(judge, TrainableModel) else judge
    if not isinstance(backend, Backend):
        raise TypeError(f"judge must be a Judge, a model name, (AsyncOpenAI, model), Backend, TrainableModel or None, "
                        f"not {judge!r}")
    if backend not in _backend_judges:  # the base model, no adapter: what /v1/models lists as root
        served = (await backend.request("GET", "/v1/models"))["data"]
        _backend_judges[backend] = Judge.from_client(backend.openai_client(), served[0].get("root") or served[0]["id"],
                                                     context_window=served[0].get("max_model_len"))
    return _backend_judges[backend]


async def _served_context_window(judge: Judge) -> int | None:
    """The judge's context window where its endpoint lists it (vLLM and art-backend do, as
    `max_model_len`), so the answer's budget fits; None where it does not."""
    try:
        listed = await judge.openai_client().models.list()
    except APIError as error:
        logger.info("RULER judge %r: no model list at %s (%s); its context window is unknown", judge.model,
                    judge.base_url, error)
        return None
    window = next(((m.model_extra or {}).get("max_model_len") for m in listed.data if m.id == judge.model), None)
    return window if isinstance(window, int) else None


class TrajectoryScore(BaseModel):
    trajectory_id: str
    explanation: str = ""
    score: float


class JudgeAnswer(BaseModel):  # the shape; ids and bounds are checked in parse_answer
    scores: list[TrajectoryScore]


@dataclass(frozen=True)
class RulerFailure:  # a group dropped with `swallow_exceptions=True`: why, and which one
    error: str
    group_metadata: dict[str, Any]
    trajectories: int


ruler_failures: deque[RulerFailure] = deque(maxlen=1000)  # dropped groups outlive the group itself


def pop_ruler_failures() -> list[RulerFailure]:
    """The groups dropped since the last call (e.g. to report them in a training step's metrics)."""
    failures = list(ruler_failures)
    ruler_failures.clear()
    return failures


def _render(message: dict[str, Any]) -> str:
    role, content = str(message.get("role", "?")), message.get("content") or ""
    if role == "tool":
        role = f"tool result {message.get('name') or message.get('tool_call_id') or ''}".rstrip()
    if isinstance(content, list):  # content parts: text kept, others named
        content = " ".join(str(p.get("text", f"[{p.get('type')}]")) for p in content if isinstance(p, dict))
    lines = [f"[{role}] {content if isinstance(content, str) else json.dumps(content)}".rstrip()]
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        lines.append(f"[{message.get('role')} calls {function.get('name')}] {function.get('arguments')}")
    return "\n".join(lines)


def _tools(group: TrajectoryGroup) -> str:
    histories = [h for t in group.trajectories for h in t.histories()]
    functions = [tool.get("function", tool) for h in histories for tool in h.tools or []]
    found: dict[str, str] = {}
    for function in functions:
        found.setdefault(str(function.get("name")), str(function.get("description") or "").strip())
    return "\n".join(f"- {name}: {about}".rstrip(": ") for name, about in found.items())


def build_prompt(group: TrajectoryGroup, rubric: str) -> tuple[list[dict[str, str]], list[str], list[int]]:
    """The judge's messages, the distinct ids, and each trajectory's index into them."""
    conversations = [[_render(m) for m in t.messages()] for t in group.trajectories]
    shortest = min(len(c) for c in conversations)
    shared = 0  # the common prefix, leaving every trajectory at least its last message
    while shared < shortest - 1 and all(c[shared] == conversations[0][shared] for c in conversations):
        shared += 1
    bodies: list[str] = []
    index: list[int] = []
    for trajectory, conversation in zip(group.trajectories, conversations):
        parts = ["\n".join(conversation[shared:]) or "(no messages)"]
        for n, history in enumerate(trajectory.additional_histories, 1):
            parts.append(f"--- sub-agent conversation {n} ---\n" + "\n".join(_render(m) for m in history.messages()))
        body = "\n".join(parts)
        if body not in bodies:  # identical trajectories are judged once and share the score
            bodies.append(body)
        index.append(bodies.index(body))
    ids = [f"t{i + 1}" for i in range(len(bodies))]
    sections = []
    if shared:
        sections.append("<context>\n" + "\n".join(conversations[0][:shared]) + "\n</context>")
    if tools := _tools(group):
        sections.append(f"<tools>\n{tools}\n</tools>")
    sections += [f'<trajectory id="{i}">\n{body}\n</trajectory>' for i, body in zip(ids, bodies)]
    sections.append(f"Score every trajectory: {', '.join(ids)}.")
    system = f"{_INSTRUCTIONS}\n\nRubric:\n{rubric.strip()}"
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}], ids, index


def answer_schema(ids: list[str], max_explanation_chars: int | None = None) -> dict[str, Any]:
    """JSON schema of the answer: ids pinned in order (`prefixItems`), any id via `items` for
    engines without prefixItems, scores bounded to [0, 1]."""
    explanation: dict[str, Any] = {"type": "string"}
    if max_explanation_chars:
        explanation["maxLength"] = max_explanation_chars

    def item(allowed: list[str]) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": False, "required": ["trajectory_id", "explanation", "score"],
                "properties": {"trajectory_id": {"type": "string", "enum": allowed}, "explanation": explanation,
                               "score": {"type": "number", "minimum": 0, "maximum": 1}}}

    scores = {"type": "array", "prefixItems": [item([i]) for i in ids], "items": item(ids),
              "minItems": len(ids), "maxItems": len(ids)}
    return {"type": "object", "properties": {"scores": scores}, "required": ["scores"], "additionalProperties": False}


def parse_answer(text: str, ids: list[str]) -> dict[str, TrajectoryScore]:
    """Scores by id; a `RulerError` naming every problem if the answer breaks the contract."""
    text = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    try:
        answer = JudgeAnswer.model_validate_json(text)
    except ValidationError as error:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in error.errors()[:3])
        raise RulerError(f"the answer is not the requested JSON ({details})") from None
    scores: dict[str, TrajectoryScore] = {}
    problems = []
    for entry in answer.scores:
        if entry.trajectory_id not in ids:
            problems.append(f"unknown trajectory_id {entry.trajectory_id!r} (the ids are {', '.join(ids)})")
        elif entry.trajectory_id in scores:
            problems.append(f"trajectory_id {entry.trajectory_id!r} appears more than once")
        elif not (math.isfinite(entry.score) and 0 <= entry.score <= 1):
            problems.append(f"score {entry.score} of {entry.trajectory_id!r} is outside [0, 1]")
        scores.setdefault(entry.trajectory_id, entry)
    if missing := [i for i in ids if i not in scores]:
        problems.append(f"no score for {', '.join(missing)}")
    if problems:
        raise RulerError("; ".join(problems))
    return scores


def answer_budget(judge: Judge, messages: list[dict[str, str]], answers: int) -> int:
    if judge.max_tokens:
        return judge.max_tokens
    budget = 32 + answers * ((judge.max_explanation_chars or 400) + 40)
    if judge.context_window:  # a token is rarely under 3 characters, so this over-counts the prompt
        prompt_tokens = sum(len(m["content"]) for m in messages) // 3 + 16 * len(messages)
        budget = min(budget, max(64, judge.context_window - prompt_tokens))
    return budget


async def _judge(judge: Judge, messages: list[dict[str, str]], ids: list[str]) -> dict[str, TrajectoryScore]:
    """Ask once; on a bad answer ask once more, showing the judge its answer and the error."""
    schema = answer_schema(ids, judge.max_explanation_chars)
    error, cut = RulerError("no answer"), ""
    for attempt in range(2):
        budget = answer_budget(judge, messages, len(ids))
        try:
            response = await judge.openai_client().chat.completions.create(
                model=judge.model, messages=messages,  # type: ignore[arg-type]
                temperature=judge.temperature, max_tokens=budget,
                response_format={"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema}})
        except APIError as failed:
            raise RulerError(f"The RULER judge {judge.model!r} at {judge.base_url} failed: {failed}") from failed
        text, finish = response.choices[0].message.content or "", response.choices[0].finish_reason
        try:
            return parse_answer(text, ids)
        except RulerError as bad:
            error, cut = bad, f" (cut off at max_tokens={budget}: raise Judge.max_tokens)" if finish == "length" else ""
            logger.info("RULER judge answer %d rejected: %s%s", attempt + 1, error, cut)
            messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": (
                f"That answer is invalid: {error}. Answer again with JSON only, scoring each of "
                f"{', '.join(ids)} exactly once with a score between 0 and 1.")}]
    raise RulerError(f"The RULER judge {judge.model!r} at {judge.base_url} answered badly twice: {error}{cut}. "
                     "Use a judge that follows response_format json_schema, or a stronger model.") from None


async def ruler_score_group(group: TrajectoryGroup, judge: JudgeLike = None, rubric: str = DEFAULT_RUBRIC, *,
                            judge_model: str | None = None, swallow_exceptions: bool = False,
                            debug: bool = False) -> TrajectoryGroup | None:
    """Score `group` with one judge call: `reward` becomes the judge's score, the old reward
    stays in `metrics["independent_reward"]`, the explanation goes to `logs` and
    `metadata["ruler_explanation"]`. With `swallow_exceptions`, a failure returns None (drop
    the group) after recording why in `group.metadata["ruler_error"]`, the trajectories' logs,
    a warning and `ruler_failures`. A misconfigured judge raises either way: it would drop every group.
    `judge_model`: ART's name for a judge given by name (see `Judge.from_name`)."""
    if judge_model is not None:
        if judge is not None:
            raise TypeError("pass the judge once: judge= or judge_model=, not both")
        judge = judge_model
    if not group.trajectories:
        return group
    resolved = await resolve_judge(judge)
    messages, ids, index = build_prompt(group, rubric)
    try:
        scores = await _judge(resolved, messages, ids)
    except Exception as error:
        if not swallow_exceptions:
            raise
        reason = f"{type(error).__name__}: {error}"
        logger.warning("RULER dropped a group (%s): %s", group.metadata, reason)
        group.metadata["ruler_error"] = reason
        for logs in [group.logs, *(t.logs for t in group.trajectories)]:
            logs.append(f"RULER failed: {reason}")
        ruler_failures.append(RulerFailure(reason, dict(group.metadata), len(group.trajectories)))
        return None
    for trajectory, i in zip(group.trajectories, index):
        _apply(trajectory, scores[ids[i]])
    if debug:
        print(f"RULER judge {resolved.model}: {len(group.trajectories)} trajectories, {len(ids)} distinct")
        for n, (trajectory_id, score) in enumerate((i, scores[i]) for i in ids):
            same = [k for k, i in enumerate(index) if i == n]
            print(f"  {trajectory_id} (trajectories {same}) score {score.score:.3f}: {score.explanation}")
    return group


def _apply(trajectory: Trajectory, score: TrajectoryScore) -> None:
    trajectory.metrics["independent_reward"] = trajectory.reward
    trajectory.metrics["ruler_score"] = score.score
    trajectory.reward = score.score
    trajectory.metadata["ruler_explanation"] = score.explanation.strip()
    trajectory.metadata["ruler_id"] = score.trajectory_id
    trajectory.logs.append(f"RULER {score.trajectory_id} ({score.score:.3f}): {score.explanation.strip()}")


def ruler(judge: JudgeLike = None, rubric: str = DEFAULT_RUBRIC, *, judge_model: str | None = None,
          swallow_exceptions: bool = False, debug: bool = False
          ) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]]:
    """`ruler_score_group` with its settings fixed, for `gather_trajectory_groups(after_each=...)`."""

    async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
        return await ruler_score_group(group, judge, rubric, judge_model=judge_model,
                                       swallow_exceptions=swallow_exceptions, debug=debug)

    return score
