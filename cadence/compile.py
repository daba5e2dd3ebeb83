"""torch.compile for cadence: options checked before any work, compilation in place, launcher settings.

The model is compiled in place (its forward), not wrapped in torch.compile's
`OptimizedModule`, so its state dict keeps its own names: saved weights never carry the
`_orig_mod.` prefix. The Learner compiles the user's module inside the strategy's wrapper
(see `Learner.compile` for why). Regional compilation (`regional=True`, Accelerate's
`compile_regions`) compiles each block of a repeated `nn.ModuleList` instead, once per class.

>>> model = compile_model(model, backend="eager")        # in place; returns the same module
>>> model = compile_model(model, backend="inductor", regional=True)   # a transformer's layers, compiled once
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

_ALWAYS_REGISTERED = frozenset({"inductor", "eager", "aot_eager", "cudagraphs"})  # registered by torch itself
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# torch.compile's options, and cadence's `regional` (compile the repeated blocks, not the whole model)
OPTION_NAMES = ("backend", "mode", "fullgraph", "dynamic", "options", "disable", "regional")
# what `cadence launch --dynamo_*` (and Accelerate's `dynamo_config`) set, and the option each fills
ENV_VARS = {"backend": "CADENCE_DYNAMO_BACKEND", "mode": "CADENCE_DYNAMO_MODE",
            "fullgraph": "CADENCE_DYNAMO_USE_FULLGRAPH", "dynamic": "CADENCE_DYNAMO_USE_DYNAMIC",
            "regional": "CADENCE_DYNAMO_USE_REGIONAL_COMPILATION"}


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
    if not isinstance(options.get("regional", False), bool):
        raise TypeError(f"compile option regional must be True or False, got {options['regional']!r}")
    return dict(options)


def check_backend(backend: str) -> None:
    """ValueError unless `backend` is a torch.compile backend registered in this torch.

    torch's own common backends pass without importing torch._dynamo (seconds, e.g. in the launcher).
    """
    if backend in _ALWAYS_REGISTERED:
        return
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

    `regional=True` compiles regions instead (Accelerate's `compile_regions`): each block of an
    `nn.ModuleList` whose blocks share one class (a transformer's layers) is compiled, and the blocks of
    that class share one code object, so the first block's compiled graph serves the others; every
    other submodule without repeated blocks below it (embeddings, final norm, head) is compiled on its
    own, and the code that calls them (the loop over the layers) runs eagerly. A model without
    repeated blocks is compiled whole, as Accelerate does.

    >>> model = compile_model(nn.Linear(4, 2), backend="aot_eager", dynamic=False)
    >>> sorted(model.state_dict())            # no `_orig_mod.` prefix
    ['bias', 'weight']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_model needs an nn.Module, got {type(model).__name__}")
    options = check_compile_options(options)
    regional = options.pop("regional", False)
    model = uncompile(model)
    if regional:
        _compile_regions(model, options, {})
    else:
        model.forward = CompiledForward(model, options)  # an instance attribute: the class's forward is untouched
    return model


def is_repeated_blocks(module: nn.Module) -> bool:
    """Whether `module` is an `nn.ModuleList` of blocks of one class (Accelerate's test for a region).

    >>> is_repeated_blocks(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    True
    """
    return isinstance(module, nn.ModuleList) and len(module) > 0 and all(isinstance(m, type(module[0])) for m in module)


def has_repeated_blocks(module: nn.Module) -> bool:
    """Whether `module` or a module below it is a list of repeated blocks (`is_repeated_blocks`)."""
    return any(is_repeated_blocks(m) for m in module.modules())


def _compile_regions(module: nn.Module, options: dict[str, Any], codes: dict[type, types.CodeType]) -> None:
    """Compile `module`'s regions in place; `codes`: the code object shared by the blocks of each class."""
    if is_repeated_blocks(module):
        for block in module:
            block.forward = CompiledForward(block, options, codes.get(type(block)))
            codes.setdefault(type(block), block.forward.code)
    elif has_repeated_blocks(module) or isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # containers: no forward
        for child in module.children():
            _compile_regions(child, options, codes)
    else:
        module.forward = CompiledForward(module, options)


def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Accelerate's `compile_regions`: each repeated block compiled once per class (`compile_model(..., regional=True)`).

    In place, and `module` is returned: its state dict keeps its names (Accelerate's returns a copy whose
    blocks are `OptimizedModule`s, saved as `layers.0._orig_mod.…`). A model without repeated blocks is
    compiled whole.

    >>> model = compile_regions(LlamaForCausalLM(config), mode="reduce-overhead")
    >>> has_compiled_regions(model), "model.layers.0.mlp.up_proj.weight" in model.state_dict()
    (True, True)
    """
    return compile_model(module, regional=True, **compile_kwargs)


def compile_regions_deepspeed(module: nn.Module, **compile_kwargs: Any) -> None:
    """Accelerate's `compile_regions_deepspeed`, for a `DeepSpeedEngine`'s `module`: `compile_regions`, which already
    compiles in place, leaving the engine's hooks on each block outside its graph. Under ZeRO-3 the hooks DeepSpeed
    puts on every submodule run inside the blocks and break their graphs, as under whole-model compilation: the
    results are the same as eager, less of the model is compiled.

    >>> compile_regions_deepspeed(engine.module, backend="inductor")
    """
    compile_regions(module, **compile_kwargs)


def has_compiled_regions(module: nn.Module) -> bool:
    """Whether `module` or a module below it runs through torch.compile (Accelerate's name).

    >>> has_compiled_regions(compile_model(llama, backend="eager", regional=True))
    True
    """
    return any(is_compiled(m) for m in module.modules())


class CompiledForward:
    """`module.forward` through torch.compile; a deep copy or a pickled copy of the module gets its plain forward.

    (A function attribute would be shared by `copy.deepcopy`, and the copy would run the original's
    weights; a compiled function cannot be pickled.)
    """

    def __init__(self, module: nn.Module, options: dict[str, Any], code: types.CodeType | None = None):
        import torch

        forward = module.forward

        def compiled_forward(*args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)

        # a new code object: this module's own compilation cache; `code`: a cache shared with other modules
        compiled_forward.__code__ = self.code = code or compiled_forward.__code__.replace()
        self.fn, self.module, self.options = torch.compile(compiled_forward, **options), weakref.ref(module), options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self.module()))
        return _plain_forward(copy) if copy is not None else self

    def __reduce__(self) -> tuple:
        return _plain_forward, (self.module(),)


def _plain_forward(module: nn.Module) -> Any:
    """The class's forward bound to `module` (what `uncompile` removes again)."""
    return type(module).forward.__get__(module)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside torch.compile's `OptimizedModule` wrappers (whose state dict adds `_orig_mod.`).

    >>> unwrap_compiled(torch.compile(net)) is net
    True
    """
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def uncompile(model: nn.Module) -> nn.Module:
    """The plain module: `OptimizedModule` wrappers removed, an in-place compilation (ours, `nn.Module.compile`)
    dropped, and ours of every module below it (regional compilation's).

    >>> uncompile(compile_model(net, backend="eager")) is net
    True
    """
    model = unwrap_compiled(model)
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, CompiledForward) or (isinstance(forward, types.MethodType) and forward.__self__ is module
                                                    and forward.__func__ is type(module).forward):
            del module.__dict__["forward"]  # ours, or the plain forward a deep copy of ours left
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
    if environ.get(ENV_VARS["regional"]) == "1":
        options["regional"] = True
    try:
        return check_compile_options(options)
    except ValueError as e:
        raise ValueError(f"{e} (set by cadence launch --dynamo_backend / the config's dynamo_config)") from None


# Accelerate's `dynamo_config` keys (also `cadence launch` flags) and the torch.compile option each sets
CONFIG_KEYS = {"dynamo_backend": "backend", "dynamo_mode": "mode", "dynamo_use_fullgraph": "fullgraph",
               "dynamo_use_dynamic": "dynamic", "dynamo_use_regional_compilation": "regional"}


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
    for key in ("dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation"):
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


__all__ = ["compile_model", "compile_regions", "compile_regions_deepspeed", "has_compiled_regions", "uncompile",
           "unwrap_compiled", "is_compiled", "resolve_compile", "options_from_env", "check_compile_options",
           "normalize_dynamo_config", "dynamo_env"]
