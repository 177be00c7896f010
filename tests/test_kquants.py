"""The `gguf` weight format (specdec/core/kquants.py): a GGUF file's Q4_K and Q6_K blocks, and its
Q4_0, Q4_1, Q5_0 and Q8_0 blocks (specdec/core/blocks.py), served as stored. Their weights equal
gguf-py's dequantization bit for bit, the native kernel and the torch ops compute the same sums,
every row is independent of its pass, and the engine's exactness (tree pass = one-token steps,
batched = alone) holds on models whose layers mix the formats as real files do."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from specdec.core.blocks import BLOCK_FORMATS, FILE_BLOCK_TYPES, BlockLinear, dequantize_blocks, file_blocks, packed_bits
from specdec.core.engine import ForwardCall, LlamaEngine
from specdec.core.gguf_file import gguf_tensors
from specdec.core.hub import load_model_weights_only
from specdec.core.int8 import Int8Linear
from specdec.core.kernels import _cpu_flags, build, sources
from specdec.core.kquants import KQuantLinear, _llama_rows, decode, load_gguf_linears, pack, unpack
from tests.test_engine import assert_tree_pass_equals_one_token_steps
from tests.tiny_models import build_model_dir

# weights a block holds, its bytes, where its float16 factors lie
LAYOUTS = {
    "Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q8_0": (32, 34, (0,)), "Q4_0": (32, 18, (0,)),
    "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)),
}


def raw_blocks(kind: str, rows: int, columns: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """Random rows of a GGUF tensor as the file stores them: random quants and factors, float16
    d (and dmin) of a real model's size."""
    rng = np.random.default_rng(seed)
    size, nbytes, factors = LAYOUTS[kind]
    count = columns // size
    blocks = rng.integers(0, 256, size=(rows, count, nbytes), dtype=np.uint8)
    for at in factors:
        factor = (np.abs(rng.standard_normal((rows, count))) * scale).astype(np.float16)
        blocks[..., at : at + 2] = factor.view(np.uint8).reshape(rows, count, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_blocks_dequantize_as_gguf_py_does_and_pack_losslessly(kind):
    raw = raw_blocks(kind, 48, 512, seed=1)
    blocks = decode(raw, kind)
    expected = quants.dequantize(raw, getattr(GGMLQuantizationType, kind))
    assert np.array_equal(blocks.dequantize().numpy().view(np.uint32), expected.view(np.uint32))
    (back,) = unpack(*pack(blocks))
    assert all(torch.equal(getattr(back, f), getattr(blocks, f)) for f in ("q", "a", "b", "d", "dmin"))


@pytest.mark.parametrize("kind", FILE_BLOCK_TYPES)
def test_file_blocks_dequantize_as_gguf_py_does(kind):
    raw = raw_blocks(kind, 48, 512, seed=2)
    expected = quants.dequantize(raw, getattr(GGMLQuantizationType, kind))
    q, d, m, bits = file_blocks(raw, kind)
    assert np.array_equal(dequantize_blocks(q, d, m).numpy().view(np.uint32), expected.view(np.uint32))
    assert bits == {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q8_0": 8}[kind] and int(q.max()) < 2**bits
    layer = BlockLinear.from_file_blocks(raw, kind)  # packed as the kernel reads them, and back
    assert np.array_equal(layer.dequantized_weight().numpy().view(np.uint32), expected.view(np.uint32))


def test_five_bit_blocks_multiply_as_the_torch_ops_and_each_row_alone():
    """Q5_0 in its 5-bit blocks, alone and fused beside a 4-bit part (5 bits) and an 8-bit one
    (8 bits): each row's sums are the torch ops' to rounding, alone as in any pass."""
    five = BlockLinear.from_file_blocks(raw_blocks("Q5_0", 40, 512, seed=6), "Q5_0", torch.randn(40))
    four = BlockLinear.from_file_blocks(raw_blocks("Q4_0", 24, 512, seed=7), "Q4_0", torch.randn(24))
    eight = BlockLinear.from_file_blocks(raw_blocks("Q8_0", 20, 512, seed=8), "Q8_0", torch.randn(20))
    torch.manual_seed(2)
    x = torch.randn(40, 512) * 3
    for layer in (five, BlockLinear.side_by_side([four, five]), BlockLinear.side_by_side([five, eight])):
        assert layer.kernels is not None
        native = layer(x)
        assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(len(x))]), native)
        for rows in (2, 9, 15, 16, 17, 32, 33):  # row groups of every size the kernel makes
            assert torch.equal(layer(x[:rows]), native[:rows]), rows
        reference = layer._torch_forward(x)
        assert torch.allclose(native, reference, rtol=1e-5, atol=1e-4 * reference.abs().max().item())
    assert packed_bits(BlockLinear.side_by_side([four, five]).packed) == 5
    assert packed_bits(BlockLinear.side_by_side([five, eight]).packed) == 8
    assert torch.equal(BlockLinear.side_by_side([four, five, eight])(x), torch.cat([four(x), five(x), eight(x)], dim=1))


