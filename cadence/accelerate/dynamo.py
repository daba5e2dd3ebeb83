"""Accelerate's `TorchDynamoPlugin` and `DynamoBackend`: the torch.compile settings of `Accelerator(dynamo_plugin=...)`.

The plugin's options go to cadence's in-place compilation (`cadence.compile.compile_model`) of every prepared model,
as `Accelerator(dynamo_backend=...)` does; `accelerator.state.dynamo_plugin` is the plugin in use.
`use_regional_compilation=True` compiles each model's repeated blocks instead (`cadence.utils.compile_regions`).

>>> plugin = TorchDynamoPlugin(backend="aot_eager", mode="default", dynamic=False)
>>> plugin.to_kwargs()
{'backend': 'aot_eager', 'dynamic': False}
>>> Accelerator(dynamo_plugin=plugin).state.dynamo_plugin.backend
<DynamoBackend.AOT_EAGER: 'AOT_EAGER'>
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ..compile import ENV_VARS, check_compile_options
from .enums import _ValueEnum
from .handlers import KwargsHandler

__all__ = ["DynamoBackend", "TorchDynamoPlugin"]

class DynamoBackend(str, _ValueEnum):
    """Accelerate's torch.compile backend names (upper case; a member equals its name: `DynamoBackend.INDUCTOR ==
    "INDUCTOR"`). NO: no compilation. A backend this torch has not registered is refused by the Accelerator.

    >>> DynamoBackend("inductor".upper()), DynamoBackend.NO == "NO"
    (<DynamoBackend.INDUCTOR: 'INDUCTOR'>, True)
    """

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """torch.compile options for prepared models: `backend`, `mode`, `fullgraph`, `dynamic`, `options`, `disable`,
    `use_regional_compilation`.

    As Accelerate's: a field left None takes what the launcher set (`cadence launch --dynamo_backend / --dynamo_mode /
    --dynamo_use_fullgraph / --dynamo_use_dynamic / --dynamo_use_regional_compilation`), else the default (backend
    "no", mode "default", fullgraph False, use_regional_compilation False); `backend` becomes a `DynamoBackend`.
    `use_regional_compilation=True` compiles each block of a model's repeated `nn.ModuleList` (a transformer's
    layers), once per class, instead of the whole model: faster to compile (`cadence.utils.compile_regions`). In
    place either way, so saved weights keep their names; a model without repeated blocks is compiled whole, as
    Accelerate does.

    >>> TorchDynamoPlugin(backend="eager", fullgraph=True).to_kwargs()
    {'backend': 'eager', 'fullgraph': True}
    >>> accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", use_regional_compilation=True))
    """

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self):
        launched = {option: os.environ.get(var) for option, var in ENV_VARS.items()}
        if self.backend is None:
            self.backend = launched["backend"] or "no"
        try:
            self.backend = DynamoBackend(str(self.backend).upper())
        except ValueError:
            raise ValueError(f"TorchDynamoPlugin(backend={self.backend!r}): not a DynamoBackend; use one of "
                             f"{', '.join(b.value.lower() for b in DynamoBackend)}") from None
        if self.mode is None:
            self.mode = launched["mode"] or "default"
        if self.fullgraph is None:
            self.fullgraph = launched["fullgraph"] == "1"
        if self.dynamic is None and launched["dynamic"] is not None:
            self.dynamic = launched["dynamic"] == "1"
        if self.use_regional_compilation is None:
            self.use_regional_compilation = launched["regional"] == "1"
        if not isinstance(self.use_regional_compilation, bool):
            raise ValueError(f"TorchDynamoPlugin(use_regional_compilation={self.use_regional_compilation!r}): give True "
                             f"or False")

    def to_dict(self) -> dict[str, Any]:
        """Every field, the backend as its lower-case name (Accelerate's)."""
        return {**copy.deepcopy(self.__dict__), "backend": self.backend.value.lower()}

    def to_kwargs(self) -> dict[str, Any]:
        """The torch.compile arguments that differ from torch's defaults (the launcher's settings aside); as
        Accelerate's, without `use_regional_compilation` (how torch.compile is applied, not one of its arguments)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        defaults.update(backend="no", mode="default", fullgraph=False)
        return {k: v for k, v in self.to_dict().items() if v != defaults[k] and k != "use_regional_compilation"}


def dynamo_plugin_for(dynamo_backend: Any, dynamo_plugin: TorchDynamoPlugin | None) -> TorchDynamoPlugin:
    """The Accelerator's plugin: `dynamo_plugin`, or one made from `dynamo_backend` (None: the launcher's settings)."""
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one.")
    if dynamo_plugin is None:
        return TorchDynamoPlugin(backend=dynamo_backend)
    if not isinstance(dynamo_plugin, TorchDynamoPlugin):
        raise ValueError(f"dynamo_plugin: takes a TorchDynamoPlugin (or give dynamo_backend=\"inductor\" alone), got "
                         f"{type(dynamo_plugin).__name__}")
    return dynamo_plugin


def compile_options(plugin: TorchDynamoPlugin) -> dict[str, Any] | None:
    """Options for `compile_model` (torch.compile's, and `regional`), checked before anything compiles; None: no
    compilation."""
    if plugin.backend == DynamoBackend.NO:
        return None
    options = {**plugin.to_kwargs(), **({"regional": True} if plugin.use_regional_compilation else {})}
    try:
        return check_compile_options(options)
    except ValueError as e:
        raise ValueError(f"{e} (from {plugin})") from None
