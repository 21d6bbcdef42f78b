"""Run configuration, the schema: dataclasses with defaults that run, loaded from TOML,
overridden by `--set`.

A TOML file names the sections below (`[model]`, `[model.moe]`, `[parallel]`, `[train]`,
`[data]`, `[checkpoint]`, `[eval]`); the command line overrides single keys with dotted paths
(`--set model.num_layers=4`).

Every key is a typed field (`Literal[...]` for a choice) with a one-line docstring on the line
after it; `field_docs()` reads those back and `reference()` lists every key with its type,
default and doc (`tessera-train --help-config`). This module checks each key on its own:

- `load_config`: each value from TOML or `--set` against its field's type (unknown keys, with
  the closest known one; a string for an int, a float for an int, a choice that does not exist);
- `check_fields`: the types again (configs built in code) and each key's fixed range (`RANGES`).

The rules between keys, and the values derived from them (`parallel.dp`), are
`core.validation`'s. This module imports nothing of the project, so everything can read the
schema. Each failure is a `ConfigError` whose message names the key, the value and what would
be right.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message is meant for the user."""


@dataclass
class MoEConfig:
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model (the other model.moe keys are then unused)."""
    top_k: int = 2
    """Experts each token is routed to, 1..num_experts."""
    ffn_dim: int = 0
    """Hidden size of each routed expert; 0: model.ffn_dim."""
    num_shared_experts: int = 0
    """Always-on experts that every token passes through besides its top_k."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Scores from the gate's logits: softmax over the experts, or a sigmoid per expert (DeepSeek-V3)."""
    normalize_topk: bool = True
    """Rescale each token's top_k combine weights to sum to 1."""
    n_groups: int = 1
    """Group-limited routing: the experts split into this many groups (n_groups divides num_experts)."""
    topk_groups: int = 1
    """Group-limited routing: groups each token may use, 1..n_groups."""
    group_score_experts: int = 0
    """Group-limited routing: a group scores the sum of its best this many experts (DeepSeek-V3: 2); 0: top_k // topk_groups."""
    aux_loss_coeff: float = 0.01
    """Weight of the load-balancing auxiliary loss (>= 0)."""
    aux_loss_per_sequence: bool = False
    """Balance the load per sequence instead of per micro-batch."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss on the gate's logits (>= 0)."""
    bias_update_rate: float = 0.0
    """> 0: auxiliary-loss-free balancing, a per-expert bias moved by this much each step."""
    capacity_factor: float = 0.0
    """Tokens an expert takes, as a multiple of an even share (the rest are dropped); 0: dropless."""
    first_k_dense: int = 0
    """The first this many layers keep a dense feed-forward layer."""
    moe_every: int = 1
    """After those, every moe_every-th layer is an MoE layer (1: all of them)."""
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach other ranks' experts under EP (measured at ep=4: "allgather" faster at top-8, "alltoall" at top-2)."""
    grouped_gemm: Literal["auto", "triton"] = "auto"
    """Expert GEMMs: "auto" (CUTLASS when built, else torch._grouped_mm), "triton" (rows aligned to 128 per expert, Triton kernels)."""
    routed_scaling_factor: float = 1.0
    """Scale of the routed experts' combine weights (DeepSeek-V3: 2.5)."""
    shared_ffn_dim: int = 0
    """Hidden size of the shared experts together; 0: num_shared_experts * the expert ffn_dim."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers that keep a dense feed-forward layer whatever first_k_dense and moe_every say."""


@dataclass
class RopeScalingConfig:
    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    """Rotary frequency scaling: none, linear (positions / factor), llama3 (Llama 3.1) or yarn."""
    factor: float = 1.0
    """Context extension factor: the frequencies are divided by it (llama3 and yarn: the low ones)."""
    original_max_position_embeddings: int = 0
    """llama3 and yarn: the context length the model was pretrained with (> 0)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations over the original context below which a frequency is interpolated fully."""
    beta_slow: float = 1.0
    """yarn: rotations over the original context above which a frequency is kept (extrapolated)."""
    attention_factor: float = 0.0
    """yarn: scale of cos and sin; 0: from factor (0.1*ln(factor)+1, or via mscale and mscale_all_dim)."""
    mscale: float = 0.0
    """yarn with attention_factor 0: with mscale_all_dim, the default factor's numerator weight (DeepSeek)."""
    mscale_all_dim: float = 0.0
    """yarn with attention_factor 0: with mscale, the default factor's denominator weight (DeepSeek)."""
    truncate: bool = True
    """yarn: round the interpolation ramp's ends to whole dimensions (floor and ceil)."""


