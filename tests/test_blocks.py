"""The block weight formats (specdec/core/blocks.py): GGUF's own blocks, rows that do not
depend on the batch, and the native kernel against the torch ops. The engine's exactness tests
(tree pass = one-token steps, batched sequences = each alone) run on q4_1 in test_engine.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.core.hub import BUILTIN_SMOLLM2, resolve_source
from specdec.core.kernels import native
from specdec.core.models import ModelSpec, UnsupportedModel, load_model
from specdec.core.blocks import BLOCK_FORMATS, BlockLinear, dequantize_blocks, quantize_blocks, unpack


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr("specdec.core.blocks.native", lambda: None)
    elif native() is None:
        pytest.fail("the native engine kernels did not build on this machine (see the log)")
    return request.param


@pytest.mark.parametrize("block_format", BLOCK_FORMATS)
@pytest.mark.parametrize("shape", [(40, 32), (200, 576), (70, 100)])  # 100 inputs: a block padded with zeros
def test_rows_do_not_depend_on_the_batch(block_format, shape, kernels):
    torch.manual_seed(0)
    linear = torch.nn.Linear(shape[1], shape[0])
    layer = BlockLinear.from_linear(linear, block_format)
    assert (layer.kernels is not None) == (kernels == "native")
    x = torch.randn(19, shape[1]) * torch.logspace(-2, 2, 19)[:, None]  # rows of very different scales
    together = layer(x)
    assert torch.equal(together, torch.cat([layer(row[None]) for row in x]))
    assert torch.equal(layer(x[3:11]), together[3:11])
    q, d, m = quantize_blocks(linear.weight.detach(), block_format)
    blocks = x @ dequantize_blocks(q, d, m)[:, : shape[1]].t() + linear.bias.detach()
    assert ((together - blocks).norm(dim=1) / blocks.norm(dim=1)).max() < 0.02  # int8 activations in blocks of 32


@pytest.mark.parametrize("block_format", BLOCK_FORMATS)
def test_a_row_is_its_quantized_activations_times_the_dequantized_blocks(block_format, kernels):
    """Independent of the kernel's arithmetic: in float64, each activation block rounded to
    int8 at its own scale (max |x| / 127), times the weights the blocks stand for."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(96, 48)
    layer = BlockLinear.from_linear(linear, block_format)
    x = torch.randn(7, 96) * torch.logspace(-1, 1, 96)  # blocks of different scales
    blocks = x.double().view(7, -1, 32)
    scale = (blocks.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / 127).double()
    rounded = (torch.round(blocks / scale) * scale).view(7, 96)
    expected = rounded @ dequantize_blocks(*quantize_blocks(linear.weight.detach(), block_format)).double().t() + linear.bias.double()
    assert torch.allclose(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_format", ["q4_1", "q8_0"])
def test_the_native_kernel_computes_what_the_torch_ops_compute(block_format):
    """The same integer sums and scales; the native kernel fuses its multiply-adds, so the
    floats agree to rounding."""
    if native() is None:
        pytest.fail("the native engine kernels did not build on this machine (see the log)")
    torch.manual_seed(1)
    layer = BlockLinear.from_linear(torch.nn.Linear(1536, 200), block_format)
    x = torch.randn(17, 1536)
    assert torch.allclose(layer(x), layer._torch_forward(x), rtol=1e-5, atol=1e-4)


def test_q8_0_blocks_are_llama_cpps():
    """The reference Q8_0 quantizer (gguf-py's, llama.cpp's rules: d = max |w| / 127, q =
    round(w / d) half away from zero) gives the same blocks, including halves and a zero block."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    torch.manual_seed(4)
    weight = torch.randn(24, 96)
    weight[0, :32] = 0.0
    weight[1, :32] = torch.arange(32) - 15.5  # every scaled weight a half or near one
    raw = quantize(weight.numpy(), GGMLQuantizationType.Q8_0).reshape(-1, 34)  # a block: d (float16), 32 int8
    q, d, m = quantize_blocks(weight, "q8_0")
    assert torch.equal(q.view(-1, 32).int() - 128, torch.from_numpy(raw[:, 2:].copy().view(np.int8)).int())
    assert torch.equal(d.view(-1), torch.from_numpy(raw[:, :2].copy().view(np.float16).reshape(-1)))
    assert torch.equal(m, d * -128)


@pytest.mark.parametrize("block_format", BLOCK_FORMATS)
def test_blocks_pack_unpack_and_fuse(block_format):
    torch.manual_seed(2)
    parts = [torch.nn.Linear(64, n) for n in (48, 20, 20)]  # 20: channels padded to 16
    layers = [BlockLinear.from_linear(p, block_format) for p in parts]
    for part, layer in zip(parts, layers):
        assert all(torch.equal(a, b) for a, b in zip(unpack(layer.packed, layer.out_features), quantize_blocks(part.weight, block_format)))
    fused = BlockLinear.side_by_side(layers)
    x = torch.randn(5, 64)
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], dim=1))


def test_a_block_of_equal_weights_and_an_all_zero_row():
    """Equal weights are exact in the 4-bit formats (Q4_0: a power of two here); Q8_0 holds
    them as 127 d, d rounded to float16. An all-zero row or input stays zero."""
    weight = torch.zeros(16, 64)
    weight[1] = 0.25
    for block_format in BLOCK_FORMATS:
        q, d, m = quantize_blocks(weight, block_format)
        expected = weight if block_format != "q8_0" else weight.sign() * 127 * (weight / 127).half().float()
        assert torch.equal(dequantize_blocks(q, d, m), expected), block_format
        layer = BlockLinear.from_linear(torch.nn.Linear(64, 16, bias=False), block_format)
        assert torch.equal(layer(torch.zeros(2, 64)), torch.zeros(2, 16))


@pytest.mark.e2e
def test_the_default_gguf_blocks_are_served_as_the_file_stores_them():
    """Quantizing the dequantized weights gives the file's own Q4_1 blocks back, bit for bit:
    the q4_1 verifier is the file's model. (q and k are stored with their rows permuted for
    llama.cpp's rotary; the other matrices are compared.)"""
    from gguf import GGUFReader

    directory, name = resolve_source(BUILTIN_SMOLLM2)
    tensors = {t.name: t for t in GGUFReader(str(Path(directory) / name)).tensors}
    model = load_model(ModelSpec(BUILTIN_SMOLLM2))
    for gguf_name, module in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
                              ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
        stored = tensors[f"blk.7.{gguf_name}.weight"]
        assert stored.tensor_type.name == "Q4_1"
        raw = np.asarray(stored.data).view(np.uint8).reshape(-1, 20)  # a block: d, m (float16), 16 bytes of nibbles
        weight = model.get_submodule(f"model.layers.7.{module}").weight.detach()
        q, d, m = quantize_blocks(weight, "q4_1")
        nibbles = torch.from_numpy(raw[:, 4:].copy())
        assert torch.equal(q.view(-1, 32), torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)), gguf_name  # weights j and 16 + j
        assert torch.equal(d.view(-1), torch.from_numpy(raw[:, 0:2].copy().view(np.float16).reshape(-1)))
        assert torch.equal(m.view(-1), torch.from_numpy(raw[:, 2:4].copy().view(np.float16).reshape(-1)))
    # The file's one Q8_0 matrix, the token embeddings (also its tied LM head), the same way.
    stored = tensors["token_embd.weight"]
    assert stored.tensor_type.name == "Q8_0"
    raw = np.asarray(stored.data).view(np.uint8).reshape(-1, 34)
    q, d, _ = quantize_blocks(model.get_input_embeddings().weight.detach(), "q8_0")
    assert torch.equal(q.view(-1, 32).int() - 128, torch.from_numpy(raw[:, 2:].copy().view(np.int8)).int())
    assert torch.equal(d.view(-1), torch.from_numpy(raw[:, :2].copy().view(np.float16).reshape(-1)))


def test_a_gguf_is_served_in_a_block_format_only_if_it_stores_its_layers_so_or_may_be_requantized():
    with pytest.raises(UnsupportedModel, match="stores its layers as Q4_1; dtype q4_0 keeps a GGUF's Q4_0 blocks"):
        load_model(ModelSpec(BUILTIN_SMOLLM2, dtype="q4_0"))
    model = load_model(ModelSpec(BUILTIN_SMOLLM2, dtype="q4_0", requantize=True, layers=2))  # a drafter made smaller
    layers = [m for name, m in model.named_modules() if ".layers." in name and isinstance(m, BlockLinear)]
    assert model.weight_format == "q4_0" and len(layers) == 14
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
