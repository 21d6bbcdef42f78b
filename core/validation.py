"""Every rule between a config's fields, in one place, run once at start.

`validate(config, world_size)` is the entry point: the launcher runs it before it starts any
worker, each rank again at start, `tessera-convert` and the benchmarks on the configs they
build. It runs the two halves in order:

- `check_config(config)`: what holds whatever the parallel layout and the world size are:
  each key's type and range (`core.config.check_fields`), the model (heads, rotary scaling,
  MoE), the train settings (learning rates, recomputation, precision and backend), the
  dynamic-CP cost model and the held-out data's folder;
- `check_layout(config, world_size)`: the parallel layout on `world_size` ranks (divisibility
  by tp/ep, the world by pp*cp*tp, the pipeline split, the batch over dp, what runs at tp=1 or
  pp=1 only, dynamic CP), deriving `parallel.dp` and `parallel.cp_token_budget`.

`tessera-plan` runs `check_config` once, so a config's own error is named as such, and then
`check_layout` for each layout it tries. Each failure is a `ConfigError` whose message names
the key, the value and what would be right.

What needs facts outside the config stays where those facts are: a GPU, Transformer Engine or
torchao being there, the folders the run writes, the data service's answer
(`core.train.cli.check_inputs`, `core.train.data.check_data_source`), and what `train.precision
= 'auto'` becomes on the device (`check_split_masters`, called again by `core.train.parallelize`).
"""

from __future__ import annotations

import math

from pathlib import Path

from core.config import Config, ConfigError, ModelConfig, MoEConfig, RopeScalingConfig, TrainConfig, check_fields
from core.rules import (
    HOOKED_RECOMPUTE,
    RECOMPUTE_MODULES,
    check_schedule,
    moe_layer_rule,
    nests,
    offloaded_checkpoints,
    partition_layers,
    recompute_set,
    torchao_fp8,
)
from dataservice.cp_plan import CostModel

BF16_BETA_LIMIT = 1 - 2**-8  # half a bf16 unit in the last place is up to 2^-8 of the value: see _check_moments


def validate(config: Config, world_size: int) -> Config:
    """Check everything about `config` on `world_size` ranks and derive `parallel.dp` (and the
    dynamic-CP token budget); raise ConfigError at the first problem. Returns `config`."""
    check_config(config)
    check_layout(config, world_size)
    return config


def check_config(config: Config) -> None:
    """The rules that hold whatever the layout and world size: types, ranges, the model, the
    train settings, the data the config names itself (cost model, held-out folder)."""
    check_fields(config, "")
    _check_model(config.model)
    _check_train(config)
    if config.data.cp_cost:
        _check_cp_cost(config)
    _check_client_security(config)
    if config.eval.interval:
        _check_eval_data(config)


def check_layout(config: Config, world_size: int) -> int:
    """The rules of the parallel layout on `world_size` ranks; sets and returns parallel.dp.
    Expects a config `check_config` accepted (types converted)."""
    if world_size < 1:
        raise ConfigError(f"the world size must be >= 1, got {world_size}")
    dp = _check_split(config, world_size)
    _check_train_layout(config)
    _check_cp_comm(config)
    if config.parallel.dynamic_cp:
        _check_dynamic_cp(config, dp)
    if config.eval.interval and config.parallel.pp > 1:
        raise ConfigError("eval.interval > 0 with parallel.pp > 1 is not supported yet (no forward-only pipeline "
                          "schedule); use eval.interval=0 or parallel.pp=1")
    return dp


# ---- the model ----------------------------------------------------------------------------

