"""The plain model: packed attention equals per-document attention, config errors are clear."""

import pytest
import torch

from core.config import ConfigError, ModelConfig, load_config, resolve_layout
from core.model import AttentionMeta, build_model
from core.attention import varlen_attention


def _meta(lengths):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths))


def test_packed_documents_do_not_attend_across_boundaries():
    # Reference: each document run alone as its own batch. Packed: all in one row.
    # fp32 on CPU; the only difference is summation order inside SDPA, so 1e-5.
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)
    model = build_model(cfg, seed=1)
    lengths = [5, 9, 1, 17]
    tokens = torch.randint(0, 64, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    packed = model(tokens, positions, _meta(lengths))
    start = 0
    for n in lengths:
        alone = model(tokens[start:start + n], torch.arange(n), _meta([n]))
        torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_reference_attention_matches_explicit_mask():
    torch.manual_seed(0)
    lengths = [3, 7, 7, 2]
    total = sum(lengths)
    q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    out = varlen_attention(q, k, v, _meta(lengths).cu_seqlens, max(lengths))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk.double()) / 8 ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    expected = torch.einsum("hts,shd->thd", scores.softmax(-1), vv.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_config_overrides_and_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nnum_layers = 3\n[train]\nmax_steps = 7\n")
    cfg = load_config(path, ["model.dim=128", "train.run_dir=/tmp/x", "parallel.tp=2"])
    assert (cfg.model.num_layers, cfg.model.dim, cfg.train.max_steps, cfg.train.run_dir) == (3, 128, 7, "/tmp/x")
    with pytest.raises(ConfigError, match="unknown config key 'model.layers'"):
        load_config(None, ["model.layers=2"])
    with pytest.raises(ConfigError, match="must be int"):
        load_config(None, ["model.dim=abc"])
    bad_tp = load_config(None, ["parallel.tp=3"])
    with pytest.raises(ConfigError, match="tp=3 must divide"):
        resolve_layout(bad_tp, 3)
    with pytest.raises(ConfigError, match="world size 6 is not a multiple"):
        resolve_layout(load_config(None, ["parallel.tp=4", "model.num_kv_heads=4"]), 6)
    ok = resolve_layout(load_config(None, ["parallel.tp=2", "train.global_batch_size=8"]), 4)
    assert ok.parallel.dp == 2
    assert resolve_layout(load_config(None, ["train.precision=fp8", "train.compile=true"]), 1).train.compile
    assert resolve_layout(load_config(None, ["train.compile=true", "model.moe.num_experts=4"]), 1).train.compile
    with pytest.raises(ConfigError, match="data.cp_cost: cost model /no/cost.json"):
        resolve_layout(load_config(None, ["data.dataset=/d", "data.cp_cost=/no/cost.json"]), 1)
    with pytest.raises(ConfigError, match="data.cp_cost is the cost model of the trainer's own server"):
        resolve_layout(load_config(None, ["data.address=h:1", "data.cp_cost=/no/cost.json"]), 1)
    cost = tmp_path / "cost.json"
    cost.write_text('{"per_token": 1e-6, "per_pair": 1e-9}')
    assert resolve_layout(load_config(None, ["data.dataset=/d", f"data.cp_cost={cost}"]), 1).data.cp_cost == str(cost)
