"""A Hugging Face model on dict batches: `learn.summary()` runs it as the training loop does (`model(**batch)`), and
under `to_bf16()` `predict` gives fp32 logits computed in bf16 autocast, before a fit as after it, as `get_preds`."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import SEQ, VOCAB, lm_learner, token_data  # noqa: E402


def test_summary_of_a_model_taking_dict_batches():
    learn = lm_learner("gpt2")                  # batches of 8 {"input_ids", "labels"}, n_embd 32
    text = str(learn.summary())
    assert text.startswith(f"GPT2LMHeadModel (input: input_ids: 8 x {SEQ}, labels: 8 x {SEQ})")
    shapes = {line[:line.index(")") + 1]: line for line in text.splitlines() if line.startswith(("Embedding", "Linear"))}
    assert f"8 x {SEQ} x 32 " in shapes["Embedding (transformer.wte)"]
    assert f"8 x {SEQ} x {VOCAB} " in shapes["Linear (lm_head)"]


def autocast_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids[None]).logits[0].float()


def test_predict_under_bf16_gives_fp32_before_and_after_fit():
    learn = lm_learner("gpt2").to_bf16()
    ids = token_data(1, seed=3)[0]["input_ids"]
    for when in ("before fit", "after fit"):
        pred = learn.predict({"input_ids": ids})
        assert pred.dtype == torch.float32 == learn.get_preds()[0].dtype, when
        torch.testing.assert_close(pred, autocast_logits(learn.model, ids), atol=0, rtol=0, msg=when)
        learn.fit(1)
