"""The engine's CUDA-graph path (specdec/core/cuda_graphs.py). The bucket and capacity choice,
and the runner itself run uncaptured, are tested on the CPU; the same exactness tests run on a
GPU when there is one (captured graphs, cuBLAS), and are skipped without one."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.core.cuda_graphs import ROW_BUCKETS, GraphRunner, capacity_for, cuda_graphs_enabled, row_buckets, row_chunks
from specdec.core.engine import ForwardCall, LlamaEngine
from specdec.core.hub import load_model_weights_only
from specdec.core.tree import DraftTree, verification_inputs
from tests.tiny_models import build_model_dir


@pytest.mark.parametrize("count", [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100])
@pytest.mark.parametrize("buckets", [(16,), (1, 16, 64), (4, 32)])
def test_row_chunks_cover_the_rows_in_buckets(count, buckets):
    chunks = row_chunks(count, buckets)
    assert sum(rows for rows, _ in chunks) == count
    assert all(0 < rows <= bucket and bucket in buckets for rows, bucket in chunks)
    assert all(rows == bucket == buckets[-1] for rows, bucket in chunks[:-1])  # only the last pass is padded
    rest = chunks[-1][0]
    assert chunks[-1][1] == min(b for b in buckets if b >= rest)


def test_one_bucket_runs_every_pass_at_its_size():
    assert row_chunks(1, (16,)) == [(1, 16)]
    assert row_chunks(33, (16,)) == [(16, 16), (16, 16), (1, 16)]
    assert row_chunks(33, (1, 16, 64)) == [(33, 64)]


def test_capacity_doubles_from_the_smallest_buffer():
    assert [capacity_for(n) for n in (1, 256, 257, 512, 513, 5000)] == [256, 256, 512, 512, 1024, 8192]


def test_row_buckets_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPECDEC_CUDA_ROW_BUCKETS", raising=False)
    assert row_buckets() == ROW_BUCKETS
    monkeypatch.setenv("SPECDEC_CUDA_ROW_BUCKETS", "64, 16")
    assert row_buckets() == (16, 64)


@pytest.fixture(autouse=True)
def graphs_on(monkeypatch):
    """Whatever the environment running the tests says."""
    monkeypatch.delenv("SPECDEC_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("SPECDEC_CUDA_ROW_BUCKETS", raising=False)


def test_no_graphs_on_a_cpu(tmp_path):
    """The CPU paths are untouched: no runner, and batch invariance only from the native layers."""
    model = load_model_weights_only(str(build_model_dir(tmp_path, seed=3)), torch.bfloat16).eval()
    engine = LlamaEngine(model)
    assert engine.graphs is None
    assert engine.batch_invariant == (engine.native_layers is not None)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=gpu)])
def shaped_model(request):
    """Random weights. On the GPU two layers of SmolLM2-135M's shape in bf16 (cuBLAS picks its
    kernels by shape); on the CPU a narrower float32 model, where the same runner runs each pass
    uncaptured (the runner's logic checked without a GPU; cuBLAS's sums only with one)."""
    torch.manual_seed(0)
    return _model(request.param)


def _model(device: str) -> LlamaForCausalLM:
    width = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=4096)
    if device == "cpu":
        width = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    config = LlamaConfig(num_hidden_layers=2, max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.1, **width)
    # float32 on the CPU: its bf16 GEMMs are slow there, and the runner's logic is the same.
    return LlamaForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()


def _graphed(model) -> LlamaEngine:
    engine = LlamaEngine(model)
    if model.device.type == "cuda":
        assert engine.graphs is not None
    else:
        engine.graphs = GraphRunner(engine)
    return engine


def _steps(engine, cache, tokens: list[int]) -> torch.Tensor:
    return torch.cat([engine(cache, [t])[0] for t in tokens])


def _tree_steps(engine, cache, tree: DraftTree) -> dict[int, torch.Tensor]:
    """Each node's logits from one-token steps along its path (depth first: one step a node)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parent):
        children.setdefault(parent, []).append(node)
    found, length = {}, cache.length

    def visit(node: int, at: int) -> None:
        cache.truncate(at)
        found[node] = engine(cache, [tree.token_ids[node]])[0][-1]
        for child in children.get(node, []):
            visit(child, at + 1)

    for root in children.get(-1, []):
        visit(root, length)
    assert len(found) == len(tree)
    return found


@pytest.mark.parametrize("start", [40, 250])  # 250: passes cross from the 256-position buffer into the 512 one
def test_k_token_passes_equal_one_token_steps(shaped_model, start):
    engine = _graphed(shaped_model)
    vocab = shaped_model.config.vocab_size
    rng = random.Random(start)
    tokens = [rng.randrange(vocab) for _ in range(start + 33)]
    with torch.inference_mode():
        cache = engine.new_cache()
        engine(cache, tokens[:start], prefill=True)
        steps = _steps(engine, cache, tokens[start:])
        for k in range(1, 34):
            cache.truncate(start)
            logits, _ = engine(cache, tokens[start : start + k], num_logits=k)
            assert torch.equal(logits, steps[:k]), f"k={k}: max diff {(logits - steps[:k]).abs().max()}"


