"""Crashes its worker process while loading: a crash loop."""

import os

import inferd


class Model(inferd.Model):
    def load(self) -> None:
        os._exit(13)

    def predict_batch(self, inputs: list[bytes]) -> list[bytes]:
        return inputs
