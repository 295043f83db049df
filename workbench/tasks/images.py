"""imagenet-photos: how faithfully a compressed ImageNet classifier reproduces its fp32 self on real photos.

The photos ship with installed packages (no downloads): scikit-learn's two sample images and scikit-image's
bundled colour photos. There are no labels, so the metrics compare with the fp32 zoo model
(``efficientnet-lite0``) on the same inputs:

- ``agreement`` (primary, higher is better): fraction of evaluation inputs whose top-1 class equals fp32's;
- ``kl`` (lower is better): mean KL(p_fp32 || p_model) of the softmax over the 1000 classes, in nats.

Each photo gives ten deterministic views (ten-crop): its short side resized to 256 (bicubic), then 224x224 crops
at the centre and the four corners, each also mirrored left-right. Calibration and evaluation use different
photos (`CALIBRATION_PHOTOS`, `EVALUATION_PHOTOS`): 40 calibration and 50 evaluation inputs; ``quick`` uses
the centre crop and its mirror of each evaluation photo (10 inputs). The fp32 model's top-1 classes on the
evaluation photos are sensible (`EXPECTED`: the chelsea photo is a cat, coffee an espresso, ...); the
fp32 reference logits are computed once per process.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workbench.tasks.base import MetricSpec, Task, check_count, check_model, eval_mode, model_device

__all__ = ["ImagePhotosTask", "CALIBRATION_PHOTOS", "EVALUATION_PHOTOS", "EXPECTED", "photo", "views",
           "VIEWS_PER_PHOTO"]

CALIBRATION_PHOTOS = ("astronaut", "china", "flower", "hubble_deep_field")
EVALUATION_PHOTOS = ("chelsea", "coffee", "rocket", "camera", "motorcycle")
RESIZE, CROP = 256, 224
VIEWS_PER_PHOTO = 10
REFERENCE_MODEL = "efficientnet-lite0"

# ImageNet-1k classes an fp32 classifier should give each evaluation photo (index: name), for sanity checks.
EXPECTED: dict[str, dict[int, str]] = {
    "chelsea": {281: "tabby cat", 282: "tiger cat", 283: "Persian cat", 284: "Siamese cat", 285: "Egyptian cat"},
    "coffee": {967: "espresso", 968: "cup", 504: "coffee mug"},
    "rocket": {657: "missile", 744: "projectile", 812: "space shuttle"},
    "camera": {872: "tripod"},           # scikit-image's cameraman stands behind a camera on a tripod
    "motorcycle": {665: "moped", 670: "motor scooter"},
}


@functools.cache
def photo(name: str) -> np.ndarray:
    """One bundled photo as (H, W, 3) uint8 RGB (grey photos are repeated over the three channels)."""
    if name in ("china", "flower"):
        from sklearn.datasets import load_sample_image

        img = load_sample_image(f"{name}.jpg")
    elif name == "motorcycle":
        from skimage import data as skdata

        img = skdata.stereo_motorcycle()[0]   # the left image of the stereo pair
    elif name in ("astronaut", "chelsea", "coffee", "rocket", "camera", "hubble_deep_field"):
        from skimage import data as skdata

        img = getattr(skdata, name)()
    else:
        raise ValueError(f"unknown photo {name!r}; photos: {CALIBRATION_PHOTOS + EVALUATION_PHOTOS}")
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    return np.ascontiguousarray(img[:, :, :3], dtype=np.uint8)


def _normalise(crops: np.ndarray) -> torch.Tensor:
    """(N, 224, 224, 3) uint8 -> (N, 3, 224, 224) float32, normalised as the model was trained."""
    from workbench.models.efficientnet import MEAN, STD

    x = torch.from_numpy(crops).float().div_(255.0).permute(0, 3, 1, 2)        # (N, 3, H, W)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous()


@functools.cache
def views(name: str) -> torch.Tensor:
    """The ten views of photo ``name``: (10, 3, 224, 224), in the order centre, its mirror, then top-left,
    top-right, bottom-left, bottom-right, each followed by its mirror."""
    from PIL import Image

    im = Image.fromarray(photo(name))
    w, h = im.size
    scale = RESIZE / min(w, h)
    im = im.resize((max(RESIZE, round(w * scale)), max(RESIZE, round(h * scale))), Image.BICUBIC)
    a = np.asarray(im)                                                     # (H', W', 3)
    H, W = a.shape[:2]
    corners = [((H - CROP) // 2, (W - CROP) // 2), (0, 0), (0, W - CROP), (H - CROP, 0), (H - CROP, W - CROP)]
    crops = []
    for top, left in corners:
        c = a[top:top + CROP, left:left + CROP]
        crops += [c, c[:, ::-1]]
    return _normalise(np.ascontiguousarray(np.stack(crops)))


def _inputs(photos, quick: bool = False) -> torch.Tensor:
    x = torch.cat([views(p) for p in photos])                             # (P * 10, 3, 224, 224)
    if quick:
        idx = [i * VIEWS_PER_PHOTO + j for i in range(len(photos)) for j in (0, 1)]
        x = x[idx]
    return x


def logits(model: nn.Module, x: torch.Tensor, batch_size: int = 25) -> torch.Tensor:
    """fp32 logits (N, classes) of ``model`` on images ``x``, in batches, under inference mode."""
    device = model_device(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    out = []
    with torch.inference_mode():
        for i in range(0, len(x), batch_size):
            y = model(x[i:i + batch_size].to(device=device, dtype=dtype))
            if not isinstance(y, torch.Tensor) or y.ndim != 2 or y.shape[0] != len(x[i:i + batch_size]):
                shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(f"an ImageNet classifier must return (batch, classes) logits, got {shape}")
            out.append(y.float().cpu())
    return torch.cat(out)


@functools.cache
def _reference(quick: bool) -> torch.Tensor:
    from workbench.models import load

    return logits(load(REFERENCE_MODEL), _inputs(EVALUATION_PHOTOS, quick))


class ImagePhotosTask(Task):
    name = "imagenet-photos"
    metrics = (
        MetricSpec("agreement", True, "fraction of photo views whose top-1 ImageNet class equals the fp32 model's"),
        MetricSpec("kl", False, "mean KL(fp32 || model) of the class probabilities, in nats (lower is better)"),
    )
    default_batch_size = 8
    input_desc = "(B, 3, 224, 224) normalised RGB"

    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        return self.evaluate_with_error(model, quick)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """Agreement (Wilson 95 % half-width) and mean KL (Student's t over views). The views of one photo are
        not independent samples, so the stated errors are lower bounds."""
        from workbench.measurement.sampling import mean_halfwidth, wilson_halfwidth

        check_model(model)
        with eval_mode(model):
            out = logits(model, _inputs(EVALUATION_PHOTOS, quick))
        ref = _reference(quick)
        if out.shape != ref.shape:
            raise ValueError(f"expected logits of shape {tuple(ref.shape)} (ImageNet-1k), got {tuple(out.shape)}")
        agree = int((out.argmax(-1) == ref.argmax(-1)).sum())
        kl = F.kl_div(F.log_softmax(out.double(), -1), F.log_softmax(ref.double(), -1), log_target=True,
                      reduction="none").sum(-1)                                      # (N,) per view
        return ({"agreement": agree / len(out), "kl": max(float(kl.mean()), 0.0)},
                {"agreement": wilson_halfwidth(agree, len(out)), "kl": mean_halfwidth(kl.numpy())})

    def predictions(self, model: nn.Module) -> dict[str, int]:
        """Top-1 class of ``model`` on the centre crop of each evaluation photo."""
        check_model(model)
        x = torch.stack([views(p)[0] for p in EVALUATION_PHOTOS])
        with eval_mode(model):
            top = logits(model, x).argmax(-1)
        return dict(zip(EVALUATION_PHOTOS, top.tolist()))

    def calibration(self, n: int, batch_size: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        """``n`` views of the calibration photos (never the evaluation photos), interleaved so that a few
        samples already cover every photo: view 0 of each photo, then view 1 of each, ..."""
        x = torch.stack([views(p) for p in CALIBRATION_PHOTOS]).transpose(0, 1).flatten(0, 1)  # (10 * P, 3, H, W)
        check_count(n, len(x), "imagenet-photos calibration")
        bs = batch_size or self.default_batch_size
        return [(x[i:min(i + bs, n)],) for i in range(0, n, bs)]

    def example_inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        bs = batch_size or self.default_batch_size
        x = _inputs(EVALUATION_PHOTOS)
        return (x[torch.arange(bs) % len(x)],)
