"""An on-disk cache of target features: one safetensors file per training sequence.

`hspec data features` fills it once; every drafter of a comparison then trains from the same files
(docs/design.md#training). Hidden states are stored in bf16 (their range can be large), the normed final hidden
and K/V in fp16; loading returns fp32. The teacher's summary (training/features.py) is computed from the
stored, fp16-rounded final hidden states, so it equals what training would compute from the file.
Files are written atomically, so an interrupted run resumes by skipping files that exist; files written
before the summary existed get it added by the next `hspec data features` over the same corpus.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from hspec.models.llama import TargetModel
from hspec.training.features import SequenceFeatures, compute_features, teacher_summary

# index.json keys renamed since caches were first written: old key -> current key (`read_index` maps them).
_RENAMED_KEYS = {"hidden_layers": "target_layers"}


def read_index(path: Path) -> dict:
    """A cache's index.json, with keys written under an old name (caches already on disk) renamed."""
    meta = json.loads(Path(path).read_text())
    for old, new in _RENAMED_KEYS.items():
        if old in meta and new not in meta:
            meta[new] = meta.pop(old)
    return meta


class FeatureStore:
    """Features of a corpus under `root`: `index.json` + `seq_XXXXX.safetensors`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        index = self.root / "index.json"
        if not index.exists():
            raise FileNotFoundError(f"no feature cache at {self.root} (index.json missing); run `hspec data features`")
        meta = read_index(index)
        self.target_layers = tuple(meta["target_layers"])
        self.kv_layers = tuple(meta["kv_layers"])
        self.ids: list[str] = meta["ids"]
        self.lengths: list[int] = meta["lengths"]
        self.target = meta["target"]

    def available(self) -> list[int]:
        """Indices of sequences whose feature file exists."""
        return [i for i in range(len(self.ids)) if self._path(i).exists()]

    def load(self, i: int) -> SequenceFeatures:
        with safe_open(str(self._path(i)), framework="pt") as f:
            meta = f.metadata()
            get = f.get_tensor
            kv = {layer: (get(f"k.{layer}").float(), get(f"v.{layer}").float()) for layer in self.kv_layers}
            summary = "target_lse" in f.keys()  # absent from files written before it existed
            return SequenceFeatures(tokens=get("tokens").long(), prompt_length=int(meta["prompt_length"]),
                                    hidden=get("hidden").float(), target_layers=self.target_layers,
                                    final_hidden=get("final_hidden").float(), kv=kv,
                                    target_lse=get("target_lse").float() if summary else None,
                                    target_argmax=get("target_argmax").long() if summary else None)

    def has_teacher_summary(self, i: int) -> bool:
        """Whether sequence i's file holds the teacher's summary."""
        with safe_open(str(self._path(i)), framework="pt") as f:
            return "target_lse" in f.keys()

    def tokens(self, i: int) -> torch.Tensor:
        """Only the token ids of sequence i, (S,) long (cheap: reads one tensor)."""
        with safe_open(str(self._path(i)), framework="pt") as f:
            return f.get_tensor("tokens").long()

    def _path(self, i: int) -> Path:
        return self.root / f"seq_{i:05d}.safetensors"

    @staticmethod
    def build(root: Path, model: TargetModel, target_name: str, records: Sequence[dict],
              target_layers: Sequence[int], kv_layers: Sequence[int]) -> FeatureStore:
        """Compute (or finish computing) the features of `records` (prompt_ids + response_ids)."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        meta = {"target": target_name, "target_layers": list(target_layers), "kv_layers": list(kv_layers),
                "ids": [r["id"] for r in records],
                "lengths": [len(r["prompt_ids"]) + len(r["response_ids"]) for r in records]}
        index = root / "index.json"
        if index.exists():
            old = read_index(index)
            if {k: old[k] for k in meta} != meta:
                raise ValueError(f"{root} holds features of another corpus or layer set; use another directory")
        else:
            index.write_text(json.dumps(meta))
        store = FeatureStore(root)
        done = {i for i in range(len(records)) if store._path(i).exists()}
        for i in tqdm(sorted(i for i in done if not store.has_teacher_summary(i)), desc="teacher summary", unit="seq"):
            store._write(i, store.load(i), model)
        for i in tqdm([i for i in range(len(records)) if i not in done], desc="features", unit="seq"):
            r = records[i]
            feats = compute_features(model, list(r["prompt_ids"]) + list(r["response_ids"]), len(r["prompt_ids"]),
                                     target_layers, kv_layers)
            store._write(i, feats, model)
        return store

    def _write(self, i: int, feats: SequenceFeatures, model: TargetModel) -> None:
        """Store sequence i's features (atomically), with the teacher's summary of the stored final hidden."""
        device = model.embed_tokens.weight.device
        final_hidden = feats.final_hidden.half()
        lse, argmax = teacher_summary(model, final_hidden.float().to(device))
        tensors = {"tokens": feats.tokens.int(), "hidden": feats.hidden.bfloat16(), "final_hidden": final_hidden,
                   "target_lse": lse, "target_argmax": argmax.int()}
        for layer, (k, v) in feats.kv.items():
            tensors[f"k.{layer}"], tensors[f"v.{layer}"] = k.half(), v.half()
        tmp = self._path(i).with_suffix(".tmp")
        save_file({k: t.to("cpu").contiguous() for k, t in tensors.items()}, str(tmp),
                  metadata={"prompt_length": str(feats.prompt_length)})
        os.replace(tmp, self._path(i))


class FeatureStores:
    """Several feature caches read as one (e.g. a corpus cached in parts); indices run across them."""

    def __init__(self, roots: Sequence[Path]) -> None:
        if not roots:
            raise ValueError("no feature cache directories given")
        self.stores = [FeatureStore(r) for r in roots]
        first = self.stores[0]
        for store in self.stores[1:]:
            if (store.target_layers, store.kv_layers, store.target) != (first.target_layers, first.kv_layers,
                                                                         first.target):
                raise ValueError(f"feature caches {first.root} and {store.root} differ in target or layers")
        self.target_layers, self.kv_layers, self.target = first.target_layers, first.kv_layers, first.target
        self._where = [(s, i) for s in self.stores for i in range(len(s.ids))]
        self.ids = [s.ids[i] for s, i in self._where]
        self.lengths = [s.lengths[i] for s, i in self._where]  # prompt + response tokens

    def available(self) -> list[int]:
        return [j for j, (s, i) in enumerate(self._where) if s._path(i).exists()]

    def load(self, j: int) -> SequenceFeatures:
        store, i = self._where[j]
        return store.load(i)

    def tokens(self, j: int) -> torch.Tensor:
        store, i = self._where[j]
        return store.tokens(i)

