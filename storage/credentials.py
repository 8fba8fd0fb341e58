"""Which storage options are credentials, and a ROOT as another process is given it: without them.

Credentials belong to the process that opens ROOT, taken from its own environment or
configuration (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``AZURE_STORAGE_CONNECTION_STRING``, an instance role, ...). Storage options that travel somewhere
they would be kept or seen (a Prefect flow's parameters, a fleet's ``init_info`` to a server) must
hold none. The rule, at any depth of the options (``client_kwargs.aws_session_token``):

- a credential is an option whose name is one s3fs, gcsfs, adlfs or botocore takes a secret under
  (``CREDENTIAL_OPTIONS``: ``key``, ``secret``, ``token``, ``password``, ``account_key``,
  ``sas_token``, ``connection_string``, ``client_secret``, ``credential``, ...), with a value that
  is set (not None, not empty);
- ``token`` is s3fs's session token and gcsfs's credentials: it is one unless it names a gcsfs
  mode (``anon``, ``google_default``, ``cloud``, ``browser``, ``cache``) or a key file (``....json``);
- everything else is not (``anon=False``, ``endpoint_url``, ``region_name``, ``account_name``,
  ``profile``, ``max_pool_connections``): a name, an address, a switch.
"""

from __future__ import annotations

from collections.abc import Mapping

from dcr_core.errors import UsageError
from storage.backends import registry
from storage.root import RootRef

CREDENTIAL_OPTIONS = frozenset({
    "key", "secret", "token", "session_token", "password", "passwd", "account_key", "sas_token", "connection_string",
    "client_secret", "credential", "credentials", "access_token", "refresh_token", "api_key", "private_key",
    "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
})
TOKEN_MODES = frozenset({"anon", "google_default", "cloud", "browser", "cache"})  # gcsfs: how, not what


def is_credential(name: object, value: object) -> bool:
    """Whether option ``name`` set to ``value`` is a credential (see the module docstring)."""
    if not isinstance(name, str) or name.lower() not in CREDENTIAL_OPTIONS or value is None or value == "":
        return False
    if name.lower() == "token" and isinstance(value, str):
        return value not in TOKEN_MODES and not value.endswith(".json")
    return True


def find_credential(options: Mapping | None) -> tuple[str, ...] | None:
    """The path of names to the first credential in ``options`` (``("client_kwargs",
    "aws_session_token")``), or None."""
    for k, v in (options or {}).items():
        if is_credential(k, v):
            return (str(k),)
        if isinstance(v, Mapping):
            inner = find_credential(v)
            if inner is not None:
                return (str(k), *inner)
    return None


def for_another_process(ref: RootRef, to: str) -> RootRef:
    """``ref`` as it is sent to ``to``, a process that opens ROOT itself, maybe on another machine (a
    server member of a fleet): a local path made absolute (the directory must be there under the
    same path: one machine, or a shared file system), the storage options as they are, unless one is
    a credential: refused in one line naming it (the process takes its own from its environment).
    A ROOT that only this process sees (``memory://``) is refused too."""
    found = find_credential(ref.storage_options)
    if found is not None:
        raise UsageError(f"{to}: storage option {'.'.join(found)!r} is a credential, and none is sent to another "
                         "process: give it the store's credentials in its own environment (AWS_ACCESS_KEY_ID, "
                         "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_CONNECTION_STRING, ...)")
    backend = registry.backend_class(ref.url)
    if not backend.shared_between_processes:
        raise UsageError(f"{to}: ROOT {ref.url!r} lives in this process only; another process cannot open it")
    if backend.local:
        return RootRef(registry.canonical_url(ref.url), ref.storage_options)
    return ref