def mixed_layer(seed: int) -> tuple[KQuantLinear, KQuantLinear, KQuantLinear]:
    """A fused layer of a Q4_K part and a Q6_K part (a Q4_K_M file's q|k|v), and its parts."""
    first = KQuantLinear.from_blocks(decode(raw_blocks("Q4_K", 48, 768, seed), "Q4_K"), torch.randn(48))
    second = KQuantLinear.from_blocks(decode(raw_blocks("Q6_K", 32, 768, seed + 1), "Q6_K"), torch.randn(32))
    return KQuantLinear.side_by_side([first, second]), first, second


def test_native_kernel_sums_what_the_torch_ops_sum_and_each_row_alone():
    fused, first, second = mixed_layer(seed=2)
    assert fused.kernels is not None
    torch.manual_seed(0)
    x = torch.randn(40, 768) * 3
    x[3] = 0  # an all-zero row quantizes to zeros
    native = fused(x)
    assert torch.equal(native, torch.cat([first(x), second(x)], dim=1))
    reference = fused._torch_forward(x)
    assert torch.allclose(native, reference, rtol=1e-5, atol=1e-4 * reference.abs().max().item())
    # row groups of every size the vector path makes; with AMX, one, two and three row tiles
    for rows in (1, 2, 3, 4, 5, 9, 15, 16, 17, 32, 33):
        assert torch.equal(fused(x[:rows]), native[:rows]), rows
    assert torch.equal(torch.cat([fused(x[i : i + 1]) for i in range(len(x))]), native)
    # the weights the sums stand for: dequantized blocks times the activations, to quantization error
    weights = torch.cat([first.dequantized_weight(), second.dequantized_weight()])
    dense = x @ weights.T + fused.bias
    assert (native - dense).abs().max() < 0.02 * dense.abs().max()


