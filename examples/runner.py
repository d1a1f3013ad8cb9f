"""The loop every example shares: score held-out scenarios, train GRPO steps, score again, plot.
With `--sft-demos N` (an example that has demonstrations) one SFT step on N of them comes first,
and the held-out score after it is printed too: base -> after SFT -> after RL.

An example describes itself with an `Example` (its scenarios, how one rollout runs on a
served model, which metrics to show) and gets two commands from this module:

    train_main(EXAMPLE)      # python -m examples.<name>.train     [--model DIR] [--ruler] [--pipeline] ...
    evaluate_main(EXAMPLE)   # python -m examples.<name>.evaluate  [--base-url URL --models a b] ...
                             # (examples/evaluation.py)

Training resumes from the last checkpoint when run again; the held-out scores already
measured come from the model's history.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from art_integrations import (
    Backend,
    LocalBackend,
    RemoteBackend,
    TrainableModel,
    TrainConfig,
    TrainSFTConfig,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
    trajectory_group,
)


class Scenario(Protocol):
    id: str


@dataclass(frozen=True)
class Policy:
    """A served model a rollout talks to, and how long the world around it makes the rollout wait.
    `trainable` means our backend (record exact tokens); any other OpenAI-compatible endpoint is
    only scored."""

    base_url: str  # ends in /v1
    model: str
    api_key: str = "unused"
    temperature: float = 1.0
    max_tokens: int = 64
    trainable: bool = True
    seed: int | None = None  # sent with every request: the same seed and prompt sample the same tokens
    tool_seconds: float = 0.0  # each tool call answers after this, as a remote service would (`--tool-seconds`)
    judge_seconds: float = 0.0  # each finished rollout waits this for its score, as on a hosted judge

    def langchain(self, **kwargs: Any) -> Any:
        """A LangChain chat model: `ChatART` on our backend, plain `ChatOpenAI` elsewhere."""
        from langchain_openai import ChatOpenAI

        from art_integrations.langchain import ChatART

        chat_model = ChatART if self.trainable else ChatOpenAI
        return chat_model(base_url=self.base_url, model=self.model, api_key=self.api_key,
                          temperature=self.temperature, max_tokens=self.max_tokens, seed=self.seed, **kwargs)

    def llamaindex(self, **kwargs: Any) -> Any:
        """A LlamaIndex function-calling LLM: `ARTLLM` on our backend, `OpenAILike` elsewhere."""
        if self.seed is not None:  # LlamaIndex's OpenAI LLMs have no seed field; this is where it goes
            kwargs["additional_kwargs"] = {**kwargs.get("additional_kwargs", {}), "seed": self.seed}
        if self.trainable:
            from art_integrations.llamaindex import ARTLLM

            return ARTLLM(model=self.model, api_base=self.base_url, api_key=self.api_key,
                          temperature=self.temperature, max_tokens=self.max_tokens, **kwargs)
        from llama_index.llms.openai_like import OpenAILike

        return OpenAILike(model=self.model, api_base=self.base_url, api_key=self.api_key,
                          temperature=self.temperature, max_tokens=self.max_tokens,
                          is_chat_model=True, is_function_calling_model=True, **kwargs)


@dataclass(frozen=True)
class Example:
    """What an example gives the shared commands."""

    project: str
    model_prefix: str  # trained models are named <prefix>-s<seed>
    title: str  # for the learning-curve plot
    scenarios: Callable[[str, int, int], Sequence[Scenario]]  # (split "train"/"val", count, seed)
    rollout: Callable[[Policy, Any], Awaitable[Trajectory]]  # runs inside art_capture and sets the reward
    metrics: tuple[str, ...] = ()  # trajectory metrics shown per step and in the evaluation table
    steps: int = 8
    scenarios_per_step: int = 3
    rollouts: int = 4
    held_out: int = 12
    learning_rate: float = 1e-3
    temperature: float = 1.0  # training rollouts are sampled at this (held-out scoring is greedy)
    scale_rewards: bool = True  # divide each group's advantages by its reward std
    max_tokens: int = 64
    # a scripted expert's conversations on the given scenarios, for `--sft-demos` (None: the example has none)
    demonstrations: Callable[[Sequence[Any]], list[Trajectory]] | None = None
    slow_tools: bool = False  # its rollout's tools wait Policy.tool_seconds (`--tool-seconds`)


def common_arguments(example: Example, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the local backend's base model: a Hugging Face model dir "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", default=None, choices=["auto", "torch", "vllm"],
                        help="the local backend's engine (default: ART_BACKEND_ENGINE, else auto)")
    parser.add_argument("--backend-url", default=None, help="use a running `art-backend serve` at this URL (its "
                        "own --model and --engine) instead of starting one here")
    parser.add_argument("--backend-api-key", default=None, help="the running backend's --api-key")
    parser.add_argument("--art-dir", default=".art", help="where trained models live (with --backend-url: the "
                        "backend's --art-dir, where the learning curve is drawn)")
    parser.add_argument("--held-out", type=int, default=example.held_out, help="held-out scenarios scored")
    parser.add_argument("--max-tokens", type=int, default=example.max_tokens, help="per model call")
    if example.slow_tools:
        parser.add_argument("--tool-seconds", type=float, default=0.0, help="each tool call answers after this many "
                            "seconds, as a web API or a database would (the rollout waits; others decode meanwhile)")
    parser.add_argument("--judge-seconds", type=float, default=0.0, help="each rollout waits this many seconds for "
                        "its score after it ends, as on a hosted judge")
    return parser


def checked_waits(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, float]:
    """--tool-seconds and --judge-seconds as Policy's fields."""
    waits = {"tool_seconds": getattr(args, "tool_seconds", 0.0), "judge_seconds": args.judge_seconds}
    for name, seconds in waits.items():
        if not seconds >= 0:
            parser.error(f"--{name.replace('_', '-')} {seconds}: a wait is 0 seconds or more")
    return waits


