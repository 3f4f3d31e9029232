"""Sharded, replicated search: the index library (types, analyzer, lexical and dense indexes, the shard,
its write-ahead log and snapshots, filters, fusion, quality metrics). The service is built on top of it."""
