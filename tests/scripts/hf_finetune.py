"""Launched on 2 processes by tests/hf/test_hf_engines.py: tiny GPT-2 (tied) and Llama fine-tuned on several engines.

argv: OUT_DIR RUNS_JSON, a list of runs, each with its own distrib_ctx:
    name; model ("gpt2" or "llama"); engine ("ddp", "fsdp", "zero2", "zero3"); precision ("no" or "bf16");
    shard (save_model's max_shard_size); lora (train a peft LoRA adapter);
    checkpoint (also save_state and learn.save inside the context, each loaded into a fresh Learner on that engine);
    init_options (strategy options such as FSDP's cpu_ram_efficient_loading or zero3_init_flag: the model is
        built in the strategy's init_context);
    source ("config": AutoModelForCausalLM.from_config; "pretrained": from_pretrained of the tiny model saved first).
Rank 0 writes OUT_DIR/<name>/: export/ (save_model), logits.pt (the trained model's, after the context) and
result.json (whether lm_head and the input embedding are one Parameter after the context; the same, and the
logits' distance, after loading each checkpoint; the tokens `learn.model.generate` gave inside the context, or its
error, and after it).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import ENGINES, LAYER, lm_learner, logits, tiny_model  # noqa: E402

from cadence import rank  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

from cadence.distributed import get_strategy  # noqa: E402


def tied(model) -> bool:
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def generate(model) -> list | str:
    """Greedy tokens for a fixed prompt, or the error `generate` raised."""
    model.eval()
    try:
        with torch.no_grad():
            return model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False,
                                  pad_token_id=0).tolist()
    except Exception as e:  # noqa: BLE001 - the test reads which engine failed, and how
        return f"{type(e).__name__}: {e}"


def run(out: Path, spec: dict) -> None:
    engine = ENGINES[spec["engine"]](LAYER[spec["model"]])
    init_options = spec.get("init_options")  # the model built in the strategy's init_context
    if init_options:
        engine = {"strategy": get_strategy(engine.pop("strategy"), **init_options, **engine)}
    source = spec.get("source")
    if source == "pretrained":  # the same tiny model, saved by every rank (no rank waits for another's file)
        source = out / f"pretrained-rank{rank()}"
        tiny_model(spec["model"]).save_pretrained(source)
    learn = lm_learner(spec["model"], lora=spec.get("lora", False),
                       init_context=engine["strategy"].init_context() if init_options else None, source=source)
    if spec.get("precision") == "bf16":
        learn.to_bf16()
    with learn.distrib_ctx(**engine):
        learn.fit(1)
        groups = sorted({type(m).__name__ for m in learn.model.modules() if isinstance(m, FSDPModule)} -
                        {type(learn.model).__name__})   # FSDP's groups below the root
        generated = generate(learn.model)  # as a user samples mid-training, on the wrapped model
        learn.save_model(out / "export", max_shard_size=spec.get("shard", "2GB"))
        if spec.get("checkpoint"):
            learn.save_state(out / "state")  # the engine's own format
            learn.save(out / "saved")  # full weights and optimizer state
    result = {"tied": tied(learn.model), "losses": [float(v) for v in learn.recorder.losses], "fsdp_groups": groups,
              "generated": {"inside": generated, "after": generate(learn.model)}}
    trained = logits(learn.model)
    for how in ("load_state", "load") if spec.get("checkpoint") else ():
        fresh = lm_learner(spec["model"], seed=1)
        with fresh.distrib_ctx(**engine):
            getattr(fresh, how)(out / ("state" if how == "load_state" else "saved"))
        result[how] = {"tied": tied(fresh.model), "max_diff": (logits(fresh.model) - trained).abs().max().item()}
    if rank() == 0:
        torch.save(trained, out / "logits.pt")
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    out_dir, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for spec in runs:
        run(out_dir / spec["name"], spec)
    if rank() == 0:
        print("HF RUNS DONE", len(runs))
