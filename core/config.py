"""Run configuration: dataclasses with defaults that run, loaded from TOML, overridden by `--set`.

A TOML file names the sections below (`[model]`, `[model.moe]`, `[parallel]`, `[train]`,
`[data]`, `[checkpoint]`); the command line overrides single keys with dotted paths
(`--set model.num_layers=4`). Unknown keys and impossible layouts fail at start with one
message that says what was wrong and what would be right.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.parallel.schedules import check_schedule, partition_layers
from dataservice.cp_plan import CostModel


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message is meant for the user."""


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0: dense model
    top_k: int = 2
    ffn_dim: int = 0  # per-expert hidden size; 0: model.ffn_dim
    num_shared_experts: int = 0
    router: str = "softmax"  # "softmax" | "sigmoid"
    normalize_topk: bool = True
    n_groups: int = 1  # group-limited routing: experts split into groups ...
    topk_groups: int = 1  # ... of which tokens may use this many
    aux_loss_coeff: float = 0.01
    aux_loss_per_sequence: bool = False
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 0.0  # > 0: auxiliary-loss-free balancing (per-expert bias)
    capacity_factor: float = 0.0  # 0: dropless
    first_k_dense: int = 0
    moe_every: int = 1
    dispatcher: str = "alltoall"  # "alltoall" | "allgather"
    routed_scaling_factor: float = 1.0  # routed experts' combine weights are scaled by this (DeepSeek-V3: 2.5)
    shared_ffn_dim: int = 0  # hidden size of the shared experts together; 0: num_shared_experts * expert ffn_dim


@dataclass
class ModelConfig:
    vocab_size: int = 512
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_dim: int = 176
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel size (divides tp-free expert ranks)
    sequence_parallel: bool = True
    distributed_optimizer: bool = True  # ZeRO-1 over data parallel ranks
    bucket_mb: float = 25.0
    # The experts' weight gradients go straight into the fp32 main grads (GEMM epilogue adds to
    # them) instead of through a bf16 gradient and a separate accumulation pass.
    gradient_accumulation_fusion: bool = True
    pp_schedule: str = "1f1b"  # "1f1b" | "interleaved"
    pp_virtual_stages: int = 1
    pp_first_stage_layers: int = 0  # 0: even split
    pp_last_stage_layers: int = 0
    dynamic_cp: bool = False  # per step, a CP group size per micro-batch, planned by the data service
    cp_token_budget: int = 0  # dynamic_cp: most tokens a rank holds in one micro-batch (after padding);
    # 0: micro_batch_size*seq_len/cp, what a rank holds under static CP with the same settings
    dp: int = 0  # derived: world // (pp*cp*tp); a value given must match


@dataclass
class TrainConfig:
    max_steps: int = 20  # the schedule's length
    stop_at_step: int = 0  # > 0: leave after this step (a job slot's end); resume continues the schedule
    seed: int = 1234
    seq_len: int = 256
    micro_batch_size: int = 2
    global_batch_size: int = 8  # sequences (packed rows) per optimizer step
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "fp32" | "bf16" | "fp8"
    # fp8: quantise each weight once per optimizer step, not per micro-batch (core/fp8_cache.py);
    # holds an FP8 copy of every FP8 weight in both GEMM layouts through the step.
    fp8_weight_cache: bool = True
    recompute: str = "none"  # "none" | "selective" | "full"
    run_dir: str = "runs/default"
    log_interval: int = 1
    tensorboard: bool = False
    plot: bool = True
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    compile: bool = False


