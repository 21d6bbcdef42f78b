"""Hugging Face checkpoints in and out: `tessera-convert from-hf`, `checkpoint.init_from`, `to-hf`.

Reference: transformers' own model (CPU, fp32, eager attention) on the same global batch the
data service hands the trainer (read here with a DataClient: same seed, seq_len and rows per
step). Each document piece of a packed row runs through the Hugging Face model on its own with
its own position ids; the token cross-entropies against the batch's labels (-100 ignored) are
summed and divided by the label count: Tessera's logged loss (metrics.jsonl `loss`, the LM
cross-entropy alone, computed before the step's update).

Models: tiny random ones built by transformers (Llama 3 with and without llama3 (+ q, k, v, o
biases) and yarn rope scaling, Qwen3 with a head_dim apart from hidden/heads and tied embeddings, Qwen3-MoE with a
dense first layer, Mixtral, DeepSeek-V3 with and without query compression: interleaved and
halves rotary rows, yarn with mscale, group-limited sigmoid routing with a non-zero correction
bias, a shared expert, a dense first layer), weights drawn at std 0.25 and norm gains around 1, so the loss
is far from uniform and depends on every weight, the rotary, the norms and the routing.

Tolerance: 1e-5 relative (fp32; only reduction orders differ: attention kernels, the
vocabulary split of tp=2, the expert exchange of ep=2).

- step 1 (the imported weights) at 1 process, tp=2 and (MoE) ep=2 (DeepSeek-V3 also pp=2, cp=2) equals transformers' loss
  of the imported model on the first global batch;
- after 2 steps at tp=2 (ep=2 for Mixtral), `to-hf` of the step-2 checkpoint, loaded by
  `AutoModelForCausalLM.from_pretrained` with no missing or unexpected keys, gives step 3's loss
  on the third batch;
- HF -> from-hf -> to-hf is bitwise identical (keys, dtypes, values, config.json);
- a checkpoint of a model that was not imported exports with a config.json made from [model]
  (Llama, Mixtral): transformers' logits equal Tessera's (atol 1e-4, logits of size ~10);
- bad input: unknown architecture, unsupported rope type, sliding window, a truncated weights
  file, a missing tensor or a wrong shape in init_from: exit 2 with one line, nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from core.state.checkpoint import save_checkpoint  # noqa: E402
from core.train.cli import main as train_main  # noqa: E402
from core.config import load_config  # noqa: E402
from core.validation import validate  # noqa: E402
from core.train.data import LocalServer  # noqa: E402
from core.layers import AttentionMeta  # noqa: E402
from core.mesh import ParallelMesh  # noqa: E402
from core.train.model import build_model  # noqa: E402
from dataservice.build import build_dataset, make_corpus  # noqa: E402
from dataservice.client import DataClient  # noqa: E402
from dataservice.tokenizer import train_tiny_tokenizer  # noqa: E402
from interop.cli import main as convert_main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5
SEQ_LEN, ROWS, MICRO = 64, 4, 2
SEED = 1234  # the from-hf config's train.seed
COMMON = dict(vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6)


def _configs() -> dict:
    t = transformers
    return {
        "llama": t.LlamaConfig(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "llama_rope_llama3": t.LlamaConfig(**COMMON, attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "llama_rope_yarn": t.LlamaConfig(**COMMON, max_position_embeddings=64, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
        "qwen3": t.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
        "qwen3_moe": t.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[0]),
        "mixtral": t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        # DeepSeek-V3's shape: compressed queries, interleaved rotary rows, yarn with mscale,
        # 8 experts in 4 groups (best 2 groups, top 4), one shared expert, layer 0 dense.
        "deepseek_v3": t.DeepseekV3Config(**_deepseek(q_lora_rank=16, rope_interleave=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0})),
        # Moonlight's: one query projection, the halves layout, no rope scaling.
        "deepseek_v3_plain": t.DeepseekV3Config(**_deepseek(q_lora_rank=None, rope_interleave=False,
                                                            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    }


def _deepseek(**extra) -> dict:
    return {**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4, "max_position_embeddings": 64,
            "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 16,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            **extra}


MOE = {"qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3_plain"}
DEEPSEEK = {"deepseek_v3", "deepseek_v3_plain"}


def make_hf_model(folder: Path, name: str, dtype=torch.float32) -> Path:
    torch.manual_seed(7)
    config = _configs()[name]
    config.initializer_range = 0.25
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.dim() == 1:  # norm gains
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        for bname, buf in model.named_buffers():  # DeepSeek's correction bias: live, fp32 as in its files
            if bname.endswith("e_score_correction_bias"):
                buf.data = 0.1 * torch.randn(buf.shape, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[:2]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def in_process(main, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """An entry point called in this process (no interpreter start-up): exit code and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as stop:
            code = stop.code
    proc = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{args[:1]} failed ({code}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def convert(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return in_process(convert_main, *args, check=check)


def train_args(config: Path, run_dir: Path, dataset: Path, *extra: str) -> list[str]:
    sets = [f"data.dataset={dataset}", f"train.run_dir={run_dir}", f"train.seq_len={SEQ_LEN}",
            f"train.micro_batch_size={MICRO}", f"train.global_batch_size={ROWS}", "train.max_steps=2", "train.lr=1e-3",
            "train.min_lr=1e-4", "train.warmup_steps=0", "train.plot=false", "train.device=cpu", *extra]
    return ["--config", str(config)] + [a for s in sets for a in ("--set", s)]


def train(config: Path, run_dir: Path, dataset: Path, nproc: int = 1, *extra: str) -> subprocess.CompletedProcess:
    """The real trainer in its own process(es): `python -m core.train.cli` (torchrun for nproc > 1)."""
    args = ["-m", "core.train.cli", *train_args(config, run_dir, dataset, *extra)]
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc)]
    return run(*args)


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hf-data")
    corpus = make_corpus(tmp, n_docs=120, seed=5, min_len=16, max_len=160)
    return build_dataset([corpus], tmp / "shards")  # byte tokenizer: 259 ids < vocab_size 272


