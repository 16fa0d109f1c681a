"""Which measured cost curves are cached, and when one is measured again (costs.py)."""

from __future__ import annotations

import pytest

import specdecode.costs as costs_module
from specdecode.costs import UNCLEAN_TRIES, cached_costs, monotone, read_cached


class Target:
    """Only what cached_costs touches besides the measurement."""
    max_seq_len = 4096

    def rollback(self, n: int) -> None:
        pass


@pytest.fixture
def measurements(tmp_path, monkeypatch):
    """Each load's measurement is the next (curve, clean) of the list it is given."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    queue: list[tuple[dict[int, float], bool]] = []
    taken = []

    def fake_measure(model, context, sizes, rounds=3):
        curve, clean = queue.pop(0)
        taken.append(curve)
        out = {b: curve.get(b, curve[1]) for b in sizes}  # flat where unnamed
        return (out if clean else monotone(out)), clean  # as measure_curve returns them

    monkeypatch.setattr(costs_module, "measure_curve", fake_measure)
    return queue, taken


def relative(curve: dict[int, float]) -> dict[int, float]:
    """c(b) in plain steps, as CostModel keeps it."""
    return pytest.approx({b: c / curve[1] for b, c in curve.items()})


def load(**kw):
    return cached_costs(Target(), key="pair|machine", max_k=4, **kw)


def test_a_clean_curve_is_measured_once(measurements):
    queue, taken = measurements
    queue.append(({1: 1.0, 5: 2.0}, True))
    first, cached = load()
    assert not cached and first.verify[5] == 2.0  # c(1) = 1.0: seconds are steps
    again, cached = load()
    assert cached and again.verify == first.verify and len(taken) == 1


def test_a_noisy_machine_stops_measuring_after_a_few_loads(measurements):
    """Unclean curves are cached, measured again at the next loads, and kept (their
    per-size minimum, made monotone) after UNCLEAN_TRIES; never one per load."""
    queue, taken = measurements
    noisy = [{1: 1.2, 2: 2.5, 3: 3.0, 4: 3.5, 5: 4.0}, {1: 1.0, 2: 3.0, 3: 3.5, 4: 4.0, 5: 5.0},
             {1: 1.1, 2: 2.0, 3: 2.2, 4: 2.5, 5: 1.9}]  # the last one disturbed at b = 4
    queue += [(c, False) for c in noisy]
    kept = [{1: 1.2, 2: 2.5, 3: 3.0, 4: 3.5, 5: 4.0}, {1: 1.0, 2: 2.5, 3: 3.0, 4: 3.5, 5: 4.0},
            {1: 1.0, 2: 1.9, 3: 1.9, 4: 1.9, 5: 1.9}]
    assert len(noisy) == UNCLEAN_TRIES
    for i in range(UNCLEAN_TRIES):
        costs, cached = load()
        assert not cached and len(taken) == i + 1
        assert read_cached(Target(), key="pair|machine", max_k=4).verify == relative(kept[i])
    costs, cached = load()
    assert cached and len(taken) == UNCLEAN_TRIES and costs.verify == relative(kept[-1])


def test_a_clean_measurement_replaces_unclean_ones_and_refresh_forgets(measurements):
    queue, taken = measurements
    queue += [({1: 1.0, 5: 1.5}, False), ({1: 1.0, 5: 3.0}, True), ({1: 1.0, 5: 4.0}, False)]
    load()
    costs, cached = load()  # the unclean one was unsettled: measured again, clean now
    assert not cached and costs.verify[5] == 3.0
    assert load()[1] and len(taken) == 2
    costs, cached = load(refresh=True)
    assert not cached and costs.verify[5] == 4.0  # not merged with what was cached
