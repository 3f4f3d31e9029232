"""LlmService: the one way a request's text generation reaches an LLM model and comes back, whatever the
edge (the OpenAI routes in api/completions.py, the gRPC edge's vLLM tensors in grpc_edge/text.py, both
through api/generation.py). The edge parses its wire once into a `GenerationRequest` and the call's
deadline, priority and tenant share (`rt.service.generate` or `collect`); it only encodes what comes
back.

    check     n and the sampling parameters (`GenerationRequest.checked`: a 400 naming the bad one)
    tokenize  in a thread for a long prompt; an empty one is a 400
    length    prompt + max_tokens within the model's context (ContextLengthExceeded, 400); without
              max_tokens a chat answer may fill the rest of the context, a completion stops at 16
    deadline  passed before anything is scheduled: DeadlineExceeded (504); later, LLMRuntime's watchdog
              fails the stream and aborts the sequence in its engine
    reserve   the caller's tokens (prompt + n x max_tokens) through the edge's hook (the gateway's quota
              admission, which kinds/ never imports): it raises to refuse, before anything is submitted
    hold      no worker in service: the request waits for one (`rt.hold`, kinds/llm/cold.py), within its
              deadline and the cold bound, or is refused (429, 503) at once
    submit    one sequence per choice (`n`), choice i sampling with seed + i, all or none
    text      `Choices.stream` (pieces as they come) or `Choices.collect` (whole texts), stop strings
              applied (kinds/llm/text.py). Their `finally` aborts every sequence still running:
              client_gone=True when the consumer stopped early or the caller left, False when the
              choices ended or one of them failed

"The caller went away" is protocol-neutral, as for BatchService: `gone` registers a callback, called once
if the caller leaves, and returns what stops watching (an edge's `call.departure.watch`; None: nobody to
watch, or the consumer stops the stream itself when its caller leaves, as the HTTP edge's streamed
response does). When it fires, the sequences are aborted at once and the wait ends with ClientGone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Protocol

import msgspec

from inferd.clock import Clock
from inferd.errors import BadRequest, ClientGone, DeadlineExceeded, ServingError
from inferd.kinds.llm.model import Tokenizer
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.stream import TokenStream
from inferd.kinds.llm.text import interleave, pieces
from inferd.routing.fairness import INTERACTIVE, NO_TENANT, TenantShare

DEFAULT_MAX_TOKENS = 16
"""A completion's length without max_tokens (OpenAI's default; a chat answer's is the rest of the context)."""
MAX_CHOICES = 16
"""Most choices (`n`) one request may ask for."""
MAX_SEED = 2**63 - 1 - MAX_CHOICES
"""Choice i samples with seed + i: every one stays a non-negative 64-bit integer."""
TOKENIZE_IN_THREAD_CHARS = 64 * 1024

Unwatch = Callable[[], None]
GoneWatch = Callable[[Callable[[], None]], Unwatch]
"""Registers `on_gone`, called once if the caller goes away (soon, if it has already); returns what stops
the watch."""
Reserve = Callable[[int, Sequence[TokenStream]], Awaitable[None]]
"""The edge's admission of the call's tokens: the tokens it may use (prompt + n x max_tokens) and the
list its choices' streams are put in (read at the end, to refund what they did not use). Raises to
refuse."""


class ContextLengthExceeded(BadRequest):
    """Prompt plus max_tokens exceed the model's context (OpenAI code `context_length_exceeded`)."""

    @property
    def code(self) -> str:
        return "context_length_exceeded"


def check_context(max_model_len: int, prompt_tokens: int, max_tokens: int, what: str) -> None:
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({prompt_tokens} in the {what}, {max_tokens} in the completion). Please "
            f"reduce the length of the {what} or completion."
        )


class LlmSequences(Protocol):
    """What the service needs of an LLM model's runtime (kinds/llm/runtime.py LLMRuntime)."""

    clock: Clock
    tokenizer: Tokenizer
    max_model_len: int

    async def hold(self, n: int, deadline: float | None) -> None: ...

    def submit(self, prompt: list[int], gen: Generation) -> TokenStream: ...

    def abort(self, stream: TokenStream, client_gone: bool = True) -> None: ...


class Sampling(msgspec.Struct, frozen=True):
    """A request's checked sampling parameters: what changes the generated text."""

    max_tokens: int
    """The request's, or DEFAULT_MAX_TOKENS when it gave none (the service then sets it from the
    prompt's length)."""
    seed: int | None
    """None: unseeded (a negative seed means none, llama.cpp's convention)."""
    temperature: float
    top_p: float
    ignore_eos: bool


