"""`inferd index load`, `inferd bench-search` and `inferd plan search`: search through the HTTP API."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer

index_app = typer.Typer(no_args_is_help=True, help="Search indexes: load documents.")
plan_app = typer.Typer(no_args_is_help=True, help="Capacity plans from saved benchmark profiles.")

Url = Annotated[str, typer.Option(help="Base URL of the server's HTTP API.")]


def _call(url: str, method: str, body: Any, timeout_s: float = 300.0) -> tuple[int, Any]:
    if not url.startswith(("http://", "https://")):
        raise typer.BadParameter(f"--url must be an http:// or https:// address, got {url!r}")
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # nosec B310  # http(s) only: checked above
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except OSError as exc:
        typer.echo(f"error: cannot reach {url}: {exc}", err=True)
        raise typer.Exit(1) from None


@index_app.command("load")
def load(
    name: Annotated[str, typer.Argument(help="The index.")],
    file: Annotated[Path, typer.Argument(help="Documents, one JSON object a line: id, text, title, fields.")],
    url: Url = "http://127.0.0.1:8000",
    batch: Annotated[int, typer.Option(help="Documents per request (at most 1000).")] = 256,
    create: Annotated[
        str | None,
        typer.Option(help="Create the index first with these settings (JSON, e.g. '{\"shards\": 2}')."),
    ] = None,
) -> None:
    """Load a JSON-lines file of documents into an index, with a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from inferd.bench.search import read_jsonl

    base = f"{url.rstrip('/')}/v1/indexes/{name}"
    if create is not None:
        status, answer = _call(base, "PUT", json.loads(create))
        if status not in (200, 201):
            typer.echo(f"error: creating index {name}: {status} {answer}", err=True)
            raise typer.Exit(1)
    docs = [
        {k: d[k] for k in ("id", "text", "title", "fields") if d.get(k) is not None} | {"id": str(d["id"])}
        for d in read_jsonl(file)
    ]
    seq: list[int] = []
    with Progress(
        *Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()
    ) as bar:
        task = bar.add_task(f"loading {name}", total=len(docs))
        for i in range(0, len(docs), batch):
            status, answer = _post_batch(f"{base}/documents", docs[i : i + batch])
            if status != 200:
                typer.echo(f"error: batch at line {i + 1}: {status} {answer}", err=True)
                raise typer.Exit(1)
            seq = answer["seq"]
            bar.advance(task, len(docs[i : i + batch]))
    typer.echo(json.dumps({"index": name, "documents": len(docs), "seq": seq}))


LOAD_RETRIES = 3
"""A batch answered 503 (nothing written: the embedder failed or was busy) is sent again this often."""


def _post_batch(url: str, docs: list[dict[str, Any]]) -> tuple[int, Any]:
    """One batch, sent again after 1, 2, 4 s while it is answered 503 (safe: an upsert replaces)."""
    for attempt in range(LOAD_RETRIES + 1):
        status, answer = _call(url, "POST", {"documents": docs})
        if status != 503 or attempt == LOAD_RETRIES:
            return status, answer
        typer.echo(f"retrying a batch in {2**attempt} s: {answer}", err=True)
        time.sleep(2**attempt)
    return status, answer


def bench_search(
    index: Annotated[
        str | None, typer.Argument(help="The index to search (not with --shard-profile).")
    ] = None,
    url: Url = "http://127.0.0.1:8000",
    queries: Annotated[Path | None, typer.Option(help="Queries, JSON lines {id, text}.")] = None,
    qrels: Annotated[
        Path | None, typer.Option(help="Judgements, JSON lines {query_id, doc_id, relevance}.")
    ] = None,
    collection: Annotated[
        Path | None, typer.Option(help="A judged collection folder (its queries.jsonl and qrels.jsonl).")
    ] = None,
    rate: Annotated[float, typer.Option(help="Searches per second (Poisson arrivals).")] = 50.0,
    duration_s: Annotated[float, typer.Option(help="Seconds of load.")] = 10.0,
    k: Annotated[int, typer.Option(help="Hits per search under load.")] = 10,
    mode: Annotated[str, typer.Option(help="hybrid, lexical or dense.")] = "hybrid",
    timeout_ms: Annotated[float, typer.Option(help="Each search's timeout_ms.")] = 1000.0,
    kill_at_s: Annotated[
        float | None, typer.Option(help="SIGKILL a replica of shard 0 at this second.")
    ] = None,
    slow_at_s: Annotated[
        float | None, typer.Option(help="SIGSTOP a replica of shard 0 at this second.")
    ] = None,
    slow_s: Annotated[float, typer.Option(help="How long the stopped replica stays stopped.")] = 2.0,
    slow_factor: Annotated[
        float | None,
        typer.Option(help="Slow the replica this many times (run 1/F of the time) instead of stopping it."),
    ] = None,
    result_cache: Annotated[
        bool, typer.Option("--result-cache/--no-result-cache", help="Let searches use the result cache.")
    ] = True,
    fresh_queries: Annotated[
        bool, typer.Option(help="Make every search's text unique, so each query is embedded (uncached).")
    ] = False,
    out: Annotated[Path | None, typer.Option(help="Save the report (JSON).")] = None,
    shard_profile: Annotated[
        bool,
        typer.Option(
            "--shard-profile",
            help="Instead: build shards in process at --sizes and measure their per-query CPU and memory "
            "(the profile `inferd plan search` reads; no server).",
        ),
    ] = False,
    sizes: Annotated[str, typer.Option(help="Documents per profiled shard, comma-separated.")] = (
        "10000,100000,300000"
    ),
    dim: Annotated[int, typer.Option(help="Vector length of the profiled shards.")] = 384,
    save_profile: Annotated[Path | None, typer.Option(help="Where to save the shard profile.")] = None,
) -> None:
    """Open-loop load and quality (nDCG@10, Recall@100) through the search API; HDR latencies. With
    --shard-profile: the per-shard cost profile of `inferd plan search`, measured in process."""
    from inferd.bench.search import BenchSpec, read_qrels, read_queries, run_bench

    if shard_profile:
        _shard_profile(sizes, dim, save_profile)
        return
    if index is None:
        typer.echo("error: give the INDEX to search (or --shard-profile)", err=True)
        raise typer.Exit(2)
    if collection is not None:
        queries, qrels = collection / "queries.jsonl", collection / "qrels.jsonl"
    if queries is None:
        typer.echo("error: give --queries FILE (or --collection DIR)", err=True)
        raise typer.Exit(2)
    spec = BenchSpec(
        url,
        index,
        read_queries(queries),
        read_qrels(qrels) if qrels is not None else {},
        rate=rate,
        duration_s=duration_s,
        k=k,
        mode=mode,
        timeout_ms=timeout_ms,
        kill_at_s=kill_at_s,
        slow_at_s=slow_at_s,
        slow_s=slow_s,
        slow_factor=slow_factor,
        result_cache=result_cache,
        fresh_queries=fresh_queries,
    )
    report = asyncio.run(run_bench(spec)).to_json()
    if out is not None:
        out.write_text(report)
    typer.echo(report)


