"""Statistics that compare strategies (agreement with scipy, degenerate inputs, pairing by key) and the
energy meter's handling of hardware counters (faked: this machine may expose none)."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from remat.bench import energy as E
from remat.bench.stats import compare, drop_warmup, median_interval, paired_test, summarize, summarize_by

# ------------------------------------------------------------------------------------------ statistics


def test_summary_matches_scipy_t_interval():
    values = np.random.default_rng(0).normal(10.0, 2.0, size=12)
    s = summarize(values, confidence=0.9)
    low, high = sps.t.interval(0.9, 11, loc=values.mean(), scale=sps.sem(values))
    assert s.n == 12 and s.mean == pytest.approx(values.mean())
    assert (s.ci_low, s.ci_high) == (pytest.approx(low), pytest.approx(high))
    assert s.std == pytest.approx(values.std(ddof=1))
    assert s.ci_low < s.mean < s.ci_high
    assert s.reason == "" and isinstance(s.ci_low, float)


def test_summary_of_known_values():
    s = summarize([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, 2) = 4.302653
    assert s.mean == 2.0 and s.ci_high - 2.0 == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)


def test_summary_degenerate_inputs():
    assert summarize([]).mean is None and summarize([]).reason == "no measurements"
    one = summarize([4.0])
    assert (one.mean, one.ci_low, one.ci_high, one.n) == (4.0, None, None, 1) and "one measurement" in one.reason
    flat = summarize([3.0, 3.0, 3.0])
    assert (flat.ci_low, flat.ci_high) == (3.0, 3.0) and "zero variance" in flat.reason
    with pytest.raises(ValueError, match="non-finite"):
        summarize([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        summarize([1.0, 2.0], confidence=95)


def test_paired_test_matches_scipy_ttest_rel():
    rng = np.random.default_rng(1)
    baseline = rng.normal(100.0, 5.0, size=15)
    strategy = baseline * 0.9 + rng.normal(0.0, 2.0, size=15)
    c = paired_test(list(strategy), list(baseline))
    ref = sps.ttest_rel(strategy, baseline)
    ci = ref.confidence_interval(0.95)
    assert c.n == 15 and c.unpaired == 0
    assert c.p_value == pytest.approx(ref.pvalue) and c.statistic == pytest.approx(ref.statistic)
    assert (c.ci_low, c.ci_high) == (pytest.approx(ci.low), pytest.approx(ci.high))
    assert c.diff == pytest.approx((strategy - baseline).mean())
    assert c.relative_diff == pytest.approx((strategy.mean() - baseline.mean()) / baseline.mean())
    assert c.ci_low < c.diff < c.ci_high
    assert c.significant and c.to_dict()["significant"] is True


def test_pairing_by_key_ignores_order_and_counts_unpaired():
    base = {(0, 1): 1.0, (0, 2): 2.0, (1, 1): 3.0, (1, 2): 5.0}
    strat = {(1, 2): 5.5, (0, 1): 1.2, (1, 1): 3.1, (0, 2): 2.4, (2, 0): 99.0}  # (2, 0) has no partner
    c = paired_test(strat, base)
    ref = sps.ttest_rel([1.2, 2.4, 3.1, 5.5], [1.0, 2.0, 3.0, 5.0])
    assert c.n == 4 and c.unpaired == 1 and c.p_value == pytest.approx(ref.pvalue)
    assert c.mean == pytest.approx((1.2 + 2.4 + 3.1 + 5.5) / 4)


def test_paired_test_degenerate_inputs():
    same = paired_test([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same.p_value == 1.0 and same.diff == 0.0 and "identical" in same.reason
    shifted = paired_test([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    assert shifted.p_value is None and shifted.diff == 1.0 and "zero variance" in shifted.reason
    assert (shifted.ci_low, shifted.ci_high) == (1.0, 1.0) and not shifted.significant
    one = paired_test([2.0], [1.0])
    assert one.p_value is None and one.n == 1 and one.relative_diff == 1.0 and "one pair" in one.reason
    none = paired_test({}, {(0, 0): 1.0})
    assert none.n == 0 and none.mean is None and none.unpaired == 1
    assert paired_test([1.0, 2.0], [0.0, 0.5]).relative_diff is not None
    assert paired_test([1.0, 2.0], [0.0, 0.0]).relative_diff is None  # baseline mean 0
    with pytest.raises(ValueError, match="equal lengths"):
        paired_test([1.0, 2.0], [1.0])
    with pytest.raises(TypeError, match="both"):
        paired_test({(0, 0): 1.0}, [1.0])
    with pytest.raises(ValueError, match="non-finite"):
        paired_test([1.0, float("inf")], [1.0, 2.0])


def _rows():
    rows = []
    rng = np.random.default_rng(2)
    for seed in range(4):
        for step in range(6):
            base = 1.0 + 0.1 * seed + rng.normal(0, 0.01) + (0.5 if step == 0 else 0.0)  # step 0 warms up
            rows.append({"strategy": "none", "seed": seed, "step": step, "time_s": base})
            rows.append({"strategy": "sqrt", "seed": seed, "step": step, "time_s": base * 1.3 + rng.normal(0, 0.01)})
    return rows


def test_compare_rows_by_step_and_by_seed():
    rows = drop_warmup(_rows(), warmup=1)
    assert len(rows) == 2 * 4 * 5 and min(r["step"] for r in rows) == 1
    by_step = compare(rows, value="time_s", baseline="none")
    assert set(by_step) == {"sqrt"}
    c = by_step["sqrt"]
    assert c.n == 20 and c.relative_diff == pytest.approx(0.3, abs=0.02) and c.p_value < 1e-6

    by_seed = compare(rows, value="time_s", baseline="none", by=("seed",))["sqrt"]
    per_seed = {
        s: [np.mean([r["time_s"] for r in rows if r["strategy"] == s and r["seed"] == k]) for k in range(4)]
        for s in ("none", "sqrt")
    }
    assert by_seed.n == 4
    assert by_seed.p_value == pytest.approx(sps.ttest_rel(per_seed["sqrt"], per_seed["none"]).pvalue)

    summaries = summarize_by(rows, value="time_s", by=("seed",))
    assert summaries["none"].mean == pytest.approx(np.mean(per_seed["none"]))
    with pytest.raises(ValueError, match="baseline 'dtr' has no rows"):
        compare(rows, value="time_s", baseline="dtr")
    with pytest.raises(KeyError, match="lacks"):
        compare([{"strategy": "none", "seed": 0}], value="time_s", baseline="none")


# ---------------------------------------------------------------------------------------------- energy


def _zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int = 1_000_000) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(label + "\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


def test_rapl_counts_packages_only_and_unwraps(tmp_path):
    pkg0 = _zone(tmp_path, "intel-rapl:0", "package-0", 900_000)
    pkg1 = _zone(tmp_path, "intel-rapl:1", "package-1", 100)
    core = _zone(tmp_path, "intel-rapl:0:0", "core", 5)  # inside package-0: not counted twice
    _zone(tmp_path, "intel-rapl:2", "psys", 0)  # whole platform: overlaps the packages
    meter = E.EnergyMeter("rapl", powercap_root=tmp_path).start()
    (pkg0 / "energy_uj").write_text("950000")
    meter.sample()
    (pkg0 / "energy_uj").write_text("50000")  # wrapped past 1,000,000 uJ
    (pkg1 / "energy_uj").write_text("300100")
    (core / "energy_uj").write_text("999999")
    reading = meter.stop()
    # package-0: 50,000 + (1,000,000 - 950,000) + 50,000 = 150,000 uJ; package-1: 300,000 uJ
    assert reading.by_source == {"rapl:package-0": pytest.approx(0.15), "rapl:package-1": pytest.approx(0.3)}
    assert reading.joules == pytest.approx(0.45) and reading.kwh == pytest.approx(0.45 / 3.6e6)
    assert reading.source == "rapl:package-0+rapl:package-1" and reading.reason == ""
    assert reading.watts is not None and reading.watts > 0


def test_rapl_permission_error_gives_no_figure_and_the_reason(tmp_path, monkeypatch):
    _zone(tmp_path, "intel-rapl:0", "package-0", 10)

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(E, "_read_int", denied)
    with E.EnergyMeter("rapl", powercap_root=tmp_path) as meter:
        pass
    assert meter.reading.joules is None and meter.reading.kwh is None and meter.reading.source == "none"
    assert "permission denied" in meter.reading.reason and "root" in meter.reading.reason


def test_no_counters_means_no_figure(tmp_path):
    reading = E.EnergyMeter("rapl", powercap_root=tmp_path / "absent").start().stop()
    assert reading.joules is None and "no RAPL package zones" in reading.reason
    with pytest.raises(ValueError, match="unknown energy source"):
        E.EnergyMeter("wattmeter")
    with pytest.raises(RuntimeError, match="before start"):
        E.EnergyMeter("rapl").stop()


def _fake_pynvml(energy_mj: list[int], supported: bool = True) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def total_energy(handle):
        if not supported:
            raise NVMLError("Not Supported")
        return energy_mj.pop(0)

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: ("gpu", index)
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: ("gpu", uuid)
    nvml.nvmlDeviceGetTotalEnergyConsumption = total_energy
    return nvml


def test_nvml_energy_and_visible_device_mapping(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([5_000_000, 5_012_500]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    reading = E.EnergyMeter("nvml", gpu_index=1).start().stop()
    assert reading.joules == pytest.approx(12.5) and reading.source == "nvml:gpu1"

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], supported=False))
    reading = E.EnergyMeter("nvml", gpu_index=0).start().stop()
    assert reading.joules is None and "Not Supported" in reading.reason

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    reading = E.EnergyMeter("nvml", gpu_index=0).start().stop()
    assert reading.joules is None and "nvidia-ml-py" in reading.reason


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_median_interval_takes_the_widest_order_statistics_the_binomial_tail_allows(confidence):
    for n in range(1, 61):
        values = [float(v) for v in range(n, 0, -1)]  # x_(i) = i once sorted: the interval reads off the ranks
        got = median_interval(values, confidence)
        assert got.median == (n + 1) / 2 and got.n == n
        tail = (1 - confidence) / 2
        ranks = [k for k in range(1, n // 2 + 1) if sps.binom.cdf(k - 1, n, 0.5) <= tail]
        if not ranks:
            assert got.low is None and got.high is None and "too few" in got.reason
            continue
        k = max(ranks)
        assert (got.low, got.high) == (k, n + 1 - k)
        # its coverage: the median lies outside only when at most k - 1 values fall on one side
        assert 1 - 2 * sps.binom.cdf(k - 1, n, 0.5) >= confidence


def test_median_interval_known_ranks_and_bad_input():
    assert (median_interval(range(1, 17)).low, median_interval(range(1, 17)).high) == (4, 13)  # tables: n=16
    assert median_interval(range(1, 6)).reason == "5 values are too few for a 95% interval"
    assert median_interval([]).median is None
    with pytest.raises(ValueError, match="non-finite"):
        median_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0, 2.0], confidence=1.0)
