"""tiny-llama: a Hugging Face ``LlamaForCausalLM`` (RMSNorm, SwiGLU, rotary, grouped-query attention) for the zoo.

The architecture is `ARCH` (10.4 M parameters, input embedding tied to the output head), the tokenizer a
byte-level BPE of 4,096 tokens trained offline with the ``tokenizers`` library on the training documents of
`workbench.tasks.data.english_documents` only; its JSON ships as ``data/tiny-llama-tokenizer.json`` and
loads as a ``PreTrainedTokenizerFast``. Weights ship in fp16 (``data/tiny-llama.safetensors``) and load as
fp32. Both are made by ``python -m workbench.models.train tiny-llama``.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["ARCH", "EOS", "TOKENIZER_FILE", "build", "tokenizer", "train_tokenizer"]

EOS = "<|endoftext|>"            # separates documents; id 0
TOKENIZER_FILE = "tiny-llama-tokenizer.json"
VOCAB_SIZE = 4096

ARCH: dict = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 320,
    "intermediate_size": 864,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,     # grouped-query attention: 2 query heads per key/value head
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,  # lm_head.weight is embed_tokens.weight (one stored copy when compressed)
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def build(arch: dict | None = None) -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` of ``arch`` (default `ARCH`), fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**(arch or ARCH))).eval()


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (deterministic for a given input)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def tokenizer(path=None):
    """The shipped tiny-llama tokenizer as a ``PreTrainedTokenizerFast`` (no network, no pickle)."""
    from transformers import PreTrainedTokenizerFast

    from workbench.paths import data_dir

    file = path or data_dir() / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"the tiny-llama tokenizer was not found at {file}; "
                                f"run `python -m workbench.models.train tiny-llama`")
    return PreTrainedTokenizerFast(tokenizer_file=str(file), eos_token=EOS, bos_token=EOS, pad_token=EOS)
