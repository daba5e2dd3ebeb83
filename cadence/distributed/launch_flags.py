"""`cadence launch`'s flags (Accelerate's names) and the config they make: the YAML config with the flags on top.

Each engine's flags fill its block of the config (`--fsdp_*` the fsdp_config, DeepSpeed's the
deepspeed_config, `--parallelism_config_*` the parallelism_config); `resolve_config` checks the result
before anything starts.

>>> p = argparse.ArgumentParser(); add_launch_args(p)
>>> resolve_config(p.parse_args(["--cpu", "--num_processes", "2", "train.py"])).num_processes
2
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from cadence.compile import CONFIG_KEYS, check_backend
from cadence.distributed import config as cfg_mod
from cadence.distributed import launch_xla
from cadence.distributed.config import Config

# Config keys that are also `cadence launch` flags (besides --cpu for use_cpu).
LAUNCH_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
               "mixed_precision", "gradient_accumulation_steps", "num_cpu_threads_per_process",
               "max_restarts", "monitor_interval", "rdzv_backend", "timeout", "preemption_grace_s", "debug", "gpu_ids")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Add `cadence launch`'s flags and the positional `training_script [args...]` to `parser`.

    >>> p = argparse.ArgumentParser(); add_launch_args(p)
    >>> p.parse_args(["--cpu", "--num_processes", "2", "train.py", "--lr", "1"]).training_script_args
    ['--lr', '1']
    """
    add_launch_options(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run training_script as a module, like `python -m`")
    parser.add_argument("--no_python", action="store_true", help="run training_script as a program, not with python")
    parser.add_argument("training_script", help="the script (or module, or program) to run on every process")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """Add the flags that say how to launch (config file, processes, precision, ...), not what to run.

    >>> p = argparse.ArgumentParser(); add_launch_options(p)
    >>> p.parse_args(["--cpu"]).use_cpu
    True
    """
    parser.add_argument("--config_file", default=None, help="YAML config (default: `cadence config`'s file)")
    parser.add_argument("--cpu", "--use_cpu", dest="use_cpu", action="store_const", const=True, default=None,
                        help="train on CPU even where an accelerator exists")
    parser.add_argument("--multi_gpu", action="store_true", help="DDP over GPUs (accepted for Accelerate users)")
    cfg_mod.add_config_flags(parser, LAUNCH_KEYS)
    parser.add_argument("--rdzv_conf", default="", help="extra rendezvous settings, `key1=v1,key2=v2`")
    add_accelerate_options(parser)
    add_fsdp_options(parser)
    add_dynamo_options(parser)
    add_deepspeed_options(parser)
    add_parallelism_options(parser)
    launch_xla.add_xla_options(parser)


def add_accelerate_options(parser: argparse.ArgumentParser) -> None:
    """`accelerate launch` flags that say how torchrun runs the workers, or that cadence does by default.

    The rest of Accelerate's flags are cadence's own (`--num_processes`, `--use_fsdp`, ...) or refused
    with a reason (`other_launchers`).

    >>> p = argparse.ArgumentParser(); add_accelerate_options(p)
    >>> p.parse_args(["--tee", "3", "--same_network"]).tee
    '3'
    """
    group = parser.add_argument_group("accelerate launch", "Accelerate's flags, for its users")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="accepted: the launcher already shows only the failing rank's traceback, once")
    group.add_argument("--same_network", action="store_true",
                       help="accepted: machines reach machine 0 at --main_process_ip directly (cadence's default)")
    group.add_argument("--main_training_function", default=None,
                       help="with --tpu, each worker imports the script and calls this function (Accelerate's TPU "
                            "launcher); otherwise the script runs as __main__, as accelerate launch does off TPUs")
    group.add_argument("--log_dir", default=None, help="torchrun's log directory (with --tee: the workers' streams)")
    group.add_argument("--tee", default=None, help="torchrun's --tee: copy workers' streams to --log_dir (0-3)")
    group.add_argument("--role", default=None, help="torchrun's worker role name")