def _shard_profile(sizes: str, dim: int, save_profile: Path | None) -> None:
    import json

    from inferd.kinds.search.shard_profile import ShardProfileSpec, profile_shards

    try:
        spec = ShardProfileSpec(sizes=tuple(int(float(x)) for x in sizes.split(",")), dim=dim)
        profile = profile_shards(spec, lambda line: typer.echo(line, err=True))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    text = json.dumps(profile, indent=1)
    if save_profile is not None:
        save_profile.write_text(text)
    typer.echo(text)


@plan_app.command("search")
def plan_search_cmd(
    profile: Annotated[
        Path | None,
        typer.Option(help="A shard profile (inferd bench-search --shard-profile); default: the bundled one."),
    ] = None,
    docs: Annotated[float, typer.Option(help="Documents to hold, e.g. 1e9.")] = 1e9,
    qps: Annotated[float, typer.Option(help="Searches per second to serve, e.g. 1e6.")] = 1e6,
    dim: Annotated[int, typer.Option(help="Vector length.")] = 384,
    recall: Annotated[float, typer.Option(help="Wanted HNSW recall@10 against exact search.")] = 0.95,
    mode: Annotated[str, typer.Option(help="hybrid, lexical or dense.")] = "hybrid",
    host_memory_gib: Annotated[float, typer.Option(help="Memory of one host.")] = 512.0,
    host_cores: Annotated[int, typer.Option(min=1, help="Cores of one host.")] = 64,
    docs_per_shard: Annotated[
        int | None, typer.Option(help="Fix the shard size (default: the one needing fewest hosts).")
    ] = None,
    ef_search: Annotated[
        int | None, typer.Option(help="Fix HNSW ef_search (a profiled one; default: from the recall fit).")
    ] = None,
    max_extrapolation: Annotated[
        float, typer.Option(help="Consider shards up to this many times the largest profiled one.")
    ] = 10.0,
    max_call_ms: Annotated[
        float, typer.Option(help="Longest CPU time (service time) of one shard call.")
    ] = 100.0,
    json_output: Annotated[
        bool, typer.Option("--json", help="The plan as JSON (schema inferd.plan/1).")
    ] = False,
) -> None:
    """Shard size, shards, replicas, cores, hosts and memory for a search workload, step by step
    (docs/search-capacity.md)."""
    from inferd.config import ConfigError
    from inferd.fleetsim.search_plan import SearchTargets, load_profile, plan_search

    targets = SearchTargets(
        docs, qps, dim, recall, mode, host_memory_gib, host_cores, max_call_ms=max_call_ms,
        docs_per_shard=docs_per_shard, ef_search=ef_search, max_extrapolation=max_extrapolation,
    )  # fmt: skip
    try:
        data, name = load_profile(profile)
        plan = plan_search(data, targets, profile_name=name)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    report = plan.report()
    if json_output:
        typer.echo(report.to_json())
        return
    c = plan.chosen
    typer.echo(
        f"plan search: {docs:g} documents, {qps:g} searches/s ({mode}), dim {dim}, recall@10 >= {recall}"
    )
    typer.echo(f"profile: {name}")
    typer.echo(f"  shards:       {c.shards:,} of {c.docs_per_shard:,} documents ({c.shard_gib} GiB each)")
    typer.echo(f"  replicas:     {c.replicas_per_shard:,} a shard, {c.replica_processes:,} in all")
    typer.echo(f"  front end:    {c.frontend_cores:,} cores")
    typer.echo(f"  cores:        {c.cores:,}")
    typer.echo(f"  hosts:        {c.hosts:,} ({host_cores} cores, {host_memory_gib:g} GiB each)")
    typer.echo(f"  memory:       {c.memory_gib / 1024:,.1f} TiB")
    typer.echo("reasoning:")
    for i, step in enumerate(report.reasoning, 1):
        typer.echo(f"  {i}. {step}")