@pytest.mark.slow  # extra builds of the kernels, a minute each (AVX-512 emulated: several)
def test_every_instruction_set_computes_the_same_bits():
    """The kernels' scalar paths (-march=x86-64), AVX2's (x86-64-v3), AVX-512 with VNNI emulated
    by SIMDe on AVX2 (so its paths are checked on any x86), AVX-512's where this CPU has it
    (x86-64-v4), AMX's tiles emulated (on the scalar paths, and beside emulated AVX-512 for the
    K-quants' tile path), and this CPU's own (VNNI, tiles where it has them) give
    every GGUF format's layers and the int8 layer the same outputs bit for bit, row by row: a
    served model's tokens do not depend on its machine."""
    marches = [("x86-64", ()), ("x86-64", ("amx",)), ("x86-64-v3", ()), ("x86-64-v3", ("avx512",)),
               ("x86-64-v3", ("avx512", "amx")), *([("x86-64-v4", ())] if " avx512bw" in _cpu_flags() else []), ("native", ())]
    builds = {f"{march}{'+' if emulate else ''}{'+'.join(emulate)}": build(sources(), march, emulate)
              for march, emulate in marches}
    fused, _, _ = mixed_layer(seed=3)
    layers = {"Q4_K|Q6_K": fused, "int8": Int8Linear.from_linear(torch.nn.Linear(768, 200))}
    layers.update({f: BlockLinear.from_linear(torch.nn.Linear(768, 200), f) for f in BLOCK_FORMATS})
    layers["Q5_0"] = BlockLinear.from_file_blocks(raw_blocks("Q5_0", 200, 768, seed=4), "Q5_0", torch.randn(200))
    torch.manual_seed(1)
    x = torch.randn(19, 768) * 3
    for name, layer in layers.items():
        outputs = {}
        for march, kernels in builds.items():
            layer.kernels = kernels
            outputs[march] = layer(x)
            assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(len(x))]), outputs[march]), (name, march)
        for march, output in outputs.items():
            assert torch.equal(output, outputs["native"]), (name, march)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def kquant_model_dir(request, tmp_path_factory):
    """A 2-layer model 256 wide (K-quant rows are multiples of 256)."""
    return build_model_dir(tmp_path_factory.mktemp(request.param), seed=3, arch=request.param, width=256)


# How real files store a layer's linears (the rest: `other`), by the projection they fill.
Q4_K_M = {"v_proj": "Q6_K", "down_proj": "Q6_K", "other": "Q4_K"}  # the 1.5B's
Q5_0_MIX = {"v_proj": "Q8_0", "down_proj": "Q6_K", "other": "Q5_0"}  # the 0.5B's (its other half: v Q5_0, down Q4_K)


def kquant_model(path, seed: int = 5, kinds: dict[str, str] = Q4_K_M) -> torch.nn.Module:
    """The model with its decoder's linears replaced by random blocks of `kinds`; its tiny
    vocabulary's head int8 (a float head's sums would change with the pass)."""
    model = load_model_weights_only(str(path), torch.float32).eval()
    model.lm_head = Int8Linear.from_linear(model.lm_head)
    for index, layer in enumerate(model.model.layers):
        for owner, name in ((layer.self_attn, "q_proj"), (layer.self_attn, "k_proj"), (layer.self_attn, "v_proj"),
                            (layer.self_attn, "o_proj"), (layer.mlp, "gate_proj"), (layer.mlp, "up_proj"), (layer.mlp, "down_proj")):
            linear = getattr(owner, name)
            kind = kinds.get(name, kinds["other"])
            raw = raw_blocks(kind, linear.out_features, linear.in_features, seed=seed + 10 * index + len(name), scale=0.004)
            bias = None if linear.bias is None else linear.bias.detach().float()
            if kind.endswith("_K"):
                setattr(owner, name, KQuantLinear.from_blocks(decode(raw, kind), bias))
            else:
                setattr(owner, name, BlockLinear.from_file_blocks(raw, kind, bias))
    return model


@pytest.mark.parametrize("kinds", [Q4_K_M, Q5_0_MIX], ids=["Q4_K_M", "Q5_0+Q8_0+Q6_K"])
def test_kquant_tree_pass_equals_one_token_steps_and_batches_equal_alone(kquant_model_dir, kinds):
    engine = LlamaEngine(kquant_model(kquant_model_dir, kinds=kinds))
    assert engine.native_layers is not None  # one native layer, whatever the mix
    assert_tree_pass_equals_one_token_steps(engine)
    with torch.inference_mode():
        together = engine.forward_many(_two_calls(engine))
        alone = [engine.forward_many([c])[0] for c in _two_calls(engine)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(together, alone))


def _two_calls(engine):
    return [ForwardCall(engine.new_cache(), [1, 5, 7, 3, 9], 2), ForwardCall(engine.new_cache(), [6, 1, 4], 1, prefill=True)]