# `--fsdp_<key>` flags: Accelerate's names; they fill the config's fsdp_config block (the FSDP strategy accepts the
# keys FSDP2 makes moot, such as use_orig_params, and refuses the others; resolve_config refuses --fsdp_version 1)
FSDP_FLAGS = {"sharding_strategy": str, "auto_wrap_policy": str, "transformer_layer_cls_to_wrap": str,
              "min_num_params": int, "offload_params": bool, "state_dict_type": str,
              "activation_checkpointing": bool, "cpu_ram_efficient_loading": bool, "version": int,
              "reshard_after_forward": str, "backward_prefetch": str, "forward_prefetch": bool,
              "use_orig_params": bool, "sync_module_states": bool, "activation_checkpointing_offload": bool}


def add_fsdp_options(parser: argparse.ArgumentParser) -> None:
    """`--use_fsdp` and the `--fsdp_*` flags (see cadence.distributed.fsdp.FSDP for what each does).

    >>> p = argparse.ArgumentParser(); add_fsdp_options(p)
    >>> p.parse_args(["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"]).fsdp_sharding_strategy
    'SHARD_GRAD_OP'
    """
    group = parser.add_argument_group("FSDP", "shard the model with FSDP2 (Accelerate's flag names)")
    group.add_argument("--use_fsdp", action="store_true", help="train with the FSDP strategy")
    for key, kind in FSDP_FLAGS.items():
        if kind is bool:
            group.add_argument(f"--fsdp_{key}", type=_yes_no, default=None, metavar="true|false")
        else:
            group.add_argument(f"--fsdp_{key}", type=kind, default=None)


def add_dynamo_options(parser: argparse.ArgumentParser) -> None:
    """`--dynamo_backend` and friends (Accelerate's flags): the config's dynamo_config, read by the Learner.

    >>> p = argparse.ArgumentParser(); add_dynamo_options(p)
    >>> p.parse_args(["--dynamo_backend", "aot_eager"]).dynamo_backend
    'aot_eager'
    """
    group = parser.add_argument_group("torch.compile", "compile the model in every worker (Accelerate's flag names)")
    group.add_argument("--dynamo_backend", default=None, help="torch.compile backend: inductor, aot_eager, eager, ... or no")
    group.add_argument("--dynamo_mode", default=None, help="default, reduce-overhead, max-autotune, ...")
    group.add_argument("--dynamo_use_fullgraph", type=_yes_no, default=None, metavar="true|false")
    group.add_argument("--dynamo_use_dynamic", type=_yes_no, default=None, metavar="true|false")
    group.add_argument("--dynamo_use_regional_compilation", type=_yes_no, default=None, metavar="true|false",
                       help="compile each repeated block (a transformer's layers) once, not the whole model")