class GenerationRequest(msgspec.Struct, frozen=True):
    """What to generate, as an edge parsed it; `checked` (which the service calls) refuses bad values.
    (Structs, not frozen dataclasses: built on every request, in a fifth of the time.)"""

    prompt: str | Sequence[int]
    """The prompt's text, or its token ids."""
    chat: bool = False
    """The text is a rendered chat template: its control tokens must parse as such (a raw completion
    prompt's never do), and without max_tokens the answer may fill the rest of the context."""
    n: int = 1
    max_tokens: int | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    ignore_eos: bool = False
    """Keep generating past end-of-turn until max_tokens (vLLM's extension, for benchmarks)."""
    stops: tuple[str, ...] = ()
    """Stop strings: the text ends before the first one the output reaches."""

    @property
    def what(self) -> str:
        """How errors name the prompt."""
        return "messages" if self.chat else "prompt"

    def checked(self) -> Sampling:
        """The sampling parameters, checked: a BadRequest naming the first bad one (n first)."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise BadRequest(f"n must be between 1 and {MAX_CHOICES}, got {self.n}")
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
        temperature = 1.0 if self.temperature is None else self.temperature
        if not 0.0 <= temperature <= 2.0:
            raise BadRequest(f"temperature must be between 0 and 2, got {temperature}")
        top_p = 1.0 if self.top_p is None else self.top_p
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
        seed = self.seed
        if seed is not None and seed < 0:
            seed = None  # -1 and other negatives mean "no seed" (llama.cpp's convention)
        if seed is not None and seed > MAX_SEED:
            raise BadRequest(f"seed must be at most {MAX_SEED} (or negative for none), got {seed}")
        return Sampling(max_tokens, seed, temperature, top_p, self.ignore_eos)


class Completion(msgspec.Struct, frozen=True):
    """A request's whole answer: each choice's (text, finish_reason), its usage, where it ran."""

    texts: list[tuple[str, str]]
    prompt_tokens: int
    completion_tokens: int
    worker_id: str
    """The worker that generated the first choice (the last one, after a failover)."""


class LlmService:
    """One LLM model's text generation: check, tokenize, admit, submit, then the choices' text."""

    __slots__ = ("_rt",)

    def __init__(self, runtime: LlmSequences) -> None:
        self._rt = runtime

    async def generate(
        self,
        request: GenerationRequest,
        *,
        deadline: float | None,
        priority: int = INTERACTIVE,
        share: TenantShare = NO_TENANT,
        reserve: Reserve | None = None,
    ) -> Choices:
        """Every choice submitted, as `Choices`; raises (nothing left running) what refuses the request:
        BadRequest (a parameter, an empty prompt, ContextLengthExceeded), DeadlineExceeded (`deadline`,
        absolute on the runtime's clock, already passed), `reserve`'s refusal, the cold hold's (no worker
        in service: Overloaded, WorkerUnavailable, DeadlineExceeded) or the placement's (Overloaded,
        WorkerUnavailable). `share` is the call's tenant: its fairness lane and its
        prefix-cache salt, one value."""
        rt = self._rt
        sampling = request.checked()
        ids = await self._tokens(request)
        max_tokens = sampling.max_tokens
        if request.max_tokens is None and request.chat:  # a chat answer may fill the rest of the context
            max_tokens = max(1, rt.max_model_len - len(ids))
        check_context(rt.max_model_len, len(ids), max_tokens, request.what)
        if deadline is not None and rt.clock.now() >= deadline:
            raise DeadlineExceeded(f"the request's deadline passed before its {request.what} was scheduled")
        gen = Generation(
            max_tokens=max_tokens,
            seed=sampling.seed,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            priority=priority,
            tenant=share.name,
            weight=share.weight,
            ignore_eos=sampling.ignore_eos,
            deadline=deadline,
        )
        streams: list[TokenStream] = []
        if reserve is not None:
            await reserve(len(ids) + request.n * max_tokens, streams)
        await rt.hold(request.n, deadline)  # no worker in service: wait for one its waker starts
        try:
            for i in range(request.n):
                seed = None if gen.seed is None else gen.seed + i
                streams.append(rt.submit(ids, gen if i == 0 else dataclasses.replace(gen, seed=seed)))
        except Exception:  # all choices or none: a refused one takes the accepted ones with it
            for stream in streams:
                rt.abort(stream, client_gone=False)
            raise
        return Choices(rt, streams, list(request.stops))

    async def collect(
        self,
        request: GenerationRequest,
        *,
        deadline: float | None,
        priority: int = INTERACTIVE,
        share: TenantShare = NO_TENANT,
        reserve: Reserve | None = None,
        gone: GoneWatch | None = None,
    ) -> Completion:
        """The whole answer of a request that is not streamed: `generate`, then `Choices.collect`."""
        choices = await self.generate(request, deadline=deadline, priority=priority, share=share, reserve=reserve)
        texts = await choices.collect(gone)
        return Completion(texts, choices.prompt_tokens, choices.completion_tokens, choices.worker_id)

    async def _tokens(self, request: GenerationRequest) -> list[int]:
        prompt = request.prompt
        if not isinstance(prompt, str):
            ids = list(prompt)
        elif len(prompt) > TOKENIZE_IN_THREAD_CHARS:  # off the event loop
            ids = await asyncio.to_thread(self._rt.tokenizer.encode, prompt, request.chat)
        else:
            ids = self._rt.tokenizer.encode(prompt, request.chat)
        if not ids:
            raise BadRequest(f"the {request.what} is empty: it holds no tokens")
        return ids


class Choices:
    """A request's submitted sequences, one per choice: read once, by `stream` or by `collect`, whose end
    aborts whatever still runs."""

    __slots__ = ("_rt", "stops", "streams")

    def __init__(self, rt: LlmSequences, streams: list[TokenStream], stops: list[str]) -> None:
        self._rt = rt
        self.streams = streams
        self.stops = stops

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def worker_id(self) -> str:
        """The worker generating the first choice now (another one after a failover)."""
        return self.streams[0].worker_id

    @property
    def prompt_tokens(self) -> int:
        return self.streams[0].prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """The tokens every choice has generated so far."""
        return sum(s.completion_tokens for s in self.streams)

    async def stream(self, gone: GoneWatch | None = None) -> AsyncIterator[tuple[int, str, str | None]]:
        """(choice, text, finish_reason) as each choice's pieces come (each choice's own order kept; a
        choice's last piece has its finish_reason). A choice's ServingError ends them all and is raised;
        ClientGone when `gone` reports the caller left. Close it (`contextlib.aclosing`) to stop early."""
        rt = self._rt
        client_gone = True  # until every choice has ended on its own, or one failed
        left = False

        def on_gone() -> None:
            nonlocal left
            left = True
            self.abort(client_gone=True)  # the waiting choices fail at once

        unwatch = gone(on_gone) if gone is not None else None
        try:
            texts = [pieces(s, rt.tokenizer.detokenizer(), self.stops, rt.abort) for s in self.streams]
            if len(texts) == 1:  # nearly every request: its pieces read directly (one generator less a token)
                async with aclosing(texts[0]) as one:
                    async for text, finish in one:
                        yield 0, text, finish
            else:
                async with aclosing(interleave(texts)) as merged:
                    async for i, (text, finish) in merged:
                        yield i, text, finish
            client_gone = False
        except ServingError:
            if left:
                raise ClientGone() from None
            client_gone = False  # the other choices end because this one failed, not the client
            raise
        finally:
            if unwatch is not None:
                unwatch()
            self.abort(client_gone)

    async def collect(self, gone: GoneWatch | None = None) -> list[tuple[str, str]]:
        """Every choice's whole (text, finish_reason). A choice's error (DeadlineExceeded, WorkerDied,
        ...) is raised once all have ended; ClientGone when `gone` reports the caller left first."""
        work = asyncio.gather(*(self._whole(s) for s in self.streams), return_exceptions=True)
        left = False

        def on_gone() -> None:
            nonlocal left
            if not work.done():  # once every choice has ended, the results stand
                left = True
                self.abort(client_gone=True)

        unwatch = gone(on_gone) if gone is not None else None
        ended = False  # until every choice has ended: a cancellation ends the wait early
        try:
            results = await work
            ended = True
        finally:
            if unwatch is not None:
                unwatch()
            self.abort(client_gone=not ended)
        if left:
            raise ClientGone()
        for r in results:  # every choice was awaited, so no failure goes unretrieved; the first one answers
            if isinstance(r, BaseException):
                raise r
        return results

    async def _whole(self, stream: TokenStream) -> tuple[str, str]:
        parts, finish = [], "length"
        async for text, reason in pieces(stream, self._rt.tokenizer.detokenizer(), self.stops, self._rt.abort):
            parts.append(text)
            finish = reason or finish
        return "".join(parts), finish

    def abort(self, client_gone: bool) -> None:
        """End every sequence still running in its engine (a no-op for those that have ended)."""
        for stream in self.streams:
            self._rt.abort(stream, client_gone=client_gone)