def test_tree_pass_equals_one_token_steps_along_each_path(shaped_model):
    engine = _graphed(shaped_model)
    vocab = shaped_model.config.vocab_size
    rng = random.Random(7)
    context = [rng.randrange(vocab) for _ in range(60)]
    parents = [-1] + [rng.randrange(-1, n) for n in range(1, 32)]
    tree = DraftTree([rng.randrange(vocab) for _ in parents], parents)
    with torch.inference_mode():
        cache = engine.new_cache()
        engine(cache, context[:-2], prefill=True)
        positions, mask = verification_inputs(tree, len(context) - 2, 2)
        logits, _ = engine(cache, context[-2:] + tree.token_ids, len(tree) + 1, position_ids=positions, attention_mask=mask)
        cache.truncate(len(context) - 2)
        _steps(engine, cache, context[-2:])
        for node, step_logits in _tree_steps(engine, cache, tree).items():
            assert torch.equal(step_logits, logits[node + 1]), f"node {node}"


def test_rows_do_not_depend_on_the_pass_or_other_sessions(shaped_model):
    """What `batch_invariant` would promise (the verifier's prefix cache relies on it): a
    prompt fed in one call or in parts gives the same keys, values, logits and hidden states,
    and sessions run in one forward_many get what each gets alone."""
    engine = _graphed(shaped_model)
    vocab = shaped_model.config.vocab_size
    rng = random.Random(3)
    prompt = [rng.randrange(vocab) for _ in range(90)]
    with torch.inference_mode():
        whole = engine.new_cache()
        logits, states = engine(whole, prompt, num_logits=5, hidden_states=(0, 1, 2))
        parts = engine.new_cache()
        for a, b in [(0, 16), (16, 21), (21, 85)]:
            engine(parts, prompt[a:b])
        part_logits, part_states = engine(parts, prompt[85:], num_logits=5, hidden_states=(0, 1, 2))
        assert torch.equal(logits, part_logits)
        assert all(torch.equal(s[:, 85:], p) for s, p in zip(states, part_states))
        assert torch.equal(whole.keys[:, :, :90], parts.keys[:, :, :90])
        assert torch.equal(whole.values[:, :, :90], parts.values[:, :, :90])

        contexts = [prompt[:30], prompt[30:37], prompt[:64]]
        caches = [engine.new_cache() for _ in contexts]
        together = engine.forward_many([ForwardCall(c, ctx, 3) for c, ctx in zip(caches, contexts)])
        for ctx, (got, _) in zip(contexts, together):
            alone, _ = engine(engine.new_cache(), ctx, 3)
            assert torch.equal(got, alone)


@gpu
def test_cuda_graphs_compute_what_the_eager_engine_computes():
    """The same model either way, up to bf16 rounding: logits and hidden states close."""
    torch.manual_seed(0)
    model = _model("cuda")
    graphed, eager = LlamaEngine(model), LlamaEngine(model, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    prompt = [random.Random(1).randrange(4096) for _ in range(50)]
    with torch.inference_mode():
        a, b = graphed.new_cache(), eager.new_cache()
        graphed(a, prompt[:40], prefill=True)
        eager(b, prompt[:40], prefill=True)
        got, got_states = graphed(a, prompt[40:], num_logits=10, hidden_states=True)
        expected, expected_states = eager(b, prompt[40:], num_logits=10, hidden_states=True)
    assert torch.allclose(got, expected, atol=0.1, rtol=0.05)
    assert len(got_states) == len(expected_states) == 3
    assert all(torch.allclose(g.float(), e.float(), atol=0.1, rtol=0.05) for g, e in zip(got_states, expected_states))


def test_graphs_are_on_unless_the_environment_turns_them_off(monkeypatch):
    assert cuda_graphs_enabled()
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "0")
    assert not cuda_graphs_enabled()
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "1")
    assert cuda_graphs_enabled()


def test_the_runner_without_capture_on_a_cpu(tmp_path):
    """The runner's padding, chunking, masks and cache copies, run eagerly on a CPU (a replay
    there is the captured pass run again): a tree pass over two buffers in two chunks equals
    one-token steps bit for bit, and it matches the eager torch path up to bf16 rounding."""
    model = load_model_weights_only(str(build_model_dir(tmp_path, seed=3)), torch.bfloat16).eval()
    engine, eager = LlamaEngine(model), LlamaEngine(model)
    engine.graphs = GraphRunner(engine, (4, 8))
    rng = random.Random(5)
    vocab = model.config.vocab_size
    context = [rng.randrange(vocab) for _ in range(248)]
    parents = [-1, 0, 0, 1, -1, 4, 2, 6, 7, 3]
    tree = DraftTree([rng.randrange(vocab) for _ in parents], parents)
    with torch.inference_mode():
        cache = engine.new_cache()
        assert cache.values.dtype == torch.bfloat16
        engine(cache, context[:246], prefill=True)
        positions, mask = verification_inputs(tree, 246, 2)
        logits, states = engine(cache, context[246:] + tree.token_ids, len(tree) + 1, position_ids=positions, attention_mask=mask,
                                hidden_states=True)
        assert sorted(engine.graphs.graphs) == [(4, 512), (8, 256)]  # 12 rows: 8 in the 256 buffer, 4 in the 512 one
        assert len(states) == 3 and states[0].shape == (1, 12, model.config.hidden_size)
        cache.truncate(246)
        _steps(engine, cache, context[246:])
        for node, step_logits in _tree_steps(engine, cache, tree).items():
            assert torch.equal(step_logits, logits[node + 1]), f"node {node}"
        reference = eager.new_cache()
        eager(reference, context[:246], prefill=True)
        expected, _ = eager(reference, context[246:] + tree.token_ids, len(tree) + 1, position_ids=positions, attention_mask=mask)
    assert torch.allclose(logits, expected, atol=0.05, rtol=0.02)
