"""`tessera-data build`: turn corpus files into a sharded, checksummed dataset folder.

Inputs are JSON Lines files (`.jsonl`, `.json`, `.ndjson`: one record per line), any other
file as one plain-text document, and folders walked recursively with a glob. A JSON record is
a pretraining document (text in `text_field`) or a fine-tuning example (`prompt`/`completion`
or `messages`, rendered by `dataservice.sft` with the loss on the answers only). A document is
tokenized and gets `eos_id` appended; an example is rendered as its template says. Each is
identified by the xxh3_64 of its stored token bytes (and, for an example, its target runs);
exact duplicates are dropped and counted; all are appended to bounded-size LMDB shards
(format: `dataservice.shards`). A dataset holding any example also gets its target runs
(`targets.npy`, `targets_ptr.npy`); a pretraining document's one run is the whole document.

Problems never crash a build; they are counted in the manifest:
`invalid_utf8` (a text file, or a JSON line, that is not valid UTF-8), `empty` (a document
with no non-whitespace character), `broken_json` (a line that is not JSON), and
`missing_field` (a JSON line that is not an object with a string `text_field`, `prompt` /
`completion` or `messages`), and the examples' own (`dataservice.sft.EXAMPLE_PROBLEMS`). Blank
lines of JSON Lines files are skipped silently. `strict=True` turns the first problem
into a BuildError naming file and line.

The build is transactional: everything is written into `OUTPUT.tmp-<pid>`, synced, and
renamed to OUTPUT at the end, so an interrupted build never leaves a complete-looking
OUTPUT (no manifest.json).

`make_corpus` writes a random JSON Lines corpus for other engineers' tests.
"""

from __future__ import annotations

import array
import ctypes
import datetime
import json
import os
import pathlib
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np
import xxhash

from .progress import Progress
from .sft import (EXAMPLE_PROBLEMS, OVERLONG_MODES, Example, ExampleProblem, ExampleRenderer, NoChatTemplate,
                  find_chat_template, fit_example, kind_of, missing_template)
from .shards import (FORMAT_VERSION, INDEX_DTYPE, INDEX_NAME, MANIFEST_NAME, TARGETS_NAME, TARGETS_PTR_NAME,
                     ShardWriter, dataset_fingerprint, file_checksum, fsync_path, manifest_checksum)
from .tokenizer import load_tokenizer

JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
PROBLEMS = ("invalid_utf8", "empty", "broken_json", "missing_field", *EXAMPLE_PROBLEMS)
BATCH_DOCS = 1024
BATCH_BYTES = 8 << 20
MAX_SKIPPED = 0.5  # a build that skips more of its records than this fails: the input is not what it seems
MAX_SHARD_SIZE_MB = 1 << 20  # 1 TiB: a bound LMDB maps on 64-bit systems


class BuildError(Exception):
    """A build cannot run or was stopped (bad input, refused output, --strict problem)."""


@dataclass
class _Counts:
    documents: int = 0
    duplicates_dropped: int = 0
    invalid_utf8: int = 0
    empty: int = 0
    broken_json: int = 0
    missing_field: int = 0
    no_assistant: int = 0
    unknown_role: int = 0
    empty_completion: int = 0
    bad_example: int = 0
    template_error: int = 0
    overlong_dropped: int = 0  # examples over --max-example-tokens, by what the build did with them
    overlong_split: int = 0
    overlong_truncated: int = 0
    files: int = 0
    first_problems: list = field(default_factory=list)  # a few "file:line: what" examples


