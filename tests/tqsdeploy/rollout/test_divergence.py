"""The engine's per-step divergence series: early stopping and non-finite steps, the same for every strategy."""

import math

from tqsdeploy.rollout.engine import Divergence, EarlyStop
from tqsdeploy.sweep.strategies import BY_NAME, strategy_names


def test_a_series_stops_once_gamma_settles():
    # divergence growing by a constant factor per step: gamma(t) = log(sum / delta) / t settles towards log(2)
    series = Divergence(windows=2, steps=40, delta_sq=1.0, stop=EarlyStop(tol=0.05, window=3))
    added = 0
    for t in range(40):
        added += 1
        if series.add(2.0 * 2.0**t):
            break
    assert added < 40 and series.div_sq == [2.0**t for t in range(added)] and not series.nonfinite
    gammas = [math.log(sum(series.div_sq[:t]) / 1.0) / t for t in range(added - 3, added + 1)]
    assert max(gammas) - min(gammas) <= 0.05


def test_a_series_without_early_stopping_or_perturbation_runs_every_step():
    for stop, delta_sq in ((None, 1.0), (EarlyStop(tol=10.0, window=1), 0.0)):
        series = Divergence(windows=4, steps=5, delta_sq=delta_sq, stop=stop)
        assert not any(series.add(4.0) for _ in range(5))
        assert series.div_sq == [1.0] * 5


def test_a_non_finite_step_ends_the_series_with_the_remaining_steps_infinite():
    series = Divergence(windows=1, steps=5)
    assert not series.add(1.0)
    assert series.add(math.nan)
    assert series.nonfinite and series.div_sq[0] == 1.0 and series.div_sq[1:] == [math.inf] * 4


def test_every_named_strategy_has_one_implementation():
    assert strategy_names() == ("auto", "feed", "rebuild", "unit", "prefix", "batch")
    assert all(cls.name == name and cls.help for name, cls in BY_NAME.items())
