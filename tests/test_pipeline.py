"""Pipeline parallelism equals the single-process model (gloo processes on CPU, fp32).

Reference: the plain GPT from the same seed, run in the test process over the same
micro-batches one after the other, each micro-batch's CE sum divided by the step's label
count before backward (what the training loop does without pipelining). The pipelined loss
and every parameter's gradient must match it.

Tolerance: without TP and without a tied embedding each stage runs exactly the reference's
ops on the same inputs, and each parameter accumulates its micro-batch gradients in the same
order (every schedule here runs a chunk's backwards in micro-batch order). With the
reference on one thread, as the worker processes are, the gradients are bitwise equal, and
the test requires that. The tied embedding adds two separately accumulated gradients, and
tensor parallelism splits matmul and vocab reductions over ranks, so those cases get
`rtol=1e-4, atol=1e-6` (measured: at most 6e-7 of the largest gradient; gradients are of
order 1e-3..1e-1 here, and a wrong micro-batch, stage or missing term is off by far more).
The loss is summed in float32 on the last stage and in float64 here: `rel=1e-6`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.config import Config
from core.train.data import StepInputs
from core.train.loss import cross_entropy_sum
from core.mesh import ParallelMesh
from core.layers import AttentionMeta
from core.train.model import build_model
from core.parallel.pipeline import _check_activation, build_pipeline_stage, run_pipeline_step
from core.parallel.schedules import Post, plan_step, theoretical_bubble
from core.rules import check_schedule, partition_layers
from tests.support.distributed import free_port, run_distributed

SEED = 7
TOKENS = 32  # micro_batch_size * seq_len = 2 * 16


def make_config(layers=4, pp=1, tp=1, schedule="1f1b", virtual=1, first=0, last=0, tie=False) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_dim = 64, 32, layers, 4, 2, 64
    m.tie_embeddings = tie
    p = cfg.parallel
    p.pp, p.tp, p.pp_schedule, p.pp_virtual_stages = pp, tp, schedule, virtual
    p.pp_first_stage_layers, p.pp_last_stage_layers = first, last
    cfg.train.micro_batch_size, cfg.train.seq_len = 2, 16
    return cfg


def make_micro_batches(count: int, vocab: int, seed: int = 3, doc_len: int = 0, device="cpu") -> list[StepInputs]:
    """Packed micro-batches of random documents (lengths 3..12, or all `doc_len`), labels -100
    at document ends."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = [doc_len] * (TOKENS // doc_len) if doc_len else []
        while sum(lengths) < TOKENS:
            lengths.append(min(int(torch.randint(3, 13, (1,), generator=g)), TOKENS - sum(lengths)))
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        tokens = torch.randint(0, vocab, (TOKENS,), generator=g)
        labels = tokens.roll(-1)
        labels[cu[1:].long() - 1] = -100
        positions = torch.cat([torch.arange(n) for n in lengths])
        meta = AttentionMeta(cu_seqlens=cu.to(device), max_seqlen=max(lengths))
        batches.append(StepInputs(tokens.to(device), labels.to(device), positions.to(device), meta, TOKENS,
                                  int((labels != -100).sum())))
    return batches


