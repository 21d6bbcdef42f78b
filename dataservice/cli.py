"""`tessera-data`: the data service's command line.

Each subcommand is registered by a small `_add_<name>(sub)` function that adds its parser
and sets `func`, a callable taking the parsed args and returning the exit code. Exit codes:
0 success, 1 a failed verification, 2 misuse (bad arguments, missing input, bad output path),
each misuse reported as one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

from dataservice.build import MAX_SKIPPED, BuildError, build_dataset, summary_line
from dataservice.sft import OVERLONG_MODES
from dataservice.serve_cli import add_health, add_peek, add_serve
from dataservice.show_row import add_show_row
from dataservice.shards import MANIFEST_NAME, DatasetError, load_manifest, verify_dataset


class _Parser(argparse.ArgumentParser):
    """argparse that reports misuse as a single line (no usage block) and exits with 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(prog: str, message: str) -> int:
    # Keep misuse to one line even if the message carries a newline from a library.
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    return 2


# ---- build -----------------------------------------------------------------------------

def _add_build(sub) -> None:
    p = sub.add_parser("build", help="build a sharded token dataset from corpus files",
                       description="Tokenize JSON Lines files, text files and folders into LMDB shards "
                                   "with an index and a checksummed manifest.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="JSON Lines file (.jsonl/.json/.ndjson), text file (one document), or folder")
    p.add_argument("--output", "-o", required=True, metavar="DIR", help="dataset folder to create")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (default, built in) or the path of a tokenizer.json")
    p.add_argument("--text-field", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--chat-template", default="auto", metavar="auto|plain|FILE",
                   help="how prompt/completion and messages records are rendered: 'auto' (default) uses the "
                        "tokenizer folder's chat template if it has one, else the plain template; 'plain'; "
                        "or a jinja template file")
    p.add_argument("--no-loss-mask", action="store_true",
                   help="render fine-tuning records with the template but train on every token (prompts "
                        "and template markers too), as in pretraining; default: loss on the answers only")
    p.add_argument("--max-example-tokens", type=int, default=0, metavar="N",
                   help="fine-tuning examples longer than N tokens (rendered, with eos) are handled as --overlong "
                        "says and counted; set it to the trainer's train.seq_len (default: 0, no limit: packing "
                        "splits a longer example over rows, so an answer may lose its prompt)")
    p.add_argument("--overlong", choices=OVERLONG_MODES, default=None,
                   help="what to do with an example over --max-example-tokens: 'drop' it (default: nothing is "
                        "trained on an answer without its prompt, nothing rewritten), 'split' it into pieces of "
                        "N tokens (later pieces lack the prompt), or 'truncate-prompt' (keep the final answer "
                        "whole, cut the prompt from the left; dropped if the answer alone is longer)")
    p.add_argument("--glob", action="append", default=None, metavar="PATTERN",
                   help="files to take from input folders, relative to each (repeatable; braces such as "
                        "'**/*.{py,md}' expand; default: **/*)")
    p.add_argument("--max-skipped", type=float, default=MAX_SKIPPED, metavar="FRACTION",
                   help=f"fail when more than this share of the records are skipped as problems "
                        f"(default: {MAX_SKIPPED})")
    p.add_argument("--shard-size-mb", type=float, default=256.0,
                   help="upper bound of each shard's data.mdb in MiB (default: 256)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--strict", action="store_true",
                   help="stop with an error at the first invalid/empty/broken document")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line, only the final summary")
    p.set_defaults(func=_run_build)


def _run_build(args) -> int:
    prog = "tessera-data build"
    if args.overlong and not args.max_example_tokens:
        return _fail(prog, f"--overlong {args.overlong} needs --max-example-tokens N (the row length, "
                           "train.seq_len); without it no example is over-long")
    try:
        out = build_dataset(args.inputs, args.output, tokenizer=args.tokenizer, text_field=args.text_field,
                            glob=args.glob or ["**/*"], max_skipped=args.max_skipped,
                            shard_size_mb=args.shard_size_mb, overwrite=args.overwrite,
                            strict=args.strict, progress=not args.quiet, chat_template=args.chat_template,
                            loss_mask=not args.no_loss_mask, max_example_tokens=args.max_example_tokens,
                            overlong=args.overlong or "drop")
    except BuildError as e:
        return _fail(prog, str(e))
    except OSError as e:
        return _fail(prog, f"{e.filename or ''}: {e.strerror or e}")
    manifest = json.loads((out / "manifest.json").read_text())
    sys.stderr.write(summary_line(out, manifest) + "\n")
    return 0


# ---- inspect ---------------------------------------------------------------------------

def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="summarize a dataset and verify its checksums",
                       description="Print a dataset's summary and verify every checksum "
                                   "(exit 1 if verification fails).")
    p.add_argument("dataset", metavar="DIR", help="dataset folder made by `tessera-data build`")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-verify", action="store_true", help="skip reading the files to check checksums")
    p.add_argument("--seq-len", type=int, default=0, metavar="N",
                   help="fine-tuning datasets: count the examples longer than rows of N tokens (split over rows "
                        "when trained on, so an answer may lose its prompt); default: not counted")
    p.set_defaults(func=_run_inspect)


