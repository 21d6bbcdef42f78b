"""MoE statistics as metrics, summed over every rank and every pipeline stage.

Each MoE layer counts, over its training forwards since the last read (`MoELayer.take_stats`),
its assignments per expert, its forwards, assignments and drops (of document tokens: padding is
not counted), and the sums of its balancing and z-loss values with what they are averaged over
(micro-batches or sequences; document tokens), each micro-batch's recorded once, by the first
rank of its context-parallel group. A training loop takes them from every layer at a step's end
(`take_moe_stats`: copies to the host, no sync) and, once the step is done, packs this rank's
into one flat float64 vector (`MoEStatsLayout.pack`) laid out alike on every rank: a slot per
MoE layer of the WHOLE model, whichever pipeline stage holds it, zeros where this rank holds
none. Summed over all ranks (the loop adds the vector to the one all-reduce of its step
metrics), it holds the statistics of the step's global batch, which `summarize` reads as:

  moe/layer{i}/tokens_per_expert  assignments per expert over the global batch (all E, before drops)
  moe/layer{i}/max_mean_load      max / mean of that list (1.0 = perfectly balanced)
  moe/layer{i}/aux_loss           balancing loss without coeff (1.0 = balanced): mean over the step's
                                  micro-batches, or with aux_loss_per_sequence over its sequences
  moe/layer{i}/z_loss             router z-loss without coeff, mean over the step's document tokens
  moe/layer{i}/dropped_frac       fraction of assignments dropped by capacity (0 dropless)
  moe/max_mean_load               worst layer's max_mean_load
  moe/aux_loss_term               sum over layers of aux_coeff*aux_loss + z_coeff*z_loss
  moe/all_to_all_s                seconds in the token all-to-alls of all layers: summed over the
                                  pipeline's stages, mean over the ranks of a stage (with the
                                  run's `moe.comm.ExchangeTimer`: expert parallelism)

Every assignment is counted once whatever the layout: data-, context- and expert-parallel
ranks and "split" TP ranks (etp = 1) count their own tokens; "sharded" TP ranks (etp = tp)
route the same tokens, so their sums are divided by tp. A micro-batch split over a
context-parallel group is one unit (moe.layer's definitions): the per-sequence loss, the
z-loss and the loads equal the single-process run's on every layout, dynamic CP included; the
micro-batch level loss wherever the micro-batches are the same (every static layout).
"""

from __future__ import annotations

import torch
from torch import nn

from core.config import ModelConfig, MoEConfig
from core.rules import moe_layer_rule
from core.mesh import ParallelMesh
from moe.comm import ExchangeTimer
from moe.layer import moe_layers

__all__ = ["MoEStatsLayout", "take_moe_stats", "moe_metrics"]

# Per layer: these counters, then the E assignment counts.
_FIELDS = ("forwards", "assignments", "dropped", "aux_loss", "z_loss", "aux_units", "z_tokens")