def open_backend(args: argparse.Namespace) -> Backend:
    """The backend to train and score on: a running one at --backend-url, or one started here."""
    if args.backend_url is None:
        return LocalBackend(model=args.model, engine=args.engine, art_dir=args.art_dir)
    if args.model is not None or args.engine is not None:
        raise SystemExit("--model and --engine configure a backend started here; with --backend-url the running "
                         "backend serves its own (`art-backend serve --model ... --engine ...`).")
    return RemoteBackend(args.backend_url, api_key=args.backend_api_key)


async def run_rollout(example: Example, policy: Policy, scenario: Scenario) -> Trajectory:
    """The example's rollout, then its judge's wait (`--judge-seconds`)."""
    trajectory = await example.rollout(policy, scenario)
    if policy.judge_seconds:
        await asyncio.sleep(policy.judge_seconds)
    return trajectory


async def score_scenarios(example: Example, policy: Policy, scenarios: Sequence[Scenario]) -> list[Trajectory]:
    """One rollout per scenario, all at once (the backend batches them)."""
    return list(await asyncio.gather(*(run_rollout(example, policy, s) for s in scenarios)))


def rollout_seed(run_seed: int, step: int, scenario: int, rollout: int) -> int:
    """The sampling seed of one training rollout, from the run's seed and where the rollout stands:
    a run repeats token for token, and no two rollouts of a group draw alike."""
    return random.Random(f"{run_seed}/{step}/{scenario}/{rollout}").getrandbits(31)


def seeded_rollouts(example: Example, policy: Policy, scenario: Scenario, run_seed: int, step: int, index: int,
                    ) -> Callable[[], Awaitable[Trajectory]]:
    """What `trajectory_group` calls once per rollout: the n-th call samples with its own seed."""
    count = itertools.count()
    return lambda: run_rollout(example, replace(policy, seed=rollout_seed(run_seed, step, index, next(count))),
                               scenario)


def mean_metric(trajectories: Sequence[Trajectory], metric: str) -> float:
    return statistics.fmean(float(t.metrics.get(metric, 0)) for t in trajectories) if trajectories else 0.0


# ---------------------------------------------------------------------------------------------
# train


