"""Models and strategies by reference: a preset or built-in name, ``path/to/file.py:NAME`` or
``package.module:NAME`` (an object, or a function of no arguments that returns one).

A model loaded from a file keeps its reference (``Program.model_ref``), so spawned ranks and
resumed runs rebuild it from the same file; checkpoints record it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from .model import Model, check_model
from .strategies import STRATEGIES, Strategy, get_strategy

__all__ = ["load_model", "load_strategy", "is_reference"]

USER_PREFIX = "parlay_user_"


def is_reference(text: str) -> bool:
    return isinstance(text, str) and ":" in text


def _load_object(ref: str, what: str) -> Any:
    path, _, name = ref.rpartition(":")
    if not path or not name.isidentifier():
        raise ValueError(f"{what} {ref!r}: write FILE.py:NAME or package.module:NAME (NAME an object or a function "
                         f"of no arguments).")
    if path.endswith(".py") or os.sep in path or "/" in path:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"{what} {ref!r}: {str(file)!r} is not a file.")
        resolved = file.resolve()
        key = USER_PREFIX + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
        module = sys.modules.get(key)
        if module is None:
            if str(resolved.parent) not in sys.path:  # the file may import its neighbours
                sys.path.insert(0, str(resolved.parent))
            spec = importlib.util.spec_from_file_location(key, resolved)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module  # dataclasses and pickling look their module up by name
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[key]
                import traceback

                frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(resolved)]
                line = getattr(e, "lineno", None) or (frames[-1].lineno if frames else "?")
                raise ValueError(f"{what} {ref!r}: running {file} failed: {type(e).__name__}: {e} (line {line})"
                                 ) from None
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m`: the current folder first
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            raise ValueError(f"{what} {ref!r}: cannot import {path!r} ({e}); a module of yours must be importable "
                             f"from the current folder or PYTHONPATH (or give FILE.py:NAME).") from None
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(f"{what} {ref!r}: {path!r} has no {name!r} (it defines {', '.join(public[:12]) or 'nothing'}).")
    obj = getattr(module, name)
    if isinstance(obj, type) or (callable(obj) and not _meets_model(obj) and not isinstance(obj, Strategy)):
        # a factory, or a class: called with no arguments
        import inspect

        try:
            needs = [p.name for p in inspect.signature(obj).parameters.values()
                     if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        except (TypeError, ValueError):
            needs = []
        if needs:
            raise TypeError(f"{what} {ref!r}: {name} is a function of ({', '.join(needs)}); give a {what} object or a "
                            f"function of no arguments that returns one.")
        obj = obj()
    return obj


def _meets_model(obj) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("decls", "inputs", "loss"))


def load_model(ref: str) -> tuple[Model, str | None]:
    """(model, reference to rebuild it, or None for a preset)."""
    from .models.gpt import GPT, PRESETS

    if not isinstance(ref, str) or not ref:
        raise ValueError(f"model {ref!r}: give a preset ({', '.join(PRESETS)}) or FILE.py:NAME / module:NAME.")
    if not is_reference(ref):
        if ref not in PRESETS:
            hint = f" (write {ref}:NAME, NAME the model object or factory in it)" if ref.endswith(".py") else ""
            raise ValueError(f"model {ref!r} is not a preset ({', '.join(PRESETS)}) nor FILE.py:NAME / "
                             f"module:NAME{hint}.")
        return GPT(PRESETS[ref]), None
    obj = _load_object(ref, "model")
    return check_model(obj, where=f"model {ref!r}"), ref


def load_strategy(ref: str | Strategy) -> Strategy:
    """A built-in combination (``"fsdp+tp"``) or a ``Strategy`` from FILE.py:NAME / module:NAME;
    ``"dp+FILE.py:NAME"`` combines a user's strategy with built-ins."""
    if isinstance(ref, Strategy):
        return ref
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"strategy {ref!r}: give a name such as {', '.join(STRATEGIES)} (joined by '+') or "
                         f"FILE.py:NAME / module:NAME.")
    out = None
    for part in (p.strip() for p in ref.split("+")):
        if is_reference(part.partition("@")[0]):
            part, _, axes = part.partition("@")
            s = _load_object(part, "strategy")
            if not isinstance(s, Strategy):
                raise TypeError(f"strategy {part!r} is a {type(s).__name__}, not a parlay Strategy "
                                f"(parlay.core.strategies.Strategy).")
            if axes:
                s = s.on(*(a.strip() for a in axes.split(",")))
        else:
            s = get_strategy(part)
        out = s if out is None else out + s
    return out
