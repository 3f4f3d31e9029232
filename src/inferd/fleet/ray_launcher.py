"""Workers as Ray actors on an existing Ray cluster (`inferd serve --ray ADDRESS`).

Each worker slot runs one `WorkerActor`, placed by Ray on a node with a free device: the actor asks for
`num_gpus=1` when the cluster has GPUs, otherwise for one unit of a custom resource (default
`inferd_device`, set with `ray_resource`), so on a CPU-only cluster start each node with e.g.
`ray start ... --resources='{"inferd_device": 4}'` (one unit per worker the node may hold). The actor
asks for no CPU: the device resource alone decides placement.

The actor runs inferd's own Worker, which connects back to the front end's TCP worker port and speaks
inferd's wire protocol: batches never travel as Ray calls, so the per-batch cost is that of a socket,
and inferd's retry policy is the only one (actors have max_restarts=0 and max_task_retries=0, so Ray
neither restarts an actor nor re-runs its task). An actor that dies (killed, its node lost) surfaces as
ActorDiedError on the launcher's pending call, and its connection to the front end breaks: its batches
are recovered exactly as after a local worker crash, and the launcher starts a new actor.

Ray only places and runs the actors: the slots, the worker's bootstrap (the same `inferd.worker.main`
arguments a local worker gets, called inside the actor) and the restart loop with its backoff are
worker.launcher's, shared with the local Supervisor.

With TLS on the worker port (--ssl-certfile, or --worker-ssl-certfile), each actor gets the worker port's
certificate as PEM text in its arguments and trusts it as it is: the certificate must name the address
the actors connect to (worker_host, or this node's address for 0.0.0.0) as a subjectAltName. Without
TLS, actors join over plain TCP: on a loopback worker_host as always, elsewhere only with --insecure
(passed on to the actors).

Ray is an optional extra (`pip install inferd[ray]`); this module is imported only when --ray is used.
The cluster's nodes need inferd installed (same version) in the Python environment their workers use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from inferd.config import ConfigError
from inferd.routing.backoff import Backoff
from inferd.worker.launcher import RESTART_BACKOFF, Launcher, WorkerBootstrap, WorkerExit, WorkerSlot

log = logging.getLogger("inferd.ray")

DEFAULT_RESOURCE = "inferd_device"
PENDING_WARN_S = 30.0


class WorkerActor:
    """One inferd worker inside a Ray actor (threaded: `pid` answers while `serve` runs)."""

    def pid(self) -> int:
        return os.getpid()

    def serve(self, args: list[str]) -> int:
        """Run `inferd.worker.main` with the launcher's bootstrap arguments until its front end goes or
        drains it; the worker's exit code."""
        from inferd.worker.main import main

        try:
            return main(args)
        except SystemExit as exc:  # the arguments were refused: an exit code, not an actor death
            return exc.code if isinstance(exc.code, int) else 2


class ActorProcess:
    """What the server knows of a slot's actor, shaped like the local slot's process."""

    def __init__(self, actor: Any, done: Any) -> None:
        self.actor = actor
        self.done = done
        """The actor's `serve` call (an ObjectRef): its result is the worker's exit code."""
        self.pid = 0
        """The actor's process id on its node (0 until the actor has started)."""
        self.returncode: int | None = None

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(RayError, ValueError):
            ray.kill(self.actor, no_restart=True)


