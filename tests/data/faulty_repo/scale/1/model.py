"""Example user model: one vectorised numpy call for the whole batch."""

import numpy as np

import inferd


class Model(inferd.Model):
    def load(self) -> None:
        self.factor = 2.0

    def predict_batch(self, inputs: list[np.ndarray]) -> list[dict]:
        batch = np.stack(inputs)  # (n, 4)
        doubled = batch * self.factor
        sums = batch.sum(axis=1, dtype=np.float64)
        return [{"DOUBLED": d, "SUM": s} for d, s in zip(doubled, sums, strict=True)]

    def warmup_inputs(self) -> list[np.ndarray]:
        return [np.zeros(4, dtype=np.float32)]
