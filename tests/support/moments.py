"""One AdamW step with bf16 moments against a float64 reference (tests/test_optimizer_moments.py).

`one_step(path)` trains the toy GPT of `tests.support.toy` two steps with bf16 moments (so both
moments hold real values), then captures the third step's inputs (fp32 masters, the reduced
gradients, the deferred clip factor, both moments widened from bf16, the learning rate) and runs
the step on `path`: "foreach" (torch's foreach ops), "fused" (torch's fused kernel), "host"
(optimizer offload's CPU step), "triton" and "triton-split" (the one-pass kernel, fp32 and split
masters; Triton's interpreter on CPU: TRITON_INTERPRET=1 before Triton is imported). The
reference applies torch's AdamW arithmetic in float64 to those inputs and rounds the moments to
bf16 once. `compare` returns the distances: masters (fp32) relative to the reference, and the
moments in bf16 units in the last place.
"""

from __future__ import annotations

import math

import torch

from core.mesh import ParallelMesh
from tests.support.toy import make_trainer, train_steps

PATHS = ("foreach", "fused", "host", "triton", "triton-split")


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (as int16) mapped to integers in the order of their values (+0 = -0)."""
    i = bits.view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between bf16 tensors `a` and `b`, element by element."""
    return (_ordered(a) - _ordered(b)).abs()


def one_step(path: str) -> dict:
    """The inputs, the result and the float64 reference of one step on `path` (numpy-free dicts
    of tensors, picklable)."""
    split = path == "triton-split"
    model, dp, opt, sched = make_trainer(ParallelMesh.build(), moments_dtype=torch.bfloat16, offload=path == "host",
                                         param_dtype=torch.bfloat16 if split else torch.float32, split=split)
    opt.fused = path != "foreach"
    train_steps(model, dp, opt, sched, ParallelMesh.build(), 2, clip=0.5, defer_clip=True)
    inputs = {}
    real_step = opt.step

    def capturing_step():
        dp.finish_grad_sync()
        clip = dp.pending_grad_scale
        inputs.update(masters=[s.master.double() for s in dp.slots], lr=opt.lr, step=opt.step_count + 1,
                      grads=[g.double() * (1.0 if clip is None else float(clip)) for g in dp.local_grads()],
                      exp_avg=[m.double() for m in opt.exp_avg], exp_avg_sq=[v.double() for v in opt.exp_avg_sq],
                      clipped=clip is not None and float(clip) < 1)
        real_step()

    opt.step = capturing_step
    train_steps(model, dp, opt, sched, ParallelMesh.build(), 1, clip=0.5, start=2, defer_clip=True)
    got = dict(masters=[s.master.clone() for s in dp.slots], exp_avg=[m.clone() for m in opt.exp_avg],
               exp_avg_sq=[v.clone() for v in opt.exp_avg_sq])
    ran_triton = opt._tables._key is not None
    decays = [opt.weight_decay if d else 0.0 for d in opt._decayed]
    dp.remove()
    return dict(got=got, want=_reference(inputs, decays, opt.betas, opt.eps), ran_triton=ran_triton,
                clipped=inputs["clipped"], dtypes={str(t.dtype) for t in got["exp_avg"] + got["exp_avg_sq"]})


def _reference(inputs: dict, decays: list[float], betas: tuple[float, float], eps: float) -> dict:
    """torch's AdamW (decoupled decay, bias correction) in float64; moments rounded to bf16 once."""
    beta1, beta2 = betas
    lr, step = inputs["lr"], inputs["step"]
    bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
    out = dict(masters=[], exp_avg=[], exp_avg_sq=[])
    for p, g, m, v, wd in zip(inputs["masters"], inputs["grads"], inputs["exp_avg"], inputs["exp_avg_sq"], decays):
        p = p * (1 - lr * wd)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / bias1 * m / (v.sqrt() / bias2_sqrt + eps)
        out["masters"].append(p)
        out["exp_avg"].append(m.to(torch.bfloat16))
        out["exp_avg_sq"].append(v.to(torch.bfloat16))
    return out


def compare(result: dict) -> dict:
    """Worst distances of one step's result from the reference: `master_rel` (fp32 masters,
    |got - want| / max(|want|, 1e-3)), `moment_ulps` (bf16 units in the last place), and the
    share of moment elements equal to the reference's bit for bit."""
    got, want = result["got"], result["want"]
    master = max(float(((a.double() - b).abs() / b.abs().clamp(min=1e-3)).max()) for a, b in
                 zip(got["masters"], want["masters"]) if a.numel())
    moments = [(a, b) for kind in ("exp_avg", "exp_avg_sq") for a, b in zip(got[kind], want[kind]) if a.numel()]
    worst = max(int(ulps(a, b).max()) for a, b in moments)
    equal = sum(int((ulps(a, b) == 0).sum()) for a, b in moments) / sum(a.numel() for a, _ in moments)
    return dict(master_rel=master, moment_ulps=worst, moment_exact=equal)


if __name__ == "__main__":  # run under TRITON_INTERPRET=1 by the test: the Triton paths
    for name in ("triton", "triton-split"):
        r = one_step(name)
        assert r["ran_triton"], name
        print(name, r["dtypes"], compare(r))
