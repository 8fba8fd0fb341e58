"""The highest fleet epoch a state file has seen, kept beside it: ``.<name>.fleet-epochs``.

A state file that is a fleet member (``state:PATH``) refuses a switch made under an epoch older
than one that already reached it (the fencing of ``flows.receive.receiver``). The epochs seen are
kept in this small file beside the state file (``{"format": "dcr-fleet-epochs", "epochs": {NAME:
E}}``), read and raised only under the state file's lock (``storage.local.state.exclusive``), so
one check-and-raise is atomic against every other writer of the file, in any process, and a fence
outlives the process that set it. It is written by a temp file and a rename (a reader sees the
old one or the new one); a damaged one is refused in one line naming it (a fence that cannot be
read keeps nobody out: remove it only when no coordinator of an older epoch can still be running).
"""

from __future__ import annotations

import contextlib
import os
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr_core.errors import IntegrityError
from storage import layout
from storage.local.safetensors import temp_path

FORMAT: Final = "dcr-fleet-epochs"
MAX_BYTES = 1 << 16


class FleetEpochs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["dcr-fleet-epochs"] = FORMAT
    epochs: dict[str, int] = Field(default_factory=dict)


def epochs_path(state_path: str) -> str:
    directory, name = os.path.split(os.path.realpath(state_path))
    return os.path.join(directory, f".{name}.fleet-epochs")


def read(state_path: str) -> dict[str, int]:
    """The highest epoch seen per fleet ({} if none was ever recorded)."""
    path = epochs_path(state_path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    try:
        doc = FleetEpochs.model_validate_json(data)
        for name, epoch in doc.epochs.items():
            layout.fleet_key(name)
            if isinstance(epoch, bool) or not 1 <= epoch <= layout.MAX_STEP:
                raise ValueError(f"epoch {epoch!r}")
    except (ValidationError, ValueError) as e:
        raise IntegrityError(f"{path}: not a DCR fleet epochs file ({type(e).__name__}); it fences the state file "
                             "beside it: remove it only when no older fleet coordinator can still be running") from None
    return dict(doc.epochs)


def write(state_path: str, epochs: dict[str, int]) -> None:
    """Keep ``epochs`` beside the state file (temp file, rename); the caller holds the file's lock."""
    path = epochs_path(state_path)
    tmp = temp_path(os.path.realpath(state_path))  # a killed writer's is swept as the state's (state.exclusive)
    try:
        with open(tmp, "wb") as f:
            f.write(FleetEpochs(epochs=epochs).model_dump_json().encode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
