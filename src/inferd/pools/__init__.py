"""Pools: worker processes that load many models on demand, each within a memory budget (docs/architecture.md, "Pools")."""