def reference(cfg: Config, micro: list[StepInputs], device="cpu") -> tuple[float, dict[str, torch.Tensor]]:
    """The plain model over the micro-batches in order, on one thread like the workers (the
    thread count changes how CPU kernels split their sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(cfg.model, seed=SEED).to(device)
        divisor = sum(mb.num_labels for mb in micro)
        total = 0.0
        for mb in micro:
            part, _ = cross_entropy_sum(model(mb.tokens, mb.position_ids, mb.meta), mb.labels)
            (part / divisor).backward()
            total += float(part.detach())
    finally:
        torch.set_num_threads(threads)
    return total, {name: p.grad.cpu() for name, p in model.named_parameters()}


def _pipeline_cases(rank, world, cases, doc_len=0):
    from core.parallel.tensor import apply_tp, sync_sequence_parallel_grads

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = []
    for kwargs, num_micro in cases:
        cfg = make_config(**kwargs)
        p = cfg.parallel
        mesh = ParallelMesh.build(pp=p.pp, dp=world // (p.pp * p.tp), tp=p.tp)
        stage = build_pipeline_stage(build_model(cfg.model, seed=SEED).to(device), mesh, cfg)
        for chunk in stage.chunks:  # after the split, module-replacing steps go per chunk
            apply_tp(chunk, mesh, sequence_parallel=True)
        micro = make_micro_batches(num_micro, cfg.model.vocab_size, doc_len=doc_len, device=device)
        tp_group = mesh.group("tp") if p.tp > 1 else None
        result = run_pipeline_step(
            stage, micro, lambda logits, mb: cross_entropy_sum(logits, mb.labels, tp_group), mesh, cfg,
            loss_divisor=sum(mb.num_labels for mb in micro),
        )
        for chunk in stage.chunks:
            sync_sequence_parallel_grads(chunk, mesh)
        # numpy, pickled by value: a tensor would travel as a shared-memory handle that dies
        # with this process, possibly before the parent has read it.
        grads = {name: (prm.grad.cpu().numpy(), getattr(prm, "tp_shard_dim", None)) for name, prm in stage.named_parameters()}
        out.append({
            "loss": float(result.loss_sum), "grads": grads, "layers": stage.layer_ids,
            "tp_rank": mesh.coordinate("tp"), "metrics": result.metrics(),
        })
    return out


# name: (config, number of micro-batches, tolerance kind). All run on 4 processes: the pp=2
# cases as pp=2 x dp=2 (both data-parallel replicas get the same micro-batches, and their
# pipeline peers are ranks two apart rather than neighbours).
CASES = {
    "pp2_1f1b": (dict(layers=4, pp=2), 4, "exact"),
    "pp2_1f1b_fewer_micro_than_stages": (dict(layers=4, pp=2), 1, "exact"),
    "pp2_interleaved_v2": (dict(layers=4, pp=2, schedule="interleaved", virtual=2), 4, "exact"),
    "pp2_uneven_1_3": (dict(layers=4, pp=2, first=1, last=3), 3, "exact"),
    "pp2_tied": (dict(layers=4, pp=2, tie=True), 4, "loose"),
    "pp4_1f1b": (dict(layers=8, pp=4), 6, "exact"),
    "pp4_interleaved_v2": (dict(layers=8, pp=4, schedule="interleaved", virtual=2), 4, "exact"),
    "pp4_uneven_1_3": (dict(layers=8, pp=4, first=1, last=3), 4, "exact"),
    "pp2_tp2_1f1b": (dict(layers=4, pp=2, tp=2), 4, "loose"),
    "pp2_tp2_interleaved_tied": (dict(layers=4, pp=2, tp=2, schedule="interleaved", virtual=2, tie=True), 4, "loose"),
}


@pytest.fixture(scope="module")
def runs():
    """One launch of 4 processes runs every case: process start-up dominates the cost."""
    per_rank = run_distributed(_pipeline_cases, 4, [(kw, m) for kw, m, _ in CASES.values()])
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CASES)}


def _expected(ref: dict[str, torch.Tensor], name: str, shard_dim, tp_rank: int, tp: int) -> torch.Tensor:
    full = ref[name] if name in ref else ref["tok_embeddings.weight"]  # tied: output.weight is that one
    if shard_dim is None or tp == 1:
        return full
    size = full.shape[shard_dim] // tp
    return full.narrow(shard_dim, tp_rank * size, size)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_every_gradient_match_single_process(runs, name):
    kwargs, num_micro, tol = CASES[name]
    cfg = make_config(**kwargs)
    ref_loss, ref_grads = reference(cfg, make_micro_batches(num_micro, cfg.model.vocab_size))
    rtol, atol = (0.0, 0.0) if tol == "exact" else (1e-4, 1e-6)
    covered = set()
    for rank_result in runs[name]:
        assert rank_result["loss"] == pytest.approx(ref_loss, rel=1e-6)  # known on every rank
        for pname, (grad, shard_dim) in rank_result["grads"].items():
            grad = torch.from_numpy(grad)
            expected = _expected(ref_grads, pname, shard_dim, rank_result["tp_rank"], cfg.parallel.tp)
            torch.testing.assert_close(grad, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name} {pname}: {m}")
            covered.add(pname)
    # Every parameter of the plain model lives on some stage (output.weight stands for a tied one).
    expected_names = set(ref_grads) | ({"output.weight"} if cfg.model.tie_embeddings else set())
    assert covered == expected_names


@pytest.mark.slow
def test_uneven_and_interleaved_layer_placement(runs):
    assert [r["layers"] for r in runs["pp4_uneven_1_3"]] == [[[0]], [[1, 2]], [[3, 4]], [[5, 6, 7]]]
    assert [r["layers"] for r in runs["pp2_uneven_1_3"]] == [[[0]], [[0]], [[1, 2, 3]], [[1, 2, 3]]]  # pp x dp
    # Megatron placement: rank r holds virtual stages r and r + pp.
    assert [r["layers"] for r in runs["pp4_interleaved_v2"]] == [
        [[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]
    ]


@pytest.mark.slow
def test_bubble_metrics_are_reported(runs):
    metrics = runs["pp4_1f1b"][0]["metrics"]
    assert metrics["pp_bubble_theory"] == pytest.approx(3 / 9)
    assert runs["pp4_interleaved_v2"][0]["metrics"]["pp_bubble_theory"] == pytest.approx(3 / 11)
    for result in runs["pp4_1f1b"]:
        assert 0.0 <= result["metrics"]["pp_idle"] < 1.0


# ---- single-process checks of the planning ----


def test_partition_layers_even_uneven_and_refusals():
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert partition_layers(8, 4, first=1, last=3) == [range(0, 1), range(1, 3), range(3, 5), range(5, 8)]
    assert partition_layers(6, 3, last=1) == [range(0, 3), range(3, 5), range(5, 6)]
    with pytest.raises(ValueError, match="at least one layer"):
        partition_layers(4, 4, first=2)
    with pytest.raises(ValueError, match="must equal model.num_layers=4"):
        partition_layers(4, 2, first=1, last=2)
    with pytest.raises(ValueError, match=">= 0"):
        partition_layers(4, 2, first=-1)


def test_schedule_refusals_name_the_setting():
    with pytest.raises(ValueError, match="must be one of 1f1b, interleaved"):
        check_schedule("gpipe", 2, 1)
    with pytest.raises(ValueError, match="pp_virtual_stages >= 2"):
        check_schedule("interleaved", 2, 1)
    with pytest.raises(ValueError, match="needs parallel.pp_schedule='interleaved'"):
        check_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"multiple of parallel.pp=4"):
        plan_step("interleaved", 4, 2, 6)


@pytest.mark.parametrize("schedule,vs", [("1f1b", (1,)), ("interleaved", (2, 3, 4))])
def test_plans_run_to_the_end_with_the_theoretical_bubble(schedule, vs):
    for pp in (1, 2, 3, 4, 8) if schedule == "1f1b" else (2, 3, 4, 8):
        for v in vs:
            for m in (1, 2, 3, 5, 8, 16) if schedule == "1f1b" else (pp, 2 * pp, 4 * pp):
                plan = plan_step(schedule, pp, v, m)
                assert all(len(t) == 2 * m * v for t in plan.ticks)  # every forward and backward ran
                # Unit-cost clock: the planned idle share is the textbook bubble exactly.
                assert plan.idle_fraction() == pytest.approx(theoretical_bubble(pp, m, v))


@pytest.mark.parametrize("schedule,pp,v,m", [("1f1b", 4, 1, 6), ("interleaved", 2, 2, 4), ("interleaved", 4, 3, 8)])
def test_both_ends_of_every_link_agree_on_message_order(schedule, pp, v, m):
    """NCCL matches a pair's messages by issue order: sender and receiver must list them alike."""
    plan = plan_step(schedule, pp, v, m)
    for a in range(pp):
        for b in range(pp):
            sent = [msg for item in plan.programs[a] if isinstance(item, Post) for peer, msg in item.sends if peer == b]
            got = [msg for item in plan.programs[b] if isinstance(item, Post) for peer, msg in item.recvs if peer == a]
            assert sent == got
    messages = sum(len(item.sends) for prog in plan.programs for item in prog if isinstance(item, Post))
    assert messages == 2 * m * (pp * v - 1)  # one activation and one gradient per stage boundary


