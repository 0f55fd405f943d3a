"""The collective votes' helpers: every rank's value or error gathered on every rank, so all end alike.

Below the profiler (it votes with them) and the failure channel: imports nothing of autoprofile.
"""
from __future__ import annotations

import torch.distributed as dist


def gather(value, group) -> list:
    """Every rank's value in rank order (this rank's alone without a group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def gather_errors(err: str | None, group) -> list[str]:
    """Every rank's error (None dropped), identical on all ranks."""
    out = gather(err, group)
    if len(out) == 1:
        return [err] if err else []
    errors = [(r, e) for r, e in enumerate(out) if e]
    causes = [(r, e) for r, e in errors if not is_consequence(e)]
    return [f"rank {r}: {e}" for r, e in (causes or errors)]  # a peer's PeerFailed only repeats the cause


def is_consequence(err: str) -> bool:
    """A rank's error text that only reports another rank's failure (channel.PeerFailed, a peer's closed
    connection)."""
    return (err.startswith("PeerFailed:") or "Connection closed by peer" in err
            or "Connection reset by peer" in err)


def describe(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its text."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
