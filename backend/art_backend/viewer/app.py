"""The viewer's HTTP app: read-only pages over an art dir.

    /                                   every project and model
    /<project>                          that project's models
    /<project>/<model>                  reward curve per split, the steps
    /<project>/<model>/<split>/<step>   the groups side by side, conversations, token views
                                        (`?tokens=open` unfolds every token view)

Only GET routes exist. With an API key every route needs it: `Authorization: Bearer KEY`, or
once `?key=KEY` in the browser, which sets a cookie and redirects to the same page without it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from art_backend.errors import ModelNotFoundError
from art_backend.training.grpo import group_advantages
from art_backend.viewer.conversation import Conversation, conversation
from art_backend.viewer.curve import reward_curve_svg, reward_series, split_colour
from art_backend.viewer.store import ArtStore, NotInStore, StoredModel
from art_backend.viewer.tokens import Tokenizers, TokenView, token_view
from art_integrations.trajectory import Trajectory, TrajectoryGroup

KEY_COOKIE = "art_viewer_key"


def _number(value: Any) -> str:
    """Metrics as people read them: booleans as words, floats to 4 significant digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "; ".join(map(str, value))
    return str(value)


def _templates() -> Environment:
    environment = Environment(loader=PackageLoader("art_backend.viewer", "templates"),
                              autoescape=select_autoescape(["html"]), undefined=StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True)
    environment.filters["number"] = _number
    environment.filters["url"] = lambda part: quote(str(part), safe="")
    environment.globals["split_colour"] = split_colour
    return environment


@dataclass(frozen=True)
class TrajectoryShown:
    number: int
    trajectory: Trajectory
    main: Conversation
    additional: list[Conversation]
    tokens: TokenView
    other_metadata: dict[str, Any]  # metadata besides RULER's explanation


@dataclass(frozen=True)
class GroupShown:
    number: int
    group: TrajectoryGroup
    mean_reward: float | None
    no_signal: bool  # all rewards equal: GRPO skips the group
    trajectories: list[TrajectoryShown]


def _require_key(app: FastAPI, api_key: str, templates: Environment) -> None:
    expected = api_key.encode()

    def matches(given: str | None) -> bool:
        return given is not None and secrets.compare_digest(given.encode(), expected)

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        header = request.headers.get("authorization", "")
        if matches(header.removeprefix("Bearer ") if header.startswith("Bearer ") else None) \
                or matches(request.cookies.get(KEY_COOKIE)):
            return await call_next(request)
        if matches(request.query_params.get("key")):
            # The key leaves the address bar (and the history) at once; the cookie carries it on.
            kept = [(name, value) for name, value in request.query_params.multi_items() if name != "key"]
            query = "&".join(f"{quote(name)}={quote(value)}" for name, value in kept)
            response = RedirectResponse(request.url.path + (f"?{query}" if query else ""), status_code=303)
            response.set_cookie(KEY_COOKIE, api_key, httponly=True, samesite="strict")
            return response
        page = templates.get_template("error.html").render(
            title="API key required", message=(
                "This viewer was started with an API key. Open this address once with ?key=KEY appended "
                "(the browser then keeps it in a cookie), or send the header Authorization: Bearer KEY."),
            links=[])
        return HTMLResponse(page, status_code=401)