@pytest.fixture(scope="module")
def batches(dataset) -> list:
    """The first three global batches (ROWS rows each), as the trainer's data service sends them."""
    server = LocalServer(str(dataset))
    try:
        with DataClient([server.address], seq_len=SEQ_LEN, micro_batch_size=ROWS, seed=SEED, prefetch=1) as client:
            return [next(client) for _ in range(3)]
    finally:
        server.stop()


@torch.no_grad()
def hf_loss(model, batch) -> float:
    """Sum of token cross-entropies over the batch's documents, each run alone, / label count."""
    model.eval()
    tokens, labels, positions = (batch.tokens.reshape(-1).long(), batch.labels.reshape(-1),
                                 batch.position_ids.reshape(-1).long())
    cu = batch.cu_seqlens.tolist()
    total = torch.zeros((), dtype=torch.float64)
    for start, end in zip(cu[:-1], cu[1:]):
        if not (labels[start:end] != -100).any():
            continue
        logits = model(input_ids=tokens[None, start:end], position_ids=positions[None, start:end]).logits[0]
        total += torch.nn.functional.cross_entropy(logits.float(), labels[start:end], ignore_index=-100, reduction="sum")
    return float(total / (labels != -100).sum())


def load_hf(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (HF folder, from-hf folder), converted on first use."""
    root = tmp_path_factory.mktemp("hf-models")
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            hf = make_hf_model(root / f"hf-{name}", name)
            convert("from-hf", str(hf), str(root / f"ts-{name}"))
            cache[name] = hf, root / f"ts-{name}"
        return cache[name]

    return get


def _assert_close(tessera: float, reference: float, what: str) -> None:
    assert abs(tessera - reference) <= RTOL * abs(reference), f"{what}: tessera {tessera!r} vs transformers {reference!r}"


# ------------------------------------------------------------------------------ step 1 == HF
@pytest.mark.parametrize("name", list(_configs()))
def test_first_step_loss_equals_transformers(tmp_path, dataset, batches, imported, name):
    hf, ts = imported(name)
    run_dir = tmp_path / "run"
    train(ts / "config.toml", run_dir, dataset, 1, "train.max_steps=1", "checkpoint.save_at_end=false")
    reference = hf_loss(load_hf(hf), batches[0])
    assert abs(reference - torch.log(torch.tensor(272.0)).item()) > 0.3  # far from a uniform guess
    _assert_close(losses(run_dir)[1], reference, name)


# The rope variants differ from "llama" only in rank-local math: tp=2 of the plain one covers them.
# Every family at tp=2, the MoE families also at ep=2, and pp=2, where the tied head's copy on
# the last stage reads the embedding. Context parallelism shards no weight: its load is the
# single process's.
# DeepSeek-V3 in every layout: multi-head latent attention splits its heads over tp, its
# rotary key over cp's ring, and the correction bias travels with each pipeline stage.
LAYOUTS = [(name, "tp2", ["parallel.tp=2"]) for name in ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")] + \
          [(name, "ep2", ["parallel.ep=2"]) for name in sorted(MOE - {"deepseek_v3_plain"})] + \
          [("qwen3", "pp2", ["parallel.pp=2"]), ("deepseek_v3", "pp2", ["parallel.pp=2"]),
           ("deepseek_v3", "cp2", ["parallel.cp=2"])]


@pytest.mark.slow
@pytest.mark.parametrize("name,layout,sets", LAYOUTS, ids=[f"{name}-{layout}" for name, layout, _ in LAYOUTS])
def test_first_step_loss_equals_transformers_in_parallel(tmp_path, dataset, batches, imported, name, layout, sets):
    hf, ts = imported(name)
    run_dir = tmp_path / "run"
    train(ts / "config.toml", run_dir, dataset, 2, "train.max_steps=1", "checkpoint.save_at_end=false", *sets)
    _assert_close(losses(run_dir)[1], hf_loss(load_hf(hf), batches[0]), f"{name} {layout}")


# --------------------------------------------------------------- trained checkpoint -> HF
# A dense family through tensor parallelism, a MoE family through expert parallelism.
EXPORTS = [("llama_rope_llama3", ["parallel.tp=2"]), ("mixtral", ["parallel.ep=2"]),
           ("deepseek_v3", ["parallel.ep=2", "model.moe.bias_update_rate=0.01"])]


@pytest.mark.slow
@pytest.mark.parametrize("name,sets", EXPORTS, ids=[n for n, _ in EXPORTS])
def test_exported_checkpoint_gives_the_next_steps_loss(tmp_path, dataset, batches, imported, name, sets):
    _, ts = imported(name)
    run_dir = tmp_path / "run"
    train(ts / "config.toml", run_dir, dataset, 2, "train.max_steps=3", "checkpoint.interval=2", *sets)
    out = tmp_path / "exported"
    convert("to-hf", str(run_dir / "checkpoints" / "step_000002"), str(out))
    assert (out / "tokenizer.json").exists() == (ts / "tokenizer.json").exists()
    trained = losses(run_dir)
    _assert_close(trained[3], hf_loss(load_hf(out), batches[2]), f"{name} step 3")
    assert abs(trained[3] - trained[1]) > 1e-3  # the weights did move


# ------------------------------------------------------------------------- bitwise round trip
@pytest.mark.parametrize("name,dtype", [("mixtral", torch.bfloat16), ("qwen3", torch.float32),
                                        ("qwen3_moe", torch.bfloat16), ("llama_rope_yarn", torch.float32),
                                        ("deepseek_v3", torch.bfloat16), ("deepseek_v3_plain", torch.float32)])
def test_round_trip_is_bitwise(tmp_path, name, dtype):
    hf = make_hf_model(tmp_path / "hf", name, dtype)
    convert("from-hf", str(hf), str(tmp_path / "ts"), "--shard-size-gb", "0.00002")  # several shards
    assert len(list((tmp_path / "ts").glob("weights-*.safetensors"))) > 1
    convert("to-hf", str(tmp_path / "ts"), str(tmp_path / "back"))
    before, after = tensors(hf), tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    assert json.loads((hf / "config.json").read_text()) == json.loads((tmp_path / "back" / "config.json").read_text())
    load_hf(tmp_path / "back")


@pytest.mark.slow
def test_tokenizer_files_travel_and_the_data_fits(tmp_path):
    """An imported model's tokenizer builds data its vocabulary covers: the trainer's check passes."""
    hf = make_hf_model(tmp_path / "hf", "llama")
    tokenizer = train_tiny_tokenizer(tmp_path / "tok", vocab_size=200)
    (hf / "tokenizer.json").write_bytes(Path(tokenizer).read_bytes())
    convert("from-hf", str(hf), str(tmp_path / "ts"))
    assert (tmp_path / "ts" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    corpus = make_corpus(tmp_path, n_docs=20, seed=1, min_len=16, max_len=100)
    data = build_dataset([corpus], tmp_path / "data", tokenizer=str(tmp_path / "ts" / "tokenizer.json"))
    config = tmp_path / "ts" / "config.toml"
    assert in_process(train_main, *train_args(config, tmp_path / "run", data), "--print-config").returncode == 0
    tiny = in_process(train_main, *train_args(config, tmp_path / "run", data, "model.vocab_size=100"), check=False)
    assert tiny.returncode == 2 and "model.vocab_size=100 is smaller than the vocabulary" in tiny.stderr
    convert("to-hf", str(tmp_path / "ts"), str(tmp_path / "back"))
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()


# --------------------------------------------------------------------------------- bad input
def _one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _edit_config(hf: Path, **changes) -> None:
    data = json.loads((hf / "config.json").read_text())
    data.update(changes)
    (hf / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("change,needle", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "unknown architecture GPT2LMHeadModel"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "'dynamic'"),
    (dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
          sliding_window=4096), "sliding_window=4096"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_from_hf_refuses_what_it_cannot_represent(tmp_path, imported, change, needle):
    hf, _ = imported("llama")
    copy = tmp_path / "hf"
    copy.mkdir()
    for f in hf.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    _edit_config(copy, **change)
    _one_line_exit_2(convert("from-hf", str(copy), str(tmp_path / "out"), check=False), needle)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_from_hf_refuses_a_truncated_weights_file(tmp_path, imported):
    hf, _ = imported("llama")
    copy = tmp_path / "hf"
    copy.mkdir()
    for f in hf.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    weights = copy / "model.safetensors"
    whole = weights.read_bytes()
    for cut in (len(whole) // 2, 4):  # a download cut short in the data, or in the header
        weights.write_bytes(whole[:cut])
        _one_line_exit_2(convert("from-hf", str(copy), str(tmp_path / "out"), check=False),
                         f"'{weights}' is not a readable safetensors file", "fetch the file again")
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_from_hf_refuses_a_folder_without_the_model(tmp_path):
    _one_line_exit_2(convert("from-hf", str(tmp_path / "nothing"), str(tmp_path / "out"), check=False), "not a folder")
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(convert("from-hf", str(tmp_path / "empty"), str(tmp_path / "out"), check=False), "config.json")
    _one_line_exit_2(convert("to-hf", str(tmp_path / "empty"), str(tmp_path / "out"), check=False), "neither a checkpoint")


def _broken_weights(ts: Path, target: Path, edit) -> Path:
    weights = {}
    for f in sorted(ts.glob("weights-*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            weights.update({k: handle.get_tensor(k) for k in handle.keys()})
    edit(weights)
    target.mkdir()
    save_file(weights, str(target / "weights.safetensors"))
    return target


@pytest.mark.parametrize("edit,needles", [
    (lambda w: w.pop("layers.1.attention.wk.weight"), ["no tensor 'layers.1.attention.wk.weight'", "[16, 32]"]),
    (lambda w: w.update({"layers.0.feed_forward.w2.weight": torch.zeros(32, 40)}),
     ["'layers.0.feed_forward.w2.weight'", "[32, 40]", "[32, 48]"]),
])
def test_init_from_with_a_missing_or_misshapen_tensor_exits_2(tmp_path, dataset, imported, edit, needles):
    _, ts = imported("llama")
    broken = _broken_weights(ts, tmp_path / "broken", edit)
    proc = in_process(train_main, *train_args(ts / "config.toml", tmp_path / "run", dataset,
                                              f"checkpoint.init_from={broken}"), check=False)
    _one_line_exit_2(proc, *needles)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------- a model trained from scratch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("moe", [False, True], ids=["dense-as-llama", "moe-as-mixtral"])
def test_a_run_without_import_exports_a_config_of_its_own(tmp_path, moe):
    """No imported config.json to keep: to-hf writes one from [model] (Llama or Mixtral), and
    transformers' logits on a document equal Tessera's (fp32, atol 1e-4 on logits of size ~10)."""
    sets = ["model.vocab_size=96", "model.dim=32", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=48",
            "model.rope_theta=50000.0"]
    if moe:
        sets += ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_dim=24"]
    config = load_config(None, sets)
    validate(config, 1)
    model = build_model(config.model, seed=3)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if param.dim() == 1 else param * 12)
    save_checkpoint(tmp_path / "ckpt", 1, model, None, None, ParallelMesh.build(), {"model": config.to_dict()["model"]})
    convert("to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf = load_hf(tmp_path / "hf")
    assert type(hf).__name__ == ("MixtralForCausalLM" if moe else "LlamaForCausalLM")
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40)
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 40], dtype=torch.int32), max_seqlen=40, doc_lengths=(40,))
    with torch.no_grad():
        ours = model.eval()(tokens, positions, meta)
        theirs = hf(input_ids=tokens[None], position_ids=positions[None]).logits[0]
    assert ours.abs().max() > 3.0
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-5)
