"""The training systems bench/peers.py sets side by side, each behind one builder.

A builder takes the workload (`Spec`), the shared micro-batches (`Feed`) and the reference
weights, and returns a `Built`: one optimizer step as a callable that returns the step's mean
token loss, plus the parameter counts the shared MFU formula reads. A system that cannot run
here raises `Unavailable` with one line saying why; the bench reports it and goes on.

Every system gets the same model (Tessera's `build_model(cfg, seed=0)` weights, copied in by
name where the architecture is the same), the same rows, targets (next token, -100 at each
row's end) and document boundaries, micro-batch, accumulation, AdamW (betas 0.9/0.95, eps 1e-8,
no weight decay, constant lr) and global-norm clipping at 1.0. The peers are optional,
benchmark-only dependencies: imported here at build time, never by the product.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import socket
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch

from bench.train_step import moe_after_step
from core.precision import te_backend
from core.config import Config, ModelConfig
from core.train.data import StepInputs
from core.layers import AttentionMeta
from core.train.model import build_model, count_params
from core.train.trainer import Trainer
from dataservice.packing import IGNORE_INDEX
from interop.families import tensor_map

EOS = 0  # the token that ends every document (TorchTitan finds boundaries by it)
BETAS, EPS, CLIP = (0.9, 0.95), 1e-8, 1.0
TORCHTITAN_API = "0.2"  # the JobConfig/TrainSpec API; 0.3 needs a torch newer than 2.11


class Unavailable(Exception):
    """A system that cannot run a workload here; its message is the one line the bench prints."""


@dataclass
class Spec:
    """What every system of a workload runs."""

    model: ModelConfig  # Tessera's config: the reference shapes
    seq: int
    batch: int  # rows per micro-batch
    accum: int  # micro-batches per optimizer step
    precision: str  # "bf16", "fp8" or "fp32"
    compile: bool
    recompute: str  # "none", "selective" or "full" (Tessera's names; each peer maps it)
    packed: bool  # rows of several documents
    lr: float
    device: torch.device
    # Tessera's own recompute_modules in place of `recompute` (each system its own choice); None: `recompute`
    tessera_modules: tuple[str, ...] | None = None
    tessera_recompute_layers: int = 0  # Tessera's train.recompute_num_layers (0: every block)
    tessera_split_masters: bool = False  # Tessera's parallel.split_master_weights
    recompute_forced: bool = False  # `recompute` was asked for, not the workload's default: every system runs it
    tessera_fp8_recipe: str = "blockwise"  # Tessera's train.fp8_recipe (model.dense_backend is in `model`)
    tessera_cuda_graphs: bool = False  # Tessera's train.cuda_graphs (with compile)
    tessera_fused_loss: bool = False  # Tessera's train.fused_loss


@dataclass
class Micro:
    """One micro-batch in the layouts the systems read."""

    tokens: torch.Tensor  # [B, S]
    targets: torch.Tensor  # [B, S]: the next token, -100 at each row's end
    positions: torch.Tensor  # [B, S]: position inside its document
    cu_seqlens: torch.Tensor  # [docs + 1] int32 over the flattened rows
    max_seqlen: int
    num_labels: int
    doc_lengths: tuple[int, ...] | None = None  # on the host, as Tessera's data client hands them over

    def flat(self) -> StepInputs:
        meta = AttentionMeta(cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen, doc_lengths=self.doc_lengths)
        return StepInputs(self.tokens.reshape(-1), self.targets.reshape(-1), self.positions.reshape(-1), meta,
                          num_tokens=float(self.tokens.numel()), num_labels=float(self.num_labels))


class Feed:
    """A system's own cursor over the shared pool: every system reads the same sequence."""

    def __init__(self, pool: list[Micro]):
        self.pool, self.at = pool, 0

    def next(self) -> Micro:
        micro = self.pool[self.at % len(self.pool)]
        self.at += 1
        return micro


@dataclass
class Built:
    step: Callable[[], object]  # one optimizer step; returns its mean token loss (tensor or float)
    params: tuple[int, int, int]  # (total, input embedding, active per token)
    attention_width: float  # what core.metrics.flops_per_token counts as the attention width
    setup: str  # the system's recipe in one line


def optional(module: str, why: str):
    """Import a peer; Unavailable (one line) when it is missing or does not import here."""
    try:
        return importlib.import_module(module)
    except Exception as err:  # an incompatible release fails with any error, not only ImportError
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise Unavailable(f"{why}: {type(err).__name__}: {first}") from None


