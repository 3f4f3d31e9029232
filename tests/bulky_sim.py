"""`sim` with one bulky, slow answer on demand: the stuck-front-end test fills a link's buffers with it.

An input that starts with "!bulky" is noted (one line, its text, appended to the file `params.started_log`
names) when its batch starts, takes `params.bulky_ms` more, and answers `bulky_output(input,
params.bulky_bytes)`: bigger than the kernel's socket buffers hold. Every other input is plain `sim`.
"""

from __future__ import annotations

import time

from inferd.models.sim import SimModel, sim_digest


def bulky_output(text: str, size: int) -> str:
    """The answer to a bulky input: its sim digest, repeated to `size` characters."""
    digest = sim_digest("sim", 1, text)
    return (digest * (size // len(digest) + 1))[:size]


class BulkySim(SimModel):
    def predict_batch(self, inputs: list[bytes]) -> list[str]:
        bulky = [item for item in inputs if item.startswith(b"!bulky")]
        if not bulky:
            return super().predict_batch(inputs)
        p = self.config.params
        with open(p["started_log"], "a") as log:
            log.write("".join(f"{item.decode()}\n" for item in bulky))
        time.sleep(float(p["bulky_ms"]) / 1000.0)
        out = super().predict_batch(inputs)
        size = int(p["bulky_bytes"])
        return [
            bulky_output(i.decode(), size) if i.startswith(b"!bulky") else o
            for i, o in zip(inputs, out, strict=True)
        ]
