"""SFT (ART's `train_sft`, `train_sft_from_file`) on the tiny model: a real step lowers the
demonstrated answer's cross-entropy and is a checkpoint like a GRPO step's (served as `name@1`,
in the history and the viewer, pushed, pulled and resumed elsewhere); demonstrations without
token ids render to exactly what serving prompts and produces, in each family's tool-call
markup; the loss is the token-mean cross-entropy, packed; a bad file line is refused by its
number, with nothing trained."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

import art_integrations as art
from art_backend.chat_service import ChatService
from art_backend.engine.base import end_of_turn_ids
from art_backend.protocol import ChatCompletionRequest
from art_backend.training.service import TrainingService
from art_backend.training.packing import pack
from art_backend.training.sft import SFT_LOSS, Renderer, SFTStats, plan_sft, trajectory_sequences
from art_backend.training.trainer import LoraTrainer
from art_backend.viewer.app import create_viewer_app
from art_backend.viewer.tokens import Tokenizers
from art_integrations import (BackendError, LoraConfig, RemoteBackend, TrainableModel, TrainConfig, Trajectory,
                              TrajectoryGroup, TrainSFTConfig)
from art_integrations.art_compat import names
from art_integrations.trajectory import Choice
from art_integrations.utils.sft import SFTFileError, create_lr_schedule, read_sft_file, train_sft_from_file
from tests.chat_families import FAMILIES, _family_tokenizer
from tests.conftest import ServerThread, training_server, vllm_engine

SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the inbox",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "system", "content": "You find emails."},
    {"role": "user", "content": "Find the invoice from Zoé"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": json.dumps({"q": "invoice"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "email 7: invoice due Friday"},
    {"role": "assistant", "content": "It is email 7, due Friday."},
]
ANSWER = [{"role": "user", "content": "What is the code word?"},
          {"role": "assistant", "content": "The code word is pineapple."}]


# ----- rendering: what serving would have prompted and produced ------------------------------

def _serving(tokenizer: Any) -> ChatService:
    """Serving's chat service over an engine that lends it only its tokenizer: prompts are built as
    a request's are (`ChatService.prepare`: template, tool markup, continuation of earlier turns)."""
    engine = SimpleNamespace(tokenizer=tokenizer, base_model_name="m", max_model_len=4096,
                             served_models=lambda: ["m"], chat_formatter=lambda tools, reasoning: _formatter(tokenizer))
    return ChatService(engine)  # type: ignore[arg-type]


def _formatter(tokenizer: Any) -> Any:
    from art_backend.chat_format import ChatFormatter

    return ChatFormatter(tokenizer)


@pytest.mark.parametrize("family", ["smollm2", "qwen2_5", "qwen3", "llama3_1", "llama3_2", "mistral_nemo"])
def test_a_rendered_conversation_is_what_serving_prompts_and_produces(family: str, tiny_model_dir: Path) -> None:
    if family == "smollm2":  # no tools in its template: they are taught in Hermes markup
        from transformers import AutoTokenizer

        tokenizer, generation_eos = AutoTokenizer.from_pretrained(tiny_model_dir), None
    else:
        tokenizer = _family_tokenizer(family, tiny_model_dir)
        generation_eos = tokenizer.convert_tokens_to_ids(FAMILIES[family]["generation_eos"])
    serving = _serving(tokenizer)
    stop_ids = sorted(end_of_turn_ids(tokenizer, generation_eos))
    renderer = Renderer(serving.formatter, tokenizer, stop_ids)

    turns = renderer.turns(CONVERSATION, [SEARCH], "conversation")
    assert len(turns) == 2
    for turn, upto in zip(turns, (2, 4)):
        request = ChatCompletionRequest(model="m", messages=CONVERSATION[:upto], tools=[SEARCH])
        prepared = serving.prepare(request)
        assert prepared.generation.prompt_ids == turn.prompt  # the prompt serving builds, token for token
        # the completion: the reply's text, then the end-of-turn token serving stops on
        assert turn.completion[-1] in stop_ids
        text = tokenizer.decode(turn.completion[:-1], skip_special_tokens=False)
        parsed = serving.formatter.parse(text, prepared.prompt, prepared.tools)
        demonstrated = CONVERSATION[upto]
        # (stripped: Qwen3's reply opens with an empty think block, and the text after it with "\n\n")
        assert (parsed.content or "").strip() == (demonstrated["content"] or "")
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in demonstrated.get("tool_calls", [])]
        # what serving does when a choice finishes, so the next turn's prompt continues its ids
        serving.continuations.remember(turn.prompt, turn.completion,
                                       [c["id"] for c in demonstrated.get("tool_calls", [])])

    stats = SFTStats()
    sequences = trajectory_sequences(Trajectory(messages_and_choices=CONVERSATION, tools=[SEARCH]), "t", renderer,
                                     "all", 4096, len(tokenizer), stats)
    trained = [t for s in sequences for t, m in zip(s.token_ids, s.assistant_mask) if m]
    assert trained == turns[0].completion + turns[1].completion
    # Mistral's template shows the system prompt in the last user turn only; Qwen3's writes an earlier
    # reply back without the (empty) think block it opened with: each turn is then a sequence of its own
    if family in ("mistral_nemo", "qwen3"):
        assert stats.prefix_breaks == 1 and [s.token_ids for s in sequences] == [
            turn.prompt + turn.completion for turn in turns]
    else:  # one sequence: the second prompt extends the first turn's tokens
        assert stats.prefix_breaks == 0 and sequences[0].token_ids == turns[1].prompt + turns[1].completion


