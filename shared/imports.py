"""Operator code named by an import path ``package.module:function``: user models (``model:``,
``--model``), user losses (``train.loss``, ``--loss``) and user data functions (``--data``).

Import paths come only from the operator's configuration and command line, never from a message
(docs/security.md): the callers check that before they get here.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_import_path(ref: str) -> bool:
    """True for ``package.module:function`` (attributes may be dotted: ``pkg.mod:Class.build``)."""
    return bool(_IMPORT_PATH.match(ref))


def check_import_origin(setting: str, run_ref: str, local_ref: str | None) -> None:
    """Refuse code named by the network: a run whose ``setting`` (``model``, ``loss``) is an import
    path is used only if the operator gave this process the same reference (``--model``,
    ``--loss``). A built-in name may come from anywhere. ValueError saying how to start the process."""
    if is_import_path(run_ref) and run_ref != local_ref:
        told = f" (this process was started with --{setting} {local_ref})" if local_ref else ""
        raise ValueError(f"the run uses {setting} {run_ref!r} (an import path); start this process with "
                         f"--{setting} {run_ref}{told}: import paths are never taken from the network")


def import_callable(ref: str, what: str) -> Callable[..., Any]:
    """The callable ``ref`` names. ValueError, prefixed with ``what`` (e.g. ``model 'x:y'``), says
    which part is wrong: the form, a module that does not import, a missing attribute, or one that
    is not callable."""
    if not is_import_path(ref):
        raise ValueError(f"{what}: an import path is package.module:function")
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import module {module_name!r} ({exc}); is its package on "
                         f"PYTHONPATH or installed?") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what}: {attr!r} is not callable (it is a {type(target).__name__})")
    return target
