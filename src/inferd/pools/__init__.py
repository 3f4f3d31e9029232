"""Model pools: workers that load and unload many models on demand, within a memory budget each.

`residency.py`: what one pool worker holds, and which models it evicts to load another (the worker's own
rule; worker/pool.py runs it).
"""
