"""Time and peak memory of `tessera-convert` on a ~1B Llama-shaped model (Llama 3.2 1B's shape).

The model is built by transformers from a config on the CPU (random weights, bf16) and saved
with `save_pretrained`; nothing is downloaded. Each conversion runs in a fresh process, which
reports its wall time and its peak resident size (VmHWM: anonymous memory plus the mapped
file pages it touched; imports included, about 0.5 GiB). The baseline is a plain copy of the model's safetensors files
in the same run (the I/O floor), so `*_vs_copy` says what the conversion costs beyond moving
the bytes (`import_s`, the interpreter's imports before a conversion, is not in them);
`*_rss_vs_model` is the peak resident size over the model's size in bytes.

    from-hf          HF folder -> Tessera import folder
    to-hf            import folder -> HF folder
    to-hf (DCP)      a trainer checkpoint (core.state.checkpoint.save_checkpoint of the model loaded
                     through checkpoint.init_from) -> HF folder

    python -m bench.convert [--work DIR] [--layers 16] [--shard-size-gb 2] [--keep]

The files were just written, so they are read from the page cache: the figures are the
conversion's own cost, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench.harness import emit
from core.state.checkpoint import save_checkpoint
from core.config import load_config
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.state.pretrained import load_weights
from interop.convert import TensorFiles

ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                max_position_embeddings=131072)

# Peak RSS from /proc/self/status VmHWM: ru_maxrss would carry the parent's peak across fork+exec.
_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
{setup}
ready = time.perf_counter()
{body}
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print(json.dumps({{"s": time.perf_counter() - ready, "import_s": ready - start, "rss_gb": int(hwm.split()[1]) / 2**20}}))
"""


def measured(body: str, setup: str = "") -> dict:
    """Run `setup` then `body` in a fresh interpreter: the body's wall seconds, the setup's (the
    imports), and the process's peak RSS (GiB)."""
    code = _CHILD.format(root=str(ROOT), setup=setup, body=body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_model(folder: Path, layers: int) -> None:
    config = transformers.LlamaConfig(**LLAMA_1B, num_hidden_layers=layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def make_checkpoint(imported: Path, target: Path) -> None:
    """A DCP checkpoint of the imported model as the trainer writes it (one process, bf16 params)."""
    config = load_config(imported / "config.toml")
    with torch.device("meta"):
        model = build_model(config.model, seed=0)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    load_weights(imported, model, None, ParallelMesh.build())
    save_checkpoint(target, 1, model, None, None, ParallelMesh.build(), {"model": config.to_dict()["model"],
                                                                        "init_from": str(imported)})


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="working folder (default: a temporary one); the HF model is reused if there")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16: Llama 3.2 1B)")
    parser.add_argument("--shard-size-gb", type=float, default=2.0, help="most GiB per written safetensors file")
    parser.add_argument("--keep", action="store_true", help="keep the working folder")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="tessera-convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    hf, imported, back, ckpt, back_dcp = (work / n for n in ("hf", "imported", "back", "checkpoint", "back-dcp"))
    try:
        if not (hf / "config.json").is_file():
            make_model(hf, args.layers)
        for folder in (imported, back, ckpt, back_dcp, work / "copy"):
            shutil.rmtree(folder, ignore_errors=True)
        size = folder_bytes(hf)
        shard = ["--shard-size-gb", str(args.shard_size_gb)]
        copy = measured(f"import shutil; shutil.copytree({str(hf)!r}, {str(work / 'copy')!r})")
        shutil.rmtree(work / "copy")
        cli, setup = "assert main({argv!r}) == 0", "from interop.cli import main"
        from_hf = measured(cli.format(argv=["from-hf", str(hf), str(imported), *shard]), setup)
        to_hf = measured(cli.format(argv=["to-hf", str(imported), str(back), *shard]), setup)
        make_checkpoint(imported, ckpt)
        step = ckpt / "step_000001"
        to_hf_dcp = measured(cli.format(argv=["to-hf", str(step), str(back_dcp), *shard]), setup)
        params = sum(int(torch.Size(shape).numel()) for shape, _ in TensorFiles.hf_folder(hf).headers.values())
        figures = {
            "model": f"llama {args.layers} layers, hidden 2048, bf16", "params": params, "model_gb": size / 2**30,
            "cpus": os.cpu_count(), "copy_s": copy["s"], "import_s": from_hf["import_s"],
            "from_hf_s": from_hf["s"], "from_hf_rss_gb": from_hf["rss_gb"],
            "to_hf_s": to_hf["s"], "to_hf_rss_gb": to_hf["rss_gb"],
            "to_hf_dcp_s": to_hf_dcp["s"], "to_hf_dcp_rss_gb": to_hf_dcp["rss_gb"],
            "from_hf_vs_copy": from_hf["s"] / copy["s"], "to_hf_vs_copy": to_hf["s"] / copy["s"],
            "to_hf_dcp_vs_copy": to_hf_dcp["s"] / copy["s"],
            "from_hf_rss_vs_model": from_hf["rss_gb"] * 2**30 / size, "to_hf_rss_vs_model": to_hf["rss_gb"] * 2**30 / size,
            "to_hf_dcp_rss_vs_model": to_hf_dcp["rss_gb"] * 2**30 / size,
            "round_trip_bytes_equal": _same_tensors(hf, back),
            "parent_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }
        emit("convert", figures, device="cpu")
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of two HF folders equal, read one at a time."""
    x, y = TensorFiles.hf_folder(a), TensorFiles.hf_folder(b)
    return set(x.files) == set(y.files) and all(torch.equal(x.read(k), y.read(k)) for k in x.files)


if __name__ == "__main__":
    main()
