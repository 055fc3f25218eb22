"""The GGUF → safetensors cache: a GGUF target dequantised once, then read back in seconds.

`transformers`/`gguf` dequantise a GGUF in tens of seconds to minutes; the result (config.json,
model.safetensors, the tokenizer files) is kept as a directory under the cache root. Several processes
may want the same target at once (an eval's shards, a server beside a trainer), and any may be killed
while converting, so a cache directory is

1. written by one process at a time: the others wait on a file lock beside it (`filelock`, a kernel
   lock that dies with its holder, so a killed converter never blocks the next) and then read its work;
2. written whole: into a hidden temporary sibling, flushed to disk and renamed into place
   (`hspec.durable.atomic_directory`), so a reader never sees half a cache;
3. marked complete: `hspec-cache.json` records the size and sha256 of every file, and a load checks
   them; a cache without the marker (incomplete, or from before it existed) or with a file that differs
   (corrupted, truncated, edited) is converted again, with a message that says why.

The check reads every byte once more on each load (sha256: about 1.2 s a GB on one core; SmolLM2-135M's
540 MB, 0.7 s); the load reads them right after, from the page cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import filelock
import torch

from hspec.durable import atomic_directory, remove_stale_temporaries

MARKER_FILE = "hspec-cache.json"  # written last inside the temporary directory, so its presence means complete


def cached_conversion(gguf_path: Path, out_dir: Path,
                      convert: Callable[[Path, Path], None] | None = None) -> Path:
    """`out_dir`, a complete conversion of `gguf_path`: the cache if it checks out, else converted now.

    `convert(gguf_path, directory)` writes the converted files into an empty `directory` (default
    `dequantize_gguf`). Returns `out_dir`.
    """
    if cache_problem(out_dir) is None:  # the common case: no lock taken
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(out_dir.parent / f".{out_dir.name}.lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        print(f"[hspec] waiting for another process converting {gguf_path.name} into {out_dir} (lock {lock.lock_file})",
              flush=True)
        lock.acquire()
    try:
        problem = cache_problem(out_dir)  # another process may have finished it while this one waited
        if problem is None:
            return out_dir
        for line in remove_stale_temporaries(out_dir.parent, out_dir.name):  # ours to clear: we hold its lock
            print(f"[hspec] {line}", flush=True)
        if out_dir.exists():
            print(f"[hspec] the cache at {out_dir} is not usable ({problem}); converting {gguf_path.name} again",
                  flush=True)
        else:
            print(f"[hspec] converting {gguf_path.name} to a safetensors cache at {out_dir} (once)", flush=True)
        with atomic_directory(out_dir) as staging:
            (convert or dequantize_gguf)(gguf_path, staging)
            write_marker(staging, gguf_path)
    finally:
        lock.release()
    return out_dir


def cache_problem(out_dir: Path) -> str | None:
    """Why `out_dir` is not a complete, intact cache (None: it is one): what its marker says against its files."""
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return "absent" if not out_dir.exists() else \
            f"no {MARKER_FILE}: its conversion never finished, or an hspec without the marker wrote it"
    try:
        recorded = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{marker} is unreadable ({type(err).__name__}: {err})"
    present = sorted(p.name for p in out_dir.iterdir() if p.is_file() and p.name != MARKER_FILE)
    if present != sorted(recorded):
        return f"it holds {present}, its marker lists {sorted(recorded)}"
    for name in present:
        size, digest = _size_and_digest(out_dir / name)
        if [size, digest] != [recorded[name].get("bytes"), recorded[name].get("sha256")]:
            return f"{name} differs from what was written ({size} bytes, sha256 {digest[:12]}...; written: " \
                   f"{recorded[name].get('bytes')} bytes, sha256 {str(recorded[name].get('sha256'))[:12]}...)"
    return None


def write_marker(directory: Path, gguf_path: Path) -> None:
    """Record the size and sha256 of every file in `directory` (what `cache_problem` checks) and the source."""
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        size, digest = _size_and_digest(path)
        files[path.name] = {"bytes": size, "sha256": digest}
    (directory / MARKER_FILE).write_text(json.dumps({"source": str(gguf_path), "files": files}, indent=2) + "\n")


def _size_and_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def dequantize_gguf(gguf_path: Path, directory: Path) -> None:
    """Write `gguf_path` dequantised to float32 into `directory`: model.safetensors, config.json, tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers refuses to re-save a GGUF-loaded model, so write the tensors and config ourselves.
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    raw = hf_model.config.to_dict()
    raw.pop("quantization_config", None)
    raw["architectures"] = [type(hf_model).__name__]
    raw["hspec_source"] = str(gguf_path)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
