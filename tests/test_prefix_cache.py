"""Prefix caching: a session whose prompt starts like an earlier one copies the cached rows and
gets exactly what a full read of its prompt gives, tokens, cache and features alike."""
from __future__ import annotations

import torch

from specdec.core.kv_cache import KVCache
from specdec.core.models import ModelSpec
from specdec.core.prefix_cache import BLOCK_TOKENS, PrefixCache
from specdec.core.sampling import Sampling
from specdec.core.tree import DraftTree
from specdec.serving.wire import model_info
from tests.test_feature_head import head_dir  # noqa: F401 - the fixture
from verifier_service.verifier import Verifier

SHARED = [(7 * i + 3) % 15 + 1 for i in range(2 * BLOCK_TOKENS + 5)]  # two full blocks and some
PROMPTS = [SHARED + [4, 9, 2], SHARED + [8], SHARED[: BLOCK_TOKENS + 3] + [11, 12, 13], [5, 6] + SHARED]


def filled_cache(length: int, seed: int) -> KVCache:
    cache = KVCache(2, 1, 4, torch.float32, "cpu", capacity=8, transposed_keys=True)
    cache.reserve(length)
    generator = torch.Generator().manual_seed(seed)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    cache.length = length
    return cache


def test_blocks_match_the_longest_cached_prefix_and_copy_rows_exactly():
    tokens = list(range(1, 2 * BLOCK_TOKENS + 4))
    source = filled_cache(len(tokens), seed=0)
    states = (torch.randn(len(tokens), 3),)
    prefix = PrefixCache(2**20, depths=(1,))
    prefix.store(tokens, source, states)
    assert len(prefix.match(tokens)) == 2  # full blocks only
    assert len(prefix.match(tokens[:BLOCK_TOKENS] + [99] * BLOCK_TOKENS)) == 1
    assert prefix.match([99] + tokens) == []
    target = KVCache(2, 1, 4, torch.float32, "cpu", capacity=8, transposed_keys=True)
    (loaded,) = prefix.load(prefix.match(tokens), target)
    end = 2 * BLOCK_TOKENS
    assert target.length == end
    assert torch.equal(target.rows(0, end)[0], source.rows(0, end)[0]) and torch.equal(target.values[:, :, :end], source.values[:, :, :end])
    assert torch.equal(loaded, states[0][:end])


def test_the_least_recently_used_blocks_go_past_the_memory_bound():
    block_bytes = 2 * 2 * 1 * 4 * BLOCK_TOKENS * 4  # keys and values, 2 layers, 1 head, dim 4, float32
    prefix = PrefixCache(3 * block_bytes)
    first, second = list(range(1, 2 * BLOCK_TOKENS + 1)), list(range(100, 100 + 2 * BLOCK_TOKENS))
    prefix.store(first, filled_cache(len(first), 1), ())
    prefix.store(second, filled_cache(len(second), 2), ())
    # Four blocks do not fit in three: the first prompt's first block went, and its child with it.
    assert prefix.match(first) == [] and len(prefix.match(second)) == 2


def rounds(engine: Verifier, tag: str, keep_state: bool) -> list:
    """Each prompt: a fused round with features (which reads the prompt), then a tree."""
    results = []
    for i, prompt in enumerate(PROMPTS):
        session = engine.open_session(f"{tag}{i}", prompt, Sampling(), keep_verifier_state=keep_state)
        fused = engine.verify(session, 1, DraftTree([], []), 3, verifier_state=keep_state)
        tree = engine.verify(session, 2, DraftTree([4, 6, 8], [-1, -1, 0]), 0, verifier_state=keep_state)
        cache = session.cache
        results.append((fused, tree, *cache.rows(0, cache.length)))
    return results


def assert_same_rounds(cached: list, fresh: list) -> None:
    for (fused, tree, keys, values), (fused0, tree0, keys0, values0) in zip(cached, fresh):
        assert fused.token_ids == fused0.token_ids and tree.token_ids == tree0.token_ids
        assert tree.num_accepted == tree0.num_accepted
        assert torch.equal(keys, keys0) and torch.equal(values, values0)
        for result, expected in ((fused, fused0), (tree, tree0)):
            assert result.verifier_state == expected.verifier_state


def test_sessions_reading_a_cached_prefix_get_what_a_full_read_gives(tiny_dirs, head_dir):  # noqa: F811
    spec = ModelSpec(str(tiny_dirs["verifier"]), dtype="int8")
    fresh_engine = Verifier(spec, feature_checkpoint=str(head_dir))
    cached_engine = Verifier(spec, feature_checkpoint=str(head_dir), prefix_cache_mib=16)
    assert fresh_engine.prefix is None and cached_engine.prefix is not None
    for keep_state in (False, True):  # the first pass fills the cache, the second reads it with features
        assert_same_rounds(
            rounds(cached_engine, f"c{keep_state}", keep_state), rounds(fresh_engine, f"f{keep_state}", keep_state)
        )
    prefix = cached_engine.prefix
    # First pass: prompts 1 and 2 find 2 and 1 of prompt 0's blocks; the second pass finds them
    # all (prompt 3 starts elsewhere, so only its own blocks, then).
    block = BLOCK_TOKENS
    assert prefix.hit_tokens == (2 * block + block) + (2 * block + 2 * block + block + 2 * block)
    assert prefix.hit_tokens + prefix.read_tokens == 2 * sum(len(p) - 1 for p in PROMPTS)
    info = model_info(cached_engine, cached_engine.sessions, "tiny")  # what the replicas export to Prometheus
    assert (info.prefix_hit_tokens, info.prefix_read_tokens) == (prefix.hit_tokens, prefix.read_tokens)


def test_no_prefix_cache_where_rows_depend_on_the_pass(tiny_dirs):
    engine = Verifier(ModelSpec(str(tiny_dirs["verifier"]), dtype="float32"), prefix_cache_mib=16)
    assert not engine.engine.batch_invariant and engine.prefix is None
