"""Fine-tuning data for the tests: chat templates in the two common styles with the special
tokens they use, and a JSONL of synthetic conversations and prompt/completion records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Two templates in the two common styles: header tokens per turn, and ChatML with a default
# system turn that appears only when the conversation has none.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% if not messages or messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<unk>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>")


def conversations(path: Path, n: int, seed: int) -> Path:
    """Conversations and prompt/completion records with answers of up to ~150 bytes, so
    examples are split over 64-token rows and spread over CP ranks."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "mu", "nu"]

    def say(k):
        return " ".join(rng.choice(words, size=int(k)).tolist())

    with open(path, "w") as f:
        for i in range(n):
            if i % 4 == 0:
                record = {"prompt": f"{i} {say(rng.integers(1, 8))}?", "completion": say(rng.integers(1, 25))}
            else:
                turns = [{"role": "system", "content": f"s{i % 7}"}]
                for _ in range(int(rng.integers(1, 3))):
                    turns += [{"role": "user", "content": say(rng.integers(1, 10))},
                              {"role": "assistant", "content": say(rng.integers(1, 25))}]
                record = {"messages": turns}
            f.write(json.dumps(record) + "\n")
    return path
