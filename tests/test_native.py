"""The native decoder stack (`models.native`, `decoder_stack.cpp`) gives the Python layers' bits.

Every test compares a target built with the stack against the same checkpoint built without it: logits,
requested hidden states and the pool's K/V after each forward must be equal in every bit, for decodes and
verifies, in bf16, int8 and int4, across the families the stack fits. The losslessness suites run over
the stack too, since `build_model` attaches it to every row-invariant target.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hspec.cache.paged_pool import pages_for
from hspec.models import native as native_module
from hspec.models.loading import read_config
from hspec.models.native import NativeDecoderStack


class _Counting:
    """Stands in for the compiled extension and counts the calls that reach it."""

    def __init__(self, extension) -> None:
        self.extension, self.calls = extension, 0

    def decoder_stack(self, *args):
        self.calls += 1
        return self.extension.decoder_stack(*args)


def _prefilled(model, prompt: list[int], extra: int):
    pool = model.new_pool(num_pages=pages_for(len(prompt) + extra, 16))
    pool.add_sequence(0)
    model.prefill(torch.tensor([prompt]), pool, [0], last_logits_only=True)
    return pool


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "smollm2-like"])
def test_the_native_stack_gives_the_python_layers_bits(tiny_dirs, family, dtype):
    from conftest import load_tiny

    fast = load_tiny(tiny_dirs[family], dtype=dtype).model
    slow = load_tiny(tiny_dirs[family], dtype=dtype, native=False).model
    assert fast.native is not None and slow.native is None
    counter = _Counting(fast.native.extension)
    fast.native.extension = counter
    vocab = fast.config.vocab_size
    prompt = [3 + (7 * i) % (vocab - 3) for i in range(280)]  # the fp32 value chunks (256 keys) while decoding
    pools = [_prefilled(model, prompt, 80) for model in (fast, slow)]
    generator = torch.Generator().manual_seed(0)
    group = fast.config.num_heads // fast.config.num_kv_heads
    # the last rows one product takes, and one beyond (the stack covers it only with hspec's attention)
    widths = (1, 4, 1, 8, 32 // group, 32 // group + 1, 1, 3)
    with torch.inference_mode():
        for width in widths:
            ids = torch.randint(3, vocab, (1, width), generator=generator)
            a = fast(ids, pools[0], [0], hidden_layers=(0, 2, fast.config.num_layers))
            b = slow(ids, pools[1], [0], hidden_layers=(0, 2, slow.config.num_layers))
            assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
            assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
    assert counter.calls == len(widths) - (not fast.native.kernels)


def test_batches_of_ragged_sequences_on_scattered_pages_keep_the_python_layers_bits(tiny_dirs):
    """Two sequences of different lengths whose pages interleave in the pool (a gather, as in the server),
    then one of them alone on its scattered pages, decoding and verifying side by side."""
    from conftest import load_tiny

    fast = load_tiny(tiny_dirs["llama"], dtype="int4").model
    slow = load_tiny(tiny_dirs["llama"], dtype="int4", native=False).model
    counter = _Counting(fast.native.extension)
    fast.native.extension = counter
    vocab = fast.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    pools = [model.new_pool(num_pages=64, page_size=8) for model in (fast, slow)]
    with torch.inference_mode():
        for model, pool in zip((fast, slow), pools, strict=True):
            for seq in (0, 1):
                pool.add_sequence(seq)
            for chunk in range(6):  # 6 x 8 tokens each, alternating: the two sequences' pages interleave
                for seq in (0, 1):
                    ids = torch.tensor([[3 + (5 * chunk + 11 * seq + i) % (vocab - 3) for i in range(8)]])
                    model.prefill(ids, pool, [seq])
            model.prefill(torch.tensor([[5, 6, 7]]), pool, [1])  # ragged: 48 and 51 tokens
        assert pools[0].slot_table([0]).contiguous_start is None  # sequence 0 alone is a gather too
        for seq_ids, width in (([0, 1], 1), ([0, 1], 4), ([1, 0], 1), ([0], 1), ([0], 5), ([1], 2)):
            ids = torch.randint(3, vocab, (len(seq_ids), width), generator=generator)
            a = fast(ids, pools[0], seq_ids, hidden_layers=(1, 3))
            b = slow(ids, pools[1], seq_ids, hidden_layers=(1, 3))
            assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
            assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
    assert counter.calls == 6


@pytest.mark.parametrize("kernels", [True, False])
def test_what_the_stack_leaves_to_the_python_layers(tiny_dirs, kernels):
    """Prefills, float32, trees whose nodes read their own key copies, and without hspec's attention kernel
    verifies wider than one product."""
    from conftest import load_tiny

    model = load_tiny(tiny_dirs["llama"], dtype="bfloat16", kernels=kernels).model
    stack = model.native
    if kernels and not stack.kernels:
        pytest.skip("hspec's CPU kernels do not run here")
    x = torch.zeros(1, 2, model.config.hidden_size, dtype=torch.bfloat16)
    group = model.config.num_heads // model.config.num_kv_heads
    assert not stack.covers(x, node_tables=False)  # autograd on
    with torch.inference_mode():
        assert stack.covers(x, node_tables=False)
        assert stack.covers(x.expand(3, -1, -1), node_tables=False)  # a batch
        assert not stack.covers(x.float(), node_tables=False)
        assert not stack.covers(x, node_tables=True)
        # hspec's attention computes each query row alone, a tree's under its mask; torch's products take
        # at most 32 rows, and a tree's nodes then read their own copies of their keys
        wide = torch.zeros(1, 32 // group + 1, model.config.hidden_size, dtype=torch.bfloat16)
        assert stack.covers(wide, node_tables=False) == kernels
        assert model.tree_shares_keys == kernels
    assert load_tiny(tiny_dirs["llama"]).model.native is None  # float32 takes the fused kernels
    assert load_tiny(tiny_dirs["qwen3"], dtype="bfloat16").model.native is None  # per-head q/k norm


def test_a_deep_copy_binds_the_copys_weights(tiny_dirs):
    from conftest import load_tiny

    model = load_tiny(tiny_dirs["llama"], dtype="int8").model
    copied = copy.deepcopy(model)
    assert copied.native.weights[0] is copied.layers[0].input_layernorm.weight
    assert copied.native.weights[0] is not model.layers[0].input_layernorm.weight
    assert copied.native.extension is model.native.extension


# A child process: with the decoder stack's source broken (argv[1]) and built in a folder of its own (argv[3]),
# building it warns and returns None, and a bf16 target (argv[2]) loads with the Python layers, which decode. A
# child, because torch's loader remembers each extension's source within a process: a broken one built here
# would make the next load of the real stack in this process build it again under a new version (~30 s), and
# every later process once more. The CPU kernels load first from the usual folder (built there already).
_BROKEN_CHILD = """
import os, sys, warnings
from pathlib import Path
import torch
from conftest import load_tiny
from hspec.cache.paged_pool import pages_for
from hspec.models import native
native.load_kernels()
native._SOURCE = Path(sys.argv[1])
os.environ["TORCH_EXTENSIONS_DIR"] = sys.argv[3]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert native.build_extension() is None
    model = load_tiny(Path(sys.argv[2]), dtype="bfloat16").model