@dataclass
class ModelConfig:
    vocab_size: int = 512
    """Rows of the embedding and the output head; at least the dataset tokenizer's vocabulary."""
    dim: int = 64
    """Width of the residual stream (the hidden size)."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads; they divide model.dim into heads of an even size."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); they divide model.num_heads."""
    ffn_dim: int = 176
    """Hidden size of the dense SwiGLU feed-forward layers."""
    head_dim: int = 0
    """Size of each attention head (q, k and v); 0: model.dim // model.num_heads."""
    qk_norm: bool = False
    """RMS-normalise each query and key head before the rotary (one gain of head_dim shared by the heads; Qwen3)."""
    attention_bias: bool = False
    """Biases on the attention's q, k, v and output projections."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the RMS norms."""
    tie_embeddings: bool = False
    """One weight shared by the input embedding and the output head."""
    mtp_layers: int = 0
    """Multi-token prediction depths (DeepSeek-V3): each a block after the model predicting one token further; 0: off."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the weights."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """Scaling of the rotary frequencies for long contexts ([model.rope_scaling])."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """The mixture-of-experts layers ([model.moe])."""
    attention: Literal["gqa", "mla"] = "gqa"
    """gqa (grouped-query: num_kv_heads, head_dim) or mla (multi-head latent, DeepSeek-V3: the *_lora_rank, *_head_dim keys)."""
    q_lora_rank: int = 0
    """mla: width of the compressed query latent; 0: one uncompressed query projection (DeepSeek-V2-Lite, Moonlight)."""
    kv_lora_rank: int = 0
    """mla: width of the compressed key/value latent (> 0)."""
    qk_nope_head_dim: int = 0
    """mla: features of each query and key head without rotary positions (> 0)."""
    qk_rope_head_dim: int = 0
    """mla: features of each query head and of the shared key that carry rotary positions (> 0, even)."""
    v_head_dim: int = 0
    """mla: features of each value head (> 0; may differ from the query/key head)."""
    dense_backend: Literal["torch", "te"] = "torch"
    """GEMMs of the blocks' linear layers: torch (F.linear, or Tessera's FP8 kernels) or te (Transformer Engine, GPU only)."""
    te_norm_fusion: bool = True
    """With dense_backend te: the norms inside te.LayerNormLinear (q/k/v) and te.LayerNormMLP (dense FFN) where the block allows."""

    @property
    def attention_head_dim(self) -> int:
        """The query/key head size in use: gqa: model.head_dim, or model.dim // model.num_heads when it
        is 0; mla: qk_nope_head_dim + qk_rope_head_dim."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.dim // self.num_heads

    @property
    def value_head_dim(self) -> int:
        """The value (and attention output) head size: mla's v_head_dim, else the query/key head size."""
        return self.v_head_dim if self.attention == "mla" else self.attention_head_dim

    @property
    def rope_head_dim(self) -> int:
        """Features of a head that carry rotary positions: mla's qk_rope_head_dim, else the whole head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.attention_head_dim


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: heads, feed-forward and vocabulary split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel stages."""
    cp: int = 1
    """Context-parallel size: each document's tokens split over this many ranks (ring attention)."""
    ep: int = 1
    """Expert-parallel size: each MoE layer's experts split over this many of the dp*cp ranks."""
    etp: int = 1
    """Expert tensor parallelism: 1 (whole experts on every TP rank) or parallel.tp (expert hidden sizes split)."""
    sequence_parallel: bool = True
    """With tp > 1: norms and residuals hold 1/tp of the tokens on each rank."""
    distributed_optimizer: bool = True
    """ZeRO-1: the optimizer state sharded over the data-parallel ranks."""
    split_master_weights: bool = False
    """bf16 params: keep each fp32 master as the bf16 weight plus its low 16 bits (exact; 2 bytes per parameter less)."""
    bucket_mb: float = 25.0
    """MiB of gradients per bucket reduced while the backward still runs."""
    gradient_accumulation_fusion: bool = True
    """Weight-gradient GEMMs (experts; bf16 block linears) add straight into the fp32 main grads (no bf16 gradient)."""
    pp_schedule: Literal["1f1b", "interleaved"] = "1f1b"
    """Pipeline schedule: 1f1b (one model chunk per rank) or interleaved (pp_virtual_stages chunks per rank)."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank: 1 for 1f1b, >= 2 for interleaved."""
    pp_first_stage_layers: int = 0
    """Layers of the first pipeline stage; 0: an even split."""
    pp_last_stage_layers: int = 0
    """Layers of the last pipeline stage; 0: an even split."""
    cp_comm: Literal["ring", "a2a", "a2a+ring"] = "ring"
    """How CP ranks attend: ring (K/V passed round), a2a (all-to-all over heads, Ulysses) or a2a+ring (a2a in groups of cp_a2a)."""
    cp_a2a: int = 0
    """cp_comm a2a+ring: CP ranks of each all-to-all group (neighbours, inside a node; divides parallel.cp)."""
    dynamic_cp: bool = False
    """Per step, a CP group size per micro-batch, planned by the data service (docs/dynamic_cp.md)."""
    cp_token_budget: int = 0
    """Dynamic CP: most tokens a rank holds in one micro-batch; 0: micro_batch_size*seq_len/cp."""
    dp: int = 0
    """Data-parallel size, derived as world // (pp*cp*tp); 0: derive it (a value given must match)."""