def check_moe(moe: MoEConfig, where: str = "model.moe") -> None:
    """The checks of an MoE layer's settings; ConfigError names the key and the accepted values.
    Also the guard of `moe.router.TopKRouter` and `moe.layer.MoELayer` built outside a run."""
    check_fields(moe, where + ".")
    e, k = moe.num_experts, moe.top_k
    if e < 1:
        raise ConfigError(f"{where}.num_experts must be >= 1 for an MoE layer, got {e}")
    if not 1 <= k <= e:
        raise ConfigError(f"{where}.top_k={k} must be between 1 and num_experts={e}")
    if e % moe.n_groups:
        raise ConfigError(f"{where}.n_groups={moe.n_groups} must be >= 1 and divide num_experts={e}")
    if not 1 <= moe.topk_groups <= moe.n_groups:
        raise ConfigError(f"{where}.topk_groups={moe.topk_groups} must be between 1 and n_groups={moe.n_groups}")
    if k > moe.topk_groups * (e // moe.n_groups):
        raise ConfigError(
            f"{where}.top_k={k} exceeds the experts reachable in topk_groups={moe.topk_groups} groups of "
            f"{e // moe.n_groups}; raise topk_groups or lower top_k"
        )


def _check_mla(m: ModelConfig) -> None:
    needed = {"kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
              "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}
    unset = [f"model.{k}" for k, v in needed.items() if v <= 0]
    if unset:
        raise ConfigError(f"model.attention='mla' needs {', '.join(unset)} > 0 (DeepSeek-V3: kv_lora_rank=512, "
                          f"qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)")
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary embeddings turn pairs of features)")
    if m.qk_norm:
        raise ConfigError("model.qk_norm with model.attention='mla' is not supported: MLA normalises its latents "
                          "(kv_norm, q_norm), not each head; set model.qk_norm=false")
    if m.head_dim:
        raise ConfigError(f"model.head_dim={m.head_dim} has no effect with model.attention='mla' (the heads are "
                          f"qk_nope_head_dim + qk_rope_head_dim and v_head_dim); set it to 0")


def _check_model(m: ModelConfig) -> None:
    if m.attention == "mla":
        _check_mla(m)
    else:
        unused = [k for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                  if getattr(m, k)]
        if unused:
            raise ConfigError(f"model.{unused[0]}={getattr(m, unused[0])} is an MLA key but model.attention="
                              f"'{m.attention}'; set model.attention='mla' or remove it")
    if not m.head_dim and m.dim % m.num_heads and m.attention != "mla":
        raise ConfigError(f"model.dim={m.dim} must be divisible by model.num_heads={m.num_heads} "
                          f"(or give the head size as model.head_dim)")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even (rotary embeddings turn pairs of features)")
    if m.attention != "mla" and m.attention_head_dim % 2:
        raise ConfigError(f"model.dim / model.num_heads = {m.dim} / {m.num_heads} = {m.attention_head_dim} must be even "
                          f"(rotary embeddings turn pairs of features); change model.dim or model.num_heads, "
                          f"or set model.head_dim")
    _check_rope_scaling(m.rope_scaling)
    moe = m.moe
    if not moe.num_experts:
        return
    check_moe(moe)
    if moe.first_k_dense >= m.num_layers:
        raise ConfigError(f"model.moe.first_k_dense={moe.first_k_dense} leaves no MoE layer among "
                          f"model.num_layers={m.num_layers}; lower it, or set model.moe.num_experts=0 for a dense model")
    bad = [i for i in moe.dense_layers if not 0 <= i < m.num_layers]
    if bad or len(set(moe.dense_layers)) != len(moe.dense_layers):
        raise ConfigError(f"model.moe.dense_layers={moe.dense_layers} must name distinct layers in "
                          f"[0, model.num_layers={m.num_layers})")
    if not any(moe_layer_rule(moe, i) for i in range(m.num_layers)):
        raise ConfigError(f"model.moe.dense_layers={moe.dense_layers} with first_k_dense={moe.first_k_dense} and "
                          f"moe_every={moe.moe_every} leaves no MoE layer; set model.moe.num_experts=0 for a dense model")


def _check_rope_scaling(r: RopeScalingConfig) -> None:
    where = "model.rope_scaling"
    if r.type == "none":
        if r.factor != 1.0:
            raise ConfigError(f"{where}.factor={r.factor} has no effect with {where}.type='none'; "
                              f"choose a type ('linear', 'llama3' or 'yarn') or leave the factor at 1")
        return
    if r.type in ("llama3", "yarn"):
        if r.original_max_position_embeddings < 1:
            raise ConfigError(f"{where}.type='{r.type}' needs {where}.original_max_position_embeddings > 0 "
                              f"(the pretraining context length), got {r.original_max_position_embeddings}")
        if r.factor < 1.0:
            raise ConfigError(f"{where}.factor={r.factor} must be >= 1 with {where}.type='{r.type}'")
    if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
        raise ConfigError(f"{where}.high_freq_factor={r.high_freq_factor} must exceed "
                          f"{where}.low_freq_factor={r.low_freq_factor}")
    if r.type != "yarn":
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(r, name):
                raise ConfigError(f"{where}.{name}={getattr(r, name)} is used by {where}.type='yarn' only, "
                                  f"not '{r.type}'")
    elif r.beta_fast <= r.beta_slow:
        raise ConfigError(f"{where}.beta_fast={r.beta_fast} must exceed {where}.beta_slow={r.beta_slow}")


# ---- the train settings -------------------------------------------------------------------

def _check_train(config: Config) -> None:
    t = config.train
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must not exceed train.lr={t.lr} (the cosine decays from lr to min_lr)")
    if not t.run_dir.strip():
        raise ConfigError("train.run_dir is empty; give the run a folder, e.g. train.run_dir=runs/my_run")
    _check_recompute(t)
    if t.offload_checkpoints and not offloaded_checkpoints(config):
        covered = ("whole blocks: train.recompute='full' (or 'block' in train.recompute_modules); train.compile keeps "
                   "the inner checkpoints in its graphs" if t.compile else
                   "train.recompute='full' (or 'block', 'attention', or, without MLA, 'attention_core' in "
                   "train.recompute_modules)")
        raise ConfigError("train.offload_checkpoints=true keeps the inputs of recomputed modules in host memory, but "
                          f"none it covers is recomputed; recompute {covered}, or set train.offload_checkpoints=false")
    if t.offload_checkpoints_layers < 0:
        raise ConfigError(f"train.offload_checkpoints_layers={t.offload_checkpoints_layers} must be >= 0 "
                          "(0: every recomputed block offloads its inputs)")
    if t.offload_checkpoints_layers and not t.offload_checkpoints:
        raise ConfigError(f"train.offload_checkpoints_layers={t.offload_checkpoints_layers} limits a checkpoint "
                          "offload that is off; set train.offload_checkpoints=true (or offload_checkpoints_layers=0)")
    if "mla_up" in recompute_set(t) and config.model.attention != "mla":
        raise ConfigError(f"train.recompute_modules has 'mla_up', which recomputes multi-head latent attention's "
                          f"up-projections, but model.attention={config.model.attention!r}; use 'attention_core' "
                          f"or set model.attention='mla'")
    if "mla_up" in t.offload_modules:
        raise ConfigError("train.offload_modules cannot name 'mla_up' (a checkpoint inside the attention, not a "
                          "module of its own); offload 'attention' or 'attention_core'")
    _check_dense_backend(config)
    check_split_masters(config, t.precision)
    if t.cuda_graphs and not t.compile:
        raise ConfigError("train.cuda_graphs=true replays the compiled blocks' graphs and needs train.compile=true; "
                          "set train.compile=true or train.cuda_graphs=false")
    if t.fused_loss and not config.parallel.gradient_accumulation_fusion:
        raise ConfigError("train.fused_loss=true writes the head's gradient into its fp32 main grad during the "
                          "forward: it needs parallel.gradient_accumulation_fusion=true")
    if t.fused_loss and config.model.dense_backend != "torch":
        raise ConfigError("train.fused_loss=true needs model.dense_backend=\"torch\" (the head is a plain linear)")
    _check_mlp_chunks(config)
    _check_optimizer_offload(config)
    _check_moments(t)


def _check_moments(t: TrainConfig) -> None:
    """bf16 moments round each update to 8 significant bits: a step moves a moment only where its
    change, (1 - beta) of the gap to the new term, passes half a unit in the last place (between
    2^-9 and 2^-8 of the value). At beta >= 1 - 2^-8 a moment whose term falls to zero loses at
    most 2^-8 of itself a step, which rounds back for nearly every value: it could grow, never decay."""
    if t.optimizer_moments_dtype != "bf16":
        return
    for name, beta in (("beta1", t.beta1), ("beta2", t.beta2)):
        if beta >= BF16_BETA_LIMIT:
            raise ConfigError(f"train.{name}={beta:g} with train.optimizer_moments_dtype='bf16': a bf16 moment "
                              f"would stop decaying (a step lowers it by {1 - beta:.2g} of itself at most, which "
                              f"bf16's rounding undoes); use {name} < {BF16_BETA_LIMIT:.5f} or optimizer_moments_dtype='fp32'")


def _check_optimizer_offload(config: Config) -> None:
    t = config.train
    if t.optimizer_offload_host_gb and not t.optimizer_offload:
        raise ConfigError(f"train.optimizer_offload_host_gb={t.optimizer_offload_host_gb} bounds the offloaded "
                          "optimizer's host memory: set train.optimizer_offload=true, or leave it at 0")
    if t.optimizer_offload and config.parallel.split_master_weights:
        raise ConfigError("train.optimizer_offload=true keeps the fp32 masters whole in host memory: "
                          "parallel.split_master_weights has nothing to split there; set it false")


def _check_mlp_chunks(config: Config) -> None:
    t, n = config.train, config.train.mlp_chunk_tokens
    if not n:
        return
    tokens = t.micro_batch_size * t.seq_len
    if tokens % n:
        raise ConfigError(f"train.mlp_chunk_tokens={n} must divide the tokens of a micro-batch, train.micro_batch_size "
                          f"x train.seq_len = {tokens} (e.g. {max(d for d in range(1, min(n, tokens) + 1) if tokens % d == 0)})")
    if config.model.dense_backend != "torch" or t.precision == "fp8":
        raise ConfigError("train.mlp_chunk_tokens > 0 runs the dense SwiGLU in plain GEMMs: it needs "
                          "model.dense_backend='torch' and train.precision other than fp8")


def check_split_masters(config: Config, precision: str) -> None:
    """parallel.split_master_weights needs bf16 parameters. `precision` is train.precision, or
    on the device what 'auto' became there (fp32 on a CPU), which only the run knows."""
    if config.parallel.split_master_weights and precision == "fp32":
        raise ConfigError(f"parallel.split_master_weights keeps fp32 masters as bf16 weights plus their low halves: "
                          f"it needs train.precision bf16 or fp8, not {precision}")


def _check_dense_backend(config: Config) -> None:
    t, backend = config.train, config.model.dense_backend
    if t.fp8_recipe != "blockwise" and t.precision != "fp8":
        raise ConfigError(f"train.fp8_recipe={t.fp8_recipe!r} applies to train.precision='fp8' only "
                          f"(now {t.precision!r}); set both or leave fp8_recipe at 'blockwise'")
    if t.fp8_expert_wgrad != "fp8" and t.precision != "fp8":
        raise ConfigError(f"train.fp8_expert_wgrad={t.fp8_expert_wgrad!r} applies to train.precision='fp8' only "
                          f"(now {t.precision!r}); set both or leave fp8_expert_wgrad at 'fp8'")
    if t.fp8_recipe == "delayed" and backend != "te":
        raise ConfigError("train.fp8_recipe='delayed' runs through Transformer Engine: set model.dense_backend='te', "
                          "or use blockwise, tensorwise or rowwise with the torch backend")
    if t.fp8_recipe == "rowwise" and backend == "te":
        raise ConfigError("train.fp8_recipe='rowwise' runs through torchao with model.dense_backend='torch'; "
                          "Transformer Engine's recipes here are blockwise, tensorwise and delayed")
    torchao = torchao_fp8(config)
    hooked = sorted(recompute_set(t) & set(HOOKED_RECOMPUTE))
    if hooked and (backend == "te" or torchao):
        setting, linears = (("model.dense_backend='te'", "Transformer Engine's linears") if backend == "te"
                            else (f"train.fp8_recipe={t.fp8_recipe!r}", "torchao's FP8 linears"))
        raise ConfigError(f"train.recompute_modules {hooked} cannot run with {setting}: {linears} save their own "
                          "(possibly FP8) inputs, which those hooks do not see; recompute 'attention_core', "
                          "'attention', 'mlp' or 'block' instead")


def _check_recompute(t: TrainConfig) -> None:
    for key in ("recompute_modules", "offload_modules"):
        names = getattr(t, key)
        bad = [n for n in names if n not in RECOMPUTE_MODULES]
        if bad:
            raise ConfigError(f"train.{key}={names!r}: unknown module {bad[0]!r}; choose from {', '.join(RECOMPUTE_MODULES)}")
        if len(set(names)) != len(names):
            raise ConfigError(f"train.{key}={names!r} names a module twice")
    recomputed = recompute_set(t)
    if t.recompute_num_layers < 0:
        raise ConfigError(f"train.recompute_num_layers={t.recompute_num_layers} must be >= 0 (0: recompute in every block)")
    if t.recompute_num_layers and not recomputed:
        raise ConfigError(f"train.recompute_num_layers={t.recompute_num_layers} limits a recomputation that is not "
                          "set: name modules in train.recompute_modules (or set train.recompute)")
    for name in t.offload_modules:
        clash = sorted(r for r in recomputed if nests(name, r))
        if clash:
            raise ConfigError(f"train.offload_modules has {name!r}, which overlaps the recomputed {clash[0]!r} (one "
                              f"module is inside the other); offload or recompute it, not both")
    if t.compile and t.offload_modules:
        raise ConfigError("train.offload_modules works on saved-tensor hooks, which train.compile cannot trace; set "
                          "train.compile=false, or recompute 'attention_core', 'moe_experts', 'mlp' or 'block'")


# ---- the data the config names ------------------------------------------------------------

def _check_cp_cost(config: Config) -> None:
    if not config.data.dataset:
        raise ConfigError("data.cp_cost is the cost model of the trainer's own server (data.dataset); a running "
                          "service (data.address) takes it as `tessera-data serve --cp-cost FILE`")
    try:
        CostModel.from_json(config.data.cp_cost)
    except ValueError as err:
        raise ConfigError(f"data.cp_cost: {err}") from None


_CLIENT_SECURITY = ("auth_token_file", "tls_ca_file", "tls_cert_file", "tls_key_file")


def _check_client_security(config: Config) -> None:
    """The client's token and TLS keys talk to a running service (data.address, or eval.address,
    which shares them); the trainer's own loopback server takes neither."""
    d = config.data
    given = [f"data.{key}" for key in _CLIENT_SECURITY if getattr(d, key)]
    if given and not d.address and not config.eval.address:
        raise ConfigError(f"{given[0]}={getattr(d, given[0][5:])!r} is for a running data service, but data.address "
                          "is empty: the trainer's own loopback server (data.dataset) takes no token and no TLS; set "
                          f"data.address=HOST:PORT (or eval.address) or leave {', '.join(given)} unset")


def _check_eval_data(config: Config) -> None:
    e = config.eval
    if not e.address and not e.dataset:
        raise ConfigError(f"eval.interval={e.interval} needs held-out data: set eval.dataset=DIR (a folder made by "
                          "`tessera-data build`) or eval.address=HOST:PORT (a running `tessera-data serve`)")
    if not e.address:
        if not Path(e.dataset).is_dir():
            raise ConfigError(f"eval.dataset={e.dataset!r}: no such folder; give a folder made by `tessera-data build`")
        if not (Path(e.dataset) / "manifest.json").is_file():
            raise ConfigError(f"eval.dataset={e.dataset!r} is not a dataset (it has no manifest.json); give a folder "
                              "made by `tessera-data build`")


# ---- the parallel layout ------------------------------------------------------------------

def _check_split(config: Config, world_size: int) -> int:
    """Divisibility of the model by tp/ep, the world by pp*cp*tp, the batch over dp, the
    pipeline split; sets and returns parallel.dp."""
    m, p, t = config.model, config.parallel, config.train
    moe = m.moe
    if m.attention == "mla" and m.num_heads % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide model.num_heads={m.num_heads} (MLA splits its heads over tp)")
    if m.attention != "mla" and (m.num_heads % p.tp or m.num_kv_heads % p.tp):
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
    if moe.num_experts:
        if moe.num_experts % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} must divide model.moe.num_experts={moe.num_experts}")
        if p.etp not in (1, p.tp):
            raise ConfigError(f"parallel.etp={p.etp} must be 1 (whole experts on every TP rank) or "
                              f"parallel.tp={p.tp} (expert hidden sizes split over TP)")
        hidden = moe.ffn_dim or m.ffn_dim
        shared = moe.shared_ffn_dim or moe.num_shared_experts * hidden
        for name, size in (("expert hidden size (model.moe.ffn_dim or model.ffn_dim)", hidden),
                           ("shared experts' hidden size", shared)):
            if size % p.etp:
                raise ConfigError(f"parallel.etp={p.etp} must divide the {name} = {size}")
    if m.num_layers < p.pp:
        raise ConfigError(f"model.num_layers={m.num_layers} is smaller than parallel.pp={p.pp}")
    rows_per_micro_step = t.micro_batch_size * dp
    if t.global_batch_size % rows_per_micro_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"micro_batch_size*dp = {t.micro_batch_size}*{dp} = {rows_per_micro_step}"
        )
    # Under (dynamic) context parallelism each rank's token count varies per batch; the CP
    # split pads it to a multiple of tp itself.
    if p.sequence_parallel and p.tp > 1 and p.cp == 1 and not p.dynamic_cp and (t.micro_batch_size * t.seq_len) % p.tp:
        raise ConfigError(f"train.micro_batch_size*train.seq_len = {t.micro_batch_size}*{t.seq_len} must be "
                          f"divisible by parallel.tp={p.tp} for sequence parallelism")
    try:  # also at pp=1: an interleaved schedule or fixed stage sizes there are a mistake
        check_schedule(p.pp_schedule, p.pp, p.pp_virtual_stages)
        partition_layers(m.num_layers, p.pp * p.pp_virtual_stages, p.pp_first_stage_layers, p.pp_last_stage_layers)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if p.pp > 1:
        accum = t.global_batch_size // rows_per_micro_step
        if p.pp_schedule == "interleaved" and accum % p.pp:
            raise ConfigError(f"the interleaved schedule needs micro-batches per step ({accum}) to be a multiple of "
                              f"parallel.pp={p.pp}: raise train.global_batch_size")
    return dp


