"""``dcr fleet ROOT --engine URL [--engine URL ...] [--step N] [--name NAME] [--wait S] [--timeout S]``:
switch a fleet of vLLM servers (and state files) to one step, all or nothing, one coordinator per
fleet at a time (``flows.receive.fleet``)."""

from __future__ import annotations

from dataclasses import asdict

from flows.cli.common import add_common, say, step_arg, storage_options, use_prefect
from flows.cli.values import SECONDS, WAIT
from flows.maintenance.audit import human_bytes
from flows.receive.fleet import FleetResult, FleetSwitchError, run_fleet
from flows.receive.fleet_members import HTTP_TIMEOUT


def add_arguments(name: str, p) -> None:
    add_common(p, orchestrated=True)
    p.add_argument("--engine", action="append", default=[], required=True, metavar="URL|ID=URL",
                   help="a member (repeatable): http://HOST:PORT, an OpenAI-compatible vLLM server started with "
                   "--weight-transfer-config '{\"backend\": \"dcr\"}' and VLLM_SERVER_DEV_MODE=1 (it reads ROOT "
                   "with the credentials of its own environment: a credential in --storage-option is refused); or "
                   "state:PATH, a DCR state file this command refits; ID=URL names its receiver id (default "
                   "NAME-HOST-PORT, NAME-state-FILENAME)")
    p.add_argument("--step", type=step_arg, default=None, metavar="N",
                   help="the step every member serves afterwards (default: the newest live step; lower moves the fleet back)")
    p.add_argument("--name", default="default", metavar="NAME", help="the fleet (its record: fleets/NAME.json; default: default)")
    p.add_argument("--wait", type=WAIT, default=0.0, metavar="S",
                   help="seconds to wait for another coordinator of the fleet (its lease, fleets/NAME/lease/) to "
                   "finish; default 0: refuse at once, naming it and when its lease ends")
    p.add_argument("--timeout", type=SECONDS, default=HTTP_TIMEOUT, metavar="S",
                   help="seconds any other wait may take: a member's answer, or the state files' locks held by "
                   f"another receive or fleet switch (default {HTTP_TIMEOUT:.0f})")


def format_result(r: FleetResult) -> str:
    version = r.version if r.version is not None else "mixed" if r.outcome == "mixed" else "unknown"
    lines = [f"fleet {r.fleet}: {r.outcome}; version {version} "
             f"(target {r.target}, previous {r.previous if r.previous is not None else 'none'}) in {r.seconds:.1f} s"]
    for m in r.members:
        step = m["step"] if m["step"] is not None else "unknown"
        err = f": {m['error']}" if m.get("error") else ""
        pulled = "" if m.get("bytes_pulled") is None else f", pulled {human_bytes(m['bytes_pulled'])}"
        lines.append(f"  {m['url']} ({m['receiver']}): step {step}, {m['outcome']}, pause {m['pause_seconds']:.3f} s"
                     f"{pulled}{err}")
    return "\n".join(lines)


def run(name: str, args) -> int:
    so = storage_options(args)
    try:
        if use_prefect(args):
            from flows.cli.orchestrated import run_flow  # noqa: PLC0415 - Prefect only when asked for

            r = FleetResult(**run_flow(args, "fleet_refit", args.root, args.engine, args.step, args.name, so, args.timeout,
                                       args.wait))
        else:
            r = run_fleet(args.root, args.engine, args.step, args.name, so, timeout=args.timeout, wait=args.wait)
    except FleetSwitchError as e:
        if getattr(e, "result", None) is not None:  # where every member is, then the one-line error
            say(args, format_result(e.result), asdict(e.result))
        raise
    say(args, format_result(r), asdict(r))
    return 0
