"""The project's error hierarchy: one base class, each also a matching builtin where one fits.

Every error carries a one-line message that names the object concerned and, where possible,
says what to do instead. The CLI prints ``str(error)`` and exits with ``exit_code``: one class per
condition, so every command exits with the same code for the same condition (the table is in
docs/reference/commands.md).
"""


class DCRError(Exception):
    """Base class of every error DCR raises on purpose."""

    exit_code = 1


class InvalidCheckpointError(DCRError, ValueError):
    """A checkpoint (or receiver state file) cannot be read or is not a valid safetensors file."""

    exit_code = 2


class SchemaMismatchError(DCRError, ValueError):
    """Tensor names, dtypes or shapes differ from the base step."""

    exit_code = 2


class StepConflictError(DCRError):
    """The step is already committed, not after the latest committed step, or lost a race."""

    exit_code = 3


class StepNotFoundError(DCRError, FileNotFoundError):
    """The requested step is not committed in ROOT (or ROOT holds no committed step)."""

    exit_code = 4


class StepVanishedError(StepNotFoundError):
    """A step a refit planned to read was deleted meanwhile (``dcr gc``): plan again."""


class IntegrityError(DCRError):
    """Stored bytes do not match the digests that bind them: corrupted, missing or foreign data."""

    exit_code = 5


class StateMismatchError(IntegrityError):
    """A receiver's state is not the step it claims to be."""


class UntrustedError(IntegrityError):
    """ROOT holds something no retry makes trustworthy: an unsigned or forged commit marker, a marker
    of another run, a link or special file where an object belongs. Someone must look."""


class UnsafeKeyError(UntrustedError, ValueError):
    """A key taken from a manifest or commit marker points outside where it must lie, or a path
    below ROOT is a link or special file."""


class UsageError(DCRError, ValueError):
    """Bad arguments (receiver id, step number, option values)."""

    exit_code = 2


class RootNotFoundError(UsageError):
    """ROOT is a local directory that does not exist, or holds nothing a publisher wrote: a misspelt
    ROOT, said as such by every command (never as a missing step)."""


class BusyError(DCRError, TimeoutError):
    """What this process must hold alone (a state file's lock) is held by another, and did not come
    free within the time allowed. Nothing was changed; retry later, or allow longer."""


class FencedError(BusyError):
    """A request made for a fleet under an epoch older than one the receiver has already seen: the
    coordinator that sent it lost its lease to another (``storage.fleet_lease``). Nothing was changed."""
