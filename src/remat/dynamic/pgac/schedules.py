"""Schedules of PGAC's threshold scale gamma as a function of the training fraction ``f`` in [0, 1].

PGAC stores block ``l`` when its EMA score is at least ``tau = gamma(f) * quantile_q(scores)``, so a larger
gamma recomputes more blocks and a smaller one stores more. The schedules:

* :class:`Constant` ``gamma(f) = value``;
* :class:`Linear` from ``start`` at ``f = 0`` to ``end`` at ``f = 1``;
* :class:`Cosine` from ``start`` to ``end`` along half a cosine;
* :class:`FromFunction`: any callable of ``f``;
* :class:`LearnedGamma`: a 1-16-1 MLP of ``f`` trained online from the measured step time and peak memory,
  by comparing mirrored exploration samples (see its docstring for exactly what it optimises).

The defaults of "linear" and "cosine" follow the PGAC proposal: prune more (recompute more) early in
training and store more later, 1.5 -> 0.5 times the q-quantile. :func:`make_schedule` turns the ``gamma=``
argument of :class:`remat.PGAC` into a schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


class Schedule:
    """gamma as a function of the training fraction. ``observe(reward)`` is only used by learned schedules."""

    learns = False

    def __call__(self, fraction: float) -> float:
        raise NotImplementedError

    def observe(self, reward: float, outcome: Hashable = None) -> None:
        """Reward of the gamma returned by the last call, and what that gamma did (e.g. the plan it
        produced). Only learned schedules use them."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class Constant(Schedule):
    def __init__(self, value: float = 1.0) -> None:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"gamma must be a finite number >= 0, got {value}")
        self.value = float(value)

    def __call__(self, fraction: float) -> float:
        return self.value

    def __repr__(self) -> str:
        return f"Constant({self.value})"


class Linear(Schedule):
    def __init__(self, start: float = 1.5, end: float = 0.5) -> None:
        _check_range(start, end)
        self.start, self.end = float(start), float(end)

    def __call__(self, fraction: float) -> float:
        f = _clip01(fraction)
        return self.start + (self.end - self.start) * f

    def __repr__(self) -> str:
        return f"Linear({self.start}, {self.end})"


class Cosine(Schedule):
    def __init__(self, start: float = 1.5, end: float = 0.5) -> None:
        _check_range(start, end)
        self.start, self.end = float(start), float(end)

    def __call__(self, fraction: float) -> float:
        f = _clip01(fraction)
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * f))

    def __repr__(self) -> str:
        return f"Cosine({self.start}, {self.end})"


class FromFunction(Schedule):
    def __init__(self, fn: Callable[[float], float]) -> None:
        self.fn = fn

    def __call__(self, fraction: float) -> float:
        value = float(self.fn(_clip01(fraction)))
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the gamma function returned {value} at fraction {fraction}; it must be >= 0")
        return value

    def __repr__(self) -> str:
        return f"FromFunction({getattr(self.fn, '__name__', self.fn)!r})"


@dataclass
class _Pair:
    """A pair of mirrored samples ``mu(f) + sigma * eps`` and ``mu(f) - sigma * eps``."""

    fraction: float
    eps: float
    sigma: float
    first_reward: float | None = None
    first_outcome: Hashable = None
    second_half: bool = False


MAX_WIDEN = 4.0


