"""Dynamic context parallelism in the training loop: run one global step's plan entries.

The data service plans each global step (dataservice.cp_stream): its documents, the same
whatever the layout, go to micro-batches, each on an aligned power-of-two sub-group of the
dp*cp ranks. This rank's stream carries its entries in execution order, each with the
entry's whole documents; here each entry is split over its sub-group (`dynamic_cp_inputs`)
and run forward and backward. The loss is divided by the step's global label count as on
every other layout, so loss and gradients equal the single-process run on the same rows.

Gradients are reduced once, after the step's last micro-batch on every rank: ranks run
different numbers of micro-batches (an idle rank none, its gradients stay zero), so
overlapping the reduction with a "last" backward would launch it at different points of
different ranks' ring exchanges.

With `parallel.cp_comm = "a2a"` an entry's attention is one all-to-all over heads within its
sub-group instead of the ring (`core.parallel.ulysses.dynamic_a2a_inputs`); the plan, the
split's token counts and everything else are the same.

MoE under expert parallelism: the token all-to-alls (or all-gathers) of a MoE layer are
collectives over the ep group, so its ranks must make the same MoE calls in the same order,
while the plan gives ranks different numbers of micro-batches. Each entry comes with its wave
(`StepPlan.waves`: entries of one wave share no rank; a rank's entries rise in wave), and a
rank runs one micro-batch per wave of the step, an empty one (no tokens: every layer runs,
every collective is joined, nothing is computed or counted) in a wave where it has no entry.
Within a wave every rank runs one forward and one backward, so the ring exchanges of an entry
and the all-to-alls of every layer meet in the same order on all ranks, and nothing waits on a
rank of a later wave. Empty micro-batches cost each MoE layer its collectives' latency; the
plan's own idle time is not changed (a rank waiting for a wider group idled there anyway).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple

import torch
from torch import nn

from core.config import Config
from core.layers import AttentionMeta
from core.train.data import StepInputs, mtp_inputs, take_positions
from core.mesh import ParallelMesh
from core.parallel.context import CPSubgroups, apply_cp, dynamic_cp_inputs
from core.parallel.ulysses import apply_a2a_cp, dynamic_a2a_inputs
from dataservice.packing import IGNORE_INDEX

__all__ = ["DynamicCP"]


class _Entry(NamedTuple):
    """What `dynamic_cp_inputs` reads of a plan entry; `docs` index the batch's own documents."""

    group_start: int
    group_size: int
    docs: torch.Tensor