def _stand_in_for_hf_datasets() -> None:
    """TorchTitan's model specs import its Hugging Face text loader, which imports `datasets`
    (with pyarrow and pandas, ~70 MB of wheels). This bench never builds that loader: it feeds
    the shared micro-batches. Where `datasets` is not installed, an empty module answers the
    import, and anything taken from it raises when used."""
    if importlib.util.find_spec("datasets") is not None:
        return

    def unused(*args, **kwargs):
        raise RuntimeError("the `datasets` package is not installed: bench/peers.py feeds TorchTitan its own batches")

    def attribute(attr: str):
        if attr.startswith("__"):  # what import machinery and inspect probe for
            raise AttributeError(attr)
        return unused

    for name in ("datasets", "datasets.distributed"):
        module = types.ModuleType(name)
        module.__getattr__ = attribute
        sys.modules[name] = module


def _autocast(spec: Spec):
    """bf16 autocast over fp32 parameters (what AMP training loops do); nothing in fp32."""
    if spec.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(spec.device.type, dtype=torch.bfloat16)


def _adamw(params, spec: Spec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec.lr, betas=BETAS, eps=EPS, weight_decay=0.0,
                             fused=spec.device.type == "cuda")


def _expert_share(model: torch.nn.Module, suffix: str, top_k: int, experts: int) -> int:
    """Routed-expert parameters one token does not use: all but top_k / E of each experts module."""
    idle = 0
    for name, module in model.named_modules():
        if name.endswith(suffix) and not name.endswith("shared_" + suffix):
            n = sum(p.numel() for p in module.parameters())
            idle += n - n * top_k // experts
    return idle


def _counts(model: torch.nn.Module, embedding: torch.nn.Module, spec: Spec, suffix: str = "experts") -> tuple:
    total = sum(p.numel() for p in model.parameters())
    moe = spec.model.moe
    idle = _expert_share(model, suffix, moe.top_k, moe.num_experts) if moe.num_experts else 0
    return total, embedding.weight.numel(), total - idle


def reference_weights(spec: Spec) -> dict[str, torch.Tensor]:
    """Tessera's initial weights for this model (seed 0, as its Trainer builds them), on the CPU."""
    return build_model(spec.model, seed=0).state_dict()


