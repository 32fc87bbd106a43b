"""benchmarks/peak_composition.py: the live tensors at a step's peak add up to the measured peak, which equals
remat's prediction for fp32 plans (the simulator's ledger is exact there)."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def composition():
    yield importlib.import_module("benchmarks.peak_composition")


@pytest.mark.parametrize("strategy", ["none", "full"])
def test_the_groups_add_up_to_the_measured_peak_which_is_the_predicted_one(composition, strategy, capsys):
    assert composition.main(["--size", "tiny", "--dtype", "fp32", "--strategy", strategy]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(predicted - measured +0 B)" in lines[1], lines[1]
    measured = int(lines[1].split("measured ")[1].split(" B")[0].replace(",", ""))
    groups = [int(line.split()[0].replace(",", "")) for line in lines[3:]]
    assert sum(groups) == measured
    phases = {line.split(", ")[1] for line in lines[3:]}
    assert phases == {"forward", "backward"}  # the peak falls in backward, with forward tensors still alive
