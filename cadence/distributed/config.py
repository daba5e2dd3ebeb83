"""The launcher's YAML config: what `cadence config` writes and `cadence launch` reads.

Keys carry Accelerate's names, so a file written by `accelerate config` loads too; the keys
Accelerate writes that cadence has no use for are accepted and ignored, any other key fails.

>>> cfg = load_config()       # $CADENCE_CONFIG_FILE, else ~/.cache/cadence/default_config.yaml  # doctest: +SKIP
>>> cfg.num_processes, cfg.mixed_precision                                                   # doctest: +SKIP
(1, 'no')
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence.distributed.env import DEFAULT_TIMEOUT_S

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", "XLA")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")

# Keys `accelerate config` writes (or wrote in older versions) that cadence does not use as such
# (`fp16` and the top-level `dynamo_backend` are translated in `from_dict`).
ACCELERATE_ONLY_KEYS = frozenset({
    "same_network", "enable_cpu_affinity", "downcast_bf16",
    "dynamo_backend", "fp16", "fp8_config", "tp_config", "megatron_lm_config",
    "ipex_config", "mpirun_config", "tpu_name", "tpu_zone", "tpu_use_cluster",
    "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file", "commands",
})
# Values YAML 1.1 reads as booleans when left unquoted (`mixed_precision: no`), and old names.
_ALIASES = {"mixed_precision": {False: "no"}, "distributed_type": {False: "NO", "TPU": "XLA"}}

# The engines a config names (through distributed_type or an engine's block), and the pairs that train together:
# tensor and pipeline parallelism run inside FSDP2 (ModelParallel takes the fsdp_config's options); any other pair
# would leave one engine's settings unused.
TYPE_ENGINES = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed", "XLA": "XLA"}
ENGINE_BLOCKS = {"FSDP": "fsdp_config", "DeepSpeed": "deepspeed_config", "model parallel": "parallelism_config"}
TRAIN_TOGETHER = frozenset({frozenset({"FSDP", "model parallel"})})
_ENGINE_TYPE = {**{engine: name for name, engine in TYPE_ENGINES.items()}, "model parallel": "FSDP"}
_TP_INSIDE_FSDP = "tensor and pipeline parallelism train inside FSDP2"
_XLA_SHARDS = ("on XLA, the xla strategy shards weights with its own FSDP: "
               "learn.distrib_ctx(strategy='xla', spmd=True, fsdp=True)")


def engines_apart(a: str, b: str, together: frozenset = TRAIN_TOGETHER) -> bool:
    """Whether engines `a` and `b` cannot train in one run.

    >>> engines_apart("FSDP", "model parallel"), engines_apart("DeepSpeed", "model parallel")
    (False, True)
    """
    return a != b and frozenset({a, b}) not in together


def describe_settings(settings: dict[str, Any]) -> str:
    """`key: value, ...` as a config file writes them.

    >>> describe_settings({"distributed_type": "XLA"})
    'distributed_type: XLA'
    """
    return ", ".join(f"{key}: {value}" for key, value in settings.items())


def _key(help: str, default: Any = None, kind: type | None = None, choices: tuple | None = None,
         minimum: float | None = None, maximum: float | None = None, default_factory: Any = None) -> Any:
    """A config field whose metadata (help, kind, choices, minimum, maximum) drives validation, flags and questions."""
    meta = dict(help=help, kind=kind or type(default), choices=choices, minimum=minimum, maximum=maximum)
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Config:
    """Launcher settings, with defaults for one process on this machine.

    >>> Config(num_processes=2, distributed_type="MULTI_CPU", use_cpu=True).strategy
    'ddp'
    """

    compute_environment: str = _key("where the job runs", "LOCAL_MACHINE", choices=("LOCAL_MACHINE",))
    distributed_type: str = _key("how processes share the work", "NO", choices=DISTRIBUTED_TYPES)
    num_processes: int = _key("processes in total, over all machines", 1, minimum=1)
    num_machines: int = _key("machines taking part", 1, minimum=1)
    machine_rank: int = _key("rank of this machine (0 is the main one)", 0, minimum=0)
    main_process_ip: str | None = _key("IP address of machine 0 (multi-machine)", kind=str)
    main_process_port: int | None = _key("port on machine 0 (default: a free one, 29500 multi-machine)", kind=int,
                                        minimum=1, maximum=65535)
    mixed_precision: str = _key("mixed precision", "no", choices=MIXED_PRECISIONS)
    use_cpu: bool = _key("train on CPU even where an accelerator exists", False)
    gpu_ids: str = _key("GPUs this machine's processes use: comma-separated ids (CUDA_VISIBLE_DEVICES), or all", "all")
    gradient_accumulation_steps: int = _key("batches per optimizer step", 1, minimum=1)
    num_cpu_threads_per_process: int | None = _key("threads per process (default: cores // processes)", kind=int, minimum=1)
    max_restarts: int = _key("restarts of the worker group before failing", 0, minimum=0)
    monitor_interval: float = _key("seconds between checks of the workers", 0.1, minimum=0)
    rdzv_backend: str = _key("rendezvous backend", "static", choices=RDZV_BACKENDS)
    timeout: float = _key("seconds a collective may wait before the run fails", DEFAULT_TIMEOUT_S, minimum=1)
    preemption_grace_s: float = _key("seconds workers get to checkpoint after SIGTERM/SIGUSR1 before they are killed",
                                     60.0, minimum=0)
    debug: bool = _key("detailed distributed checks and launcher logs", False)
    main_training_function: str | None = _key("on XLA, the function of the script each worker calls (Accelerate's "
                                              "TPU launcher; `accelerate config` writes main); other engines run the "
                                              "script as __main__", kind=str)
    fsdp_config: dict = _key("FSDP options (passed to the FSDP strategy)", kind=dict, default_factory=dict)
    deepspeed_config: dict = _key("DeepSpeed options (passed to the DeepSpeed strategy)", kind=dict, default_factory=dict)
    parallelism_config: dict = _key("tensor-parallel sizes (Accelerate's parallelism_config block: "
                                    "parallelism_config_tp_size, ...); selects the model_parallel strategy",
                                    kind=dict, default_factory=dict)
    dynamo_config: dict = _key("torch.compile settings (Accelerate's dynamo_backend, dynamo_mode, dynamo_use_fullgraph, "
                               "dynamo_use_dynamic, dynamo_use_regional_compilation)", kind=dict, default_factory=dict)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(f, getattr(self, f.name)))
        from cadence.compile import normalize_dynamo_config

        self.dynamo_config = normalize_dynamo_config(self.dynamo_config)
        if not 0 <= self.machine_rank < self.num_machines:
            raise ValueError(f"machine_rank must be in [0, num_machines={self.num_machines}), got {self.machine_rank}")
        if self.gpu_ids != "all" and not all(i.strip().isdigit() for i in self.gpu_ids.split(",")):
            raise ValueError(f"gpu_ids must be all or comma-separated GPU ids such as 0,1; got {self.gpu_ids!r}")
        per_machine = self.num_processes // self.num_machines
        if self.gpu_ids != "all" and not self.use_cpu and len(self.gpu_ids.split(",")) < per_machine:
            raise ValueError(f"gpu_ids {self.gpu_ids} lists {len(self.gpu_ids.split(','))} GPU(s) for {per_machine} "
                             f"processes per machine: list one GPU per process, or use all")
        if self.num_processes % self.num_machines:
            raise ValueError(f"num_processes ({self.num_processes}) is the total over all machines: "
                             f"make it a multiple of num_machines ({self.num_machines})")
        self._refuse_engines_apart()

    def engine_settings(self) -> dict[str, dict[str, Any]]:
        """The engines this config names, each with the keys that name it: distributed_type FSDP, DEEPSPEED or XLA,
        and each engine's block when not empty (`fsdp_config: {}`, as `accelerate config` writes, names none).

        >>> Config(distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 2}).engine_settings()
        {'DeepSpeed': {'distributed_type': 'DEEPSPEED', 'deepspeed_config': {'zero_stage': 2}}}
        """
        named: dict[str, dict[str, Any]] = {}
        if self.distributed_type in TYPE_ENGINES:
            named[TYPE_ENGINES[self.distributed_type]] = {"distributed_type": self.distributed_type}
        for engine, block in ENGINE_BLOCKS.items():
            if getattr(self, block):
                named.setdefault(engine, {})[block] = getattr(self, block)
        return named

    def _refuse_engines_apart(self) -> None:
        """ValueError when the config names two engines that do not train together: one's settings would go unused
        unsaid (a parallelism_config would win over distributed_type: DEEPSPEED)."""
        named = self.engine_settings()
        for a, b in itertools.combinations(named, 2):
            if engines_apart(a, b):
                hints = [_TP_INSIDE_FSDP] * ("model parallel" in (a, b))
                hints += [_XLA_SHARDS] * ("XLA" in (a, b) and bool({a, b} & {"FSDP", "model parallel"}))
                raise ValueError(f"{describe_settings(named[a])} ({a}) and {describe_settings(named[b])} ({b}) each "
                                 f"choose the engine the workers train with, and a run trains with one: to train with "
                                 f"{a}, {self._leave(b, a)}; to train with {b}, {self._leave(a, b)}"
                                 + (f" ({'; '.join(hints)})" if hints else ""))

    def _leave(self, dropped: str, kept: str) -> str:
        """What to change so that only engine `kept` trains: `dropped`'s blocks go, distributed_type names `kept`."""
        steps = [f"remove the {key} block" for key in self.engine_settings()[dropped] if key != "distributed_type"]
        typed = TYPE_ENGINES.get(self.distributed_type)
        if not (typed == kept or (kept == "model parallel" and typed in (None, "FSDP"))):
            steps.insert(0, f"set distributed_type: {_ENGINE_TYPE[kept]}")
        return " and ".join(steps)

    @property
    def strategy(self) -> str | None:
        """Strategy name the launched script uses (`CADENCE_STRATEGY`), None for a single process.

        >>> Config(distributed_type="FSDP", num_processes=4).strategy
        'fsdp'
        """
        if self.parallelism_config:
            return "model_parallel"
        named = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed", "XLA": "xla"}.get(self.distributed_type)
        return named or ("ddp" if self.num_processes > 1 else None)

    def check_strategy_exists(self) -> None:
        """ValueError when no engine implements this config's strategy (asks the strategy registry).

        >>> Config(distributed_type="XLA", num_processes=8).check_strategy_exists()   # "xla" exists: nothing raised
        """
        from cadence.distributed.registry import STRATEGIES

        if self.strategy is not None and self.strategy not in STRATEGIES:
            have = {"MULTI_GPU", "MULTI_CPU"} | {t for t in DISTRIBUTED_TYPES if t.lower() in STRATEGIES}
            raise ValueError(f"distributed_type {self.distributed_type} needs the {self.strategy!r} strategy, which "
                             f"this cadence does not have (strategies: {', '.join(sorted(STRATEGIES))}): set "
                             f"distributed_type to one of {', '.join(sorted(have))}")

    def check_engine_options(self) -> None:
        """ValueError, before any worker starts, when the engine refuses its options (`fsdp_config`, ...).

        >>> Config(distributed_type="FSDP", num_processes=2, fsdp_config={"fsdp_sharding_strategy": 9}).check_engine_options()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: fsdp_config: FSDP sharding_strategy 9 does not exist; ...
        """
        from cadence.distributed.model_parallel import parallelism_sizes
        from cadence.distributed.registry import strategy_class

        if self.strategy is not None:
            strategy_class(self.strategy, parallelism_sizes(self.parallelism_config or {})).check_launcher_config(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in field order, ready for YAML.

        >>> Config().to_dict()["mixed_precision"]
        'no'
        """
        return dataclasses.asdict(self)


def _checked(f: dataclasses.Field, value: Any) -> Any:
    """`value` for field `f`, coerced where harmless (int -> float); ValueError naming the key otherwise."""
    value = _ALIASES.get(f.name, {}).get(value, value) if isinstance(value, (str, bool)) else value
    kind, choices = f.metadata["kind"], f.metadata["choices"]
    if value is None and kind is dict:
        return {}
    if value is None and f.default is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{f.name} must be of type {kind.__name__}, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{f.name} must be a finite number, got {value}")
    if f.metadata["minimum"] is not None and value < f.metadata["minimum"]:
        raise ValueError(f"{f.name} must be >= {f.metadata['minimum']}, got {value}")
    if f.metadata["maximum"] is not None and value > f.metadata["maximum"]:
        raise ValueError(f"{f.name} must be <= {f.metadata['maximum']}, got {value}")
    return value


def config_fields() -> tuple[dataclasses.Field, ...]:
    """The config's fields, each with metadata `help`, `kind`, `choices`, `minimum` and `maximum`.

    >>> config_fields()[0].name, config_fields()[0].metadata["choices"]
    ('compute_environment', ('LOCAL_MACHINE',))
    """
    return dataclasses.fields(Config)


def add_config_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Add one `--<key>` flag per config key (all, or `names`); an absent flag parses as None.

    >>> p = argparse.ArgumentParser(); add_config_flags(p, ("num_processes",))
    >>> p.parse_args(["--num_processes", "2"]).num_processes
    2
    """
    for f in config_fields():
        kind = f.metadata["kind"]
        if (names is not None and f.name not in names) or kind is dict or f.name == "compute_environment":
            continue
        if kind is bool:
            parser.add_argument(f"--{f.name}", action="store_const", const=True, default=None, help=f.metadata["help"])
        else:
            parser.add_argument(f"--{f.name}", type=kind, choices=f.metadata["choices"], default=None,
                                help=f"{f.metadata['help']} (default: {f.default})")


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys that `args` (parsed with `add_config_flags`) sets, i.e. those not None.

    >>> flag_values(argparse.Namespace(num_processes=2, mixed_precision=None))
    {'num_processes': 2}
    """
    return {f.name: getattr(args, f.name) for f in config_fields() if getattr(args, f.name, None) is not None}


def default_config_path() -> Path:
    """Where the config lives: `$CADENCE_CONFIG_FILE`, else `$XDG_CACHE_HOME/cadence/default_config.yaml`.

    >>> default_config_path().name
    'default_config.yaml'
    """
    if os.environ.get("CADENCE_CONFIG_FILE"):
        return Path(os.environ["CADENCE_CONFIG_FILE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "cadence" / "default_config.yaml"


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a mapping (ours or Accelerate's format) into a Config; ValueError names key and source.

    >>> from_dict({"num_processes": 2, "main_training_function": "main"}).num_processes
    2
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a config must be a mapping of keys to values, got {type(raw).__name__}")
    known = {f.name for f in config_fields()}
    for key in raw:
        if key not in known and key not in ACCELERATE_ONLY_KEYS:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{source}: unknown key {key!r}; {hint}allowed keys: {', '.join(sorted(known))}")
    kept = {k: v for k, v in raw.items() if k in known}
    if "gpu_ids" in kept and kept["gpu_ids"] is None:               # Accelerate writes `gpu_ids: null` for "not set"
        del kept["gpu_ids"]
    elif isinstance(kept.get("gpu_ids"), int) and not isinstance(kept["gpu_ids"], bool):   # YAML reads `gpu_ids: 0` as int
        kept["gpu_ids"] = str(kept["gpu_ids"])
    if raw.get("fp16") and "mixed_precision" not in raw:          # Accelerate's oldest format
        kept["mixed_precision"] = "fp16"
    if "dynamo_backend" in raw and "dynamo_config" not in raw:     # Accelerate's format before dynamo_config
        kept["dynamo_config"] = {"dynamo_backend": raw["dynamo_backend"]}
    try:
        return Config(**kept)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Read the config at `path` (default: `default_config_path()`); defaults when no file exists.

    An explicit `path` that does not exist is an error.

    >>> load_config("my_config.yaml").mixed_precision     # doctest: +SKIP
    'bf16'
    """
    file = Path(path).expanduser() if path is not None else default_config_path()
    if not file.is_file():
        if path is not None:
            raise FileNotFoundError(f"config file {file} does not exist: write one with `cadence config --config_file {file}`")
        return Config()
    import yaml  # here, not at import: `import cadence` stays light

    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{file}: not valid YAML ({e})") from None
    return from_dict(raw, source=str(file))


def save(config: Config, path: str | os.PathLike | None = None) -> Path:
    """Write `config` as YAML to `path` (default: `default_config_path()`) and return the path.

    >>> save(Config(num_processes=2, distributed_type="MULTI_CPU"), "/tmp/cfg.yaml")    # doctest: +SKIP
    PosixPath('/tmp/cfg.yaml')
    """
    file = Path(path).expanduser() if path is not None else default_config_path()
    import yaml  # here, not at import: `import cadence` stays light

    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return file


# What `cadence config` asks, in order; keys asked only on several machines come last.
QUESTIONS = ("use_cpu", "num_machines", "num_processes", "distributed_type", "mixed_precision",
             "gradient_accumulation_steps", "timeout")
MULTI_MACHINE_QUESTIONS = ("machine_rank", "main_process_ip", "main_process_port", "rdzv_backend")


def questionnaire(start: Config, given: dict[str, Any], ask: Callable[[str], str] | None = input) -> Config:
    """A Config from `start`, the values `given` (flags), and answers to the remaining questions.

    `ask=None` asks nothing (non-terminal use): the unanswered keys keep `start`'s values. A
    distributed_type left at NO becomes MULTI_CPU/MULTI_GPU when several processes are chosen.

    >>> questionnaire(Config(), {"num_processes": 2, "use_cpu": True}, ask=None).distributed_type
    'MULTI_CPU'
    """
    values = {**start.to_dict(), **given}
    fields = {f.name: f for f in config_fields()}
    for name in QUESTIONS + MULTI_MACHINE_QUESTIONS:
        if ask is None or name in given or (name in MULTI_MACHINE_QUESTIONS and values["num_machines"] == 1):
            continue
        if name == "distributed_type":
            values[name] = _suggested_type(values)
        values[name] = _ask_one(fields[name], values[name], ask)
    if "distributed_type" not in given:
        values["distributed_type"] = _suggested_type(values)
    return Config(**values)


def _suggested_type(values: dict[str, Any]) -> str:
    if values["distributed_type"] != "NO" or values["num_processes"] == 1:
        return values["distributed_type"]
    import torch

    return "MULTI_CPU" if values["use_cpu"] or not torch.cuda.is_available() else "MULTI_GPU"


def _ask_one(f: dataclasses.Field, current: Any, ask: Callable[[str], str]) -> Any:
    """Ask for one key until the answer is valid; an empty answer keeps `current`."""
    choices = f" ({'/'.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
    while True:
        answer = ask(f"{f.metadata['help']}{choices} [{_show(current)}]: ").strip()
        if not answer:
            return current
        try:
            return _checked(f, _parse(f.metadata["kind"], answer))
        except ValueError as e:
            print(f"  {e}")


def _show(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "none"}[value]
    return str(value)


def _parse(kind: type, answer: str) -> Any:
    if kind is bool:
        if answer.lower() not in ("y", "yes", "n", "no", "true", "false"):
            raise ValueError(f"answer yes or no, not {answer!r}")
        return answer.lower() in ("y", "yes", "true")
    try:
        return kind(answer)
    except ValueError:
        raise ValueError(f"expected a value of type {kind.__name__}, got {answer!r}") from None
