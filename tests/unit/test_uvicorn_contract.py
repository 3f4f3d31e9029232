"""uvicorn as a contract: the uvicorn code that runs the front door is the code it was written against
(uvicorn 0.54), and the installed uvicorn is inside the range pyproject.toml pins.

The front door is our own HTTP/1.1 protocol (api/frontdoor.py), no longer a subclass of uvicorn's: what
inferd relies on is uvicorn's Server running a protocol class given as `Config(http=<class>)`, building
it with (config, server_state, app_state), calling its `shutdown()` on every connection of
`server_state.connections` and waiting for `server_state.tasks`, and keeping
`server_state.default_headers` (date, server) fresh; and runner.GracefulServer's overrides of Server.

Each failure names the method or attribute and says what to re-check. To move to another uvicorn: pin
it in pyproject.toml, run scripts/lock, read uvicorn's diff of every method named below, run
tests/integration/test_hostile_clients.py and tests/integration/test_server_failures.py, then update
WRITTEN_AGAINST and the tables here.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.metadata
import inspect
import textwrap
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.server import ServerState

from inferd.api.asgi import AsgiApp, HttpResponse, Router
from inferd.api.door_policy import DoorLimits, DoorPolicy
from inferd.api.frontdoor import FrontDoorProtocol, front_door_protocol
from inferd.clock import FakeClock

ROOT = Path(__file__).resolve().parents[2]
WRITTEN_AGAINST = "0.54"
"""The uvicorn minor that api/frontdoor.py and runner.GracefulServer were checked against."""
INSTALLED = importlib.metadata.version("uvicorn")
RECHECK = (
    f"api/frontdoor.py and runner.py were written against uvicorn {WRITTEN_AGAINST}; the installed uvicorn "
    f"is {INSTALLED}. Re-check them against this uvicorn (see this test's docstring) before changing this table."
)

OTHER_METHODS: list[tuple[Callable[..., Any], str]] = [
    # runner.GracefulServer overrides these of uvicorn.Server
    (uvicorn.Server.__init__, "self, config"),
    (uvicorn.Server.capture_signals, "self"),
    (uvicorn.Server.handle_exit, "self, sig, frame"),
    (uvicorn.Server.on_tick, "self, counter"),
]

# uvicorn.Server's code that drives the protocol class or that GracefulServer extends, as checked
# (uvicorn 0.54.0): the sha256 of ast.unparse(the method), so comments and layout do not count.
SERVER_CODE = {
    "startup": "8b35da79161af825",  # create_protocol: http_protocol_class(config=, server_state=, app_state=)
    "shutdown": "6b5cbc9c494e1209",  # connection.shutdown() for each; waits for connections and tasks
    "on_tick": "f0ebcc100cbc32e8",  # server_state.default_headers; GracefulServer extends it
    "main_loop": "d36123dfe98057ed",
    "handle_exit": "7ea8c96125df5dc9",
    "capture_signals": "5c21d816e7ca26af",
}

SERVER_STATE = {"connections": set, "tasks": set, "total_requests": int, "default_headers": list}

CONFIG_OPTIONS = [  # what runner.build_uvicorn passes to uvicorn.Config (tls.uvicorn_options included)
    "http", "ws", "timeout_keep_alive", "loop", "lifespan", "access_log", "log_level",
    "timeout_graceful_shutdown", "backlog", "log_config", "ssl_certfile", "ssl_keyfile", "ssl_ciphers",
]  # fmt: skip


def parameters(func: Callable[..., Any]) -> str:
    """The parameter list without annotations: `self, config, _loop=None, *args, key=1, **kwargs`."""
    shown = []
    for p in inspect.signature(func).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            shown.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            shown.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not any(s.startswith("*") for s in shown):
                shown.append("*")
            shown.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(shown)


def code_digest(func: Callable[..., Any]) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]


def pinned_uvicorn() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [Requirement(d) for d in deps if Requirement(d).name == "uvicorn"]
    return spec


def test_pyproject_pins_uvicorn_to_the_minor_the_front_door_was_written_against() -> None:
    spec = pinned_uvicorn().specifier
    major, minor = (int(x) for x in WRITTEN_AGAINST.split("."))
    inside = [f"{major}.{minor}.0", f"{major}.{minor}.99"]
    outside = [f"{major}.{minor - 1}.99", f"{major}.{minor + 1}.0", f"{major + 1}.0.0"]
    assert all(spec.contains(v) for v in inside) and not any(spec.contains(v) for v in outside), (
        f"pyproject.toml pins uvicorn{spec}, but tests/unit/test_uvicorn_contract.py checks the front door "
        f"only against uvicorn {WRITTEN_AGAINST}.x: pin uvicorn>={WRITTEN_AGAINST},<{major}.{minor + 1}, "
        "or re-check the front door against the other minor (see this test's docstring)"
    )


def test_installed_uvicorn_is_inside_the_pinned_range() -> None:
    spec = pinned_uvicorn().specifier
    assert spec.contains(Version(INSTALLED)), (
        f"uvicorn {INSTALLED} is installed, outside pyproject.toml's uvicorn{spec}: install from "
        f"requirements/lock.txt. {RECHECK}"
    )


@pytest.mark.parametrize(("func", "expected"), OTHER_METHODS, ids=lambda f: getattr(f, "__qualname__", ""))
def test_other_uvicorn_method_has_the_parameters_the_server_was_written_against(
    func: Callable[..., Any], expected: str
) -> None:
    assert parameters(func) == expected, (
        f"uvicorn {func.__qualname__}({parameters(func)}) was ({expected}). {RECHECK}"
    )


@pytest.mark.parametrize("name", SERVER_CODE)
def test_uvicorn_server_method_has_the_code_the_front_door_was_checked_against(name: str) -> None:
    digest = code_digest(getattr(uvicorn.Server, name))
    assert digest == SERVER_CODE[name], (
        f"uvicorn Server.{name}'s code changed (digest {digest!r}, was {SERVER_CODE[name]!r}): read its diff "
        f"against api/frontdoor.py and runner.py. {RECHECK}"
    )


def test_uvicorn_config_and_server_take_what_the_runner_passes_and_reads() -> None:
    accepted = inspect.signature(uvicorn.Config.__init__).parameters
    missing = [name for name in CONFIG_OPTIONS if name not in accepted]
    assert not missing, (
        f"uvicorn.Config no longer takes {missing} (runner.build_uvicorn passes them). {RECHECK}"
    )
    server = uvicorn.Server(uvicorn.Config(lambda scope, receive, send: None, log_config=None))
    assert vars(server).get("should_exit") is False, (
        f"uvicorn.Server.__init__ no longer sets should_exit = False (runner.GracefulServer sets it). {RECHECK}"
    )
    for name, kind in SERVER_STATE.items():
        assert isinstance(getattr(server.server_state, name, None), kind), (
            f"uvicorn ServerState.{name} is not a {kind.__name__} (the front door uses it). {RECHECK}"
        )
    config = uvicorn.Config(lambda scope, receive, send: None, http=FrontDoorProtocol, log_config=None)
    config.load()
    assert config.http_protocol_class is FrontDoorProtocol, (
        f"uvicorn.Config(http=<class>) no longer serves with that class (runner passes the door's). {RECHECK}"
    )


class FakeTransport(asyncio.Transport):
    """A connected plain-TCP transport that keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.2", 40000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def door_connection(router: Router) -> tuple[FrontDoorProtocol, FakeTransport, ServerState]:
    """The front door's protocol as uvicorn's Server builds it, connected to a fake transport."""
    app = AsgiApp(router, lambda: None, lambda request, other: HttpResponse(b"", 404))  # type: ignore[arg-type,return-value]
    cls = front_door_protocol(DoorPolicy(DoorLimits(), FakeClock()), app)
    config = uvicorn.Config(app, http=cls, ws="none", log_config=None, lifespan="off")
    config.load()
    state = ServerState()
    protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport, state


async def test_the_front_door_answers_pipelined_requests_in_order_through_uvicorns_server_state() -> None:
    release = asyncio.Event()
    router = Router()

    async def slow(request: Any) -> HttpResponse:
        await release.wait()
        return HttpResponse(b"a", content_type=b"text/plain")

    async def fast(request: Any) -> HttpResponse:
        return HttpResponse(b"b", content_type=b"text/plain")

    router.add("GET", "/a", slow)
    router.add("GET", "/b", fast)
    protocol, transport, state = door_connection(router)
    assert state.connections == {protocol}
    protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        assert len(state.tasks) == 1, "the pipelined request must wait for the first one's answer"
        await asyncio.sleep(0)
        assert transport.written == b""
    finally:
        release.set()
        while state.tasks:
            await asyncio.gather(*state.tasks)
    answers = bytes(transport.written).split(b"HTTP/1.1 200 OK")
    assert [a.rsplit(b"\r\n\r\n", 1)[-1] for a in answers[1:]] == [b"a", b"b"], bytes(transport.written)
    assert state.total_requests == 2
    protocol.shutdown()  # idle: uvicorn's shutdown closes it at once
    assert transport.closed
    protocol.connection_lost(None)
    assert state.connections == set()
