"""Which members of a group that makes no progress still answer: pinged ahead of the hang deadline.

    probe = HangProbe()                                   # one per RUNNING group (``states.Running``)
    hung = probe.look(group, members, progress_at, clock, deadline)   # clock: the controller's
    # None: not at the deadline yet; else the members that did not answer (() when every one did)

A member that does not answer a ping within ``answer_s`` is hung (a process stopped, or its node
unreachable); the others are blocked in a collective with it. The pings go out ``answer_s`` before
the deadline (half the deadline when that is shorter), all at once, so that at the deadline every
member has had its time to answer and the hung ones are known at once, rather than each pinged
after the deadline in turn (``answer_s`` per member). A new step (``progress_at`` moved) makes the
pings of the old one stale: the next look pings again.
"""

from __future__ import annotations

from .group import Call, WorkerGroup, WorkerLost

ANSWER_S = 2.0  # a live member answers a ping within this, however busy its training thread is


class HangProbe:
    def __init__(self, answer_s: float = ANSWER_S):
        self.answer_s = answer_s
        self.pings: dict[str, Call | None] = {}  # member -> its ping (None: it was gone already)
        self.sent_at: float | None = None  # controller clock
        self.progress_at: float | None = None  # the progress the pings were sent after

    def look(self, group: WorkerGroup, members: list[str], progress_at: float, clock,
             deadline: float) -> tuple[str, ...] | None:
        """None while ``clock()`` is within ``deadline`` seconds of ``progress_at`` (pinging the members once
        it is within the lead); past it, the members that did not answer within ``answer_s`` of their
        ping (waiting out the rest of that time when the pings went out late)."""
        now = clock()
        idle = now - progress_at
        lead = min(self.answer_s, deadline / 2)
        if idle <= deadline - lead:
            return None
        if self.sent_at is None or self.progress_at != progress_at or set(self.pings) != set(members):
            self._send(group, members, progress_at, now)
        if idle <= deadline:
            return None
        until = self.sent_at + self.answer_s
        hung = []
        for wid, call in self.pings.items():
            try:
                if call is None:
                    raise WorkerLost(f"worker {wid} is gone")
                group.result(call, timeout=max(0.0, until - clock()))
            except (WorkerLost, TimeoutError):
                hung.append(wid)
        self.sent_at = None  # looked at: a later look (the group formed again) pings afresh
        return tuple(hung)

    def _send(self, group: WorkerGroup, members: list[str], progress_at: float, now: float) -> None:
        self.pings = {}
        for wid in members:
            try:
                self.pings[wid] = group.submit(wid, "ping")
            except WorkerLost:
                self.pings[wid] = None
        self.sent_at, self.progress_at = now, progress_at

