"""`sim` that records every run of every input: the network-fault tests count executions with it.

Before a batch runs, the worker appends one line per item to the file `params.exec_log` names:
"PID WALL_TIME INPUT". Appends of one short line per write do not interleave across processes.
"""

from __future__ import annotations

import os
import time

from inferd.models.sim import SimModel


class CountingSim(SimModel):
    def predict_batch(self, inputs: list[bytes]) -> list[str]:
        now = time.time()
        lines = "".join(f"{os.getpid()} {now:.3f} {item.decode()}\n" for item in inputs)
        with open(self.config.params["exec_log"], "a") as log:
            log.write(lines)
        return super().predict_batch(inputs)
