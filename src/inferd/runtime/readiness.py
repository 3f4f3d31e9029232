"""The server's readiness (`GET /v2/health/ready`, gRPC ServerReady, the gRPC health service's ""; a
Kubernetes readiness probe), from the model versions it serves, by one rule:

    a model unloaded, or loading (the repository API)   -> not counted (fleet/model_control.py)
    a model served on demand (a waker is registered:   -> not counted: its readiness is its own
      a pooled model, a `[autoscale] min_workers = 0`
      model: runtime/waking.py)
    any other model (its workers are kept up)          -> counted: ready, i.e. a ready worker making
                                                          progress (the kind's `Runtime.ready`)

The server is ready when every counted version is (and it is not shutting down: server.py).

What the server keeps warm holds its readiness down, as Triton's strict readiness does: a model whose
workers crash in a loop, or that has none yet, or whose workers stall, takes the server out of service
(a Kubernetes Service then sends its traffic to the other replicas), because the server promised that
model warm. What it serves on demand never does: it promises no warm worker, so a failure to serve one
on demand is that model's alone. Its own readiness (`/v2/models/{m}/ready`, gRPC ModelReady, the health
service's model name, the repository index's state and reason) says so, and its requests get the 503
with its reason and Retry-After. That covers:

* a pooled model whose last load failed, during its backoff (1 s doubling to 60 s: pools/placement.py);
  with the strict rule, one broken model would flap the readiness of a server of many, and Kubernetes
  would take all of them out of service for it;
* a pool with no worker joined (`workers = 0`: its workers are `inferd worker --pool` processes on
  other hosts, which may be absent for a while, and are started and stopped apart from the server);
  its models say "pool 'p' has no worker" until one joins. A pool with workers of its own holds loads
  for them while they join (pools/manager.py);
* a pooled model measured bigger than every worker of its pool, and a `min_workers = 0` model that
  cannot be woken (a version other than its default).

A server whose models are all served on demand is therefore ready as soon as it listens.

A front end among several (`--frontends N`) listens only once `models_ready`, every version's own
readiness, on-demand ones included, or after a bounded wait (frontends/readiness.py): a restarted one
takes its share of new connections once the workers and pool workers that rejoin it within a backoff
step are back, rather than answering their models' requests with "has no worker" meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

from inferd.runtime.contract import Runtime


def counted(rt: Runtime, on_demand: Callable[[str], bool], unloaded: Container[str]) -> bool:
    """Whether the version's readiness counts in the server's: served, not unloaded, kept warm."""
    return rt.name not in unloaded and not on_demand(rt.name)


def server_ready(runtimes: Iterable[Runtime], on_demand: Callable[[str], bool], unloaded: Container[str]) -> bool:
    """Every counted version is ready. `on_demand(model)`: a waker is registered for it (`Wakers.on_demand`);
    `unloaded`: the models the repository API unloaded or is loading."""
    return all(rt.ready for rt in runtimes if counted(rt, on_demand, unloaded))


def models_ready(runtimes: Iterable[Runtime], unloaded: Container[str]) -> bool:
    """Every version served, on demand or not, is ready on its own (the listen gate of a front end among
    several; not the server's readiness)."""
    return all(rt.ready for rt in runtimes if rt.name not in unloaded)
