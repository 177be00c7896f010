"""The model engine: int8 linears whose rows do not depend on the batch, and the Llama-family
forward that must give a tree pass the very logits one-token steps give."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdec.core.engine import ForwardCall, KVCache, LlamaEngine
from specdec.core.int8 import Int8Linear, quantize_linears
from specdec.core.hub import load_model_weights_only
from specdec.core.kernels import build, native, sources
from specdec.core.tree import DraftTree, verification_inputs
from tests.tiny_models import build_model_dir


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Runs a test on the engine's native kernels and again on its torch-ops fallback."""
    if request.param == "torch":
        for module in ("engine", "int8", "blocks"):
            monkeypatch.setattr(f"specdec.core.{module}.native", lambda: None)
    elif native() is None:
        pytest.fail("the native engine kernels did not build on this machine (see the log)")
    return request.param


def test_int8_linear_rows_do_not_depend_on_the_batch(kernels):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 200)
    quantized = Int8Linear.from_linear(linear)
    x = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # rows of very different scales
    together = quantized(x)
    alone = torch.cat([quantized(row[None]) for row in x])
    assert torch.equal(together, alone)
    relative = (together - linear(x)).norm(dim=1) / linear(x).norm(dim=1)
    assert relative.max() < 0.03


def test_int8_linear_sums_exactly_with_either_kernel(kernels):
    """Rows that quantize to +-127 everywhere make sums past 2**24: both kernels must convert
    the exact integer sum to float32 the same way."""
    weight = torch.full((96, 1536), 127, dtype=torch.int8)
    weight[::2] = -127
    quantized = Int8Linear(weight, torch.ones(96), None)
    x = torch.full((5, 1536), 1.0)
    x[1::2] = -1.0
    x[:, ::7] = torch.linspace(-1, 1, 5)[:, None]
    rows = torch.round(x / (x.abs().amax(dim=1, keepdim=True) / 127))
    exact = (rows.double() @ weight.double().t()).float() * (x.abs().amax(dim=1, keepdim=True) / 127)
    assert torch.equal(quantized(x), exact)
    assert torch.equal(quantized(x[:1]), exact[:1])


def test_int8_tiles_give_the_vector_paths_bits():
    """AMX's tiles (their emulated twin, built on the scalar paths so it runs on any CPU, and this
    CPU's own where it has them) give every row of every pass the sums the tiles-off path gives:
    row groups of 4-16 and past 16, channels in sets of four blocks and a partial set."""
    emulated = build(sources(), "x86-64", emulate=("amx",))
    builds = {"emulated tiles": emulated, **({"this CPU's tiles": native()} if native().tiles() else {})}
    torch.manual_seed(0)
    quantized = Int8Linear.from_linear(torch.nn.Linear(512, 16 * 9 + 5))  # 10 blocks: two sets of four and a part
    for rows in (1, 4, 5, 16, 17, 33):
        x = torch.randn(rows, 512) * 4
        outputs = {}
        for name, kernels in builds.items():
            quantized.kernels = kernels
            assert kernels.tiles(), name
            outputs[name] = quantized(x)
            kernels.tiles(False)
            assert torch.equal(quantized(x), outputs[name]), (name, rows)
            kernels.tiles(True)
        assert all(torch.equal(output, outputs["emulated tiles"]) for output in outputs.values()), rows


@pytest.fixture(params=["int8", "q4_1", "q8_0"])
def weights(request):
    """Runs a test with the model's linears int8, and again with 4-bit and 8-bit blocks."""
    return request.param


def quantize(model: torch.nn.Module, weights: str) -> None:
    quantize_linears(model, block_format=None if weights == "int8" else weights)


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-wide"])
def tiny_model(request, tmp_path_factory):
    """Tiny Llama and Qwen2 models; the wide one has real models' head width (64), which the
    native kernels' vector paths take."""
    arch, width = ("llama", 256) if request.param == "llama-wide" else (request.param, 32)
    path = build_model_dir(tmp_path_factory.mktemp(request.param), seed=3, arch=arch, width=width)
    return load_model_weights_only(str(path), torch.float32).eval()


