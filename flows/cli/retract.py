"""``dcr retract ROOT --step N [--reason TEXT]``: take back step N and every step built on it."""

from __future__ import annotations

from dataclasses import asdict

from flows.cli.common import add_common, say, step_arg, storage_options
from flows.maintenance.retract import run_retract


def add_arguments(name: str, p) -> None:
    add_common(p)
    p.add_argument("--step", type=step_arg, required=True, metavar="N",
                   help="the step to take back: N and every step built on it (its chain of bases leads to N) are retracted")
    p.add_argument("--reason", default="", metavar="TEXT", help="why (kept in each retraction record)")


def run(name: str, args) -> int:
    res = run_retract(args.root, args.step, args.reason, storage_options(args))
    steps = ", ".join(map(str, sorted(res.retracted))) or "none"
    already = f" (already retracted: {', '.join(map(str, sorted(res.already)))})" if res.already else ""
    latest = "no step is live" if res.latest is None else f"the newest live step is {res.latest}"
    say(args, f"retracted steps {steps}{already}; {latest}", asdict(res))
    return 0
