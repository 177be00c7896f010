"""Tiny random-weight models with a tiny word-level tokenizer, saved as real model
directories so every test goes through the same loading path as real models."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(13)]
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"


def build_tokenizer(words: list[str] = WORDS) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model_dir(
    path: Path, seed: int, layers: int = 2, init_range: float = 0.4, words: list[str] = WORDS, arch: str = "llama", width: int = 32
) -> Path:
    """A 2-layer model (Llama, Qwen2 or GPT-2) over the tiny vocabulary, `width` wide in 4
    heads. A wide init range makes its next-token distributions peaked, like a real model's,
    so acceptance is neither 0 nor 1."""
    torch.manual_seed(seed)
    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": True, "initializer_range": init_range}
    if arch == "gpt2":
        config = GPT2Config(vocab_size=len(words), n_embd=width, n_layer=layers, n_head=4, n_positions=128, **special)
    else:
        config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](
            vocab_size=len(words),
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            **special,
        )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    build_tokenizer(words).save_pretrained(path)
    return path


def build_perturbed_copy(source: Path, path: Path, seed: int, noise: float = 0.1) -> Path:
    """A drafter that is not the verifier but agrees with it often: `source`'s weights with
    Gaussian noise of `noise` times each tensor's spread added."""
    model = AutoModelForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * noise)
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(source).save_pretrained(path)
    return path


QWEN_TOKENIZER = Path(__file__).parent / "data" / "qwen2.5_tokenizer"


def qwen_tokenizer_dir(path: Path) -> Path:
    """The shipped Qwen2.5 tokenizer (tests/data), decompressed into `path`."""
    import lzma
    import shutil

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN_TOKENIZER / name, path / name)
    (path / "tokenizer.json").write_bytes(lzma.decompress((QWEN_TOKENIZER / "tokenizer.json.xz").read_bytes()))
    return path


def build_text_model_dir(path: Path, tokenizer, strings: list[str], seed: int, arch: str = "llama", spread: float = 1.0) -> Path:
    """A random 2-layer model over `tokenizer`'s whole (real) vocabulary that only ever says the
    tokens of `strings`, preferring earlier strings: two such models with different tokenizers
    and the same strings agree on text often, token by token they cannot. Every token's
    embedding carries one large constant feature; the output head reads it as a bias, so the
    other tokens' logits sit ~100 below (probability 0 in float32) and each string's tokens get
    a preference that `spread`-scaled random features perturb by context."""
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    bias = torch.full((vocab,), -30.0)
    for rank, text in enumerate(strings):
        for token in tokenizer.encode(text, add_special_tokens=False):
            bias[token] = max(float(bias[token]), -0.15 * rank)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings.normal_(0.0, 1.0)
        embeddings[:, 0] = 6.0
        for name, weight in model.named_parameters():  # the layers' writes to the residual stream: a small context effect
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.mul_(0.1)
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 0.1 * spread)
        head[:, 0] = bias
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