def test_engine_gives_transformers_logits_and_hidden_states(tiny_model):
    engine = LlamaEngine(tiny_model)
    context, new = [1, 5, 7, 3, 9, 4], [6, 8, 10]
    with torch.inference_mode():
        cache = DynamicCache(config=tiny_model.config)
        tiny_model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
        reference = tiny_model(input_ids=torch.tensor([new]), past_key_values=cache, use_cache=True, output_hidden_states=True)
        engine_cache = engine.new_cache()
        engine(engine_cache, context)
        logits, hidden = engine(engine_cache, new, num_logits=3, hidden_states=True)
    # float rounding at each tensor's scale (the wide model's residual stream grows past 1000)
    assert torch.allclose(logits, reference.logits[0], atol=1e-5 * max(1.0, reference.logits.abs().max().item()))
    assert len(hidden) == len(reference.hidden_states)
    assert all(torch.allclose(a, b, atol=1e-5 * max(1.0, b.abs().max().item())) for a, b in zip(hidden, reference.hidden_states))


def test_native_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_NATIVE_KERNELS", "0")
    assert native.__wrapped__() is None


@pytest.mark.parametrize("shape", [(37, 13), (960, 576), (70, 1536)])
def test_native_int8_linear_equals_the_torch_ops_bit_for_bit(shape, monkeypatch):
    """Odd widths (padding to the 16-channel blocks and 4-input steps), every row count the
    kernel groups differently, with and without bias and smoothing."""
    torch.manual_seed(1)
    out_features, in_features = shape
    linear = torch.nn.Linear(in_features, out_features)
    for layer in (Int8Linear.from_linear(linear), Int8Linear.from_linear(linear, torch.rand(in_features) + 0.1)):
        assert layer.kernels is not None
        with monkeypatch.context() as torch_ops:
            torch_ops.setattr("specdec.core.int8.native", lambda: None)
            reference = Int8Linear(layer.weight, layer.scale, layer.bias, layer.smoothing)
        for rows in (1, 2, 5, 8, 9, 13, 16, 17, 33):
            x = torch.randn(rows, in_features) * 4
            assert torch.equal(layer(x), reference(x)), rows


def test_native_passes_let_other_python_threads_run():
    """A service's gRPC threads take requests and send replies while its compute thread is in
    a native pass: the kernels run without Python's lock. With a switch interval far longer
    than the test, a thread gets the lock only where the holder gives it up; the worker gives
    it up nowhere between its passes, so this thread runs again mid-pass only if the kernel
    let go of the lock (held, it would run again only once the worker had ended)."""
    import sys
    import threading
    import time

    kernels = native()
    assert kernels is not None, "the native engine kernels did not build on this machine (see the log)"
    torch.manual_seed(0)
    layer = Int8Linear(torch.randint(-127, 128, (4096, 4096), dtype=torch.int8), torch.full((4096,), 1e-3), None, None)
    x = torch.randn(16, 4096)
    passes = {"begun": 0, "ended": 0}
    seen = threading.Event()

    def multiply():
        deadline = time.monotonic() + 60  # a hang guard: a kernel that holds the lock fails the test, slowly
        while not seen.is_set() and time.monotonic() < deadline:
            passes["begun"] += 1
            kernels.int8_linear(x, layer.smoothing, layer.packed, layer.sums, layer.scale, layer.bias, layer.out_features)
            passes["ended"] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(120)
    try:
        worker = threading.Thread(target=multiply)
        worker.start()  # waits (without the lock) until the worker runs; then needs the lock back
        mid_pass = passes["begun"] > passes["ended"]
        seen.set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert mid_pass, passes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])  # SmolLM2's head width and Qwen2.5-1.5B's
