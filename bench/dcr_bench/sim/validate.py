"""``dcr simulate --validate RECORDS.json``: the model's predictions against measured refits.

A record: ``{"name": str, "scenario": {...the fields of a scenario file...}, "mode": "full" | "direct" |
"tree", "streaming": bool, "measured_s": float, "bytes_per_link": {"uplink": ..., ...} (optional),
"details": {...} (optional, free-form)}``. A prediction is *within* when it is within ``TOLERANCE``
(25%) of the measured time, either way.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr_bench.sim.model import Model
from dcr_bench.sim.scenario import ScenarioError, parse

TOLERANCE = 0.25


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    scenario: dict
    mode: Literal["full", "direct", "tree"]
    streaming: bool
    measured_s: float = Field(gt=0)
    bytes_per_link: dict[str, float] | None = None
    details: dict | None = None


def load_records(path: str) -> list[Record]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ScenarioError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, list):
        raise ScenarioError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    out = []
    for i, item in enumerate(data):
        try:
            out.append(Record.model_validate(item))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or "record"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            raise ScenarioError(f"{path}: record {i}: {where}: {msg}") from None
    return out


def compare(records: list[Record], source: str = "records", base_dir: str | None = None) -> list[dict]:
    rows = []
    for i, r in enumerate(records):
        sc = parse(r.scenario, f"{source}: record {i} ({r.name}): scenario", base_dir)
        if r.streaming and r.mode == "full":
            raise ScenarioError(f"{source}: record {i} ({r.name}): the full checkpoint has no streaming variant")
        t = Model(sc).run(r.mode, r.streaming)
        ratio = t.total_s / r.measured_s
        row = {"name": r.name, "mode": r.mode, "streaming": r.streaming, "predicted_s": t.total_s,
               "measured_s": r.measured_s, "ratio": ratio, "within": abs(ratio - 1) <= TOLERANCE,
               "segments": [s.__dict__ for s in t.segments]}
        if r.bytes_per_link:
            row["bytes_per_link"] = {k: {"predicted": t.bytes_per_link.get(k), "measured": v,
                                         "ratio": t.bytes_per_link[k] / v if v and k in t.bytes_per_link else None}
                                     for k, v in r.bytes_per_link.items()}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'record':<40} {'mode':<7} {'stream':<6} {'predicted s':>11} {'measured s':>11} {'ratio':>6}  within 25%"]
    for r in rows:
        lines.append(f"{r['name']:<40} {r['mode']:<7} {'yes' if r['streaming'] else 'no':<6} {r['predicted_s']:>11.2f} "
                     f"{r['measured_s']:>11.2f} {r['ratio']:>6.2f}  {'yes' if r['within'] else 'NO'}")
        for k, b in (r.get("bytes_per_link") or {}).items():
            if b["ratio"] is not None:
                lines.append(f"{'':<4}bytes on {k}: predicted {b['predicted'] / 1e6:.1f} MB, measured "
                             f"{b['measured'] / 1e6:.1f} MB (ratio {b['ratio']:.2f})")
    return "\n".join(lines)