def expand_braces(pattern: str, start: int = 0) -> list[str]:
    """Shell-style alternatives, which pathlib's glob does not know: 'a/*.{py,txt}' ->
    ['a/*.py', 'a/*.txt'], nested ones too; a brace pair without a comma stays literal."""
    open_ = pattern.find("{", start)
    if open_ < 0:
        return [pattern]
    depth, commas = 0, []
    for i in range(open_, len(pattern)):
        if pattern[i] == "{":
            depth += 1
        elif pattern[i] == "}":
            depth -= 1
            if depth == 0:
                break
        elif pattern[i] == "," and depth == 1:
            commas.append(i)
    else:
        return [pattern]  # unbalanced: nothing to expand
    close = i
    if not commas:
        return expand_braces(pattern, open_ + 1)
    bounds = [open_, *commas, close]
    head, tail = pattern[:open_], pattern[close + 1:]
    out: list[str] = []
    for a, b in zip(bounds, bounds[1:]):
        for expanded in expand_braces(head + pattern[a + 1:b] + tail, len(head)):
            if expanded not in out:
                out.append(expanded)
    return out


def _input_files(inputs: Sequence[str | os.PathLike], globs: Sequence[str]) -> list[pathlib.Path]:
    """Every input file, in a deterministic order (folders sorted by relative path); a file
    matched by several patterns is taken once."""
    if not inputs:
        raise BuildError("no input given; name JSON Lines files, text files or folders")
    patterns = [p for g in globs for p in expand_braces(g)]
    matched = dict.fromkeys(patterns, 0)
    files: list[pathlib.Path] = []
    folders = 0
    for inp in inputs:
        p = pathlib.Path(inp)
        if p.is_dir():
            folders += 1
            found: set[pathlib.Path] = set()
            for pattern in patterns:
                try:
                    hits = {q for q in p.glob(pattern) if q.is_file()}
                except (ValueError, NotImplementedError) as e:  # '', an absolute pattern, ...
                    raise BuildError(f"--glob {pattern!r} is not a pattern relative to the input folders "
                                     f"(e.g. '**/*.txt'): {e}") from None
                matched[pattern] += len(hits)
                found |= hits
            files.extend(sorted(found))
        elif p.is_file():
            files.append(p)
        else:
            raise BuildError(f"input {str(p)!r} does not exist (expected a file or a folder)")
    shown = ", ".join(repr(g) for g in globs)
    if not files:  # one empty folder among others is fine; nothing at all is a mistake
        raise BuildError(f"no input files: the folder(s) given have no files matching --glob {shown}")
    for pattern, count in matched.items():
        if folders and not count:
            sys.stderr.write(f"tessera-data build: warning: --glob {pattern!r} matched no file in the input folders\n")
    return files


def _problem(counts: _Counts, kind: str, where: str, strict: bool) -> None:
    if strict:
        raise BuildError(f"{where}: {kind.replace('_', ' ')} (--strict stops at the first problem)")
    setattr(counts, kind, getattr(counts, kind) + 1)
    if len(counts.first_problems) < 10:
        counts.first_problems.append(f"{where}: {kind}")


_JSON = json.JSONDecoder()


def _parse_json_line(text: str):
    """json.loads for one line, skipping its per-call set-up in the common case."""
    try:
        obj, end = _JSON.raw_decode(text)
        if end == len(text) or text[end:].isspace():
            return obj
    except ValueError:
        pass
    return json.loads(text)  # exact semantics (leading blanks, error) for the rare rest


_OVERLONG_COUNT = {"drop": "overlong_dropped", "split": "overlong_split", "truncate-prompt": "overlong_truncated"}


