"""SIGTERM and SIGINT during training: finish the step in flight, save, exit resumable.

Schedulers (SLURM, Kubernetes, spot reclaimers) send SIGTERM and kill a grace period later; Ctrl-C
sends SIGINT. The first signal asks the loop to stop after the step it is running; the loop then
writes the final checkpoint as at the end of a run (uploads included), within
`checkpoint.grace_seconds` of the signal, after which the process exits without waiting further.
A second signal stops at once. The process exits with EXIT_STATUS[signal]: a scheduler's requeue
(or a rerun with `--resume auto`) continues from the saved step exactly.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("dflash_train")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STATUS = {"SIGTERM": 75, "SIGINT": 130}
"""75 is EX_TEMPFAIL (sysexits.h: try again later), what a requeue policy matches on; 130 is the
shell's status for Ctrl-C."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so that it ends a command as Ctrl-C does (the CLI
    installs `raise_terminated` for every command; `StopSignals` replaces it while training)."""


def raise_terminated(signum, frame) -> None:
    raise Terminated


def end_like_ctrl_c_on_sigterm() -> None:
    """SIGTERM raises Terminated in the main thread (unless the process was started ignoring it)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, raise_terminated)


def interrupt(name: str) -> KeyboardInterrupt:
    """The exception a command raises to stop as if signal `name` had reached it there."""
    return Terminated() if name == "SIGTERM" else KeyboardInterrupt()


class StopSignals:
    """`with StopSignals(grace_seconds) as signals:` around the loop; `signals.received` is the first
    signal's name ('SIGTERM', 'SIGINT') or None. Outside the main thread (where Python delivers
    signals) it installs nothing. `second_ends=False`: a second SIGTERM is not a second request (a
    distributed rank gets the scheduler's and then torchrun's, which passes it on). `on_signal(name)`
    runs in the handler, after the first."""

    def __init__(self, grace_seconds: float, second_ends: bool = True, on_signal=None):
        self.grace_seconds = grace_seconds
        self.second_ends = second_ends
        self.on_signal = on_signal
        self.received: str | None = None
        self._previous: dict = {}
        self._timer: threading.Timer | None = None
        self._deadline: float | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            # A signal the process was started ignoring (a background job's SIGINT) stays ignored.
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS
                              if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and not self.second_ends and signum == signal.SIGTERM:
            return
        if self.received is not None:  # a second signal: the default action, now
            log.warning("%s again: stopping without waiting for the checkpoint", name)
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)  # the handler before: the CLI's Terminated, or the default end
        self.received = name
        self._deadline = time.monotonic() + self.grace_seconds
        log.warning("%s: finishing the step in flight, then saving a checkpoint (within %.0f s%s)", name,
                    self.grace_seconds, f"; a second {name} stops at once" if self.second_ends or name != "SIGTERM" else "")
        self._timer = threading.Timer(self.grace_seconds, self._grace_over)
        self._timer.daemon = True
        self._timer.start()
        if self.on_signal is not None:
            self.on_signal(name)

    def remaining(self) -> float | None:
        """Seconds left of the grace period after a signal; None before one."""
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def _grace_over(self) -> None:
        log.error("%s: the checkpoint was not saved within checkpoint.grace_seconds (%.0f s); exiting without it "
                  "(--resume auto continues from the newest saved step)", self.received, self.grace_seconds)
        logging.shutdown()
        os._exit(EXIT_STATUS[self.received])