def write_gguf(path, model, kinds: dict[str, str], seed: int) -> dict[str, np.ndarray]:
    """A GGUF file holding the model's decoder linears (and its LM head as `output`) as random
    K-quant blocks of the given kinds; the model's weights are set to what they dequantize to
    (what transformers would load from the file). Returns the raw rows by GGUF name."""
    writer = GGUFWriter(str(path), model.config.model_type)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    targets = {f"blk.{i}.{g}.weight": f"model.layers.{i}.{m}" for i in range(model.config.num_hidden_layers) for g, m in names.items()}
    targets["output.weight"] = "lm_head"
    modules = dict(model.named_modules())
    raws = {}
    for offset, (name, target) in enumerate(targets.items()):
        linear = modules[target]
        kind = kinds.get(name.split(".")[-2], "Q4_K")
        raw = raw_blocks(kind, linear.out_features, linear.in_features, seed=seed + offset, scale=0.004)
        quant_type = getattr(GGMLQuantizationType, kind)
        dequantized = torch.from_numpy(quants.dequantize(raw, quant_type))
        if model.config.model_type == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = model.config.num_attention_heads if "attn_q" in name else model.config.num_key_value_heads
            dequantized = dequantized[_llama_rows(len(raw), heads)]
        linear.weight.data = dequantized.clone()
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=quant_type)
        raws[name] = raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raws


