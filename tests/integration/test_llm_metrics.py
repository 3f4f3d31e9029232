"""/metrics of a real server with sim-llm carries every LLM metric issue 5 lists, and the prefix cache
counters move by exactly the tokens two requests sharing a prefix should hit."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import ServerProc, start_server

BLOCK_SIZE = 16
"""sim-llm's default KV block size (SchedulerConfig.block_size): only full blocks are cached."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("llm-metrics")
    (root / "repo" / "sim-llm").mkdir(parents=True)
    (root / "repo" / "sim-llm" / "model.toml").write_text('builtin = "sim-llm"\n')
    s = start_server(root, "--model-repo", str(root / "repo"))
    yield s
    assert s.stop() in (0, -15)


def scrape(server: ServerProc) -> str:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_prefix_cache_counters_count_the_shared_full_blocks(server: ServerProc) -> None:
    hits, queries = (
        'inferd_llm_prefix_cache_hit_tokens_total{model="sim-llm",version="1"}',
        'inferd_llm_prefix_cache_query_tokens_total{model="sim-llm",version="1"}',
    )
    before = scrape(server)
    shared = " ".join(f"w{i}" for i in range(2 * BLOCK_SIZE))  # two full blocks
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    for tail in ("first caller asks this", "second caller asks that"):
        c.completions.create(model="sim-llm", prompt=f"{shared} {tail}", max_tokens=2, seed=1)
    after = scrape(server)
    prompt_len = 2 * BLOCK_SIZE + 4
    assert metric(after, queries) - metric(before, queries) == 2 * prompt_len
    assert metric(after, hits) - metric(before, hits) == 2 * BLOCK_SIZE, "the second prompt hit both blocks"


def test_prefix_cache_never_crosses_tenants(server: ServerProc) -> None:
    """The same prompt from another tenant (X-Tenant) hits nothing; from the same tenant it hits."""
    hits = 'inferd_llm_prefix_cache_hit_tokens_total{model="sim-llm",version="1"}'
    prompt = " ".join(f"t{i}" for i in range(2 * BLOCK_SIZE)) + " tail"
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    def ask(tenant: str) -> float:
        before = metric(scrape(server), hits)
        c.completions.create(
            model="sim-llm", prompt=prompt, max_tokens=2, seed=1, extra_headers={"X-Tenant": tenant}
        )
        return metric(scrape(server), hits) - before

    assert ask("tenant-a") == 0  # first sight of this prompt
    assert ask("tenant-b") == 0, "tenant-b hit tenant-a's cached blocks"
    assert ask("tenant-a") == 2 * BLOCK_SIZE


def test_every_llm_metric_of_the_issue_is_exported(server: ServerProc) -> None:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    list(c.completions.create(model="sim-llm", prompt="count me in", max_tokens=4, stream=True))
    text = scrape(server)
    for name in (
        "inferd_time_to_first_token_seconds_count",
        "inferd_inter_token_latency_seconds_count",
        "inferd_llm_request_duration_seconds_count",
        "inferd_prompt_tokens_total",
        "inferd_generation_tokens_total",
        "inferd_llm_kv_usage_ratio",
        "inferd_llm_prefix_cache_hit_tokens_total",
        "inferd_llm_prefix_cache_query_tokens_total",
        "inferd_llm_preemptions_total",
    ):
        assert metric(text, f'{name}{{model="sim-llm",version="1"}}') >= 0
    for state in ("running", "waiting"):
        assert metric(text, f'inferd_llm_sequences{{model="sim-llm",state="{state}",version="1"}}') == 0
    assert metric(text, 'inferd_generation_tokens_total{model="sim-llm",version="1"}') >= 4
