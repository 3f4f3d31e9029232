"""Closed-loop clients of the `sim` model whose every answer is checked: each request carries a unique
input, and a 200's OUTPUT0 must be sim_digest of that input (anything else is a misrouted answer).
Bounded in count (`max_requests`) and in time (`max_s`)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.models.sim import sim_digest


def wait_for(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {within_s}s")


@dataclass
class Answer:
    text: str
    status: int
    body: str
    """OUTPUT0 for a 200, else the error message."""
    latency_s: float
    version: str = "1"
    """The version that answered (X-Inferd-Model-Version; a 200's digest is that version's)."""
    sent_at: float = 0.0
    """When it was sent (time.monotonic)."""

    @property
    def correct(self) -> bool:
        """A 200 whose OUTPUT0 is its own input's digest at the version that answered."""
        return self.status == 200 and self.body == sim_digest("sim", int(self.version), self.text)


@dataclass
class Load:
    """Closed-loop clients, each sending unique inputs one after another: bounded in count and in time."""

    url: str
    tag: str
    clients: int = 6
    max_requests: int = 3000
    max_s: float = 90.0
    """No request starts later than this after the clients started."""
    timeout_s: float = 40.0
    """A request unanswered this long is given up (unanswered)."""
    answers: list[Answer] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    sent: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _until: float = 0.0

    def __enter__(self) -> Load:
        self._until = time.monotonic() + self.max_s
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)

    def answered(self) -> int:
        with self._lock:
            return len(self.answers)

    def finish(self, within_s: float = 60) -> None:
        """Wait until all `max_requests` got their answer (or failed)."""
        wait_for(lambda: len(self.answers) + len(self.unanswered) >= self.max_requests, within_s, "answers")

    def _next(self) -> str | None:
        with self._lock:
            if self._stop.is_set() or self.sent >= self.max_requests or time.monotonic() > self._until:
                return None
            self.sent += 1
            return f"{self.tag}-{self.sent}"

    def _client(self) -> None:
        while (text := self._next()) is not None:
            answer = infer(self.url, text, self.timeout_s)
            with self._lock:
                if answer is None:
                    self.unanswered.append(text)
                else:
                    self.answers.append(answer)


def infer(url: str, text: str, timeout_s: float = 40.0) -> Answer | None:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    ).encode()
    req = urllib.request.Request(
        f"{url}/v2/models/sim/infer", data=body, headers={"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            output = json.loads(r.read())["outputs"][0]["data"][0]
            version = r.headers.get("X-Inferd-Model-Version", "1")
            return Answer(text, r.status, output, time.monotonic() - t0, version, t0)
    except urllib.error.HTTPError as exc:
        return Answer(text, exc.code, exc.read().decode(errors="replace"), time.monotonic() - t0, sent_at=t0)
    except (
        OSError,
        http.client.HTTPException,
    ):  # connection refused, reset, or cut mid-answer (IncompleteRead)
        return None


@dataclass(frozen=True)
class Tally:
    sent: int
    ok: int
    refused: int
    lost: int
    duplicated: int
    misrouted: int


def tally(load: Load) -> Tally:
    """Every request sent got exactly one answer; a 200's digest is its own input's."""
    per_input = Counter(a.text for a in load.answers)
    ok = [a for a in load.answers if a.status == 200]
    return Tally(
        sent=load.sent,
        ok=len(ok),
        refused=sum(1 for a in load.answers if a.status != 200),
        lost=load.sent - len(per_input),
        duplicated=sum(n - 1 for n in per_input.values()),
        misrouted=sum(1 for a in ok if not a.correct),
    )


def report(fault: str, t: Tally, **figures: float) -> None:
    extra = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    print(
        f"\nnetfault {fault}: sent={t.sent} ok={t.ok} refused={t.refused} lost={t.lost} "
        f"duplicated={t.duplicated} misrouted={t.misrouted} {extra}"
    )


def assert_exactly_once(t: Tally, load: Load) -> None:
    assert t.lost == 0 and not load.unanswered, f"unanswered requests: {load.unanswered[:5]}"
    assert t.duplicated == 0
    assert t.misrouted == 0, [
        a for a in load.answers if a.status == 200 and a.body != sim_digest("sim", 1, a.text)
    ]
    assert t.sent == t.ok + t.refused


def wait_answers(load: Load, n: int, within_s: float = 30) -> None:
    target = load.answered() + n
    wait_for(lambda: load.answered() >= target, within_s, f"{n} more answers")