def _dynamo_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--dynamo_*`: the dynamo_config block."""
    given = {k: getattr(args, k) for k in CONFIG_KEYS if getattr(args, k, None) is not None}
    return {"dynamo_config": {**base.dynamo_config, **given}} if given else {}


def _yes_no(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


# DeepSpeed's flags, Accelerate's names; they fill the config's deepspeed_config block (key = flag name)
DEEPSPEED_FLAGS = {"deepspeed_config_file": str, "zero_stage": int, "offload_optimizer_device": str,
                   "offload_param_device": str, "offload_optimizer_nvme_path": str, "offload_param_nvme_path": str,
                   "gradient_clipping": float, "zero3_init_flag": bool, "zero3_save_16bit_model": bool}


def add_deepspeed_options(parser: argparse.ArgumentParser) -> None:
    """`--use_deepspeed` and DeepSpeed's flags (see cadence.distributed.deepspeed.DeepSpeed for what each does).

    >>> p = argparse.ArgumentParser(); add_deepspeed_options(p)
    >>> p.parse_args(["--use_deepspeed", "--zero_stage", "2"]).zero_stage
    2
    """
    group = parser.add_argument_group("DeepSpeed", "ZeRO stages and offload through DeepSpeed (Accelerate's flag names)")
    group.add_argument("--use_deepspeed", action="store_true", help="train with the DeepSpeed strategy")
    for key, kind in DEEPSPEED_FLAGS.items():
        group.add_argument(f"--{key}", type=_yes_no if kind is bool else kind, default=None,
                           metavar="true|false" if kind is bool else None)


# `--parallelism_config_<key>` flags: Accelerate's names; they fill the config's parallelism_config block
PARALLELISM_FLAGS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size",
                     "pp_size", "pp_microbatches", "pp_schedule")  # the pp keys are cadence's own


def add_parallelism_options(parser: argparse.ArgumentParser) -> None:
    """`--use_parallelism_config` and its sizes (see cadence.distributed.model_parallel.ModelParallel).

    >>> p = argparse.ArgumentParser(); add_parallelism_options(p); p.parse_args(["--parallelism_config_tp_size", "2"])
    Namespace(use_parallelism_config=False, parallelism_config_dp_replicate_size=None, parallelism_config_dp_shard_size=None, parallelism_config_tp_size=2, parallelism_config_cp_size=None, parallelism_config_pp_size=None, parallelism_config_pp_microbatches=None, parallelism_config_pp_schedule=None)
    """
    group = parser.add_argument_group("Model parallel", "tensor and pipeline parallelism inside FSDP2 (Accelerate's "
                                      "flag names; the pp flags are cadence's)")
    group.add_argument("--use_parallelism_config", action="store_true", help="train with the model_parallel strategy")
    for key in PARALLELISM_FLAGS:
        group.add_argument(f"--parallelism_config_{key}", type=str if key == "pp_schedule" else int, default=None)


def _engine_changes(args: argparse.Namespace, base: Config, use: str, distributed_type: str, block: str,
                    flags: dict[str, str]) -> dict:
    """Config changes from `--use_<engine>` and the engine's flags (flag name -> key in the config block)."""
    given = {key: getattr(args, flag) for flag, key in flags.items() if getattr(args, flag, None) is not None}
    if not getattr(args, use, False) and not given:
        return {}
    return {"distributed_type": distributed_type, block: {**getattr(base, block), **given}}


def _fsdp_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--use_fsdp` / `--fsdp_*`: distributed_type FSDP and the fsdp_config block."""
    return _engine_changes(args, base, "use_fsdp", "FSDP", "fsdp_config", {f"fsdp_{k}": f"fsdp_{k}" for k in FSDP_FLAGS})


def _deepspeed_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--use_deepspeed` and DeepSpeed's flags: distributed_type DEEPSPEED and its block."""
    return _engine_changes(args, base, "use_deepspeed", "DEEPSPEED", "deepspeed_config", {k: k for k in DEEPSPEED_FLAGS})


