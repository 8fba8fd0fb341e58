"""Running a flow for a ``dcr`` command under Prefect, with the command's own output contract.

The CLI runs in-process unless asked (``--orchestrator prefect`` or ``DCR_ORCHESTRATOR=prefect``):
a ``PREFECT_API_URL`` set for workers and the UI does not change what a ``dcr`` call prints, how it
fails or how long it takes. When asked, the flow runs against the configured API, its logs and
tracebacks go to the API (the UI shows them), and the terminal gets what the command always
prints: its result line (nothing under ``-q``), one ``dcr: prefect: ...`` line naming the run, and
on failure the one-line ``dcr: error: ...`` with the error's exit code.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from prefect.client.orchestration import get_client
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker, PrefectConsoleHandler
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    PREFECT_UI_URL,
    temporary_settings,
)

from flows import prefect_flows

STARTUP_S = 120  # how long a --workers command waits for the local API server it starts


class _NotPrefect(logging.Filter):
    """Drops Prefect's records (flow and task run lines, tracebacks) from the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("prefect")


def mute_prefect_console() -> None:
    """Keep Prefect's records off the terminal; they still reach the API (Prefect's ``api`` handler)."""
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, _NotPrefect) for f in handler.filters):
                handler.addFilter(_NotPrefect())


@contextlib.contextmanager
def _api_for_workers(workers) -> Iterator[bool]:
    """With workers and no ``PREFECT_API_URL``: one local API server for the flow and its Dask
    workers (they take the flow's settings; without a URL each worker process would start a
    temporary server of its own); yields whether it started one. Else nothing changes."""
    if workers is None or PREFECT_API_URL.value():
        yield False
        return
    from prefect.server.api.server import SubprocessASGIServer  # noqa: PLC0415 - 1.3 s to import: only here

    server = SubprocessASGIServer()
    # Prefect waits 20 s for it by default; a new server's database migrations take longer than that
    # on a loaded 2-core machine (seen: "Timed out while attempting to connect to ephemeral Prefect
    # API server"), so a --workers command waits up to STARTUP_S unless the setting asks for more.
    wait = max(STARTUP_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    with temporary_settings({PREFECT_SERVER_ANALYTICS_ENABLED: False}):  # no telemetry from a throwaway server
        server.start(timeout=wait)
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            try:
                yield True
            finally:  # what the run logged and emitted goes out while its server is up: at exit, Prefect would
                # retry sending it to the stopped server for over a minute
                APILogWorker.drain_all(timeout=10)
                EventsWorker.drain_all(timeout=10)
    finally:
        server.stop()


def run_flow(args, name: str, *params, **kw):
    """The flow ``flows.prefect_flows.<name>`` run with ``params`` as a Prefect flow run: its result,
    or its exception re-raised."""
    mute_prefect_console()
    if kw.get("workers") is not None:  # the scheduler of a LocalCluster runs here: its INFO lines are not ours
        import distributed  # noqa: F401, PLC0415 - only with workers; importing it sets its loggers' levels

        logging.getLogger("distributed").setLevel(logging.WARNING)
    with _api_for_workers(kw.get("workers")) as temporary:
        return _run_flow(args, name, params, kw, temporary)


def _run_flow(args, name: str, params: tuple, kw: dict, temporary: bool = False):
    state = getattr(prefect_flows, name)(*params, **kw, return_state=True)
    run_id = state.state_details.flow_run_id
    if not args.quiet:
        ui = PREFECT_UI_URL.value()
        where = f"{ui.rstrip('/')}/runs/flow-run/{run_id}" if ui else str(run_id)
        if temporary:  # its server stops with this command: no page to link to
            where = f"{run_id} (on a temporary local API: set PREFECT_API_URL to keep the runs)"
        try:
            with get_client(sync_client=True) as client:
                name = client.read_flow_run(run_id).name
        except Exception:  # noqa: BLE001 - the run is over; its name is only for this line
            name = str(run_id)
        print(f"dcr: prefect: flow run {name!r} {state.name.lower()}: {where}", file=sys.stderr, flush=True)
    return state.result()
