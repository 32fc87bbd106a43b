"""gamma schedules of PGAC: fixed shapes, callables, and the learned schedule's convergence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from remat.dynamic import make_schedule
from remat.dynamic.pgac.record import step_reward
from remat.dynamic.pgac.schedules import Constant, Cosine, FromFunction, LearnedGamma, Linear


def test_fixed_schedules_follow_their_formulas():
    assert Constant(0.7)(0.0) == Constant(0.7)(1.0) == 0.7
    lin = Linear(1.5, 0.5)
    assert [lin(f) for f in (0.0, 0.25, 1.0, 2.0)] == pytest.approx([1.5, 1.25, 0.5, 0.5])
    cos = Cosine(2.0, 0.0)
    assert [cos(f) for f in (0.0, 0.5, 1.0)] == pytest.approx([2.0, 1.0, 0.0])
    assert FromFunction(lambda f: 1 + f)(0.5) == 1.5


def test_make_schedule_accepts_names_numbers_callables_and_schedules():
    assert isinstance(make_schedule("constant"), Constant) and make_schedule("constant")(0.3) == 1.0
    assert isinstance(make_schedule("linear"), Linear)
    assert isinstance(make_schedule("cosine"), Cosine)
    assert isinstance(make_schedule("learned"), LearnedGamma)
    assert make_schedule(0.8)(0.5) == 0.8
    assert make_schedule(lambda f: 2 * f)(0.25) == 0.5
    sched = Linear(1, 0)
    assert make_schedule(sched) is sched


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ("steep", ValueError, "unknown gamma schedule"),
        (-1.0, ValueError, ">= 0"),
        (True, TypeError, "not a bool"),
        ([1.0], TypeError, "gamma must be"),
    ],
)
def test_make_schedule_rejects_bad_values(bad, error, match):
    with pytest.raises(error, match=match):
        make_schedule(bad)


def test_function_schedule_rejects_negative_values():
    with pytest.raises(ValueError, match="must be >= 0"):
        FromFunction(lambda f: -1.0)(0.5)


def test_learned_schedule_rejects_bad_ranges():
    with pytest.raises(ValueError, match="low < high"):
        LearnedGamma(low=1.0, high=0.5)
    with pytest.raises(ValueError, match="strictly between"):
        LearnedGamma(init=3.0)


def test_step_reward_is_log_throughput_with_a_hinge_on_the_budget():
    assert step_reward(0.5, 90, 100) == pytest.approx(math.log(2.0))
    assert step_reward(0.5, 110, 100, penalty=10) == pytest.approx(math.log(2.0) - 1.0)
    assert step_reward(2.0, None, 100) == pytest.approx(-math.log(2.0))


def run_learner(reward, steps: int, seed: int, **kwargs) -> LearnedGamma:
    learner = LearnedGamma(seed=seed, **kwargs)
    noise = np.random.default_rng(seed + 100)
    for t in range(steps):
        f = t / steps
        g = learner(f)
        learner.observe(reward(g, f) + 0.01 * noise.standard_normal())
    return learner


def test_learned_gamma_converges_to_the_best_gamma_under_the_budget():
    # Step time grows with gamma (more recompute); memory falls with it and exceeds the budget below 0.6.
    def reward(g, f):
        return step_reward(1.0 + 0.3 * g, 1.0 + 0.5 * (0.6 - g), 1.0)

    eps = np.random.default_rng(0).standard_normal(4000)

    def smoothed(mu, sigma=0.05):  # what the learner climbs at the end: the reward averaged over its exploration
        return float(np.mean([reward(min(2.0, max(0.0, mu + sigma * e)), 0.0) for e in eps]))

    grid = np.linspace(0.3, 1.5, 121)
    best = float(grid[int(np.argmax([smoothed(m) for m in grid]))])
    assert 0.6 < best < 0.75  # just above the budget boundary, by about the final exploration width
    finals = []
    for init in (0.2, 1.6):  # from deep over the budget, and from needlessly slow
        for seed in range(4):
            learner = run_learner(reward, 1000, seed, init=init)
            assert learner.updates == 500  # one update per mirrored pair
            final = learner.mean(1.0)
            assert 0.6 <= final <= 0.85, (init, seed, final)
            assert smoothed(final) > smoothed(init)
            finals.append(final)
    assert abs(float(np.mean(finals)) - best) < 0.08, (finals, best)


def test_learned_gamma_tracks_an_optimum_that_moves_with_training():
    def reward(g, f):
        return -4 * (g - (0.3 + 0.6 * f)) ** 2

    for seed in range(3):
        learner = run_learner(reward, 1000, seed)
        assert learner.mean(1.0) == pytest.approx(0.9, abs=0.15)


def test_learned_state_dict_resumes_identically():
    a = run_learner(lambda g, f: -abs(g - 0.5), 101, seed=3)
    b = LearnedGamma(seed=99)
    b.load_state_dict(a.state_dict())
    assert [a(0.5) for _ in range(4)] == [b(0.5) for _ in range(4)]
    assert a.mean(0.2) == b.mean(0.2)


def test_learned_gamma_uses_a_private_random_stream():
    state = np.random.get_state()
    import torch

    torch_state = torch.get_rng_state()
    run_learner(lambda g, f: -g, 20, seed=0)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], state[1])


def test_pairs_with_the_same_outcome_teach_nothing():
    learner = LearnedGamma(seed=0)
    before = {k: v.copy() for k, v in learner.params.items()}
    noise = np.random.default_rng(0)
    for _ in range(100):
        learner(0.5)
        learner.observe(float(noise.standard_normal()), outcome=("keep", "checkpoint"))
    assert learner.updates == 0
    assert all(np.array_equal(before[k], learner.params[k]) for k in before)
    learner(0.5)
    learner.observe(1.0, outcome="a")
    learner(0.5)
    learner.observe(0.0, outcome="b")
    assert learner.updates == 1