def sft_stats(path: pathlib.Path, manifest: dict, seq_len: int = 0) -> dict | None:
    """What a fine-tuning dataset trains on, from its index and targets (no shard is read):
    examples, their prompt and response (target) tokens, the share of all tokens trained on, and
    with `seq_len` the examples longer than a row. None for a dataset without a loss mask."""
    mask = manifest.get("loss_mask")
    if not mask:
        return None
    lengths = np.load(path / manifest["index"]["file"], mmap_mode="r")["length"].astype(np.int64)
    runs = np.load(path / mask["runs"], mmap_mode="r").astype(np.int64)
    ptr = np.load(path / mask["ptr"], mmap_mode="r").astype(np.int64)
    per_run = runs[:, 1] - runs[:, 0]
    targets = np.add.reduceat(per_run, ptr[:-1]) if per_run.size else np.zeros(lengths.size, np.int64)
    example = targets < lengths  # a pretraining document trains on all of its tokens
    prompt, response = lengths[example] - targets[example], targets[example]
    n = int(example.sum())
    stats = {
        "examples": n, "documents": int(lengths.size - n), "records": manifest.get("records", {}),
        "chat_template": manifest.get("chat_template"),
        "prompt_tokens": int(prompt.sum()), "response_tokens": int(response.sum()),
        "prompt_tokens_mean": round(float(prompt.mean()), 1) if n else 0.0,
        "response_tokens_mean": round(float(response.mean()), 1) if n else 0.0,
        "trained_share": round(float(targets.sum() / max(1, lengths.sum())), 4),
        "seq_len": seq_len or None,
        "overlong_examples": int((lengths[example] > seq_len).sum()) if seq_len else None,
        "longest_example": int(lengths[example].max()) if n else 0,
    }
    build, counts = manifest.get("build", {}), manifest.get("counts", {})
    if build.get("max_example_tokens"):  # what the build did with the examples over its limit
        stats["overlong_at_build"] = {
            "max_example_tokens": build["max_example_tokens"], "mode": build["overlong"],
            **{k: counts.get(f"overlong_{k}", 0) for k in ("dropped", "split", "truncated")}}
    return stats


def _inspect_summary(path: pathlib.Path, manifest: dict, problems: list[str] | None) -> dict:
    c = manifest["counts"]
    return {
        "path": str(path),
        "fingerprint": manifest["fingerprint"],
        "tokenizer": manifest["tokenizer"],
        "token_dtype": manifest["token_dtype"],
        "documents": c.get("documents"),
        "tokens": manifest.get("total_tokens"),
        "duplicates_dropped": c.get("duplicates_dropped", 0),
        "problems_in_input": {k: c.get(k, 0) for k in ("invalid_utf8", "empty", "broken_json", "missing_field")},
        "files": c.get("files"),
        "length_stats": manifest.get("length_stats"),
        "length_histogram": manifest.get("length_histogram", []),
        "shards": manifest["shards"],
        "verified": problems is not None,
        "ok": not problems,
        "verification_problems": problems or [],
    }


