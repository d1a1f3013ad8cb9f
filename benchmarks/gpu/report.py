"""check.sh's helpers: the rows each stage adds to the kit's table (stage, measure, value; tab-
separated), the random 1.5B model the serving stage serves, and the table itself.

    python benchmarks/gpu/report.py main-rows MAIN_LOG ART_DIR
    python benchmarks/gpu/report.py json-rows unsloth|serving|pipeline FILE.json
    python benchmarks/gpu/report.py random-model DIR
    python benchmarks/gpu/report.py table ROWS.tsv DEVICE
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from art_backend.durable import read_json_lines


def rows(stage: str, pairs: list[tuple[str, object]]) -> str:
    return "".join(f"{stage}\t{measure}\t{value}\n" for measure, value in pairs)


def main_rows(log: Path, art_dir: Path) -> str:
    """The main job: the held-out line, which trainer trained, and each step's parts from its
    history record (sleep = vLLM's sleep, wake = its wake-up) and the client's train() time."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    pairs: list[tuple[str, object]] = []
    held_out = re.search(r"held-out score: base (\S+) -> trained (\S+) \((\S+)\) in (\S+) min", text)
    pairs.append(("held-out before -> after (minutes)", f"{held_out[1]} -> {held_out[2]} ({held_out[3]}) in "
                  f"{held_out[4]} min" if held_out else "not reached"))
    trainer = re.search(r"Trainer: .*", text)
    pairs.append(("trainer", trainer[0] if trainer else "not logged"))
    fallback = re.search(r"Unsloth is installed but does not import.*", text)
    if fallback:
        pairs.append(("Unsloth fallback", fallback[0]))
    calls = [float(s) for s in re.findall(r"train\(\) returned in (\S+) s", text)]
    history = next(iter(sorted(art_dir.glob("*/models/*/history.jsonl"))), None)
    records = [r for r in read_json_lines(history) if r.get("split") == "train"] if history else []
    for record, call in zip(records, calls + [None] * len(records), strict=False):
        parts = [record.get(k) for k in ("pause_seconds", "train_seconds", "resume_seconds")]
        swap = None if call is None else call - record["seconds"]
        pairs.append((f"step {record['step']} sleep / train / wake / commit+swap (s)",
                      " / ".join("n/a" if v is None else f"{v:.2f}" for v in (*parts, swap))))
    return rows("main", pairs)


def json_rows(stage: str, path: Path) -> str:
    if not path.is_file():
        return rows(stage, [("result", "none written")])
    data = json.loads(path.read_text())
    if stage == "serving":  # bench_vllm_serving.py --json
        return rows(stage, [(f"tok/s at {r['concurrency']}: ours / bare vLLM",
                             f"{r['ours-vllm_tok_s']:.0f} / {r['bare-vllm_tok_s']:.0f} "
                             f"({r['ours_vllm_over_bare_vllm']:.2f}x)") for r in data["rows"]])
    if stage == "pipeline":  # bench_pipeline.py --json: one tool wait, one seed
        loop, pipe = (next(j for j in data["jobs"] if j["mode"] == mode) for mode in ("loop", "pipeline"))
        (tools, medians), = data["medians"].items()
        sleep_wake = pipe["sleep_wake"]
        return rows(stage, [
            ("tools wait / judge waits (s)", f"{tools} / {data['judge_seconds']}"),
            ("steps/min: loop / pipeline / bound (its work)",
             f"{loop['steps_per_minute']:.2f} / {pipe['steps_per_minute']:.2f} / {medians['bound']:.2f} "
             f"({medians['bound_its_work']:.2f})"),
            ("loop step: rollouts / train (s)", f"{loop['rollout_seconds']:.1f} / {loop['train']:.1f}"),
            ("held-out gain: loop / pipeline", f"{loop['gain']:+.3f} / {pipe['gain']:+.3f}"),
            ("vLLM sleep / wake per step (s, median)",
             "n/a" if sleep_wake is None else f"{sleep_wake[0]:.2f} / {sleep_wake[1]:.2f}")])
    return rows(stage, list(data["rows"].items()))  # unsloth_vs_peft.py --json


def random_model(out: Path) -> None:
    """Qwen2.5-1.5B's shape, randomly initialised, with the embedded model's tokenizer (as the
    README's GPU measurements: no machine here reaches a model hub)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from check_vllm_gpu import build_random_model

    from art_backend.config import BackendSettings
    from art_backend.model_store import embedded_model_dir
    build_random_model("qwen2-1.5b", embedded_model_dir(BackendSettings().cache_dir), out)


def table(rows_file: Path, device: str) -> str:
    lines = [line.split("\t", 2) for line in rows_file.read_text().splitlines() if line.count("\t") >= 2]
    out = [f"GPU kit on {device}", "", "| stage | measure | value |", "| --- | --- | --- |"]
    out += [f"| {stage} | {measure} | {value.replace('|', '/')} |" for stage, measure, value in lines]
    return "\n".join(out)


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "main-rows":
        print(main_rows(Path(args[0]), Path(args[1])), end="")
    elif command == "json-rows":
        print(json_rows(args[0], Path(args[1])), end="")
    elif command == "random-model":
        random_model(Path(args[0]))
    elif command == "table":
        print(table(Path(args[0]), args[1]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
