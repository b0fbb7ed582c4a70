"""Fault handling for one rank of a multi-process run: no rank hangs when another fails.

- A background thread publishes this rank's position (step and instruction) in the job's store whenever
  it changes, and watches for the job's abort record.
- A rank whose step raises writes the abort record (the first writer wins) naming itself, the
  instruction it was at and the error, waits briefly for the others to acknowledge, and exits 1.
- A rank that sees the abort record prints it with its own position and exits 1 at once, even while
  its main thread is blocked in a transfer.
- A rank that dies without a word (killed, os._exit) is found by its peers: their transfers with it fail
  (the connection closes) or time out; the first to notice writes the abort record naming the dead rank
  and the last position it published.
- Under torchrun, the launcher stops the other workers with SIGTERM once one has failed. SIGTERM is
  blocked in every thread and taken by a signal thread, which prints the abort record (waiting up to a
  few seconds for one) before exiting, so every rank says why it stopped.
- At the end of a successful run, `stop` joins both threads and closes the monitor's store connections
  before the process group is destroyed: no thread of the monitor may be left when the interpreter shuts
  down, since a thread that comes back from torch's C++ code (a store call releases the GIL) once the
  interpreter is finalizing is ended by `pthread_exit`, and that unwinds through C++ frames that cannot be
  unwound: `std::terminate`, "terminate called without an active exception", SIGABRT.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

ABORT = "pipec/abort"
ACKS = "pipec/stopped"
BEAT = "pipec/beat/"  # + rank: a counter the watcher adds to every BEAT_EVERY seconds
BEAT_EVERY = 0.25
DONE = "pipec/done/"  # + rank: set when a rank's run is over, so its silence from then on is no failure
STOPPED = 75  # exit status of a rank that stops because another one failed (the failing one exits 1)


def die_with_parent() -> None:
    """Linux: have the kernel kill this rank when its parent (torchrun's agent, or `pipec run`) dies, so a
    SIGKILL of the launcher leaves no rank training on. Call first thing; if the parent is already gone
    by then, exit at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(STOPPED)


def block_sigterm() -> None:
    """Call before any thread starts (before importing torch) so the signal thread alone takes SIGTERM."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Monitor:
    def __init__(
        self,
        rank: int,
        world: int,
        where: Callable[[], str],
        store_factory: Callable[[], object],
        interval: float = 0.05,
        grace: float = 20.0,
    ) -> None:
        self.rank, self.world = rank, world
        self.grace = grace
        # The ranks this one watches: its neighbours in the job's order, so each rank is watched by two (by
        # one in a job of two) at two store reads per beat, whatever the job's size.
        self.watched = sorted({(rank - 1) % world, (rank + 1) % world} - {rank})
        self.where = where
        self.store = store_factory()  # the watcher's own connection
        self.main_store = store_factory()  # the main thread's (fail / position of a peer)
        self.interval = interval
        self.failing = False
        self.exit_code = 1
        self.stopped = threading.Event()
        self._watcher: threading.Thread | None = None
        self._signals: threading.Thread | None = None

    def start(self) -> Monitor:
        self._watcher = threading.Thread(target=self._watch, name="pipec-monitor", daemon=True)
        self._watcher.start()
        if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set()):
            self._signals = threading.Thread(target=self._sigterm, name="pipec-sigterm", daemon=True)
            self._signals.start()
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """End the monitor, from the main thread, once the run is over: stop and join its threads (the signal
        thread is woken from its wait by a SIGTERM of its own), give SIGTERM back its default action, and
        close the monitor's store connections. False when a thread is still running after `timeout` seconds
        (blocked in a store call): the process must then not go through the interpreter's shutdown."""
        try:  # over, not silent: the neighbours must not take this rank's last beat for a freeze
            self.main_store.set(DONE + str(self.rank), "1")
        except Exception:
            pass
        self.stopped.set()
        deadline = time.monotonic() + timeout
        if self._watcher is not None:
            self._watcher.join(timeout)
        if self._signals is not None and self._signals.is_alive():
            try:
                signal.pthread_kill(self._signals.ident, signal.SIGTERM)
            except OSError:  # it ended meanwhile (a SIGTERM from the launcher came first)
                pass
            self._signals.join(max(0.0, deadline - time.monotonic()))
        if any(t is not None and t.is_alive() for t in (self._watcher, self._signals)):
            return False
        if self._signals is not None:  # a SIGTERM from now on ends the process, as it would anyone's
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        self.store = self.main_store = None
        return True

    # ---- the watcher -----------------------------------------------------------------------------
    def _watch(self) -> None:
        last = None
        beat = 0.0
        seen = {r: (0, time.monotonic()) for r in self.watched}  # neighbour -> (its count, when it last moved)
        while not self.stopped.is_set():
            try:
                pos = self.where()
                if pos != last:
                    self.store.set(f"pipec/at/{self.rank}", pos)
                    last = pos
                if time.monotonic() - beat >= BEAT_EVERY:  # the heartbeat: this process still answers
                    self.store.add(BEAT + str(self.rank), 1)
                    beat = time.monotonic()
                    self._check_neighbours(seen)
                if not self.failing and self.store.check([ABORT]):
                    culprit, reason = _parse(self.store.get(ABORT))
                    if not self.failing and not self.stopped.is_set():
                        self._stop_because(culprit, reason)
            except Exception:  # the store went away: the job is ending; the main thread will notice
                if self.stopped.wait(1.0):
                    return
            self.stopped.wait(self.interval)

    def _check_neighbours(self, seen: dict[int, tuple[int, float]]) -> None:
        """End the job when a watched rank's heartbeat has not moved for `grace` seconds (once it has beaten
        at all, and unless its run is over): a stopped, frozen or killed rank is named after the grace,
        not after a receive's whole timeout, and whatever the survivors were doing."""
        now = time.monotonic()
        for r in self.watched:
            count = self.store.add(BEAT + str(r), 0)
            if count != seen[r][0]:
                seen[r] = (count, now)
            elif count and now - seen[r][1] >= self.grace and not self.failing:
                if self.store.check([DONE + str(r)]):
                    continue
                where = self.store.get(f"pipec/at/{r}").decode() if self.store.check([f"pipec/at/{r}"]) else "?"
                reason = (
                    f"rank {r} stopped responding or died (no heartbeat for {now - seen[r][1]:.1f} s, past the "
                    f"--heartbeat-grace of {self.grace:g} s; its last reported position: {where}); rank "
                    f"{self.rank} noticed at {self.where()}"
                )
                record = f"{r}\n{reason}"
                current = self.store.compare_set(ABORT, "", record)
                culprit, first = _parse(current)
                self.failing = True
                if culprit == r and first == reason:
                    say(f"pipec: {reason}")
                    os._exit(STOPPED)
                self._stop_because(culprit, first)

    def _stop_because(self, culprit: int, reason: str) -> None:
        if culprit == self.rank:  # the others gave up on this rank (it hung, or its link broke)
            say(f"pipec: rank {self.rank}: stopping at {self.where()}; the other ranks gave up on it: {reason}")
        else:
            say(f"pipec: rank {self.rank}: stopping at {self.where()}, because {reason}")
        try:
            self.store.add(ACKS, 1)
        except Exception:
            pass
        os._exit(1 if culprit == self.rank else STOPPED)

    def _sigterm(self) -> None:
        signal.sigwait({signal.SIGTERM})
        if self.stopped.is_set():  # woken by stop(): the run is over
            return
        reason = None
        # A rank that failed writes its record before it exits, so before the launcher sends SIGTERM; a
        # survivor may be writing one now. Polled, not a blocking wait: the watcher beats on this same
        # connection, and a second's wait on it stilled this rank's heartbeat, so that a survivor looking
        # for the silent rank blamed this one.
        deadline = time.monotonic() + 1.0
        try:
            while not self.store.check([ABORT]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.store.check([ABORT]):
                _, reason = _parse(self.store.get(ABORT))
        except Exception:
            pass
        if self.failing:
            os._exit(self.exit_code)
        say(
            f"pipec: rank {self.rank}: stopped by SIGTERM from the launcher at {self.where()}"
            + (f", because {reason}" if reason else " (no rank recorded a failure; see the launcher's report)")
        )
        os._exit(STOPPED)

    # ---- the main thread ---------------------------------------------------------------------------
    def position_of(self, rank: int) -> str:
        try:
            if self.main_store.check([f"pipec/at/{rank}"]):
                return self.main_store.get(f"pipec/at/{rank}").decode()
        except Exception:
            pass
        return "an unknown position"

    def recorded(self) -> bool:
        """Whether some rank has recorded a failure already (then there is no culprit left to find)."""
        try:
            return bool(self.main_store.check([ABORT]))
        except Exception:
            return False

    def await_record(self, seconds: float) -> bool:
        """Wait up to `seconds` for some rank to record a failure; whether one did."""
        deadline = time.monotonic() + seconds
        while not self.recorded():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def silent_ranks(self, window: float = 4 * BEAT_EVERY) -> list[int]:
        """The other ranks whose heartbeat did not move for `window` seconds: stopped (SIGSTOP), dead, or
        cut off. A rank that waits for a peer still beats, so this names the rank that stopped answering,
        not the ranks that wait on it."""
        others = [r for r in range(self.world) if r != self.rank]
        try:
            before = [self.main_store.add(BEAT + str(r), 0) for r in others]
            time.sleep(window)
            after = [self.main_store.add(BEAT + str(r), 0) for r in others]
        except Exception:
            return []
        return [r for r, a, b in zip(others, before, after) if a == b]

    def fail(self, reason: str, culprit: int, grace: float = 3.0) -> int:
        """Record the failure of rank `culprit` (this rank, or a peer it lost) for every rank, unless
        another was recorded first; print it; wait up to `grace` seconds for the other ranks to stop.
        Returns the exit status: 1 when this rank is the culprit, STOPPED otherwise."""
        self.exit_code = 1 if culprit == self.rank else STOPPED
        self.failing = True
        record = f"{culprit}\n{reason}"
        try:
            current = self.main_store.compare_set(ABORT, "", record)
        except Exception:
            current = record
        if _parse(current) != (culprit, reason):  # another failure was recorded first
            who, first = _parse(current)
            self.exit_code = 1 if who == self.rank else STOPPED
            say(f"pipec: rank {self.rank}: stopping at {self.where()}, because {first}")
            try:  # acknowledged like any rank that stops, so the recorder need not wait out its grace
                self.main_store.add(ACKS, 1)
            except Exception:
                pass
            return self.exit_code
        say(f"pipec: {reason}")
        deadline = time.monotonic() + grace
        expected = self.world - 1 - (culprit != self.rank)  # a dead peer never acknowledges
        try:
            while time.monotonic() < deadline and self.main_store.add(ACKS, 0) < expected:
                time.sleep(0.05)
        except Exception:
            pass
        return self.exit_code


def _parse(record: str | bytes) -> tuple[int, str]:
    text = record.decode() if isinstance(record, bytes) else record
    culprit, _, reason = text.partition("\n")
    return int(culprit), reason