def _untied(path) -> torch.nn.Module:
    """The tiny model with an LM head of its own (16-row groups), as a GGUF file's `output` fills it."""
    model = load_model_weights_only(str(path), torch.float32).eval()
    model.lm_head = torch.nn.Linear(model.config.hidden_size, 16 * (model.config.vocab_size // 16 + 1), bias=False)
    model.config.tie_word_embeddings = False
    return model


def _load_and_compare(model, path) -> dict[str, torch.nn.Module]:
    """load_gguf_linears(model, path), checking every linear now holds exactly the weights it had
    (what the file dequantizes to); returns the served layers by name."""
    expected = {name: module.weight.detach().clone() for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    load_gguf_linears(model, path)
    served = {name: module for name, module in model.named_modules() if isinstance(module, (KQuantLinear, BlockLinear))}
    assert set(served) == set(expected)
    for name, module in served.items():
        assert torch.equal(module.dequantized_weight(), expected[name]), name
    return served


def test_a_gguf_files_blocks_replace_the_models_linears(kquant_model_dir, tmp_path):
    """load_gguf_linears reads each tensor's own blocks (llama's q and k rows in transformers'
    order), so the served weights are the file's; a model that is not the file's, or a file
    storing its linears in another format, is refused with the tensor named."""
    model = _untied(kquant_model_dir)
    write_gguf(tmp_path / "model.gguf", model, {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}, seed=7)
    served = _load_and_compare(model, tmp_path / "model.gguf")
    assert {type(m).__name__ for m in served.values()} == {"KQuantLinear"}

    # The 0.5B's mix: Q5_0 and Q8_0 blocks beside K-quants, a Q8_0 head.
    mix = _untied(kquant_model_dir)
    kinds = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0",
             "ffn_down": "Q6_K", "output": "Q8_0"}
    write_gguf(tmp_path / "mix.gguf", mix, kinds, seed=9)
    served = _load_and_compare(mix, tmp_path / "mix.gguf")
    assert {type(m).__name__ for n, m in served.items() if "down_proj" in n} == {"KQuantLinear"}
    assert {type(m).__name__ for n, m in served.items() if "down_proj" not in n} == {"BlockLinear"}
    assert LlamaEngine(mix).native_layers is not None

    with pytest.raises(ValueError, match="blk.0.attn_q.weight in model.gguf does not dequantize to the model's"):
        load_gguf_linears(_untied(kquant_model_dir), tmp_path / "model.gguf")
    q5_1 = _untied(kquant_model_dir)
    write_gguf(tmp_path / "q5_1.gguf", q5_1, {"ffn_up": "Q5_1"}, seed=8)
    with pytest.raises(ValueError, match="stores linears as Q5_1; dtype gguf serves Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q8_0"):
        load_gguf_linears(q5_1, tmp_path / "q5_1.gguf")
    # K-quants and blocks in one fused q|k|v: no one layer holds both
    split = _untied(kquant_model_dir)
    write_gguf(tmp_path / "split.gguf", split, {"attn_v": "Q8_0"}, seed=10)
    load_gguf_linears(split, tmp_path / "split.gguf")
    with pytest.raises(ValueError, match=r"different kinds \(BlockLinear, KQuantLinear\) cannot be fused"):
        LlamaEngine(split)


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_tensors_find_what_the_gguf_package_reads(tmp_path, alignment):
    """Stepping over the metadata (strings, arrays of strings and of numbers, an alignment of
    the file's own) finds every tensor where the gguf package's reader does, with its format,
    its shape rows first and its bytes."""
    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "\u0120token"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_string("general.name", "tiny")
    writer.add_bool("general.flag", True)
    writer.add_float64("general.weight", 1.5)
    tensors = {"blk.0.attn_q.weight": raw_blocks("Q4_K", 32, 512, seed=1), "blk.0.ffn_down.weight": raw_blocks("Q8_0", 16, 64, seed=2)}
    for name, raw in tensors.items():
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=getattr(GGMLQuantizationType, "Q4_K" if "attn" in name else "Q8_0"))
    writer.add_tensor("output_norm.weight", np.arange(96, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    found = gguf_tensors(path)
    read = GGUFReader(str(path)).tensors
    assert list(found) == [t.name for t in read]
    for tensor in read:
        ours = found[tensor.name]
        assert ours.kind == tensor.tensor_type.name
        assert ours.shape == tuple(int(n) for n in reversed(tensor.shape))
        assert np.array_equal(ours.data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1)), tensor.name
    q = found["blk.0.attn_q.weight"]
    assert q.shape == (32, 512) and np.array_equal(q.data, tensors["blk.0.attn_q.weight"])
    with pytest.raises(ValueError, match="not a GGUF file"):
        (tmp_path / "other.gguf").write_bytes(b"GGML" + bytes(60))
        gguf_tensors(tmp_path / "other.gguf")


@pytest.mark.parametrize("head_kind", ["Q8_0", "Q6_K"])
def test_a_draft_vocabulary_serves_its_rows_of_the_files_head(kquant_model_dir, tmp_path, head_kind):
    """A head cut to a draft vocabulary (scatter_head) takes those rows of the file's head, in
    the file's own blocks; its logits are theirs, -inf elsewhere."""
    from specdec.core.drafter_checkpoint import scatter_head

    model = _untied(kquant_model_dir)
    write_gguf(tmp_path / "model.gguf", model, {"output": head_kind}, seed=11)
    whole = model.lm_head.weight.detach().clone()
    model.config.vocab_size = len(whole)  # the head's 32 rows, so that 16 of them (a K-quant row group) are a cut
    ids = [0, 2, 3, 7, 11, 12, 15, 16, 17, 19, 20, 23, 24, 26, 29, 31]
    scatter_head(model, ids)
    load_gguf_linears(model, tmp_path / "model.gguf")
    served = model.lm_head.head
    assert type(served).__name__ == ("KQuantLinear" if head_kind == "Q6_K" else "BlockLinear")
    assert torch.equal(served.dequantized_weight(), whole[ids])
    hidden = torch.randn(3, model.config.hidden_size)
    logits = model.lm_head(hidden)
    assert torch.equal(logits[:, ids], served(hidden)) and torch.isinf(logits[:, [1, 4, 5, 30]]).all()


def test_gguf_is_refused_for_a_model_that_is_not_a_gguf_file(kquant_model_dir):
    from specdec.core.models import ModelSpec, UnsupportedModel, load_model

    with pytest.raises(UnsupportedModel, match="dtype gguf serves a GGUF file's own blocks; .* is not a GGUF file"):
        load_model(ModelSpec(str(kquant_model_dir), dtype="gguf"))