def test_captured_turns_keep_their_exact_tokens_and_last_trains_only_the_last(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = Renderer(_serving(tokenizer).formatter, tokenizer, sorted(end_of_turn_ids(tokenizer, None)))
    first = Choice(message={"role": "assistant", "content": "hi"}, prompt_token_ids=[1, 2, 3], token_ids=[40, 41, 2])
    second = Choice(message={"role": "assistant", "content": "ok"}, prompt_token_ids=[1, 2, 3, 40, 41, 2, 7],
                    token_ids=[50, 2])
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, first,
                                                  {"role": "user", "content": "y"}, second])
    stats = SFTStats()
    [every] = trajectory_sequences(trajectory, "t", renderer, "all", 4096, len(tokenizer), stats)
    assert every.token_ids == [1, 2, 3, 40, 41, 2, 7, 50, 2]  # as captured, not re-tokenized
    assert every.assistant_mask == [False] * 3 + [True] * 3 + [False] + [True] * 2
    [last] = trajectory_sequences(trajectory, "t", renderer, "last", 4096, len(tokenizer), stats)
    assert last.assistant_mask == [False] * 7 + [True] * 2
    assert stats.exact_histories == 2 and stats.rendered_histories == 0
    with pytest.raises(ValueError, match="every assistant turn starts after token 3"):  # nothing left to learn
        trajectory_sequences(trajectory, "t", renderer, "all", 3, len(tokenizer), stats)


# ----- the loss --------------------------------------------------------------------------------

