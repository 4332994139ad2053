"""Where a run stands: the one record the loop's parts share, and what a checkpoint saves of it.

The loop advances it; the periodic parts (logging, evaluations, the held-out probe, checkpoints, the
time limits) read it to decide whether they are due, and the time limits shorten or stop it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    total_steps: int
    """The run's length: the plan's, or fewer once a time budget knows what fits."""
    step: int = 0
    """Optimizer steps done."""
    cursor: tuple[int, int] = (0, 0)
    """(epoch, batch index) of the next micro-batch."""
    stopped: str | None = None
    """Why the run stops before `total_steps` ('deadline'); None while it runs on."""
    tracking_run_id: str | None = None
    """The experiment tracker's run, continued after a resume."""

    @property
    def done(self) -> bool:
        """The last step is done: the periodic parts then run once more (logging, the probe)."""
        return self.stopped is not None or self.step >= self.total_steps

    def due(self, every: int) -> bool:
        """Whether something run every `every` steps (0: never) runs after this step."""
        return every > 0 and self.step % every == 0
