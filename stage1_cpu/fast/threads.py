"""How many threads a decode step runs on: all of numba's, unless fewer are faster right now.

Why: a step of the one-region decode (decode_step.py) ends each of its ~150 phases by waiting
until every item of the phase is done. On a quiet machine both threads stream weights and the
step takes about half the time of one thread's. Beside programs that keep the cores busy, the
OS shares each core between one of ours and one of theirs: a thread that holds an item is off
its core for a time slice (milliseconds), and the other thread waits for it, phase after phase.
One thread then waits for nobody: with two busy programs on two cores it gets two thirds of a
core to itself and can run faster than two threads that keep waiting for each other
(docs/cpus.md, "Spinning or sleeping").

So the step measures itself. It runs on the count that was faster lately, and now and then runs
two steps on the other count to find out whether that is still so (a probe); a probe that loses
makes the next one come twice as late (at most MAX_GAP steps later), one that wins switches. So
on a quiet machine the probes cost about a percent at first and less later. A machine that gets
busy (or quiet again) shows in the steps themselves: when the count in use runs far slower (or
faster) than at the last probe, the next probe comes at once. Only one-token steps
count (a verify step of T tokens costs more, whatever the threads), and only their seconds:
the logits are the same bits on any number of threads (decode_step.py: claimed work).
"""
from __future__ import annotations


class Threads:
    """The number of threads for the next step: `most` (numba's count) or 1, whichever measured
    faster lately. pick() before a step; update() after a one-token step, with its seconds."""

    GAP = 64                    # steps before the first probe, and after one that wins
    MAX_GAP = 512               # the longest wait between probes
    PROBE = 2                   # steps a probe takes (its mean is the other count's estimate)
    KEEP = 0.8                  # the count in use: a running mean, each step keeping 80 % (~5 steps)
    MARGIN = 0.9                # the other count must be this much faster to be switched to
    DRIFT = 1.3                 # the count in use this much slower or faster than at the last probe: look again

    def __init__(self, most: int):
        self.most = most
        self.use = most                         # the count in use
        self.cost: dict[int, float] = {}        # threads -> seconds of a one-token step
        self.probe: list[float] = []            # the running probe's timings
        self.gap, self.wait = self.GAP, self.GAP    # steps between probes; steps until the next
        self.level = None                       # the count in use's cost at the last probe

    def pick(self) -> int:
        """The threads for the next step: the count in use, or the other one during a probe."""
        if self.most == 1:
            return 1
        if self.wait > 0:
            self.wait -= 1
            return self.use
        return self.most if self.use == 1 else 1

    def update(self, threads: int, seconds: float) -> None:
        """A one-token step on `threads` threads took `seconds`."""
        if threads == self.use:
            old = self.cost.get(threads, seconds)
            self.cost[threads] = now = self.KEEP * old + (1 - self.KEEP) * seconds
            if self.level and not self.level / self.DRIFT < now < self.level * self.DRIFT:
                self.wait, self.gap, self.level = 0, self.GAP, None    # the machine changed: probe now
            return
        self.probe.append(seconds)
        if len(self.probe) < self.PROBE:
            return
        self.cost[threads] = sum(self.probe) / len(self.probe)
        self.probe = []
        if self.cost[threads] < self.MARGIN * self.cost.get(self.use, float("inf")):
            self.use, self.gap = threads, self.GAP               # faster now: switch
        else:
            self.gap = min(2 * self.gap, self.MAX_GAP)           # not faster: look again later
        self.wait, self.level = self.gap, self.cost.get(self.use)
