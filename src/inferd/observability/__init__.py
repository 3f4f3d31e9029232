"""Metrics, logging and (later) tracing."""