def hf_llama_weights(spec: Spec, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference weights under Hugging Face Llama names (interop's own map)."""
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    return {link.hf[0]: weights[link.name] for link in tensor_map("llama", shapes)}


def hf_glm4_moe_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference weights of the DeepSeek-like MoE under Glm4Moe names: Llama's names for the
    attention, norms and dense layers; the router and its bias; routed experts fused as
    gate_up_proj [E, 2I, H] and down_proj [E, H, I] (Tessera keeps [E, in, out]: gate_up_proj is
    w13 [E, H, 2, I] transposed, gate rows first); shared experts."""
    out, rest = {}, {}
    for key, value in weights.items():
        layer, _, name = key.partition(".feed_forward.")
        prefix = f"model.{layer}.mlp."
        if name == "router.weight":
            out[prefix + "gate.weight"] = value
        elif name == "router.expert_bias":
            out[prefix + "gate.e_score_correction_bias"] = value
        elif name == "experts.w13":
            out[prefix + "experts.gate_up_proj"] = value.flatten(2).transpose(1, 2)
        elif name == "experts.w2":
            out[prefix + "experts.down_proj"] = value.transpose(1, 2)
        elif name.startswith("shared_experts."):
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[name.split(".")[1]]
            out[prefix + f"shared_experts.{proj}.weight"] = value
        else:
            rest[key] = value
    shapes = {k: tuple(v.shape) for k, v in rest.items()}
    out.update({link.hf[0]: rest[link.name] for link in tensor_map("llama", shapes)})
    return out


def copy_by_name(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy into `model`'s parameters, names read through compile and checkpoint wrappers;
    every parameter must be found (a silent miss would compare different models)."""
    wrappers = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
    missing = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name
            for w in wrappers:
                key = key.replace(w, "")
            if key not in weights:
                missing.append(key)
                continue
            src = weights[key]
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(src.to(local.dtype).reshape(local.shape))
    if missing:
        raise RuntimeError(f"no reference weight for {len(missing)} parameters, e.g. {missing[:3]}")


# -- Tessera ---------------------------------------------------------------------------------


def tessera(spec: Spec, feed: Feed, weights) -> Built:
    """Trainer.step then Trainer.record, as bench/train_step.py and the trainer's own loop run them."""
    config = Config(model=spec.model)
    t = config.train
    t.device, t.seed, t.seq_len = spec.device.type, 0, spec.seq
    t.compile, t.precision = spec.compile, spec.precision
    t.cuda_graphs = spec.compile and spec.tessera_cuda_graphs
    t.fused_loss = spec.tessera_fused_loss
    config.parallel.split_master_weights = spec.tessera_split_masters
    if spec.tessera_modules is None:
        t.recompute = spec.recompute
    else:
        t.recompute, t.recompute_modules = "none", list(spec.tessera_modules)
        t.recompute_num_layers = spec.tessera_recompute_layers
    if spec.precision == "fp8":
        t.fp8_recipe = spec.tessera_fp8_recipe
    t.micro_batch_size, t.global_batch_size = spec.batch, spec.batch * spec.accum
    t.lr = t.min_lr = spec.lr
    t.warmup_steps, t.weight_decay, t.beta1, t.beta2, t.eps, t.grad_clip = 0, 0.0, *BETAS, EPS, CLIP
    t.max_steps = 10**6
    trainer = Trainer(config)
    flat = {id(m): m.flat() for m in feed.pool}

    def step():
        start = time.perf_counter()
        micro = [flat[id(feed.next())] for _ in range(spec.accum)]
        return trainer.record(trainer.step(micro), start)["loss"]

    recompute = (f"recompute {spec.recompute}" if spec.tessera_modules is None
                 else f"recompute_modules {'+'.join(spec.tessera_modules) or 'none'}"
                 + (f" in the first {spec.tessera_recompute_layers} blocks" if spec.tessera_recompute_layers else ""))
    return Built(step, _tessera_counts(spec), spec.model.num_heads * spec.model.attention_head_dim,
                 f"Trainer.step+record, precision {spec.precision}"
                 f"{' (' + spec.tessera_fp8_recipe + ')' if spec.precision == 'fp8' else ''}, "
                 f"dense backend {spec.model.dense_backend}, {recompute}, compile {spec.compile}"
                 f"{', CUDA graphs' if t.cuda_graphs else ''}{', fused loss' if t.fused_loss else ''}"
                 f"{', split masters' if config.parallel.split_master_weights else ''}")


def _tessera_counts(spec: Spec) -> tuple[int, int, int]:
    """The plain model's counts, as the Trainer takes them (one rank holds the whole model)."""
    with torch.device("meta"):
        return count_params(build_model(spec.model, seed=0))


# -- a plain PyTorch loop (the model of bench/train_step.py's baseline), with torchao FP8 ----


def torchao_fp8(recipe: str) -> Callable[[Spec, Feed, dict], Built]:
    """torchao float8 training: `convert_to_float8_training` on the plain model (every block
    linear; the output head stays bf16, as torchao's recipes advise), compiled whole, bf16
    autocast over fp32 parameters, fused AdamW."""

    def build(spec: Spec, feed: Feed, weights) -> Built:
        if spec.precision != "fp8":
            raise Unavailable(f"torchao {recipe}: an FP8 recipe, run in the dense-fp8 workload only")
        float8 = optional("torchao.float8", "torchao is not installed (pip install torchao)")
        model = build_model(spec.model, seed=0).to(spec.device)
        emulate = spec.device.type != "cuda"  # the CPU smoke path: exact emulation of the FP8 GEMMs
        cfg = float8.Float8LinearConfig.from_recipe_name(recipe)
        if emulate:
            cfg = dataclasses.replace(cfg, emulate=True)
        float8.convert_to_float8_training(model, config=cfg, module_filter_fn=lambda mod, fqn: fqn != "output")
        return _plain_loop(model, spec, feed, f"torchao {recipe} float8 on the plain model")

    return build


def _plain_loop(model: torch.nn.Module, spec: Spec, feed: Feed, what: str) -> Built:
    run = torch.compile(model) if spec.compile else model
    opt = _adamw(model.parameters(), spec)
    after = moe_after_step(model)
    flat = {id(m): m.flat() for m in feed.pool}

    def step():
        total = None
        for _ in range(spec.accum):
            micro = flat[id(feed.next())]
            with _autocast(spec):
                logits = run(micro.tokens, micro.position_ids, micro.meta)
            loss = torch.nn.functional.cross_entropy(logits.float(), micro.labels, ignore_index=IGNORE_INDEX,
                                                     reduction="sum") / (micro.num_labels * spec.accum)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after()
        return total

    params = count_params(model)
    return Built(step, params, spec.model.num_heads * spec.model.attention_head_dim,
                 f"{what}, compile {spec.compile}, bf16 autocast, fused AdamW")


# -- Hugging Face transformers ---------------------------------------------------------------


def huggingface(spec: Spec, feed: Feed, weights) -> Built:
    """LlamaForCausalLM (dense) or Glm4MoeForCausalLM (the DeepSeek-like MoE: GQA attention,
    sigmoid group-limited routing, shared experts) with SDPA, torch.compile of the whole model,
    bf16 autocast over fp32 parameters, fused AdamW, and the model's own loss with
    num_items_in_batch (the HF Trainer's gradient-accumulation normalisation). Packed rows pass
    position_ids that restart at each document: transformers then builds a block-causal mask
    (SDPA with an explicit mask)."""
    if spec.precision == "fp8":
        raise Unavailable("hf: bf16 only here (transformers' FP8 training is torchao's convert, measured "
                          "on the plain model)")
    transformers = optional("transformers", "transformers is not installed")
    m = spec.model
    if m.moe.num_experts:
        model = _hf_moe(transformers, spec)
        model.load_state_dict(hf_glm4_moe_weights(weights), strict=True)
        counts = _counts(model, model.model.embed_tokens, spec)
        setup = "Glm4MoeForCausalLM (Tessera's initial weights; no auxiliary loss)"
    else:
        config = transformers.LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.attention_head_dim,
            rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, max_position_embeddings=max(spec.seq, 2048),
            tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False, use_cache=False)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                            dtype=torch.float32)
        model.load_state_dict(hf_llama_weights(spec, weights), strict=True)
        counts = _counts(model, model.model.embed_tokens, spec)
        setup = "LlamaForCausalLM (Tessera's initial weights)"
    model.config.use_cache = False
    if spec.recompute != "none":  # transformers has whole-layer checkpointing only
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(spec.device).train()
    run = torch.compile(model) if spec.compile else model
    opt = _adamw(model.parameters(), spec)

    def step():
        total = None
        n = sum(feed.pool[(feed.at + i) % len(feed.pool)].num_labels for i in range(spec.accum))
        for _ in range(spec.accum):
            micro = feed.next()
            with _autocast(spec):
                out = run(input_ids=micro.tokens, position_ids=micro.positions, labels=micro.tokens,
                          num_items_in_batch=torch.tensor(n, device=spec.device))
            out.loss.backward()
            total = out.loss.detach() if total is None else total + out.loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    packing = "position_ids (block-causal mask)" if spec.packed else "one document per row"
    return Built(step, counts, m.num_heads * m.attention_head_dim,
                 f"{setup}, SDPA, {packing}, compile {spec.compile}, "
                 f"gradient checkpointing {spec.recompute != 'none'}")


