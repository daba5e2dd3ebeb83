"""Launched on 2 processes by tests/hf/test_hf_engines.py: tiny GPT-2 (tied) and Llama fine-tuned on several engines.

argv: OUT_DIR RUNS_JSON, a list of runs {"name", "model" ("gpt2"/"llama"), "engine" ("ddp", "fsdp", "zero2", "zero3"),
"precision" ("no"/"bf16"), "shard" (save_model's max_shard_size), "lora" (a peft LoRA adapter), "checkpoint" (also
save_state and learn.save inside the context, each loaded into a fresh Learner on the same engine)}, each with its own distrib_ctx.
Rank 0 writes OUT_DIR/<name>/: export/ (save_model), logits.pt (the trained model's, after the context), result.json
(whether lm_head and the input embedding are one Parameter after the context; the same and the logits' distance
after loading each checkpoint).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import ENGINES, LAYER, lm_learner, logits  # noqa: E402

from cadence import rank  # noqa: E402


def tied(model) -> bool:
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def run(out: Path, spec: dict) -> None:
    learn = lm_learner(spec["model"], lora=spec.get("lora", False))
    if spec.get("precision") == "bf16":
        learn.to_bf16()
    engine = ENGINES[spec["engine"]](LAYER[spec["model"]])
    with learn.distrib_ctx(**engine):
        learn.fit(1)
        learn.save_model(out / "export", max_shard_size=spec.get("shard", "2GB"))
        if spec.get("checkpoint"):
            learn.save_state(out / "state")  # the engine's own format
            learn.save(out / "saved")  # full weights and optimizer state
    result = {"tied": tied(learn.model), "losses": [float(v) for v in learn.recorder.losses]}
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
