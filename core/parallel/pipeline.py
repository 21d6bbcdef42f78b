"""Pipeline parallelism: split the plain GPT into stages and run a 1F1B or interleaved step.

`build_pipeline_stage(model, mesh, config)` deletes from the plain model what this pipeline
rank does not own and returns a `PipelineStage` whose `chunks` are GPT modules (one per
virtual stage; v > 1 only with the interleaved schedule). Layer keys stay the global layer
indices, so parameter names (and checkpoints) are those of the plain model.

`run_pipeline_step(stage, micro_batches, loss_fn, mesh, config, loss_divisor)` runs the
forwards and backwards of all micro-batches of one optimizer step in the schedule's order,
leaving gradients accumulated in `.grad`; it returns the step's loss sum on every rank.

Activations between stages are [T_local, dim] where T_local is the micro-batch's token count
(`tokens.numel()`, already this rank's share under context parallelism) divided by tp under
sequence parallelism: every rank of a pipeline reads the same micro-batches from the data
service, so the receiver allocates its buffer from its own copy of the batch and no shape is
exchanged. The sender checks the shape and dtype it produced against that rule, so a
mismatch fails with a message instead of corrupting a transfer. Transfers are
`dist.batch_isend_irecv` batches in the order `core.parallel.schedules.plan_step` fixes.

Order with other steps: module-replacing steps (`apply_tp`, recompute, ...) go either on the
plain model before this split or on each chunk after it; with v > 1 the pruned `model`
itself is only a container of this rank's modules and must not be run or re-parallelised.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from core.config import Config
from core.mesh import ParallelMesh
from core.parallel.schedules import (
    Action,
    Message,
    Post,
    plan_step,
    theoretical_bubble,
)
from core.rules import check_schedule, partition_layers

log = logging.getLogger(__name__)


@dataclass
class PipelineStage:
    """This pipeline rank's share of the model and what the schedule needs to know about it."""

    chunks: list[nn.Module]  # chunk c is virtual stage c * pp + pp_rank
    layer_ids: list[list[int]]  # global layer indices of each chunk
    pp: int
    pp_rank: int
    virtual: int
    schedule: str
    peers: list[int]  # global ranks of this pipeline, by pp coordinate
    tied_group: Any = None  # first+last stage group for a tied embedding, when pp > 1
    # True when a data-parallel wrapper sums the tied copies' grads (it tags them
    # `pp_tied_group` and owns .grad); the schedule then leaves them alone.
    tied_grads_reduced_elsewhere: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def stage_of(self, chunk: int) -> int:
        return chunk * self.pp + self.pp_rank

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Global (plain-model) names of this rank's parameters, each once."""
        seen: set[int] = set()
        for chunk in self.chunks:
            for name, param in chunk.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The chunks' state dicts merged (their keys are disjoint global names)."""
        merged: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            merged.update(chunk.state_dict())
        return merged


class LossParts(NamedTuple):
    """What a loss_fn may return instead of a loss sum: `objective` is backpropagated as it is
    (already normalised), `reported` is summed into the step's `loss_sum`, and `extra` (1-D,
    `run_pipeline_step(extra_values=...)` long) into its `extra_sums` (e.g. auxiliary losses)."""

    objective: torch.Tensor
    reported: torch.Tensor
    extra: torch.Tensor


@dataclass
class PipelineStepResult:
    """One step's loss and bubble: theoretical, and measured as this rank's idle share."""

    loss_sum: torch.Tensor  # float32 scalar: the sum of loss_fn over all micro-batches, on every rank
    theoretical_bubble: float
    idle_fraction: float  # this rank: 1 - compute time / step time
    mean_idle_fraction: float  # the mean of idle_fraction over the pipeline's ranks
    compute_s: float
    step_s: float
    extra_sums: torch.Tensor | None = None  # LossParts.extra summed over the step, on every rank

    def metrics(self) -> dict[str, float]:
        return {
            "pp_bubble_theory": self.theoretical_bubble,
            "pp_idle": self.idle_fraction,
            "pp_idle_mean": self.mean_idle_fraction,
        }


def _chunk_of(model: nn.Module, layer_ids: range, embed: bool, head: bool) -> nn.Module:
    """A module of the model's class sharing its submodules: only `layer_ids`, and the
    embedding / norm+output only where asked. The model itself is left as it is."""
    chunk = copy.copy(model)
    chunk._modules = dict(model._modules)  # its own table, so the assignments below stay local
    chunk.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    mtp = getattr(model, "mtp", None) is not None
    if not embed and not (head and mtp):
        chunk.tok_embeddings = None
    chunk.embeds_tokens = embed
    if not head:
        chunk.norm = None
        chunk.output = None
        if mtp:
            chunk.mtp = None
    return chunk