def test_native_attention_gives_each_query_what_it_gets_alone(dtype, dim):
    """Causal and masked (tree) forms agree, each query's row equals its one-query call bit for
    bit, and the values match float64 attention (over the same bfloat16 numbers, where the
    cache is bfloat16: keys as pairs of channels, multiplied in pairs)."""
    torch.manual_seed(5)
    kernels = native()
    if dtype == torch.bfloat16 and kernels.cache_dtype() != "bfloat16":
        pytest.skip("this CPU has no bfloat16 dot products")
    heads, kv_heads, length, capacity = 9, 3, 150, 256
    keys_t, values = torch.randn(kv_heads, dim, capacity).to(dtype), torch.randn(kv_heads, capacity, dim).to(dtype)
    cached_keys = keys_t if dtype == torch.float32 else keys_t.view(kv_heads, dim // 2, 2, capacity).transpose(2, 3).contiguous()
    for count in (1, 4, 9, 33):
        q, start = torch.randn(count, heads, dim), length - count
        together = kernels.attention(q, cached_keys, values, length, start, None)
        mask = torch.ones(count, length, dtype=torch.bool).tril(start)
        assert torch.equal(kernels.attention(q, cached_keys, values, length, start, mask), together)
        for row in range(count):
            alone = kernels.attention(q[row : row + 1], cached_keys, values, start + row + 1, start + row, None)
            assert torch.equal(alone[0], together[row])
        # A tree: each row sees the context, a random set of earlier rows (its branch) and itself;
        # rows that share a pass see different keys past the context.
        branches = torch.rand(count, count).tril(-1) < 0.4
        tree_mask = mask.clone()
        tree_mask[:, start:] = branches | torch.eye(count, dtype=torch.bool)
        tree = kernels.attention(q, cached_keys, values, length, start, tree_mask)
        for row in range(count):
            alone = kernels.attention(q[row : row + 1], cached_keys, values, length, start + row, tree_mask[row : row + 1])
            assert torch.equal(alone[0], tree[row])
        keys = keys_t.transpose(1, 2).double()
        tolerance = 1e-5 if dtype == torch.float32 else 3e-3  # bfloat16 weights: 8 significant bits
        for row in range(count):
            seen = start + row + 1
            for head in range(heads):
                kv = head // (heads // kv_heads)
                weights = torch.softmax(keys[kv, :seen] @ q[row, head].to(dtype).double() / dim**0.5, dim=0)
                expected = weights @ values[kv, :seen].double()
                assert torch.allclose(together[row, head * dim : (head + 1) * dim].double(), expected, atol=tolerance)


def test_quantized_tree_pass_equals_one_token_steps(tiny_model, weights, kernels):
    """Exactness for the int8 and 4-bit engines: each tree node's logits from one masked pass
    are bit-identical to feeding its path one token at a time."""
    model = load_model_weights_only(tiny_model.name_or_path, torch.float32).eval()
    quantize(model, weights)
    engine = LlamaEngine(model)
    assert (engine.native_layers is not None) == (kernels == "native")
    assert_tree_pass_equals_one_token_steps(engine)


def assert_tree_pass_equals_one_token_steps(engine: LlamaEngine) -> None:
    """Each node of a tree verified in one masked pass after a cached context gets the very
    logits of feeding its path one token at a time."""
    context = [1, 5, 7, 3, 9, 11, 12, 4]
    tree = DraftTree([4, 6, 8, 10, 11, 13, 5], [-1, -1, 0, 0, 1, 3, 5])
    with torch.inference_mode():
        cache = engine.new_cache()
        engine(cache, context[:5])
        positions, mask = verification_inputs(tree, 5, 3)
        logits, _ = engine(cache, context[5:] + tree.token_ids, len(tree) + 1, position_ids=positions, attention_mask=mask)
        for node in range(len(tree)):
            step_cache = engine.new_cache()
            engine(step_cache, context[:5])
            for token in context[5:] + [tree.token_ids[n] for n in tree.path_to(node)]:
                step_logits, _ = engine(step_cache, [token])
            assert torch.equal(step_logits[-1], logits[node + 1]), f"node {node}"


def test_sequences_batched_in_one_pass_get_what_each_gets_alone(tiny_model, weights, kernels):
    """Continuous batching's exactness: several sessions' forwards in one `forward_many` (a
    tree with its mask, plain tokens, a prefill, hidden states) give each session bit-identical
    logits, hidden states and cache to its forward alone."""
    model = load_model_weights_only(tiny_model.name_or_path, torch.float32).eval()
    quantize(model, weights)
    engine = LlamaEngine(model)
    tree = DraftTree([4, 6, 8, 10], [-1, -1, 0, 2])
    contexts = [[1, 5, 7, 3, 9], [2, 2, 8], [6, 1, 4, 4, 9, 12, 3]]

    def calls():
        caches = [engine.new_cache() for _ in contexts]
        engine(caches[0], contexts[0][:3])
        engine(caches[1], contexts[1][:2])
        positions, mask = verification_inputs(tree, 3, 2)
        return caches, [
            ForwardCall(caches[0], contexts[0][3:] + tree.token_ids, len(tree) + 1, positions, mask, hidden_states=True),
            ForwardCall(caches[1], contexts[1][2:]),
            ForwardCall(caches[2], contexts[2], 2, prefill=True),
        ]

    with torch.inference_mode():
        caches, batch = calls()
        together = engine.forward_many(batch)
        alone_caches, alone_calls = calls()
        alone = [engine.forward_many([call])[0] for call in alone_calls]
    # The torch-ops path runs the calls one after another: the same numbers, not just close ones.
    for (logits, hidden), (expected, expected_hidden), cache, alone_cache in zip(together, alone, caches, alone_caches):
        assert torch.equal(logits, expected)
        assert (hidden is None) == (expected_hidden is None)
        assert hidden is None or all(torch.equal(h, e) for h, e in zip(hidden, expected_hidden))
        assert cache.length == alone_cache.length
        assert torch.equal(cache.values[:, :, : cache.length], alone_cache.values[:, :, : cache.length])


def test_only_the_depths_asked_for_are_kept(tiny_model, kernels):
    """A verifier reading features needs 3 of the residual stream's depths: asked for as a
    tuple, the engine keeps those alone, in that order, equal to the full set's."""
    model = load_model_weights_only(tiny_model.name_or_path, torch.float32).eval()
    quantize_linears(model)
    engine = LlamaEngine(model)
    last = model.config.num_hidden_layers
    with torch.inference_mode():
        _, every = engine(engine.new_cache(), [1, 5, 7, 3], 1, hidden_states=True)
        _, some = engine(engine.new_cache(), [1, 5, 7, 3], 1, hidden_states=(last, 0, 1))
    assert len(every) == last + 1 and len(some) == 3
    assert all(torch.equal(s, every[d]) for s, d in zip(some, (last, 0, 1)))


def test_native_prefill_equals_feeding_the_prompt_in_parts(tiny_model, weights):
    """With the native layers a prompt's prefill is batch-invariant like every other pass."""
    model = load_model_weights_only(tiny_model.name_or_path, torch.float32).eval()
    quantize(model, weights)
    engine = LlamaEngine(model)
    prompt = [1, 5, 7, 3, 9, 11, 12, 4, 6, 8]
    with torch.inference_mode():
        whole, _ = engine(engine.new_cache(), prompt, num_logits=4, prefill=True)
        cache = engine.new_cache()
        engine(cache, prompt[:3], prefill=True)
        engine(cache, prompt[3:6])
        parts, _ = engine(cache, prompt[6:], num_logits=4)
    assert torch.equal(whole, parts)


def test_native_decoder_layers_compute_what_the_torch_layers_compute(tiny_model, weights):
    """The one-call native layer (norms, rotary, cache writes, attention, SwiGLU with an SD²
    delta) against the same engine's layer-by-layer torch forward: equal up to float rounding.
    (4-bit blocks: the first layer's output and cache only. Their activations take a scale per
    32 inputs, a grid fine enough that a last-bit difference often moves one by a whole unit,
    and deeper layers compound it: the logits differ by up to ~0.3.)"""
    from specdec.core.steering import DrafterSteering

    model = load_model_weights_only(tiny_model.name_or_path, torch.float32).eval()
    quantize(model, weights)
    engine = LlamaEngine(model)
    torch.manual_seed(4)
    steering = DrafterSteering.for_model(model, steering_size=16)
    torch.nn.init.normal_(steering.proj.weight, std=0.5)
    engine.up_delta = steering.delta
    tree = DraftTree([4, 6, 8], [-1, -1, 0])
    positions, mask = verification_inputs(tree, 4, 2)
    results = []
    with torch.inference_mode(), steering.steer(torch.randn(16)):
        for layers in (engine.native_layers, None):
            engine.native_layers = layers
            cache = engine.new_cache() if layers is None else float32_cache(engine)  # float rounding only, not float16's
            engine(cache, [1, 5, 7, 3])
            logits, hidden = engine(cache, [9, 2] + tree.token_ids, 5, position_ids=positions, attention_mask=mask, hidden_states=True)
            results.append((logits, hidden, cache.values[:, :, :9].clone()))
    (native_logits, native_hidden, native_values), (torch_logits, torch_hidden, torch_values) = results
    depths = len(native_hidden) if weights == "int8" else 2
    assert weights != "int8" or torch.allclose(native_logits, torch_logits, atol=2e-3, rtol=1e-3)
    assert all(torch.allclose(a, b, atol=2e-3, rtol=1e-3) for a, b in zip(native_hidden[:depths], torch_hidden[:depths]))
    assert torch.allclose(native_values[: depths - 1], torch_values[: depths - 1], atol=2e-3, rtol=1e-3)


def float32_cache(engine: LlamaEngine) -> KVCache:
    return KVCache(len(engine.layers), engine.num_kv_heads, engine.head_dim, torch.float32, "cpu", transposed_keys=True)


def test_native_layers_keep_a_16_bit_cache_of_the_float32_values(tiny_model):
    """The native layers cache keys and values in 16 bits (half the bytes attention reads):
    bfloat16 where the CPU multiplies it, else float16. Each written value is the float32 one
    rounded, and the logits stay close."""
    model = load_model_weights_only(tiny_model.name_or_path, torch.float32).eval()
    quantize_linears(model)
    engine = LlamaEngine(model)
    assert engine.native_layers is not None, "the native engine kernels did not build on this machine (see the log)"
    short = engine.new_cache()
    dtype = getattr(torch, native().cache_dtype())
    assert short.values.dtype == dtype
    results = []
    with torch.inference_mode():
        for cache in (short, float32_cache(engine)):
            results.append((engine(cache, [1, 5, 7, 3, 9, 2], 6)[0], cache.values[0, :, :6].clone(), cache_keys(cache)[0, :, :6].clone()))
    (short_logits, short_values, short_keys), (full_logits, full_values, full_keys) = results
    # the first layer's: same inputs
    assert torch.equal(short_values, full_values.to(dtype)) and torch.equal(short_keys, full_keys.to(dtype))
    assert (short_logits - full_logits).abs().max() < 0.05 * full_logits.abs().max()  # rounding, through int8 activations


def cache_keys(cache: KVCache) -> torch.Tensor:
    """A KVCache's keys as [layers, kv_heads, positions, head_dim], whatever its layout."""
    if not cache.transposed_keys:
        return cache.keys
    if cache.keys.dim() == 5:  # bfloat16 pairs of channels [layers, kv_heads, head_dim / 2, capacity, 2]
        return cache.keys.transpose(2, 3).flatten(3)
    return cache.keys.transpose(2, 3)


@pytest.mark.parametrize("transposed_keys, dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_kv_cache_grows_and_keeps_a_path(transposed_keys, dtype):
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, dtype=dtype, device="cpu", capacity=4, transposed_keys=transposed_keys)
    if dtype == torch.bfloat16:
        assert cache.keys.shape == (2, 1, 1, 4, 2)  # pairs of channels

    def keys():  # [layer, head, position, dim], a view of the cache
        if not transposed_keys:
            return cache.keys
        return cache.keys[:, :, 0] if dtype == torch.bfloat16 else cache.keys.transpose(2, 3)

    cache.reserve(10)
    positions = torch.arange(10, dtype=torch.float32)
    keys()[:, 0, :10] = positions[:, None]
    cache.values[:, 0, :10] = -positions[:, None]
    cache.length = 10
    cache.reserve(40)
    assert cache.values.shape[2] >= 40 and torch.equal(keys()[1, 0, :10, 0], positions)
    cache.keep_positions(4, [6, 9])
    assert cache.length == 6 and keys()[0, 0, :6, 1].tolist() == [0, 1, 2, 3, 6, 9]
    assert cache.values[1, 0, :6, 0].tolist() == [0, -1, -2, -3, -6, -9]
    cache.truncate(2)
    assert cache.get_seq_length() == 2


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["int8", "q4_1"])
def test_default_verifier_pass_equals_one_token_steps(kernels, dtype):
    """On the real default verifier float32 attention noise, turned into different int8
    activations, moves logits by whole units; the engine's batch-invariant attention (native
    float32, or float64 without the kernels) keeps a 9-token pass bit-identical to one-token
    steps."""
    from specdec.core.hub import BUILTIN_SMOLLM2
    from specdec.core.models import ModelSpec, load_model

    engine = LlamaEngine(load_model(ModelSpec(BUILTIN_SMOLLM2, dtype=dtype)))
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 40000, (120,), generator=generator).tolist()
    new = torch.randint(0, 40000, (9,), generator=generator).tolist()
    with torch.inference_mode():
        cache = engine.new_cache()
        engine(cache, context)
        together, _ = engine(cache, new, num_logits=9)
        cache.truncate(len(context))
        alone = torch.cat([engine(cache, [token])[0] for token in new])
    assert torch.equal(together, alone)


