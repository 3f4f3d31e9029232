"""Returns one output too few whenever a batch holds more than one item."""

import inferd


class Model(inferd.Model):
    def predict_batch(self, inputs: list[bytes]) -> list[bytes]:
        out = [b"ok:" + x for x in inputs]
        return out[:-1] if len(out) > 1 else out
