"""MoE pieces on one process: grouped GEMM, routers, capacity, losses, the layer, metrics.

References: `expert_mm` against per-group float64 matmuls; the MoE layer against a dense
evaluation that runs EVERY expert on EVERY token (einsum) and combines by the router's
choice — no permutation code shared with the layer. These run in float64, so the layer's
only differences are summation order: 1e-10 relative.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bench.moe_layer import BalancedRouter, accumulating, make_layer as make_bench_layer
from core.config import ModelConfig, MoEConfig
from core.layers import AttentionMeta
from core.train.model import build_model
from moe.dispatcher import AllGatherDispatcher, build_dispatcher, sort_by_expert
from moe.experts import GroupedExperts, expert_mm, expert_mm_loop
from moe.layer import MoELayer, set_moe_loss_scale, update_expert_bias
from moe.stats import MoEStatsLayout, moe_metrics, take_moe_stats
from moe.router import (
    capacity_keep,
    expert_counts,
    load_balancing_loss,
    route,
    sequence_load_balancing_loss,
    z_loss,
)

TIGHT = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny ops: on the shared 2-core machine extra intra-op threads only spin (measured 50x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(**moe) -> ModelConfig:
    base = dict(num_experts=8, top_k=2, ffn_dim=16, aux_loss_coeff=0.0)
    base.update(moe)
    return ModelConfig(vocab_size=64, dim=24, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=32, moe=MoEConfig(**base))


def _layer(**moe) -> MoELayer:
    torch.manual_seed(3)
    layer = MoELayer(_cfg(**moe), layer_id=1).double()
    with torch.no_grad():  # make routing decisive and the experts distinct
        layer.router.weight.normal_(0, 1.0)
        for p in layer.experts.parameters():
            p.normal_(0, 0.3)
    return layer


def every_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """[T, E, D]: every expert (gate, up [E, D, H], down [E, H, D]) on every token, by einsum."""
    h = F.silu(torch.einsum("td,edh->teh", x, gate)) * torch.einsum("td,edh->teh", x, up)
    return torch.einsum("teh,ehd->ted", h, down)


def dense_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then the router's weighted choice (plus shared experts)."""
    r = layer.router(x)
    e = layer.experts
    all_out = every_expert(x, e.w13[:, :, 0], e.w13[:, :, 1], e.w2)  # [T, E, D]
    chosen = all_out.gather(1, r.indices.unsqueeze(-1).expand(-1, -1, x.shape[1]))
    y = (chosen * r.weights.to(x.dtype).unsqueeze(-1)).sum(1)
    return y + layer.shared_experts(x) if layer.shared_experts is not None else y


# ------------------------------------------------------------------ grouped GEMM
def test_expert_mm_matches_per_group_matmul_with_empty_groups():
    torch.manual_seed(0)
    x, w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True), torch.randn(4, 8, 5, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 8, 0])
    out = expert_mm(x, w, torch.cumsum(counts, 0, dtype=torch.int32))
    expected = torch.cat([x[:3] @ w[0], x[3:11] @ w[2]])
    torch.testing.assert_close(out, expected, **TIGHT)
    out.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    expected.square().sum().backward()
    torch.testing.assert_close(gx, x.grad, **TIGHT)
    torch.testing.assert_close(gw, w.grad, **TIGHT)
    assert gw[1].abs().sum() == 0 and gw[3].abs().sum() == 0  # empty groups get no gradient


def test_expert_mm_loop_zero_fills_rows_past_last_group():
    x, w = torch.ones(5, 2), torch.ones(2, 2, 3)
    out = expert_mm_loop(x, w, torch.tensor([1, 3], dtype=torch.int32))
    assert out.shape == (5, 3) and out[3:].abs().sum() == 0 and out[:3].eq(2).all()


