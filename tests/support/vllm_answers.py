"""What a vLLM server with DCR's backend answers a fleet member's calls, without vLLM (``VllmAnswers``)."""

from __future__ import annotations

from flows.receive.fleet_members import MemberError
from storage.catalog import Catalog
from storage.root import RootRef, open_root


class VllmAnswers:
    """A vLLM server's answers to a member's calls, as vLLM 0.32 gives them: an update session
    (start refused while one is open, update and finish refused without one, a failed update ends
    it), a weight version set only by a finish that names one; ``weights``: the step it holds;
    ``unanswered``: routes whose answer is lost (the request applied); ``failing``: routes that
    answer an error; ``held``: what its prepare reports holding (``prepared/<receiver>.json``). A
    member's ``call`` (``flows.receive.fleet_members.HttpServer``)."""

    def __init__(self, version: str = "1"):
        self.version, self.weights, self.session, self.unanswered = version, int(version), False, set()
        self.failing: dict[str, str] = {}  # route -> the error it answers (HTTP 500)
        self.held: int | None = int(version)  # what its engine holds as DCR knows it (its prepare's report)

    def __call__(self, url, route, body=None, method="POST", timeout=None):
        def refuse(why):
            raise MemberError(f"{url}{route}: HTTP 500: RuntimeError: {why}", 500)

        if route in self.failing:
            raise MemberError(f"{url}{route}: HTTP 500: {self.failing[route]}", 500)
        if route == "/init_weight_transfer_engine" and body["init_info"].get("prepare_id"):
            info = body["init_info"]  # its prepare's report, at once, saying what its engine holds
            Catalog(open_root(RootRef(info["root"]))).record_prepared(info["receiver_id"], {
                "prepare_id": info["prepare_id"], "step": info["step"], "ok": True, "ranks": 1, "held": self.held})
        if route == "/start_weight_update":
            if self.session:
                refuse("start_weight_update called while a weight update is already active")
            self.session = True
        elif route == "/update_weights":
            if not self.session:
                refuse("start_weight_update must be called before update_weights.")
            self.weights = self.held = body["update_info"]["step"]
        elif route == "/finish_weight_update":
            if not self.session:
                refuse("finish_weight_update called without a matching start_weight_update.")
            self.session = False
            self.version = body.get("weight_version", self.version)
        if route in self.unanswered:
            raise MemberError(f"{url}{route}: timed out")
        return {"weight_version": self.version} if route == "/weight_info" else {}
