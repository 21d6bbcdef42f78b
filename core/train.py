"""The training loop: data service -> parallel model -> loss -> distributed optimizer.

One optimizer step consumes `train.global_batch_size` packed rows: `accum` micro-batches of
`micro_batch_size` rows on each of the `dp` data-parallel ranks. The loss is the sum of the
token losses over the whole global batch divided by its number of counted labels, so it
equals the single-process loss on the same rows whatever the layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from core.config import Config, grad_accum_steps, resolve_layout
from core.data import open_stream, resolve_address, to_inputs
from core.mesh import ParallelMesh, init_distributed
from core.metrics import PEAK_FLOPS, MetricsWriter, flops_per_token
from core.model import build_model
from core.parallel import parallelize
from core.loss import cross_entropy_sum

log = logging.getLogger(__name__)


def _precision(config: Config, device: torch.device) -> str:
    precision = config.train.precision
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def _all_reduce_sum(values: list[float], group, device: torch.device) -> list[float]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def count_params(model: torch.nn.Module) -> tuple[int, int, int]:
    """(all parameters, input-embedding parameters, parameters one token uses) of the
    UNSHARDED model. A token runs top_k of each MoE layer's E routed experts, so MFU counts
    that share of the expert weights (MFU on active parameters, as MoE papers quote it)."""
    from moe.layer import moe_layers

    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel() if model.tok_embeddings is not None else 0
    idle = 0
    for layer in moe_layers(model):
        experts = sum(p.numel() for p in layer.experts.parameters())
        idle += experts - experts * layer.moe.top_k // layer.moe.num_experts
    return total, embedding, total - idle


def train(config: Config, resume: bool = False) -> list[dict]:
    """Run `train.max_steps` optimizer steps; returns the metrics records (on the writer rank)."""
    rank, world, device = init_distributed()
    if config.train.device == "cpu":
        device = torch.device("cpu")
    resolve_layout(config, world)
    p, t = config.parallel, config.train
    mesh = ParallelMesh.build(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, device_type=device.type)
    torch.manual_seed(t.seed + rank)  # dropout-free model: only affects user code that draws

    model = build_model(config.model, seed=t.seed)
    _, embedding_params, active_params = count_params(model)
    dynamic = None
    if p.dynamic_cp:  # the step's plan comes from the data service; sub-groups are built once here
        from core.dynamic_cp import DynamicCP

        dynamic = DynamicCP.build(config, mesh, model)
    precision = _precision(config, device)
    model, optimizer, scheduler, grads = parallelize(model, mesh, config, device, precision)

    address, server = resolve_address(config)
    run_dir = Path(t.run_dir)
    ckpt_dir = Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"
    start_step, resume_token = 0, None
    if resume:
        from core.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(ckpt_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir}")
        start_step, extra = load_checkpoint(path, model, optimizer, scheduler, mesh)
        resume_token = extra.get("data", {}).get("resume_token")
    stream = open_stream(config, mesh, address, resume_token)

    accum = grad_accum_steps(config)
    shard = _context_sharder(config, mesh)
    if grads.pipeline is not None:
        from core.parallel.pipeline import run_pipeline_step
    if config.model.moe.num_experts:
        from moe.comm import EXCHANGE_TIMER
        from moe.layer import set_moe_loss_scale

        set_moe_loss_scale(model, accum * mesh.size("dp_cp"))
        EXCHANGE_TIMER.enabled = p.ep > 1 and config.model.moe.dispatcher == "alltoall"
    tp_group = mesh.group("tp") if p.tp > 1 else None
    reduce_group = mesh.group("dp_cp") if mesh.size("dp_cp") > 1 else None
    reduce_size = mesh.size("dp_cp")
    writer = MetricsWriter(run_dir, enabled=rank == 0, max_steps=t.max_steps, tensorboard=t.tensorboard)
    flops_token = flops_per_token(active_params, embedding_params, config.model.num_layers, config.model.dim, t.seq_len)
    peak = PEAK_FLOPS.get(precision) if device.type == "cuda" else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" and grads.uses_autocast else contextlib.nullcontext()
    data_iter = iter(stream)
    step = start_step
    try:
        last_step = min(t.max_steps, t.stop_at_step) if t.stop_at_step else t.max_steps
        while step < last_step:
            step_start = time.perf_counter()
            if dynamic is not None:
                micro = dynamic.next_step(data_iter, device)
            else:
                micro = [shard(to_inputs(next(data_iter), device)) for _ in range(accum)]
            data_wait = time.perf_counter() - step_start  # blocked on the data client (+ the copy in)
            local_labels = float(sum(m.num_labels for m in micro))
            local_tokens = float(sum(m.num_tokens for m in micro))
            global_labels, global_tokens, wait_sum = _all_reduce_sum([local_labels, local_tokens, data_wait],
                                                                     reduce_group, device)
            if grads.pipeline is not None:
                # The schedule interleaves micro-batches' backwards: reduce once, at the end.
                with grads.dp.no_sync():
                    result = run_pipeline_step(
                        grads.pipeline, micro, lambda out, mb: cross_entropy_sum(out, mb.labels, tp_group, compiled=t.compile),
                        mesh, config, global_labels, forward_context=lambda: autocast,
                    )
                loss_sum, extra_metrics = result.loss_sum, result.metrics()
            else:
                loss_sum = _forward_backward(model, micro, grads, autocast, tp_group, global_labels, device,
                                             overlap_reduction=dynamic is None, compiled_loss=t.compile)
                extra_metrics = {}
            grad_norm = grads.finish_and_clip(t.grad_clip)
            lr = optimizer.lr
            optimizer.step()
            scheduler.step()
            grads.zero_grad()
            step += 1
            loss = _all_reduce_sum([float(loss_sum)], reduce_group, device)[0] / max(global_labels, 1.0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - step_start
            record = {
                "step": step,
                "loss": loss,
                "grad_norm": float(grad_norm),
                "lr": lr,
                "tokens_per_s": global_tokens / elapsed,
                "step_s": elapsed,
                "data_wait_s": wait_sum / reduce_size,  # mean over the data-parallel ranks
                "mfu": (flops_token * global_tokens / elapsed / (peak * world)) if peak else None,
                "mem_gb": (torch.cuda.max_memory_allocated() / 2**30) if device.type == "cuda" else _rss_gb(),
            }
            record.update(extra_metrics)
            record.update(_moe_metrics(model))
            if step % t.log_interval == 0 or step == t.max_steps:
                writer.log(record)
            else:
                writer.history.append(record)
            interval = config.checkpoint.interval
            if (interval and step % interval == 0) or (step == last_step and config.checkpoint.save_at_end):
                _save(ckpt_dir, step, model, optimizer, scheduler, mesh, stream, config)
    finally:
        stream.close()
        if server is not None:
            server.stop()
    plot = writer.close(plot=t.plot)
    if plot is not None:
        print(f"loss plot: {plot}", flush=True)
    return writer.history


def _save(ckpt_dir, step, model, optimizer, scheduler, mesh, stream, config) -> None:
    from core.checkpoint import save_checkpoint

    # Every data-parallel rank is at the same global row offset after a step, so rank 0's
    # token resumes all of them, on any dp size.
    state = stream.state_dict()
    path = save_checkpoint(ckpt_dir, step, model, optimizer, scheduler, mesh, {"data": state}, keep=config.checkpoint.keep)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"checkpoint: {path}", flush=True)


def _forward_backward(model, micro, grads, autocast, tp_group, global_labels: float, device: torch.device,
                      overlap_reduction: bool = True, compiled_loss: bool = False) -> torch.Tensor:
    """Gradient accumulation over this rank's micro-batches; returns the summed token loss.

    overlap_reduction: start the gradient reduction during the last micro-batch's backward.
    Off when ranks run different numbers of micro-batches (dynamic CP, where a rank may run
    none): then `finish_and_clip` reduces every bucket once, after all of them."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    with contextlib.nullcontext() if overlap_reduction else grads.dp.no_sync():
        for i, m in enumerate(micro):
            _set_sequences(model, m.meta.cu_seqlens, m.tokens.numel())
            with grads.sync_context(last=i == len(micro) - 1):
                with autocast:
                    logits = model(m.tokens, m.position_ids, m.meta)
                    part, _ = cross_entropy_sum(logits, m.labels, tp_group, compiled=compiled_loss)
                (part / max(global_labels, 1.0)).backward()
            loss_sum += part.detach()
    return loss_sum


