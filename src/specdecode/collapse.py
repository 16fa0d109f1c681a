"""The acceptance-collapse guard: the controller's explicit "speculation off" state.

The controller (controller.py) already declines drafts that do not pay: free
drafts whose hindsight acceptance is below break-even are cut to nothing, a
costly drafter that does not pay is paused. The guard turns a run of such
steps into one observable state. Evidence, step by step:

- below break-even (`below`): no option was drafted although some drafter was
  there to judge (a costly one paused or priced at length 0, a free draft cut
  to length 0), or a verified draft emitted fewer tokens than its cost in plain
  steps;
- paid (`paid`): a verified draft emitted at least its cost in plain steps.

WINDOW below-break-even steps with no paid one in between engage the guard
(steps with no evidence, e.g. a lookup that found nothing, count neither
way). While engaged, steps are plain without asking any drafter, except one
probe step in every PROBE_EVERY, planned as usual (free drafts proposed and
judged, a costly drafter's pause counting down, its probes); the first probe
whose draft pays releases the guard. The guard belongs to the controller, so
on a server it spans requests (a workload that does not pay stays off for the
next request too, and is probed there).

Nothing here changes what is emitted: a plain step is the target's own step.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = 32  # below-break-even steps in a row (none paid between) that engage the guard
PROBE_EVERY = 8  # while engaged, every PROBE_EVERY-th step is planned as usual


@dataclass
class CollapseGuard:
    """State of one controller's guard (see the module doc). engagements: times it
    engaged so far; plain_steps: steps it made plain so far."""

    window: int = WINDOW
    probe_every: int = PROBE_EVERY
    run: int = 0  # below-break-even steps since the last paid one
    engaged: bool = False
    engagements: int = 0
    plain_steps: int = 0
    _since_probe: int = 0

    def probe_now(self) -> bool:
        """Whether this step may be planned as usual (always, unless engaged: then one
        step in probe_every); a step that may not counts as made plain."""
        if not self.engaged:
            return True
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            return True
        self.plain_steps += 1
        return False

    def below(self) -> None:
        """One step whose options (or whose verified draft) were below break-even."""
        self.run += 1
        if not self.engaged and self.run >= self.window:
            self.engaged, self._since_probe = True, 0
            self.engagements += 1

    def paid(self) -> None:
        """A verified draft paid for its step: the run ends, the guard releases."""
        self.run, self.engaged = 0, False

    def to_dict(self) -> dict[str, object]:
        return {"engaged": self.engaged, "engagements": self.engagements,
                "plain_steps": self.plain_steps, "run": self.run, "window": self.window,
                "probe_every": self.probe_every}