class LearnedGamma(Schedule):
    """gamma from a small MLP of the training fraction, trained online from the reward of each step.

    Net: ``mu_theta(f) = low + (high - low) * sigmoid(w2 . tanh(w1 * (2f - 1) + b1) + b2)``, 16 hidden units
    (1-16-1), starting at ``mu = init``. Exploration: calls come in mirrored pairs; the first returns
    ``mu(f) + sigma(f) * eps`` with ``eps ~ N(0, 1)``, the next ``mu(f) - sigma(f) * eps`` (clipped to
    ``[low, high]``), with ``sigma(f)`` going linearly from ``sigma`` to ``sigma_end`` over training. After
    ``observe`` has reported the reward of both (each the reward of the step that ran with that gamma's
    mask), the net takes one Adam step along ``(r_plus - r_minus) / scale * eps * dmu/dtheta`` with ``scale``
    a running mean of ``|r_plus - r_minus|`` (the ratio capped at 3). A pair whose two samples had the same
    outcome (``observe(reward, outcome)``; PGAC passes the plan the gamma produced) or equal rewards carries
    no information about gamma, only timing noise: it is skipped, and the exploration widens by 1.25x (up
    to 4x) so that the next pairs reach the edges of the plateau; informative pairs narrow it back by 0.9x.

    What it optimises: ``E[(r_plus - r_minus) * eps] / (2 sigma)`` estimates ``dJ/dmu`` for the smoothed reward
    ``J(mu) = E_eps[r(mu + sigma * eps)]`` (antithetic finite differences, i.e. REINFORCE with the mirrored
    sample as baseline), so at each training fraction ``mu(f)`` climbs ``J`` and settles at a maximiser of
    the reward averaged over the exploration width. That width shrinks over training, so early on the
    net is cautious near the budget (a sample that overshoots costs much more than one that is slow) and
    later it settles close to the best gamma itself. Pairing adjacent steps cancels slow drifts of the step
    time (data, clocks, other jobs); the running scale makes the step size independent of the reward's units.

    :class:`remat.PGAC` gives ``r = -log(step seconds) - overshoot_penalty * max(0, peak / budget - 1)``
    (:func:`remat.dynamic.pgac.controller.step_reward`): log throughput, with a hinge penalty when the step's
    activation peak (measured when measured, else the simulator's prediction) exceeds the budget. A larger
    gamma recomputes more blocks (slower, less memory), so the optimum is the smallest gamma whose steps
    stay within the budget, and the net learns where that lies as the scores evolve over training.
    Randomness comes from a private generator (``seed``): the training RNG streams are untouched and every
    rank of a job explores identically.
    """

    learns = True

    def __init__(
        self,
        low: float = 0.0,
        high: float = 2.0,
        init: float = 1.0,
        *,
        hidden: int = 16,
        sigma: float = 0.15,
        sigma_end: float | None = 0.05,
        lr: float = 0.005,
        seed: int = 0,
    ) -> None:
        if not 0 <= low < high or not math.isfinite(high):
            raise ValueError(f"LearnedGamma needs 0 <= low < high, got low={low}, high={high}")
        if not low < init < high:
            raise ValueError(f"init must lie strictly between low={low} and high={high}, got {init}")
        sigma_end = sigma if sigma_end is None else sigma_end
        if sigma <= 0 or sigma_end <= 0 or lr <= 0:
            raise ValueError(f"LearnedGamma needs sigma, sigma_end and lr > 0, got {sigma}, {sigma_end}, {lr}")
        self.low, self.high, self.sigma, self.sigma_end, self.lr = low, high, sigma, sigma_end, lr
        self._rng = np.random.default_rng(seed)
        p = (init - low) / (high - low)
        self.params = {
            "w1": self._rng.normal(0.0, 0.3, hidden),  # small: mu starts nearly flat in f and generalises
            "b1": self._rng.normal(0.0, 0.5, hidden),
            "w2": self._rng.normal(0.0, 0.01, hidden),
            "b2": np.array([math.log(p / (1 - p))]),
        }
        self._adam = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in self.params.items()}
        self._adam_t = 0
        self._pair: _Pair | None = None
        self.diff_scale: float | None = None  # running mean of |r_plus - r_minus|
        self.updates = 0
        self.widen = 1.0  # exploration multiplier: grows on plateaus where both samples give one plan

    # ----- the net -----
    def _forward(self, fraction: float) -> tuple[float, dict[str, np.ndarray]]:
        x = 2.0 * _clip01(fraction) - 1.0
        p = self.params
        h = np.tanh(p["w1"] * x + p["b1"])
        z = float(p["w2"] @ h + p["b2"][0])
        s = 1.0 / (1.0 + math.exp(-z))
        mu = self.low + (self.high - self.low) * s
        dmu_dz = (self.high - self.low) * s * (1.0 - s)
        dpre = dmu_dz * p["w2"] * (1.0 - h * h)
        grads = {"w1": dpre * x, "b1": dpre, "w2": dmu_dz * h, "b2": np.array([dmu_dz])}
        return mu, grads

    def mean(self, fraction: float) -> float:
        """The net's gamma at ``fraction``, without exploration noise."""
        return self._forward(fraction)[0]

    def __call__(self, fraction: float) -> float:
        f = _clip01(fraction)
        pair = self._pair
        if pair is not None and not pair.second_half and pair.first_reward is not None:
            pair.second_half = True
            pair.fraction = f
            sample = -pair.eps * pair.sigma
        else:
            sigma = (self.sigma + (self.sigma_end - self.sigma) * f) * self.widen
            self._pair = _Pair(f, float(self._rng.standard_normal()), sigma)
            sample = self._pair.eps * sigma
        return min(self.high, max(self.low, self.mean(f) + sample))

    def observe(self, reward: float, outcome: Hashable = None) -> None:
        pair = self._pair
        if pair is None or not math.isfinite(reward):
            return
        if not pair.second_half:
            pair.first_reward, pair.first_outcome = reward, outcome
            return
        self._pair = None
        assert pair.first_reward is not None
        if outcome is not None and outcome == pair.first_outcome:
            # Both samples did the same thing: the reward difference is only noise. Look further next time.
            self.widen = min(MAX_WIDEN, self.widen * 1.05)
            return
        self.widen = max(1.0, self.widen * 0.8)
        diff = pair.first_reward - reward  # r(mu + sigma eps) - r(mu - sigma eps)
        # Scale-free step: the difference in units of its running mean magnitude (outliers capped at 3).
        size = abs(diff)
        if size <= 1e-9 * (1.0 + abs(reward)):
            return  # the two masks performed the same (e.g. both samples gave one plan): nothing to learn
        if self.diff_scale is None:
            self.diff_scale = size
        else:
            self.diff_scale = 0.95 * self.diff_scale + 0.05 * min(size, 3.0 * self.diff_scale or size)
        if self.diff_scale <= 0.0:
            return
        direction = max(-3.0, min(3.0, diff / self.diff_scale))
        _, grads = self._forward(pair.fraction)
        self._adam_step({k: direction * pair.eps * g for k, g in grads.items()})
        self.updates += 1

    def _adam_step(self, ascent: dict[str, np.ndarray], b1: float = 0.9, b2: float = 0.999) -> None:
        self._adam_t += 1
        for k, g in ascent.items():
            m, v = self._adam[k]
            m[:] = b1 * m + (1 - b1) * g
            v[:] = b2 * v + (1 - b2) * g * g
            m_hat = m / (1 - b1**self._adam_t)
            v_hat = v / (1 - b2**self._adam_t)
            self.params[k] = self.params[k] + self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)

    # ----- checkpoints -----
    def state_dict(self) -> dict[str, Any]:
        return {
            "params": {k: v.tolist() for k, v in self.params.items()},
            "adam": {k: (m.tolist(), v.tolist()) for k, (m, v) in self._adam.items()},
            "adam_t": self._adam_t,
            "updates": self.updates,
            "widen": self.widen,
            "diff_scale": self.diff_scale,
            "rng": self._rng.bit_generator.state,
            "pair": asdict(self._pair) if self._pair is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.params = {k: np.array(v, dtype=float) for k, v in state["params"].items()}
        self._adam = {k: (np.array(m, dtype=float), np.array(v, dtype=float)) for k, (m, v) in state["adam"].items()}
        self._adam_t = state["adam_t"]
        self.updates = state["updates"]
        self.widen = state.get("widen", 1.0)
        self.diff_scale = state["diff_scale"]
        self._rng.bit_generator.state = state["rng"]
        pair = state.get("pair")
        if pair is not None and isinstance(pair.get("first_outcome"), list):  # a plan through JSON
            pair = {**pair, "first_outcome": tuple(pair["first_outcome"])}
        self._pair = _Pair(**pair) if pair is not None else None

    def __repr__(self) -> str:
        return (
            f"LearnedGamma(low={self.low}, high={self.high}, sigma={self.sigma}->{self.sigma_end}, "
            f"updates={self.updates})"
        )


NAMED: dict[str, Callable[[], Schedule]] = {
    "constant": Constant,
    "linear": Linear,
    "cosine": Cosine,
    "learned": LearnedGamma,
}
NEEDS_LENGTH = (Linear, Cosine)


def make_schedule(gamma: str | float | Schedule | Callable[[float], float]) -> Schedule:
    """The schedule for PGAC's ``gamma=``: a name, a number (constant), a Schedule or a callable of f."""
    if isinstance(gamma, Schedule):
        return gamma
    if isinstance(gamma, bool):
        raise TypeError("gamma must be a number, a schedule name, a Schedule or a callable, not a bool")
    if isinstance(gamma, int | float):
        return Constant(float(gamma))
    if isinstance(gamma, str):
        try:
            return NAMED[gamma]()
        except KeyError:
            raise ValueError(
                f"unknown gamma schedule {gamma!r}; use one of {sorted(NAMED)}, a number, a "
                "remat.dynamic.pgac.schedules.Schedule or a function of the training fraction"
            ) from None
    if callable(gamma):
        return FromFunction(gamma)
    raise TypeError(f"gamma must be a number, a schedule name, a Schedule or a callable, got {type(gamma).__name__}")


def _clip01(f: float) -> float:
    return min(1.0, max(0.0, float(f)))


def _check_range(start: float, end: float) -> None:
    for v in (start, end):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"schedule end points must be finite numbers >= 0, got start={start}, end={end}")