class DynamicCP:
    """The loop's handle: sub-groups built once, a step's entries read and run."""

    def __init__(self, config: Config, mesh: ParallelMesh, subgroups: CPSubgroups):
        self.config, self.mesh, self.subgroups = config, mesh, subgroups
        tp = mesh.size("tp")
        self.multiple_of = tp if config.parallel.sequence_parallel and tp > 1 else 1
        # MoE layers with collectives over ranks that run different entries: one micro-batch per wave.
        self.by_waves = bool(config.model.moe.num_experts) and mesh.size("ep") > 1
        self.split = dynamic_a2a_inputs if config.parallel.cp_comm == "a2a" else dynamic_cp_inputs

    @classmethod
    def build(cls, config: Config, mesh: ParallelMesh, model: nn.Module) -> "DynamicCP":
        """Collective (builds every sub-group). Call before `parallelize`: the ring (or all-to-all)
        attention module goes in even at cp == 1 (groups are made of data-parallel ranks then)."""
        if config.parallel.cp_comm == "a2a":
            apply_a2a_cp(model, None)
        else:
            apply_cp(model, None)
        return cls(config, mesh, CPSubgroups.build(mesh))

    def next_step(self, batches: Iterator, device: torch.device) -> list[StepInputs]:
        """This rank's micro-batches of the next global step (empty when it is idle), split; with
        `by_waves` one per wave of the step, empty ones where this rank has no entry."""
        entries: list = []
        step = None
        while True:
            batch = next(batches)
            if not batch.dynamic_cp:
                raise RuntimeError("parallel.dynamic_cp is set but the data service sent a batch without a CP plan; "
                                   "is the server older than the trainer?")
            if step is not None and batch.step != step:
                raise RuntimeError(f"step {step} ended early: got a batch of step {batch.step} after entry "
                                   f"{len(entries)} of {batch.cp_microbatches_in_step}")
            step = batch.step
            if batch.cp_microbatches_in_step:
                entries.append((batch.cp_wave, self._inputs(batch, device, self.config.model.mtp_layers)))
            if batch.ends_step:
                if not self.by_waves:
                    return [inputs for _, inputs in entries]
                return self._by_wave(entries, batch.cp_step_waves, device)

    def _by_wave(self, entries: list, waves: int, device: torch.device) -> list[StepInputs]:
        if waves == 0:
            raise RuntimeError("MoE with parallel.ep > 1 under parallel.dynamic_cp needs the plan's waves, which "
                               "this data service does not send; is the server older than the trainer?")
        out: list[StepInputs] = [None] * waves
        for wave, inputs in entries:
            if not 0 <= wave < waves or out[wave] is not None:
                raise RuntimeError(f"the data service sent entries of waves {[w for w, _ in entries]} in a step of "
                                   f"{waves} waves; each wave holds at most one entry of a rank")
            out[wave] = inputs
        return [inputs if inputs is not None else _empty(device, self.config.model.mtp_layers) for inputs in out]

    def _inputs(self, batch, device: torch.device, mtp_layers: int = 0) -> StepInputs:
        cu = batch.cu_seqlens.to(device, torch.int32)
        entry = _Entry(batch.cp_group_start, batch.cp_group_size, torch.arange(cu.numel() - 1, device=device))
        tokens, labels = batch.tokens.reshape(-1).to(device, torch.long), batch.labels.reshape(-1).to(device, torch.long)
        s = self.split(entry, tokens, labels, batch.position_ids.reshape(-1).to(device, torch.long), cu,
                       self.subgroups, multiple_of=self.multiple_of)
        # Every member of the group counts its own shard's labels: they sum to the entry's.
        out = StepInputs(s.tokens, s.labels, s.position_ids, s.meta,
                         num_tokens=batch.num_tokens / batch.cp_group_size,
                         num_labels=float((s.labels != IGNORE_INDEX).sum()),
                         num_microbatches=1 / batch.cp_group_size,
                         num_sequences=(cu.numel() - 1) / batch.cp_group_size)
        if not mtp_layers:
            return out
        # The entry's documents in their order (docs = all of them): `source` indexes this batch,
        # so the MTP inputs made on it follow each position like its label.
        mtp_tokens, mtp_labels = mtp_inputs(tokens, labels, cu, mtp_layers)
        out = take_positions(dataclasses.replace(out, mtp_tokens=mtp_tokens, mtp_labels=mtp_labels), s.source)
        counts = (out.mtp_labels != IGNORE_INDEX).sum(dim=1).tolist()
        return dataclasses.replace(out, mtp_num_labels=tuple(float(n) for n in counts))


def _empty(device: torch.device, mtp_layers: int = 0) -> StepInputs:
    """A micro-batch without tokens: it runs every layer (and joins every collective) on nothing."""
    none = torch.zeros(0, dtype=torch.long, device=device)
    meta = AttentionMeta(cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device), max_seqlen=0, doc_lengths=())
    mtp = {}
    if mtp_layers:
        mtp = dict(mtp_tokens=torch.zeros(mtp_layers, 0, dtype=torch.long, device=device),
                   mtp_labels=torch.zeros(mtp_layers, 0, dtype=torch.long, device=device),
                   mtp_num_labels=(0.0,) * mtp_layers)
    return StepInputs(none, none.clone(), none.clone(), meta, num_tokens=0.0, num_labels=0.0, num_microbatches=0.0,
                      num_sequences=0.0, **mtp)