def _check_train_layout(config: Config) -> None:
    """The train settings that run at tp=1 or pp=1 only."""
    t, p = config.train, config.parallel
    if torchao_fp8(config) and p.tp > 1:
        raise ConfigError(f"train.fp8_recipe={t.fp8_recipe!r} with the torch backend (torchao) runs at "
                          f"parallel.tp=1 only (now {p.tp}); use blockwise, or model.dense_backend='te'")
    if t.cuda_graphs and p.pp > 1:
        raise ConfigError(f"train.cuda_graphs=true runs at parallel.pp=1 only (now {p.pp}): a pipeline "
                          "schedule keeps several micro-batches in flight, whose graph outputs a replay would overwrite")


def cp_a2a_size(config: Config) -> int:
    """The all-to-all group of all-to-all CP: cp for "a2a", cp_a2a for "a2a+ring", 1 for the ring."""
    p = config.parallel
    return {"ring": 1, "a2a": p.cp, "a2a+ring": p.cp_a2a}[p.cp_comm]


def _check_cp_comm(config: Config) -> None:
    """All-to-all CP: the group sizes, and heads that split over them (core/parallel/ulysses.py).
    Under dynamic CP the sizes are the planner's (`_check_dynamic_cp`)."""
    p = config.parallel
    if p.cp_a2a and p.cp_comm != "a2a+ring":
        raise ConfigError(f"parallel.cp_a2a={p.cp_a2a} is read only with parallel.cp_comm='a2a+ring' (now "
                          f"{p.cp_comm!r}); set cp_comm='a2a+ring' or remove it")
    if p.dynamic_cp and p.cp_comm == "a2a+ring":
        raise ConfigError("parallel.dynamic_cp with parallel.cp_comm='a2a+ring' is not supported: the plan's "
                          "sub-groups change size every micro-batch, so there is no fixed all-to-all group inside "
                          "them to ring between; use cp_comm='a2a' (all-to-all over each sub-group) or 'ring'")
    if p.cp_comm == "ring" or p.cp == 1 or p.dynamic_cp:
        return
    if p.cp_comm == "a2a+ring" and not (1 < p.cp_a2a < p.cp and p.cp % p.cp_a2a == 0):
        raise ConfigError(f"parallel.cp_comm='a2a+ring' needs parallel.cp_a2a, the all-to-all group inside a node, "
                          f"between 2 and cp/2 and dividing parallel.cp={p.cp} (now {p.cp_a2a}); or use cp_comm='a2a'")
    _check_a2a_heads(config, cp_a2a_size(config), "choose an all-to-all group (parallel.cp or cp_a2a) that divides")


