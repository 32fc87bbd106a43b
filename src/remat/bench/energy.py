"""Energy used by a stretch of training, read from the counters the hardware keeps.

- ``nvml``: the GPU's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, NVIDIA Volta and
  later) through ``pynvml`` (PyPI ``nvidia-ml-py``), for the CUDA device in use;
- ``rapl``: the CPU package counters of Linux powercap (``/sys/class/powercap/intel-rapl:N/energy_uj``;
  AMD processors appear under the same name), with wrap-around handled.

Where a counter cannot be read the reading says which and why; a figure is never estimated. A counter
that can wrap (RAPL wraps after ``max_energy_range_uj``, minutes to hours) is handled once between two
reads, so long runs should call :meth:`EnergyMeter.sample` now and then (once per step is plenty).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POWERCAP_ROOT = Path("/sys/class/powercap")
JOULES_PER_KWH = 3.6e6


@dataclass(frozen=True)
class EnergyReading:
    """Energy over one measured interval. ``joules`` is None when no counter could be read; ``reason``
    then says why (and, when only some counters were read, which were not)."""

    joules: float | None
    seconds: float
    source: str
    reason: str
    by_source: dict[str, float] = field(default_factory=dict)

    @property
    def kwh(self) -> float | None:
        return None if self.joules is None else self.joules / JOULES_PER_KWH

    @property
    def watts(self) -> float | None:
        if self.joules is None or self.seconds <= 0:
            return None
        return self.joules / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "joules": self.joules,
            "kwh": self.kwh,
            "watts": self.watts,
            "seconds": self.seconds,
            "source": self.source,
            "reason": self.reason,
            "by_source": dict(self.by_source),
        }


class CounterUnavailable(Exception):
    """A counter cannot be read; the message is the reason shown to people."""


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


class _RaplZone:
    """One CPU package's cumulative counter, in joules, unwrapped across counter overflows."""

    def __init__(self, zone: Path) -> None:
        self.zone = zone
        try:
            self.name = "rapl:" + zone.joinpath("name").read_text().strip()
            self.max_uj = _read_int(zone / "max_energy_range_uj")
            self._last = _read_int(zone / "energy_uj")
        except PermissionError as err:
            raise CounterUnavailable(
                f"permission denied reading {err.filename or zone}: Linux lets only root read RAPL counters "
                "(run as root, or `chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj`)"
            ) from err
        except (OSError, ValueError) as err:
            raise CounterUnavailable(f"cannot read RAPL zone {zone}: {err}") from err
        self._total_uj = 0

    def read(self) -> float:
        raw = _read_int(self.zone / "energy_uj")
        # A smaller value than last time means the counter wrapped past max_energy_range_uj.
        self._total_uj += raw - self._last if raw >= self._last else raw + self.max_uj - self._last
        self._last = raw
        return self._total_uj / 1e6


class _NvmlDevice:
    """One GPU's total-energy counter (millijoules since the driver loaded), in joules."""

    def __init__(self, index: int | None) -> None:
        try:
            import pynvml
        except ImportError as err:
            raise CounterUnavailable("pynvml is not installed (pip install nvidia-ml-py)") from err
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            self._handle, label = _nvml_handle(pynvml, _current_cuda_index() if index is None else index)
            self.name = f"nvml:{label}"
            self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except pynvml.NVMLError as err:
            raise CounterUnavailable(f"NVML cannot report GPU energy: {err}") from err

    def read(self) -> float:
        return (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj) / 1e3


def _current_cuda_index() -> int:
    import torch

    if not torch.cuda.is_available():
        raise CounterUnavailable("no CUDA device is visible to torch")
    return torch.cuda.current_device()


def _nvml_handle(pynvml: Any, index: int) -> tuple[Any, str]:
    """NVML handle of CUDA device ``index``, following CUDA_VISIBLE_DEVICES (NVML numbers all GPUs)."""
    visible = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if index < len(visible):
        entry = visible[index]
        if entry.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entry)), f"gpu{entry}"
        return pynvml.nvmlDeviceGetHandleByUUID(entry), entry
    return pynvml.nvmlDeviceGetHandleByIndex(index), f"gpu{index}"