def _documents(files: list[pathlib.Path], text_field: str, strict: bool, counts: _Counts,
               renderer: ExampleRenderer, records: dict, overlong: tuple[int, str] = (0, "drop")
               ) -> Iterator[tuple[str, bytes] | Example]:
    """(text, its UTF-8 bytes) of every usable document and the Example(s) of every usable
    fine-tuning record; problems go into `counts`, records of each kind into `records`.
    `overlong`: (most tokens of an example, 0 for no limit; what to do with a longer one)."""
    limit, mode = overlong
    for path in files:
        counts.files += 1
        if path.suffix.lower() in JSONL_SUFFIXES:
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    try:
                        obj = _parse_json_line(line.decode("utf-8"))
                    except UnicodeDecodeError:
                        _problem(counts, "invalid_utf8", f"{path}:{lineno}", strict)
                        continue
                    except ValueError:
                        if line.strip():  # blank lines are not documents, just skipped
                            _problem(counts, "broken_json", f"{path}:{lineno}", strict)
                        continue
                    kind = kind_of(obj, text_field) if isinstance(obj, dict) else None
                    if kind is None:
                        _problem(counts, "missing_field", f"{path}:{lineno} (field {text_field!r})", strict)
                        continue
                    if kind != "text":
                        try:
                            example = renderer.render(obj)
                        except ExampleProblem as p:
                            _problem(counts, p.kind, f"{path}:{lineno}", strict)
                            continue
                        except NoChatTemplate as e:
                            raise BuildError(f"{path}:{lineno} is a fine-tuning record, but {e}") from None
                        records[kind] += 1
                        if limit and example.ids.size > limit:
                            fitted = fit_example(example, limit, mode)
                            done = _OVERLONG_COUNT[mode] if fitted else "overlong_dropped"
                            setattr(counts, done, getattr(counts, done) + 1)
                            yield from fitted
                            continue
                        yield example
                        continue
                    text = obj[text_field]
                    try:
                        raw = text.encode("utf-8")
                    except UnicodeEncodeError:  # JSON escapes can spell lone surrogates
                        _problem(counts, "invalid_utf8", f"{path}:{lineno}", strict)
                        continue
                    if not text or text.isspace():
                        _problem(counts, "empty", f"{path}:{lineno}", strict)
                        continue
                    records["text"] += 1
                    yield text, raw
        else:
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                line = raw.count(b"\n", 0, e.start) + 1
                _problem(counts, "invalid_utf8", f"{path}:{line}", strict)
                continue
            if not text or text.isspace():
                _problem(counts, "empty", f"{path}:1", strict)
                continue
            records["text"] += 1
            yield text, raw


class _SeenHashes:
    """The document hashes stored so far, as a few sorted uint64 arrays whose sizes halve
    (merged like a binary counter): 8 bytes per document and vectorised look-ups, where a
    Python set would take about 100 bytes per document."""

    def __init__(self):
        self.levels: list[np.ndarray] = []

    def first_sight(self, hashes: np.ndarray) -> np.ndarray:
        """Mask of the hashes seen neither before nor earlier in `hashes`; records them."""
        keep = np.zeros(hashes.shape, bool)
        keep[np.unique(hashes, return_index=True)[1]] = True
        for level in self.levels:
            pos = np.minimum(np.searchsorted(level, hashes), level.size - 1)
            keep &= level[pos] != hashes
        new = np.sort(hashes[keep])
        while self.levels and self.levels[-1].size <= new.size:
            new = np.sort(np.concatenate([self.levels.pop(), new]))
        if new.size:
            self.levels.append(new)
        return keep