def test_the_loss_is_the_token_mean_cross_entropy_packed_with_the_shared_prefix_once(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = Renderer(_serving(tokenizer).formatter, tokenizer, sorted(end_of_turn_ids(tokenizer, None)))
    system = {"role": "system", "content": "You answer questions about capitals, in one word. " * 8}
    demonstrations = [Trajectory(messages_and_choices=[system, {"role": "user", "content": f"Capital of {c}?"},
                                                       {"role": "assistant", "content": a}])
                      for c, a in [("France", "Paris"), ("Peru", "Lima"), ("Japan", "Tokyo")]]
    [batch] = plan_sft(demonstrations, TrainSFTConfig(batch_size=3), renderer, 4096, len(tokenizer)).batches
    [packed_batch] = pack(batch, 2048)
    assert packed_batch.token_ids.shape[0] == 1  # one row: the system prompt's tokens are in it once
    assert packed_batch.tokens < sum(len(s) for s in batch) - 2 * 80

    torch.manual_seed(0)
    trainer = LoraTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    trainer._adapter("m", LoraConfig(), None)  # noqa: SLF001 - the adapter both ways are computed with
    assert trainer.peft is not None
    with torch.no_grad():  # B starts at zero: give the adapter an effect, so its gradients are all non-zero
        for name, param in trainer.peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)

    def loss_and_gradients(packing: bool) -> tuple[float, dict[str, torch.Tensor]]:
        assert trainer.peft is not None
        trainer.packing = packing
        trainer.peft.zero_grad(set_to_none=True)
        loss = trainer.accumulate_gradients(batch, TrainConfig(), SFT_LOSS)["loss"]
        return loss, {n: p.grad.clone() for n, p in trainer.peft.named_parameters() if p.grad is not None}

    packed_loss, packed = loss_and_gradients(True)
    plain_loss, plain = loss_and_gradients(False)
    with torch.no_grad():  # the formula, straight: (1/|T|) sum over trained tokens of -log p(x_t | x_<t)
        nll = []
        for sequence in batch:
            ids = torch.tensor([sequence.token_ids])
            logp = torch.log_softmax(trainer.peft(input_ids=ids).logits[0, :-1].float(), -1)
            picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
            nll.append(-picked[torch.tensor(sequence.assistant_mask[1:])])
        formula = float(torch.cat(nll).mean())
    assert packed_loss == pytest.approx(formula, rel=1e-5) and plain_loss == pytest.approx(formula, rel=1e-5)
    assert packed.keys() == plain.keys() and packed
    for name, gradient in packed.items():
        torch.testing.assert_close(gradient, plain[name], rtol=1e-4, atol=1e-7, msg=name)


# ----- a real step on the tiny model ----------------------------------------------------------