def _hf_moe(transformers, spec: Spec):
    m, moe = spec.model, spec.model.moe
    if not hasattr(transformers, "Glm4MoeConfig"):
        raise Unavailable(f"hf: transformers {transformers.__version__} has no Glm4Moe (the DeepSeek-V3 MoE with GQA "
                          "attention); DeepseekV3 uses MLA and Qwen3-MoE softmax routing without shared experts")
    if moe.moe_every != 1 or moe.dense_layers:
        raise Unavailable("hf: Glm4Moe puts MoE on every layer after the first_k_dense")
    config = transformers.Glm4MoeConfig(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.attention_head_dim,
        rms_norm_eps=m.norm_eps, max_position_embeddings=max(spec.seq, 2048), tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta, "partial_rotary_factor": 1.0},
        attention_bias=False, moe_intermediate_size=moe.ffn_dim, num_experts_per_tok=moe.top_k,
        n_shared_experts=moe.num_shared_experts, n_routed_experts=moe.num_experts,
        routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_groups, topk_group=moe.topk_groups,
        first_k_dense_replace=moe.first_k_dense, norm_topk_prob=moe.normalize_topk, use_qk_norm=m.qk_norm,
        initializer_range=m.init_std, use_cache=False, num_mtp_layers=0)
    experts = "grouped_mm" if spec.device.type == "cuda" else "eager"
    try:
        return transformers.Glm4MoeForCausalLM._from_config(config, attn_implementation="sdpa",
                                                             experts_implementation=experts,
                                                             dtype=torch.float32)
    except TypeError:  # a transformers without selectable expert kernels
        return transformers.Glm4MoeForCausalLM._from_config(config, attn_implementation="sdpa",
                                                             dtype=torch.float32)


# -- TorchTitan ------------------------------------------------------------------------------


