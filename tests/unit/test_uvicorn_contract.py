"""uvicorn as a contract: the private uvicorn code that api/frontdoor.py subclasses, overrides, calls and
reads is the code it was written against (uvicorn 0.54), and the installed uvicorn is inside the range
pyproject.toml pins.

Each failure names the method or attribute and says what to re-check. To move to another uvicorn: pin
it in pyproject.toml, run scripts/lock, read uvicorn's diff of every method named below against
api/frontdoor.py, run tests/integration/test_hostile_clients.py and tests/unit/test_door_policy.py,
then update WRITTEN_AGAINST and the tables here.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.metadata
import inspect
import textwrap
import tomllib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools
import pytest
import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

ROOT = Path(__file__).resolve().parents[2]
WRITTEN_AGAINST = "0.54"
"""The uvicorn minor that api/frontdoor.py (and runner.GracefulServer) were checked against."""
INSTALLED = importlib.metadata.version("uvicorn")
RECHECK = (
    f"api/frontdoor.py was written against uvicorn {WRITTEN_AGAINST}; the installed uvicorn is {INSTALLED}. "
    "Re-check the front door against this uvicorn (see this test's docstring) before changing this table."
)

# What the front door overrides (super() called unless noted) or calls on HttpToolsProtocol, with the
# parameter lists it was written against.
PROTOCOL_METHODS = {
    "__init__": "self, config, server_state, app_state, _loop=None",  # uvicorn's Server passes keywords
    "connection_made": "self, transport",
    "connection_lost": "self, exc",
    "data_received": "self, data",  # replaced whole: the door's is a copy of uvicorn's, plus its checks
    "on_message_begin": "self",
    "on_url": "self, url",
    "on_header": "self, name, value",
    "on_headers_complete": "self",  # reads self.app when called: the door swaps it for a refusal app
    "on_body": "self, body",
    "on_message_complete": "self",
    "_start_asgi_task": "self, cycle, app",
    # called only
    "_unset_keepalive_if_required": "self",
    "_should_upgrade": "self",
    "handle_websocket_upgrade": "self",
    "_unsupported_upgrade_warning": "self",
    "send_400_response": "self, msg",
    "on_response_complete": "self",  # called for a refused request whose body was skipped
}

# uvicorn's code of each method above, as api/frontdoor.py was checked against it (uvicorn 0.54.0):
# the sha256 of ast.unparse(the method), so comments and layout do not count. A method that extends
# uvicorn's relies on what uvicorn's does (which cycle it makes, when it pauses reading), not only on
# its parameters.
PROTOCOL_CODE = {
    "__init__": "ef1b7c9c785b9967",
    "connection_made": "52a70c678525d887",
    "connection_lost": "8a5a84898dabba92",
    "data_received": "8583b7d501b5b5dd",
    "on_message_begin": "4f7bac281585eb31",
    "on_url": "381560766601b143",
    "on_header": "fa663d220912eefa",
    "on_headers_complete": "f5d7f89383b961ff",
    "on_body": "04bff947c3d58504",
    "on_message_complete": "4ce97e51d988d172",
    "_start_asgi_task": "bc55a6f4487614df",
    "_unset_keepalive_if_required": "c8a2b3d2c6549f51",
    "_should_upgrade": "3fde089b4def4efb",
    "handle_websocket_upgrade": "9f6222b9c807ab2d",
    "_unsupported_upgrade_warning": "2b72baffb4f70927",
    "send_400_response": "65982634137320d0",
    "on_response_complete": "3b835da51ff0d85f",
}

PROTOCOL_ATTRIBUTES = {
    # attribute: when uvicorn sets it
    "app": "__init__",  # read, and swapped for one on_headers_complete call
    "loop": "__init__",
    "logger": "__init__",
    "parser": "__init__",
    "pipeline": "__init__",  # a deque of (cycle, app)
    "cycle": "__init__",  # None until the first request
    "transport": "connection_made",
    "flow": "connection_made",
    "client": "connection_made",  # (host, port) or None
    "url": "on_message_begin",  # the request target, complete by on_headers_complete
}

CYCLE_ATTRIBUTES = ["keep_alive", "response_complete", "response_started", "disconnected", "message_event"]
"""What the front door reads or sets on RequestResponseCycle: setting `disconnected` and then
`message_event` makes the app's receive() return http.disconnect and its send() a no-op."""

OTHER_METHODS: list[tuple[Callable[..., Any], str]] = [
    (FlowControl.resume_reading, "self"),  # the door's _close_with
    # runner.GracefulServer overrides these of uvicorn.Server
    (uvicorn.Server.__init__, "self, config"),
    (uvicorn.Server.capture_signals, "self"),
    (uvicorn.Server.handle_exit, "self, sig, frame"),
    (uvicorn.Server.on_tick, "self, counter"),
]

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


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_httptools_protocol_method_has_the_parameters_the_front_door_was_written_against(name: str) -> None:
    method = HttpToolsProtocol.__dict__.get(name)
    assert callable(method), f"uvicorn HttpToolsProtocol.{name} is gone (the front door uses it). {RECHECK}"
    assert parameters(method) == PROTOCOL_METHODS[name], (
        f"uvicorn HttpToolsProtocol.{name}({parameters(method)}) was ({PROTOCOL_METHODS[name]}). {RECHECK}"
    )


