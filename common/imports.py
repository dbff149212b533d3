"""Objects named on the command line as MODULE:NAME (an adapter function, a model family)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from common.errors import InputError


def one_line(err: BaseException) -> str:
    """An exception as 'Type: first 200 characters of its message', on one line."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def import_named(spec: str, option: str, form: str, example: str) -> Any:
    """The object `spec` (`form`: 'module:name', the name part possibly dotted) names; InputError
    starting with `option` and `spec` for a malformed spec, a failed import or a missing name.
    The current directory is searched first, as `python -m` has it: a module beside the user's
    data imports without being installed."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise InputError(f"{option} {spec!r}: expected {form}, e.g. {example}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # a module's body can raise anything; the user needs its first line
        raise InputError(f"{option} {spec}: cannot import {module_name!r} ({one_line(err)})") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise InputError(f"{option} {spec}: module {module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    return target
