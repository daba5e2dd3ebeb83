"""Offline stand-ins for what Accelerate's examples download: built once into a folder, then used unchanged.

The network cannot exist here, so each download an example makes resolves to something local:

- `from_pretrained("bert-base-cased")` / `("HuggingFaceTB/SmolLM-360M")` / `("NousResearch/Hermes-3-Llama-3.1-8B")`:
  tiny models built from a config
  and saved into a Hugging Face hub cache (`hub/models--<org>--<name>/snapshots/<rev>/`, `refs/main`), read
  by the real transformers with `HF_HUB_CACHE=<dir>/hub HF_HUB_OFFLINE=1`. The BERT stand-in is "pretrained"
  here (a few hundred steps on the generated paraphrase task) and saved with its classifier reversed, so
  an example starts far below chance and reaches the accuracy floor only by training.
- `datasets.load_dataset("nyu-mll/glue", "mrpc")`, `("Salesforce/wikitext", ...)`, `("roneneldan/TinyStories")` and `evaluate.load("glue",
  "mrpc")`: the small packages in `site/`, put on PYTHONPATH for the run, reading the generated files in
  `data/` (`CADENCE_EXAMPLES_DATA`).
- cv_example's Oxford pets folder: `pets/<breed>_<n>.jpg`, three colours of noise; `timm.create_model` and
  `torchvision.transforms` come from `site/` too (torchvision cannot be installed on this CPU build).

    python tests/accelerate/examples/standins/build.py /tmp/standins   # prints the environment to run with
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

REVISION = "0" * 40
BERT, SMOLLM, HERMES = "bert-base-cased", "HuggingFaceTB/SmolLM-360M", "NousResearch/Hermes-3-Llama-3.1-8B"
SPLITS = {"train": 640, "validation": 204, "test": 160}   # MRPC-like; 204 does not split evenly into batches
WORDS = [f"{a}{b}" for a in ("Ka", "Lo", "Mi", "Nu", "Pe", "Ro", "Su", "Ta", "Vi", "Zo")
         for b in ("bel", "cor", "dan", "fin", "gor", "lin", "mar", "nor", "pol", "ster")]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sentence(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(6, 10))] + ["."]


def mrpc_pair(rng: random.Random, idx: int) -> dict:
    """A paraphrase keeps the words of sentence1 (two swapped neighbours); a non-paraphrase is a new sentence."""
    first = sentence(rng)
    label = rng.random() < 0.5
    if label:
        second = list(first)
        i = rng.randrange(len(second) - 2)
        second[i], second[i + 1] = second[i + 1], second[i]
    else:
        second = sentence(rng)
    return {"sentence1": " ".join(first), "sentence2": " ".join(second), "label": int(label), "idx": idx}


def write_data(root: Path) -> None:
    rng = random.Random(0)
    glue = root / "data" / "glue_mrpc"
    glue.mkdir(parents=True, exist_ok=True)
    for split, n in SPLITS.items():
        rows = [mrpc_pair(rng, i) for i in range(n)]
        (glue / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    wiki = root / "data" / "wikitext"
    wiki.mkdir(parents=True, exist_ok=True)
    for split, n in {"train": 600, "validation": 60, "test": 60}.items():
        rows = [{"text": "" if i % 5 == 0 else " ".join(sentence(rng) * 2)} for i in range(n)]   # wikitext has blank lines
        (wiki / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stories = root / "data" / "tinystories"
    stories.mkdir(parents=True, exist_ok=True)
    rows = [{"text": " ".join(sentence(rng) * 3)} for _ in range(80)]   # a story retells its sentence
    (stories / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_pets(root: Path) -> None:
    """cv_example's folder: `<breed>_<n>.jpg`; each breed a colour, with noise."""
    from PIL import Image
    pets = root / "pets"
    pets.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(0)
    for breed, colour in {"abyssinian": (200, 60, 60), "beagle": (60, 200, 60), "persian": (60, 60, 200)}.items():
        for n in range(40):
            pixels = np.clip(np.array(colour) + gen.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(pets / f"{breed}_{n}.jpg")


def snapshot(root: Path, repo_id: str) -> Path:
    """The folder `from_pretrained(repo_id)` reads offline: a hub cache entry at revision REVISION."""
    entry = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / "main").write_text(REVISION)
    folder = entry / "snapshots" / REVISION
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def bert_tokenizer():
    from transformers import BertTokenizer
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + ["."])}
    return BertTokenizer(vocab=vocab, do_lower_case=False, model_max_length=64)


def pretrain_bert(tokenizer, steps: int = 600):
    """A tiny BERT taught the paraphrase task, shipped with its classifier reversed (see `reverse_classifier`)."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config)
    rng = random.Random(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(**paraphrase_batch(tokenizer, [mrpc_pair(rng, 0) for _ in range(32)])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return reverse_classifier(model, tokenizer), loss.item()


def paraphrase_batch(tokenizer, rows: list[dict]) -> dict:
    batch = tokenizer([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], padding=True, return_tensors="pt")
    return {**batch, "labels": torch.tensor([r["label"] for r in rows])}


def reverse_classifier(model, tokenizer, margin: float = 2e-5):
    """Point the classifier the wrong way, its logit gap shrunk to `margin`: accuracy starts far below chance.

    An example reaches the accuracy floor only if its optimizer steps really train the model, at the
    examples' own learning rate (2e-5, 100 warm-up steps), on every engine.
    """
    rows = [mrpc_pair(random.Random(2), 0) for _ in range(256)]
    with torch.no_grad():
        gap = model(**paraphrase_batch(tokenizer, rows)).logits.diff(dim=-1).abs().mean()
        model.classifier.weight.mul_(-margin / gap)
        model.classifier.bias.zero_()
    return model


def build_bert(root: Path) -> float:
    tokenizer = bert_tokenizer()
    model, loss = pretrain_bert(tokenizer)
    folder = snapshot(root, BERT)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return loss


def build_llama(root: Path, repo_id: str, **config) -> None:
    """A tiny Llama and a word-level tokenizer over WORDS, saved as the hub snapshot of `repo_id`."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {tok: i for i, tok in enumerate(["<|endoftext|>", "<unk>"] + WORDS + ["."])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                        unk_token="<unk>", model_max_length=64)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         max_position_embeddings=128, bos_token_id=0, eos_token_id=0, **config)
    folder = snapshot(root, repo_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_llamas(root: Path) -> None:
    """SmolLM (tied embeddings, one key/value head) and Hermes-3 (untied, heads that split over 2 tensor-parallel
    ranks: transformers' tp_plan slices heads)."""
    build_llama(root, SMOLLM, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    build_llama(root, HERMES, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def environment(root: Path) -> dict[str, str]:
    """What a run needs: the hub cache offline, the stand-in packages first on the path, the data folder."""
    return {"HF_HOME": str(root / "hf_home"), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "CADENCE_EXAMPLES_DATA": str(root / "data"),
}


def build(root: Path) -> dict[str, str]:
    """Write every stand-in under `root` (skipped when already built there) and return the run environment."""
    root = Path(root)
    torch.set_num_threads(1)
    done = root / "BUILT"
    if not done.exists():
        write_data(root)
        write_pets(root)
        loss = build_bert(root)
        build_llamas(root)
        done.write_text(f"bert pretraining loss {loss:.4f}\n")
    return environment(root)


if __name__ == "__main__":
    env = build(Path(sys.argv[1]))
    print((Path(sys.argv[1]) / "BUILT").read_text().strip())
    print(" ".join(f"{k}={v}" for k, v in env.items()))