async def held_out_score(example: Example, model: TrainableModel, step: int, held_out: Sequence[Scenario],
                         args: argparse.Namespace, label: str) -> float:
    """The held-out score at `step` (greedy), from the history if this run already measured it."""
    for record in await model.history():
        if record["split"] == "val" and record["step"] == step:
            print(f"{label} held-out score (step {step}, from history): {record['reward/mean']:.3f}")
            return float(record["reward/mean"])
    policy = Policy(f"{model.backend.base_url}/v1", model.get_inference_name(step), temperature=0,
                    max_tokens=args.max_tokens, **args.waits)
    trajectories = await score_scenarios(example, policy, held_out)
    await model.log([TrajectoryGroup(trajectories=trajectories)], split="val")
    score = statistics.fmean(t.reward for t in trajectories)
    print(f"{label} held-out score (step {step}): {score:.3f}")
    return score


def plot_history(history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # an SFT step's record has its loss, not a reward: it is drawn as a line at its step
    sft = [r["step"] for r in history if r.get("kind") == "sft"]
    train = [(r["step"], r["reward/mean"]) for r in history if r["split"] == "train" and r.get("kind") != "sft"]
    val = [(r["step"], r["reward/mean"]) for r in history if r["split"] == "val"]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for i, step in enumerate(sft):
        axis.axvline(step, color="gray", linestyle=":", label="SFT step" if i == 0 else None)
    if train:
        axis.plot(*zip(*train), marker=".", label="train reward (rollouts)")
    if val:
        axis.plot(*zip(*val), marker="o", linestyle="--", label="held-out score")
    axis.set_xlabel("step")
    axis.set_ylabel("reward")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.set_title(f"{title}, {'SFT, then ' if sft else ''}GRPO")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


AfterEach = Callable[[TrajectoryGroup], Awaitable[Any]]  # gather_trajectory_groups' after_each


def ruler_after_each(backend: Backend, args: argparse.Namespace) -> AfterEach:
    """Score each group with RULER: the judge is --judge-model at --judge-base-url, or the base
    model on the local backend (a 135M judge demonstrates the loop; use a strong one for real)."""
    from art_integrations.rewards import Judge, ruler

    judge: Any = (Judge(base_url=args.judge_base_url, model=args.judge_model, api_key=args.judge_api_key)
                  if args.judge_base_url else backend)
    return ruler(judge=judge, swallow_exceptions=True)


def step_line(example: Example, step: int, steps: int, metrics: dict[str, Any], groups: int,
              rollout_seconds: float) -> str:
    def number(key: str, digits: int = 3) -> str:
        value = metrics.get(key)
        return "n/a" if value is None else f"{value:.{digits}f}"

    parts = "".join(f", {name} {number(f'metrics/{name}', 2)}" for name in example.metrics)
    dropped = f" ({metrics['groups/dropped']} dropped)" if metrics.get("groups/dropped") else ""
    return (f"step {step}/{steps}: reward mean {number('reward/mean')} std {number('reward/std')}{parts}, "
            f"rollouts {rollout_seconds:.2f} s, {number('seconds', 0)} s train on {metrics.get('sequences', 0)} sequences, "
            f"groups trained {metrics.get('groups/trained', 0)}/{groups}{dropped}, "
            f"policy entropy {number('entropy', 2)}")


def no_signal_note(step: int, quiet_steps: int) -> str:
    return (f"No group has had signal for {quiet_steps} steps (steps {step - quiet_steps + 1}-{step}): every rollout "
            "of each group scored the same, so GRPO had nothing to prefer and the adapter has not changed. Make "
            "rollouts of a scenario score differently: sample more of them or more varied ones (--rollouts, "
            "--temperature), or give partial credit in the reward.")


async def warm_start(example: Example, model: TrainableModel, args: argparse.Namespace) -> None:
    """One SFT step on `--sft-demos` demonstrations from training scenarios (drawn apart from the
    GRPO steps' by their own seed), each seen `--sft-epochs` times."""
    assert example.demonstrations is not None
    demonstrations = example.demonstrations(example.scenarios("train", args.sft_demos, 10_000 + args.seed))
    result = await model.train_sft(demonstrations * args.sft_epochs,
                                   TrainSFTConfig(learning_rate=args.sft_learning_rate))
    print(f"SFT step {result.step}: {len(demonstrations)} demonstrations x {args.sft_epochs} epochs, "
          f"loss {result.metrics.get('loss', float('nan')):.3f}, {result.metrics.get('seconds', 0):.0f} s", flush=True)


async def train(example: Example, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    held_out = example.scenarios("val", args.held_out, 0)
    # the pipeline drops a group whose rollouts all scored alike (ART's rule) and takes the next
    # scenario in its place, so it is given more of them, in the same order
    scenarios = example.scenarios("train", args.steps * args.scenarios_per_step * (3 if args.pipeline else 1),
                                  args.seed)
    sft_steps = 1 if args.sft_demos else 0  # the checkpoint the SFT step makes comes before the GRPO steps
    if args.sft_demos and example.demonstrations is None:
        raise SystemExit(f"--sft-demos: the {example.title} example has no demonstrations to start from")
    async with open_backend(args) as backend:
        model = TrainableModel(name=args.name or f"{example.model_prefix}-s{args.seed}", project=example.project)
        await model.register(backend)
        base = await held_out_score(example, model, 0, held_out, args, "base model")
        after_sft = None
        if sft_steps:
            if await model.get_step() == 0:
                await warm_start(example, model, args)
            after_sft = await held_out_score(example, model, 1, held_out, args, "after SFT")
        policy = Policy(f"{backend.base_url}/v1", model.inference_name, temperature=args.temperature,
                        max_tokens=args.max_tokens, **args.waits)
        after_each = ruler_after_each(backend, args) if args.ruler else None
        # the KL's reference is the policy GRPO starts from, as TRL's is: the SFT checkpoint where there is one
        config = TrainConfig(learning_rate=args.learning_rate, temperature=args.temperature,
                             scale_rewards=args.scale_rewards, beta=args.beta,
                             kl_reference_step=sft_steps if args.beta and sft_steps else None)
        first_step = await model.get_step() - sft_steps
        steps_started = time.perf_counter()
        if args.pipeline:
            from examples.pipelined import pipelined_steps

            await pipelined_steps(example, args, model, policy, scenarios, after_each, first_step, config)
        else:
            await synchronous_steps(example, args, model, policy, scenarios, after_each, first_step, config)
        steps = await model.get_step() - sft_steps - first_step
        if steps:
            seconds = time.perf_counter() - steps_started
            print(f"training: {steps} steps in {seconds:.1f} s, {60 * steps / seconds:.2f} steps/min "
                  f"({'pipeline' if args.pipeline else 'synchronous loop'})", flush=True)
        final_step = await model.get_step()
        trained = await held_out_score(example, model, final_step, held_out, args, "trained policy")
        directory = Path(args.art_dir) / model.project / "models" / model.name
        directory.mkdir(parents=True, exist_ok=True)  # a backend elsewhere keeps its checkpoints there
        plot_history(await model.history(), directory / "learning_curve.png", example.title)
        in_own_process = isinstance(backend, LocalBackend) and backend.pid is not None
    sft_part = "" if after_sft is None else f"after SFT {after_sft:.3f} -> "
    print(f"\nheld-out score: base {base:.3f} -> {sft_part}trained {trained:.3f} ({trained - base:+.3f}) "
          f"in {(time.perf_counter() - started) / 60:.1f} min")
    # the backend's own process has exited and been waited for: its peak is the children's
    backend_peak = peak_resident_gb(resource.RUSAGE_CHILDREN) if in_own_process else None
    print(memory_line(peak_resident_gb(resource.RUSAGE_SELF), backend_peak, elsewhere=args.backend_url is not None))
    print(f"checkpoints: {directory / 'checkpoints'}")
    print(f"metrics:     {directory / 'history.jsonl'}")
    print(f"plot:        {directory / 'learning_curve.png'}")


async def synchronous_steps(example: Example, args: argparse.Namespace, model: TrainableModel, policy: Policy,
                            scenarios: Sequence[Scenario], after_each: AfterEach | None, first_step: int,
                            config: TrainConfig) -> None:
    """Steps `first_step` to `args.steps`, each as ART's loop has it: gather every group, then train."""
    quiet_steps = 0  # steps in a row in which no group had signal
    for step in range(first_step, args.steps):
        batch = scenarios[step * args.scenarios_per_step:(step + 1) * args.scenarios_per_step]
        started = time.perf_counter()
        groups = await gather_trajectory_groups(
            [trajectory_group(seeded_rollouts(example, policy, s, args.seed, step, i), n=args.rollouts, scenario=s.id)
             for i, s in enumerate(batch)],
            max_exceptions=0.1, after_each=after_each, progress=False)
        called = time.perf_counter()
        result = await model.train(groups, config)
        print(step_line(example, step + 1, args.steps, result.metrics, len(groups) + len(groups.dropped),
                        called - started) + f", train() returned in {time.perf_counter() - called:.2f} s", flush=True)
        quiet_steps = 0 if result.metrics.get("groups/trained") else quiet_steps + 1
        if quiet_steps and quiet_steps % 3 == 0:
            print(no_signal_note(step + 1, quiet_steps), flush=True)


def peak_resident_gb(who: int) -> float:
    """The peak resident memory of this process (RUSAGE_SELF) or of its largest finished child
    (RUSAGE_CHILDREN), from getrusage: KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(who).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def memory_line(agent: float, backend: float | None, elsewhere: bool) -> str:
    """The job's summary line on memory: the agent's process and the backend's own, each at its peak
    (their sum bounds what the two ever held at once)."""
    if elsewhere:
        return f"peak memory: {agent:.2f} GB resident (the agent and its capture; the backend runs elsewhere)"
    if backend is None:
        return f"peak memory: {agent:.2f} GB resident (the agent, its capture and the backend in this process)"
    return (f"peak memory: {agent + backend:.2f} GB resident (backend {backend:.2f} GB, agent and capture "
            f"{agent:.2f} GB: two processes, each at its peak)")


def train_main(example: Example, description: str | None = None) -> None:
    parser = common_arguments(example, description)
    parser.add_argument("--steps", type=int, default=example.steps)
    parser.add_argument("--scenarios-per-step", type=int, default=example.scenarios_per_step)
    parser.add_argument("--rollouts", type=int, default=example.rollouts, help="rollouts per scenario (one group)")
    parser.add_argument("--learning-rate", type=float, default=example.learning_rate)
    parser.add_argument("--temperature", type=float, default=example.temperature,
                        help="sampling temperature of training rollouts")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient of the GRPO steps: toward the SFT "
                        "checkpoint with --sft-demos, else toward the base model (0: no KL term)")
    parser.add_argument("--scale-rewards", action=argparse.BooleanOptionalAction, default=example.scale_rewards,
                        help="divide each group's advantages by its reward std (--no-scale-rewards: reward minus "
                        "the group's mean, so a group's weight grows with how far its rewards differ)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help=f"model name (default: {example.model_prefix}-s<seed>)")
    parser.add_argument("--ruler", action="store_true", help="score groups with RULER instead of the task's reward "
                        "(kept as metrics/independent_reward)")
    parser.add_argument("--judge-base-url", default=None, help="RULER judge endpoint (…/v1); default: the base model")
    parser.add_argument("--judge-model", default=None)
    parser.add_argument("--judge-api-key", default="unused")
    parser.add_argument("--sft-demos", type=int, default=0, help="first one SFT step on this many demonstrations "
                        "(a scripted expert's, where the example has one), then the GRPO steps")
    parser.add_argument("--sft-epochs", type=int, default=2, help="times each demonstration is seen in the SFT step")
    parser.add_argument("--sft-learning-rate", type=float, default=5e-4)
    parser.add_argument("--pipeline", action="store_true", help="train with ART's PipelineTrainer: the next steps' "
                        "rollouts run while a step trains (pays when rollouts wait on tools or a judge)")
    parser.add_argument("--max-steps-off-policy", type=int, default=1, help="with --pipeline: how many steps older "
                        "than the checkpoint it trains a group's sampler may be")
    args = parser.parse_args()
    args.waits = checked_waits(parser, args)
    if args.beta < 0:
        parser.error(f"--beta {args.beta}: a KL coefficient, 0 (off) or more")
    if args.max_steps_off_policy < 0:
        parser.error(f"--max-steps-off-policy {args.max_steps_off_policy}: a count of steps, 0 or more")
    if args.sft_demos < 0 or args.sft_epochs < 1:
        parser.error(f"--sft-demos {args.sft_demos} --sft-epochs {args.sft_epochs}: demonstrations are counted from 0 "
                     "(0: no SFT step), epochs from 1")
    asyncio.run(train(example, args))