class MoEStatsLayout:
    """Where each MoE layer's statistics sit in one flat vector, the same on every rank."""

    def __init__(self, layers: list[tuple[int, MoEConfig]], timed: bool = False, copies: int = 1,
                 stage_ranks: int = 1):
        """layers: (global layer id, its MoE config) of every MoE layer the vector holds.
        timed: a slot for the all-to-all seconds. copies: ranks that record the same statistics
        for the same tokens ("sharded" TP: tp). stage_ranks: ranks per pipeline stage, over
        which the all-to-all seconds are averaged."""
        self.layers = sorted(layers, key=lambda item: item[0])
        self.timed, self.copies, self.stage_ranks = timed, copies, stage_ranks
        self.offsets: dict[int, int] = {}
        size = 0
        for layer_id, moe in self.layers:
            self.offsets[layer_id] = size
            size += len(_FIELDS) + moe.num_experts
        self.size = size + (1 if timed else 0)

    @classmethod
    def of_model(cls, model: nn.Module, timed: bool = False) -> "MoEStatsLayout":
        """The layers `model` holds, read as one rank's statistics (nothing summed over ranks)."""
        return cls([(layer.layer_id, layer.moe) for layer in moe_layers(model)], timed=timed)

    @classmethod
    def of_run(cls, cfg: ModelConfig, mesh: ParallelMesh, etp: int, timed: bool) -> "MoEStatsLayout":
        """Every MoE layer of the model `cfg` describes, for vectors summed over all ranks of
        `mesh` (etp: parallel.etp, as `moe.parallel.apply_ep` got it); the multi-token
        prediction blocks are layers num_layers.. (DeepSeek-V3's numbering)."""
        layers = [(i, cfg.moe) for i in range(cfg.num_layers + cfg.mtp_layers) if moe_layer_rule(cfg.moe, i)]
        tp = mesh.size("tp")
        return cls(layers, timed=timed, copies=tp if etp > 1 and tp > 1 else 1,
                   stage_ranks=mesh.size("dp_cp") * tp)

    def pack(self, taken: tuple) -> torch.Tensor:
        """This rank's share of the vector, from a `take_moe_stats` whose copies have landed
        (waits for the all-to-alls it timed)."""
        layers, exchange = taken
        out = torch.zeros(self.size, dtype=torch.float64)
        for layer_id, raw in layers:
            if not raw:
                continue
            at = self.offsets[layer_id]
            for i, name in enumerate(_FIELDS):
                out[at + i] = float(raw.get(name, 0))
            counts = raw["tokens_per_expert"]
            out[at + len(_FIELDS):at + len(_FIELDS) + counts.numel()] = counts.double()
        if self.timed and exchange is not None:
            out[-1] = ExchangeTimer.seconds(exchange)
        return out

    def summarize(self, vector: torch.Tensor) -> dict:
        """The metrics (module docstring) of a packed vector, or of the sum of every rank's."""
        values = vector.tolist()
        metrics, worst, term = {}, 0.0, 0.0
        for layer_id, moe in self.layers:
            at = self.offsets[layer_id]
            forwards, assignments, dropped, aux, z, aux_units, z_tokens = (v / self.copies
                                                                           for v in values[at:at + len(_FIELDS)])
            if forwards == 0:  # no training forward since the last read
                continue
            # Sums of integers, divided by the exact number of copies: integers again.
            counts = [round(c / self.copies) for c in values[at + len(_FIELDS):at + len(_FIELDS) + moe.num_experts]]
            mean = sum(counts) / len(counts)
            stats = {
                "tokens_per_expert": counts,
                "max_mean_load": (max(counts) / mean) if mean > 0 else 0.0,
                "dropped_frac": dropped / max(assignments, 1.0),
            }
            # The layer computes each loss only when its coefficient is set.
            if moe.aux_loss_coeff > 0:
                stats["aux_loss"] = aux / aux_units if aux_units else 0.0
            if moe.z_loss_coeff > 0:
                stats["z_loss"] = z / z_tokens if z_tokens else 0.0
            for name, value in stats.items():
                metrics[f"moe/layer{layer_id}/{name}"] = value
            worst = max(worst, stats["max_mean_load"])
            term += moe.aux_loss_coeff * stats.get("aux_loss", 0.0) + moe.z_loss_coeff * stats.get("z_loss", 0.0)
        if metrics:
            metrics["moe/max_mean_load"] = worst
            metrics["moe/aux_loss_term"] = term
        if self.timed:
            metrics["moe/all_to_all_s"] = values[-1] / self.stage_ranks
        return metrics


def take_moe_stats(model: nn.Module, exchange_timer: ExchangeTimer | None = None) -> tuple:
    """Every MoE layer's raw statistics (and `exchange_timer`'s events) since the last call, on
    their way to the host without a sync: a training loop takes them at the end of a step and
    packs them once that step is done, while the next one already runs."""
    layers = [(layer.layer_id, layer.take_stats()) for layer in moe_layers(model)]
    exchange = exchange_timer.take() if exchange_timer is not None and layers else None  # a stage without MoE times none
    return layers, exchange


def moe_metrics(model: nn.Module, exchange_timer: ExchangeTimer | None = None) -> dict:
    """This rank's metrics (module docstring) over the forwards since the last call, on its own
    tokens and its own layers (no collectives: any rank may call it alone); resets them.
    exchange_timer: the run's timer of the token all-to-alls, which its dispatchers were built with."""
    taken = take_moe_stats(model, exchange_timer)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()  # the copies `take_moe_stats` started
    layout = MoEStatsLayout.of_model(model, timed=exchange_timer is not None)
    return layout.summarize(layout.pack(taken))
