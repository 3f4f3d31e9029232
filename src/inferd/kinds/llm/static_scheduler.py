"""Static (request-level) batching: the baseline that continuous batching is measured against.

A batch of up to `max_num_seqs` waiting sequences is admitted only when nothing is running. It then
runs until every one of its sequences has finished; nothing joins it in flight, so a short request that
arrives just after a batch started waits for the batch's longest output. This is how request-level
batching servers behave.

Each member reserves KV blocks for its prompt plus `max_tokens` at admission, the way such servers
preallocate for the longest possible output. A batch therefore never runs out of blocks and never
preempts; a sequence that does not fit waits for the next batch. Within a batch everything else is the
continuous scheduler's: decodes first, prefill chunked under `max_num_batched_tokens`, interactive
before bulk, tenants taking turns by weight within a class.
"""

from __future__ import annotations

from inferd.kinds.llm.plan import StepPlan
from inferd.kinds.llm.scheduler import LLMScheduler, _Step


class StaticBatchScheduler(LLMScheduler):
    """`LLMScheduler` whose admissions happen only on steps that start with nothing running."""

    _batch_open = False

    def schedule(self) -> StepPlan:
        # Decided once, before this step schedules anything: only an idle engine may take a new batch.
        self._batch_open = not self.running_ids()
        return super().schedule()

    def _admit_class(self, cls: int, step: _Step) -> bool:
        """Admit one class's waiting head into the forming batch; False if its head has to stay."""
        if not self._batch_open or any(self._waiting[c] for c in self.CLASSES if c < cls):
            return False  # mid-flight, or a higher class still waits: nobody overtakes it
        queue = self._waiting[cls]
        block_size = self.config.block_size
        while (seq := queue.head()) is not None and len(self._running) < self.config.max_num_seqs:
            seq.extend_hashes(block_size)
            hit = self.kv.find_prefix(seq.block_hashes, seq.num_tokens)
            reserved = seq.num_tokens + seq.max_tokens - len(seq.output)
            if not self.kv.admit(seq.seq_id, hit, reserved):
                return False
            queue.pop(seq)
            self._start(seq, hit.num_tokens)
            step.take(seq, min(seq.num_pending, step.budget))
            step.admitted.append(seq.seq_id)
        return not queue