class _Tokenizer:
    """All TorchTitan reads of a tokenizer here: the id that ends a document (its masks)."""

    eos_id = EOS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchtitan(spec: Spec, feed: Feed, weights) -> Built:
    """TorchTitan's own Trainer: its model (Llama3 `Transformer`, or `DeepSeekV3Model` for the
    MoE), its parallelize function (activation checkpointing, per-block torch.compile of model
    and loss, FP8 through its torchao converter; on one rank FSDP is off and its
    `maybe_enable_amp` runs bf16 autocast over fp32 parameters), its optimizer and LR scheduler
    builders, and its `train_step` (gradient accumulation normalised by the global token count,
    `clip_grad_norm_`, optimizer and scheduler steps), fed the shared micro-batches."""
    titan = optional("torchtitan", "torchtitan is not installed (pip install torchtitan==0.2.2)")
    version = getattr(titan, "__version__", "0")
    if not version.startswith(TORCHTITAN_API):
        raise Unavailable(f"torchtitan {version}: this bench drives the {TORCHTITAN_API} API "
                          "(torchtitan 0.3 needs a torch newer than 2.11)")
    _stand_in_for_hf_datasets()
    train = optional("torchtitan.train", f"torchtitan {version} does not import with torch {torch.__version__}")
    where = optional("torchtitan.tools.utils", "torchtitan's utils").device_type
    if where != spec.device.type:  # it picks CUDA whenever no other accelerator is found
        raise Unavailable(f"torchtitan {version} runs on {where}, not {spec.device.type}")
    specs = optional("torchtitan.protocols.train_spec", "torchtitan's train_spec")
    config_mod = optional("torchtitan.config", "torchtitan's config")
    m = spec.model
    if m.moe.num_experts:
        base, args, width = _titan_moe(spec)
    else:
        base, args, width = _titan_dense(spec)
    name = f"tessera_peers_{os.getpid()}_{len(specs._extra_train_specs)}"
    specs.register_train_spec(name, dataclasses.replace(
        specs.get_train_spec(base), model_args={"peer": args}, build_tokenizer_fn=lambda job_config: _Tokenizer(),
        build_dataloader_fn=None, build_validator_fn=None))

    job = config_mod.JobConfig()
    job.job.dump_folder = tempfile.mkdtemp(prefix="tessera-peers-titan-")
    job.model.name, job.model.flavor = name, "peer"
    tr = job.training
    tr.local_batch_size, tr.global_batch_size, tr.seq_len = spec.batch, spec.batch * spec.accum, spec.seq
    tr.steps, tr.max_norm = 10**6, CLIP
    tr.mixed_precision_param = "float32" if spec.precision == "fp32" else "bfloat16"
    o = job.optimizer
    o.lr, o.beta1, o.beta2, o.eps, o.weight_decay = spec.lr, *BETAS, EPS, 0.0
    o.implementation = "fused" if spec.device.type == "cuda" else "foreach"
    job.lr_scheduler.warmup_steps, job.lr_scheduler.decay_ratio = 0, 0.0
    job.metrics.log_freq = 10**9  # the losses are read here, after the timing, as for the other systems
    # TorchTitan's recommended selective AC is per-op; "full" when the workload recomputes whole
    # blocks; none only when asked for (--recompute none)
    job.activation_checkpoint.mode = ("none" if spec.recompute == "none" and spec.recompute_forced
                                      else "full" if spec.recompute == "full" else "selective")
    job.activation_checkpoint.selective_ac_option = "op"
    job.compile.enable, job.compile.components = spec.compile, ["model", "loss"]
    if spec.precision == "fp8":
        job.model.converters = ["quantize.linear.float8"]
        f8 = job.quantize.linear.float8
        f8.recipe_name, f8.filter_fqns, f8.emulate = "rowwise", ["output"], spec.device.type != "cuda"
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)

    losses: list[torch.Tensor] = []

    class PeerTrainer(train.Trainer):
        def forward_backward_step(self, **kwargs):
            loss = super().forward_backward_step(**kwargs)
            losses.append(loss.detach())
            return loss

    trainer = PeerTrainer(job)
    model = trainer.model_parts[0]
    if not m.moe.num_experts:
        adapter = trainer.train_spec.state_dict_adapter(args, None)
        copy_by_name(model, adapter.from_hf(hf_llama_weights(spec, weights)))

    on_host: dict[int, tuple[dict, torch.Tensor]] = {}

    def batches():
        # Its train_step counts the target tokens on the host and moves each micro-batch to the
        # GPU itself, as it does with its own data loader: host copies, made once per micro-batch.
        while True:
            micro = feed.next()
            if id(micro) not in on_host:
                inputs = {"input": micro.tokens.cpu()}
                if spec.packed:  # rotary positions restart at each document, as in the other systems
                    inputs["positions"] = micro.positions.cpu()
                on_host[id(micro)] = inputs, micro.targets.cpu()
            inputs, targets = on_host[id(micro)]
            yield dict(inputs), targets  # its train_step moves the dict's tensors in place

    data = trainer.batch_generator(batches())  # its own wrapper: data-loading times, token counts

    def step():
        losses.clear()
        trainer.step += 1
        trainer.train_step(data)
        return torch.stack(losses).sum()

    counts = _counts(model, model.tok_embeddings, spec)
    attention = "flex block-causal (documents split at EOS)" if spec.packed else "sdpa causal"
    return Built(step, counts, width,
                 f"torchtitan {version} {base} Trainer.train_step, {attention}, AC {job.activation_checkpoint.mode}"
                 f"{'/op' if job.activation_checkpoint.mode == 'selective' else ''}, compile {spec.compile}, "
                 f"{'float8 rowwise converter, ' if spec.precision == 'fp8' else ''}"
                 f"{'AMP bf16' if spec.precision != 'fp32' else 'fp32'}, no FSDP on one rank")


