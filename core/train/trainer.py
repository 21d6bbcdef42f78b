"""The Trainer: data service -> parallel model -> loss -> distributed optimizer, in small phases.

One optimizer step consumes `train.global_batch_size` packed rows: `accum` micro-batches of
`micro_batch_size` rows on each of the `dp` data-parallel ranks. The loss is the sum of the
token losses over the whole global batch divided by its number of counted labels, so it
equals the single-process loss on the same rows whatever the layout.

    trainer = Trainer(config)            # mesh, model, parallelize, optimizer
    trainer.open_data(resume=False)      # the data service (or none: feed `step` yourself)
    micro = trainer.next_micro_batches() # this rank's micro-batches of one step
    result = trainer.step(micro)         # forward/backward, clip, optimizer; no host sync
    record = trainer.record(result, t0)  # the metrics line (waits for this step's end)
    record.update(trainer.evaluate())    # validation loss on the held-out rows ([eval])
    trainer.save()

`run()` is that loop with logging and checkpoints; it reads a step's record only once the next
step is queued, so the device never idles while the host reads metrics and launches the next
step's first kernels. The benchmarks and tests call `step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from core.state.checkpoint import AsyncCheckpointer, latest_checkpoint, load_checkpoint, save_checkpoint
from core.config import Config
from core.rules import attention_width, grad_accum_steps
from core.validation import cp_a2a_size, validate
from core.train.data import StepInputs, open_stream, resolve_address, take_positions, to_inputs
from core.lifecycle import stop_deferred
from core.train.dynamic_cp import DynamicCP
from core.train.failure import record_cause
from core.train.loss import cross_entropy_sum, fused_head_loss
from core.train.host_memory import check_host_memory
from core.planner.state import state_bytes
from core.mesh import ParallelMesh, init_distributed
from core.metrics import PEAK_FLOPS, MetricsWriter, flops_per_token
from core.train.model import build_model, count_params
from core.parallel.context import shard_for_cp
from core.parallel.ulysses import shard_for_a2a
from core.parallel.pipeline import LossParts, run_pipeline_step
from core.precision.plan import resolve_precision_plan
from core.train.parallelize import checkpoint_buffers, parallelize
from core.state.pretrained import load_weights
from core.watchdog import HANG_EXIT_CODE, Watchdog
from moe.comm import ExchangeTimer
from moe.layer import set_moe_loss_scale
from moe.stats import MoEStatsLayout, take_moe_stats
from dataservice.packing import IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One optimizer step as the device left it: tensors are not read back until `record`."""

    loss_sum: torch.Tensor  # this rank's summed token loss
    grad_norm: torch.Tensor
    lr: float
    global_labels: float
    global_tokens: float
    data_wait_sum: float  # seconds blocked on data, summed over the data-parallel ranks
    metrics: dict = field(default_factory=dict)  # the pipeline schedule's figures
    data_wait: float = 0.0  # this rank's seconds blocked on data
    busy_marks: tuple = ()  # (start, end) of this rank's forward/backward: host times, or CUDA events
    step: int = 0
    host_values: torch.Tensor | None = None  # [loss_sum, grad_norm], copied to the host without waiting
    moe_stats: tuple | None = None  # moe.stats.take_moe_stats at the step's end
    done: object = None  # the step's end: a CUDA event, or the host clock
    mtp_labels: tuple = ()  # each multi-token prediction depth's global label count (its sums: host_values[2:])