def _encode_flat(batch: list[tuple[str, bytes]], tok) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of a batch of documents, each followed by eos, in one flat array, and the
    end offset of each document in it."""
    if tok.kind == "byte":  # ids are the bytes: one vectorised scatter, no per-document arrays
        raws = [raw for _, raw in batch]
        lens = np.fromiter(map(len, raws), np.int64, count=len(raws))
        ends = np.cumsum(lens + 1)
        flat = np.empty(int(ends[-1]), tok.dtype)
        is_text = np.ones(flat.shape[0], bool)
        is_text[ends - 1] = False
        flat[is_text] = np.frombuffer(b"".join(raws), np.uint8)
        flat[ends - 1] = tok.eos_id
        return flat, ends
    ids = tok.encode_batch([text for text, _ in batch])
    eos = np.array([tok.eos_id], tok.dtype)
    ends = np.cumsum(np.fromiter((len(a) + 1 for a in ids), np.int64, count=len(ids)))
    return np.concatenate([part for a in ids for part in (a, eos)]), ends


def _encode_items(batch: list, tok) -> tuple[np.ndarray, np.ndarray, list]:
    """`_encode_flat` for a batch that may hold Examples: (flat tokens, end offsets, each item's
    target runs or None for a document)."""
    if not any(isinstance(item, Example) for item in batch):
        flat, ends = _encode_flat(batch, tok)
        return flat, ends, [None] * len(batch)
    eos = np.array([tok.eos_id], tok.dtype)
    parts = [item.ids if isinstance(item, Example) else np.concatenate([tok.encode(item[0]), eos])
             for item in batch]
    ends = np.cumsum(np.fromiter(map(len, parts), np.int64, count=len(parts)))
    runs = [item.target_runs if isinstance(item, Example) else None for item in batch]
    return np.concatenate(parts).astype(tok.dtype, copy=False), ends, runs


class _Targets:
    """Target runs of the kept documents while a build runs; written only if an example was kept."""

    def __init__(self):
        self.counts = array.array("I")  # runs per document; 0: a pretraining document (all targets)
        self.runs = array.array("I")  # [start, end) pairs of the examples, flattened
        self.any_example = False

    def add(self, runs: list) -> None:
        for r in runs:
            if r is None:
                self.counts.append(0)
            else:
                self.any_example = True
                self.counts.append(len(r))
                self.runs.frombytes(np.ascontiguousarray(r, np.uint32).tobytes())

    def write(self, tmp: pathlib.Path, lengths: np.ndarray) -> dict:
        """targets.npy (uint32 [runs, 2]) and targets_ptr.npy (uint64 [documents + 1]); the manifest entry."""
        counts = np.frombuffer(self.counts, np.uint32).astype(np.int64)
        whole = counts == 0
        per_doc = np.where(whole, 1, counts)
        ptr = np.zeros(counts.size + 1, np.uint64)
        np.cumsum(per_doc, out=ptr[1:])
        runs = np.empty((int(ptr[-1]), 2), np.uint32)
        example_rows = np.repeat(~whole, per_doc)
        runs[example_rows] = np.frombuffer(self.runs, np.uint32).reshape(-1, 2)
        runs[~example_rows] = np.stack([np.zeros(int(whole.sum()), np.uint32), lengths[whole].astype(np.uint32)], 1)
        for name, arr in ((TARGETS_NAME, runs), (TARGETS_PTR_NAME, ptr)):
            with open(tmp / name, "wb") as f:
                np.save(f, arr, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
        target_tokens = int((runs[:, 1].astype(np.int64) - runs[:, 0]).sum())
        return {"runs": TARGETS_NAME, "runs_checksum": file_checksum(tmp / TARGETS_NAME),
                "ptr": TARGETS_PTR_NAME, "ptr_checksum": file_checksum(tmp / TARGETS_PTR_NAME),
                "target_tokens": target_tokens}


def _item_bytes(item) -> int:
    return item.ids.nbytes if isinstance(item, Example) else len(item[1])


def _batches(docs: Iterable) -> Iterator[list]:
    batch, size = [], 0
    for d in docs:
        batch.append(d)
        size += _item_bytes(d)
        if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def length_histogram(lengths: np.ndarray) -> list[dict]:
    """Documents per power-of-two length bucket [2^b, 2^(b+1)), non-empty buckets only."""
    if lengths.size == 0:
        return []
    buckets = np.floor(np.log2(np.maximum(lengths, 1).astype(np.float64))).astype(np.int64)
    docs = np.bincount(buckets)
    toks = np.bincount(buckets, weights=lengths.astype(np.float64))
    return [{"min": 1 << b, "max": (1 << (b + 1)) - 1, "documents": int(docs[b]), "tokens": int(toks[b])}
            for b in range(docs.size) if docs[b]]


def _prepare_output(output: pathlib.Path, overwrite: bool) -> pathlib.Path:
    if output.exists() and not output.is_dir():
        raise BuildError(f"output {str(output)!r} exists and is not a folder; choose a folder path")
    if output.exists() and not overwrite:
        raise BuildError(f"output {str(output)!r} already exists; pass --overwrite to replace it")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the parent folder of output {str(output)!r}: {e.strerror}") from None
    tmp = output.parent / f"{output.name}.tmp-{os.getpid()}"
    if tmp.exists():  # left by an earlier build_dataset call of this same process
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
    except OSError as e:
        raise BuildError(f"cannot write next to output {str(output)!r}: {e.strerror}") from None
    return tmp


def _write_file(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _publish(tmp: pathlib.Path, output: pathlib.Path, overwrite: bool) -> None:
    """Rename the finished `tmp` folder to `output`, swapping out an old one if allowed."""
    fsync_path(tmp)
    if output.exists():
        if not overwrite:
            raise BuildError(f"output {str(output)!r} appeared during the build; pass --overwrite to replace it")
        if _exchange(tmp, output):  # readers see the old or the new dataset, never neither
            fsync_path(output.parent)
            shutil.rmtree(tmp)  # now the old dataset
            return
        old = output.parent / f"{output.name}.old-{os.getpid()}"
        os.rename(output, old)
        try:
            os.rename(tmp, output)
        except OSError:
            os.rename(old, output)
            raise
        fsync_path(output.parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, output)
    fsync_path(output.parent)


def build_dataset(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *,
                  tokenizer: str = "byte", text_field: str = "text", glob: str | Sequence[str] = "**/*",
                  shard_size_mb: float = 256, overwrite: bool = False, strict: bool = False,
                  progress: bool = False, max_skipped: float = MAX_SKIPPED,
                  chat_template: str = "auto", loss_mask: bool = True, max_example_tokens: int = 0,
                  overlong: str = "drop") -> pathlib.Path:
    """Build a dataset folder at `output` from `inputs`; returns the output path.

    `tokenizer` is "byte" or a path to a tokenizer.json. `shard_size_mb` bounds each shard's
    data.mdb (fractions allowed, for tests). `progress` draws a progress line on a terminal.
    Raises BuildError on misuse or, with `strict`, on the first input problem, or when more
    than `max_skipped` of the records were skipped as problems (a wrong `text_field` skips them
    all); then no output folder is left behind. `glob`: one pattern or several, with braces.
    `chat_template`: how fine-tuning records are rendered ('auto', 'plain' or a jinja file;
    see `dataservice.sft.find_chat_template`). `loss_mask=False`: fine-tuning examples are rendered
    the same but every token is a target (no mask is stored), as in pretraining.
    `max_example_tokens` (0: no limit): a fine-tuning example longer than this is handled as
    `overlong` says (`dataservice.sft.fit_example`: drop, split or truncate-prompt), and counted.
    """
    t0 = time.perf_counter()
    output = pathlib.Path(output).absolute()
    if not 0 < shard_size_mb <= MAX_SHARD_SIZE_MB:
        raise BuildError(f"--shard-size-mb must be positive and at most {MAX_SHARD_SIZE_MB} (1 TiB), got {shard_size_mb}")
    try:
        tok = load_tokenizer(tokenizer)
    except Exception as e:  # TokenizerError or an OS error: both are the user's input
        raise BuildError(str(e)) from None
    try:
        template = find_chat_template(tokenizer, chat_template)
        renderer = ExampleRenderer(tok, template, missing_template(tokenizer, chat_template, template))
    except (ValueError, OSError) as e:
        raise BuildError(str(e)) from None
    if not 0 <= max_skipped <= 1:
        raise BuildError(f"--max-skipped must be a fraction in [0, 1], got {max_skipped}")
    if max_example_tokens < 0 or overlong not in OVERLONG_MODES:
        raise BuildError(f"--max-example-tokens {max_example_tokens} must be >= 1 (0: no limit) and --overlong "
                         f"{overlong!r} one of {', '.join(OVERLONG_MODES)}")
    globs = [glob] if isinstance(glob, str) else list(glob)
    files = _input_files(inputs, globs)
    tmp = _prepare_output(output, overwrite)
    try:
        manifest = _build_into(tmp, files, tok, renderer, text_field, shard_size_mb, strict, progress, t0, loss_mask,
                               (max_example_tokens, overlong))
        _check_skipped(manifest, max_skipped, text_field)
        manifest["build"].update(inputs=[str(i) for i in inputs], text_field=text_field, glob=globs)
        manifest["manifest_checksum"] = manifest_checksum(manifest)
        _write_file(tmp / MANIFEST_NAME, json.dumps(manifest, indent=2).encode() + b"\n")
        _publish(tmp, output, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _build_into(tmp: pathlib.Path, files: list[pathlib.Path], tok, renderer: ExampleRenderer, text_field: str,
                shard_size_mb: float, strict: bool, show_progress: bool, t0: float, loss_mask: bool = True,
                overlong: tuple[int, str] = (0, "drop")) -> dict:
    """Write shards, index and tokenizer copy into `tmp`; returns the manifest (not yet written)."""
    counts = _Counts()
    writer = ShardWriter(tmp, int(shard_size_mb * (1 << 20)))
    seen = _SeenHashes()
    targets = _Targets()
    records = {"text": 0, "prompt_completion": 0, "messages": 0}
    idx_hash, idx_len = array.array("Q"), array.array("I")
    idx_shard, idx_key = array.array("I"), array.array("Q")
    dtype = tok.dtype
    bar = Progress(enabled=show_progress)
    total_tokens = 0
    try:
        for batch in _batches(_documents(files, text_field, strict, counts, renderer, records, overlong)):
            flat, ends, runs = _encode_items(batch, tok)
            view = memoryview(flat).cast("B")
            starts = np.concatenate(([0], ends[:-1]))
            isz = flat.itemsize
            # An example's identity includes what it trains on: equal tokens, other targets, kept.
            hashes = np.fromiter((xxhash.xxh3_64_intdigest(view[a:b] if r is None else bytes(view[a:b]) + r.tobytes())
                                  for a, b, r in zip((starts * isz).tolist(), (ends * isz).tolist(), runs)),
                                 np.uint64, count=len(ends))
            keep = seen.first_sight(hashes)
            counts.duplicates_dropped += int(keep.size - np.count_nonzero(keep))
            if not keep.any():
                continue
            lens = (ends - starts)[keep]
            targets.add([r for r, k in zip(runs, keep.tolist()) if k])
            shard, key = writer.add_batch(view, starts[keep] * isz, ends[keep] * isz, lens)
            idx_hash.frombytes(hashes[keep].tobytes())
            idx_len.frombytes(lens.astype(np.uint32).tobytes())
            idx_shard.frombytes(shard.astype(np.uint32).tobytes())
            idx_key.frombytes(key.astype(np.uint64).tobytes())
            total_tokens += int(lens.sum())
            bar.update(len(idx_len), total_tokens, writer.bytes_written)
        if not idx_len:
            raise BuildError(f"no documents to store: {counts.files} input file(s) gave only problems "
                             f"or duplicates ({_problem_text(counts)})")
        shards = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.finish()
    counts.documents = len(idx_len)
    index = np.empty(counts.documents, INDEX_DTYPE)
    index["hash"] = np.frombuffer(idx_hash, np.uint64)
    index["length"] = np.frombuffer(idx_len, np.uint32)
    index["shard"] = np.frombuffer(idx_shard, np.uint32)
    index["key"] = np.frombuffer(idx_key, np.uint64)
    with open(tmp / INDEX_NAME, "wb") as f:
        np.save(f, index, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    desc = tok.describe()
    if desc["kind"] == "hf":  # keep the dataset self-contained: readers can decode without the original
        folder = pathlib.Path(desc["path"]).parent
        _write_file(tmp / "tokenizer.json", pathlib.Path(desc["path"]).read_bytes())
        for name in ("tokenizer_config.json", "chat_template.jinja"):  # its special tokens and template
            if (folder / name).is_file():
                _write_file(tmp / name, (folder / name).read_bytes())
    lengths = index["length"]
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": desc,
        "token_dtype": np.dtype(dtype).name,
        "appends_eos": True,
        "counts": {k: v for k, v in vars(counts).items() if k != "first_problems"},
        "total_tokens": int(total_tokens),
        "length_stats": {"min": int(lengths.min()), "max": int(lengths.max()),
                         "mean": round(float(lengths.mean()), 3)},
        "length_histogram": length_histogram(lengths),
        "shards": shards,
        "index": {"file": INDEX_NAME, "dtype": [list(f) for f in INDEX_DTYPE.descr]},
        "index_checksum": file_checksum(tmp / INDEX_NAME),
        "first_problems": counts.first_problems,
        "records": records,
        "chat_template": renderer.describe() if records["prompt_completion"] + records["messages"] else None,
        "build": {"seconds": round(time.perf_counter() - t0, 3), "shard_size_mb": shard_size_mb,
                  "max_example_tokens": overlong[0] or None, "overlong": overlong[1] if overlong[0] else None,
                  "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
    }
    if targets.any_example and loss_mask:
        manifest["loss_mask"] = targets.write(tmp, lengths)
    manifest["fingerprint"] = dataset_fingerprint(manifest)
    return manifest


def _check_skipped(manifest: dict, max_skipped: float, text_field: str) -> None:
    c = manifest["counts"]
    skipped = sum(c.get(k, 0) for k in PROBLEMS)
    records = skipped + c["documents"] + c["duplicates_dropped"]
    if records and skipped / records > max_skipped:
        hint = f" (is --text-field {text_field!r} the field holding the text?)" if c.get("missing_field") else ""
        raise BuildError(f"skipped {skipped:,} of {records:,} records ({', '.join(f'{k}={c.get(k, 0)}' for k in PROBLEMS)})"
                         f"{hint}; more than --max-skipped {max_skipped:g} of the input, so nothing was written")


def _problem_text(counts: _Counts) -> str:
    return ", ".join(f"{k}={getattr(counts, k)}" for k in PROBLEMS)


def summary_line(output: pathlib.Path, manifest: dict) -> str:
    """One line saying what a finished build holds, for the CLI's final report."""
    c = manifest["counts"]
    problems = ", ".join(f"{k}={c.get(k, 0)}" for k in PROBLEMS)
    secs = manifest.get("build", {}).get("seconds", 0) or 1e-9
    mb = sum(s["bytes"] for s in manifest["shards"]) / 1e6
    mask = manifest.get("loss_mask")
    targets = f" ({mask['target_tokens']:,} of them targets)" if mask else ""
    template = manifest.get("chat_template")
    if template:  # which template rendered the fine-tuning records
        targets += "; chat template " + (template["kind"] if template["kind"] == "plain"
                                         else f"{template['source']} (sha256 {template['sha256'][:12]})")
    limit = manifest.get("build", {}).get("max_example_tokens")
    if limit:
        targets += (f"; over {limit:,} tokens (--overlong {manifest['build']['overlong']}): {c.get('overlong_dropped', 0):,} "
                    f"dropped, {c.get('overlong_split', 0):,} split, {c.get('overlong_truncated', 0):,} prompt-truncated")
    return (f"built {output}: {c['documents']:,} documents, {manifest['total_tokens']:,} tokens{targets}, "
            f"{len(manifest['shards'])} shard(s), {mb:,.1f} MB, {c['duplicates_dropped']:,} duplicates dropped, "
            f"problems: {problems}; {c['files']:,} file(s) in {secs:.2f}s "
            f"({c['documents'] / secs:,.0f} docs/s, {manifest['total_tokens'] / secs / 1e6:,.2f} M tokens/s)")