@dataclass
class DataConfig:
    address: str = ""  # host:port of a running data service (comma-separated replicas)
    dataset: str = ""  # a shard folder: the trainer serves it on loopback itself
    cp_cost: str = ""  # with `dataset`: JSON cost model of dynamic CP for that server (docs/dynamic_cp.md)
    prefetch: int = 4
    consumer: str = "tessera-train"


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between saves; 0: only at the end
    dir: str = ""  # default: RUN_DIR/checkpoints
    keep: int = 2
    save_at_end: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _apply(obj: Any, values: dict[str, Any], where: str) -> None:
    """Set fields of a dataclass from a nested dict, refusing unknown keys and wrong types."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{path}' (known keys here: {known})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"'{path}' is a section; give keys like '{path}.<name>'")
            _apply(current, value, path)
            continue
        setattr(obj, key, _coerce(value, current, path))


def _coerce(value: Any, current: Any, path: str) -> Any:
    kind = type(current)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"'{path}' must be {kind.__name__}, got {value!r}")


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE, got '{text}'")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words are strings: --set data.dataset=/tmp/ds
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file, then each `KEY=VALUE` override in order."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
        _apply(config, data, "")
    for text in overrides:
        keys, value = _parse_override(text)
        nested: Any = value
        for key in reversed(keys):
            nested = {key: nested}
        _apply(config, nested, "")
    return config


def resolve_layout(config: Config, world_size: int) -> Config:
    """Derive the data-parallel size and check the layout; raise ConfigError when impossible."""
    m, p = config.model, config.parallel
    for name in ("tp", "pp", "cp", "ep", "etp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    if m.dim % m.num_heads:
        raise ConfigError(f"model.dim={m.dim} must be divisible by model.num_heads={m.num_heads}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}"
        )
    if m.num_heads % p.tp or m.num_kv_heads % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} must divide model.num_heads={m.num_heads} and "
            f"model.num_kv_heads={m.num_kv_heads}"
        )
    for name, size in (("ffn_dim", m.ffn_dim), ("vocab_size", m.vocab_size)):
        if size % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} must divide model.{name}={size}")
    model_ranks = p.pp * p.cp * p.tp
    if world_size % model_ranks:
        raise ConfigError(
            f"world size {world_size} is not a multiple of pp*cp*tp = {p.pp}*{p.cp}*{p.tp} = {model_ranks}"
        )
    dp = world_size // model_ranks
    if p.dp and p.dp != dp:
        raise ConfigError(
            f"world size {world_size} != pp*dp*cp*tp = {p.pp}*{p.dp}*{p.cp}*{p.tp}; "
            f"leave parallel.dp unset to use dp={dp}"
        )
    p.dp = dp
    if (dp * p.cp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide dp*cp = {dp}*{p.cp} = {dp * p.cp}")
    if m.moe.num_experts and m.moe.num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe.num_experts={m.moe.num_experts}")
    if m.num_layers < p.pp:
        raise ConfigError(f"model.num_layers={m.num_layers} is smaller than parallel.pp={p.pp}")
    t = config.train
    rows_per_micro_step = t.micro_batch_size * dp
    if t.global_batch_size % rows_per_micro_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"micro_batch_size*dp = {t.micro_batch_size}*{dp} = {rows_per_micro_step}"
        )
    # Under (dynamic) context parallelism each rank's token count varies per batch; the CP
    # split pads it to a multiple of tp itself.
    if p.sequence_parallel and p.tp > 1 and p.cp == 1 and not p.dynamic_cp and (t.micro_batch_size * t.seq_len) % p.tp:
        raise ConfigError("micro_batch_size*seq_len must be divisible by parallel.tp for sequence parallelism")
    if p.pp > 1:
        try:
            check_schedule(p.pp_schedule, p.pp, p.pp_virtual_stages)
            partition_layers(m.num_layers, p.pp * p.pp_virtual_stages, p.pp_first_stage_layers, p.pp_last_stage_layers)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        accum = t.global_batch_size // rows_per_micro_step
        if p.pp_schedule == "interleaved" and accum % p.pp:
            raise ConfigError(f"the interleaved schedule needs micro-batches per step ({accum}) to be a multiple of "
                              f"parallel.pp={p.pp}: raise train.global_batch_size")
    if p.dynamic_cp:
        _check_dynamic_cp(config, dp)
    for name, allowed in (
        ("precision", ("auto", "fp32", "bf16", "fp8")),
        ("recompute", ("none", "selective", "full")),
        ("device", ("auto", "cpu", "cuda")),
    ):
        if getattr(t, name) not in allowed:
            raise ConfigError(f"train.{name}={getattr(t, name)!r} must be one of {', '.join(allowed)}")
    if not math.isfinite(t.lr) or t.lr <= 0:
        raise ConfigError(f"train.lr must be a positive number, got {t.lr}")
    if config.data.cp_cost:
        _check_cp_cost(config)
    return config


def _check_cp_cost(config: Config) -> None:
    if not config.data.dataset:
        raise ConfigError("data.cp_cost is the cost model of the trainer's own server (data.dataset); a running "
                          "service (data.address) takes it as `tessera-data serve --cp-cost FILE`")
    try:
        CostModel.from_json(config.data.cp_cost)
    except ValueError as err:
        raise ConfigError(f"data.cp_cost: {err}") from None


def _check_dynamic_cp(config: Config, dp: int) -> None:
    p, t = config.parallel, config.train
    if p.pp > 1:
        raise ConfigError("parallel.dynamic_cp with parallel.pp > 1 is not supported: the pipeline schedule needs the "
                          "same micro-batches on every stage and rank; use parallel.pp=1")
    if config.model.moe.num_experts:
        raise ConfigError("parallel.dynamic_cp with MoE (model.moe.num_experts > 0) is not supported yet: the "
                          "auxiliary losses are scaled for a fixed number of micro-batches per rank")
    if p.cp_token_budget < 0:
        raise ConfigError(f"parallel.cp_token_budget must be >= 0 (0: the default), got {p.cp_token_budget}")
    if p.cp_token_budget == 0:
        p.cp_token_budget = max(1, t.micro_batch_size * t.seq_len // p.cp)
    # A document piece has up to seq_len tokens; it must fit the largest aligned power-of-two
    # group of the dp*cp ranks, padded to a multiple of 2g (the zigzag split).
    g = 1 << ((dp * p.cp).bit_length() - 1)
    need = t.seq_len if g == 1 else -(-t.seq_len // (2 * g)) * 2
    if p.cp_token_budget < need:
        raise ConfigError(
            f"parallel.cp_token_budget={p.cp_token_budget} is too small: a document piece of train.seq_len="
            f"{t.seq_len} tokens over the largest CP group of {g} of the dp*cp = {dp * p.cp} ranks needs {need} "
            f"tokens per rank; give parallel.cp_token_budget >= {need}"
        )


def grad_accum_steps(config: Config) -> int:
    t, p = config.train, config.parallel
    return t.global_batch_size // (t.micro_batch_size * p.dp)
