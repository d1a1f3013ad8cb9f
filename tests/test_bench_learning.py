"""The learning benchmark's summary counts a seed at the edge of a target as reaching it: scores are
printed to three places, and their float differences land either side of the edge."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_learning import Run, print_table


def test_a_seed_at_the_edge_of_a_target_counts_as_reaching_it(capsys) -> None:
    runs = [Run(0, "torch", 0.375, 1.000, 2.5, 2.2), Run(0, "vllm", 0.375, 0.950, 9.9, 0.4),
            Run(1, "torch", 0.271, 0.571, 2.5, 2.2), Run(1, "vllm", 0.271, 0.775, 9.0, 0.4),
            Run(2, "torch", 0.375, 0.950, 2.5, 2.2), Run(2, "vllm", 0.375, 0.879, 9.6, 0.4)]
    print_table(runs, ["torch", "vllm"], target=0.3)
    out = capsys.readouterr().out
    assert "seed 0 -0.050, seed 1 +0.204, seed 2 -0.071; seeds within 0.05 or above: 2/3" in out
    torch_row = next(line for line in out.splitlines() if line.strip().startswith("torch"))
    assert torch_row.split()[4] == "3/3"  # seed 1's 0.571 - 0.271 reaches the +0.30 target


def test_a_job_that_starts_with_sft_gets_its_score_after_the_sft_step_in_a_column(capsys) -> None:
    from bench_learning import SUMMARY

    line = ("held-out score: base 0.271 -> after SFT 0.512 -> trained 0.604 (+0.333) in 6.1 min\n"
            "peak memory: 2.61 GB resident (backend 2.40 GB, agent and capture 0.21 GB: two processes, each at its peak)")
    match = SUMMARY.search(line)
    assert match is not None and (match["base"], match["sft"], match["trained"]) == ("0.271", "0.512", "0.604")
    assert SUMMARY.search(line.replace("after SFT 0.512 -> ", ""))["sft"] is None
    print_table([Run(0, "torch", 0.271, 0.604, 6.1, 2.61, after_sft=0.512)], ["torch"], target=0.2)
    header, row = capsys.readouterr().out.strip().splitlines()[:2]
    assert header.split()[3:5] == ["after", "SFT"] and row.split()[3] == "0.512"


def test_each_gain_carries_its_paired_standard_error_from_the_recorded_held_out_scenarios(tmp_path, capsys) -> None:
    import json

    from bench_learning import held_out_rewards, paired_standard_error

    val = tmp_path / "project" / "models" / "agent" / "trajectories" / "val"
    val.mkdir(parents=True)
    scored = {0: [0.0, 0.5, 1.0, 0.0], 1: [0.5, 0.5, 1.0, 1.0], 9: [1.0, 0.5, 1.0, 0.5]}
    for step, rewards in scored.items():
        groups = [{"trajectories": [{"reward": r, "metadata": {"scenario": f"val-{i}"}}]} for i, r in enumerate(rewards)]
        (val / f"{step:04d}.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    base, after_sft, trained = held_out_rewards(tmp_path)
    assert trained == {"val-0": 1.0, "val-1": 0.5, "val-2": 1.0, "val-3": 0.5}
    # trained - base per scenario: 1, 0, 0, 0.5 -> sample std 0.4787, over sqrt(4)
    assert abs(paired_standard_error(base, trained) - 0.4787 / 2) < 1e-3
    assert paired_standard_error({"val-0": 0.0}, {"val-0": 1.0}) is None  # one scenario: no spread to measure
    print_table([Run(0, "torch", 0.375, 0.75, 6.1, 2.61, after_sft=0.75, gain_se=0.239, grpo_added_se=0.144)],
                ["torch"], target=0.2)
    out = capsys.readouterr().out
    assert "+0.375 ±0.239" in out and "+0.000 ±0.144" in out
    assert "GRPO added to what SFT reached on 0/1 seeds (least +0.000)" in out