# ------------------------------------------------------------------ the experts
def _separate_weights(e: int = 5, d: int = 12, h: int = 8, seed: int = 7):
    """Gate and up [E, D, H] and down [E, H, D] as separate float64 leaves (the old layout)."""
    gen = torch.Generator().manual_seed(seed)
    return [(0.3 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()
            for shape in ((e, d, h), (e, d, h), (e, h, d))]


def _per_group_reference(x, counts, gate, up, down):
    """Rows of group g through expert g (every_expert, then each row's own expert picked)."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    all_out = every_expert(x, gate, up, down)
    return all_out[torch.arange(x.shape[0]), expert_of_row]


@pytest.mark.parametrize("mm", [expert_mm, expert_mm_loop])
def test_grouped_experts_equal_separate_gate_and_up_weights_forward_and_backward(mm):
    # w13[:, :, 0] is the gate and w13[:, :, 1] the up projection, run as one GEMM on the
    # [E, D, 2H] view; the reference multiplies the three separate weights by einsum.
    gate, up, down = _separate_weights()
    experts = GroupedExperts(5, 12, 8, mm=mm).double()
    with torch.no_grad():
        experts.w13.copy_(torch.stack((gate, up), dim=2))
        experts.w2.copy_(down)
    counts = torch.tensor([4, 0, 7, 1, 3])  # an empty expert: no gradient for it
    x = torch.randn(int(counts.sum()), 12, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = experts(x, counts)
    want = _per_group_reference(x_ref, counts, gate, up, down)
    torch.testing.assert_close(y, want, **TIGHT)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, **TIGHT)
    torch.testing.assert_close(experts.w13.grad[:, :, 0], gate.grad, **TIGHT)
    torch.testing.assert_close(experts.w13.grad[:, :, 1], up.grad, **TIGHT)
    torch.testing.assert_close(experts.w2.grad, down.grad, **TIGHT)
    assert experts.w13.grad[1].abs().sum() == 0 and experts.w13.grad[0].abs().sum() > 0


def test_grouped_experts_load_a_state_dict_with_separate_w1_and_w3():
    # Checkpoints written before gate and up were one weight: w1 (gate), w3 (up) [E, D, H].
    gate, up, down = _separate_weights()
    old = {"w1": gate.detach(), "w3": up.detach(), "w2": down.detach()}
    experts = GroupedExperts(5, 12, 8).double()
    missing, unexpected = experts.load_state_dict(old)
    assert not missing and not unexpected and sorted(old) == ["w1", "w2", "w3"]  # the caller's dict untouched
    assert list(experts.state_dict()) == ["w13", "w2"]
    torch.testing.assert_close(experts.w13[:, :, 0], gate.detach(), rtol=0, atol=0)
    torch.testing.assert_close(experts.w13[:, :, 1], up.detach(), rtol=0, atol=0)
    counts = torch.tensor([2, 3, 0, 5, 1])
    x = torch.randn(11, 12, dtype=torch.float64)
    torch.testing.assert_close(experts(x, counts), _per_group_reference(x, counts, gate, up, down).detach(), **TIGHT)
    # Inside a model, under its prefix: the whole MoE layer's output is unchanged.
    layer = _layer()
    x = torch.randn(9, 24, dtype=torch.float64)
    state = layer.state_dict()
    w13 = state.pop("experts.w13")
    state["experts.w1"], state["experts.w3"] = w13[:, :, 0].clone(), w13[:, :, 1].clone()
    fresh = MoELayer(_cfg(), layer_id=1).double()
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)


# ------------------------------------------------------------------ routers
def test_softmax_topk_normalised_and_raw():
    torch.manual_seed(0)
    logits = torch.randn(50, 8)
    idx, w, probs = route(logits, MoEConfig(num_experts=8, top_k=3, normalize_topk=True))
    torch.testing.assert_close(w.sum(-1), torch.ones(50))
    assert torch.equal(idx.sort(-1).values, logits.topk(3).indices.sort(-1).values)  # the same k, in no set order
    torch.testing.assert_close(w, torch.softmax(logits, -1).gather(1, idx) / torch.softmax(logits, -1).gather(1, idx).sum(-1, keepdim=True))
    idx2, w2, _ = route(logits, MoEConfig(num_experts=8, top_k=3, normalize_topk=False))
    torch.testing.assert_close(w2, torch.softmax(logits, -1).gather(1, idx2))
    torch.testing.assert_close(probs.sum(-1), torch.ones(50))


def test_sigmoid_group_limited_routing_matches_brute_force():
    # DeepSeek-V3 style: 16 experts in 4 groups, tokens use their 2 best groups, top-4.
    torch.manual_seed(1)
    moe = MoEConfig(num_experts=16, top_k=4, router="sigmoid", n_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    logits = torch.randn(64, 16)
    idx, w, probs = route(logits, moe)
    s = torch.sigmoid(logits)
    for t in range(64):  # brute force over the 6 group pairs (test only; not a hot path)
        group_score = s[t].view(4, 4).topk(2, dim=-1).values.sum(-1)
        best = set(group_score.topk(2).indices.tolist())
        allowed = [e for e in range(16) if e // 4 in best]
        expected = sorted(sorted(allowed, key=lambda e: -s[t, e].item())[:4])
        assert sorted(idx[t].tolist()) == expected
    torch.testing.assert_close(w.sum(-1), torch.full((64,), 2.5))
    torch.testing.assert_close(probs, s / s.sum(-1, keepdim=True))


def test_bias_steers_selection_not_weights():
    torch.manual_seed(2)
    logits = torch.randn(40, 8)
    moe = MoEConfig(num_experts=8, top_k=2, router="sigmoid", normalize_topk=False)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 wins every token's selection
    idx, w, _ = route(logits, moe, bias)
    assert (idx == 5).any(-1).all()
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, idx))  # unbiased scores


def test_capacity_keeps_highest_weights_within_capacity():
    torch.manual_seed(3)
    idx, w, _ = route(torch.randn(30, 4) + torch.tensor([3.0, 0, 0, 0]), MoEConfig(num_experts=4, top_k=2))
    keep = capacity_keep(idx, w, 4, capacity_factor=1.0)  # capacity = ceil(30*2/4) = 15
    kept_counts = expert_counts(idx[keep], 4)
    assert kept_counts.max() <= 15 and kept_counts[0] == 15  # expert 0 is overloaded
    for e in range(4):
        kept_w, dropped_w = w[(idx == e) & keep], w[(idx == e) & ~keep]
        if dropped_w.numel():
            assert kept_w.min() >= dropped_w.max()


def test_balancing_losses_values():
    t, e, k = 64, 8, 2
    uniform = torch.full((t, e), 1.0 / e)
    idx = torch.arange(t * k).view(t, k) % e  # every expert exactly t*k/e times
    assert math.isclose(load_balancing_loss(uniform, expert_counts(idx, e), k).item(), 1.0, rel_tol=1e-6)
    torch.manual_seed(4)
    probs = torch.softmax(torch.randn(t, e), -1)
    idx = probs.topk(k).indices
    whole = load_balancing_loss(probs, expert_counts(idx, e), k)
    one_seq = sequence_load_balancing_loss(probs, idx, torch.tensor([0, t]), k)
    torch.testing.assert_close(one_seq, whole)
    halves = sequence_load_balancing_loss(probs, idx, torch.tensor([0, 20, t]), k)
    expected = (load_balancing_loss(probs[:20], expert_counts(idx[:20], e), k)
                + load_balancing_loss(probs[20:], expert_counts(idx[20:], e), k)) / 2
    torch.testing.assert_close(halves, expected)
    logits = torch.randn(t, e)
    torch.testing.assert_close(z_loss(logits), (logits.exp().sum(-1).log() ** 2).mean())


# ------------------------------------------------------------------ the layer
@pytest.mark.parametrize("moe", [
    dict(),
    dict(router="sigmoid", n_groups=4, topk_groups=2, top_k=4, num_shared_experts=1, routed_scaling_factor=2.0),
    dict(normalize_topk=False, top_k=1),
])
def test_layer_equals_dense_reference_forward_and_backward(moe):
    layer = _layer(**moe)
    torch.manual_seed(5)
    x = torch.randn(37, 24, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    gx = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    ref = dense_reference(layer, x)
    (ref * g).sum().backward()
    torch.testing.assert_close(y, ref, **TIGHT)
    torch.testing.assert_close(gx, x.grad, **TIGHT)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TIGHT, msg=lambda m: f"{name}: {m}")
    assert grads["router.weight"].abs().sum() > 0


def test_capacity_drops_are_excluded_and_reported():
    layer = _layer(capacity_factor=0.5, top_k=2)
    torch.manual_seed(6)
    x = torch.randn(40, 24, dtype=torch.float64)
    y = layer(x)
    r = layer.router(x)
    assert r.keep is not None and (~r.keep).any()
    ref = dense_reference(layer, x)  # weights of dropped assignments are already 0
    torch.testing.assert_close(y, ref, **TIGHT)
    order, counts = sort_by_expert(r.indices, r.keep, 8)
    assert int(counts.sum()) == int(r.keep.sum()) == order.numel()
    stats = moe_metrics(torch.nn.ModuleList([layer]))
    capacity = math.ceil(0.5 * 40 * 2 / 8)
    assert max(expert_counts(r.indices[r.keep], 8).tolist()) <= capacity
    assert math.isclose(stats["moe/layer1/dropped_frac"], 2 * float((~r.keep).sum()) / (2 * 80))  # 2 forwards


@pytest.mark.parametrize("num_experts", [8, 255, 256, 300, 40000])
def test_sort_by_expert_is_the_stable_sort_of_the_ids(num_experts):
    # The sort runs on the narrowest key type that holds the ids (uint8 up to 256 values):
    # the same order as the stable sort of the int64 ids, with and without dropped assignments.
    torch.manual_seed(num_experts)
    ids = torch.randint(0, num_experts, (513, 6))
    order, counts = sort_by_expert(ids, None, num_experts)
    assert torch.equal(order, torch.argsort(ids.reshape(-1), stable=True))
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=num_experts))
    keep = torch.rand(513, 6) > 0.3
    order, counts = sort_by_expert(ids, keep, num_experts)
    marked = ids.reshape(-1).masked_fill(~keep.reshape(-1), num_experts)
    assert torch.equal(order, torch.argsort(marked, stable=True)[: int(keep.sum())])
    assert torch.equal(counts, torch.bincount(ids[keep], minlength=num_experts))


def test_expert_counts_compiled_equal_eager():
    # Traced, the counts are a compare-and-sum; eagerly a scatter_add: the same counts.
    ids = torch.randint(0, 37, (301, 6), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 36  # one expert much fuller, one (id 35 or so) possibly empty
    traced = torch.compile(expert_counts, backend="aot_eager", fullgraph=True)
    want = torch.bincount(ids.reshape(-1), minlength=37)
    assert torch.equal(traced(ids, 37), want) and torch.equal(expert_counts(ids, 37), want)


def test_allgather_dispatcher_single_rank_equals_alltoall():
    layer = _layer(top_k=3)
    x = torch.randn(19, 24, dtype=torch.float64)
    y = layer(x)
    layer.dispatcher = AllGatherDispatcher(8)
    torch.testing.assert_close(layer(x), y, **TIGHT)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_routing_weights_in_the_experts_equal_weights_in_the_combine(dispatcher):
    # The layer applies each row's routing weight before the experts' down projection (linear,
    # so the same output); against the weighted combine, with dropped assignments: the output,
    # the input's and every parameter's gradient (the router's through the weights).
    grads = []
    for inside in (True, False):
        torch.manual_seed(3)
        layer = _layer(capacity_factor=0.75, top_k=3)
        layer.dispatcher = build_dispatcher(dispatcher, 8, weigh_in_experts=inside)
        x = torch.randn(29, 24, dtype=torch.float64, requires_grad=True)
        out = layer(x)
        (out * torch.linspace(-1, 1, 24, dtype=torch.float64)).sum().backward()
        assert layer.router.weight.grad.abs().sum() > 0
        grads.append([out, x.grad] + [p.grad for p in layer.parameters()])
    assert not bool(layer.router(x.detach()).keep.all())  # some assignments were dropped
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **TIGHT)


def test_aux_loss_gradient_is_coeff_over_num_losses():
    # Reference: the explicit objective out.sum() + coeff/N * aux + zc/N * z, differentiated
    # by autograd; the layer must give the same gradient without returning the loss.
    coeff, zc, n = 0.3, 0.05, 6
    layer = _layer(aux_loss_coeff=coeff, z_loss_coeff=zc)
    set_moe_loss_scale(torch.nn.ModuleList([layer]), n)
    x = torch.randn(30, 24, dtype=torch.float64)
    layer(x).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    r = layer.router(x)
    aux = load_balancing_loss(r.probs, r.tokens_per_expert, 2)
    (dense_reference(layer, x).sum() + (coeff * aux + zc * z_loss(r.logits)) / n).backward()
    # The router computes in fp32 by design; the two objectives add the same fp32 terms in
    # another order, hence fp32 tolerance here, on the gradient's scale: a small entry can be
    # the difference of large terms (5e-7 of the largest entry at worst over 60 inputs).
    want = layer.router.weight.grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * want.abs().max().item())
    with pytest.raises(ValueError, match="num_losses must be > 0"):
        set_moe_loss_scale(torch.nn.ModuleList([layer]), 0)


def _meta(*bounds: int, **fields) -> AttentionMeta:
    cu = torch.tensor(bounds, dtype=torch.int32)
    return AttentionMeta(cu_seqlens=cu, max_seqlen=int(cu.diff().max()), **fields)


def test_per_sequence_aux_loss_needs_and_uses_boundaries():
    layer = _layer(aux_loss_coeff=0.1, aux_loss_per_sequence=True)
    model = torch.nn.ModuleList([layer])
    x = torch.randn(30, 24, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"layer\(x, meta\)"):
        layer(x)
    layer(x, _meta(0, 12, 30))
    r = layer.router(x)
    expected = sequence_load_balancing_loss(r.probs, r.indices, torch.tensor([0, 12, 30]), 2)
    assert math.isclose(moe_metrics(model)["moe/layer1/aux_loss"], expected.item(), rel_tol=1e-9)
    with pytest.raises(ValueError, match="covers 29 tokens but the micro-batch has 30"):
        layer(x, _meta(0, 29))
    # The total the meta states on the host (the trainer's: no device read) is the one checked,
    # whether given or derived from the host's document lengths.
    with pytest.raises(ValueError, match="covers 28 tokens but the micro-batch has 30"):
        layer(x, _meta(0, 12, 30, total_tokens=28))
    with pytest.raises(ValueError, match="covers 27 tokens but the micro-batch has 30"):
        layer(x, _meta(0, 12, 30, doc_lengths=(12, 15)))


def test_each_micro_batch_in_a_model_balances_over_its_own_sequences():
    """Two micro-batches of one step with different documents, through the whole model: each
    forward's aux loss is that of its own boundaries (the per-sequence loss computed by hand
    from the router's output on the hidden states the layer saw), not the other's; the metric
    averages over all sequences of the step."""
    cfg = _cfg(aux_loss_coeff=0.1, aux_loss_per_sequence=True, first_k_dense=1)
    model = build_model(cfg, seed=4).double()
    layer = model.layers["1"].feed_forward
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    t = 30
    metas = [_meta(0, 12, 30), _meta(0, 5, 9, 30)]
    tokens = [torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for tok, meta in zip(tokens, metas):
        model(tok, torch.arange(t), meta).sum().backward()
    expected = []
    for h, meta in zip(seen, metas):
        r = layer.router(h)
        cu = meta.cu_seqlens.long()
        expected.append(sequence_load_balancing_loss(r.probs, r.indices, cu, 2).item())
    assert expected[0] != pytest.approx(expected[1])  # the boundaries matter on these inputs
    got = moe_metrics(model)["moe/layer1/aux_loss"]
    # The metric is the mean over the step's sequences (2 in the first micro-batch, 3 in the second).
    want = (2 * expected[0] + 3 * expected[1]) / 5
    assert math.isclose(got, want, rel_tol=1e-6), (got, expected)  # the statistics sum in fp32


def test_moe_metrics_keys_values_and_reset():
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=64,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, first_k_dense=1, z_loss_coeff=1e-3))
    model = build_model(cfg, seed=0)
    t = 24
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, t], dtype=torch.int32), max_seqlen=t)
    for _ in range(2):  # two micro-batches
        model(torch.randint(0, 64, (t,)), torch.arange(t), meta)
    m = moe_metrics(model)
    assert "moe/layer0/max_mean_load" not in m  # first_k_dense=1: layer 0 is dense
    for i in (1, 2):
        counts = m[f"moe/layer{i}/tokens_per_expert"]
        assert sum(counts) == 2 * t * 2  # every token's 2 choices, both micro-batches
        assert m[f"moe/layer{i}/max_mean_load"] == max(counts) / (sum(counts) / 4)
        assert m[f"moe/layer{i}/dropped_frac"] == 0.0
        assert m[f"moe/layer{i}/aux_loss"] > 0 and m[f"moe/layer{i}/z_loss"] > 0
    assert m["moe/max_mean_load"] == max(m["moe/layer1/max_mean_load"], m["moe/layer2/max_mean_load"])
    assert moe_metrics(model) == {}  # reset after reading
    model.eval()
    model(torch.randint(0, 64, (t,)), torch.arange(t), meta)
    assert moe_metrics(model) == {}  # evaluation forwards are not counted


def test_statistics_summed_over_ranks_are_those_of_the_whole_batch():
    """Two copies of a model each run part of a step's micro-batches (two data-parallel ranks,
    in one process); their packed statistics, summed as the trainer sums them over ranks, read
    as the metrics of one model that ran them all (reference: `moe_metrics` of that model): the
    same loads, the same means (1e-6: fp32 sums). A rank holding some layers only (a pipeline
    stage) leaves the others' slots empty; ranks recording the same tokens ("sharded" TP) are
    divided out."""
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=64,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, first_k_dense=1, aux_loss_coeff=0.01,
                                    aux_loss_per_sequence=True, z_loss_coeff=1e-3))
    ref, first, second = (build_model(cfg, seed=0) for _ in range(3))
    t = 24
    metas = [_meta(0, 24), _meta(0, 5, 24), _meta(0, 10, 16, 24)]
    tokens = [torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for model, picked in ((ref, (0, 1, 2)), (first, (0, 1)), (second, (2,))):
        for i in picked:
            model(tokens[i], torch.arange(t), metas[i])
    layout = MoEStatsLayout([(1, cfg.moe), (2, cfg.moe)])
    summed = layout.pack(take_moe_stats(first)) + layout.pack(take_moe_stats(second))
    got, want = layout.summarize(summed), moe_metrics(ref)
    assert got.keys() == want.keys() and "moe/layer2/aux_loss" in want
    for key, value in want.items():
        assert got[key] == (value if isinstance(value, list) else pytest.approx(value, rel=1e-6)), key
    assert layout.summarize(2 * summed) != got  # twice the tokens ...
    assert MoEStatsLayout(layout.layers, copies=2).summarize(2 * summed) == got  # ... or each counted twice

    stage = build_model(cfg, seed=0)
    del stage.layers["1"]  # what a later pipeline stage holds
    stage(tokens[0], torch.arange(t), metas[0])
    alone = layout.summarize(layout.pack(take_moe_stats(stage)))
    assert "moe/layer2/tokens_per_expert" in alone and not any(k.startswith("moe/layer1/") for k in alone)


def test_aux_loss_free_bias_balances_skewed_input():
    """A frozen router on inputs skewed towards two experts; only the bias moves (rate 0.01,
    300 steps of 256 tokens, top-2 of 8). Reference: the same run with bias_update_rate=0.
    Loads are read through moe_metrics; 'window' sums the last 50 steps' loads (one step's
    512 assignments carry sampling noise of about +-18% per expert)."""
    def run(rate: float, steps: int = 300) -> tuple[float, float, float]:
        torch.manual_seed(8)
        layer = MoELayer(_cfg(num_experts=8, top_k=2, router="sigmoid", bias_update_rate=rate), layer_id=0)
        model = torch.nn.ModuleList([layer])
        with torch.no_grad():
            layer.router.weight.normal_(0, 0.2)
            layer.router.weight[:2] += 0.5  # experts 0 and 1 like the common input direction
        g = torch.Generator().manual_seed(9)
        per_step, counts = [], []
        for _ in range(steps):
            x = torch.randn(256, 24, generator=g) * 0.5 + 1.0  # skewed: a large shared mean
            with torch.no_grad():
                layer(x)
            m = moe_metrics(model)
            per_step.append(m["moe/layer0/max_mean_load"])
            counts.append(torch.tensor(m["moe/layer0/tokens_per_expert"]))
            update_expert_bias(model)
        window = torch.stack(counts[-50:]).sum(0).float()
        return per_step[0], sum(per_step[-50:]) / 50, (window.max() / window.mean()).item()

    start, last_steps, window = run(rate=0.01)
    frozen = run(rate=0.0)
    print(f"\naux-loss-free balancing, max/mean load: first step {start:.2f}, last 50 steps "
          f"{last_steps:.2f} per step, {window:.3f} over the window; without bias {frozen[0]:.2f} -> "
          f"{frozen[1]:.2f} / {frozen[2]:.3f}")
    assert start > 3.0 and frozen[1] > 3.0 and frozen[2] > 3.0  # the input really is skewed (max 4.0)
    assert window < 1.1 and last_steps < 2.0


# ------------------------------------------------------------------ GPU (skipped without CUDA)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_expert_mm_native_bf16_matches_float64():
    from moe.experts import _native_reason

    torch.manual_seed(0)
    dev = torch.device("cuda")
    counts = torch.tensor([40, 0, 97, 3, 0, 160, 1, 19], device=dev)
    x = torch.randn(int(counts.sum()), 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(8, 128, 256, device=dev) * 0.1).to(torch.bfloat16).requires_grad_()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert _native_reason(x, w) is None  # the torch._grouped_mm path really runs
    out = expert_mm(x, w, offsets)
    g = torch.randn_like(out)
    out.backward(g)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = expert_mm_loop(xd, wd, offsets)
    ref.backward(g.double())
    # bf16 output rounding (2^-8 relative) on top of fp32 accumulation.
    for got, want in ((out, ref), (x.grad, xd.grad), (w.grad, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.gpu
@needs_gpu
def test_bf16_router_logits_and_gradients_match_float64():
    from moe.router import router_logits

    torch.manual_seed(0)
    x = torch.randn(1000, 2048, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (0.02 * torch.randn(64, 2048, device="cuda")).to(torch.bfloat16).requires_grad_()
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = xd @ wd.t()
    # Exact products, fp32 sums over 2048 terms: within 2^-24 * 2048 of sum |x||w| per logit.
    bound = (xd.abs() @ wd.abs().t()) * 2048 * 2.0 ** -24
    assert ((logits.double() - ref).abs() <= bound).all()
    g = torch.randn_like(logits) * 1e-3
    logits.backward(g)
    ref.backward(g.double())
    # The gradient GEMMs see g to 16 significant bits (2^-16 of each |g| term, fp32 sums on top);
    # the results are rounded to bf16 (2^-9 relative).
    gd = g.double().abs()
    for got, want, spread in ((x.grad, xd.grad, gd @ wd.detach().abs()), (w.grad, wd.grad, gd.t() @ xd.detach().abs())):
        err = (got.double() - want).abs()
        assert (err <= 2.0 ** -8 * want.abs() + 2.0 ** -15 * spread).all()


@pytest.mark.gpu
@needs_gpu
def test_layer_bf16_on_gpu_matches_fp32_dense_reference():
    # Same bf16 weights and inputs; reference in fp32 on the GPU. The router reads both in
    # fp32, so routing is identical; differences are bf16 rounding of the expert path.
    layer = _layer(num_shared_experts=1, top_k=2).float()
    layer = layer.to("cuda", torch.bfloat16)
    x = torch.randn(256, 24, device="cuda").to(torch.bfloat16)
    y = layer(x)  # shared experts on the side stream
    torch.cuda.synchronize()
    ref_layer = _layer(num_shared_experts=1, top_k=2).float().to("cuda")
    ref_layer.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    ref = dense_reference(ref_layer, x.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("per_sequence", [False, True])
def test_layer_forward_and_backward_make_no_host_sync(per_sequence):
    # A host sync in a layer drains the GPU's queue, which then idles while the host issues the
    # next kernels: a sync per MoE layer and micro-batch. Dropless on one rank needs none.
    layer = _layer(num_shared_experts=1, top_k=2, router="sigmoid", n_groups=4, topk_groups=2, aux_loss_coeff=1e-2,
                   z_loss_coeff=1e-3, aux_loss_per_sequence=per_sequence).to("cuda", torch.bfloat16)
    x = torch.randn(256, 24, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # Boundaries already on the device, their total known on the host.
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32), max_seqlen=156,
                         total_tokens=256) if per_sequence else None
    layer.train()
    layer(x, meta).float().square().mean().backward()  # first call: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, meta).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_layer_forward_and_backward_replay_from_a_cuda_graph(compiled):
    # Dropless routing keeps every size on the device (the grouped GEMMs read their offsets
    # there), so a whole forward and backward can be one CUDA graph: each replay must write the
    # gradients the eager calls write, bit for bit (same kernels, same inputs).
    layer = make_bench_layer(8, 2, 256, 128, "cuda", torch.bfloat16)
    run = torch.compile(layer) if compiled else layer
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    tensors = [*layer.parameters(), x]

    def step():
        for t in tensors:
            t.grad = None
        run(x).backward(grad)

    for _ in range(3):  # compilation and lazy initialisation outside the capture
        step()
    torch.cuda.synchronize()
    want = [t.grad.clone() for t in tensors]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    got = [t.grad for t in tensors]
    for t in got:
        t.fill_(float("nan"))  # the replay must write every gradient
    graph.replay()
    torch.cuda.synchronize()
    for name, g, w in zip([n for n, _ in layer.named_parameters()] + ["x"], got, want):
        assert torch.equal(g, w), name


def test_full_recompute_same_grads_and_no_double_counting():
    # Reference: the same model without recomputation. The recomputed forward inside
    # backward must not count its tokens into the metrics or the bias loads again.
    from core.parallel.recompute import apply_recompute

    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, z_loss_coeff=1e-3, bias_update_rate=0.01))
    t = 20
    tokens, meta = torch.randint(0, 64, (t,)), AttentionMeta(cu_seqlens=torch.tensor([0, t], dtype=torch.int32), max_seqlen=t)
    grads = []
    for mode in ("none", "full"):
        model = apply_recompute(build_model(cfg, seed=2), mode)
        model(tokens, torch.arange(t), meta).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        m = moe_metrics(model)
        assert sum(m["moe/layer0/tokens_per_expert"]) == t * 2
        assert int(model.layers["1"].feed_forward._bias_load.sum()) == t * 2
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_mfu_counts_the_active_parameters_of_moe_layers():
    from core.train.model import count_params

    cfg = _cfg(num_shared_experts=1, first_k_dense=1)  # 2 layers: layer 0 dense, layer 1 MoE
    model = build_model(cfg, seed=0)
    total, embedding, active = count_params(model)
    assert total == sum(p.numel() for p in model.parameters())
    assert embedding == 64 * 24
    experts = model.layers["1"].feed_forward.experts
    per_expert = 3 * 24 * 16  # w13: dim x 2 x ffn; w2: ffn x dim
    assert sum(p.numel() for p in experts.parameters()) == 8 * per_expert
    assert active == total - (8 - 2) * per_expert  # a token visits top_k = 2 of the 8
    dense = build_model(ModelConfig(vocab_size=64, dim=24, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=32), 0)
    assert count_params(dense)[2] == sum(p.numel() for p in dense.parameters())


def test_expert_mm_follows_autocast_like_matmul():
    # fp32 weights under bf16 autocast: the product runs in bf16, gradients reach the fp32 leaves.
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = expert_mm(x, w, offsets)
    assert out.dtype == torch.bfloat16
    want = expert_mm_loop(x.bfloat16(), w.bfloat16(), offsets)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert w.grad[1].abs().sum() == 0 and w.grad[2].abs().sum() > 0  # the empty group gets nothing


def test_weighted_combine_gradients_match_autograd_of_bmm():
    # The combine's hand-written backward against autograd through the plain bmm, in float64.
    from moe.dispatcher import _WeightedSum

    torch.manual_seed(4)
    weights = torch.rand(7, 3, dtype=torch.float64, requires_grad=True)
    slots = torch.randn(7, 3, 5, dtype=torch.float64, requires_grad=True)
    out = _WeightedSum.apply(weights, slots)
    want = torch.bmm(weights.unsqueeze(1), slots).squeeze(1)
    torch.testing.assert_close(out, want, **TIGHT)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (weights, slots), grad)
    expected = torch.autograd.grad(want, (weights, slots), grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TIGHT)
    assert torch.autograd.gradcheck(_WeightedSum.apply, (weights, slots))


def _main_grads_fused_and_not(param_dtype: torch.dtype, device: str, rows: int = 40):
    """{fused: {param name: main grad}} and {fused: dp.stats["fused_grads"]} after three
    micro-batches (two under no_sync) of the same MoE layer, with and without the fusion."""
    from contextlib import nullcontext

    from core.mesh import ParallelMesh
    from core.parallel.data import apply_data_parallel

    mesh = ParallelMesh.build(device_type=device)
    main_grads, fused_counts = {}, {}
    for fused in (False, True):
        layer = _layer().float().to(device)
        dp = apply_data_parallel(layer, mesh, distributed_optimizer=False, param_dtype=param_dtype,
                                 gradient_accumulation_fusion=fused)
        gen = torch.Generator().manual_seed(11)
        for micro in range(3):
            x = torch.randn(rows, 24, generator=gen).to(device)
            with dp.no_sync() if micro < 2 else nullcontext(), \
                    torch.autocast(device, dtype=torch.bfloat16, enabled=param_dtype == torch.bfloat16):
                layer(x).float().square().sum().backward()
        dp.finish_grad_sync()
        main_grads[fused] = {slot.name: slot.main_grad.clone() for slot in dp.slots}
        fused_counts[fused] = dp.stats["fused_grads"]
        assert all(p.grad is None for p in layer.parameters())
        dp.remove()
        assert all(p.main_grad_sink is None for p in layer.parameters())
    return main_grads, fused_counts


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_fusion_gives_the_unfused_main_grads(param_dtype):
    # The experts' backward writes their weight gradients into the fp32 main grads itself
    # (copy on the step's first micro-batch, add after), the hook only does the bookkeeping.
    # Three micro-batches (two under no_sync), bf16 params under autocast as on a GPU: the main
    # grads equal the unfused path's (bf16 weight gradient, then the hook's fp32 pass).
    main_grads, fused_counts = _main_grads_fused_and_not(param_dtype, "cpu")
    assert fused_counts == {False: 0, True: 2 * 3}  # w13 (through its [E, dim, 2F] view), w2 in each of 3 micro-batches
    tol = dict(rtol=1e-6, atol=1e-6) if param_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for name, want in main_grads[False].items():
        assert want.abs().max() > 0, name
        torch.testing.assert_close(main_grads[True][name], want, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gradient_accumulation_fusion_on_the_gpu_matches_the_unfused_main_grads():
    # On an H100 with the library built the fused path is the CUTLASS wgrad whose epilogue adds
    # to the fp32 main grad: it skips the bf16 rounding of each micro-batch's gradient, so the
    # two agree to bf16 precision, not bit for bit.
    main_grads, fused_counts = _main_grads_fused_and_not(torch.bfloat16, "cuda", rows=4096)
    assert fused_counts == {False: 0, True: 2 * 3}
    for name, want in main_grads[False].items():
        got = main_grads[True][name]
        assert want.abs().max() > 0 and torch.isfinite(got).all(), name
        err = (got - want).norm() / want.norm()
        assert err < 1e-2, (name, err.item())


def test_gradient_accumulation_fusion_keeps_a_gradient_from_outside_the_experts():
    # An expert weight also used outside the grouped product: autograd sums that gradient with
    # the fused backward's stand-in, and the hook must still add it to the main grad.
    from core.mesh import ParallelMesh
    from core.parallel.data import apply_data_parallel

    grads = {}
    for fused in (False, True):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3, 8, 16))
        model = torch.nn.ParameterList([w])
        dp = apply_data_parallel(model, ParallelMesh.build(), distributed_optimizer=False,
                                 gradient_accumulation_fusion=fused)
        x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
        offsets = torch.tensor([4, 4, 10], dtype=torch.int32)
        (expert_mm(x, w, offsets).square().sum() + (w ** 3).sum()).backward()
        dp.finish_grad_sync()
        grads[fused] = dp.slots[0].main_grad.clone()
        assert dp.stats["fused_grads"] == int(fused)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-6, atol=1e-6)


def test_layer_bench_balanced_routing_gives_every_expert_the_same_rows():
    # bench/moe_layer.py --routing balanced: R/E rows per expert, k distinct experts per token,
    # and the layer runs on it (dispatch, experts, combine) as on the router's own choice.
    layer = make_bench_layer(16, 4, 32, 48, torch.device("cpu"), torch.float32)
    layer.router = BalancedRouter(layer.router, 16)
    x = torch.randn(60, 32)
    routing = layer.router(x)
    assert routing.tokens_per_expert.tolist() == [15] * 16
    assert all(len(set(row)) == 4 for row in routing.indices.tolist())
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_layer_bench_accumulating_rows_add_every_weight_gradient_into_fp32_main_grads():
    # bench/moe_layer.py's layer+acc / dense+acc rows: each run adds the weight gradients into
    # fp32 main grads (experts through their MainGradSink, others by a hook) and leaves no .grad.
    layer = make_bench_layer(8, 2, 16, 24, torch.device("cpu"), torch.float32)
    dense = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(12, 16)
    (layer(x).sum() + dense(x).sum()).backward()
    want = {"w13": layer.experts.w13.grad.clone(), "dense": dense.weight.grad.clone()}
    layer.experts.w13.grad = dense.weight.grad = None
    step = accumulating(lambda: (layer(x).sum() + dense(x).sum()).backward(), layer.experts, [dense.weight])
    step()
    step()
    sinks, mains = step.sinks, step.mains
    torch.testing.assert_close(sinks[layer.experts.w13].slot.main_grad, 2 * want["w13"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mains[dense.weight].main_grad, 2 * want["dense"], rtol=1e-5, atol=1e-6)
    assert dense.weight.grad is None and getattr(layer.experts.w13, "main_grad_sink", None) is None