messages = [str(w.message) for w in caught]
assert any("native decoder stack could not be built" in m for m in messages), messages
assert any("Python layers run instead" in m for m in messages), messages
assert model.native is None
pool = model.new_pool(num_pages=pages_for(5, 16))
pool.add_sequence(0)
with torch.inference_mode():
    model.prefill(torch.tensor([[3, 4, 5, 6]]), pool, [0], last_logits_only=True)
    print(tuple(model(torch.tensor([[7]]), pool, [0]).logits.shape))
"""


def test_a_stack_that_cannot_be_built_warns_and_the_python_layers_run(tiny_dirs, tmp_path):
    broken = tmp_path / "decoder_stack.cpp"
    broken.write_text("this is not C++\n")
    src = Path(native_module.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(Path(__file__).parent)])}
    child = subprocess.run([sys.executable, "-c", _BROKEN_CHILD, str(broken), str(tiny_dirs["llama"]),
                            str(tmp_path / "extensions")], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    vocab = read_config(tiny_dirs["llama"]).vocab_size
    assert child.stdout.strip().splitlines()[-1] == str((1, 1, vocab))


def test_fits_names_what_the_stack_runs(tiny_dirs):
    from conftest import load_tiny

    model = load_tiny(tiny_dirs["mistral"], dtype="int4").model
    assert NativeDecoderStack.fits(model.layers)
    model.layers[0].mlp.gate_up_weight = None  # separate gate and up projections
    assert not NativeDecoderStack.fits(model.layers)


def test_the_build_finds_the_ninja_package_without_an_activated_environment(monkeypatch):
    """`.venv/bin/hspec` runs with the environment's bin folder off PATH, where pip put `ninja`."""
    import os

    import ninja

    monkeypatch.setenv("PATH", "/nonexistent")
    with native_module._ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep) == [ninja.BIN_DIR, "/nonexistent"]
    assert os.environ["PATH"] == "/nonexistent"


# A child process: loads the decoder stack from argv[1] (a broken source: it fails fast) with TORCH_EXTENSIONS_DIR set.
_BUILD_CHILD = """
import sys, warnings
from pathlib import Path
from hspec.models import native
native._SOURCE = Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print(native.build_extension())
for warning in caught:
    print(warning.message)
"""


def test_a_build_killed_midway_does_not_block_every_later_load(tmp_path):
    """A build killed midway leaves torch's baton (`<build dir>/lock`), on which torch's loader waits forever:
    the next load removes it, says so, and builds (here: fails to, fast, on a broken source)."""
    broken = tmp_path / "decoder_stack.cpp"
    broken.write_text("this is not C++\n")
    baton = tmp_path / "extensions" / "hspec_decoder_stack" / "lock"
    baton.parent.mkdir(parents=True)
    baton.touch()  # what `kill -9` during a build leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
           "PYTHONPATH": str(Path(native_module.__file__).resolve().parents[2])}  # src/
    child = subprocess.run([sys.executable, "-c", _BUILD_CHILD, str(broken)], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert f"removed {baton}, the build lock a build killed midway left behind" in child.stdout
    assert "the native decoder stack could not be built" in child.stdout  # torch went on past its baton


def test_a_load_waiting_too_long_on_another_build_runs_without_it_and_names_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    lock = tmp_path / "extensions" / "hspec_decoder_stack" / "hspec-build.lock"
    lock.parent.mkdir(parents=True)
    hold = "import sys, time, filelock\nwith filelock.FileLock(sys.argv[1]):\n    print('held', flush=True)\n" \
           "    time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # another process is building (or hung building)
        with pytest.warns(UserWarning, match=rf"another process has held {lock} for over 1 s .*Python layers run"):
            assert native_module._build("hspec_decoder_stack", native_module._SOURCE, ["-O2"],
                                        "the native decoder stack could not be built",
                                        "the Python layers run instead", lock_timeout_s=1) is None
    finally:
        holder.kill()
        holder.wait()
