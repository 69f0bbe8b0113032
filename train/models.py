"""The model factory: any torchvision classification model by name, or a user factory.

    build_model("resnet50", num_classes=10)                # torchvision, random init
    build_model("mypkg.models:small_cnn", num_classes=10)  # small_cnn(num_classes=10)

A user factory is imported with the current folder on ``sys.path`` (as ``python -m`` does), so
a ``models.py`` beside the command works under ``torchrun`` too. The class count comes from the
dataset's manifest.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

from torch import nn

from dlpipe.errors import DlpipeError

__all__ = ["ModelError", "build_model", "unwrap"]


class ModelError(DlpipeError, ValueError):
    """The model name or factory cannot give a classification model."""


def build_model(name: str, num_classes: int) -> nn.Module:
    """A freshly initialised classifier with `num_classes` outputs."""
    model = _user_model(name, num_classes) if ":" in name else _torchvision(name, num_classes)
    if not isinstance(model, nn.Module):
        raise ModelError(f"--model {name} returned {type(model).__name__}, not a torch nn.Module")
    return model


def _torchvision(name: str, num_classes: int) -> nn.Module:
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        near = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise ModelError(
            f"--model {name}: not a torchvision classification model; {hint}"
            "give a torchvision name (e.g. resnet18) or your own factory as package.module:function"
        )
    model: nn.Module = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    return model


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