Fp8Recipe = Literal["blockwise", "tensorwise", "rowwise", "delayed"]
FP8_RECIPES = typing.get_args(Fp8Recipe)  # train.fp8_recipe's values, for command lines that take one


@dataclass
class TrainConfig:
    max_steps: int = 20
    """Optimizer steps of the schedule (the learning-rate schedule ends here)."""
    stop_at_step: int = 0
    """> 0: leave after this step (a job slot's end); a resume continues the schedule."""
    seed: int = 1234
    """Seed of the weights and of the data order."""
    seq_len: int = 256
    """Tokens per packed row (>= 2)."""
    micro_batch_size: int = 2
    """Packed rows per micro-batch on each data-parallel rank."""
    global_batch_size: int = 8
    """Packed rows per optimizer step, a multiple of micro_batch_size * dp."""
    lr: float = 3e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float = 3e-4
    """Learning rate at max_steps, the end of the cosine decay (0..lr)."""
    warmup_steps: int = 5
    """Steps of linear warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices and embeddings."""
    beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """AdamW second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Most global gradient L2 norm; larger gradients are scaled down; 0: no clipping."""
    optimizer_moments_dtype: Literal["fp32", "bf16"] = "fp32"
    """AdamW's moments: fp32, or bf16 (half the bytes; fp32 update, rounded to nearest; fp32's exponent range: no underflow)."""
    optimizer_offload: bool = False
    """fp32 masters and AdamW moments (this rank's ZeRO-1 shard) in host memory, updated on the CPU; grads stream out per bucket."""
    optimizer_offload_host_gb: float = 0.0
    """With optimizer_offload: host memory (GB) each rank may use for it; 0: /proc/meminfo MemAvailable over the ranks per node."""
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Compute precision; auto: bf16 on GPU, fp32 on CPU."""
    fp8_recipe: Fp8Recipe = "blockwise"
    """fp8 dense GEMMs' scaling: blockwise; tensorwise or rowwise via torchao (torch backend); te: blockwise, tensorwise, delayed."""
    fp8_weight_cache: bool = True
    """fp8: quantise each weight once per optimizer step, not per micro-batch (core/precision/weight_cache.py)."""
    fp8_expert_wgrad: Literal["fp8", "bf16"] = "fp8"
    """fp8: the routed experts' weight-gradient GEMM, K-grouped blockwise FP8 (fp8) or the bf16 grouped kernel (bf16)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in the backward: none, selective (attention core) or full (whole blocks)."""
    recompute_modules: list[str] = field(default_factory=list)
    """Recomputed too: norms, swiglu, moe_experts, attention_core, mla_up (MLA up-projections+core; saves latents), attention, mlp, block"""
    offload_modules: list[str] = field(default_factory=list)
    """Modules whose saved activations wait in host memory until the backward (copies overlap compute); the same names, not mla_up."""
    offload_checkpoints: bool = False
    """Keep the inputs of recomputed blocks (eager: also of recomputed attention, attention_core) in host memory until the backward."""
    offload_checkpoints_layers: int = 0
    """With offload_checkpoints: only the first N recomputed blocks of each model chunk (pipeline stage) offload; 0: all."""
    mlp_chunk_tokens: int = 0
    """> 0: tiled MLP: dense SwiGLUs run this many tokens at a time, routed experts their rows (memory flat in the sequence); 0: off."""
    recompute_num_layers: int = 0
    """Recompute only in the first N blocks of each model chunk (pipeline stage); 0: in every block."""
    run_dir: str = "runs/default"
    """Folder of the run: config.toml, metrics.jsonl, loss.png, checkpoints/."""
    log_interval: int = 1
    """Steps between progress lines (every step is recorded in metrics.jsonl)."""
    tensorboard: bool = False
    """Also write TensorBoard events to RUN_DIR/tensorboard."""
    plot: bool = True
    """Draw RUN_DIR/loss.png at the end."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto: the GPUs when there are any."""
    compile: bool = False
    """torch.compile each block and the loss (static shapes)."""
    cuda_graphs: bool = False
    """With train.compile on a GPU: replay each block's compiled regions as CUDA graphs (less host time per step)."""
    mtp_loss_weight: float = 0.3
    """With model.mtp_layers > 0: weight of the mean of the depths' losses added to the main loss (DeepSeek-V3: 0.3, later 0.1)."""
    fused_loss: bool = False
    """Output head and loss over token chunks, never the whole [tokens, vocab] logits (less memory, a little slower)."""
    hang_timeout_s: float = 600.0
    """Seconds one phase of a step may take before the rank reports a hang (rank, step, phase; stacks in RUN_DIR) and exits; 0: off."""


