"""How much work one request may ask of the data service, and the checks that enforce it.

A replica is shared by many jobs, so no request may pin a worker or its memory for long: the
layout (dp_size, seq_len, micro_batch_size, cp_size), the rows of one step, the tokens of one
step (a dynamic-CP step is materialised whole), max_batches and the windows a resume may scan
are all capped. The server states its caps in GetInfo and `tessera-data serve` sets them; a
request beyond one gets INVALID_ARGUMENT naming the field, its value and the cap.

The defaults fit the largest real jobs (see `RequestLimits`), so only hostile or mistaken
requests meet them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dataservice.plan import MAX_SEQ_LEN

__all__ = ["RequestLimits", "LimitError", "DEFAULT_LIMITS", "check_request"]

class LimitError(ValueError):
    """A request over one of the server's limits; the message names field, value and limit."""


@dataclass(frozen=True)
class RequestLimits:
    """The caps of one replica; each default with the job it leaves room for."""

    #: 64 Ki ranks: pure data parallelism (FSDP/ZeRO, tp=cp=pp=1) on the largest clusters.
    max_dp_size: int = 1 << 16
    #: 1 Mi tokens: the longest contexts trained today (long-context extension runs).
    max_seq_len: int = MAX_SEQ_LEN
    #: 4096 rows: far above any GPU's micro-batch at seq_len >= 2 (per-message bytes cap it anyway).
    max_micro_batch_size: int = 4096
    #: 64 Ki rows per global step (micro_batch_size x dp_size, or rows_per_step): above the largest
    #: published global batches (~16 Ki sequences); it also bounds the windows a stream's first
    #: step scans (rows / 256 per window).
    max_rows_per_step: int = 1 << 16
    #: 64 Mi tokens per step: DeepSeek-V3's 15,360 x 4,096 (63M) fits; a dynamic-CP step is held
    #: in memory whole at about 40 bytes a token, so this caps one step near 2.5 GiB.
    max_step_tokens: int = 1 << 26
    #: 256 CP ranks per data-parallel rank: 1 Mi-token contexts use 32-128.
    max_cp_size: int = 256
    #: 2**40 batches per request (0 stays unbounded): decades at 1000 batches/s; keeps row numbers in int64.
    max_batches: int = 1 << 40
    #: Windows a resume may scan to reach its row: a genuine token lands in its own window or the
    #: next few (a new layout moves it by at most one step); 4096 windows take seconds.
    max_scan_windows: int = 4096

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} is {value!r}; it must be an integer >= 1")
        if self.max_seq_len > MAX_SEQ_LEN or self.max_seq_len < 2:
            raise ValueError(f"max_seq_len is {self.max_seq_len}; it must be between 2 and {MAX_SEQ_LEN}")

    def as_dict(self) -> dict[str, int]:
        """The limits by name (GetInfo's `limits`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT_LIMITS = RequestLimits()


def _over(field: str, value: int, limit: int, name: str) -> LimitError:
    return LimitError(f"{field} is {value}, over this server's limit of {limit} ({name})")


def check_request(request, limits: RequestLimits) -> None:
    """Refuse a StreamRequest whose layout asks more than `limits` allow (LimitError)."""
    if request.seq_len < 2 or request.seq_len > limits.max_seq_len:
        raise LimitError(
            f"seq_len is {request.seq_len}; it must be between 2 and {limits.max_seq_len} (max_seq_len)"
        )
    if request.micro_batch_size < 1 or request.micro_batch_size > limits.max_micro_batch_size:
        raise LimitError(
            f"micro_batch_size is {request.micro_batch_size}; it must be between 1 and "
            f"{limits.max_micro_batch_size} (max_micro_batch_size)"
        )
    if request.dp_size > limits.max_dp_size:
        raise _over("dp_size", request.dp_size, limits.max_dp_size, "max_dp_size")
    cp_size = request.cp_size or 1
    if cp_size > limits.max_cp_size:
        raise _over("cp_size", cp_size, limits.max_cp_size, "max_cp_size")
    rows = request.micro_batch_size * request.dp_size
    if rows > limits.max_rows_per_step:
        raise _over(f"micro_batch_size x dp_size = {request.micro_batch_size} x {request.dp_size}", rows,
                    limits.max_rows_per_step, "max_rows_per_step")
    if request.rows_per_step > limits.max_rows_per_step:
        raise _over("rows_per_step", request.rows_per_step, limits.max_rows_per_step, "max_rows_per_step")
    if request.dynamic_cp:
        tokens = request.rows_per_step * request.seq_len
        if tokens > limits.max_step_tokens:
            raise _over(f"rows_per_step x seq_len = {request.rows_per_step} x {request.seq_len}", tokens,
                        limits.max_step_tokens, "max_step_tokens")
    if request.max_batches > limits.max_batches:
        raise _over("max_batches", request.max_batches, limits.max_batches, "max_batches")

