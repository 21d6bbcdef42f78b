"""train.cuda_graphs: the compiled blocks' regions replayed as CUDA graphs.

Anywhere: the setting without train.compile, or with a pipeline, is refused in one line. On a GPU: the trainer's
steps with graphs give the losses of the same compiled steps without them (same kernels, so the
same numbers up to bf16 reduction order), and the step really launches graphs; a CLI run with
held-out passes, a stop and a resume gives the losses of the same run without graphs.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bench.train_step import StepInputs, model_config
from core.config import Config, ConfigError
from core.validation import validate
from core.layers import AttentionMeta
from core.train.trainer import Trainer
from tests.support.runs import run_train


def _config(**train) -> Config:
    config = Config(model=model_config(2, False, dim=256))
    t = config.train
    t.seed, t.seq_len, t.micro_batch_size, t.global_batch_size = 0, 512, 2, 4
    t.warmup_steps, t.lr = 0, 3e-3
    for key, value in train.items():
        setattr(t, key, value)
    return config


def test_cuda_graphs_without_compile_or_with_a_pipeline_is_refused():
    with pytest.raises(ConfigError, match=r"train.cuda_graphs=true .* needs train.compile=true"):
        validate(_config(cuda_graphs=True, compile=False), 1)
    config = _config(cuda_graphs=True, compile=True)
    config.parallel.pp = 2
    with pytest.raises(ConfigError, match=r"runs at parallel.pp=1 only \(now 2\)"):
        validate(config, 2)


def _chain_batch(rows: int, seq: int, vocab: int, device) -> StepInputs:
    """Rows of a fixed successor chain (token -> 5 * token + 3 mod vocab) from random starts: a
    stream the model learns within a few steps."""
    tokens = torch.empty(rows, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (rows,))
    for i in range(seq):
        tokens[:, i + 1] = (5 * tokens[:, i] + 3) % vocab
    tokens = tokens.to(device)
    cu = torch.arange(0, rows * seq + 1, seq, dtype=torch.int32, device=device)
    return StepInputs(tokens[:, :-1].flatten(), tokens[:, 1:].flatten(), torch.arange(seq, device=device).repeat(rows),
                      AttentionMeta(cu_seqlens=cu, max_seqlen=seq), num_tokens=float(rows * seq),
                      num_labels=float(rows * seq))


def _losses(batches: list[StepInputs], precision: str, cuda_graphs: bool) -> tuple[list[float], int]:
    """Six steps of two micro-batches each; then the graph launches in one more step."""
    torch._dynamo.reset()
    trainer = Trainer(_config(device="cuda", compile=True, precision=precision, cuda_graphs=cuda_graphs,
                              fp8_recipe="tensorwise" if precision == "fp8" else "blockwise"))
    losses = []
    for i in range(6):
        result = trainer.step(batches[2 * i:2 * i + 2])
        losses.append(float(result.loss_sum) / result.global_labels)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(batches[:2])
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")
    return losses, launches


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_graphs_replay_the_compiled_steps(precision):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if precision == "fp8":
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    batches = [_chain_batch(2, 512, 512, torch.device("cuda")) for _ in range(12)]
    want, plain_launches = _losses(batches, precision, cuda_graphs=False)
    got, launches = _losses(batches, precision, cuda_graphs=True)
    print(precision, "plain", want, "graphs", got, "launches", launches)
    assert plain_launches == 0 and launches >= 2 * 2 * 2  # per micro-batch at least each block's forward and backward
    assert want[-1] < want[0] - 0.1  # it learns, so the comparison covers real updates
    assert got == pytest.approx(want, rel=2e-3)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_run_with_graphs_evaluates_checkpoints_and_resumes_like_one_without(tmp_path, dataset):
    """The whole CLI run: held-out passes (no-grad replays) between steps, a stop at step 20 and a
    resume in a new process, against the same compiled run without graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run = ["train.device=cuda", "train.compile=true", "train.seq_len=256", "train.max_steps=30", "train.lr=3e-3",
           "eval.interval=10", "eval.steps=2", f"eval.dataset={dataset}"]
    run_train(tmp_path / "plain", dataset, 1, *run)
    run_train(tmp_path / "graphs", dataset, 1, *run, "train.cuda_graphs=true", "train.stop_at_step=20")
    run_train(tmp_path / "graphs", dataset, 1, *run, "train.cuda_graphs=true", resume=True)
    want, got = _records(tmp_path / "plain"), _records(tmp_path / "graphs")
    print({step: (want[step]["loss"], got[step].get("loss")) for step in want})
    assert sorted(got) == list(range(1, 31)) and want[30]["loss"] < want[1]["loss"] - 0.5
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=5e-3), step
    for step in (10, 20, 30):
        assert got[step]["val_loss"] == pytest.approx(want[step]["val_loss"], rel=5e-3), step


def _records(run_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "step" in r}
