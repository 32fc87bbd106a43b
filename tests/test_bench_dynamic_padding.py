"""``remat bench --dynamic-padding``: GPT-2 on Shakespeare's paragraphs, each batch padded to its longest, the plans
per input shape within the one byte budget, every step's measured peak recorded next to the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remat.bench.records import read_jsonl
from remat.bench.runner import main
from remat.bench.text_data import MIN_PARAGRAPH, SHORT_EVERY, PaddedText

STEPS = 10
ARGS = ["--dynamic-padding", "--model", "gpt2", "--seq-len", "192", "--max-bytes", "200000", "--steps", str(STEPS),
        "--warmup", "1", "--seeds", "1", "--strategies", "none,optimal,pgac", "--eval-batches", "1", "--threads", "1",
        "--profile-repeats", "1", "--no-progress"]  # fmt: skip


def test_batches_are_padded_to_their_longest_paragraph_and_every_tenth_is_short() -> None:
    data = PaddedText(seq_len=192, batch_size=6, seed=0, split="train", tokenizer="bytes", max_bytes=200000)
    batches = data.train_batches()
    lengths = set()
    for k in range(2 * SHORT_EVERY):
        ids, labels, mask = next(batches)
        rows = 2 if k % SHORT_EVERY == SHORT_EVERY - 1 else 6
        assert ids.shape == labels.shape == mask.shape and ids.shape[0] == rows
        real = mask.sum(1)
        assert int(real.max()) == ids.shape[1] <= 192 and int(real.min()) >= MIN_PARAGRAPH  # padded to the longest
        assert torch.equal(labels == -100, mask == 0)
        assert bool((ids[mask == 0] == data.eot_token_id).all())  # the pad
        lengths.add(ids.shape[1])
    assert len(lengths) > 1  # the shapes change
    largest = data.largest_batch()[0]
    assert largest.shape == (6, 192)
    kwargs = data.batch_kwargs(next(batches))
    assert set(kwargs) == {"input_ids", "attention_mask", "labels"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("padded")
    assert main([*ARGS, "--out", str(out)]) == 0
    return out


def test_every_step_is_measured_against_the_budget_and_the_plans_hold_it(bench: Path) -> None:
    steps = read_jsonl(bench / "steps.jsonl")
    budget = json.loads((bench / "config.json").read_text())["budget"]["bytes"]
    for strategy in ("none", "optimal", "pgac"):
        mine = [s for s in steps if s["strategy"] == strategy]
        assert len(mine) == STEPS and all(s["peak_activation_bytes"] is not None for s in mine), strategy
        assert all(s["budget_bytes"] == budget for s in mine)
        assert len({tuple(s["shape"]) for s in mine}) > 1, [s["shape"] for s in mine]  # dynamic padding
    runs = {r["strategy"]: r for r in read_jsonl(bench / "runs.jsonl")}
    for strategy in ("optimal", "pgac"):
        run = runs[strategy]
        assert run["status"] == "ok" and run["steps_measured"] == STEPS and run["steps_refused"] == 0
        assert run["steps_over_budget"] == 0 and run["worst_peak_over_budget"] <= 1.02, run
    assert runs["none"]["worst_peak_over_budget"] > 1.02  # keep-all at the profiled shape is twice the budget
    shape_plans = json.loads((bench / runs["optimal"]["artifact"]).read_text())["shape_plans"]
    assert "plans per shape within" in shape_plans
    report = (bench / "report.md").read_text()
    assert "## Every step against the budget" in report and "| `optimal` | 0 | 10 | 0 |" in report


@pytest.mark.parametrize(
    "change, message",
    [
        (["--model", "mlp"], "use --model gpt2, not 'mlp'"),
        (["--strategies", "none,compile_budget"], "leave out ['compile_budget']"),
    ],
)
def test_what_dynamic_padding_cannot_run_is_refused_before_training(
    change: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = list(ARGS)
    args[args.index(change[0]) + 1] = change[1]
    assert main([*args, "--out", str(tmp_path / "bad")]) == 2
    assert message in capsys.readouterr().err
