"""How DCR's flow runs are named and tagged, and the decorator that gives a flow both.

Runs are named after what they do (``publish-step-12``, ``receive-rollout-0-to-12``: renamed to the
step it reached, ``gc-keep-5``) and tagged when they are created (``dcr``, the kind of run,
``root:<ROOT>``, ``step:<N>``, ``receiver:<id>``, ``mirror:<DST>``, ``fleet:<NAME>``).
"""

from __future__ import annotations

import inspect
import re

from prefect import Flow, tags
from prefect.runtime import flow_run

from flows.options import GcOptions


def slug(text: str) -> str:
    """``text`` as a Prefect key or run name may hold it (lower case, letters, digits and dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", str(text).lower()).strip("-")[:60] or "x"


class TaggedFlow(Flow):
    """A flow whose runs are created with DCR's tags, computed from the call's arguments.

    Prefect takes a run's tags where the run is created: from ``with prefect.tags(...)`` around a call,
    or from the deployment (``infra/prefect.yaml`` gives each deployment its kind and root). Calling one
    of these flows enters that context itself, so a run is tagged without a call to update it. The flow
    body enters it again for its task runs (a deployment's run does not go through ``__call__``).
    ``with_options`` returns a plain ``Flow``: its runs have the caller's tags only.
    """

    def __init__(self, fn, tags_of, **kwargs):
        super().__init__(fn, **kwargs)
        self.tags_of = tags_of

    def __call__(self, *args, return_state: bool = False, wait_for=None, **kwargs):
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        with tags(*self.tags_of(**bound.arguments)):
            return super().__call__(*args, return_state=return_state, wait_for=wait_for, **kwargs)


def dcr_flow(name: str, run_name, tags_of):
    """``@flow`` for DCR's flows: named runs, tagged at creation (``TaggedFlow``), nothing persisted."""
    def decorate(fn):
        return TaggedFlow(fn, tags_of, name=name, flow_run_name=run_name, log_prints=True, persist_result=False)
    return decorate


def publish_tags(root, step, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-publish", f"root:{root}", f"step:{step}")


def receive_tags(root, receiver_id, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-receive", f"root:{root}", f"receiver:{receiver_id}")


def materialize_tags(root, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-materialize", f"root:{root}")


def verify_tags(root, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-verify", f"root:{root}")


def mirror_tags(src, dst, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-mirror", f"root:{src}", f"mirror:{dst}")


def fleet_tags(root, name, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-fleet", f"root:{root}", f"fleet:{name}")


def gc_tags(root, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-gc", f"root:{root}")


def publish_name() -> str:
    return f"publish-step-{flow_run.parameters['step']}"


def receive_name() -> str:
    p = flow_run.parameters
    return f"receive-{p['receiver_id']}-to-{'latest' if p.get('step') is None else p['step']}"


def mirror_name() -> str:
    p = flow_run.parameters
    return f"mirror-{'all' if p.get('step') is None else 'step-' + str(p['step'])}"


def fleet_name() -> str:
    p = flow_run.parameters
    return f"fleet-{p.get('name') or 'default'}-to-{'latest' if p.get('step') is None else p['step']}"


def materialize_name() -> str:
    step = flow_run.parameters.get("step")
    return f"materialize-{'latest' if step is None else 'step-' + str(step)}"


def verify_name() -> str:
    step = flow_run.parameters.get("step")
    return f"verify-{'all' if step is None else 'step-' + str(step)}"


def gc_name() -> str:
    options = flow_run.parameters["options"]
    keep = options.keep_last if isinstance(options, GcOptions) else options.get("keep_last")
    return f"gc-keep-{keep}"
