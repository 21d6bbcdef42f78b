"""Resume tokens of the data service: where a stream stands, signed so that any replica trusts it.

A token names a position in the global row order of one plan (datasets, blend, seed,
seq_len), not a position in one rank's stream: `row` is the first global row not yet
served, so a trainer may resume with another dp_size or micro_batch_size as long as
`row` falls on a step boundary of the new layout. The plan's `Anchor` rides along so
that resuming costs O(1) instead of a rescan from the start of the epoch.

Wire form: ``base64url(compact JSON) "." base64url(HMAC-SHA256(secret, JSON))``. The
token is stateless: every replica that holds the same shards and the same secret
serves the same stream from it. The default secret is a project-wide constant, so
replicas started without `--token-secret` accept each other's tokens; being public, it is
for loopback only: `tessera-data serve` off loopback requires a secret of its own, the same
on every replica (docs/security.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

#: Shared by every replica that is not given `--token-secret`, so that all accept each other.
DEFAULT_TOKEN_SECRET = "tessera.dataservice.v1/resume-token"
TOKEN_VERSION = 1
CORRUPT_MESSAGE = "resume token is corrupt or was not issued by a Tessera data service"
_WEIGHT_TOLERANCE = 1e-9


class TokenError(ValueError):
    """A token that cannot be trusted or does not fit the request; the message says why."""


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _key(secret: str | bytes) -> bytes:
    return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)


def datasets_fingerprint(fingerprints: Sequence[tuple[str, str]]) -> str:
    """Identity of a set of datasets' contents: (name, manifest fingerprint) pairs, order-free."""
    text = "\n".join(f"{name}={fp}" for name, fp in sorted(fingerprints))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def describe_blend(blend: Sequence[tuple[str, float]]) -> str:
    """A blend as people read it: ``{web: 0.75, code: 0.25}``."""
    return "{" + ", ".join(f"{name}: {weight:.6g}" for name, weight in blend) + "}"


@dataclass(frozen=True)
class ResumeToken:
    """Where a stream stands: the plan it belongs to, the next global row and the plan's anchor.

    `blend` holds (dataset name, normalised weight) pairs, `datasets` the contents'
    fingerprint; both, with seed and seq_len, are there only so that a mismatch can be
    named in the error. `plan` (the StreamPlan's fingerprint) is the authority.
    """

    plan: str
    datasets: str
    blend: tuple[tuple[str, float], ...]
    seed: int
    seq_len: int
    row: int
    anchor: dict[str, Any]

    def encode(self, secret: str | bytes = DEFAULT_TOKEN_SECRET) -> str:
        """Serialise and sign."""
        payload = {
            "v": TOKEN_VERSION,
            "p": self.plan,
            "d": self.datasets,
            "b": [[name, weight] for name, weight in self.blend],
            "s": self.seed,
            "L": self.seq_len,
            "r": self.row,
            "a": self.anchor,
        }
        body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("utf-8")
        tag = hmac.new(_key(secret), body, hashlib.sha256).digest()
        return f"{_b64encode(body)}.{_b64encode(tag)}"

    @classmethod
    def decode(cls, token: str, secret: str | bytes = DEFAULT_TOKEN_SECRET) -> "ResumeToken":
        """Verify the signature and parse; TokenError(CORRUPT_MESSAGE) on anything untrusted."""
        try:
            body_text, tag_text = token.split(".")
            body, tag = _b64decode(body_text), _b64decode(tag_text)
        except (ValueError, binascii.Error):
            raise TokenError(CORRUPT_MESSAGE) from None
        expected = hmac.new(_key(secret), body, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, expected):
            raise TokenError(CORRUPT_MESSAGE)
        try:
            payload = json.loads(body)
            if payload["v"] != TOKEN_VERSION:
                raise TokenError(
                    f"resume token has format version {payload['v']!r}; this server reads "
                    f"version {TOKEN_VERSION}"
                )
            parsed = cls(
                plan=str(payload["p"]),
                datasets=str(payload["d"]),
                blend=tuple((str(name), float(weight)) for name, weight in payload["b"]),
                seed=int(payload["s"]),
                seq_len=int(payload["L"]),
                row=int(payload["r"]),
                anchor=dict(payload["a"]),
            )
        except TokenError:
            raise
        except (ValueError, KeyError, TypeError):
            # Signed by a Tessera secret but not in a shape we know: treat as untrusted.
            raise TokenError(CORRUPT_MESSAGE) from None
        if parsed.row < 0:
            raise TokenError(CORRUPT_MESSAGE)
        return parsed

    def mismatch(
        self,
        *,
        plan: str,
        datasets: str,
        blend: Sequence[tuple[str, float]],
        seed: int,
        seq_len: int,
    ) -> str | None:
        """None if this token belongs to the given plan, else a sentence naming the difference."""
        if self.plan == plan:
            return None
        if self.seq_len != seq_len:
            return f"resume token was issued for seq_len {self.seq_len}, but this request asks for seq_len {seq_len}"
        if self.seed != seed:
            return f"resume token was issued for seed {self.seed}, but this request asks for seed {seed}"
        mine, theirs = dict(self.blend), dict(blend)
        if mine.keys() != theirs.keys() or any(
            not math.isclose(mine[k], theirs[k], rel_tol=0, abs_tol=_WEIGHT_TOLERANCE) for k in mine
        ):
            return (
                f"resume token was issued for blend {describe_blend(self.blend)}, but this request "
                f"resolves to blend {describe_blend(blend)}"
            )
        if self.datasets != datasets:
            return (
                f"resume token was issued for datasets with fingerprint {self.datasets}, but this "
                f"server's datasets have fingerprint {datasets} (same names, different contents)"
            )
        return (
            f"resume token was issued by a plan with fingerprint {self.plan}, but this server's plan "
            f"for the request has fingerprint {plan} (a different planner version or window setting)"
        )
