"""torch.compile for cadence: options checked before any work, compilation in place, launcher settings.

The model is compiled in place (its forward), not wrapped in torch.compile's
`OptimizedModule`, so its state dict keeps its own names: saved weights never carry the
`_orig_mod.` prefix. The Learner compiles the user's module inside the strategy's wrapper
(see `Learner.compile` for why).

>>> model = compile_model(model, backend="eager")        # in place; returns the same module
>>> model = uncompile(model)                              # the plain module again
>>> options_from_env()            # under `cadence launch --dynamo_backend aot_eager`
{'backend': 'aot_eager', 'mode': None, 'fullgraph': False, 'dynamic': None}
"""

from __future__ import annotations

import os
import types
import weakref
from typing import Any

from torch import nn

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OPTION_NAMES = ("backend", "mode", "fullgraph", "dynamic", "options", "disable")
# what `cadence launch --dynamo_*` (and Accelerate's `dynamo_config`) set, and the torch.compile option each fills
ENV_VARS = {"backend": "CADENCE_DYNAMO_BACKEND", "mode": "CADENCE_DYNAMO_MODE",
            "fullgraph": "CADENCE_DYNAMO_USE_FULLGRAPH", "dynamic": "CADENCE_DYNAMO_USE_DYNAMIC"}


def check_compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` for torch.compile, checked (TypeError / ValueError naming the value) before anything compiles.

    >>> check_compile_options({"backend": "eager"})
    {'backend': 'eager'}
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown torch.compile option(s) {unknown}; the options are {', '.join(OPTION_NAMES)}")
    backend = options.get("backend", "inductor")
    if isinstance(backend, str):
        check_backend(backend)
    elif not callable(backend):
        raise TypeError(f"compile backend must be a name such as 'inductor' or a callable, got {backend!r}")
    if options.get("mode") not in MODES:
        raise ValueError(f"compile mode {options['mode']!r} does not exist; use one of {', '.join(map(str, MODES))}")
    return dict(options)


def check_backend(backend: str) -> None:
    """ValueError unless `backend` is a torch.compile backend registered in this torch (imports torch._dynamo)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"torch.compile backend {backend!r} does not exist in torch {torch.__version__}; "
                         f"use one of {', '.join(known)} (e.g. 'inductor', or 'eager' to check tracing only)")


def compile_model(model: nn.Module, **options: Any) -> nn.Module:
    """Compile `model`'s forward in place and return it; `options` go to torch.compile.

    The module stays itself, so its state dict keeps its names; its `forward` becomes a compiled
    function of cadence's with its own code object. Hooks (DDP's, FSDP's, dispatch's) run around
    it, uncompiled. Not `nn.Module.compile`: that compiles from `Module._call_impl`, a frame
    torch.compile skips, which leaves a built-in module such as `nn.Sequential` uncompiled, and
    traces FSDP's hooks, which break the graph. A code object per module gives each module its own
    compilation cache. The Accelerate-style `Accelerator(dynamo_backend=...)` calls this with `backend=...`.

    >>> model = compile_model(nn.Linear(4, 2), backend="aot_eager", dynamic=False)
    >>> sorted(model.state_dict())            # no `_orig_mod.` prefix
    ['bias', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_model needs an nn.Module, got {type(model).__name__}")
    options = check_compile_options(options)
    model = uncompile(model)
    model.forward = CompiledForward(model, options)  # an instance attribute: the class's forward is untouched
    return model


class CompiledForward:
    """`module.forward` through torch.compile; a deep copy of the module gets its own plain forward back.

    (A function attribute would be shared by `copy.deepcopy`, and the copy would run the original's weights.)
    """

    def __init__(self, module: nn.Module, options: dict[str, Any]):
        import torch

        forward = module.forward

        def compiled_forward(*args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)

        compiled_forward.__code__ = compiled_forward.__code__.replace()  # a new code object: this module's own cache
        self.fn, self.module, self.options = torch.compile(compiled_forward, **options), weakref.ref(module), options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self.module()))
        return type(copy).forward.__get__(copy) if copy is not None else self


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside torch.compile's `OptimizedModule` wrappers (whose state dict adds `_orig_mod.`).

    >>> unwrap_compiled(torch.compile(net)) is net
    True
    """
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def uncompile(model: nn.Module) -> nn.Module:
    """The plain module: `OptimizedModule` wrappers removed, an in-place compilation (ours, `nn.Module.compile`) dropped.

    >>> uncompile(compile_model(net, backend="eager")) is net
    True
    """
    model = unwrap_compiled(model)
    forward = model.__dict__.get("forward")
    if isinstance(forward, CompiledForward) or (isinstance(forward, types.MethodType) and forward.__self__ is model
                                                and forward.__func__ is type(model).forward):
        del model.__dict__["forward"]  # ours, or the plain forward a deep copy of ours left
    if getattr(model, "_compiled_call_impl", None) is not None:
        model._compiled_call_impl = None
    return model


def is_compiled(model: nn.Module) -> bool:
    """True when `model` runs through torch.compile (wrapped by it, or compiled in place by us or `nn.Module.compile`)."""
    return (isinstance(getattr(model, "_orig_mod", None), nn.Module) or getattr(model, "_compiled_call_impl", None) is not None
            or isinstance(model.__dict__.get("forward"), CompiledForward))


def resolve_compile(compile: bool | str | dict | None) -> dict[str, Any] | None:
    """The torch.compile options the Learner's `compile=` argument means, checked; None: do not compile.

    True: torch.compile's defaults; a str: that backend; a dict: those options; None: what
    `cadence launch --dynamo_backend` set (`options_from_env`); False: never.

    >>> resolve_compile("eager")
    {'backend': 'eager'}
    """
    if compile is None:
        return options_from_env()
    if compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, str):
        return check_compile_options({"backend": compile})
    if isinstance(compile, dict):
        return check_compile_options(compile)
    raise TypeError(f"compile must be True, False, a backend name or a dict of torch.compile options, got {compile!r}")


def options_from_env(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """torch.compile options from `CADENCE_DYNAMO_*` (set by `cadence launch`); None when no backend is set.

    >>> options_from_env({"CADENCE_DYNAMO_BACKEND": "aot_eager", "CADENCE_DYNAMO_USE_FULLGRAPH": "1"})
    {'backend': 'aot_eager', 'mode': None, 'fullgraph': True, 'dynamic': None}
    """
    environ = os.environ if environ is None else environ
    backend = environ.get(ENV_VARS["backend"], "no").lower()
    if backend == "no":
        return None
    dynamic = environ.get(ENV_VARS["dynamic"])
    options = {"backend": backend, "mode": environ.get(ENV_VARS["mode"]) or None,
               "fullgraph": environ.get(ENV_VARS["fullgraph"], "0") == "1",
               "dynamic": None if dynamic is None else dynamic == "1"}
    try:
        return check_compile_options(options)
    except ValueError as e:
        raise ValueError(f"{e} (set by cadence launch --dynamo_backend / the config's dynamo_config)") from None


# Accelerate's `dynamo_config` keys (also `cadence launch` flags) and the torch.compile option each sets
CONFIG_KEYS = {"dynamo_backend": "backend", "dynamo_mode": "mode", "dynamo_use_fullgraph": "fullgraph",
               "dynamo_use_dynamic": "dynamic"}


def normalize_dynamo_config(config: dict[str, Any]) -> dict[str, Any]:
    """Accelerate's `dynamo_config` block, checked: lower-case backend, known keys; {} when the backend is "no".

    >>> normalize_dynamo_config({"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": False})
    {'dynamo_backend': 'inductor', 'dynamo_use_fullgraph': False}
    """
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"dynamo_config: unknown key(s) {unknown}; the keys are {', '.join(CONFIG_KEYS)}")
    config = {k: v for k, v in config.items() if v is not None}
    backend = str(config.get("dynamo_backend", "no")).lower()
    if backend == "no":
        return {}
    if config.get("dynamo_mode") not in MODES:
        raise ValueError(f"dynamo_config: dynamo_mode {config['dynamo_mode']!r} does not exist; "
                         f"use one of {', '.join(map(str, MODES[1:]))}")
    for key in ("dynamo_use_fullgraph", "dynamo_use_dynamic"):
        if key in config and not isinstance(config[key], bool):
            raise ValueError(f"dynamo_config: {key} must be true or false, got {config[key]!r}")
    return {**config, "dynamo_backend": backend}


def dynamo_env(config: dict[str, Any]) -> dict[str, str | None]:
    """The `CADENCE_DYNAMO_*` variables a launch sets from a normalized `dynamo_config` (None: unset).

    >>> dynamo_env({"dynamo_backend": "eager"})["CADENCE_DYNAMO_BACKEND"]
    'eager'
    """
    def text(value: Any) -> str | None:
        return None if value is None else ("1" if value else "0") if isinstance(value, bool) else str(value)

    return {ENV_VARS[option]: text(config.get(key)) for key, option in CONFIG_KEYS.items()}


__all__ = ["compile_model", "uncompile", "unwrap_compiled", "is_compiled", "resolve_compile", "options_from_env",
           "check_compile_options", "normalize_dynamo_config", "dynamo_env"]