def _check_a2a_heads(config: Config, k: int, remedy: str) -> None:
    """Each rank's query heads split over an all-to-all of `k` ranks, and its key/value heads
    divide k or repeat to a multiple of it that divides the query heads. `remedy` ends with
    "divides": the line names the query heads after it."""
    p, m = config.parallel, config.model
    q_heads = m.num_heads // p.tp
    kv_heads = q_heads if m.attention == "mla" else m.num_kv_heads // p.tp
    if q_heads % k:
        raise ConfigError(f"parallel.cp_comm={p.cp_comm!r} splits each rank's {q_heads} query heads (model.num_heads="
                          f"{m.num_heads} / tp={p.tp}) over {k} ranks, which does not divide them; {remedy} "
                          f"{q_heads}, or cp_comm='ring'")
    if kv_heads % k and q_heads % math.lcm(kv_heads, k):
        raise ConfigError(f"parallel.cp_comm={p.cp_comm!r}: {kv_heads} key/value heads per rank cannot be repeated to "
                          f"a multiple of the all-to-all group {k} that divides the {q_heads} query heads; choose a "
                          f"group that divides or is a multiple of {kv_heads}")


def _check_dynamic_cp(config: Config, dp: int) -> None:
    p, t = config.parallel, config.train
    if p.pp > 1:
        raise ConfigError("parallel.dynamic_cp with parallel.pp > 1 is not supported: the pipeline schedule needs the "
                          "same micro-batches on every stage and rank; use parallel.pp=1")
    moe = config.model.moe
    if moe.num_experts and moe.capacity_factor > 0:
        raise ConfigError("parallel.dynamic_cp with model.moe.capacity_factor > 0 is not supported: capacity is counted "
                          "per rank's tokens, so which tokens drop would depend on each step's plan; use "
                          "capacity_factor=0 (dropless)")
    if p.cp_token_budget == 0:
        p.cp_token_budget = max(1, t.micro_batch_size * t.seq_len // p.cp)
    # A document piece has up to seq_len tokens; it must fit the largest aligned power-of-two
    # group of the dp*cp ranks, padded to a multiple of 2g (the zigzag split).
    g = 1 << ((dp * p.cp).bit_length() - 1)
    if p.cp_comm == "a2a":
        # The planner may put any micro-batch on a group of any power of two up to g; every
        # one of them must split the heads (g dividing them implies the smaller ones do).
        size = 2
        while size <= g:
            _check_a2a_heads(config, size, f"parallel.dynamic_cp may plan a micro-batch on any power of two up "
                                           f"to {g} of the dp*cp = {dp * p.cp} ranks; use dp*cp ranks whose largest "
                                           f"power of two divides")
            size *= 2
    need = t.seq_len if g == 1 else -(-t.seq_len // (2 * g)) * 2
    if p.cp_token_budget < need:
        raise ConfigError(
            f"parallel.cp_token_budget={p.cp_token_budget} is too small: a document piece of train.seq_len="
            f"{t.seq_len} tokens over the largest CP group of {g} of the dp*cp = {dp * p.cp} ranks needs {need} "
            f"tokens per rank; give parallel.cp_token_budget >= {need}"
        )