def build_pipeline_stage(model: nn.Module, mesh: ParallelMesh, config: Config) -> PipelineStage:
    """Split the plain model for this rank (see the module docstring). Collective over all
    ranks when the embedding is tied and pp > 1 (it creates the first/last-stage groups)."""
    p = config.parallel
    pp, virtual = p.pp, p.pp_virtual_stages
    check_schedule(p.pp_schedule, pp, virtual)
    if mesh.size("pp") != pp:
        raise ValueError(f"the mesh has pp={mesh.size('pp')} but parallel.pp={pp}; build both from the same config")
    num_layers = len(model.layers)
    if sorted(model.layers.keys(), key=int) != [str(i) for i in range(num_layers)]:
        raise ValueError("build_pipeline_stage needs the whole plain model (layers '0'..'L-1'); was it split already?")
    rank = mesh.coordinate("pp")
    ranges = partition_layers(num_layers, pp * virtual, p.pp_first_stage_layers, p.pp_last_stage_layers)
    stages = [c * pp + rank for c in range(virtual)]
    last = pp * virtual - 1
    tied = model.tok_embeddings is not None and model.output is not None and model.output.weight is model.tok_embeddings.weight
    # Multi-token prediction runs on the last stage and embeds there too: that stage keeps a
    # copy of the embedding (the same name, so a checkpoint holds it once), tied to the first
    # stage's like a tied output head.
    mtp = getattr(model, "mtp", None) is not None

    tied_group = None
    if (tied or mtp) and pp > 1:
        # One group per (dp, cp, tp) position joins its first and last stage, which hold the
        # two copies of the tied weight; every rank creates every group, in the same order.
        full = mesh.mesh.mesh.reshape(pp, -1)
        for first_rank, last_rank in zip(full[0].tolist(), full[-1].tolist()):
            group = dist.new_group([first_rank, last_rank])
            if dist.get_rank() in (first_rank, last_rank):
                tied_group = group

    owned = {str(i) for s in stages for i in ranges[s]}
    for key in [k for k in model.layers.keys() if k not in owned]:
        del model.layers[key]
    if 0 not in stages:
        model.embeds_tokens = False
        if not (mtp and last in stages):
            model.tok_embeddings = None
    if last not in stages:
        model.norm = None
        model.output = None
        if mtp:
            model.mtp = None
    if virtual == 1:
        chunks = [model]
    else:
        chunks = [_chunk_of(model, ranges[s], s == 0, s == last) for s in stages]
    peers = dist.get_process_group_ranks(mesh.group("pp")) if mesh.distributed else [0]
    if mesh.distributed and pp > 1:
        # NCCL wants every rank of a group in its first operation; a schedule's first P2P
        # batch joins only two ranks, so the pipeline group meets once here.
        dist.all_reduce(torch.zeros(1, device=mesh.device_type), group=mesh.group("pp"))
    stage = PipelineStage(chunks, [list(ranges[s]) for s in stages], pp, rank, virtual, p.pp_schedule, peers, tied_group)
    log.info(
        "pipeline rank %d/%d (%s, v=%d): stages %s, layers %s",
        rank, pp, p.pp_schedule, virtual, stages, stage.layer_ids,
    )
    return stage


def _hidden_shape(micro, config: Config, mesh: ParallelMesh) -> tuple[int, int]:
    tokens = micro.tokens.shape[0]
    tp = mesh.size("tp")
    if config.parallel.sequence_parallel and tp > 1:
        tokens //= tp
    return tokens, config.model.dim


def tie_for_data_parallel(stage: PipelineStage) -> None:
    """Hand the tied embedding's gradient sum to the data-parallel reducer: tag each copy
    with the first/last-stage group (core.parallel.data sums tagged copies after its own
    reduction) and stop the schedule's own sum, which reads .grad the reducer frees."""
    if stage.tied_group is None:
        return
    for weight in _tied_weights(stage):
        weight.pp_tied_group = stage.tied_group
    stage.tied_grads_reduced_elsewhere = True


def _tied_weights(stage: PipelineStage) -> list[nn.Parameter]:
    """The copies of the tied embedding this rank holds (first and/or last stage): the last
    stage's is its MTP modules' embedding, else its tied output head."""
    weights = []
    for c, chunk in enumerate(stage.chunks):
        s = stage.stage_of(c)
        if s == 0 and chunk.tok_embeddings is not None:
            weights.append(chunk.tok_embeddings.weight)
        if s == stage.num_stages - 1:
            copy_ = chunk.tok_embeddings if getattr(chunk, "mtp", None) is not None else chunk.output
            if copy_ is not None and all(copy_.weight is not w for w in weights):
                # Counted once for the global grad norm: the first stage holds the other copy.
                copy_.weight.pp_tied_duplicate = True
                weights.append(copy_.weight)
    return weights


