"""`hspec bench draft`: the cost of one draft forward T_D(K) against the target's verify T_T.

The latency model (paper §2) puts T_D(K) / T_T next to the mean accepted length: a drafter is only
worth its acceptance if its forward is cheap next to the (K+1)-token verify it saves. For each
batch size B and context length S:

1. a KV pool holds B sequences of S positions (random K/V: timings do not depend on values), and
   each drafter has committed a random hidden state for them;
2. per round, interleaved: the target's verify (a K+1 = 8-token forward over the pool, asking for
   the 5 selected layers' hidden states), then `propose(batch, K)` of every kind (T_D), then the
   verify again; T_T is the mean of the two verifies around the drafters, so slow drift hits both
   sides alike;
3. then, per round, a verify and the `commit` of K+1 newly verified positions to every kind (the
   per-step context update: one hidden vector for H-Spec, the drafter-side K/V write for
   DFlash-style kinds); these rounds grow the context by K+1 each, so they come last;
4. ratios T_D / T_T and T_commit / T_T per round, reported as min / median / max.

Drafters have random weights: cost does not depend on training. A kind with a native greedy proposal
(H-Spec on a CPU: drafters/hspec/native.py) gets a second row, the same kind without it (in Python, or
with --compile-drafter through its compiled forwards), timed in the same rounds. Results go to
results/draft_cost_<device>.{json,md}.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hspec.cache.paged_pool import pages_for
from hspec.drafters import DRAFTERS, create_drafter, drafter_config
from hspec.drafters.base import DraftBatch, Drafter
from hspec.drafters.common import select_target_layers
from hspec.drafters.compile import CompiledForward
from hspec.models.llama import TargetModel
from hspec.models.loading import Target, load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.runtime import drafter_precision_of, for_inference
from hspec.sampling import SamplingBatch, SamplingParams

GOAL = "hspec T_D(7) / T_T <= 0.15 at B = 1 (issue 17)"
# The suffix of a compiled kind's second row, whose greedy proposal skips the ahead-of-time library.
TORCH_COMPILE_ONLY = "(torch.compile only)"
# The suffix of the row of a kind with a native greedy proposal (drafters/hspec/native.py) that proposes without
# it: eagerly in Python, or with --compile-drafter through the compiled forwards.
WITHOUT_NATIVE = "(without the native call)"


class _Setting:
    """One (B, S) setting: a pool of B sequences of S positions and a draft batch over them.

    Every drafter has committed all S positions (DFlash-style kinds hold their drafter K/V for
    them), as after a prefill. `commit_round` then appends K+1 positions and commits them to every
    drafter, as a fully accepted step would; it runs after the propose rounds so the context those
    rounds see stays S.
    """

    def __init__(self, model: TargetModel, drafters: dict[str, Drafter], B: int, S: int, K: int, repeats: int,
                 seed: int) -> None:
        self.model, self.drafters, self.B, self.length, self.K = model, drafters, B, S, K
        g = torch.Generator().manual_seed(seed)
        c = model.config
        page = 16
        drafter_layers = max((d.num_drafter_layers for d in drafters.values()), default=0)
        per_seq = S + (repeats + 3) * (K + 1)  # context + commit rounds + one verify block
        self.pool = model.new_pool(B * pages_for(per_seq, page), page, drafter_layers)
        self.seq_ids = list(range(B))
        for s in self.seq_ids:
            self.pool.add_sequence(s)
        self.pool.extend(self.seq_ids, S)
        self.pool.k.normal_(generator=g)
        self.pool.v.normal_(generator=g)
        self.target_layers = select_target_layers(c.num_layers)
        histories = [torch.randint(0, c.vocab_size, (S + 1,), generator=g).tolist() for _ in self.seq_ids]
        self.batch = DraftBatch(self.seq_ids, torch.tensor([h[-1] for h in histories]), histories, self.pool,
                                SamplingBatch.from_params([SamplingParams()] * B),
                                [torch.Generator().manual_seed(seed + s) for s in self.seq_ids])
        self.verify_ids = torch.randint(0, c.vocab_size, (B, K + 1), generator=g)
        for drafter in drafters.values():
            self._commit(drafter, S)  # the "prefill": every context position is verified

    def time_verify(self) -> tuple[float, float]:
        """Seconds of one (K+1)-token target forward over every sequence (then rolled back), wall-clock and this
        process's CPU time (as `time_propose`)."""
        start, cpu = time.perf_counter(), time.process_time()
        self.model(self.verify_ids, self.pool, self.seq_ids, self.target_layers)
        elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu
        for s in self.seq_ids:
            self.pool.truncate(s, self.length)
        return elapsed, cpu_elapsed

    def time_propose(self, kind: str) -> tuple[float, float]:
        """Seconds of one `propose`, wall-clock and this process's CPU time (all its threads: with one torch
        thread, what the call cost its core however many other processes shared the CPU)."""
        start, cpu = time.perf_counter(), time.process_time()
        self.drafters[kind].propose(self.batch, self.K)
        return time.perf_counter() - start, time.process_time() - cpu

    def commit_round(self) -> dict[str, float]:
        """Append K+1 verified positions; seconds each drafter takes to commit them."""
        n = self.K + 1
        self.pool.extend(self.seq_ids, n)
        self.length += n
        return {kind: self._commit(drafter, n) for kind, drafter in self.drafters.items()}

    def close(self) -> None:
        """Make every drafter forget these sequences (the next setting reuses their ids)."""
        for drafter in self.drafters.values():
            for s in self.seq_ids:
                drafter.release(s)

    def _commit(self, drafter: Drafter, n: int) -> float:
        """Commit the last n pool positions of every sequence to `drafter`; returns seconds."""
        hidden = None
        if drafter.target_layers:
            hidden = torch.empty(self.B, n, len(drafter.target_layers), self.model.config.hidden_size,
                                 dtype=self.model.embed_tokens.weight.dtype).normal_()
        start = time.perf_counter()
        drafter.commit(self.pool, self.seq_ids, hidden, torch.full((self.B,), n, dtype=torch.long))
        return time.perf_counter() - start