def test_smoothing_tames_an_outlier_channel_and_keeps_rows_independent():
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 48, bias=False)
    x = torch.randn(6, 64)
    x[:, 5] *= 60  # one outlier channel, as LLM activations have
    plain, smoothed = Int8Linear.from_linear(linear), Int8Linear.from_linear(linear, x.abs().amax(dim=0))
    error = lambda layer: ((layer(x) - linear(x)).norm() / linear(x).norm()).item()  # noqa: E731
    assert error(smoothed) < 0.5 * error(plain)
    assert torch.equal(smoothed(x), torch.cat([smoothed(row[None]) for row in x]))
    with pytest.raises(ValueError, match="smooth their shared input alike"):
        Int8Linear.side_by_side([plain, smoothed])


def test_input_ranges_cover_every_linear(tiny_model):
    from specdec.core.models import input_ranges

    ranges = input_ranges(tiny_model, [1, 5, 7, 3, 9])
    linears = {n: m for n, m in tiny_model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(ranges) == set(linears)
    assert all(ranges[n].shape == (m.in_features,) and (ranges[n] > 0).all() for n, m in linears.items())


@pytest.mark.parametrize(
    "method, dtype", [*((m, "int8") for m in ("chain", "static", "dynamic", "rsd-c", "rsd-s")), ("dynamic", "q4_1"), ("rsd-s", "q4_1")]
)
def test_quantized_services_equal_the_served_verifier_alone(tiny_dirs, method, dtype):
    """Exactness for an int8 or 4-bit pair through the real services: greedy speculative output
    equals the same verifier decoding alone, one token per forward (`num_draft_tokens: 0`)."""
    from specdec.serving.client import CoordinatorClient, generate_request
    from tests.conftest import local_stack, tiny_config
    from tests.test_trees import SERVICE_PROMPTS, tree_request

    config = tiny_config(tiny_dirs)
    for service in ("verifier", "drafter"):
        config[service]["model"] = {"source": config[service]["model"], "dtype": dtype}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        for ids in SERVICE_PROMPTS:
            alone = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=30, num_draft_tokens=0))
            drafted = client.generate(
                generate_request(prompt_token_ids=ids, max_new_tokens=30, num_draft_tokens=8, tree=tree_request(method))
            )
            assert list(drafted.token_ids) == list(alone.token_ids), ids
            assert drafted.stats.drafted_tokens > 0 and alone.stats.drafted_tokens == 0
        client.close()