def _print_human(s: dict) -> None:
    tok = s["tokenizer"]
    out = sys.stdout.write
    out(f"dataset      {s['path']}\n")
    out(f"fingerprint  {s['fingerprint']}\n")
    out(f"tokenizer    {tok['kind']} {tok.get('name')!s} (vocab {tok['vocab_size']:,}, pad {tok['pad_id']}, "
        f"bos {tok['bos_id']}, eos {tok['eos_id']}; {s['token_dtype']})\n")
    out(f"documents    {s['documents']:,} from {s['files']:,} file(s), {s['duplicates_dropped']:,} duplicates dropped\n")
    ls = s["length_stats"] or {}
    out(f"tokens       {s['tokens']:,} (length min {ls.get('min')}, mean {ls.get('mean')}, max {ls.get('max')})\n")
    out("problems     " + ", ".join(f"{k} {v:,}" for k, v in s["problems_in_input"].items()) + "\n")
    total = sum(sh["bytes"] for sh in s["shards"])
    out(f"shards       {len(s['shards'])} ({total / 1e6:,.1f} MB)\n")
    for sh in s["shards"]:
        out(f"  {sh['name']}  {sh['documents']:>10,} docs  {sh['tokens']:>14,} tokens  "
            f"{sh['bytes'] / 1e6:>9,.1f} MB  {sh['checksum']}\n")
    out("length histogram (tokens incl. eos)\n")
    hist = s["length_histogram"]
    peak = max((h["documents"] for h in hist), default=1)
    for h in hist:
        bar = "#" * max(1, round(40 * h["documents"] / peak))
        out(f"  {h['min']:>9,}-{h['max']:<10,} {h['documents']:>10,}  {bar}\n")
    sft = s.get("sft")
    if sft:
        t = sft["chat_template"] or {}
        used = t.get("kind") if t.get("kind") == "plain" else f"{t.get('source')} (sha256 {str(t.get('sha256'))[:12]})"
        out(f"fine-tuning  {sft['examples']:,} examples ({', '.join(f'{k} {v:,}' for k, v in sft['records'].items())}), "
            f"chat template {used}\n")
        out(f"  prompt     {sft['prompt_tokens']:,} tokens (mean {sft['prompt_tokens_mean']} per example), "
            f"not trained on\n")
        out(f"  response   {sft['response_tokens']:,} tokens (mean {sft['response_tokens_mean']} per example)\n")
        out(f"  trained on {100 * sft['trained_share']:.1f}% of all tokens\n")
        built = sft.get("overlong_at_build")
        if built:
            out(f"  build      examples over {built['max_example_tokens']:,} tokens (--overlong {built['mode']}): "
                f"{built['dropped']:,} dropped, {built['split']:,} split, {built['truncated']:,} prompt-truncated\n")
        if sft["seq_len"]:
            out(f"  over-long  {sft['overlong_examples']:,} examples longer than {sft['seq_len']:,} tokens "
                f"(longest {sft['longest_example']:,})\n")
        else:
            out(f"  over-long  longest example {sft['longest_example']:,} tokens (--seq-len N counts those over N)\n")
    if not s["verified"]:
        out("verify       skipped (--no-verify)\n")
    elif s["ok"]:
        out("verify       OK: every checksum matches\n")
    else:
        out(f"verify       FAILED ({len(s['verification_problems'])} problem(s))\n")
        for p in s["verification_problems"]:
            out(f"  {p}\n")


def _run_inspect(args) -> int:
    prog = "tessera-data inspect"
    path = pathlib.Path(args.dataset)
    if not path.is_dir():
        return _fail(prog, f"dataset folder {str(path)!r} does not exist or is not a folder")
    if not (path / MANIFEST_NAME).is_file():  # not a dataset at all (a build publishes its folder whole)
        return _fail(prog, f"{str(path)!r} is not a dataset: it has no {MANIFEST_NAME}; "
                           "give a folder made by `tessera-data build`")
    try:
        manifest = load_manifest(path)
        problems = None if args.no_verify else verify_dataset(path, manifest)
        summary = _inspect_summary(path, manifest, problems)
        if args.seq_len < 0:
            return _fail(prog, f"--seq-len {args.seq_len} must be >= 1 (or left out)")
        sft = sft_stats(path, manifest, args.seq_len)
        if sft is not None:
            summary["sft"] = sft
    except (DatasetError, KeyError, TypeError) as e:
        # A manifest that does not parse or lacks fields: a dataset that fails verification.
        msg = str(e) if isinstance(e, DatasetError) else f"{path / 'manifest.json'}: malformed ({e!r})"
        if args.json:
            print(json.dumps({"path": str(path), "ok": False, "verification_problems": [msg]}, indent=2))
        else:
            sys.stderr.write(f"{prog}: verification failed: {msg}\n")
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_human(summary)
    if problems:
        if not args.json:
            sys.stderr.write(f"{prog}: verification failed: {problems[0]}\n")
        return 1
    return 0


# ---- serve / peek (implemented in serve_cli.py) ----------------------------------------

def _add_serve(sub) -> None:
    add_serve(sub)


def _add_peek(sub) -> None:
    add_peek(sub)


# ---- entry point -----------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The `tessera-data` parser with every registered subcommand."""
    parser = _Parser(prog="tessera-data", description="Tessera data service: build, inspect and serve datasets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_build(sub)
    _add_inspect(sub)
    _add_serve(sub)
    _add_peek(sub)
    add_health(sub)
    add_show_row(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `tessera-data` with `argv` (default: sys.argv[1:]); returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("tessera-data: interrupted\n")
        return 130
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, as Unix tools do. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