class _Batch:
    """The works of one batch_isend_irecv, waited for once: a gloo send's wait consumes one
    completion of its buffer, so waiting twice would block for ever."""

    def __init__(self, works: list, sent: list[torch.Tensor]):
        self.works, self.sent = works, sent  # the sent tensors must live until sent

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []


class _Clock:
    """Compute time vs step time; CUDA events on GPU (kernels run asynchronously)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.start = self._now()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(self):
        clock = self

        class _Span:
            def __enter__(self):
                self.begin = clock._now()

            def __exit__(self, *exc):
                clock.spans.append((self.begin, clock._now()))

        return _Span()

    def finish(self) -> tuple[float, float]:
        end = self._now()
        if self.cuda:
            end.synchronize()
            busy = sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
            return busy, self.start.elapsed_time(end) / 1e3
        return sum(b - a for a, b in self.spans), end - self.start


def run_pipeline_step(
    stage: PipelineStage,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor | tuple[torch.Tensor, Any]],
    mesh: ParallelMesh,
    config: Config,
    loss_divisor: float,
    forward_context: Callable[[], ContextManager] | None = None,
    backward_context: Callable[[int, bool], ContextManager] | None = None,
    last_forward: Callable[[nn.Module, torch.Tensor, Any], Any] | None = None,
    extra_values: int = 0,
) -> PipelineStepResult:
    """Forward and backward every micro-batch through the pipeline; gradients accumulate in
    `.grad` (the caller zeroes them between optimizer steps and reduces them over dp after).

    micro_batches: objects with `.tokens`, `.labels`, `.position_ids` [T] and `.meta`
    (`core.train.data.StepInputs`), the same list on every rank of the pipeline.
    loss_fn(output, micro) -> loss sum (or a (sum, count) tuple) on the last stage; each
    micro-batch's sum is divided by `loss_divisor` (the global label count) before backward.
    forward_context: wraps each forward (e.g. autocast). backward_context(chunk, last):
    wraps each backward; `last` marks a chunk's final backward of the step (e.g. to let a
    data-parallel wrapper start its reduction only then).
    last_forward(chunk, x, micro): the last stage's forward, whose output goes to loss_fn
    (default: chunk(x, micro.position_ids, micro.meta)). loss_fn may return `LossParts`; then
    `extra_values` is the length of their `extra`, the same on every rank.
    Collective over the pipeline group; one call per optimizer step is the intended use."""
    run = _StepRun(stage, micro_batches, loss_fn, mesh, config, loss_divisor, forward_context, backward_context,
                   last_forward, extra_values)
    for item in run.program:
        if isinstance(item, Post):
            run.post(item)
        elif item.kind == "F":
            run.forward(item)
        else:
            run.backward(item)
    return run.finish()


class _StepRun:
    """One optimizer step's execution of this rank's program: posts, forwards, backwards."""

    def __init__(self, stage: PipelineStage, micro_batches, loss_fn, mesh: ParallelMesh, config: Config,
                 loss_divisor: float, forward_context, backward_context, last_forward=None, extra_values: int = 0):
        self.stage, self.micro_batches, self.loss_fn = stage, micro_batches, loss_fn
        self.last_forward = last_forward
        self.mesh, self.config = mesh, config
        self.program = plan_step(stage.schedule, stage.pp, stage.virtual, len(micro_batches)).programs[stage.pp_rank]
        self.last_stage = stage.num_stages - 1
        self.divisor = float(max(loss_divisor, 1.0))
        param = next(p for c in stage.chunks for p in c.parameters() if p.is_floating_point())
        self.device, self.dtype = param.device, param.dtype
        self.group = mesh.group("pp")
        self.forward_context = forward_context or nullcontext
        self.backward_context = backward_context
        self.final_backward = {a.chunk: a for a in self.program if isinstance(a, Action) and a.kind == "B"}
        reduce_tied = stage.tied_group is not None and not stage.tied_grads_reduced_elsewhere
        self.tied = _tied_weights(stage) if reduce_tied else []
        self.tied_before = [w.grad.clone() if w.grad is not None else None for w in self.tied]
        self.recv_work: dict[Message, tuple[torch.Tensor, _Batch]] = {}  # buffer and the batch it came in
        self.to_send: dict[Message, torch.Tensor] = {}
        self.batches: list[_Batch] = []
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.extra_sums = torch.zeros(extra_values, dtype=torch.float32, device=self.device)
        self.clock = _Clock(self.device)

    def _received(self, message) -> torch.Tensor:
        buffer, batch = self.recv_work.pop(message)
        batch.wait()
        return buffer

    def post(self, item: Post) -> None:
        ops, meta = [], []
        for peer, message in item.sends:
            tensor = self.to_send.pop(message)
            ops.append(dist.P2POp(dist.isend, tensor, self.stage.peers[peer], self.group))
            meta.append((None, tensor))
        for peer, message in item.recvs:
            shape = _hidden_shape(self.micro_batches[message.micro], self.config, self.mesh)
            buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffer, self.stage.peers[peer], self.group))
            meta.append((message, buffer))
        # NCCL coalesces a batch into one Work, gloo returns one per op: a receive waits
        # for its whole batch (its sends were posted with it, so that costs nothing extra).
        batch = _Batch(dist.batch_isend_irecv(ops), [t for msg, t in meta if msg is None])
        self.batches.append(batch)
        for message, tensor in meta:
            if message is not None:
                self.recv_work[message] = (tensor, batch)

    def forward(self, item: Action) -> None:
        s, micro = self.stage.stage_of(item.chunk), self.micro_batches[item.micro]
        chunk = self.stage.chunks[item.chunk]
        x = micro.tokens if s == 0 else self._received(Message("act", s, item.micro)).requires_grad_()
        with self.clock.span(), self.forward_context():
            if s == self.last_stage and self.last_forward is not None:
                out = self.last_forward(chunk, x, micro)
            else:
                out = chunk(x, micro.position_ids, micro.meta)
            if s == self.last_stage:
                part = self.loss_fn(out, micro)
                if isinstance(part, LossParts):
                    self.loss_sum += part.reported.detach().float()
                    self.extra_sums += part.extra.detach().float()
                    out = part.objective
                else:
                    part = part[0] if isinstance(part, tuple) else part
                    self.loss_sum += part.detach().float()
                    out = part / self.divisor
        if s != self.last_stage:
            _check_activation(out, _hidden_shape(micro, self.config, self.mesh), self.dtype, s)
            self.to_send[Message("act", s + 1, item.micro)] = out.detach().contiguous()
        self.saved[(item.chunk, item.micro)] = (x if s > 0 else None, out)

    def backward(self, item: Action) -> None:
        s = self.stage.stage_of(item.chunk)
        x, out = self.saved.pop((item.chunk, item.micro))
        grad = None if s == self.last_stage else self._received(Message("grad", s, item.micro))
        last = item is self.final_backward[item.chunk]
        ctx = self.backward_context(item.chunk, last) if self.backward_context else nullcontext()
        with self.clock.span(), ctx:
            torch.autograd.backward(out, grad)
        if s > 0:
            self.to_send[Message("grad", s - 1, item.micro)] = x.grad.contiguous()

    def finish(self) -> PipelineStepResult:
        for batch in self.batches:
            batch.wait()
        compute_s, step_s = self.clock.finish()
        _sync_tied_grads(self.tied, self.tied_before, self.stage.tied_group)
        idle = 1.0 - compute_s / step_s if step_s > 0 else 0.0
        # One all-reduce tells every pipeline rank the loss (only the last stage has it) and the
        # ranks' mean idle share.
        summary = torch.cat([torch.stack([self.loss_sum.double(), torch.tensor(idle, dtype=torch.float64, device=self.device)]),
                             self.extra_sums.double()])
        if self.group is not None and self.stage.pp > 1:
            dist.all_reduce(summary, group=self.group)
        pp, m = self.stage.pp, len(self.micro_batches)
        result = PipelineStepResult(
            loss_sum=summary[0].float(),
            theoretical_bubble=theoretical_bubble(pp, m, self.stage.virtual),
            idle_fraction=idle,
            mean_idle_fraction=float(summary[1]) / pp,
            compute_s=compute_s,
            step_s=step_s,
            extra_sums=summary[2:].float(),
        )
        log.debug("pipeline step: bubble theory %.3f, idle here %.3f, idle mean %.3f",
                  result.theoretical_bubble, idle, result.mean_idle_fraction)
        return result


def _check_activation(out: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, stage: int) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise RuntimeError(
            f"pipeline stage {stage} produced an activation of shape {tuple(out.shape)} and dtype {out.dtype}, "
            f"but the next stage expects {shape} {dtype} (tokens of the micro-batch / tp under sequence "
            f"parallelism, model.dim, the parameters' dtype); does a step between stages change the hidden state?"
        )


@torch.no_grad()
def _sync_tied_grads(weights: list[nn.Parameter], before: list[torch.Tensor | None], group) -> None:
    """Add this step's gradient of each copy of the tied embedding to the other copy (only
    this step's part, so gradients accumulated before the call are not counted twice)."""
    for weight, prior in zip(weights, before):
        step_grad = torch.zeros_like(weight) if weight.grad is None else weight.grad - (prior if prior is not None else 0)
        dist.all_reduce(step_grad, group=group)
        weight.grad = step_grad if prior is None else prior + step_grad