@dataclass
class DataConfig:
    address: str = ""
    """HOST:PORT of a running data service (comma-separated replicas); used before data.dataset."""
    dataset: str = ""
    """A dataset folder (`tessera-data build`) that the trainer serves on loopback itself."""
    cp_cost: str = ""
    """With data.dataset: a JSON cost model of dynamic CP for that server (docs/dynamic_cp.md)."""
    prefetch: int = 4
    """Batches each rank's data client reads ahead."""
    consumer: str = "tessera-train"
    """The name this trainer gives the data service (its logs)."""
    stream_idle_timeout_s: float = 60.0
    """Seconds an open stream may deliver nothing before the client drops it and reads on from the next replica; 0: off."""
    retry_s: float = 120.0
    """Seconds the client keeps reconnecting to an unreachable data service before the run fails."""
    server_restarts: int = 3
    """With data.dataset: times the trainer restarts its own loopback server when it dies (same port; the stream resumes)."""
    auth_token_file: str = ""
    """With data.address (and eval.address): a file whose first line is the bearer token the service wants (not world-readable)."""
    tls_ca_file: str = ""
    """With data.address: talk TLS, trusting server certificates signed by this PEM CA; empty: plain gRPC."""
    tls_cert_file: str = ""
    """With data.tls_ca_file: this trainer's PEM client certificate, for a service that asks for one (mutual TLS)."""
    tls_key_file: str = ""
    """The PEM private key of data.tls_cert_file (not world-readable)."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Steps between saves; 0: only at the end."""
    dir: str = ""
    """Checkpoint folder; empty: RUN_DIR/checkpoints."""
    keep: int = 2
    """Newest checkpoints kept (>= 1)."""
    save_at_end: bool = True
    """Save after the last step."""
    async_save: bool = False
    """Save in the background: the step pays for a host copy; `latest` only once every rank has written."""
    init_from: str = ""
    """Weights to start from (a `tessera-convert from-hf` folder or a .safetensors file), loaded into any layout; empty: random init."""


