"""The model factory: a torchvision model of the task by name, or a user factory.

    build_model("resnet50", num_classes=10)                # torchvision, random init
    build_model("mypkg.models:small_cnn", num_classes=10)  # small_cnn(num_classes=10)
    build_model("fasterrcnn_mobilenet_v3_large_fpn", 8, task="detection", image_size=320)

Every model starts from scratch (``weights=None, weights_backbone=None``: nothing is
downloaded). The class count comes from the dataset's manifest; a detection model gets one
more, the background, at index 0 (torchvision's detection models' convention, which the
trainer's detection hooks follow for every detection model, a user's included). A detection
model that resizes inside (Faster/Mask R-CNN, RetinaNet, FCOS) is told the loader's
``image_size`` as its ``min_size`` and ``max_size``, so it keeps the loader's images as they
are. A user factory is imported with the current folder on ``sys.path`` (as ``python -m``
does), so a ``models.py`` beside the command works under ``torchrun`` too.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

from torch import nn

from dlpipe.errors import DlpipeError

__all__ = ["ModelError", "build_model", "task_models", "unwrap"]

_RESIZING_DETECTORS = ("fasterrcnn", "maskrcnn", "retinanet", "fcos")  # GeneralizedRCNNTransform
_EXAMPLES = {
    "classification": "resnet18",
    "detection": "fasterrcnn_mobilenet_v3_large_fpn",
    "segmentation": "deeplabv3_mobilenet_v3_large",
}


class ModelError(DlpipeError, ValueError):
    """The model name or factory cannot give a model of the task."""


def build_model(
    name: str, num_classes: int, *, task: str = "classification", image_size: int | None = None
) -> nn.Module:
    """A freshly initialised model of `task` for a dataset of `num_classes` classes.

    Args:
        name: a torchvision model of the task (`task_models`) or ``package.module:function``.
        num_classes: the dataset's classes (a detection model gets one more: the background).
        task: ``classification``, ``detection`` or ``segmentation``.
        image_size: the loader's image side (detection models that resize inside keep it).

    Raises:
        ModelError: an unknown name (naming the task's models), or a factory that fails.
    """
    outputs = num_classes + 1 if task == "detection" else num_classes
    if ":" in name:
        model = _user_model(name, outputs)
    else:
        model = _torchvision(name, outputs, task, image_size)
    if not isinstance(model, nn.Module):
        raise ModelError(f"--model {name} returned {type(model).__name__}, not a torch nn.Module")
    return model


def task_models(task: str) -> list[str]:
    """The torchvision models `build_model` makes for `task`, by name."""
    import torchvision
    from torchvision import models

    modules = {
        "classification": models,
        "detection": models.detection,
        "segmentation": models.segmentation,
    }
    names = torchvision.models.list_models(module=modules[task])
    return [n for n in names if not n.startswith("keypointrcnn")]  # keypoints: not a task here


def _torchvision(name: str, num_classes: int, task: str, image_size: int | None) -> nn.Module:
    import torchvision

    known = task_models(task)
    if name not in known:
        raise ModelError(_unknown(name, task, known))
    options: dict[str, object] = {"weights": None, "num_classes": num_classes}
    if task != "classification":
        options["weights_backbone"] = None
    if image_size is not None and name.startswith(_RESIZING_DETECTORS):
        options.update(min_size=image_size, max_size=image_size)
    model: nn.Module = torchvision.models.get_model(name, **options)
    return model


def _unknown(name: str, task: str, known: list[str]) -> str:
    other = [t for t in _EXAMPLES if t != task and name in task_models(t)]
    if other:
        return (
            f"--model {name} is a {other[0]} model, and this run trains {task}; give one of "
            f"the {task} models ({', '.join(known)}) or package.module:function"
        )
    near = difflib.get_close_matches(name, known, n=3)
    hint = f"did you mean {', '.join(near)}? " if near else ""
    listed = f" ({', '.join(known)})" if task != "classification" else ""
    return (
        f"--model {name}: not a torchvision {task} model{listed}; {hint}give a torchvision "
        f"name (e.g. {_EXAMPLES[task]}) or your own factory as package.module:function"
    )


def _user_model(name: str, num_classes: int) -> nn.Module:
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ModelError(
            f"--model {name}: give a factory as package.module:function (both parts), "
            "e.g. mypkg.models:small_cnn"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as exc:
        raise ModelError(
            f"--model {name}: cannot import {module_name} ({exc}); install the package or run "
            "from the folder that holds it"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"--model {name}: {module_name} has no function {attr!r}")
    try:
        model: nn.Module = factory(num_classes=num_classes)
    except (Exception, SystemExit) as exc:  # the user's code: name it, its error and the call
        raise ModelError(
            f"--model {name}: {module_name}.{attr}(num_classes={num_classes}) raised "
            f"{type(exc).__name__}: {str(exc)[:300]}; a factory takes num_classes= and "
            "returns a torch nn.Module"
        ) from None
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and ``torch.compile`` wrappers (no ``module.`` prefixes)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            inner = model.module
        elif type(model).__name__ == "OptimizedModule":  # torch.compile's wrapper
            inner = model._orig_mod
        else:
            return model
        assert isinstance(inner, nn.Module)
        model = inner