def _cross_entropy(model_dir: Path, tokens: list[int], mask: list[bool], adapter: Path | None) -> float:
    """The token-mean cross-entropy of the trained tokens, under the base model or base + adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    trained = torch.tensor(mask[1:])
    return float(-picked[trained].mean())


async def test_an_sft_step_lowers_the_answer_s_cross_entropy_is_served_synced_and_resumed(
        tiny_engine: Any, tiny_model_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    art_dir = tmp_path / ".art"
    renderer = TrainingService(tiny_engine, art_dir)._renderer()
    [sequence] = trajectory_sequences(Trajectory(messages_and_choices=ANSWER), "t", renderer, "all", 4096,
                                      len(tiny_engine.tokenizer), SFTStats())
    before = _cross_entropy(tiny_model_dir, sequence.token_ids, sequence.assistant_mask, None)

    with training_server(tiny_engine, art_dir) as server:
        backend = RemoteBackend(server.base_url)
        model = TrainableModel(name="sft-agent", project="sft")
        await model.register(backend)
        # the served prompt of a conversation's first turn is the rendered one, over HTTP too
        [first, _] = renderer.turns(CONVERSATION, [SEARCH], "conversation")
        served = await model.openai_client().chat.completions.create(
            model="sft-agent", messages=CONVERSATION[:2], tools=[SEARCH], max_tokens=1,
            extra_body={"return_token_ids": True})
        assert served.model_extra["prompt_token_ids"] == first.prompt

        demonstrations = [Trajectory(messages_and_choices=ANSWER) for _ in range(4)]
        result = await model.train_sft(demonstrations, TrainSFTConfig(learning_rate=2e-3, batch_size=1))

        assert result.step == 1 and await model.get_step() == 1
        metrics = result.metrics
        assert metrics["kind"] == "sft" and metrics["optimizer_steps"] == 4
        assert metrics["tokens/assistant"] == 4 * sum(sequence.assistant_mask)
        assert metrics["histories/rendered"] == 4 and metrics["loss/last_batch"] < metrics["loss/first_batch"]
        record = [r for r in await model.history() if r["split"] == "train"][-1]
        assert record["step"] == 1 and record["loss"] == pytest.approx(metrics["loss"])
        reply = await model.openai_client().chat.completions.create(model="sft-agent@1", messages=ANSWER[:1],
                                                                    max_tokens=3)
        assert reply.choices[0].message is not None  # the checkpoint is served as name@1
        store = f"file://{tmp_path / 'store'}"
        assert (await backend.push_checkpoints(model, store))["steps"] == [1]  # checkpoint sync takes it
        await backend.close()

    viewer = TestClient(create_viewer_app(art_dir, Tokenizers(cache_dir)))
    shown = viewer.get("/sft/sft-agent/train/1")  # the step's demonstrations, in the viewer
    assert shown.status_code == 200 and "pineapple" in shown.text

    checkpoint = art_dir / "sft" / "models" / "sft-agent" / "checkpoints" / "0001"
    after = _cross_entropy(tiny_model_dir, sequence.token_ids, sequence.assistant_mask, checkpoint)
    assert after < before - 0.5, (before, after)

    # another backend, on an empty art dir, pulls it and resumes: the next SFT step continues its
    # adapter and optimizer (a restart on the same art dir resumes the same way: test_crash_recovery.py)
    elsewhere = tmp_path / "elsewhere"
    with training_server(tiny_engine, elsewhere) as server:
        backend = RemoteBackend(server.base_url)
        model = TrainableModel(name="sft-agent", project="sft")
        await backend.pull_checkpoints(model, store)
        await model.register(backend)
        assert await model.get_step() == 1
        assert [r["kind"] for r in await model.history() if r["split"] == "train"] == ["sft"]
        second = await model.train_sft(demonstrations[:2], TrainSFTConfig(learning_rate=2e-3, batch_size=2))
        assert second.step == 2 and second.metrics["optimizer_steps"] == 1
        await backend.close()
    optimizer = torch.load(elsewhere / "sft" / "models" / "sft-agent" / "checkpoints" / "0002" / "optimizer.pt",
                           weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {5.0}  # 4 updates of step 1, then 1


@pytest.mark.vllm
async def test_an_sft_step_on_the_vllm_engine_trains_its_trainer_s_copy_and_serves_name_at_1(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = vllm_engine(tiny_model_dir)
    try:
        with training_server(engine, tmp_path / ".art") as server:
            backend = RemoteBackend(server.base_url)
            model = TrainableModel(name="sft-vllm", project="sft")
            await model.register(backend)
            result = await model.train_sft([Trajectory(messages_and_choices=ANSWER)] * 3,
                                           TrainSFTConfig(learning_rate=2e-3, batch_size=1))
            assert result.step == 1 and result.metrics["optimizer_steps"] == 3
            assert result.metrics["loss/last_batch"] < result.metrics["loss/first_batch"]
            reply = await model.openai_client().chat.completions.create(model="sft-vllm@1", messages=ANSWER[:1],
                                                                        max_tokens=3)
            assert reply.choices[0].finish_reason in ("stop", "length")  # vLLM serves the SFT checkpoint
            await backend.close()
    finally:
        await engine.close()


async def test_a_demonstration_that_cannot_be_trained_refuses_the_step(tiny_training_server: ServerThread) -> None:
    backend = RemoteBackend(tiny_training_server.base_url)
    model = TrainableModel(name="sft-refused", project="sft-refused")
    await model.register(backend)
    no_answer = Trajectory(messages_and_choices=[{"role": "user", "content": "hello?"}])
    with pytest.raises(BackendError, match="Nothing was trained: trajectory 1 has no assistant turn"):
        await model.train_sft([Trajectory(messages_and_choices=ANSWER), no_answer])
    with pytest.raises(ValueError, match="no trajectories"):
        await model.train_sft([])
    with pytest.raises(ValueError, match="only `metric_logging`"):  # ART's dev.TrainSFTConfig's one field
        await model.train_sft([Trajectory(messages_and_choices=ANSWER)], _config={"precalculate_logprobs": True})
    with pytest.raises(TypeError, match=r"pass the trajectories of groups, \[t for group in groups"):
        await model.train_sft([TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=ANSWER)])])
    with pytest.raises(BackendError, match="1 rates, but 2 trajectories in batches of 1 make 2 batches"):
        await model.train_sft([Trajectory(messages_and_choices=ANSWER)] * 2,
                              TrainSFTConfig(learning_rate=[1e-4], batch_size=1))
    assert await model.get_step() == 0
    await backend.close()


# ----- train_sft_from_file ------------------------------------------------------------------

def _line(**fields: Any) -> str:
    return json.dumps(fields)


def test_every_bad_line_is_refused_by_its_number_and_nothing_is_trained(tmp_path: Path) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    lines = [
        _line(messages=CONVERSATION, tools=[SEARCH]),  # good
        '{"messages": [',  # 2: not JSON
        _line(conversation=ANSWER),  # 3: no messages
        _line(messages=[{"role": "robot", "content": "beep"}, ANSWER[1]]),  # 4: wrong role
        _line(messages=[ANSWER[0], {"role": "assistant", "tool_calls": [  # 5: arguments not JSON
            {**call, "function": {"name": "search", "arguments": "{q: x}"}}]}]),
        _line(messages=[ANSWER[0], {"role": "assistant", "tool_calls": [  # 6: a call without its id
            {"type": "function", "function": call["function"]}]}]),
        "",  # blank lines are skipped
        _line(messages=[ANSWER[0], {"role": "assistant", "tool_calls": [  # 8: arguments as an object
            {**call, "function": {"name": "search", "arguments": {"q": "x"}}}]}], tools=[SEARCH]),
        _line(messages=[ANSWER[0]]),  # 9: nothing to learn from
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SFTFileError) as refused:
        read_sft_file(path)
    message = str(refused.value)
    assert "7 of its lines cannot be trained on, so nothing was trained" in message
    for expected in ("line 2: not JSON", "line 3: unknown key 'conversation'", "line 4: messages[0] has role 'robot'",
                     "line 5: messages[1].tool_calls[0].function.arguments is not valid JSON",
                     "line 6: messages[1].tool_calls[0] must look like",
                     "line 8: messages[1].tool_calls[0].function.arguments must be a string of JSON",
                     "line 9: no assistant message to learn from"):
        assert expected in message
    assert "line 1:" not in message and "line 7:" not in message

    class NeverTrained:
        async def train_sft(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("a file with a bad line trained")

    import asyncio

    with pytest.raises(SFTFileError, match="line 2: not JSON"):
        asyncio.run(train_sft_from_file(NeverTrained(), str(path)))  # type: ignore[arg-type]


def test_a_file_without_messages_says_how_to_write_one(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(_line(tools=[SEARCH]) + "\n")
    with pytest.raises(SFTFileError, match=r'line 1: no `messages`: each line must be \{"messages": '):
        read_sft_file(path)


async def test_train_sft_from_file_trains_one_step_on_art_s_schedule(tiny_training_server: ServerThread,
                                                                     tmp_path: Path) -> None:
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(_line(messages=m, **({"tools": [SEARCH]} if m is CONVERSATION else {})) + "\n"
                            for m in (CONVERSATION, ANSWER, ANSWER)))
    backend = RemoteBackend(tiny_training_server.base_url)
    model = TrainableModel(name="sft-file", project="sft-file")
    await model.register(backend)
    result = await train_sft_from_file(model, str(path), epochs=2, batch_size=2, peak_lr=1e-3)
    assert result is not None and result.step == 1 and await model.get_step() == 1
    schedule = create_lr_schedule(3, 1e-3, "linear", 0)  # 6 rows in batches of 2: 3 batches, no warmup (int(0.3))
    assert schedule == pytest.approx([1e-3, 5e-4, 0.0])
    assert result.metrics["optimizer_steps"] == 3 and result.metrics["trajectories"] == 6
    assert result.metrics["learning_rate"] == pytest.approx(1e-3) and result.metrics["learning_rate/last"] == 0.0
    await backend.close()


def test_art_s_sft_names_are_offered_not_refused() -> None:
    assert art.TrainSFTConfig is TrainSFTConfig
    assert TrainSFTConfig() == TrainSFTConfig(learning_rate=5e-5, batch_size="auto", assistant_turns="all")
    assert "TrainSFTConfig" not in names.PACKAGE_NAMES
    assert "train_sft" not in art.Model.ART_METHODS
    with pytest.raises(ValueError, match="assistant_turns"):
        TrainSFTConfig(assistant_turns="first")  # type: ignore[arg-type]
