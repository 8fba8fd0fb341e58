"""What a refit returns: small, serializable records (the flows return them as dicts)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class PublishResult:
    step: int
    kind: str
    base_step: int | None
    attempt: str
    policy_digest: str
    summary: dict
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class ReceiveResult:
    step: int
    from_step: int | None
    moves: list[str]
    bytes_pulled: int
    policy_digest: str
    timings: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)  # live modules: mode, pause and fetch seconds, probe counts


def as_dict(result: ReceiveResult) -> dict:
    """A receive result as one flat dict (a live module's details beside the common fields)."""
    d = asdict(result)
    d.update(d.pop("details"))
    return d