class Trainer:
    """Owns a run's mesh, precision plan, model, optimizer, data stream and step counter, and
    what the run measures (the MoE exchange timer)."""

    def __init__(self, config: Config):
        self.config = config
        self.rank, self.world, device = init_distributed()
        self.device = torch.device("cpu") if config.train.device == "cpu" else device
        validate(config, self.world)
        p, t = config.parallel, config.train
        self.mesh = ParallelMesh.build(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, device_type=self.device.type)
        torch.manual_seed(t.seed + self.rank)  # dropout-free model: only affects user code that draws

        self.plan = resolve_precision_plan(config, self.device)
        self.precision = self.plan.precision
        # What the run keeps in host memory must fit before anything is built.
        buffers = checkpoint_buffers(config, self.plan, self.mesh.coordinate("pp"))
        needs = {"train.offload_checkpoints": sum(n * c for n, c in buffers.items())}
        if t.optimizer_offload:  # both offloads share the host: one check of their sum
            resolved = dataclasses.replace(config, train=dataclasses.replace(t, precision=self.precision))
            needs["train.optimizer_offload"] = state_bytes(resolved, self.rank).host
        check_host_memory(needs, limit_gb=t.optimizer_offload_host_gb)

        model = build_model(config.model, seed=t.seed)
        _, embedding_params, active_params = count_params(model)
        # The step's plan comes from the data service; the sub-groups are built once, here.
        self.dynamic = DynamicCP.build(config, self.mesh, model) if p.dynamic_cp else None
        # The share of a step expert parallelism spends in the token all-to-alls (metrics).
        timed = bool(config.model.moe.num_experts) and p.ep > 1 and config.model.moe.dispatcher == "alltoall"
        self.exchange_timer = ExchangeTimer() if timed else None
        self.model, self.optimizer, self.scheduler, self.grads = parallelize(model, self.mesh, config, self.device,
                                                                             self.plan, self.exchange_timer)
        self.accum = grad_accum_steps(config)
        chunks = self.grads.pipeline.chunks if self.grads.pipeline is not None else [self.model]
        self.inputs_offload = getattr(chunks[0], "checkpoint_offload", None)  # train.offload_checkpoints
        self._shard = _context_sharder(config, self.mesh)
        self.moe_stats = None  # where each MoE layer's statistics sit in the step's all-rank reduction
        if config.model.moe.num_experts:
            self.moe_stats = MoEStatsLayout.of_run(config.model, self.mesh, p.etp, self.exchange_timer is not None)
        self.tp_group = self.mesh.group("tp") if p.tp > 1 else None
        self.reduce_size = self.mesh.size("dp_cp")
        self.reduce_group = self.mesh.group("dp_cp") if self.reduce_size > 1 else None
        # Label counts and metrics are host values: reduced over gloo, they queue nothing
        # behind the GPU's work, so reading them never waits for a step still running.
        self.host_reduce_group = self.mesh.host_group("dp_cp") if self.reduce_size > 1 else None
        self.host_world = self.mesh.host_group("world") if self.world > 1 else None
        # On a GPU `run` reads a step's record once the next step is queued; on the CPU a step
        # has finished when `step` returns, so there is nothing to overlap and each is read at once.
        self.lagged_records = self.device.type == "cuda"
        m = config.model
        self.mtp_layers = m.mtp_layers
        head_params = 0 if m.tie_embeddings else m.vocab_size * m.dim
        self.flops_per_token = flops_per_token(active_params, embedding_params, m.num_layers,
                                               attention_width(m), t.seq_len, m.mtp_layers, head_params)
        self.peak_flops = PEAK_FLOPS.get(self.precision) if self.device.type == "cuda" else None
        uses_autocast = self.precision == "bf16" and self.grads.uses_autocast
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if uses_autocast else contextlib.nullcontext()
        self.fused_loss = config.train.fused_loss  # its layouts checked by core.validation
        self.loss_dtype = torch.bfloat16 if uses_autocast else None

        self.run_dir = Path(t.run_dir)
        self.ckpt_dir = Path(config.checkpoint.dir) if config.checkpoint.dir else self.run_dir / "checkpoints"
        self.step_count = 0
        # Collective (a gloo group of its own): every rank builds it here, in the same order.
        self.checkpointer = AsyncCheckpointer() if config.checkpoint.async_save else None
        self.save_timings: dict = {}  # of the last save(): save_blocking_s (and save_s)
        self.watchdog = Watchdog(t.hang_timeout_s, self.rank, self.run_dir,  # armed by run()
                                 functools.partial(record_cause, self.run_dir, self.rank, exit_code=HANG_EXIT_CODE))
        self._init_loaded = False
        self.stream = None
        self._server = None
        self._batches = None
        self._eval_address = None
        self._eval_server = None

    # -- data ------------------------------------------------------------------------------

    def open_data(self, resume: bool = False) -> None:
        """Find or start the data service; with `resume`, load the newest checkpoint first so
        the stream continues where it stopped."""
        address, self._server = resolve_address(self.config)
        resume_token = self.load_latest() if resume else None
        if not resume:
            self.load_init_weights()
        self.stream = open_stream(self.config, self.mesh, address, resume_token)
        self._batches = iter(self.stream)

    def next_micro_batches(self) -> list[StepInputs]:
        """This rank's micro-batches of the next optimizer step, on the device."""
        if self.dynamic is not None:
            return self.dynamic.next_step(self._batches, self.device)
        return [self._shard(to_inputs(next(self._batches), self.device, self.mtp_layers)) for _ in range(self.accum)]

    # -- one step --------------------------------------------------------------------------

    def step(self, micro: list[StepInputs], data_wait: float = 0.0) -> StepResult:
        """Forward and backward over `micro`, gradient reduction and clipping, optimizer and
        schedule step. Reads nothing back from the device."""
        watch = self.watchdog
        watch.enter("label-count all-reduce")
        mtp_local = [float(sum(m.mtp_num_labels[k] for m in micro)) for k in range(self.mtp_layers)]
        local = [float(sum(m.num_labels for m in micro)), float(sum(m.num_tokens for m in micro)), data_wait,
                 float(sum(m.num_microbatches for m in micro)), float(sum(m.num_sequences for m in micro)), *mtp_local]
        global_labels, global_tokens, wait_sum, microbatches, sequences, *mtp_labels = self._sum_over_data_ranks(local)
        if self.moe_stats is not None:
            # What the step's auxiliary losses average over, all ranks (moe/layer.py): counts of
            # shares of 1/g summed in float64, so rounded back to the integers they are.
            # Micro-batches built without document counts (num_sequences 0) keep per-micro-batch means.
            set_moe_loss_scale(self.model, max(round(microbatches), 1), round(sequences) or None,
                               round(global_tokens) or None)
        started = self._mark()  # after the first collective: a wait for a slow peer is not this rank's time
        watch.enter("forward/backward")
        if self.grads.pipeline is not None:
            loss_sum, mtp_sums, metrics = self._pipeline_forward_backward(micro, global_labels, mtp_labels)
        else:
            (loss_sum, mtp_sums), metrics = self._forward_backward(micro, global_labels, mtp_labels), {}
        busy_marks = (started, self._mark())
        if self.inputs_offload is not None:  # this rank's checkpoint inputs sent to host memory
            metrics["offload_mib"] = self.inputs_offload.pop_stats()["bytes"] / 2 ** 20
        watch.enter("gradient reduction")
        grad_norm = self.grads.finish_and_clip(self.config.train.grad_clip)
        lr = self.optimizer.lr
        watch.enter("optimizer step + parameter all-gather")
        self.optimizer.step()
        self.scheduler.step()
        self.grads.zero_grad()
        self.step_count += 1
        values = torch.cat([torch.stack([loss_sum.detach().float().reshape(()), grad_norm.detach().float().reshape(())]),
                            mtp_sums.detach().float()])
        moe = take_moe_stats(self.model, self.exchange_timer) if self.moe_stats is not None else None
        return StepResult(loss_sum, grad_norm, lr, global_labels, global_tokens, wait_sum, metrics, data_wait,
                          busy_marks, self.step_count, values.to("cpu", non_blocking=True), moe, self._mark(),
                          tuple(mtp_labels))

    def _mark(self):
        """A point of this rank's step on the clock that sees its work: a CUDA event on the GPU
        (read in `record`, after its sync), the host clock on the CPU."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _forward_backward(self, micro: list[StepInputs], global_labels: float, mtp_labels: list[float] = ()):
        """Gradient accumulation over this rank's micro-batches; returns (the summed token loss,
        each MTP depth's summed token loss [D]).

        The gradient reduction starts during the last micro-batch's backward, except under
        dynamic CP, where ranks run different numbers of micro-batches (a rank may run none):
        then `finish_and_clip` reduces every bucket once, after all of them."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        mtp_sums = torch.zeros(self.mtp_layers, dtype=torch.float32, device=self.device)
        with contextlib.nullcontext() if self.dynamic is None else self.grads.dp.no_sync():
            for i, m in enumerate(micro):
                if self.config.train.cuda_graphs:
                    # the previous micro-batch's backward is done: its graphs' outputs may be
                    # overwritten (without this, replays wait for it and fall back to slow paths)
                    torch.compiler.cudagraph_mark_step_begin()
                with self.grads.sync_context(last=i == len(micro) - 1):
                    with self.autocast:
                        # The fused loss runs the final norms itself, chunk by chunk.
                        if self.mtp_layers:
                            heads = self.model.heads(m.tokens, m.position_ids, m.meta, m.mtp_tokens,
                                                     normed=not self.fused_loss)
                        elif self.fused_loss:
                            heads = [self.model.hidden_states(m.tokens, m.position_ids, m.meta, normed=False)]
                        else:
                            heads = [self.model(m.tokens, m.position_ids, m.meta)]  # logits
                        parts = self._loss(heads, m, global_labels, mtp_labels, logits=not (self.mtp_layers or self.fused_loss))
                    parts.objective.backward()
                loss_sum += parts.reported.detach()
                mtp_sums += parts.extra.detach()
        return loss_sum, mtp_sums

    def _loss(self, heads: list[torch.Tensor], m: StepInputs, global_labels: float, mtp_labels: list[float],
              logits: bool = False, head_owner=None) -> LossParts:
        """The micro-batch's objective: main CE sum / global labels + mtp_loss_weight * the mean
        over depths of (depth k's CE sum / its global labels), DeepSeek-V3's λ/D Σ_k L_k. `heads`:
        what the output head reads, main first (`GPT.heads`), or with `logits` the main logits.
        Reported: the main sum (the run's `loss`, comparable with and without MTP) and each depth's.
        `head_owner`: the module holding the output head (a pipeline's last chunk); the model by default."""
        owner = head_owner if head_owner is not None else self.model
        compiled = self.config.train.compile
        labels = [m.labels] + [m.mtp_labels[k] for k in range(len(heads) - 1)]
        weight = self.config.train.mtp_loss_weight / max(self.mtp_layers, 1)
        scales = [1.0 / max(global_labels, 1.0)] + [weight / max(n, 1.0) for n in mtp_labels]
        sums = []
        for h, lab, scale, norm in zip(heads, labels, scales, owner.head_norms()):
            if self.fused_loss:  # `heads` before their norms (the loss runs them)
                grad_scale = torch.full((), scale, device=self.device)
                sums.append(fused_head_loss(owner, h, lab, grad_scale, self.loss_dtype, compiled=compiled, norm=norm))
            else:
                sums.append(cross_entropy_sum(h if logits else owner.output(h), lab, self.tp_group,
                                              compiled=compiled)[0])
        # The main term divided as without MTP, so a run without it is bit for bit what it was.
        objective = sums[0] / max(global_labels, 1.0)
        for part, scale in zip(sums[1:], scales[1:]):
            objective = objective + part * scale
        extra = torch.stack([p.detach().float() for p in sums[1:]]) if len(sums) > 1 else \
            torch.zeros(0, device=self.device)
        return LossParts(objective, sums[0], extra)

    def _pipeline_forward_backward(self, micro: list[StepInputs], global_labels: float, mtp_labels: list[float]):
        mtp = self.mtp_layers

        head_owner = next((c for c in self.grads.pipeline.chunks if c.output is not None), None)

        def last_forward(chunk, x, mb):
            if mtp:
                return chunk.heads(x, mb.position_ids, mb.meta, mb.mtp_tokens, normed=not self.fused_loss)
            if self.fused_loss:  # the final norm and the head run in the loss, chunk by chunk
                return chunk.hidden_states(x, mb.position_ids, mb.meta, normed=False)
            return chunk(x, mb.position_ids, mb.meta)

        def loss_fn(out, mb):
            heads = out if mtp else [out]
            return self._loss(heads, mb, global_labels, mtp_labels, logits=not (mtp or self.fused_loss),
                              head_owner=head_owner)

        # The schedule interleaves micro-batches' backwards: reduce once, at the end.
        with self.grads.dp.no_sync():
            result = run_pipeline_step(self.grads.pipeline, micro, loss_fn, self.mesh, self.config, global_labels,
                                       forward_context=lambda: self.autocast, last_forward=last_forward,
                                       extra_values=mtp)
        return result.loss_sum, result.extra_sums, result.metrics()

    def record(self, result: StepResult, step_start: float, previous: StepResult | None = None) -> dict:
        """The step's metrics line. Waits for this step's end only (a later step may already be
        queued). Its time runs from the end of `previous` (the step before, when nothing ran
        between them) or else from `step_start` (its data wait, then its own device time)."""
        self.watchdog.enter("metrics all-reduce")
        if isinstance(result.done, torch.cuda.Event):
            result.done.synchronize()
        loss_sum, grad_norm, *mtp_sums = result.host_values.tolist()
        loss_sum, *mtp_sums = self._sum_over_data_ranks([loss_sum, *mtp_sums])
        loss = loss_sum / max(result.global_labels, 1.0)
        elapsed = self._elapsed(result, step_start, previous)
        peak = self.peak_flops
        record = {
            "step": result.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": result.lr,
            "tokens_per_s": result.global_tokens / elapsed,
            "step_s": elapsed,
            "data_wait_s": result.data_wait_sum / self.reduce_size,  # mean over the data-parallel ranks
            "mfu": (self.flops_per_token * result.global_tokens / elapsed / (peak * self.world)) if peak else None,
            "mem_gb": (torch.cuda.max_memory_allocated() / 2**30) if self.device.type == "cuda" else _rss_gb(),
        }
        if mtp_sums:  # `loss` stays the main model's; each depth's own mean token loss, and their mean
            depths = [part / max(count, 1.0) for part, count in zip(mtp_sums, result.mtp_labels)]
            record["mtp_loss"] = sum(depths) / len(depths)
            record.update({f"mtp_loss_{k}": value for k, value in enumerate(depths)})
        busy, moe = self._over_all_ranks(result)
        record.update(busy)
        record.update(result.metrics)
        record.update(moe)
        return record

    @staticmethod
    def _elapsed(result: StepResult, step_start: float, previous: StepResult | None) -> float:
        done, cuda = result.done, isinstance(result.done, torch.cuda.Event)
        if previous is not None:
            return previous.done.elapsed_time(done) / 1e3 if cuda else done - previous.done
        if cuda:
            return result.data_wait + result.busy_marks[0].elapsed_time(done) / 1e3
        return done - step_start

    def _over_all_ranks(self, result: StepResult) -> tuple[dict, dict]:
        """(stragglers, MoE statistics), from one all-reduce over every rank of host values.

        Stragglers: each rank's own time in the step before it waits for its data-parallel
        peers (its data wait + its forward/backward), gathered over every rank: min, median, max
        and the slowest rank. Model-parallel peers (tp, cp, ep, pp) wait for each other inside
        forward/backward, so a slow one raises its whole group.
        MoE: every layer's statistics summed over all ranks and pipeline stages (`moe.stats`),
        so they are the global batch's, not one rank's or one stage's."""
        moe = self.moe_stats.pack(result.moe_stats) if result.moe_stats is not None else torch.zeros(0)
        vector = torch.cat([torch.zeros(self.world, dtype=torch.float64), moe.double()])
        if result.busy_marks:
            start, end = result.busy_marks
            vector[self.rank] = result.data_wait + (end - start if isinstance(start, float)
                                                    else start.elapsed_time(end) / 1e3)
        if self.host_world is not None:
            dist.all_reduce(vector, group=self.host_world)
        busy = {}
        if result.busy_marks:
            times = vector[:self.world].tolist()
            slowest = max(range(len(times)), key=times.__getitem__)
            busy = {"busy_s_min": min(times), "busy_s_median": statistics.median(times), "busy_s_max": times[slowest],
                    "slowest_rank": slowest}
        return busy, (self.moe_stats.summarize(vector[self.world:]) if result.moe_stats is not None else {})

    def _sum_over_data_ranks(self, values: list[float]) -> list[float]:
        if self.host_reduce_group is None:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.host_reduce_group)
        return t.tolist()

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """Validation loss over `eval.steps` global batches of the held-out stream: forward only,
        the summed token loss over all ranks divided by the global label count (as in training),
        and the same loss by bucket of the token's position in its document. Every call reads
        the same rows (a fresh stream with `eval.seed`, no resume token), so evaluations compare
        across steps and layouts. MoE layers run in eval mode: no statistics, no bias load, no
        auxiliary loss. Every rank must call it; every rank gets the same dict."""
        e = self.config.eval
        self.watchdog.enter("evaluation")
        data = dataclasses.replace(self.config.data, address=e.address, dataset=e.dataset, cp_cost="")
        if self._eval_address is None:
            self._eval_address, self._eval_server = resolve_address(dataclasses.replace(self.config, data=data))
        edges = position_buckets(self.config.train.seq_len)
        sums = torch.zeros(2 * (len(edges) + 1), dtype=torch.float64, device=self.device)  # (sum, count) pairs
        # data: eval's source, so a loopback eval server gets no TLS or token meant for data.address
        stream_config = dataclasses.replace(self.config, data=data, train=dataclasses.replace(self.config.train, seed=e.seed))
        stream = open_stream(stream_config, self.mesh, self._eval_address)
        was_training = self.model.training
        self.model.train(False)
        try:
            batches = iter(stream)
            with torch.no_grad():
                for m in self._eval_micro_batches(batches, e.steps):
                    self.watchdog.enter("evaluation")
                    with self.autocast:
                        logits = self.model(m.tokens, m.position_ids, m.meta)
                    sums[0] += cross_entropy_sum(logits, m.labels, self.tp_group)[0].double()
                    sums[1] += m.num_labels
                    for i, (low, high) in enumerate(zip(edges, edges[1:])):
                        outside = (m.position_ids < low) | (m.position_ids >= high)
                        part, count = cross_entropy_sum(logits, m.labels.masked_fill(outside, IGNORE_INDEX), self.tp_group)
                        sums[2 * i + 2] += part.double()
                        sums[2 * i + 3] += count.double()
        finally:
            self.model.train(was_training)
            stream.close()
        if self.reduce_group is not None:
            self.watchdog.enter("evaluation all-reduce")
            dist.all_reduce(sums, group=self.reduce_group)
        values = sums.tolist()
        by_position = {f"{low}-{high}": values[2 * i + 2] / values[2 * i + 3]
                       for i, (low, high) in enumerate(zip(edges, edges[1:])) if values[2 * i + 3]}
        return {"val_loss": values[0] / max(values[1], 1.0), "val_loss_by_position": by_position}

    def _eval_micro_batches(self, batches, steps: int):
        """This rank's micro-batches of `steps` held-out global batches, split as in training
        (under dynamic CP the service plans the held-out steps too)."""
        for _ in range(steps):
            yield from (self.dynamic.next_step(batches, self.device) if self.dynamic is not None else
                        (self._shard(to_inputs(next(batches), self.device)) for _ in range(self.accum)))

    def _eval_due(self, last_step: int) -> bool:
        interval = self.config.eval.interval
        return bool(interval) and (self.step_count % interval == 0 or self.step_count == last_step)

    # -- checkpoints -----------------------------------------------------------------------

    def load_latest(self) -> str | None:
        """Load the newest checkpoint of the run; returns its data resume token."""
        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.ckpt_dir}")
        self.step_count, extra = load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.mesh)
        return extra.get("data", {}).get("resume_token")

    def load_init_weights(self) -> int:
        """Load `checkpoint.init_from` (pretrained weights, no optimizer state) into this
        layout, once, before the first step; returns the tensors read (0: nothing to load)."""
        source = self.config.checkpoint.init_from
        if not source or self.step_count or self._init_loaded:
            return 0
        count = load_weights(source, self.model, self.grads.dp, self.mesh)
        self._init_loaded = True
        if self.rank == 0:
            log.info("initialised %d tensors from %s", count, source)
        return count

    def save(self, on_written: Callable[[dict], None] | None = None) -> Path:
        """Save this step's checkpoint. `on_written(timings)` runs once the data are written and
        before the checkpoint is published (a background save: as it starts; it is published by
        a later poll or wait), with a stop signal deferred through it."""
        # Every data-parallel rank is at the same global row offset after a step, so rank 0's
        # token resumes all of them, on any dp size. The model config and the weights the run
        # started from travel with the checkpoint (`tessera-convert to-hf` reads them).
        extra = {"data": self.stream.state_dict()} if self.stream is not None else {}
        extra["model"] = dataclasses.asdict(self.config.model)
        if self.config.checkpoint.init_from:
            extra["init_from"] = str(Path(self.config.checkpoint.init_from).absolute())
        self.watchdog.enter("checkpoint save")
        if self.checkpointer is not None:  # published by a later poll / wait, which prints its line
            self.save_timings = self.checkpointer.save(self.ckpt_dir, self.step_count, self.model, self.optimizer,
                                                       self.scheduler, self.mesh, extra,
                                                       keep=self.config.checkpoint.keep)
            if on_written is not None:
                with stop_deferred():
                    on_written(self.save_timings)
            return self.ckpt_dir / f"step_{self.step_count:06d}"
        started = time.perf_counter()

        def written() -> None:
            elapsed = time.perf_counter() - started
            self.save_timings = {"save_blocking_s": elapsed, "save_s": elapsed}
            if on_written is not None:
                on_written(self.save_timings)

        path = save_checkpoint(self.ckpt_dir, self.step_count, self.model, self.optimizer, self.scheduler, self.mesh,
                               extra, keep=self.config.checkpoint.keep, before_publish=written)
        if self.rank == 0:
            print(f"checkpoint: {path}", flush=True)
        return path

    def _checkpoint_due(self, last_step: int) -> bool:
        c = self.config.checkpoint
        return bool(c.interval and self.step_count % c.interval == 0) or (self.step_count == last_step and c.save_at_end)

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Train to `train.max_steps` (or `stop_at_step`); returns the metrics records (on the writer rank)."""
        t = self.config.train
        if self.stream is None:
            self.open_data()
        last_step = min(t.max_steps, t.stop_at_step) if t.stop_at_step else t.max_steps
        writer = MetricsWriter(self.run_dir, enabled=self.rank == 0, max_steps=t.max_steps, tensorboard=t.tensorboard,
                               start_step=self.step_count, last_step=last_step)
        self.watchdog.start()
        # With `lagged_records` a step's record is read once the next step is queued (or at its
        # checkpoint, so a run stopped after a save has the record of the step it resumes from).
        # A run that dies mid-step then lacks the record of the step before.
        pending = None  # (result, step_start, previous, extras) of the last step, not yet recorded
        previous = None  # the step before the current one, when nothing ran between them
        ended = False
        try:
            while self.step_count < last_step:
                step_start = time.perf_counter()
                self.watchdog.begin_step(self.step_count + 1)
                self.watchdog.enter("data wait")
                micro = self.next_micro_batches()
                data_wait = time.perf_counter() - step_start  # blocked on the data client (+ the copy in)
                result = self.step(micro, data_wait)
                if pending is not None:
                    self._log(writer, *pending)
                extras: dict = {}
                pending, previous = (result, step_start, previous, extras), result
                if self._eval_due(last_step):
                    extras.update(self.evaluate())
                    previous = None  # the evaluation is not the next step's time
                if self.checkpointer is not None:
                    self.watchdog.enter("checkpoint publish")
                    extras.update(self.checkpointer.poll())  # save_s of a background save just published
                saving = self._checkpoint_due(last_step)
                if saving or not self.lagged_records:
                    # Read before the save, written once its data are (their cost on the step's
                    # line) and before it is published, with a stop signal deferred through both:
                    # a published checkpoint's step always has its record, and one killed in
                    # between leaves a record past the newest checkpoint, which a resume drops.
                    record = self.record(*pending[:3])

                    def write(timings: dict) -> None:  # called before this iteration ends
                        extras.update(timings)
                        self._write(writer, record, extras)

                    if saving:
                        self.save(on_written=write)
                        previous = None
                    else:
                        with stop_deferred():
                            write({})
                    pending = None
            if pending is not None:
                self._log(writer, *pending)
            if self.checkpointer is not None:
                self.watchdog.enter("checkpoint save")
                self.checkpointer.wait()  # the last save is complete and `latest` before the run ends
            ended = True
        finally:
            self.watchdog.stop()
            self.close()
            self._close_metrics(writer, ended)
        return writer.history

    def _close_metrics(self, writer: MetricsWriter, ended: bool) -> None:
        """Close metrics.jsonl and draw loss.png, after a stop or a failure too (the plot of the
        steps done); a plot that fails then is a warning, so that it never hides why the run ended."""
        try:
            plot = writer.close(plot=self.config.train.plot)
        except Exception as err:
            if ended:
                raise
            log.warning("loss.png not drawn: %s", err)
            return
        if plot is not None:
            print(f"loss plot: {plot}", flush=True)

    def _log(self, writer: MetricsWriter, result: StepResult, step_start: float, previous: StepResult | None,
             extras: dict) -> None:
        self._write(writer, self.record(result, step_start, previous), extras)

    def _write(self, writer: MetricsWriter, record: dict, extras: dict) -> None:
        record.update(extras)
        self.watchdog.enter("metrics write")
        interval, step = self.config.train.log_interval, record["step"]
        writer.log(record, show=step % interval == 0 or step == self.config.train.max_steps or "val_loss" in record)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._eval_server is not None:
            self._eval_server.stop()
            self._eval_server = None


def train(config: Config, resume: bool = False) -> list[dict]:
    """Run `train.max_steps` optimizer steps; returns the metrics records (on the writer rank)."""
    trainer = Trainer(config)
    try:
        trainer.open_data(resume=resume)
    except BaseException:
        trainer.close()
        raise
    return trainer.run()


def position_buckets(seq_len: int) -> list[int]:
    """Edges of the per-position loss buckets: 0, 64, 256, 1024, ... (powers of 4), then seq_len."""
    edges, edge = [0], 64
    while edge < seq_len:
        edges.append(edge)
        edge *= 4
    return edges + [seq_len]


def _context_sharder(config: Config, mesh: ParallelMesh):
    """Each context-parallel rank keeps its zigzag share of every document of a micro-batch."""
    cp = mesh.size("cp")
    if cp == 1:
        return lambda inputs: inputs
    tp = mesh.size("tp")
    multiple_of = tp if config.parallel.sequence_parallel and tp > 1 else 1
    rank = mesh.coordinate("cp")
    a2a = cp_a2a_size(config)  # all-to-all CP: a2a rank rank % a2a of ring rank rank // a2a

    def split(m):
        if a2a == 1:
            return shard_for_cp(m.tokens, m.labels, m.position_ids, m.meta.cu_seqlens, rank, cp, multiple_of=multiple_of,
                                real_tokens=m.meta.real)
        return shard_for_a2a(m.tokens, m.labels, m.position_ids, m.meta.cu_seqlens, rank // a2a, cp // a2a,
                             rank % a2a, a2a, multiple_of=multiple_of, real_tokens=m.meta.real)

    group = mesh.group("cp")

    def shard(m):
        s = split(m)
        s.meta.extra["cp_group"] = group  # MoE layers balance each sequence over its whole group
        # Counts are summed over dp x cp ranks, and the cp ranks of a data-parallel rank share
        # one micro-batch: each counts 1/cp of it (exact in floating point: cp is small).
        # MTP inputs and targets were made on the whole micro-batch: they follow their positions.
        return dataclasses.replace(take_positions(m, s.source), tokens=s.tokens, labels=s.labels,
                                   position_ids=s.position_ids, meta=s.meta, num_tokens=m.num_tokens / cp,
                                   num_labels=m.num_labels / cp, mtp_num_labels=tuple(n / cp for n in m.mtp_num_labels),
                                   num_microbatches=1 / cp, num_sequences=m.num_sequences / cp)

    return shard


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
