"""``dcr simulate``: the timeline of a refit at any scale, from a scenario file.

    dcr simulate SCENARIO.toml [...] [--out DIR] [--json]
                                                     predict: table (or JSON), DIR/simulation.json, .png
    dcr simulate --calibrate [--out FILE]            this machine's per-byte CPU costs (about 10 s)
    dcr simulate --validate RECORDS.json [--out DIR] predictions against measured refits (exit 1 if any
                                                     is off by more than 25%)
    dcr simulate --measure-direct [--out DIR]        measure real refits here and validate against them

Modes: ``full`` (transport only: upload the full checkpoint, every receiver downloads it), ``direct``
(DCR; every receiver reads the origin store), ``tree`` (DCR; one mirror per region copies from the
origin, receivers read their region's mirror); each DCR mode sequential (publish, then download, then
apply) and streaming (receivers and mirrors fetch objects while the publisher is still uploading, and
apply after the commit). The model and its equations: ``dcr_bench.sim.model`` and ``docs/simulate.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dcr_bench.sim import calibrate as cal
from dcr_bench.sim import measure, output
from dcr_bench.sim import validate as val
from dcr_bench.sim.model import simulate
from dcr_bench.sim.scenario import DEFAULT_CALIBRATION, ScenarioError, load
from flows.cli import Parser
from flows.cli.values import Number

DEFAULT_OUT = "sim-results"
BANDWIDTH = Number(float, 0, lo_open=True, unit="bytes/s")


def _bandwidths(text: str) -> list[float]:
    return [BANDWIDTH(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dcr simulate",
        description="Predict the timeline of a refit (full checkpoint, DCR direct, DCR through a relay tree; "
        "sequential and streaming) from a scenario file; calibrate its CPU costs on this machine; validate it "
        "against measured refits.",
    )
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="scenario TOML files (see bench/scenarios/)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--calibrate", action="store_true", help="measure this machine's per-byte CPU costs")
    what.add_argument("--validate", metavar="RECORDS", help="JSON list of measured refits to compare with the model")
    what.add_argument("--measure-direct", action="store_true",
                      help="run real DCR direct and full-checkpoint refits through the capped S3 test link, then validate")
    p.add_argument("--out", help=f"output directory (default {DEFAULT_OUT}/); with --calibrate the JSON file "
                   f"(default {os.path.relpath(DEFAULT_CALIBRATION)})")
    p.add_argument("--json", action="store_true",
                   help="print the predictions (a list of simulation.json documents) as JSON instead of the tables")
    p.add_argument("--params", type=Number(float, 1), default=100e6, help="--measure-direct: model parameters (default 1e8)")
    p.add_argument("--bandwidth", type=_bandwidths, default="10e6,50e6", help="--measure-direct: link caps in bytes/s (default 10e6,50e6)")
    return p


def _predict(paths: list[str], out: str, as_json: bool = False) -> int:
    docs = []
    for path in paths:
        sc = load(path)
        timelines = simulate(sc)
        target = out if len(paths) == 1 else os.path.join(out, sc.name)
        written = output.write(sc, path, timelines, target)
        if as_json:
            docs.append(output.document(sc, path, timelines))
            continue
        print(output.table(sc, timelines))
        print(f"  wrote {', '.join(written)}\n")
    if as_json:
        print(json.dumps(docs, indent=1, default=str), flush=True)
    return 0


def _validate(records_path: str, out: str) -> int:
    records = val.load_records(records_path)
    rows = val.compare(records, records_path, os.path.dirname(os.path.abspath(records_path)))
    return _report(rows, out, records_path)


def _report(rows: list[dict], out: str, source: str) -> int:
    print(val.table(rows))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "validation.json")
    with open(path, "w") as f:
        json.dump({"records": source, "tolerance": val.TOLERANCE, "comparison": rows}, f, indent=2)
        f.write("\n")
    bad = [r["name"] for r in rows if not r["within"]]
    print(f"wrote {path}; {len(rows) - len(bad)} of {len(rows)} within {val.TOLERANCE:.0%}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if a.calibrate:
            path = a.out or DEFAULT_CALIBRATION
            cal.write(cal.calibrate(), path)
            print(f"wrote {path}")
            return 0
        if a.validate:
            return _validate(a.validate, a.out or DEFAULT_OUT)
        if a.measure_direct:
            out = a.out or DEFAULT_OUT
            records = measure.measure_direct(out, params=int(a.params), bandwidths=a.bandwidth)
            rows = val.compare([val.Record.model_validate(r) for r in records], "measured")
            return _report(rows, out, os.path.join(out, "records.json"))
        if not a.scenarios:
            build_parser().error("give a SCENARIO, or --calibrate, --validate or --measure-direct")
        return _predict(a.scenarios, a.out or DEFAULT_OUT, a.json)
    except ScenarioError as e:
        print(f"dcr simulate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