def test_single_stage_runs_the_same_step_in_process():
    cfg = make_config(layers=2)
    mesh = ParallelMesh.build(device_type="cpu")  # not distributed: pp = 1
    model = build_model(cfg.model, seed=SEED)
    stage = build_pipeline_stage(model, mesh, cfg)
    assert stage.chunks == [model] and stage.layer_ids == [[0, 1]]
    micro = make_micro_batches(3, cfg.model.vocab_size)
    result = run_pipeline_step(stage, micro, lambda lg, mb: cross_entropy_sum(lg, mb.labels), mesh, cfg,
                               loss_divisor=sum(mb.num_labels for mb in micro))
    ref_loss, ref_grads = reference(cfg, micro)
    assert float(result.loss_sum) == pytest.approx(ref_loss, rel=1e-6)
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-5, atol=1e-7)  # threads may differ


def test_wrong_activation_shape_fails_with_a_message():
    with pytest.raises(RuntimeError, match=r"expects \(32, 64\)"):
        _check_activation(torch.zeros(16, 64), (32, 64), torch.float32, stage=1)


# ---- NCCL on GPUs: the same contract where tags are ignored and P2P serialises on a stream ----


def _nccl_worker(rank, world, port, cases, doc_len, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        queue.put((rank, _pipeline_cases(rank, world, cases, doc_len)))
    except BaseException as err:  # report to the parent instead of hanging it
        queue.put((rank, repr(err)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


GPU_CASES = {
    "pp2_1f1b": (dict(layers=4, pp=2), 4),
    "pp2_interleaved_v2": (dict(layers=4, pp=2, schedule="interleaved", virtual=2), 6),
    "pp2_tied": (dict(layers=4, pp=2, tie=True), 4),
}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_pipeline_matches_single_gpu():
    """fp32 on CUDA; documents of equal length (16) because CUDA's packed-attention kernel
    takes only bf16/fp16. Reference: the plain model on GPU 0. rtol 1e-4 / atol 1e-6: cuBLAS
    may pick other algorithms for the stage shapes than for the whole model."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    cases = [(kw, m) for kw, m in GPU_CASES.values()]
    port = free_port()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 2, port, cases, 16, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    for rank, value in results.items():
        assert not isinstance(value, str), f"rank {rank} failed: {value}"
    for i, (name, (kwargs, num_micro)) in enumerate(GPU_CASES.items()):
        cfg = make_config(**kwargs)
        micro = make_micro_batches(num_micro, cfg.model.vocab_size, doc_len=16, device="cuda")
        ref_loss, ref_grads = reference(cfg, micro, device="cuda")
        for rank in range(2):
            got = results[rank][i]
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-5), name
            for pname, (grad, _) in got["grads"].items():
                grad = torch.from_numpy(grad)
                expected = _expected(ref_grads, pname, None, 0, 1)
                torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {pname}: {m}")
