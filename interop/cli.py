"""`tessera-convert from-hf HF_DIR OUT_DIR` and `tessera-convert to-hf CHECKPOINT OUT_DIR`.

from-hf: a Hugging Face model folder (config.json + safetensors, one file or an index; Llama,
Qwen3, Qwen3-MoE, Mixtral) -> OUT_DIR with a complete trainer config (config.toml, whose
checkpoint.init_from names OUT_DIR's weights), the weights under Tessera's names, and the
tokenizer files. Train it with `tessera-train --config OUT_DIR/config.toml --set data.dataset=DIR`.

to-hf: a trainer checkpoint (step folder, checkpoints folder or run folder: the newest step; any
layout) or a from-hf folder -> a folder `transformers.AutoModelForCausalLM.from_pretrained`
loads. Exit 0 on success, 2 with one line on stderr for bad input (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
import time

from interop.convert import DTYPES, SHARD_BYTES, ConversionError, from_hf, to_hf


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    a = sub.add_parser("from-hf", help="Hugging Face model folder -> Tessera config + weights")
    a.add_argument("hf_dir", metavar="HF_DIR")
    a.add_argument("out_dir", metavar="OUT_DIR")
    b = sub.add_parser("to-hf", help="Tessera checkpoint (or from-hf folder) -> Hugging Face model folder")
    b.add_argument("source", metavar="CHECKPOINT")
    b.add_argument("out_dir", metavar="OUT_DIR")
    b.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="dtype of the written weights; auto: the imported model's, else the checkpoint's")
    for p in (a, b):
        p.add_argument("--shard-size-gb", type=float, default=SHARD_BYTES / 2**30,
                       help="most GiB per safetensors file (default %(default)s)")
        p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR when it exists and is not empty")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.shard_size_gb > 0:
        print(f"tessera-convert: error: --shard-size-gb {args.shard_size_gb} must be > 0", file=sys.stderr)
        return 2
    shard_bytes = int(args.shard_size_gb * 2**30)
    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"tessera-convert: {line}", flush=True)

    try:
        if args.command == "from-hf":
            out = from_hf(args.hf_dir, args.out_dir, shard_bytes=shard_bytes, overwrite=args.overwrite, log=log)
            log(f"wrote {out} in {time.perf_counter() - start:.1f} s; train with "
                f"tessera-train --config {out}/config.toml --set data.dataset=DIR")
        else:
            out = to_hf(args.source, args.out_dir, dtype=args.dtype, shard_bytes=shard_bytes, overwrite=args.overwrite,
                        log=log)
            log(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    except ConversionError as err:
        print(f"tessera-convert: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
