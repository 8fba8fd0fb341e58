"""What a refit returns: small, serializable records (the flows return them as dicts)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class _Record:
    """Read like the flows' dicts too: ``result["step"]``, ``result.get("summary")``, ``dict(result)``."""

    def __getitem__(self, key: str):
        return asdict(self)[key]

    def get(self, key: str, default=None):
        return asdict(self).get(key, default)

    def keys(self):
        return asdict(self).keys()

    def __contains__(self, key: object) -> bool:
        return key in asdict(self)

    def __iter__(self):
        return iter(asdict(self))


@dataclass
class PublishResult(_Record):
    step: int
    kind: str
    base_step: int | None
    attempt: str
    policy_digest: str
    summary: dict
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class ReceiveResult(_Record):
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
