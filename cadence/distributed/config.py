"""The launcher's YAML config: what `cadence config` writes and `cadence launch` reads.

Keys carry Accelerate's names, so a file written by `accelerate config` loads too; the keys
Accelerate writes that cadence has no use for are accepted and ignored, any other key fails.

>>> cfg = load_config()                 # $CADENCE_CONFIG_FILE, else ~/.cache/cadence/default_config.yaml
>>> cfg.num_processes, cfg.mixed_precision
(1, 'no')
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cadence.distributed.env import DEFAULT_TIMEOUT_S

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", "XLA")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")

# Keys `accelerate config` writes (or wrote in older versions) that cadence does not use.
ACCELERATE_ONLY_KEYS = frozenset({
    "gpu_ids", "same_network", "main_training_function", "enable_cpu_affinity", "downcast_bf16",
    "dynamo_config", "dynamo_backend", "fp16", "fp8_config", "tp_config", "megatron_lm_config",
    "ipex_config", "mpirun_config", "parallelism_config", "tpu_name", "tpu_zone", "tpu_use_cluster",
    "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file", "commands",
})
# Values YAML 1.1 reads as booleans when left unquoted (`mixed_precision: no`), and old names.
_ALIASES = {"mixed_precision": {False: "no"}, "distributed_type": {False: "NO", "TPU": "XLA"}}


def _key(help: str, default: Any = None, kind: type | None = None, choices: tuple | None = None,
         minimum: float | None = None, default_factory: Any = None) -> Any:
    """A config field whose metadata (help, kind, choices, minimum) drives validation, flags and questions."""
    meta = dict(help=help, kind=kind or type(default), choices=choices, minimum=minimum)
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
    main_process_port: int | None = _key("port on machine 0 (default: a free one, 29500 multi-machine)", kind=int, minimum=1)
    mixed_precision: str = _key("mixed precision", "no", choices=MIXED_PRECISIONS)
    use_cpu: bool = _key("train on CPU even where an accelerator exists", False)
    gradient_accumulation_steps: int = _key("batches per optimizer step", 1, minimum=1)
    num_cpu_threads_per_process: int | None = _key("threads per process (default: cores // processes)", kind=int, minimum=1)
    max_restarts: int = _key("restarts of the worker group before failing", 0, minimum=0)
    monitor_interval: float = _key("seconds between checks of the workers", 0.1, minimum=0)
    rdzv_backend: str = _key("rendezvous backend", "static", choices=RDZV_BACKENDS)
    timeout: float = _key("seconds a collective may wait before the run fails", DEFAULT_TIMEOUT_S, minimum=1)
    debug: bool = _key("detailed distributed checks and launcher logs", False)
    fsdp_config: dict = _key("FSDP options (passed to the FSDP strategy)", kind=dict, default_factory=dict)
    deepspeed_config: dict = _key("DeepSpeed options (passed to the DeepSpeed strategy)", kind=dict, default_factory=dict)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(f, getattr(self, f.name)))
        if not 0 <= self.machine_rank < self.num_machines:
            raise ValueError(f"machine_rank must be in [0, num_machines={self.num_machines}), got {self.machine_rank}")
        if self.num_processes % self.num_machines:
            raise ValueError(f"num_processes ({self.num_processes}) is the total over all machines: "
                             f"make it a multiple of num_machines ({self.num_machines})")

    @property
    def strategy(self) -> str | None:
        """Strategy name the launched script uses (`CADENCE_STRATEGY`), None for a single process."""
        named = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed", "XLA": "xla"}.get(self.distributed_type)
        return named or ("ddp" if self.num_processes > 1 else None)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in field order, ready for YAML."""
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
    if f.metadata["minimum"] is not None and value < f.metadata["minimum"]:
        raise ValueError(f"{f.name} must be >= {f.metadata['minimum']}, got {value}")
    return value


def config_fields() -> tuple[dataclasses.Field, ...]:
    """The config's fields, each with metadata `help`, `kind`, `choices` and `minimum`."""
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
    """The config keys that `args` (parsed with `add_config_flags`) sets, i.e. those not None."""
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
    if raw.get("fp16") and "mixed_precision" not in raw:          # Accelerate's oldest format
        kept["mixed_precision"] = "fp16"
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
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{file}: not valid YAML ({e})") from None
    return from_dict(raw, source=str(file))


def save(config: Config, path: str | os.PathLike | None = None) -> Path:
    """Write `config` as YAML to `path` (default: `default_config_path()`) and return the path.

    >>> save(Config(num_processes=2, distributed_type="MULTI_CPU"), "/tmp/cfg.yaml")
    PosixPath('/tmp/cfg.yaml')
    """
    file = Path(path).expanduser() if path is not None else default_config_path()
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return file