class RayLauncher(Launcher[ActorProcess]):
    """The launcher's surface (slots, add, retire, run, stop_all, pids, kill, mark_healthy,
    restart_hooks), with Ray actors instead of child processes."""

    def __init__(
        self,
        ray_address: str,
        token: str,
        log_level: str,
        resource: str | None = None,
        address: str = "",
        *,
        env: Mapping[str, str] | None = None,
        backoff: Backoff = RESTART_BACKOFF,
        healthy_after_s: float = 10.0,
        ca_pem: str = "",
        insecure: bool = False,
    ) -> None:
        super().__init__(address, token, log_level, env=env, backoff=backoff, healthy_after_s=healthy_after_s)
        self.ray_address = ray_address
        self.transport_args = actor_transport_args(ca_pem, insecure)
        """How each actor joins: TLS verified against `ca_pem`, or plain TCP (--insecure off loopback)."""
        self.resource = resource
        """The resource each actor holds one of: None picks GPU when the cluster has GPUs, else
        inferd_device; "GPU" always asks for num_gpus=1."""
        self._actor_class: Any = None

    async def run(self) -> None:
        await self._connect()
        await super().run()

    async def _connect(self) -> None:
        """ray.init (in a thread: it blocks for a while, and must not take the main thread's SIGTERM)."""
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"namespace": "inferd", "log_to_driver": True}
            if self.ray_address == "local":  # a new single-node cluster, just for this server
                kwargs["resources"] = {self.resource or DEFAULT_RESOURCE: max(1, len(self.slots))}
                kwargs["include_dashboard"] = False
            logging.getLogger("ray._private.worker").addFilter(_NotMainThreadNotice())
            await asyncio.to_thread(ray.init, address=self.ray_address, **kwargs)
        host, _, port = self.address.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", ""):  # listening everywhere: give actors a routable address  # nosec B104
            self.address = f"{ray.util.get_node_ip_address()}:{port}"
        self._actor_class = ray.remote(WorkerActor).options(**self._actor_options())
        log.info(
            "Ray cluster at %s: each worker actor holds one %s; actors connect to %s (%s)",
            self.ray_address,
            self.resource,
            self.address,
            "TLS" if "--ca-pem" in self.transport_args else "plain TCP",
        )

    def _actor_options(self) -> dict[str, Any]:
        """No restarts or retries by Ray (inferd's own policy is the only one), one device resource, no
        CPU, and the bootstrap's environment."""
        options: dict[str, Any] = {
            "max_restarts": 0,
            "max_task_retries": 0,
            "max_concurrency": 2,
            "num_cpus": 0,
        }
        resource = self.resource
        if resource is None:
            resource = "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else DEFAULT_RESOURCE
        if resource == "GPU":
            options["num_gpus"] = 1
        else:
            options["resources"] = {resource: 1}
            if ray.cluster_resources().get(resource, 0) < 1:
                log.error(
                    "the Ray cluster at %s has no GPU and no %r resource: worker actors wait until a node "
                    "offers one (start nodes with --resources='{\"%s\": N}', or set ray_resource)",
                    self.ray_address,
                    resource,
                    resource,
                )
        self.resource = resource
        if self.env:
            options["runtime_env"] = {"env_vars": dict(self.env)}
        return options

    async def _start(self, slot: WorkerSlot, bootstrap: WorkerBootstrap) -> ActorProcess:
        actor = self._actor_class.remote()
        return ActorProcess(actor, actor.serve.remote([*bootstrap.args(slot), *self.transport_args]))

    async def _wait(self, slot: WorkerSlot, process: ActorProcess) -> WorkerExit:
        """Until the actor's `serve` returns or the actor dies; then its device is freed."""
        try:
            async with asyncio.TaskGroup() as tg:
                watch = tg.create_task(self._watch_start(slot, process))
                try:
                    code = await process.done
                    end = WorkerExit(code, f"code {code}")
                except RayActorError as exc:  # killed, OOM, node lost: a crash, handled as one
                    end = WorkerExit(-1, f"actor death ({type(exc).__name__})")
                except RayTaskError as exc:  # the worker raised: also a crash
                    end = WorkerExit(1, f"error {exc.cause!r}")
                except RayError as exc:  # any other way the call failed: the slot restarts all the same
                    end = WorkerExit(1, f"error {exc!r}")
                watch.cancel()
        finally:
            process.kill()  # frees the actor's device resource; a no-op when it is already gone
        process.returncode = end.code
        return end

    async def _watch_start(self, slot: WorkerSlot, proc: ActorProcess) -> None:
        """Learn the actor's pid once it is placed; say so when placement waits long (no free device)."""
        pid = _awaitable(proc.actor.pid.remote())
        try:
            try:
                async with asyncio.timeout(PENDING_WARN_S):
                    proc.pid = await asyncio.shield(pid)
            except TimeoutError:
                log.warning(
                    "worker %s: its actor is not placed after %.0fs: no node has a free %s",
                    slot.worker_id,
                    PENDING_WARN_S,
                    self.resource,
                )
                proc.pid = await pid
        except RayError:  # the actor died before it answered: _wait tells that story
            return
        finally:
            pid.cancel()  # a no-op once answered; else nobody is left to read it
        log.info("started worker %s as a Ray actor (pid %d)", slot.worker_id, proc.pid)

    async def stop_all(self, grace_s: float = 5.0) -> None:
        """The workers end when the front end closes their connections; their actors are then killed."""
        self._stopping = True
        if not ray.is_initialized():
            return
        for slot in self.slots:
            if slot.process is not None:
                slot.process.kill()
        with contextlib.suppress(TimeoutError, RayError):
            async with asyncio.timeout(grace_s):
                await asyncio.to_thread(ray.shutdown)


def actor_transport_args(ca_pem: str, insecure: bool) -> list[str]:
    """The worker arguments that make an actor join over TLS, trusting `ca_pem` (PEM text: the actor's
    node need not hold the server's files), or over plain TCP where the server allows it (--insecure)."""
    if ca_pem:
        return ["--ca-pem", ca_pem]
    return ["--insecure"] if insecure else []


def _awaitable(ref: Any) -> asyncio.Future[Any]:
    return asyncio.wrap_future(ref.future())


RAY_CONNECT_TIMEOUT_S = 5.0


async def check_reachable(address: str) -> None:
    """Fail fast on a cluster address nobody answers at: ray.init itself retries for minutes, leaving the
    server live but never ready. "local" and "auto" are not network addresses and are left to ray.init."""
    if address in ("local", "auto") or ("://" in address and not address.startswith("ray://")):
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--ray {address!r}: expected HOST:PORT (the Ray head's GCS port, often 6379)")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), RAY_CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address} within {RAY_CONNECT_TIMEOUT_S:.0f} s ({exc!r}); "
            "start it (ray start --head) or fix --ray"
        ) from exc
    writer.close()


class _NotMainThreadNotice(logging.Filter):
    """ray.init runs in a thread on purpose (the server's main thread keeps its own SIGTERM handling):
    Ray's notice that it set no SIGTERM handler is expected, not a problem to report."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()
