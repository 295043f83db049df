"""The residual streams of a Hugging Face ResNet (``ResNetModel``, bottleneck or basic blocks): which layers write
each stream's channels and which read them, so `workbench.pruning.structured.channels` can cut a stream's channels
everywhere at once.

A block computes ``act(layer(x) + shortcut(x))``; ``act`` (ReLU) is channel-wise, so channel c of its output depends
on channel c of both operands only. A stream is every tensor that must therefore keep the same channels:

- a block whose shortcut is a projection (``ResNetShortCut``: 1x1 convolution + BatchNorm) starts a new stream,
  which its last convolution and the projection write; its ``layer.0`` convolution and the projection read the
  previous stream;
- a block whose shortcut is the identity passes its input through: its input and its output are one stream, which
  its last convolution writes too (and its ``layer.0`` convolution reads);
- the embedder's convolution (then BatchNorm, ReLU, max pooling: channel-wise) writes the first stream;
- the last stream is read by the classification head (average pooling to 1x1, flatten, Linear) or is the model's
  output, which cannot be cut.

`Stream.required` is what a selection must name to cut a stream: every writer but the shortcut projections, which
are cut along (a pattern over a stage's ``layers.*.layer.2.convolution`` cuts its stream).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from torch import nn

__all__ = ["Stream", "resnet_streams"]


@dataclass
class Stream:
    producers: list[str]                                 # every layer whose output is (added into) the stream
    norms: list[str]                                     # the BatchNorms on their outputs
    consumers: list[str] = field(default_factory=list)   # every layer reading it
    required: list[str] = field(default_factory=list)    # producers a selection must name (all but projections)
    output: str | None = None                            # the model whose output it is (then it cannot be cut)


def resnet_streams(model: nn.Module) -> list[Stream]:
    """The residual streams of every Hugging Face ``ResNetModel`` in ``model`` (none if transformers' ResNet is not
    imported: a model holding one has imported it), in forward order."""
    hf = sys.modules.get("transformers.models.resnet.modeling_resnet")
    if hf is None:
        return []
    modules = dict(model.named_modules())
    found: list[Stream] = []
    for name, m in modules.items():
        if isinstance(m, hf.ResNetModel):
            found += _streams(hf, modules, name, m)
    return found


def _streams(hf, modules: dict[str, nn.Module], name: str, backbone: nn.Module) -> list[Stream]:
    pre = f"{name}." if name else ""
    stem = f"{pre}embedder.embedder."
    stream = Stream([f"{stem}convolution"], [f"{stem}normalization"], required=[f"{stem}convolution"])
    streams = [stream]
    for s, stage in enumerate(backbone.encoder.stages):
        for i, block in enumerate(stage.layers):
            if not isinstance(block, (hf.ResNetBottleNeckLayer, hf.ResNetBasicLayer)):
                return []       # a block whose forward is not the one above: its streams are unknown
            b = f"{pre}encoder.stages.{s}.layers.{i}."
            stream.consumers.append(f"{b}layer.0.convolution")
            if isinstance(block.shortcut, hf.ResNetShortCut):
                stream.consumers.append(f"{b}shortcut.convolution")
                stream = Stream([f"{b}shortcut.convolution"], [f"{b}shortcut.normalization"])
                streams.append(stream)
            elif not isinstance(block.shortcut, nn.Identity):
                return []
            last = f"{b}layer.{len(block.layer) - 1}."
            stream.producers.append(f"{last}convolution")
            stream.norms.append(f"{last}normalization")
            stream.required.append(f"{last}convolution")
    parent_name = name.rpartition(".")[0]
    parent = modules.get(parent_name) if name else None
    head = getattr(parent, "classifier", None) if isinstance(parent, hf.ResNetForImageClassification) else None
    if isinstance(head, nn.Sequential) and len(head) == 2 and isinstance(head[0], nn.Flatten) \
            and isinstance(head[1], nn.Linear) and isinstance(backbone.pooler, nn.AdaptiveAvgPool2d) \
            and backbone.pooler.output_size in ((1, 1), 1):
        stream.consumers.append(f"{parent_name}.classifier.1" if parent_name else "classifier.1")
    else:
        stream.output = f"{type(backbone).__name__} {name!r}" if name else type(backbone).__name__
    return streams
