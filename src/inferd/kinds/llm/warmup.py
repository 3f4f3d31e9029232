"""An LLM worker's warm-up: a short prefill and a few decodes of one throwaway sequence through the model's
`run_step`, run once after load and before the worker reports Ready (worker/device.py), so that no
request pays for the backend's first calls (buffers allocated, kernels chosen, pages touched) and a model
that cannot compute a step fails its load instead of its first requests.

The prompt is token ids 1..n (ids every vocabulary of more than n tokens holds), n within the scheduler's
step budget; sampling is greedy. The sequence is released afterwards: it holds nothing once Ready is sent.
"""

from __future__ import annotations

import time

from inferd.kinds.llm.engine import scheduler_config
from inferd.kinds.llm.model import LLMModel, LLMRequest
from inferd.kinds.llm.plan import ScheduledChunk, StepPlan

WARMUP_SEQ = "inferd-warmup"
PROMPT_TOKENS = 8
"""Prompt length of the warm-up (fewer when the scheduler's step budget is smaller)."""
DECODE_STEPS = 2


def warm_up(model: LLMModel, decode_steps: int = DECODE_STEPS) -> float:
    """Run the warm-up on `model` (in the device thread); returns its seconds. RuntimeError when a step
    samples no token (the backend failed it)."""
    start = time.perf_counter()
    budget = scheduler_config(model.config.params).max_num_batched_tokens
    prompt = tuple(range(1, min(PROMPT_TOKENS, budget) + 1))
    requests = {WARMUP_SEQ: LLMRequest(WARMUP_SEQ, prompt, seed=0, temperature=0.0, ignore_eos=True)}
    chunk = ScheduledChunk(WARMUP_SEQ, 0, prompt, (), True)  # the whole prompt, sampling the first token
    try:
        for step in range(decode_steps + 1):
            plan = StepPlan(step, (chunk,), (), (), len(chunk.token_ids))
            token = model.run_step(plan, requests).get(WARMUP_SEQ)
            if token is None or token.token is None:
                raise RuntimeError(f"the warm-up's step {step} sampled no token ({token})")
            position = chunk.start + len(chunk.token_ids)
            chunk = ScheduledChunk(WARMUP_SEQ, position, (token.token,), (), True)  # the next decode
    finally:
        model.release(WARMUP_SEQ)
    return time.perf_counter() - start
