"""Which measured cost curves are cached, and when one is measured again (costs.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import specdecode.costs as costs_module
from specdecode.costs import (
    TRY_SPACING,
    UNCLEAN_KEEP,
    UNCLEAN_TRIES,
    cached_costs,
    monotone,
    read_cached,
)

KEY = "pair|machine"


class Target:
    """Only what cached_costs touches besides the measurement."""
    max_seq_len = 4096

    def rollback(self, n: int) -> None:
        pass


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Each load's measurement is the next (curve, clean) of `queue`; `clock[0]` is
    the wall time cached_costs sees."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    state = SimpleNamespace(queue=[], taken=[], clock=[1e9])

    def fake_measure(model, context, sizes, rounds=3):
        curve, clean = state.queue.pop(0)
        state.taken.append(curve)
        out = {b: curve.get(b, curve[1]) for b in sizes}  # flat where unnamed
        return (out if clean else monotone(out)), clean  # as measure_curve returns them

    monkeypatch.setattr(costs_module, "measure_curve", fake_measure)
    monkeypatch.setattr(costs_module, "time", SimpleNamespace(time=lambda: state.clock[0]))
    return state


def load(**kw):
    return cached_costs(Target(), key=KEY, max_k=4, **kw)


def relative(curve: dict[int, float]) -> dict[int, float]:
    """c(b) in plain steps, as CostModel keeps it."""
    return pytest.approx({b: c / curve[1] for b, c in curve.items()})


def prior():
    return read_cached(Target(), key=KEY, max_k=4)


def test_a_clean_curve_is_measured_once(machine):
    machine.queue.append(({1: 1.0, 5: 2.0}, True))
    first, cached = load()
    assert not cached and first.verify[5] == 2.0  # c(1) = 1.0: seconds are steps
    again, cached = load()
    assert cached and again.verify == first.verify and len(machine.taken) == 1
    assert prior().verify == first.verify


NOISY = [{1: 1.2, 2: 2.5, 3: 3.0, 4: 3.5, 5: 4.0}, {1: 1.0, 2: 3.0, 3: 3.5, 4: 4.0, 5: 5.0},
         {1: 1.1, 2: 2.0, 3: 2.2, 4: 2.5, 5: 1.9}]  # the last one disturbed at b = 4
MERGED = [{1: 1.2, 2: 2.5, 3: 3.0, 4: 3.5, 5: 4.0}, {1: 1.0, 2: 2.5, 3: 3.0, 4: 3.5, 5: 4.0},
          {1: 1.0, 2: 1.9, 3: 1.9, 4: 1.9, 5: 1.9}]  # per-size minimum so far


def test_a_noisy_machine_stops_measuring_after_a_few_spaced_loads(machine):
    """Unclean curves are cached, measured again at later loads, and kept (their
    per-size minimum) after UNCLEAN_TRIES tries TRY_SPACING apart; not a prior
    before that (a default must not be settled by one disturbed run)."""
    assert len(NOISY) == UNCLEAN_TRIES
    machine.queue += [(c, False) for c in NOISY]
    for i in range(UNCLEAN_TRIES):
        costs, cached = load()
        assert not cached and len(machine.taken) == i + 1 and costs.verify == relative(MERGED[i])
        assert (prior() is None) == (i < UNCLEAN_TRIES - 1)
        machine.clock[0] += TRY_SPACING
    costs, cached = load()
    assert cached and len(machine.taken) == UNCLEAN_TRIES and costs.verify == relative(MERGED[-1])
    assert prior().verify == costs.verify


def test_one_busy_spell_is_one_try_and_a_kept_curve_expires(machine):
    machine.queue += [(c, False) for c in NOISY * 3]
    for _ in range(UNCLEAN_TRIES + 1):  # loads a minute apart: one spell
        load()
        machine.clock[0] += 60
    assert len(machine.taken) == UNCLEAN_TRIES + 1 and prior() is None
    machine.clock[0] += TRY_SPACING
    load()  # the second try
    machine.clock[0] += TRY_SPACING
    assert load()[0].verify == relative(MERGED[-1]) and prior() is not None  # the third
    machine.clock[0] += UNCLEAN_KEEP
    costs, cached = load()  # expired: measured again, starting over
    assert not cached and costs.verify == relative(NOISY[0]) and prior() is None


def test_a_clean_measurement_replaces_unclean_ones_and_refresh_forgets(machine):
    machine.queue += [(NOISY[2], False), ({1: 1.0, 5: 3.0}, True), (NOISY[0], False),
                      (NOISY[1], False)]
    load()
    costs, cached = load()  # the unclean one was unsettled: measured again, clean now
    assert not cached and costs.verify[5] == 3.0
    assert load()[1] and len(machine.taken) == 2
    load(refresh=True)
    machine.clock[0] += TRY_SPACING
    costs, cached = load(refresh=True)  # not merged with what was cached
    assert not cached and costs.verify == relative(NOISY[1])


def test_a_curve_cached_before_tries_were_counted_is_settled(machine, tmp_path):
    machine.queue.append(({1: 1.0, 5: 2.0}, True))
    load()
    path = next((tmp_path / "costs").glob("*.json"))
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({k: saved[k] for k in ("key", "verify", "draft_per_token")}))
    assert load()[1] and len(machine.taken) == 1 and prior() is not None
