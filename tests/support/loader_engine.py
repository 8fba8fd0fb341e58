"""An engine for DCR's engine receiver with no vLLM: its in-place reload is the model's own
``load_weights`` (as vLLM's layerwise reload is, for the whole layers the receiver passes)."""

from __future__ import annotations


class LoaderEngine:
    """``flows.receive.engine_model.EngineModel`` over a model with a vLLM-style ``load_weights``."""

    kind, rank, ranks = "loader", 0, 1

    def __init__(self, model):
        self.model = model

    def reload(self, weights, layers):
        self.model.load_weights(weights)

    def abandon_reload(self):
        pass  # no half-processed layers to put back
