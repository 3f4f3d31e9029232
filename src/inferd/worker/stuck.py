"""When a worker cuts off a front end that stopped reading (stopped, its event loop stuck, a network
black hole), so that one hung front end never stalls the device for the others it serves.

What a worker writes to a front end waits in that link's write buffer until the kernel takes it. The
buffer is bounded per link, and the device never waits on one link for the others:

* Batch results: a front end sends a batch only against a credit, and the Credit that frees a slot
  follows the result it sent, so a front end that stops reading holds at most CAP results (plus small
  Credits and heartbeats) in its buffer; the device loop does not wait for it to drain.
* LLM token deltas go to every link at each step, so a stuck link's would pile up: the engine waits
  (backpressure, as with one front end) only while every link is more than LINK_HIGH_WATER_BYTES behind;
  a link that far behind while the others are not is cut off instead (`SequenceOwners.flush`).
* Any link: one holding more than LINK_HARD_LIMIT_BYTES is cut off at once (`FrontLink.send`).
* A link whose buffer stays non-empty with nothing passed on to the kernel for STUCK_AFTER_S is cut off
  (`DrainWatch`, observed by the link's heartbeat loop).

Cutting a link off aborts its connection (what is buffered is dropped): the worker frees its credits and
aborts its LLM sequences as for a lost link, and the front end, when it runs again, sees its connection
end and retries or fails those requests through its usual worker-loss handling. Nothing is lost
silently, and the worker rejoins it as after any lost link.

One link is never cut off for being slow or stuck: a local worker's first front end (its owner, whose
going ends the worker: `FrontLink.lifeline`). Cutting it off would end the worker for every front end;
the worker waits for it instead, as it did before it served several.
"""

from __future__ import annotations

from inferd.wire.protocol import MAX_FRAME_BYTES
from inferd.worker.credits import CAP

STUCK_AFTER_S = 10.0
"""How long a link's write buffer may stay non-empty with nothing written out before the worker cuts the
front end off (`inferd.worker.main --stuck-after-s`). Well over a GC pause or a busy front end's stall:
a front end reading anything at all is never cut off by it."""
LINK_HIGH_WATER_BYTES = 4 * 1024 * 1024
"""A link's write-buffer high-water mark: waiting for a link to drain (StreamWriter.drain) blocks only
past it, so short bursts to a slow front end never slow the device."""
LINK_HARD_LIMIT_BYTES = CAP * MAX_FRAME_BYTES + LINK_HIGH_WATER_BYTES
"""No link buffers more: CAP results of the largest frame and the small messages around them, which is
what credits allow; past it the front end is ignoring its credits."""


def positive_seconds(text: str) -> float:
    """--stuck-after-s: a number of seconds > 0 (argparse reports the ValueError as an invalid value)."""
    seconds = float(text)
    if not seconds > 0:
        raise ValueError(f"{text!r} is not a positive number of seconds")
    return seconds


class DrainWatch:
    """Whether one link is stuck. A plain object: the caller passes the time, no I/O.

    Progress is any byte passed on to the kernel (`sent_bytes - buffered_bytes` grew: the buffer shrank,
    or grew by less than was written since): a front end reading slowly is never stuck. An empty buffer
    is never stuck, and restarts the count."""

    def __init__(self, stuck_after_s: float = STUCK_AFTER_S) -> None:
        if stuck_after_s <= 0:
            raise ValueError(f"stuck_after_s must be > 0, got {stuck_after_s}")
        self.stuck_after_s = stuck_after_s
        self._since: float | None = None
        """When the buffer was last seen empty or moving; None while it is empty."""
        self._passed_on = 0
        """Bytes written out (to the kernel) as of the last observation."""

    def observe(self, now: float, buffered_bytes: int, sent_bytes: int) -> bool:
        """One look at the link: `buffered_bytes` waiting now, `sent_bytes` ever written to it.
        True when the buffer has been non-empty and unmoving for stuck_after_s."""
        passed_on = sent_bytes - buffered_bytes
        moved = passed_on > self._passed_on
        self._passed_on = max(self._passed_on, passed_on)
        if buffered_bytes <= 0:
            self._since = None
            return False
        if self._since is None or moved:
            self._since = now
            return False
        return now - self._since >= self.stuck_after_s

    def stuck_for_s(self, now: float) -> float:
        """How long the buffer has been non-empty without moving (0 when empty)."""
        return 0.0 if self._since is None else now - self._since