def run_draft_bench(target_name: str, kinds: Sequence[str] | None, out_dir: str | Path, repeats: int = 5,
                    batch_sizes: Sequence[int] = (1, 16), contexts: Sequence[int] = (256, 2048), K: int = 7,
                    seed: int = 0, draft_vocab_size: int | None = None, dtype: str = "auto",
                    target: Target | None = None, compile_drafters: bool = False, drafter_precision: str = "auto"
                    ) -> int:
    """Time every kind's draft forward against the target's verify; write draft_cost_<device>.{json,md}.

    `draft_vocab_size` sets Vp of every trained kind (default: each kind's own, the paper's 32,000);
    the files then end in `_vp<Vp>`. `dtype` is the target's and drafters' (`--dtype`; the files of a
    bfloat16 run end in `_bfloat16`). `target`: the target `target_name` names, already loaded (its own
    dtype is then the one timed); None loads it. `compile_drafters`: trained kinds' block forward through
    torch.compile (compiled in the untimed warm-up; the files then end in `_compiled`).
    `drafter_precision`: how trained kinds store their linear weights (`hspec.runtime.for_inference`;
    the files of a run with another choice than auto end in `_drafter_<int8|floating>`).
    """
    if target is None:
        target = load_target(target_name, dtype=dtype)
    model = target.model.eval()
    kinds = [k for k in (kinds or DRAFTERS.names()) if DRAFTERS.get(k).drafts]
    torch.manual_seed(seed)
    drafters = {k: _create(k, target.config, model, draft_vocab_size) for k in kinds}
    for kind, drafter in drafters.items():
        if isinstance(drafter, torch.nn.Module):  # as `hspec generate` runs it
            drafters[kind] = for_inference(drafter, target, compile_drafters, drafter_precision)
    native_kinds = [k for k, d in drafters.items() if getattr(d, "native_greedy", None) is not None]
    compiled_kinds = [k for k, d in drafters.items() if isinstance(getattr(d, "draft_greedy", None), CompiledForward)]
    for kind in native_kinds:  # the same kind proposing as it would without its native call, timed alongside
        twin = for_inference(_create(kind, target.config, model, draft_vocab_size), target, compile_drafters,
                             drafter_precision)
        twin.native_greedy = None
        drafters[f"{kind} {WITHOUT_NATIVE}"] = twin
    if compile_drafters:  # the same kinds with their greedy proposal through torch.compile, timed alongside
        for kind in compiled_kinds:
            twin = for_inference(_create(kind, target.config, model, draft_vocab_size), target, True, drafter_precision)
            twin.draft_greedy.ahead_of_time = twin.block_logits.ahead_of_time = None
            twin.native_greedy = None
            drafters[f"{kind} {TORCH_COMPILE_ONLY}"] = twin
    device = "gpu" if model.embed_tokens.weight.is_cuda else "cpu"
    rows = []
    with torch.inference_mode():
        for B in batch_sizes:
            for S in contexts:
                rows.append(_measure(model, drafters, B, S, K, repeats, seed))
                print(_format_row_summary(rows[-1]), flush=True)
    settings = {"target": target.name, "dtype": model.dtype_name,
                "K": K, "batch_sizes": list(batch_sizes), "contexts": list(contexts), "repeats": repeats,
                "kinds": kinds, "sampling": "greedy", "drafter_weights": "random",
                "draft_vocab_size": draft_vocab_size or "each kind's default", "compile_drafters": compile_drafters,
                "drafter_precision": drafter_precision_of(drafter_precision, target)}
    command = (f"hspec bench draft --target {target_name} --drafters {','.join(kinds)} --repeats {repeats} "
               f"--batch-sizes {','.join(map(str, batch_sizes))} --contexts {','.join(map(str, contexts))}")
    if draft_vocab_size is not None:
        command += f" --draft-vocab {draft_vocab_size}"
    command += f" --dtype {dtype}" + (" --compile-drafter" if compile_drafters else "")
    command += f" --drafter-precision {drafter_precision}" if drafter_precision != "auto" else ""
    payload = {"provenance": provenance(command, settings), "goal": GOAL,
               "params": {k: _num_params(d) for k, d in drafters.items()}, "results": rows}
    markdown = _markdown(payload)
    name = f"draft_cost_{device}" + (f"_vp{draft_vocab_size}" if draft_vocab_size else "")
    name += "" if settings["dtype"] == "float32" else f"_{settings['dtype']}"
    name += "_compiled" if compile_drafters else ""
    name += "" if drafter_precision == "auto" else f"_drafter_{drafter_precision}"
    json_path, md_path = write_results(Path(out_dir), name, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _measure(model: TargetModel, drafters: dict[str, Drafter], B: int, S: int, K: int, repeats: int,
             seed: int) -> dict:
    setting = _Setting(model, drafters, B, S, K, repeats, seed)
    setting.time_verify()  # warm-up
    for kind in drafters:
        setting.time_propose(kind)
    verify_s: list[float] = []
    verify_cpu_s: list[float] = []
    propose_s: dict[str, list[float]] = {k: [] for k in drafters}
    propose_cpu_s: dict[str, list[float]] = {k: [] for k in drafters}
    ratios: dict[str, list[float]] = {k: [] for k in drafters}
    cpu_ratios: dict[str, list[float]] = {k: [] for k in drafters}
    for _ in range(repeats):
        before, before_cpu = setting.time_verify()
        times = {k: setting.time_propose(k) for k in drafters}
        after, after_cpu = setting.time_verify()
        t_t, t_t_cpu = (before + after) / 2, (before_cpu + after_cpu) / 2
        verify_s.append(t_t)
        verify_cpu_s.append(t_t_cpu)
        for kind, (t_d, cpu) in times.items():
            propose_s[kind].append(t_d)
            propose_cpu_s[kind].append(cpu)
            ratios[kind].append(t_d / t_t)
            cpu_ratios[kind].append(cpu / t_t_cpu)
    # Commits append positions, so they run last; each round is set against that round's verify.
    setting.commit_round()  # warm-up
    commit_s: dict[str, list[float]] = {k: [] for k in drafters}
    commit_ratios: dict[str, list[float]] = {k: [] for k in drafters}
    for _ in range(repeats):
        t_t = setting.time_verify()[0]
        for kind, t_c in setting.commit_round().items():
            commit_s[kind].append(t_c)
            commit_ratios[kind].append(t_c / t_t)
    setting.close()
    return {
        "B": B, "S": S,
        "verify_ms": _summary([1000 * t for t in verify_s]),
        "verify_cpu_ms": _summary([1000 * t for t in verify_cpu_s]),
        "kinds": {k: {"propose_ms": _summary([1000 * t for t in propose_s[k]]),
                      "propose_cpu_ms": _summary([1000 * t for t in propose_cpu_s[k]]),
                      "commit_ms": _summary([1000 * t for t in commit_s[k]]),
                      "T_D_over_T_T": _summary(ratios[k]),
                      "T_D_over_T_T_cpu": _summary(cpu_ratios[k]),
                      "commit_over_T_T": _summary(commit_ratios[k])} for k in drafters},
    }


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _create(kind: str, target_config, model: TargetModel, draft_vocab_size: int | None) -> Drafter:
    """A kind with random weights; trained kinds get Vp = `draft_vocab_size` when it is given.

    A Markov head's W2 starts at zero (an untrained head changes nothing); here it is drawn like W1, as a
    trained head's is nonzero: an all-zero matrix stored as int4 groups gets steps of the smallest normal
    float, whose products with a row's steps are subnormal and took the w4a8 kernel ~7x its time."""
    if draft_vocab_size is None or DRAFTERS.get(kind).config_class is None:
        drafter = create_drafter(kind, target_config, target_model=model)
    else:
        config = drafter_config(kind, target_config, draft_vocab_size=draft_vocab_size)
        drafter = create_drafter(kind, target_config, target_model=model, config=config)
    markov = getattr(drafter, "markov", None)
    if markov is not None:
        with torch.no_grad():
            markov.W2.normal_(std=markov.W2.shape[0] ** -0.5)
    return drafter


def _num_params(drafter: Drafter) -> int:
    return sum(p.numel() for p in drafter.parameters()) if isinstance(drafter, torch.nn.Module) else 0


def _format_row_summary(row: dict) -> str:
    parts = [f"{k} {v['T_D_over_T_T']['median']:.3f}" for k, v in row["kinds"].items()]
    return f"[draft] B={row['B']} S={row['S']} T_T {row['verify_ms']['median']:.1f} ms; T_D/T_T: " + ", ".join(parts)


def _markdown(payload: dict) -> str:
    lines = ["# Draft cost: T_D(K) / T_T\n", provenance_markdown(payload["provenance"]),
             f"\nGoal: {payload['goal']}. T_T is one K+1 = 8-token target verify; T_D one `propose(K=7)`; "
             "commit is the per-step context update after verifying K+1 tokens (H-Spec: keep one hidden "
             "vector; DFlash-style kinds: write drafter K/V). Ratios per interleaved round, min / median / max. "
             "T_D CPU time: the process's CPU time during the call, all threads (with one torch thread, what the "
             "call cost its core on a CPU shared with other processes); T_D / T_T by CPU time: the same ratio of "
             "the two calls' CPU times, which waiting behind other processes leaves out.\n"]
    if any(WITHOUT_NATIVE in kind for row in payload["results"] for kind in row["kinds"]):
        lines.append(f"A kind with a native greedy proposal (drafters/hspec/native.py) runs a one-sequence greedy "
                     f"proposal as one native call; its row \"{WITHOUT_NATIVE}\", a second drafter of the kind "
                     "timed in the same rounds, proposes without it (in Python, or with --compile-drafter through "
                     "the compiled forwards).\n")
    if any(TORCH_COMPILE_ONLY in kind for row in payload["results"] for kind in row["kinds"]):
        lines.append(f"A compiled kind runs a one-sequence greedy proposal through its AOTInductor library "
                     f"(docs/fast-path.md#ahead-of-time-drafter); its row \"{TORCH_COMPILE_ONLY}\", a second "
                     "drafter of the kind timed in the same rounds, through torch.compile as before (batches take "
                     "that path in both).\n")
    for row in payload["results"]:
        v, v_cpu = row["verify_ms"], row["verify_cpu_ms"]
        lines += [f"\n## B = {row['B']}, context S = {row['S']} (T_T median {v['median']:.1f} ms, "
                  f"min {v['min']:.1f}, max {v['max']:.1f}; CPU time median {v_cpu['median']:.1f} ms)\n",
                  "| kind | trainable params | T_D median (ms) | T_D min (ms) | T_D CPU time median (ms) | "
                  "T_D / T_T min | median | max | T_D / T_T by CPU time, median | commit / T_T median |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for kind, m in row["kinds"].items():
            r = m["T_D_over_T_T"]
            lines.append(f"| {kind} | {payload['params'][kind] / 1e6:.1f}M | {m['propose_ms']['median']:.2f} | "
                         f"{m['propose_ms']['min']:.2f} | {m['propose_cpu_ms']['median']:.2f} | "
                         f"{r['min']:.3f} | {r['median']:.3f} | {r['max']:.3f} | "
                         f"{m['T_D_over_T_T_cpu']['median']:.3f} | {m['commit_over_T_T']['median']:.3f} |")
    return "\n".join(lines) + "\n"