def _titan_dense(spec: Spec):
    """TorchTitan's Llama3 args for Tessera's dense shapes: its FFN width formula
    (multiple_of * ceil(8 dim / 3 / multiple_of)) lands exactly on ffn_dim with multiple_of = ffn_dim."""
    llama = optional("torchtitan.models.llama3", "torchtitan's llama3")
    m = spec.model
    if m.qk_norm or m.attention_bias or (m.head_dim and m.head_dim != m.dim // m.num_heads):
        raise Unavailable("torchtitan: Llama3 has no qk-norm, attention bias or free head_dim")
    hidden = int(2 * 4 * m.dim / 3)
    multiplier = None if hidden <= m.ffn_dim else m.ffn_dim / hidden
    args = llama.TransformerModelArgs(
        dim=m.dim, n_layers=m.num_layers, n_heads=m.num_heads, n_kv_heads=m.num_kv_heads, vocab_size=m.vocab_size,
        multiple_of=m.ffn_dim, ffn_dim_multiplier=multiplier, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        max_seq_len=spec.seq, attn_type="flex" if spec.packed else "sdpa",
        attn_mask_type="block_causal" if spec.packed else "causal", eos_id=EOS)
    if m.rope_scaling.type != "none":
        raise Unavailable("torchtitan: Llama3's rope scaling is its own (llama3 only), not this model's")
    return "llama3", args, m.num_heads * m.attention_head_dim


def _titan_moe(spec: Spec):
    """TorchTitan's DeepSeekV3Model with the MoE of Tessera's config (dense first layers, E routed
    experts of moe.ffn_dim, top-k of a sigmoid within groups, normalised and scaled, shared
    experts, bias balancing). Its attention is MLA (its DeepSeek-V3 has no GQA option), with
    the 16B flavour's ranks; MFU counts its own parameters and attention width."""
    ds = optional("torchtitan.models.deepseek_v3", "torchtitan's deepseek_v3")
    moe_mod = optional("torchtitan.models.moe", "torchtitan's moe")
    m, moe = spec.model, spec.model.moe
    if moe.moe_every != 1 or moe.dense_layers:
        raise Unavailable("torchtitan: DeepSeekV3Model has MoE on every layer after n_dense_layers")
    moe_args = moe_mod.MoEArgs(
        num_experts=moe.num_experts, num_shared_experts=moe.num_shared_experts, score_func=moe.router,
        route_norm=moe.normalize_topk, route_scale=moe.routed_scaling_factor, top_k=moe.top_k,
        num_expert_groups=moe.n_groups if moe.n_groups > 1 else None,
        num_limited_groups=moe.topk_groups if moe.n_groups > 1 else None,
        use_grouped_mm=spec.device.type == "cuda",  # its grouped GEMM needs a GPU; the loop elsewhere
        load_balance_coeff=moe.bias_update_rate or None)
    nope, rope, v = 128, 64, 128
    if spec.model.dim < 512:  # the smoke shapes: MLA ranks to scale
        nope, rope, v = m.attention_head_dim, m.attention_head_dim // 2, m.attention_head_dim
    args = ds.DeepSeekV3ModelArgs(
        vocab_size=m.vocab_size, dim=m.dim, inter_dim=m.ffn_dim, moe_inter_dim=moe.ffn_dim, n_layers=m.num_layers,
        n_dense_layers=moe.first_k_dense, n_heads=m.num_heads, norm_eps=m.norm_eps, moe_args=moe_args,
        q_lora_rank=0, kv_lora_rank=4 * nope if m.dim >= 512 else 2 * nope, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v, max_seq_len=spec.seq, original_seq_len=spec.seq, rope_theta=m.rope_theta,
        attn_type="flex" if spec.packed else "sdpa", attn_mask_type="block_causal" if spec.packed else "causal")
    return "deepseek_v3", args, m.num_heads * ((nope + rope) + v) / 2


# -- Megatron-Core ---------------------------------------------------------------------------

MEGATRON_API = "0.19"  # TransformerConfig, GPTModel, DDP, get_megatron_optimizer as megatron-core 0.19 has them
# Megatron's non-TE linears (the output layer) fuse the weight-gradient accumulation only with
# Apex's extension; without it a Megatron user runs --no-gradient-accumulation-fusion
_WGRAD_FUSION = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def megatron_gpt_weights(m: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference weights under Megatron-Core GPTModel names. Its fused QKV interleaves per
    query group ([the group's query heads; its key; its value] for each group in turn, the grouping
    Tessera's repeat_interleave GQA reads); linear_fc1 is [gate; up] (silu on the first half). The
    input norms sit in linear_qkv / linear_fc1 as layer_norm_weight in the Transformer Engine layer
    spec, as input_layernorm / pre_mlp_layernorm in the local spec: both names are given."""
    head, groups = m.attention_head_dim, m.num_kv_heads
    out = {"embedding.word_embeddings.weight": weights["tok_embeddings.weight"],
           "decoder.final_layernorm.weight": weights["norm.weight"],
           "output_layer.weight": weights["output.weight"]}
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (weights[f"{src}attention.{w}.weight"] for w in ("wq", "wk", "wv"))
        qkv = torch.cat([q.reshape(groups, -1, m.dim), k.reshape(groups, head, m.dim), v.reshape(groups, head, m.dim)],
                        dim=1)
        out[dst + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, m.dim)
        out[dst + "self_attention.linear_proj.weight"] = weights[src + "attention.wo.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([weights[src + "feed_forward.w1.weight"],
                                                        weights[src + "feed_forward.w3.weight"]])
        out[dst + "mlp.linear_fc2.weight"] = weights[src + "feed_forward.w2.weight"]
        for norm, fused, local in (("attention_norm", "self_attention.linear_qkv", "input_layernorm"),
                                   ("ffn_norm", "mlp.linear_fc1", "pre_mlp_layernorm")):
            out[f"{dst}{fused}.layer_norm_weight"] = out[f"{dst}{local}.weight"] = weights[f"{src}{norm}.weight"]
    return out


def megatron_gpt(spec: Spec, transformer_engine: bool):
    """Megatron-Core's TransformerConfig and GPTModel for Tessera's dense shapes (SwiGLU, RMSNorm,
    no biases, GQA, rotary, no dropout), on the current device, parameters in bf16 unless fp32.
    The local layer spec (Megatron's own modules) where `transformer_engine` is false. Needs
    torch.distributed and megatron.core.parallel_state initialised."""
    transformer = optional("megatron.core.transformer", "megatron-core's transformer")
    layer_specs = optional("megatron.core.models.gpt.gpt_layer_specs", "megatron-core's GPT layer specs")
    gpt = optional("megatron.core.models.gpt", "megatron-core's GPTModel")
    m = spec.model
    if m.qk_norm or m.attention_bias or m.rope_scaling.type != "none":
        raise Unavailable("megatron: this bench maps Llama-like blocks only (no qk-norm, attention bias or rope scaling)")
    cuda = spec.device.type == "cuda"
    half = spec.precision != "fp32"
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.dim, num_attention_heads=m.num_heads, num_query_groups=m.num_kv_heads,
        kv_channels=m.attention_head_dim, ffn_hidden_size=m.ffn_dim, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=m.norm_eps,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=half,
        params_dtype=torch.bfloat16 if half else torch.float32, pipeline_dtype=torch.bfloat16 if half else torch.float32,
        # the reference weights are copied over every parameter: Megatron's own init would be discarded
        perform_initialization=False, use_cpu_initialization=not cuda,
        # Megatron-LM's command-line defaults (its fused kernels) on the GPU; the plain ops elsewhere
        bias_activation_fusion=cuda, masked_softmax_fusion=cuda, bias_dropout_fusion=cuda, apply_rope_fusion=cuda,
        persist_layer_norm=cuda, gradient_accumulation_fusion=cuda and transformer_engine and _WGRAD_FUSION,
        cross_entropy_loss_fusion=cuda, calculate_per_token_loss=True)
    if spec.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif spec.recompute == "selective":
        kwargs.update(recompute_granularity="selective")  # its default module: core attention
    if spec.precision == "fp8":
        # Megatron's default FP8 recipe (delayed scaling, E4M3 forward / E5M2 gradients) with the
        # amax history of its Llama 3 H100 FP8 example
        kwargs.update(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    config = transformer.TransformerConfig(**kwargs)
    layer = (layer_specs.get_gpt_layer_with_transformer_engine_spec() if transformer_engine
             else layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = gpt.GPTModel(config, layer, vocab_size=m.vocab_size, max_sequence_length=spec.seq,
                         position_embedding_type="rope", rotary_base=m.rope_theta,
                         share_embeddings_and_output_weights=m.tie_embeddings)
    return config, model


def megatron_distributed(spec: Spec) -> None:
    """One rank of torch.distributed (NCCL on the GPU, gloo elsewhere) and Megatron's model-parallel
    state at TP = PP = 1, unless this process has them already (another system, an earlier workload)."""
    parallel_state = optional("megatron.core.parallel_state", "megatron-core's parallel_state")
    if not torch.distributed.is_initialized():
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
            os.environ.setdefault(key, value)
        torch.distributed.init_process_group("nccl" if spec.device.type == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def megatron_core(spec: Spec, feed: Feed, weights) -> Built:
    """Megatron-Core as a Megatron-LM pretraining run drives it on one GPU: GPTModel with the
    Transformer Engine layer spec (TE's fused norm+linear, attention and, for FP8, its delayed
    scaling recipe) in bf16 parameters inside Float16Module, Megatron's DistributedDataParallel
    (fp32 gradient buffer) and DistributedOptimizer (fp32 master weights, Adam with decoupled
    weight decay, its global-norm clipping), the no-pipelining schedule from
    get_forward_backward_func over the accumulation's micro-batches, per-token loss normalisation
    (calculate_per_token_loss: summed token losses, gradients divided by the step's label count in
    finalize_model_grads), recompute per the workload, packed documents in the THD layout
    (PackedSeqParams over the shared cu_seqlens). Weights: Tessera's, rounded once to bf16."""
    te_backend.prefer_torch_cudnn()  # megatron.core imports Transformer Engine
    mcore = optional("megatron.core", "megatron-core is not installed (pip install megatron-core==0.19.2)")
    version = getattr(mcore, "__version__", "0")
    if not version.startswith(MEGATRON_API):
        raise Unavailable(f"megatron-core {version}: this bench drives the {MEGATRON_API} API")
    if spec.device.type != "cuda":
        raise Unavailable("megatron: its DDP, distributed optimizer and schedules allocate on CUDA "
                          "(its model alone runs here: tests/test_peers_bench.py checks it against Tessera's)")
    if spec.model.moe.num_experts:
        raise Unavailable("megatron: Tessera's DeepSeek-like MoE is not mapped onto Megatron's MoE layer in this bench")
    optional("transformer_engine.pytorch", "megatron: its Transformer Engine layer spec needs transformer_engine")
    ddp_mod = optional("megatron.core.distributed", "megatron-core's distributed")
    optim = optional("megatron.core.optimizer", "megatron-core's optimizer")
    schedules = optional("megatron.core.pipeline_parallel", "megatron-core's pipeline_parallel")
    module = optional("megatron.core.transformer.module", "megatron-core's transformer module")
    random = optional("megatron.core.tensor_parallel", "megatron-core's tensor_parallel")
    packing = optional("megatron.core.packed_seq_params", "megatron-core's packed_seq_params")
    torch.cuda.set_device(spec.device.index if spec.device.index is not None else torch.cuda.current_device())
    megatron_distributed(spec)
    random.model_parallel_cuda_manual_seed(0)  # its RNG tracker, which recompute forks
    config, gpt = megatron_gpt(spec, transformer_engine=True)
    copy_by_name(gpt, megatron_gpt_weights(spec.model, weights))
    counts = _counts(gpt, gpt.embedding.word_embeddings, spec)
    model = module.Float16Module(config, gpt) if spec.precision != "fp32" else gpt
    model = ddp_mod.DistributedDataParallel(
        config=config, module=model,
        ddp_config=ddp_mod.DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                         use_distributed_optimizer=True))
    opt = optim.get_megatron_optimizer(optim.OptimizerConfig(
        optimizer="adam", lr=spec.lr, weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
        clip_grad=CLIP, bf16=spec.precision != "fp32", params_dtype=config.params_dtype,
        use_distributed_optimizer=True), [model])
    # what Megatron-LM's training loop sets before its first step
    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = ddp_mod.finalize_model_grads
    forward_backward = schedules.get_forward_backward_func()

    inputs: dict[int, dict] = {}

    def prepared(micro: Micro) -> dict:
        # Megatron's batch: [b, s] tokens, positions, labels and a loss mask (the model returns
        # [b, s] token losses); packed rows become one THD row with the documents' cu_seqlens
        if id(micro) not in inputs:
            shape = (1, -1) if spec.packed else micro.tokens.shape
            batch = {"input_ids": micro.tokens.reshape(shape), "position_ids": micro.positions.reshape(shape),
                     "labels": micro.targets.clamp(min=0).reshape(shape),
                     "mask": (micro.targets != IGNORE_INDEX).reshape(-1).float()}
            batch["count"] = batch["mask"].sum().to(torch.int)
            if spec.packed:
                batch["packed_seq_params"] = packing.PackedSeqParams(
                    qkv_format="thd", cu_seqlens_q=micro.cu_seqlens, cu_seqlens_kv=micro.cu_seqlens,
                    max_seqlen_q=micro.max_seqlen, max_seqlen_kv=micro.max_seqlen)
            inputs[id(micro)] = batch
        return inputs[id(micro)]

    def batches():
        while True:
            yield prepared(feed.next())

    data = batches()

    def loss_func(batch: dict, token_losses: torch.Tensor):
        loss = (token_losses.float().reshape(-1) * batch["mask"]).sum()
        return loss, batch["count"], {"lm loss": torch.stack([loss.detach(), batch["count"].float()])}

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        out = chunk(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"],
                    packed_seq_params=batch.get("packed_seq_params"))
        return out, lambda token_losses: loss_func(batch, token_losses)

    def step():
        model.zero_grad_buffer()
        opt.zero_grad()
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[model],
                                   num_microbatches=spec.accum, seq_length=spec.seq, micro_batch_size=spec.batch,
                                   forward_only=False)
        opt.step()
        total = torch.stack([r["lm loss"] for r in reduced]).sum(0)
        return total[0] / total[1]

    recompute = {"full": "full (uniform, 1 layer)", "selective": "selective (core attention)"}.get(spec.recompute, "none")
    precision = ("FP8 hybrid delayed scaling (amax history 1024, max) in TE, bf16 params" if spec.precision == "fp8"
                 else "bf16 params (Float16Module)" if spec.precision == "bf16" else "fp32")
    return Built(step, counts, spec.model.num_heads * spec.model.attention_head_dim,
                 f"megatron-core {version} GPTModel, TE layer spec, {precision}, DDP (fp32 grads) + "
                 f"DistributedOptimizer, forward_backward_no_pipelining, per-token loss, recompute {recompute}, "
                 f"{'THD packed documents' if spec.packed else 'causal'}")