@dataclass
class EvalConfig:
    interval: int = 0
    """Steps between validation-loss evaluations (also after the last step); 0: no evaluation."""
    steps: int = 4
    """Global batches (train.global_batch_size rows each) per evaluation, the same rows every time."""
    dataset: str = ""
    """A held-out dataset folder (`tessera-data build`) that the trainer serves on loopback itself."""
    address: str = ""
    """HOST:PORT of a running data service of held-out rows (comma-separated replicas); used before eval.dataset."""
    seed: int = 0
    """Seed of the held-out stream's row order (fixed: each evaluation reads the same rows)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network ([model])."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the ranks split the work ([parallel])."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation and the run ([train])."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the batches come from ([data])."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When and where the run saves ([checkpoint])."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation loss on held-out rows ([eval])."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- keys, types and docs ---------------------------------------------------------------

@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(c) for c in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


@functools.cache
def field_docs() -> dict[str, str]:
    """Every key's docstring (the string literal on the line after its field), by dotted key."""
    docs_of: dict[str, dict[str, str]] = {}
    for node in ast.parse(Path(__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            docs_of[node.name] = {
                a.target.id: b.value.value
                for a, b in zip(body, body[1:])
                if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)
            }
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            out[prefix + f.name] = docs_of.get(cls.__name__, {}).get(f.name, "")
            hint = _hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")

    walk(Config, "")
    return out


def reference() -> list[str]:
    """One line per key: `key = default  # type: doc`, sections as `[section]  # doc`."""
    docs, lines = field_docs(), []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key, hint = prefix + f.name, _hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                lines.append(f"[{key}]  # {docs[key]}")
                walk(hint, key + ".")
            else:
                value = _default(f)
                shown = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else value
                lines.append(f"{key} = {shown}  # {_type_name(hint)}: {docs[key]}")

    walk(Config, "")
    return lines


class _Bare(str):
    """A `--set` value that is not a TOML literal (a bare word such as a path)."""


def _alternatives(choices: tuple) -> str:
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _convert(value: Any, hint: Any, path: str, default: Any) -> Any:
    """`value` as the field's type, or ConfigError naming the key, the value and the type wanted."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if isinstance(value, str) and value in choices:
            return str(value)
        raise ConfigError(f"{path}={value!r} must be {_alternatives(choices)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be int (a whole number, e.g. {path}={default}), got {value!r}")
    if hint is float:
        number = value
        if isinstance(value, _Bare):  # `--set train.lr=.001`: not TOML, but a number
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if not math.isfinite(number):
                raise ConfigError(f"{path} must be a finite number, got {value!r}")
            return float(number)
        raise ConfigError(f"{path} must be float (a number, e.g. {path}={default!r}), got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path} must be str (text, e.g. {path}=\"...\"), got {value!r}")
    if typing.get_origin(hint) is list and typing.get_args(hint) == (int,):
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
        raise ConfigError(f"{path} must be a list of whole numbers (e.g. {path}=[0, 3]), got {value!r}")
    if typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{path} must be a list of names (e.g. {path}=[\"norms\", \"swiglu\"]), got {value!r}")
    raise TypeError(f"{path}: no conversion for the type {hint!r}")  # a field type this module forgot


def _unknown_key(path: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{path.rpartition('.')[0] + '.' if '.' in path else ''}{close[0]}'? " if close else ""
    return ConfigError(f"unknown config key '{path}' ({hint}known keys here: {', '.join(sorted(known))})")


def _apply(obj: Any, values: dict[str, Any], where: str) -> None:
    """Set fields of a dataclass from a nested dict, refusing unknown keys and wrong types."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = _hints(type(obj))
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            raise _unknown_key(path, key, list(fields))
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"'{path}' is a section; give keys like '{path}.<name>'")
            _apply(getattr(obj, key), value, path)
            continue
        setattr(obj, key, _convert(value, hints[key], path, _default(fields[key])))


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. --set model.num_layers=4), got '{text}'")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = _Bare(raw)  # bare words are strings: --set data.dataset=/tmp/ds
    keys = key.strip().split(".")
    if not all(keys):
        raise ConfigError(f"--set {text!r}: the key must be a dotted path such as model.num_layers")
    return keys, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file, then each `KEY=VALUE` override in order; types are checked here."""
    config = Config()
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file '{path}' is a folder; give a TOML file such as launch/configs/tiny_dense.toml")
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file '{path}' is not UTF-8 text (is it a TOML file?)") from None
        except OSError as err:
            raise ConfigError(f"config file '{path}' cannot be read: {err.strerror}") from None
        _apply(config, data, "")
    for text in overrides:
        keys, value = _parse_override(text)
        nested: Any = value
        for key in reversed(keys):
            nested = {key: nested}
        _apply(config, nested, "")
    return config


# ---- ranges -------------------------------------------------------------------------------

# Ranges that hold whatever the other keys say: ">= N", "> N", or an interval "[a, b)".
RANGES = {
    "model.vocab_size": ">= 1", "model.dim": ">= 1", "model.num_layers": ">= 1", "model.num_heads": ">= 1",
    "model.num_kv_heads": ">= 1", "model.ffn_dim": ">= 1", "model.rope_theta": "> 0", "model.norm_eps": "> 0",
    "model.init_std": "> 0", "model.head_dim": ">= 0", "model.q_lora_rank": ">= 0", "model.kv_lora_rank": ">= 0",
    "model.qk_nope_head_dim": ">= 0", "model.qk_rope_head_dim": ">= 0", "model.v_head_dim": ">= 0",
    "model.mtp_layers": ">= 0",
    "model.rope_scaling.factor": "> 0", "model.rope_scaling.original_max_position_embeddings": ">= 0",
    "model.rope_scaling.low_freq_factor": "> 0", "model.rope_scaling.high_freq_factor": "> 0",
    "model.rope_scaling.beta_fast": "> 0", "model.rope_scaling.beta_slow": "> 0",
    "model.rope_scaling.attention_factor": ">= 0", "model.rope_scaling.mscale": ">= 0",
    "model.rope_scaling.mscale_all_dim": ">= 0",
    "model.moe.num_experts": ">= 0", "model.moe.top_k": ">= 1", "model.moe.ffn_dim": ">= 0",
    "model.moe.num_shared_experts": ">= 0", "model.moe.n_groups": ">= 1", "model.moe.topk_groups": ">= 1",
    "model.moe.group_score_experts": ">= 0",
    "model.moe.aux_loss_coeff": ">= 0", "model.moe.z_loss_coeff": ">= 0", "model.moe.bias_update_rate": ">= 0",
    "model.moe.capacity_factor": ">= 0", "model.moe.first_k_dense": ">= 0", "model.moe.moe_every": ">= 1",
    "model.moe.routed_scaling_factor": "> 0", "model.moe.shared_ffn_dim": ">= 0",
    "parallel.tp": ">= 1", "parallel.pp": ">= 1", "parallel.cp": ">= 1", "parallel.ep": ">= 1", "parallel.etp": ">= 1",
    "parallel.bucket_mb": "> 0", "parallel.pp_virtual_stages": ">= 1", "parallel.pp_first_stage_layers": ">= 0",
    "parallel.pp_last_stage_layers": ">= 0", "parallel.cp_token_budget": ">= 0", "parallel.cp_a2a": ">= 0", "parallel.dp": ">= 0",
    "train.max_steps": ">= 1", "train.stop_at_step": ">= 0", "train.seed": "[0, 9223372036854775807]",
    "train.seq_len": ">= 2", "train.micro_batch_size": ">= 1", "train.global_batch_size": ">= 1", "train.lr": "> 0",
    "train.min_lr": ">= 0", "train.warmup_steps": ">= 0", "train.weight_decay": ">= 0", "train.beta1": "[0, 1)",
    "train.beta2": "[0, 1)", "train.eps": ">= 0", "train.grad_clip": ">= 0", "train.log_interval": ">= 1",
    "train.hang_timeout_s": ">= 0", "train.mlp_chunk_tokens": ">= 0", "train.mtp_loss_weight": ">= 0",
    "train.optimizer_offload_host_gb": ">= 0",
    "data.prefetch": ">= 1", "data.stream_idle_timeout_s": ">= 0", "data.retry_s": "> 0", "data.server_restarts": ">= 0",
    "checkpoint.interval": ">= 0", "checkpoint.keep": ">= 1",
    "eval.interval": ">= 0", "eval.steps": ">= 1", "eval.seed": "[0, 9223372036854775807]",
}


def _number(text: str) -> float:
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else float(text)


def _in_range(value: float, spec: str) -> bool:
    if spec.startswith(">="):
        return value >= _number(spec[2:])
    if spec.startswith(">"):
        return value > _number(spec[1:])
    low, high = (_number(s) for s in spec[1:-1].split(","))
    return (value >= low if spec[0] == "[" else value > low) and (value <= high if spec[-1] == "]" else value < high)


def _walk(obj: Any, prefix: str):
    """(dotted key, owning dataclass, field, type hint) of every leaf key under `obj`."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _walk(getattr(obj, f.name), key + ".")
        else:
            yield key, obj, f, hints[f.name]


def leaf_values(config: Config) -> dict[str, Any]:
    """Every key's value, by dotted key ("train.lr": 3e-3)."""
    return {key: getattr(owner, f.name) for key, owner, f, _ in _walk(config, "")}


def check_fields(obj: Any, prefix: str) -> None:
    """Types (also of configs built in code) and the fixed ranges of every key under `obj`
    (a config or one of its sections, whose keys start with `prefix`); ConfigError naming the
    key, the value and what it must be."""
    for key, owner, f, hint in _walk(obj, prefix):
        value = _convert(getattr(owner, f.name), hint, key, _default(f))
        setattr(owner, f.name, value)
        spec = RANGES.get(key)
        if spec is not None and not _in_range(value, spec):
            raise ConfigError(f"{key}={value!r} must be {spec}")