def test_engine_applies_sd2_deltas_as_the_hooks_do(tiny_model):
    """A steered drafter on the engine: the up-branch deltas the engine adds equal what the
    steering hooks add inside transformers' modules."""
    from specdec.core.engine import TransformersEngine
    from specdec.core.steering import DrafterSteering

    model = load_model_weights_only(tiny_model.name_or_path, torch.float32).eval()
    torch.manual_seed(4)
    steering = DrafterSteering.for_model(model, steering_size=16)
    torch.nn.init.normal_(steering.proj.weight, std=0.5)
    steering.attach(model)
    engine = LlamaEngine(model)
    engine.up_delta = steering.delta
    vector, context = torch.randn(16), [1, 5, 7, 3, 9, 4]
    with torch.inference_mode():
        results = []
        for runner in (TransformersEngine(model), engine):
            with steering.steer(vector):
                steered, _ = runner(runner.new_cache(), context, num_logits=3)
            plain, _ = runner(runner.new_cache(), context, num_logits=3)
            results.append((steered, plain))
    (hooked, hooked_plain), (fused, fused_plain) = results
    # float rounding at the logits' scale
    assert torch.allclose(hooked, fused, atol=1e-5 * max(1.0, hooked.abs().max().item()))
    assert torch.allclose(hooked_plain, fused_plain, atol=1e-5 * max(1.0, hooked_plain.abs().max().item()))
    assert not torch.allclose(hooked, hooked_plain, atol=1e-3)