def create_viewer_app(art_dir: Path, tokenizers: Tokenizers, api_key: str | None = None) -> FastAPI:
    store = ArtStore(art_dir)
    templates = _templates()
    # No /docs: its page loads scripts from a CDN, and the viewer fetches nothing from the network.
    app = FastAPI(title="art-backend viewer", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        _require_key(app, api_key, templates)

    def page(template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(templates.get_template(template).render(art_dir=str(store.art_dir), **context),
                            status_code=status_code)

    @app.exception_handler(NotInStore)
    async def not_found(request: Request, error: NotInStore) -> HTMLResponse:
        params = {key: quote(str(value), safe="") for key, value in request.path_params.items()}
        model_url = f"/{params.get('project')}/{params.get('name')}"
        link_to = {"project": lambda found: f"/{found}", "model": lambda found: f"/{params['project']}/{found}",
                   "step": lambda found: f"{model_url}/{params['split']}/{found}"}.get(error.what)
        links = [(found, link_to(quote(found, safe=""))) for found in error.available] if link_to else []
        if error.what in ("split", "step"):
            links.append((f"all steps of {params['project']}/{params['name']}", model_url))
        return page("error.html", 404, title=f"No {error.what} {error.name!r}", message=str(error), links=links)

    def model_rows(models: list[StoredModel]) -> list[dict[str, Any]]:
        rows = []
        for model in models:
            series = reward_series(store.history(model))
            rows.append({"model": model, "steps": store.steps_by_split(model),
                         "latest": {split: points[-1] for split, points in series.items()}})
        return rows

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return page("index.html", title="Trained models", rows=model_rows(store.models()))

    @app.get("/{project}", response_class=HTMLResponse)
    def project_page(project: str) -> HTMLResponse:
        models = [store.model(project, name) for name in store.model_names(project)]
        return page("index.html", title=f"Project {project}", rows=model_rows(models))

    @app.get("/{project}/{name}", response_class=HTMLResponse)
    def model_page(project: str, name: str) -> HTMLResponse:
        model = store.model(project, name)
        history = store.history(model)
        steps = store.steps_by_split(model)
        series = reward_series(history)
        means = {(split, p.step): p for split, points in series.items() for p in points}
        all_steps = sorted({s for split_steps in steps.values() for s in split_steps} | {s for _, s in means})
        train_records = {r["step"]: r for r in history if r["split"] == "train"}
        return page("model.html", title=model.label, model=model, curve=Markup(reward_curve_svg(series)),
                    splits=list(dict.fromkeys([*steps, *series])), steps=steps, all_steps=all_steps,
                    means=means, train_records=train_records)

    @app.get("/{project}/{name}/{split}/{step}", response_class=HTMLResponse)
    def step_page(project: str, name: str, split: str, step: str, tokens: str = "") -> HTMLResponse:
        model = store.model(project, name)
        stored = store.step(model, split, step)
        history = store.history(model)
        tokenizer, tokenizer_note = _tokenizer(tokenizers, model)
        groups = [_group_shown(number, group, tokenizer, tokenizer_note)
                  for number, group in enumerate(stored.groups, 1)]
        split_steps = store.split_steps(model, split)
        position = split_steps.index(stored.step)
        return page(
            "step.html", title=f"{model.label} {split} step {stored.step}", model=model, stored=stored,
            groups=groups, records=[r for r in history if r["split"] == split and r["step"] == stored.step],
            curve=Markup(reward_curve_svg(reward_series(history), marked_step=stored.step, height=200)),
            previous=split_steps[position - 1] if position > 0 else None,
            next=split_steps[position + 1] if position + 1 < len(split_steps) else None,
            tokens_open=tokens == "open", tokenizer_note=tokenizer_note if tokenizer is not None else None)

    return app


def _tokenizer(tokenizers: Tokenizers, model: StoredModel) -> tuple[Any, str]:
    """The tokenizer, and a line saying which one (or why there is none)."""
    try:
        tokenizer, directory = tokenizers.tokenizer_for(model.base_model)
    except (ModelNotFoundError, OSError, ValueError) as error:
        return None, str(error)
    note = f"Decoded with the tokenizer of {directory}."
    if model.base_model is not None and directory.name != model.base_model:
        note += f" The model's base model is recorded as {model.base_model!r}: check --model if tokens look wrong."
    return tokenizer, note


def _group_shown(number: int, group: TrajectoryGroup, tokenizer: Any, tokenizer_note: str) -> GroupShown:
    rewards = [t.reward for t in group.trajectories]
    shown = []
    for index, trajectory in enumerate(group.trajectories, 1):
        tokens = token_view(trajectory, tokenizer) if tokenizer is not None else TokenView([], 0, tokenizer_note)
        shown.append(TrajectoryShown(
            index, trajectory, conversation(trajectory),
            [conversation(history) for history in trajectory.additional_histories], tokens,
            {key: value for key, value in trajectory.metadata.items() if key != "ruler_explanation"}))
    return GroupShown(number, group, sum(rewards) / len(rewards) if rewards else None,
                      len(rewards) > 1 and group_advantages(rewards, scale=True) is None, shown)