@pytest.mark.parametrize("name", PROTOCOL_CODE)
def test_httptools_protocol_method_has_the_code_the_front_door_was_checked_against(name: str) -> None:
    digest = code_digest(HttpToolsProtocol.__dict__[name])
    assert digest == PROTOCOL_CODE[name], (
        f"uvicorn HttpToolsProtocol.{name}'s code changed (digest {digest!r}, was {PROTOCOL_CODE[name]!r}): "
        f"read its diff against api/frontdoor.py. {RECHECK}"
    )


@pytest.mark.parametrize(("func", "expected"), OTHER_METHODS, ids=lambda f: getattr(f, "__qualname__", ""))
def test_other_uvicorn_method_has_the_parameters_the_server_was_written_against(
    func: Callable[..., Any], expected: str
) -> None:
    assert parameters(func) == expected, (
        f"uvicorn {func.__qualname__}({parameters(func)}) was ({expected}). {RECHECK}"
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


def connected(app: Callable[..., Any]) -> tuple[HttpToolsProtocol, FakeTransport]:
    """A real HttpToolsProtocol, from a real Config, connected to a fake transport; checks on the way
    that each attribute the door reads is set by the step the door expects."""
    config = uvicorn.Config(app, http=HttpToolsProtocol, ws="none", log_config=None, lifespan="off")
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol, (
        f"uvicorn.Config(http=<class>) no longer serves with that class (runner passes the door's). {RECHECK}"
    )
    protocol = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
    check_attributes(protocol, "__init__")
    assert protocol.cycle is None and isinstance(protocol.pipeline, deque), (
        f"uvicorn HttpToolsProtocol.__init__: cycle is {protocol.cycle!r}, pipeline is {protocol.pipeline!r} "
        f"(the door expects None and a deque). {RECHECK}"
    )
    assert isinstance(protocol.parser, httptools.HttpRequestParser), (
        f"uvicorn HttpToolsProtocol.parser is {type(protocol.parser)} (the door feeds it). {RECHECK}"
    )
    transport = FakeTransport()
    protocol.connection_made(transport)
    check_attributes(protocol, "connection_made")
    assert protocol.transport is transport and protocol.client == ("127.0.0.2", 40000), (
        f"uvicorn HttpToolsProtocol.connection_made: transport {protocol.transport!r}, client "
        f"{protocol.client!r}. {RECHECK}"
    )
    return protocol, transport


def check_attributes(protocol: HttpToolsProtocol, step: str) -> None:
    for name, set_in in PROTOCOL_ATTRIBUTES.items():
        if set_in == step:  # __init__ may set an attribute to None (cycle); later steps give it a value
            present = name in vars(protocol) if step == "__init__" else vars(protocol).get(name) is not None
            assert present, (
                f"uvicorn HttpToolsProtocol.{step} no longer sets self.{name} (the front door reads it). "
                f"{RECHECK}"
            )


async def test_httptools_protocol_sets_the_attributes_the_front_door_reads() -> None:
    """Two pipelined requests: the first runs, the second waits in the pipeline as (cycle, app), and
    each cycle has the attributes the door reads and sets."""
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    protocol, transport = connected(app)
    protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        check_attributes(protocol, "on_message_begin")
        assert protocol.url == b"/b", (
            f"uvicorn HttpToolsProtocol.url is {protocol.url!r}, not b'/b'. {RECHECK}"
        )
        pipelined = list(protocol.pipeline)
        assert len(protocol.tasks) == 1 and len(pipelined) == 1, (
            f"uvicorn HttpToolsProtocol: {len(protocol.tasks)} tasks, pipeline {pipelined!r} after two "
            f"pipelined requests (the door expects one running and one queued as (cycle, app)). {RECHECK}"
        )
        [(queued, queued_app)] = pipelined
        latest = (protocol.cycle, protocol.app)
        assert isinstance(queued, RequestResponseCycle) and (queued, queued_app) == latest, (
            f"uvicorn HttpToolsProtocol.pipeline holds {pipelined!r}, not (the latest cycle, app). {RECHECK}"
        )
        missing = [name for name in CYCLE_ATTRIBUTES if name not in vars(queued)]
        assert not missing, f"uvicorn RequestResponseCycle has no {missing} (the door reads them). {RECHECK}"
    finally:  # both requests run to completion, so no task is left behind whatever failed
        release.set()
        while protocol.tasks:
            await asyncio.gather(*protocol.tasks)
    assert transport.written.count(b"HTTP/1.1 204") == 2, bytes(transport.written)
