"""Where a front end's local workers join on a shared store (cluster/frontend.py): its own worker address
first (their lifeline), then every other live front end's from its record, once each, sorted; a record
with no worker address, or one listening on every interface (no address to reach it by), is left out.
A server with a join token and a shared store hands it to its launcher, with that token; else not."""

from __future__ import annotations

from types import SimpleNamespace

from pydantic import SecretStr

from inferd.cluster.frontend import ClusterFrontend, worker_addresses
from inferd.cluster.members import Member


def test_local_workers_join_this_front_end_first_then_every_other_live_one() -> None:
    members = {
        "a:8000": Member(id="a:8000", workers="10.0.0.1:9000"),
        "c:8000": Member(id="c:8000", workers="10.0.0.3:9000"),
        "b:8000": Member(id="b:8000", workers="10.0.0.2:9000"),
        "d:8000": Member(id="d:8000", workers=None),
        "e:8000": Member(id="e:8000", workers="0.0.0.0:9000"),
        "f:8000": Member(id="f:8000", workers="[::]:9000"),
    }
    assert worker_addresses("unix:/s/w.sock", "a:8000", members) == "unix:/s/w.sock,10.0.0.2:9000,10.0.0.3:9000"
    assert worker_addresses("unix:/s/w.sock", "a:8000", {}) == "unix:/s/w.sock"


def test_the_launcher_gets_the_front_ends_and_the_join_token_only_with_both() -> None:
    members = SimpleNamespace(members={"b:1": Member(id="b:1", workers="10.0.0.2:9000")})
    front = SimpleNamespace(me="a:1", members=members, worker_addresses=lambda own: worker_addresses(own, "a:1", members.members))
    launcher = SimpleNamespace(connect=None, token="local", extra_args=(), env={})
    config = SimpleNamespace(join_token=None, insecure=True)
    ClusterFrontend.join_every_front_end(front, launcher, "unix:/w", config)  # type: ignore[arg-type]
    assert launcher.connect is None and launcher.token == "local"  # the others would refuse its token
    config.join_token = SecretStr("join")
    ClusterFrontend.join_every_front_end(front, launcher, "unix:/w", config)  # type: ignore[arg-type]
    assert launcher.connect() == "unix:/w,10.0.0.2:9000"
    assert launcher.token == "" and launcher.env == {"INFERD_JOIN_TOKEN": "join"}  # not on their command line
    assert launcher.extra_args == ("--insecure",)
    members.members["c:1"] = Member(id="c:1", workers="10.0.0.3:9000")  # asked again at each start
    assert launcher.connect() == "unix:/w,10.0.0.2:9000,10.0.0.3:9000"
    alone = SimpleNamespace(connect=None, token="local", extra_args=(), env={})
    ClusterFrontend.join_every_front_end(SimpleNamespace(members=None), alone, "unix:/w", config)  # type: ignore[arg-type]
    assert alone.connect is None