def _parallelism_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--use_parallelism_config` / `--parallelism_config_*`: the parallelism_config block (the
    distributed_type stays the file's or `--use_fsdp`'s)."""
    changes = _engine_changes(args, base, "use_parallelism_config", base.distributed_type, "parallelism_config",
                              {f"parallelism_config_{k}": f"parallelism_config_{k}" for k in PARALLELISM_FLAGS})
    changes.pop("distributed_type", None)
    if changes and not changes["parallelism_config"]:
        changes["parallelism_config"] = {"parallelism_config_tp_size": 1}
    return changes


# Engines a launch can choose, and the pairs that train together: the config's (tensor parallelism inside FSDP2), and
# `--multi_gpu` (Accelerate's flag for several GPUs) with every engine but XLA.
_TOGETHER = cfg_mod.TRAIN_TOGETHER | {frozenset({"GPUs", e}) for e in ("FSDP", "DeepSpeed", "model parallel")}
# The engines whose flags set distributed_type (the parallelism flags add their block to the file's engine)
_TYPED = {"XLA", "FSDP", "DeepSpeed"}


def _chosen_engines(args: argparse.Namespace) -> dict[str, list[str]]:
    """The engines the flags of `args` choose, each with its flags as typed."""
    return {engine: flags for engine, flags in (
        ("XLA", ["--tpu"] if getattr(args, "tpu", False) else []),
        ("GPUs", ["--multi_gpu"] if getattr(args, "multi_gpu", False) else []),
        ("FSDP", _given(args, "use_fsdp", [f"fsdp_{k}" for k in FSDP_FLAGS])),
        ("DeepSpeed", _given(args, "use_deepspeed", list(DEEPSPEED_FLAGS))),
        ("model parallel", _given(args, "use_parallelism_config",
                                  [f"parallelism_config_{k}" for k in PARALLELISM_FLAGS]))) if flags}


def _apart(a: str, b: str) -> bool:
    return cfg_mod.engines_apart(a, b, _TOGETHER)


def refuse_engine_conflicts(args: argparse.Namespace) -> None:
    """ValueError naming the flags when they choose engines that do not train together (`--tpu`, `--use_fsdp` or an
    `--fsdp_*` flag, `--use_deepspeed` or a DeepSpeed flag, `--use_parallelism_config` or a `--parallelism_config_*`
    flag; the last two with FSDP's are 2-D parallelism): the workers run one, and the others' flags would do nothing.

    >>> refuse_engine_conflicts(argparse.Namespace(tpu=True, use_deepspeed=True))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: --tpu (XLA) and --use_deepspeed (DeepSpeed) each choose the engine the workers train with...
    """
    chosen = _chosen_engines(args)
    if any(_apart(a, b) for a in chosen for b in chosen):
        named = [f"{' '.join(flags)} ({engine})" for engine, flags in chosen.items()]
        xla = (" (on XLA, weights are sharded by the xla strategy's own FSDP: learn.distrib_ctx(strategy='xla', "
               "spmd=True, fsdp=True))") if "XLA" in chosen and chosen.keys() - {"XLA", "GPUs"} else ""
        tp = (" (tensor parallelism trains inside FSDP2: --use_fsdp with --parallelism_config_tp_size)"
              if "model parallel" in chosen and "XLA" not in chosen else "")
        raise ValueError(f"{', '.join(named[:-1])} and {named[-1]} each choose the engine the workers train with, and "
                         f"a launch trains with one: keep one engine's flags{xla}{tp}")


def refuse_overriding_the_files_engine(args: argparse.Namespace, base: Config) -> None:
    """ValueError when a flag chooses another engine than the config file's while the file holds settings for its
    own: a non-empty deepspeed_config / fsdp_config / parallelism_config, or distributed_type: XLA (XLA's only
    setting); they would be dropped unsaid. An empty block (`fsdp_config: {}`, as `accelerate config` writes) is no
    setting: `--use_fsdp` replaces a bare `distributed_type: DEEPSPEED`; the parallelism flags, which add to the
    file's engine, do not (tensor parallelism trains inside FSDP2: add --use_fsdp).

    >>> base = Config(distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 2})
    >>> refuse_overriding_the_files_engine(argparse.Namespace(tpu=True, config_file="ds.yaml"), base)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: --tpu (XLA) would replace the engine of the config file ds.yaml (distributed_type: DEEPSPEED, ...
    >>> refuse_overriding_the_files_engine(argparse.Namespace(use_deepspeed=True, config_file="tpu.yaml"),
    ...                                    Config(distributed_type="XLA"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: --use_deepspeed (DeepSpeed) would replace the engine of the config file tpu.yaml (distributed_type: ...
    """
    chosen = _chosen_engines(args)
    typed = bool(chosen.keys() & _TYPED)   # a flag sets distributed_type: a bare FSDP / DEEPSPEED is no setting
    held = {engine: settings for engine, settings in base.engine_settings().items()
            if engine == "XLA" or not typed or set(settings) != {"distributed_type"}}
    for engine, flags in chosen.items():
        for own, settings in held.items():
            if _apart(engine, own):
                path = getattr(args, "config_file", None) or cfg_mod.default_config_path()
                change = "remove that block from the file" if set(settings) - {"distributed_type"} else \
                    "change the file's distributed_type"
                tp = ("; tensor and pipeline parallelism train inside FSDP2: add --use_fsdp"
                      if engine == "model parallel" and set(settings) == {"distributed_type"} and own != "XLA" else "")
                raise ValueError(f"{' '.join(flags)} ({engine}) would replace the engine of the config file {path} "
                                 f"({cfg_mod.describe_settings(settings)}) and leave its settings unused: drop the "
                                 f"flag, or give --config_file a file for {engine} (or {change}){tp}")


def _given(args: argparse.Namespace, use: str, flags: list[str]) -> list[str]:
    """The flags of `args` given among `--<use>` and `--<flags>` (None: not given), as typed."""
    given = [f"--{k}" for k in flags if getattr(args, k, None) is not None]
    return [f"--{use}"] * bool(getattr(args, use, False)) + given


def _deepspeed_options(config: Config) -> tuple[dict, dict]:
    """The deepspeed_config block as DeepSpeed's options, and the DeepSpeed config they make (with its file's)."""
    from cadence.distributed.deepspeed_config import build_config

    options = {k.removeprefix("deepspeed_"): v for k, v in config.deepspeed_config.items()}
    return options, build_config(**options)


def _deepspeed_accumulation(args: argparse.Namespace, config: Config) -> Config:
    """`--gradient_accumulation_steps` replaces DeepSpeed's own number (the block's, its file's), as flags replace
    the file's values (Accelerate's flag is DeepSpeed's); DeepSpeed's "auto" already follows it."""
    from cadence.distributed.deepspeed_config import is_auto

    steps = getattr(args, "gradient_accumulation_steps", None)
    if steps is None or is_auto(_deepspeed_options(config)[1]["gradient_accumulation_steps"]):
        return config
    return dataclasses.replace(config, deepspeed_config={**config.deepspeed_config,
                                                         "gradient_accumulation_steps": steps})


def check_deepspeed_agrees(config: Config) -> None:
    """ValueError when DeepSpeed's own config (the deepspeed_config block, its deepspeed_config_file) contradicts the
    launch's mixed_precision or gradient_accumulation_steps: the workers would fail at their first fit, or train
    otherwise than one of them says. mixed_precision: no (the default) leaves DeepSpeed's dtype to the script.

    >>> check_deepspeed_agrees(Config(distributed_type="DEEPSPEED", gradient_accumulation_steps=4,
    ...                               deepspeed_config={"gradient_accumulation_steps": 2}))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: gradient_accumulation_steps is 4 but DeepSpeed's config (the deepspeed_config block) sets 2: ...
    """
    from cadence.distributed.deepspeed_config import as_flag, is_auto

    options, ds = _deepspeed_options(config)

    def where(key: str) -> str:   # the block's options replace its file's
        file = options.get("config_file")
        return "the deepspeed_config block" if key in options or not file else f"deepspeed_config_file {file}"

    ga, steps = ds["gradient_accumulation_steps"], config.gradient_accumulation_steps
    if steps != 1 and not is_auto(ga) and int(ga) != steps:
        raise ValueError(f"gradient_accumulation_steps is {steps} but DeepSpeed's config "
                         f"({where('gradient_accumulation_steps')}) sets {ga}: set it in one place "
                         f"(`--gradient_accumulation_steps {steps}` replaces DeepSpeed's)")
    precision = config.mixed_precision
    said = {name: as_flag(ds[name]["enabled"]) for name in ("bf16", "fp16")
            if isinstance(ds.get(name), dict) and not is_auto(ds[name].get("enabled", "auto"))}
    other = next((name for name, on in said.items() if on and name != precision), None)
    if precision != "no" and (other or said.get(precision) is False):
        clash = f"enables {other}" if other else f"disables {precision}"
        raise ValueError(f"mixed_precision is {precision} but DeepSpeed's config ({where(other or precision)}) "
                         f"{clash}: set its \"enabled\" to \"auto\" (mixed_precision then decides), or "
                         f"mixed_precision to {other or 'no'}")


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file (`--config_file` or the default one) with the flags in `args` applied on top.

    >>> resolve_config(argparse.Namespace(config_file=None, num_processes=2, use_cpu=True)).num_processes
    2
    """
    refuse_engine_conflicts(args)
    base = cfg_mod.load_config(args.config_file)
    refuse_overriding_the_files_engine(args, base)
    changes = cfg_mod.flag_values(args)
    if getattr(args, "multi_gpu", False) and base.distributed_type == "NO":
        changes["distributed_type"] = "MULTI_GPU"
    changes.update(_fsdp_changes(args, base))
    changes.update(_dynamo_changes(args, base))
    changes.update(_deepspeed_changes(args, base))
    changes.update(_parallelism_changes(args, base))
    changes.update(launch_xla.xla_changes(args))
    try:
        config = Config(**{**base.to_dict(), **changes})
    except ValueError as e:
        raise ValueError(f"cadence launch flags: {e}") from None
    if getattr(args, "fsdp_version", None) not in (None, 2):
        raise ValueError(f"--fsdp_version {args.fsdp_version}: cadence's FSDP strategy is FSDP2 (fully_shard); "
                         f"leave the flag out or pass 2")
    if getattr(args, "main_training_function", None) and config.distributed_type != "XLA":
        print(f"cadence launch: --main_training_function {args.main_training_function} is for Accelerate's TPU "
              f"launcher; the script runs as __main__, as `accelerate launch` does off TPUs", file=sys.stderr)
    config.check_strategy_exists()
    config.check_engine_options()
    if config.strategy == "deepspeed":
        config = _deepspeed_accumulation(args, config)
        check_deepspeed_agrees(config)
    if config.dynamo_config:
        check_backend(config.dynamo_config["dynamo_backend"])
    return config
