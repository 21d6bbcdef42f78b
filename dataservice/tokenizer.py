"""Tokenizers used by the data service: a built-in byte-level one and `tokenizer.json` files.

Both kinds share one small interface (`encode`, `encode_batch`, `decode`, `vocab_size`,
`pad_id`, `bos_id`, `eos_id`, `dtype`, `describe`). `describe()` is what a dataset's
manifest records, and `tokenizer_from_manifest` turns that record back into a tokenizer.

Token arrays use the narrowest dtype that holds the vocabulary: uint16 when
vocab_size <= 65536, else uint32 (the same rule the shard format uses).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Sequence

import numpy as np


class TokenizerError(Exception):
    """A tokenizer could not be loaded or does not fit the data service's needs."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The little-endian dtype that stores ids of a vocabulary of `vocab_size` tokens."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then <pad>, <bos>, <eos>.

    Needs no files and no download, so it is the default of `tessera-data build`.
    """

    kind = "byte"
    vocab_size = 259
    pad_id = 256
    bos_id = 257
    eos_id = 258
    dtype = token_dtype(259)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens added)."""
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Token ids of already UTF-8 encoded text; skips a decode/encode round trip."""
        return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` for many texts at once."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Text of `ids`; special tokens are dropped, broken UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def decode_all(self, ids) -> str:
        """Text of `ids` with the special tokens spelled out (<pad>, <bos>, <eos>): what a row holds."""
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        out, run = [], []
        for i in np.asarray(ids).tolist():
            if i in names:
                out += [bytes(run).decode("utf-8", errors="replace"), names[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + bytes(run).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        """The manifest's record of this tokenizer."""
        return {
            "kind": self.kind,
            "name": "byte",
            "path": None,
            "sha256": None,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }


# Names under which tokenizer.json files commonly carry their special tokens, most usual first.
SPECIAL_TOKEN_NAMES = {
    "pad": ["<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|finetune_right_pad_id|>"],
    "bos": ["<bos>", "<s>", "[BOS]", "<|begin_of_text|>", "<|startoftext|>", "<|im_start|>", "[CLS]"],
    "eos": ["<eos>", "</s>", "[EOS]", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>", "[SEP]"],
}


def _sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _declared_specials(config_path: pathlib.Path) -> dict[str, str]:
    """pad/bos/eos token strings a tokenizer_config.json beside the tokenizer.json names (its
    word beats our guesses by name: a chat model's eos is its end-of-turn token)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    out = {}
    for role in ("pad", "bos", "eos"):
        value = config.get(f"{role}_token") if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            out[role] = value
    return out


class HFTokenizer:
    """A `tokenizer.json` file loaded with the `tokenizers` package.

    pad/bos/eos ids are looked up under the names in `SPECIAL_TOKEN_NAMES`; a file that
    lacks one of them is refused with a message saying which names were tried.
    """

    kind = "hf"

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer  # imported here: the byte tokenizer must not need it

        self.path = pathlib.Path(path).resolve()
        if not self.path.is_file():
            raise TokenizerError(
                f"tokenizer file {str(path)!r} does not exist; give 'byte' or the path of a tokenizer.json"
            )
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load tokenizer {str(self.path)!r}: {e}") from None
        self.sha256 = _sha256_file(self.path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.dtype = token_dtype(self.vocab_size)
        declared = _declared_specials(self.path.parent / "tokenizer_config.json")
        ids = {role: self._find([declared[role], *names] if role in declared else names)
               for role, names in SPECIAL_TOKEN_NAMES.items()}
        if ids["pad"] is None:  # many released tokenizers have none; padding is never a label
            ids["pad"] = ids["eos"]
        missing = [role for role, i in ids.items() if i is None]
        if missing:
            tried = "; ".join(f"{role}: {', '.join(SPECIAL_TOKEN_NAMES[role])}" for role in missing)
            raise TokenizerError(
                f"tokenizer {str(self.path)!r} has no {'/'.join(missing)} special token; "
                f"looked for {tried} — add one of these as a special token"
            )
        self.pad_id, self.bos_id, self.eos_id = ids["pad"], ids["bos"], ids["eos"]

    def _find(self, names: list[str]) -> int | None:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`; the file's post-processor specials are not added."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` for many texts at once (the Rust side works on them in parallel)."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encs]

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=True)

    def decode_all(self, ids) -> str:
        """Text of `ids` with the special tokens (template markers, eos) kept: what a row holds."""
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)

    def describe(self) -> dict:
        """The manifest's record of this tokenizer."""
        return {
            "kind": self.kind,
            "name": self.path.parent.name if self.path.name == "tokenizer.json" else self.path.stem,
            "path": str(self.path),
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` gives the built-in byte tokenizer; anything else is a path to a tokenizer.json
    (or to a folder holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    p = pathlib.Path(spec)
    if p.is_dir():
        p = p / "tokenizer.json"
    return HFTokenizer(p)


def tokenizer_from_manifest(manifest: dict, dataset_dir: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer a dataset was built with.

    For a `tokenizer.json` tokenizer, the copy stored in the dataset folder (`dataset_dir`)
    is preferred over the original path; either must match the recorded sha256.
    """
    rec = manifest.get("tokenizer") or {}
    kind = rec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind != "hf":
        raise TokenizerError(f"manifest names unknown tokenizer kind {kind!r}; expected 'byte' or 'hf'")
    candidates = []
    if dataset_dir is not None:
        candidates.append(pathlib.Path(dataset_dir) / "tokenizer.json")
    if rec.get("path"):
        candidates.append(pathlib.Path(rec["path"]))
    for c in candidates:
        if c.is_file():
            tok = HFTokenizer(c)
            if tok.sha256 != rec.get("sha256"):
                raise TokenizerError(
                    f"tokenizer {str(c)!r} has sha256 {tok.sha256}, but the dataset was built "
                    f"with {rec.get('sha256')}"
                )
            return tok
    raise TokenizerError(
        f"the dataset's tokenizer.json is not found (looked at {', '.join(map(str, candidates)) or 'nothing'})"
    )


def train_tiny_tokenizer(folder: str | os.PathLike, specials: Sequence[str] = ("<pad>", "<bos>", "<eos>", "<unk>"),
                         vocab_size: int = 400, sample: Sequence[str] | None = None) -> pathlib.Path:
    """Train a tiny byte-level BPE in-process and save it as `folder/tokenizer.json`.

    For tests: gives a real `tokenizer.json` without any download. `specials` become the
    first ids (so the defaults give pad 0, bos 1, eos 2). `sample`: the texts to learn merges
    from (default: two short sentences).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    if sample is None:
        sample = ["hello world, naïve 東京 größe", "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(sample, trainer)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path
