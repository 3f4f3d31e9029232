"""The worker process: owns one device, runs one model, one batch at a time.

    python -m inferd.worker.main --connect unix:/run/inferd.sock --model sim [--token T]

Loop: receive -> run -> deliver, with a heartbeat beside it. A sync predict_batch runs in a thread so
heartbeats and the next (staged) batch keep flowing while the device is busy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import os
import socket
import ssl
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from inferd import tls
from inferd.clock import MonotonicClock
from inferd.config import ConfigError, ModelConfig
from inferd.llm.engine import LLMEngine, new_scheduler, scheduler_config
from inferd.llm.model import LLMModel
from inferd.models.base import Model
from inferd.models.loader import instantiate
from inferd.observability import tracing
from inferd.observability.logging_setup import set_up_process
from inferd.observability.settings import from_environment
from inferd.worker import protocol as p
from inferd.worker.connection import MAX_INFLIGHT
from inferd.worker.outputs import OutputError, convert_outputs

log = logging.getLogger("inferd.worker")

JOIN_TIMEOUT_S = 5.0
"""Most time one attempt to join (connect, TLS handshake, Hello -> Welcome) may take; an attempt caught in
a partition is abandoned and retried, so a worker rejoins within seconds of the network healing."""


class Worker:
    def __init__(
        self,
        address: str,
        model: str,
        token: str,
        worker_id: str,
        reconnect: bool = False,
        model_repo: Path | None = None,
        model_version: int = 0,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.address = address
        self.tls = tls_context
        """Verifies the front end (TCP only); None: plain TCP, or a Unix socket."""
        self.model_name = model
        self.model_version = model_version
        """The version to serve; 0: the model's default version."""
        self.token = token
        self.worker_id = worker_id
        self.reconnect = reconnect
        self.model_repo = model_repo
        self.completed = 0
        self.running = 0
        self.model: Model | None = None
        self.config: ModelConfig | None = None
        self._config_json = b""
        self._batches: asyncio.Queue[p.RunBatch | None] = asyncio.Queue(maxsize=MAX_INFLIGHT + 1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-device")
        self._writer: asyncio.StreamWriter | None = None
        self._engine: LLMEngine | None = None
        """The continuous-batching engine, when the model is an LLM (instead of the batch loop)."""

    async def run(self) -> int:
        """Serve the front end. A local worker (a child of `inferd serve`) exits when its front end goes;
        a remote one (`inferd worker`) reconnects and registers again, keeping its loaded model."""
        delay_s = 0.2
        while True:
            try:
                outcome = await self._session()
            except ssl.SSLCertVerificationError as exc:  # retrying cannot fix it: the operator must
                log.error(
                    "worker %s: the front end at %s is not trusted: %s; pass --ca-file with the CA that "
                    "signed its certificate, which must name the --connect host as a subjectAltName",
                    self.worker_id,
                    self.address,
                    exc.verify_message or exc,
                )
                outcome = "refused"
            except (OSError, p.ConnectionClosed) as exc:
                outcome = "lost"
                log.warning(
                    "worker %s: cannot reach the front end at %s: %s", self.worker_id, self.address, exc
                )
            if outcome in ("drained", "refused", "load_failed") or not self.reconnect:
                return {"drained": 0, "lost": 0, "refused": 2, "load_failed": 3}[outcome]
            if outcome == "served":
                delay_s = 0.2
            await asyncio.sleep(delay_s)
            delay_s = min(2.0, delay_s * 2)

    async def _session(self) -> str:
        """One connection: register, (re)load if needed, then receive -> run -> deliver until it ends."""
        async with asyncio.timeout(JOIN_TIMEOUT_S):  # TimeoutError is an OSError: the attempt is "lost"
            reader, writer = await p.open_connection(self.address, self.tls)
            self._writer = writer
            self._send(
                p.Hello(
                    worker_id=self.worker_id,
                    model=self.model_name,
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    token=self.token,
                    version=self.model_version,
                )
            )
            welcome = await p.read_message(reader)
        if isinstance(welcome, p.Welcome):
            give_up_when_silent(writer, welcome.silence_timeout_s)
        if not isinstance(welcome, p.Welcome) or not welcome.accepted:
            reason = getattr(welcome, "reason", "unexpected reply")
            log.error("front end refused worker %s: %s", self.worker_id, reason)
            return "refused"
        raw_config = msgspec.json.decode(welcome.model_config_json, type=dict)
        if raw_config.get("kind") == "search":  # a shard replica (search/replica.py), not a model
            from inferd.search.replica import serve_replica

            version = raw_config["version"]
            outcome = await serve_replica(self.worker_id, reader, writer, version, welcome.heartbeat_s)
            writer.close()
            return outcome
        if welcome.model_config_json != self._config_json or self.model is None:
            config = self._localize(ModelConfig(**msgspec.json.decode(welcome.model_config_json, type=dict)))
            self.model = await self._load(config)
            if self.model is None:
                return "load_failed"
            self._config_json = welcome.model_config_json
        else:
            assert self.config is not None
            self._send(p.Ready(version=self.config.version, load_s=0.0, warmup_s=0.0))
            log.info(
                "worker %s registered again with %s (model already loaded)", self.worker_id, self.address
            )
        self._batches = asyncio.Queue(maxsize=MAX_INFLIGHT + 1)  # the front end sends at most MAX_INFLIGHT
        self._engine = self._new_engine()
        async with asyncio.TaskGroup() as tg:
            heartbeat = tg.create_task(self._heartbeat(welcome.heartbeat_s))
            runner = tg.create_task(self._run_batches() if self._engine is None else self._run_engine())
            receiving = tg.create_task(self._receive(reader))
            await asyncio.wait({receiving, runner}, return_when=asyncio.FIRST_COMPLETED)
            if receiving.done():
                outcome = receiving.result()
            else:  # an engine finished draining: nothing more to read
                receiving.cancel()
                outcome = "drained"
            if outcome == "lost":  # nobody will read results of batches not started yet
                while not self._batches.empty():
                    self._batches.get_nowait()
            await self._batches.put(None)
            if self._engine is not None:
                self._engine.stop(finish_running=outcome == "drained")
            await runner
            heartbeat.cancel()
        writer.close()
        return outcome

    def _localize(self, config: ModelConfig) -> ModelConfig:
        """A model file path from another host's repository, mapped into this worker's --model-repo."""
        target, _, cls = config.implementation.rpartition(":")
        if not target.endswith(".py") or Path(target).is_file() or self.model_repo is None:
            return config
        local = self.model_repo / config.name / str(config.version) / "model.py"
        return config.model_copy(update={"implementation": f"{local}:{cls}"})

    async def _load(self, config: ModelConfig) -> Model | None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            model = instantiate(config)
            await loop.run_in_executor(self._executor, model.load)
            t1 = time.perf_counter()
            warm = model.warmup_inputs()
            if warm:
                result = await self._predict(model, warm)
                convert_outputs(config, result, len(warm))
        except Exception as exc:  # a model that fails to load is reported, not crashed on
            log.exception("model %s failed to load", config.name)
            self._send(p.LoadFailed(message=f"{type(exc).__name__}: {exc}"))
            await self._flush()
            return None
        t2 = time.perf_counter()
        self.config = config
        self._send(p.Ready(version=config.version, load_s=t1 - t0, warmup_s=t2 - t1))
        log.info(
            "worker %s ready: model %s v%d loaded in %.2fs, warm-up %.3fs",
            self.worker_id,
            config.name,
            config.version,
            t1 - t0,
            t2 - t1,
        )
        return model

    async def _receive(self, reader: asyncio.StreamReader) -> str:
        while True:
            try:
                msg = await p.read_message(reader)
            except p.ConnectionClosed:
                log.info("worker %s: the front end closed the connection", self.worker_id)
                return "lost"
            if isinstance(msg, p.RunBatch):
                await self._batches.put(msg)
            elif isinstance(msg, p.Drain):
                log.info("worker %s draining", self.worker_id)
                if self._engine is None:
                    return "drained"
                self._engine.stop(finish_running=True)  # reading on: aborts of the sequences it finishes
            elif isinstance(msg, (p.AddSequence, p.AbortSequence)) and self._engine is not None:
                self._engine.submit(msg)

    async def _run_batches(self) -> None:
        while (batch := await self._batches.get()) is not None:
            self.running = 1
            with tracing.compute(batch.traceparent, batch.batch_id, len(batch.items), self.worker_id):
                done = await self._run_one(batch)
            self.running = 0
            self.completed += 1
            self._send(done)
            await self._flush()

    async def _run_one(self, batch: p.RunBatch) -> p.BatchDone:
        start = time.perf_counter()
        assert self.model is not None and self.config is not None
        try:
            outputs = await self._predict(self.model, batch.items)
            converted, errors = convert_outputs(self.config, outputs, len(batch.items))
        except OutputError as exc:
            return p.BatchDone(
                batch.batch_id, time.perf_counter() - start, batch_error=("ModelOutputError", str(exc))
            )
        except Exception as exc:  # the model raised: its callers get a ModelError naming it
            message = f"model '{self.config.name}' raised {type(exc).__name__}: {exc}"
            log.warning("batch %d failed: %s", batch.batch_id, message)
            return p.BatchDone(
                batch.batch_id, time.perf_counter() - start, batch_error=("ModelError", message)
            )
        item_errors = {i: ("ModelError", m) for i, m in errors.items()}
        return p.BatchDone(
            batch.batch_id, time.perf_counter() - start, outputs=converted, item_errors=item_errors
        )

    # ---- LLM models: the engine loop instead of the batch loop ----------------------------------------
    def _new_engine(self) -> LLMEngine | None:
        if not isinstance(self.model, LLMModel):
            return None
        assert self.config is not None
        scheduler = new_scheduler(scheduler_config(self.config.params), MonotonicClock())
        return LLMEngine(self.model, scheduler, self._send, self._flush, self._executor)

    async def _run_engine(self) -> None:
        assert self._engine is not None
        await self._engine.run()
        await self._flush()

    async def _predict(self, model: Model, items: list) -> object:
        if inspect.iscoroutinefunction(model.predict_batch):
            return await model.predict_batch(items)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, model.predict_batch, items)

    async def _heartbeat(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self._send(p.Heartbeat(running=self.running, completed_batches=self.completed))
            await self._flush()

    def _send(self, msg: p.Message) -> None:
        assert self._writer is not None
        if not self._writer.is_closing():
            self._writer.write(p.encode_frame(msg))

    async def _flush(self) -> None:
        assert self._writer is not None
        with contextlib.suppress(OSError):  # a reset, or unacknowledged too long: _receive sees it too
            await self._writer.drain()


def give_up_when_silent(writer: asyncio.StreamWriter, timeout_s: float) -> None:
    """Over TCP, let the kernel end the connection when what we send (heartbeats, every second) stays
    unacknowledged for the front end's own heartbeat timeout: a partitioned worker then finds out when
    the front end gives it up, and rejoins as soon as the network heals."""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if timeout_s <= 0 or sock is None or option is None or sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, option, int(timeout_s * 1000))