def _corpus_words(rng: np.random.Generator) -> tuple[list[str], np.ndarray]:
    """make_corpus's vocabulary and its word probabilities (drawn from `rng`)."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=k)) for k in rng.integers(1, 10, size=2000)]
    vocab += ["naïve", "東京", "größe", "🙂", "λx", "\\n", "\"quoted\"", "tab\there", "line\nbreak"]
    # Zipf-like word frequencies, as in natural text.
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    return vocab, weights / weights.sum()


def corpus_loss_floor(seed: int = 0) -> float:
    """Cross-entropy in nats per UTF-8 byte of an ideal model of make_corpus(seed=seed)'s text:
    its words are drawn independently, so no model can predict better than the word
    distribution's entropy spread over the bytes of a word and its space (document boundaries
    and memorised repeats of the stream aside). The level a byte-level training run approaches."""
    vocab, probs = _corpus_words(np.random.default_rng(seed))
    merged: dict[str, float] = {}
    for word, p in zip(vocab, probs.tolist()):  # a spelling drawn twice is one outcome
        merged[word] = merged.get(word, 0.0) + p
    p = np.array(list(merged.values()))
    bytes_per_word = sum(q * (len(w.encode("utf-8")) + 1) for w, q in merged.items())
    return float(-(p * np.log(p)).sum() / bytes_per_word)


def make_corpus(tmp_dir: str | os.PathLike, n_docs: int, seed: int = 0, min_len: int = 16,
                max_len: int = 4096) -> pathlib.Path:
    """Write `n_docs` random documents to a JSON Lines file in `tmp_dir` and return its path.

    Lengths (in characters) lie in [min_len, max_len] with a long tail: most documents are
    short, a few are close to `max_len`. Text is words of a small vocabulary with some
    multi-byte UTF-8. The same (n_docs, seed, min_len, max_len) always gives the same file;
    documents are all distinct.
    """
    if n_docs < 1 or not 1 <= min_len <= max_len:
        raise ValueError(f"need n_docs >= 1 and 1 <= min_len <= max_len, got {n_docs}, {min_len}, {max_len}")
    rng = np.random.default_rng(seed)
    vocab, probs = _corpus_words(rng)
    words = rng.choice(len(vocab), size=max(200_000, min(4_000_000, n_docs * max_len // 4)), p=probs)
    stream = " ".join(vocab[i] for i in words.tolist())
    # A mixture in log space: mostly short documents, a broad middle, and a few near
    # max_len (as in web and code corpora, where a small share of long documents holds
    # much of the text).
    kind = rng.choice(3, size=n_docs, p=[0.65, 0.30, 0.05])
    frac = np.where(kind == 0, rng.beta(2.0, 4.0, size=n_docs),
                    np.where(kind == 1, rng.beta(4.0, 2.5, size=n_docs), rng.beta(8.0, 1.0, size=n_docs)))
    lengths = np.round(np.exp(np.log(min_len) + frac * (np.log(max_len) - np.log(min_len)))).astype(np.int64)
    lengths = np.clip(lengths, min_len, max_len)
    starts = rng.integers(0, max(1, len(stream) - max_len), size=n_docs)
    path = pathlib.Path(tmp_dir) / f"corpus-n{n_docs}-s{seed}.jsonl"
    seen: set[str] = set()
    with open(path, "w", encoding="utf-8") as f:
        for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            text = stream[s:s + n]
            if text.isspace() or text.strip() != text or text in seen:
                text = f"d{i} " + text.strip()  # keep every document non-empty and distinct
            seen.add(text)
            f.write(json.dumps({"id": i, "text": text}, ensure_ascii=False) + "\n")
    return path
