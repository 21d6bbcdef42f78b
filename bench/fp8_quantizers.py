"""Bandwidth of the FP8 quantisers on the MoE experts' operands, against a plain copy.

Each FP8 expert GEMM quantises its activation or gradient twice per micro-batch: 1x128 along the
rows in the grouped scale layout (forward, dgrad) and transposed per expert group (the K-grouped
wgrad). Those passes read bf16 and write e4m3, so their speed is memory bandwidth; this bench
times them at the DeepSeek-like step's shapes (65536 routed rows, 64 experts with uneven counts;
the 2048-wide input, the 2816-wide gate/up gradient, the 1408-wide SwiGLU output) beside
`Tensor.clone` of the same tensor, the copy's bandwidth being the ceiling. CUDA-graph replays,
interleaved rounds (bench.harness); GB/s counts 2 bytes read and 1 written per element (4 for
the copy).

    python -m bench.fp8_quantizers [--rounds 5] [--iters 20] [--tiny]

--tiny: small shapes on whatever device there is (the PyTorch fallbacks on a CPU: a smoke test).
"""

from __future__ import annotations

import argparse

import torch

from bench.harness import compare, emit, resolve_device
from core.kernels import fp8 as kfp8
from core.kernels import fp8_wgrad as kwgrad

ROWS, EXPERTS, WIDTHS = 65536, 64, (2048, 2816, 1408)
TINY_ROWS, TINY_EXPERTS, TINY_WIDTHS = 512, 4, (256,)


def uneven_offsets(rows: int, experts: int, device: torch.device) -> torch.Tensor:
    """Cumulative ends of a routing whose expert loads vary about 3x between the lightest and heaviest."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(experts, generator=gen) + 0.5
    counts = torch.distributions.Multinomial(rows, probs=weights / weights.sum()).sample().long()
    return torch.cumsum(counts, 0).to(torch.int32).to(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--iters", type=int, default=20, help="calls per round")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    args = parser.parse_args(argv)
    device = resolve_device()
    rows, experts, widths = (TINY_ROWS, TINY_EXPERTS, TINY_WIDTHS) if args.tiny else (ROWS, EXPERTS, WIDTHS)
    torch.manual_seed(0)
    offsets = uneven_offsets(rows, experts, device)
    row_starts, block_starts = kwgrad.group_blocks(offsets, rows)
    blocks = kwgrad.padded_blocks(rows, experts)
    figures = {}
    for width in widths:
        x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
        cases = {
            "clone": lambda: x.clone(),
            "1x128": lambda: kfp8.quantize_1x128(x),
            "1x128 grouped": lambda: kfp8.quantize_1x128(x, offsets),
            "1x128 of the transpose": lambda: kfp8.quantize_1x128_t(x),
            "grouped transpose 1x128": lambda: kwgrad.quantize_grouped_t(x, row_starts, block_starts, blocks, True),
            "grouped transpose 128x128": lambda: kwgrad.quantize_grouped_t(x, row_starts, block_starts, blocks, False),
        }
        times = compare(cases, rounds=args.rounds, iters=args.iters, graph=device.type == "cuda")
        row = {}
        for name, t in times.items():
            moved = x.numel() * (4 if name == "clone" else 3)
            row[name] = {"us": 1e3 * t.ms, "us_min": 1e3 * t.min_ms, "us_max": 1e3 * t.max_ms,
                         "GB/s": moved / (t.ms * 1e6)}
            print(f"{rows}x{width:<5d} {name:26s} {row[name]['us']:9.1f} us  {row[name]['GB/s']:6.0f} GB/s", flush=True)
        figures[f"{rows}x{width}"] = row
    emit("fp8_quantizers", {"experts": experts, "rounds": args.rounds, "iters": args.iters, "shapes": figures})
    return figures


if __name__ == "__main__":
    main()