def test_a_reopened_int8_session_decodes_on_exactly_as_before(tiny_dirs):
    """The prompt (but its last token) is prefilled with float32 attention kernels, whose
    results depend on the pass; a session re-opened with prompt + output must prefill the same
    prefix and feed the output as decoding did, or its next tokens could differ."""
    from specdec.core.models import ModelSpec
    from specdec.core.sampling import Sampling
    from specdec.core.tree import DraftTree
    from verifier_service.verifier import Verifier

    verifier = Verifier(ModelSpec(str(tiny_dirs["verifier"]), dtype="int8"))
    prompt, greedy = [1, 5, 9, 4, 7, 3, 8, 2, 6], Sampling(0.0, 1.0, 0, 0)
    session = verifier.open_session("a", prompt, greedy)
    tokens = [t for round_number in range(1, 5) for t in verifier.verify(session, round_number, DraftTree(), 5).token_ids]
    reopened = verifier.open_session("b", prompt + tokens[:10], greedy, prompt_length=len(prompt))
    later = [t for round_number in range(1, 3) for t in verifier.verify(reopened, round_number, DraftTree(), 5).token_ids]
    assert later == tokens[10:20]
    with pytest.raises(Exception, match="prompt_length 99 exceeds"):
        verifier.open_session("c", prompt, greedy, prompt_length=99)


