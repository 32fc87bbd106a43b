"""The ``remat`` command line: each sub-command prints its table, writes JSON, and fails clearly."""

from __future__ import annotations

import json

import pytest

from remat.cli.commands import DEFERRAL_LINE, main
from remat.profiling import transformer_layer_activation_bytes


def test_estimate_writes_the_formula(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    args = ["estimate", "--seq-len", "512", "--batch-size", "2", "--hidden", "256", "--heads", "4", "--layers", "6"]
    assert main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    per_layer = transformer_layer_activation_bytes(512, 2, 256, 4)
    assert data["per_layer_bytes"] == per_layer
    assert data["total_bytes"] == 6 * per_layer
    assert data["per_layer_full_recompute_bytes"] == 2 * 512 * 2 * 256
    assert "MiB" in capsys.readouterr().out


def test_plan_prints_a_table_and_fits_the_budget(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "mlp", "--batch-size", "16", "--strategy", "optimal", "--budget", "0.5"]
    assert main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    plan, costs = data["plan"], data["costs"]
    assert len(plan["actions"]) == len(costs["blocks"]) == 4
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    printed = capsys.readouterr().out
    assert "blocks.0" in printed and "predicted peak" in printed
    # the predicted step: the blocks kept, the rest of the step, and what the plan adds
    step = plan["predicted_step_s"]
    kept = sum(b["fwd_s"] + b["bwd_s"] for b in costs["blocks"]) + costs["outside_s"]
    assert step >= kept and f"step {step * 1e3:.2f} ms" in printed


def test_plan_on_the_meta_device_needs_no_memory(capsys):
    args = [
        "plan",
        "--model",
        "gpt2",
        "--device",
        "meta",
        "--layers",
        "4",
        "--hidden",
        "512",
        "--heads",
        "8",
        "--batch-size",
        "4",
        "--seq-len",
        "512",
        "--budget",
        "0.9",
    ]
    assert main(args) == 0
    assert "costs from meta" in capsys.readouterr().out


def test_profile_and_advise_run_on_a_small_model(tmp_path, capsys):
    out = tmp_path / "costs.json"
    assert main(["profile", "--model", "mlp", "--batch-size", "8", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["blocks"][0]["saved_bytes"]) >= {"keep", "checkpoint"}
    info = json.loads(out.read_text())["info"]
    printed = capsys.readouterr().out
    steps = info["profile_s"] / info["plain_step_s"]
    took = f"profiled in {info['profile_s']:.1f} s, {steps:.1f} plain steps"
    assert f"{took} ({info['blocks_measured']} blocks measured" in printed
    assert f"; action times from {info['action_times_from']})" in printed
    assert "step keeping everything" in printed
    rate = json.loads(out.read_text())["deferred_s_per_byte"]  # segments' waiting blocks, priced where measured
    assert (f"{DEFERRAL_LINE} {rate * 2**20 * 1e3:.3f} ms per MiB" in printed) == (rate > 0)
    assert (DEFERRAL_LINE in printed) == (rate > 0)
    # per block, what checkpointing adds to a step, recomputation + overhead, as the table has it
    row = json.loads(out.read_text())["blocks"][0]
    added = f"{row['recompute_s']['checkpoint'] * 1e3:.2f} + {row['overhead_s']['checkpoint'] * 1e3:.2f}"
    assert "ms added to a step per action: recompute + overhead" in printed
    assert f"{row['nograd_fwd_s'] * 1e3:.2f}" in printed and added in printed
    assert main(["advise", "--model", "mlp", "--batch-size", "8", "--device-memory", "1GiB"]) == 0
    assert "checkpointing is not needed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model", "mlp", "--strategy", "nonsense"], "known strategies"),
        (["plan", "--model", "mlp", "--budget", "1KiB"], "no exact plan fits --budget 1.00KiB: the least any plan"),
        (["plan", "--model", "resnet"], "resnet"),
    ],
)
def test_bad_input_fails_with_a_clear_message(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "remat.profile(" not in err  # the command's options are named, not Python calls


def test_an_infeasible_budget_names_the_budgets_the_command_can_take(capsys):
    assert main(["plan", "--model", "mlp", "--batch-size", "16", "--budget", "0.01"]) == 2
    err = capsys.readouterr().err
    share = float(err.split("--budget ")[-1].split(" or more")[0])
    assert "of the activations without checkpointing" in err and "--batch-size" in err
    assert main(["plan", "--model", "mlp", "--batch-size", "16", "--budget", str(share)]) == 0


def test_profile_prints_a_policy_a_block_cannot_run_and_why(capsys, monkeypatch):
    from remat import policies

    def refuses(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
        raise RuntimeError("this policy refuses every operator")

    monkeypatch.setitem(policies._REGISTRY, "refuses_all", policies.Policy("refuses_all", refuses))
    with pytest.warns(UserWarning, match="selective:refuses_all cannot run on"):
        assert main(["profile", "--model", "mlp", "--batch-size", "8", "--policies", "dots_saveable,refuses_all"]) == 0
    printed = capsys.readouterr().out
    header = printed.splitlines()[1]
    assert "selective:dots_saveabl" in header and "refuses_all" not in header  # columns: the actions measured
    for fqn in ("blocks.0", "blocks.3"):
        line = (
            f"{fqn}: selective:refuses_all cannot run here, left out of its plans: this policy refuses every operator"
        )
        assert line in printed


def readme_commands() -> list[list[str]]:
    """Each ``remat ...`` line of the README's command-line block, as arguments (continuations joined)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("## Command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line.split("#", 1)[0])[1:] for line in joined.splitlines() if line.startswith("remat ")]


def test_the_readmes_commands_parse_and_the_quick_ones_run(tmp_path, monkeypatch, capsys):
    """Every command the README shows names real options and models; those that run in seconds (the ``meta``
    device, ``estimate``, a tiny profile) run here. The GPT-2 ``mini`` plan and advice take a minute each and
    are run by hand (their output is in the README's figures); ``remat bench`` is ``make demo``."""
    from remat.bench.models import model_config
    from remat.cli.commands import build_parser

    commands = readme_commands()
    assert len(commands) >= 6 and commands[0] == ["bench"]
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        args = build_parser().parse_args(argv)
        if getattr(args, "model", None):
            name, preset = (args.model.split("-", 1) + [None])[:2] if "-" in args.model else (args.model, args.preset)
            model_config(name, preset or "tiny")  # the preset exists
        quick = argv[0] == "estimate" or "meta" in argv or "tiny" in argv
        if quick:
            assert main(argv) == 0, (argv, capsys.readouterr().err)
