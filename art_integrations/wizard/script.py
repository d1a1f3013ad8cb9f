"""The training script the wizard writes, and the example files it writes beside it.

The script is meant to be read and edited, so it is plain code in the style of `examples/`:
settings at the top, then scenarios, reward, rollout, held-out scoring and the loop. Each
pattern and reward changes only its own pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from art_integrations.wizard.questions import load_tools

EXAMPLE_CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Canada": "Ottawa",
    "Egypt": "Cairo", "Norway": "Oslo", "Chile": "Santiago", "Spain": "Madrid", "India": "New Delhi",
    "Ghana": "Accra", "Italy": "Rome", "Cuba": "Havana", "Nepal": "Kathmandu", "Poland": "Warsaw",
    "Greece": "Athens",
}
EXAMPLE_TOOLS = [{"type": "function", "function": {
    "name": "lookup_capital", "description": "The capital city of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}}]


def example_scenarios() -> str:
    """16 scenarios of the default task, as JSON lines."""
    return "".join(json.dumps({"prompt": f"What is the capital of {country}?", "answer": capital,
                               "followups": ["Which country is that city the capital of? One sentence."]}) + "\n"
                   for country, capital in EXAMPLE_CAPITALS.items())


EXAMPLE_AGENT = '''"""An example LangGraph agent: a model node in a graph. Replace it with yours: the training
script needs only a function that takes a chat model and returns the compiled agent."""

from typing import Any

from langgraph.graph import END, START, MessagesState, StateGraph


def build_agent(chat_model: Any) -> Any:
    async def respond(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await chat_model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("respond", respond)
    graph.add_edge(START, "respond")
    graph.add_edge("respond", END)
    return graph.compile()
'''


def render(answers: dict[str, Any], script: Path, scenarios: Path, agent_module: str | None) -> str:
    """The script's text. `scenarios`: the scenarios file it reads; `agent_module`: where the
    example agent was written (agent pattern without an agent of the user's)."""
    pattern, reward = answers["pattern"], answers["reward"]
    factory = answers.get("agent") or f"{agent_module}:build_agent"
    framework = answers.get("framework") or "langgraph"
    run = f"python {script.name}"
    top = factory.split(":")[0].split(".")[0]
    # a module beside the script (the example agent, or the user's) is first-party to isort
    first_party = agent_module is not None or (script.parent / f"{top}.py").exists() or (script.parent / top).is_dir()
    head = "\n\n".join([_header(answers, run), _imports(pattern, reward, framework, factory, first_party),
                         _settings(answers, script, scenarios)])
    parts = [head, SCENARIOS, REWARD]
    if pattern == "tools":
        tools = (load_tools(json.loads(Path(answers["tools"]).read_text()), answers["tools"])
                 if answers.get("tools") else EXAMPLE_TOOLS)
        parts.append(_tools(tools, example=not answers.get("tools")))
    parts += [ROLLOUTS[pattern] if pattern != "agent" else AGENT_ROLLOUTS[framework], HELD_OUT,
              _main(reward), CLOSING, ENTRY]
    return "\n\n\n".join(part.strip("\n") for part in parts) + "\n"


def _header(answers: dict[str, Any], run: str) -> str:
    return f'''"""{answers["task"]}

GRPO training written by `art-integrations init` (pattern: {answers["pattern"]}, reward: {answers["reward"]}).

Run it:
    {run}                             # starts a local backend; run again to resume
    {run} --serve                     # then keeps serving the trained model (Ctrl-C stops)
    {run} --backend-url http://HOST:8000   # train on a backend running elsewhere

This file is yours: edit the scenarios, the reward and the rollout below.
"""'''


def _imports(pattern: str, reward: str, framework: str, factory: str, first_party: bool) -> str:
    # in isort's order: classes, then functions
    names = ["LocalBackend", "RemoteBackend", "TrainableModel", "TrainConfig", "Trajectory", "TrajectoryGroup",
             *(["art_capture"] if pattern == "agent" else []), "gather_trajectory_groups", "trajectory_group"]
    lines = ["from __future__ import annotations", "", "import argparse", "import asyncio", "import difflib",
             "import json", "import statistics", "from pathlib import Path", "from typing import Any", "",
             "from art_integrations import (", *(f"    {name}," for name in names), ")"]
    if pattern == "agent":
        lines.append("from art_integrations.langchain import ChatART" if framework == "langgraph"
                     else "from art_integrations.llamaindex import ARTLLM")
    if reward == "ruler":
        lines.append("from art_integrations.rewards import Judge, ruler")
    if pattern == "agent":
        module, function = factory.split(":")
        line = f"from {module} import {function}" + ("" if function == "build_agent" else " as build_agent")
        lines += ["", line] if first_party else [line]  # isort's blocks
    return "\n".join(lines)


def _settings(answers: dict[str, Any], script: Path, scenarios: Path) -> str:
    relative = scenarios.name if scenarios.parent.resolve() == script.parent.resolve() else str(scenarios.resolve())
    lines = [
        f"PROJECT = {answers['project']!r}",
        f"NAME = {answers['name']!r}",
        "# a local model directory; None: the backend's embedded model",
        f"BASE_MODEL = {answers['model']!r}",
        f"SYSTEM_PROMPT = {answers['system_prompt']!r}",
        f"SCENARIOS = Path(__file__).parent / {relative!r}",
        f"STEPS = {answers['steps']}",
        f"GROUPS_PER_STEP = {answers['groups_per_step']}",
        f"ROLLOUTS_PER_GROUP = {answers['rollouts']}",
        f"LEARNING_RATE = {answers['learning_rate']!r}",
        f"HELD_OUT = {answers['held_out']}  # the first scenarios, never trained on, scored before and after",
        "TEMPERATURE = 0.7  # rollouts are sampled; held-out scoring is greedy",
        "MAX_TOKENS = 256",
    ]
    if answers.get("max_turns"):
        lines.append(f"MAX_TURNS = {answers['max_turns']}")
    if answers["reward"] == "ruler":
        judge = answers.get("judge_model")
        lines.append(f"JUDGE_MODEL = {judge!r}  # None: the backend's own base model (it runs offline; a 135M "
                     "judge only shows the loop)")
        lines.append(f"JUDGE_BASE_URL = {answers.get('judge_base_url')!r}  # its key: OPENAI_API_KEY")
    return "\n".join(lines)


SCENARIOS = '''
def load_scenarios() -> list[dict[str, Any]]:
    """One scenario per line: {"prompt": ..., "answer": ... (optional), "followups": [...] (optional)}."""
    lines = SCENARIOS.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
'''

REWARD = '''
def reward(scenario: dict[str, Any], replies: list[str]) -> float:
    """1.0 when the scenario's answer appears in the model's last reply, else partial credit for
    how close the reply comes to it. Replace this with your task's own check."""
    answer, last = scenario.get("answer"), (replies[-1] if replies else "")
    if not answer:
        return 0.0
    if answer.lower() in last.lower():
        return 1.0
    return 0.5 * difflib.SequenceMatcher(None, answer.lower(), last.lower()).ratio()
'''


def _tools(tools: list[dict[str, Any]], example: bool) -> str:
    lines = [f"TOOLS = {json.dumps(tools, indent=4)}", ""]
    for tool in tools:
        function = tool["function"]
        lines += ["", f"def {function['name']}(scenario: dict[str, Any], **arguments: Any) -> str:",
                  f"    \"\"\"{function.get('description') or 'The tool ' + function['name']}\"\"\""]
        if example:
            lines += ["    capitals = {", *(f"        {c!r}: {k!r}," for c, k in EXAMPLE_CAPITALS.items()), "    }",
                      "    country = str(arguments.get(\"country\", \"\")).strip()",
                      "    return capitals.get(country, f\"no country named {country!r}\")"]
        else:
            lines += ["    # Call your real tool here. Until then the model sees this placeholder, which is",
                      "    # enough to run the loop but teaches nothing about your task.",
                      f"    return json.dumps({{\"tool\": {function['name']!r}, \"arguments\": arguments, "
                      "\"result\": \"not implemented yet\"})"]
    names = ", ".join(f"{t['function']['name']!r}: {t['function']['name']}" for t in tools)
    lines += ["", "", f"TOOL_FUNCTIONS = {{{names}}}", "", "",
              "def run_tool(scenario: dict[str, Any], name: str, arguments: str) -> str:",
              "    \"\"\"A tool call's result, as the model will read it (errors too: the model can recover).\"\"\"",
              "    if name not in TOOL_FUNCTIONS:",
              "        return f\"error: there is no tool named {name!r}\"",
              "    try:",
              "        return TOOL_FUNCTIONS[name](scenario, **json.loads(arguments or \"{}\"))",
              "    except (TypeError, ValueError) as error:",
              "        return f\"error: {error}\""]
    return "\n".join(lines)


def _complete(returns: str) -> str:
    """The function for one model turn; it returns the reply's text, or its whole message
    (`returns="message"`: the tool-calling loop reads its tool calls)."""
    annotation, value = ("str", '.get("content") or ""') if returns == "text" else ("dict[str, Any]", "")
    return f'''
async def complete(model: TrainableModel, trajectory: Trajectory, temperature: float, **kwargs: Any) -> {annotation}:
    """One model turn on the conversation so far, appended to the trajectory with its exact tokens."""
    response = await model.openai_client().chat.completions.create(
        model=model.inference_name, messages=trajectory.messages(), temperature=temperature,
        max_tokens=MAX_TOKENS, logprobs=True, extra_body={{"return_token_ids": True}}, **kwargs)
    return trajectory.add_response(response).message{value}
'''


ROLLOUTS = {
    "single-turn": _complete("text") + '''

async def rollout(model: TrainableModel, scenario: dict[str, Any], temperature: float = TEMPERATURE) -> Trajectory:
    trajectory = Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": scenario["prompt"]}])
    reply = await complete(model, trajectory, temperature)
    trajectory.reward = reward(scenario, [reply])
    return trajectory
''',
    "multi-turn": _complete("text") + '''

async def rollout(model: TrainableModel, scenario: dict[str, Any], temperature: float = TEMPERATURE) -> Trajectory:
    """The scenario's prompt, then each of its follow-ups as the next user message, until they run
    out or MAX_TURNS model turns. Replace the follow-ups with your environment's replies."""
    trajectory = Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": scenario["prompt"]}])
    followups = list(scenario.get("followups", []))
    replies = []
    for _ in range(MAX_TURNS):
        replies.append(await complete(model, trajectory, temperature))
        if not followups:
            break
        trajectory.messages_and_choices.append({"role": "user", "content": followups.pop(0)})
    trajectory.reward = reward(scenario, replies)
    return trajectory
''',
    "tools": _complete("message") + '''

async def rollout(model: TrainableModel, scenario: dict[str, Any], temperature: float = TEMPERATURE) -> Trajectory:
    """Model turns until one calls no tool (its answer) or MAX_TURNS; each call's result goes
    back to the model as a tool message."""
    trajectory = Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": scenario["prompt"]}],
                            tools=TOOLS)
    replies = []
    for _ in range(MAX_TURNS):
        message = await complete(model, trajectory, temperature, tools=TOOLS)
        replies.append(message.get("content") or "")
        calls = message.get("tool_calls") or []
        if not calls:
            break
        for call in calls:
            result = run_tool(scenario, call["function"]["name"], call["function"]["arguments"])
            trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    trajectory.reward = reward(scenario, replies)
    return trajectory
''',
}

AGENT_ROLLOUTS = {
    "langgraph": '''
async def rollout(model: TrainableModel, scenario: dict[str, Any], temperature: float = TEMPERATURE) -> Trajectory:
    """Your agent, built on the policy being trained; every model call inside `art_capture()`
    is recorded with its exact tokens."""
    agent = build_agent(ChatART.from_model(model, temperature=temperature, max_tokens=MAX_TOKENS))
    async with art_capture(scenario=scenario["prompt"]) as trajectory:
        result = await agent.ainvoke({"messages": [("system", SYSTEM_PROMPT), ("user", scenario["prompt"])]})
    replies = [m.content for m in result["messages"] if m.type == "ai" and isinstance(m.content, str)]
    trajectory.reward = reward(scenario, replies)
    return trajectory
''',
    "llamaindex": '''
async def rollout(model: TrainableModel, scenario: dict[str, Any], temperature: float = TEMPERATURE) -> Trajectory:
    """Your agent, built on the policy being trained; every model call inside `art_capture()`
    is recorded with its exact tokens."""
    agent = build_agent(ARTLLM.from_model(model, temperature=temperature, max_tokens=MAX_TOKENS))
    async with art_capture(scenario=scenario["prompt"]) as trajectory:
        output = await agent.run(scenario["prompt"])
    trajectory.reward = reward(scenario, [str(output.response.content or "")])
    return trajectory
''',
}

HELD_OUT = '''
async def held_out_score(model: TrainableModel, scenarios: list[dict[str, Any]]) -> float | None:
    """The mean reward of one greedy rollout per held-out scenario, logged as the "val" split."""
    if not scenarios:
        return None
    groups = await gather_trajectory_groups(
        [trajectory_group(lambda s=s: rollout(model, s, temperature=0.0), n=1) for s in scenarios],
        desc="held-out")
    await model.log(groups, split="val")
    return statistics.fmean(t.reward for g in groups for t in g.trajectories)
'''


def _main(reward: str) -> str:
    judge = ""
    after_each = ""
    if reward == "ruler":
        judge = '''
    # RULER ranks each group's rollouts; `reward()` above stays as metrics/independent_reward
    judge = Judge(base_url=JUDGE_BASE_URL, model=JUDGE_MODEL) if JUDGE_MODEL else backend
    score_group = ruler(judge=judge, swallow_exceptions=True)  # a group the judge fails on is dropped'''
        after_each = ", after_each=score_group"
    return f'''
async def train(backend: LocalBackend | RemoteBackend) -> TrainableModel:
    scenarios = load_scenarios()
    held_out, training = scenarios[:HELD_OUT], scenarios[HELD_OUT:]
    if not training:
        raise SystemExit(f"{{SCENARIOS}} holds {{len(scenarios)}} scenarios, all held out: add more, or lower HELD_OUT")
    model = TrainableModel(name=NAME, project=PROJECT)
    await model.register(backend)  # resumes from the newest checkpoint, if any{judge}
    start = await model.get_step()
    if start == 0:
        print(f"held-out score of the base model: {{await held_out_score(model, held_out)}}")
    for step in range(start, STEPS):
        batch = [training[(step * GROUPS_PER_STEP + i) % len(training)] for i in range(GROUPS_PER_STEP)]
        groups: list[TrajectoryGroup] = await gather_trajectory_groups(
            [trajectory_group(lambda s=s: rollout(model, s), n=ROLLOUTS_PER_GROUP) for s in batch],
            max_exceptions=0.1{after_each}, desc=f"step {{step + 1}}/{{STEPS}}")
        result = await model.train(groups, config=TrainConfig(learning_rate=LEARNING_RATE, temperature=TEMPERATURE))
        mean = result.metrics.get("reward/mean")  # None when every group was dropped
        print(f"step {{step + 1}}/{{STEPS}}: reward mean {{'n/a' if mean is None else format(mean, '.3f')}}, "
              f"groups trained {{result.metrics.get('groups/trained', 0)}}/{{len(batch)}}, checkpoint {{result.step}}")
    print(f"held-out score after training: {{await held_out_score(model, held_out)}}")
    return model
'''


CLOSING = '''
async def main(backend_url: str | None, serve: bool) -> None:
    backend = RemoteBackend(backend_url) if backend_url else LocalBackend(model=BASE_MODEL)
    async with backend:
        model = await train(backend)
        step = await model.get_step()
        url = f"{backend.base_url}/v1"
        served = "while that backend runs" if backend_url else "until Ctrl-C" if serve else (
            f"while this script runs: `python {Path(__file__).name} --serve` keeps it")
        print(f"""
Trained model: {model.inference_name} (step {step}; every step is also served as {model.name}@<step>)
Inference URL: {url}   (served {served})

With the openai SDK:
    from openai import OpenAI
    client = OpenAI(base_url="{url}", api_key="unused")
    reply = client.chat.completions.create(model="{model.inference_name}",
                                           messages=[{{"role": "user", "content": "..."}}])

With curl:
    curl {url}/chat/completions -H 'Content-Type: application/json' \\\\
      -d '{{"model": "{model.inference_name}", "messages": [{{"role": "user", "content": "..."}}]}}'
""", flush=True)
        if serve:
            await asyncio.Event().wait()  # serves until Ctrl-C cancels this; the backend then closes
'''

ENTRY = '''
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend-url", help="a running art-backend (default: start one here)")
    parser.add_argument("--serve", action="store_true", help="after training, keep serving the model until Ctrl-C")
    arguments = parser.parse_args()
    if arguments.serve and arguments.backend_url:
        parser.error("--serve keeps the backend this script starts; the one at --backend-url serves the model already")
    try:
        asyncio.run(main(arguments.backend_url, arguments.serve))
    except KeyboardInterrupt:
        print("stopped")
'''