def _rapl_zones(root: Path) -> list[Path]:
    """Top-level package zones (``intel-rapl:0``), not their sub-zones (``intel-rapl:0:0``, core/dram)
    nor ``psys``, which already include or overlap the packages."""
    zones = [z for z in sorted(root.glob("intel-rapl:*")) if z.name.count(":") == 1]
    packages = []
    for zone in zones:
        try:
            name = zone.joinpath("name").read_text().strip()
        except OSError:
            name = ""
        if name != "psys":
            packages.append(zone)
    return packages


class EnergyMeter:
    """Measure energy between :meth:`start` and :meth:`stop`, or around a ``with`` block (``.reading``).

    ``sources``: ``"auto"`` (NVML when torch sees a CUDA device, plus RAPL), or any of ``"nvml"``,
    ``"rapl"``. ``gpu_index`` is the CUDA device index (default: the current device). The CUDA device
    is synchronised before each read so queued kernels count in the interval they were launched in.
    """

    def __init__(
        self,
        sources: str | Sequence[str] = "auto",
        *,
        gpu_index: int | None = None,
        powercap_root: Path | str = POWERCAP_ROOT,
    ) -> None:
        if isinstance(sources, str):
            sources = _auto_sources() if sources == "auto" else (sources,)
        unknown = set(sources) - {"nvml", "rapl"}
        if unknown:
            raise ValueError(f"unknown energy source(s) {sorted(unknown)}; use 'auto', 'nvml' or 'rapl'")
        self.sources = tuple(sources)
        self.gpu_index = gpu_index
        self.powercap_root = Path(powercap_root)
        self.reading: EnergyReading | None = None
        self._counters: list[Any] = []
        self._problems: list[str] = []
        self._last: dict[str, float] = {}
        self._t0: float | None = None

    def start(self) -> EnergyMeter:
        self._counters, self._problems, self._last = [], [], {}
        _synchronize()
        for source in self.sources:
            try:
                if source == "nvml":
                    self._counters.append(_NvmlDevice(self.gpu_index))
                else:
                    zones = _rapl_zones(self.powercap_root)
                    if not zones:
                        raise CounterUnavailable(f"no RAPL package zones under {self.powercap_root}")
                    self._counters += [_RaplZone(zone) for zone in zones]
            except CounterUnavailable as err:
                self._problems.append(f"{source}: {err}")
        self._t0 = time.perf_counter()
        return self

    def sample(self) -> None:
        """Read every counter now (keeps wrapping counters honest on long runs)."""
        if self._t0 is None:
            raise RuntimeError("EnergyMeter.sample() called before start()")
        for counter in list(self._counters):
            try:
                self._last[counter.name] = counter.read()
            except Exception as err:  # a counter that fails mid-run is dropped, with the reason kept
                self._counters.remove(counter)
                self._last.pop(counter.name, None)
                self._problems.append(f"{counter.name}: read failed ({err})")

    def stop(self) -> EnergyReading:
        if self._t0 is None:
            raise RuntimeError("EnergyMeter.stop() called before start()")
        _synchronize()
        self.sample()
        seconds = time.perf_counter() - self._t0
        self._t0 = None
        by_source = {counter.name: self._last[counter.name] for counter in self._counters}
        joules = sum(by_source.values()) if by_source else None
        reason = "; ".join(self._problems)
        if joules is None and not reason:
            reason = "no energy source requested"
        source = "+".join(by_source) if by_source else "none"
        self.reading = EnergyReading(joules=joules, seconds=seconds, source=source, reason=reason, by_source=by_source)
        return self.reading

    def __enter__(self) -> EnergyMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _auto_sources() -> tuple[str, ...]:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    return ("nvml", "rapl") if has_cuda else ("rapl",)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def energy_available(sources: str | Sequence[str] = "auto") -> tuple[bool, str]:
    """``(True, source)`` when at least one requested counter can be read now, else ``(False, reason)``."""
    meter = EnergyMeter(sources).start()
    reading = meter.stop()
    return (reading.joules is not None, reading.source if reading.joules is not None else reading.reason)