def test_sampling_goes_on_exactly_after_a_reopen_with_fresh_random_numbers(tiny_dirs):
    """Each position draws from its own generator, seeded by (seed, position): a session
    re-opened mid-request samples what the first would have (no random number spent twice),
    and the same positions under another seed sample differently."""
    from specdec.core.models import ModelSpec
    from specdec.core.sampling import Sampling, position_generator
    from specdec.core.tree import DraftTree
    from verifier_service.verifier import Verifier

    verifier = Verifier(ModelSpec(str(tiny_dirs["verifier"])))
    prompt, hot = [1, 5, 9], Sampling(1.5, 1.0, 0, 11)
    one_go = verifier.verify(verifier.open_session("a", prompt, hot), 1, DraftTree(), 12).token_ids
    piecewise = []
    for i in range(4):  # a restart after every three tokens: each time a new session, round 1
        reopened = verifier.open_session(f"r{i}", prompt + piecewise, hot, prompt_length=len(prompt))
        piecewise += verifier.verify(reopened, 1, DraftTree(), 3).token_ids
    assert piecewise == one_go
    other_seed = verifier.verify(verifier.open_session("b", prompt, Sampling(1.5, 1.0, 0, 12)), 1, DraftTree(), 12).token_ids
    assert other_seed != one_go
    draws = [float(torch.rand((), generator=position_generator(11, p))) for p in (3, 3, 4)]
    assert draws[0] == draws[1] != draws[2]