def _context_sharder(config: Config, mesh: ParallelMesh):
    """Each context-parallel rank keeps its zigzag share of every document of a micro-batch."""
    cp = mesh.size("cp")
    if cp == 1:
        return lambda inputs: inputs
    from core.parallel.context import shard_for_cp

    tp = mesh.size("tp")
    multiple_of = tp if config.parallel.sequence_parallel and tp > 1 else 1
    rank = mesh.coordinate("cp")

    def shard(m):
        s = shard_for_cp(m.tokens, m.labels, m.position_ids, m.meta.cu_seqlens, rank, cp, multiple_of=multiple_of)
        # Counts are summed over dp x cp ranks, and the cp ranks of a data-parallel rank share
        # one micro-batch: each counts 1/cp of it (exact in floating point: cp is small).
        return dataclasses.replace(m, tokens=s.tokens, labels=s.labels, position_ids=s.position_ids, meta=s.meta,
                                   num_tokens=m.num_tokens / cp, num_labels=m.num_labels / cp)

    return shard


def _set_sequences(model, cu_seqlens, num_tokens: int) -> None:
    if model.cfg.moe.num_experts:
        from moe.layer import set_moe_sequences

        set_moe_sequences(model, cu_seqlens, num_tokens)


def _moe_metrics(model) -> dict:
    if not model.cfg.moe.num_experts:
        return {}
    from moe.layer import moe_metrics

    return moe_metrics(model)


def _rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
