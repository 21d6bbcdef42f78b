"""Synthetic fine-tuning inputs for the long-context benchmark, no download: a tokenizer folder
(a byte-level BPE trained here, with a header-style chat template in tokenizer_config.json) and a
JSON Lines file of multi-turn conversations whose answers are long, as in long-context SFT.

    python -m bench.sft_data OUT_DIR [--conversations N] [--seed S]

writes OUT_DIR/tokenizer/{tokenizer.json,tokenizer_config.json} and OUT_DIR/conversations.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dataservice.tokenizer import train_tiny_tokenizer

SPECIALS = ("<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<unk>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def write_tokenizer(folder: Path, sample: list[str], vocab_size: int = 4000) -> Path:
    train_tiny_tokenizer(folder, specials=SPECIALS, vocab_size=vocab_size, sample=sample)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE}))
    return folder


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """Conversations of 1-3 turns, each a long document to read (200-4000 words) and an answer
    of 20-600 words: most tokens are prompt, as in long-context fine-tuning."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=k)) for k in rng.integers(1, 9, size=3000)]
    probs = 1.0 / np.arange(1, len(vocab) + 1)
    probs /= probs.sum()

    def words(k: int) -> str:
        return " ".join(vocab[i] for i in rng.choice(len(vocab), size=int(k), p=probs).tolist())

    with open(path, "w") as f:
        for i in range(n):
            turns = [{"role": "system", "content": f"You answer at length. ({i % 13})"}]
            for _ in range(int(rng.integers(1, 5))):
                turns += [{"role": "user", "content": words(rng.integers(200, 4000)) + "?"},
                          {"role": "assistant", "content": words(rng.integers(20, 600)) + "."}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--conversations", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = write_conversations(out / "conversations.jsonl", args.conversations, args.seed)
    with open(path) as f:
        sample = [json.loads(line)["messages"][1]["content"] for line, _ in zip(f, range(200))]
    write_tokenizer(out / "tokenizer", sample)


if __name__ == "__main__":
    main()