def transport(address: str, ca_file: Path | None, ca_pem: str, insecure: bool) -> ssl.SSLContext | None:
    """How the worker reaches its front end: a Unix socket, TLS verified against the CA, or plain TCP
    (loopback, or --insecure); ConfigError naming the fix otherwise."""
    try:
        kind, target = p.parse_address(address)
    except ValueError as exc:
        raise ConfigError(f"--connect: {exc}") from None
    if kind == "unix":
        return None
    context = tls.client_context(ca_file, ca_pem) if ca_file is not None or ca_pem else None
    assert isinstance(target, tuple)
    tls.check_worker_transport(address, target[0], tls=context is not None, insecure=insecure)
    return context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd-worker", description="Run one inferd worker (one device).")
    parser.add_argument("--connect", required=True, help="front end address: unix:/path or HOST:PORT")
    parser.add_argument("--model", required=True, help="name of the model this worker serves")
    parser.add_argument("--token", default="", help="join token, if the front end requires one")
    parser.add_argument("--worker-id", default="", help="worker id (default: random)")
    parser.add_argument(
        "--reconnect",
        action="store_true",
        help="when the front end goes away, reconnect and register again (remote workers)",
    )
    parser.add_argument(
        "--model-repo",
        type=Path,
        default=None,
        help="this host's copy of the model repository (for models served from one)",
    )
    parser.add_argument(
        "--model-version",
        type=int,
        default=0,
        help="the model version to serve, when several are served side by side (default: the default one)",
    )
    parser.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        help="join over TLS, verifying the front end against this CA (PEM)",
    )
    parser.add_argument("--ca-pem", default="", help="the same CA as PEM text (Ray actors)")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow plain TCP to a front end that is not on loopback (it needs --insecure too)",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--trace-endpoint", default=None, help="export spans to this OTLP/HTTP collector")
    parser.add_argument("--service-name", default=None, help="service.name of the spans (OTEL_SERVICE_NAME)")
    args = parser.parse_args(argv)
    observe = from_environment(
        os.environ,
        log_format=args.log_format,
        trace_endpoint=args.trace_endpoint,
        service_name=args.service_name,
    )
    set_up_process(observe, args.log_level, "worker", [args.token])
    try:
        tls_context = transport(args.connect, args.ca_file, args.ca_pem, args.insecure)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worker = Worker(
        args.connect,
        args.model,
        args.token,
        args.worker_id or uuid.uuid4().hex[:8],
        reconnect=args.reconnect,
        model_repo=args.model_repo,
        model_version=args.model_version,
        tls_context=tls_context,
    )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(worker.run())
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, p.ConnectionClosed, BaseExceptionGroup) as exc:
        log.warning("worker %s lost its front end: %r", worker.worker_id, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
