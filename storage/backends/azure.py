"""``az://container/prefix`` (also ``abfs://``, ``abfss://``): Azure Blob Storage, through adlfs.

Account, credentials and endpoint: Azure's standard settings, read by adlfs:
``AZURE_STORAGE_CONNECTION_STRING`` (its ``BlobEndpoint`` names an emulator or a custom endpoint),
else ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` (or ``AZURE_STORAGE_SAS_TOKEN``,
or a service principal's ``AZURE_STORAGE_CLIENT_ID``/``_SECRET``/``TENANT_ID``; with none of them,
Azure's default credential chain: managed identity, the Azure CLI's login). The same names as
``--storage-option`` (``connection_string=...``, ``account_name=...``) win, as for the other stores.

Create-if-absent: ``Put Blob`` with ``If-None-Match: *`` (adlfs's ``mode="create"`` is
``upload_blob(overwrite=False)``; a blob larger than the SDK's single-put size commits its block list
under the same condition). The service refuses (409 ``BlobAlreadyExists``) if the blob exists, and
adlfs raises ``FileExistsError``. Atomic on Azure and on Azurite (the emulator).

Retries: the Azure SDK's own storage retry policy (azure-core's pipeline inside adlfs: connection
errors, 408 and 5xx, with exponential backoff; a download cut short is resumed by the SDK's
downloader), so ``Root`` does not retry, as for GCS. adlfs does not pass retry settings through to
the SDK's clients, so there is no switching the SDK's off to put DCR's in its place. A create whose
first request succeeded but whose answer was lost is retried by the SDK and refused as existing; the
publisher then finds its own marker there (``storage.commit``).
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlsplit

import fsspec
from fsspec.asyn import sync

from storage import access
from storage.access import Endpoint, StoreConfigError
from storage.backends.base import Backend

# Where adlfs finds the account, in the order it looks (a connection string wins over an account name).
# (an account_host option names the endpoint of an account named otherwise)
ACCOUNT_SETTINGS = (("connection_string", "AZURE_STORAGE_CONNECTION_STRING"), ("account_host", None),
                    ("account_name", "AZURE_STORAGE_ACCOUNT_NAME"))
_IDENTITY_LOG = logging.getLogger("azure.identity")


class AzureBackend(Backend):
    schemes = ("az", "abfs", "abfss")
    form = "az://container/prefix"
    supports_conditional_create = True
    bucket_word = "container"
    credentials_hint = ("no usable Azure credentials; set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME "
                        "and AZURE_STORAGE_ACCOUNT_KEY")
    missing_bucket_codes = frozenset({"ContainerNotFound"})
    denied_codes = frozenset({"AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch"})
    endpoint_hint = "is the server running? (infra/start-azurite.sh starts Azurite here)"
    default_endpoint_hint = "check the network and the account name (AZURE_STORAGE_ACCOUNT_NAME)"
    server_hint = "infra/start-azurite.sh creates one in a local Azurite"

    @classmethod
    def open(cls, url: str, storage_options: dict) -> Backend:
        setting = account_setting(url, storage_options)
        if _IDENTITY_LOG.level == logging.NOTSET:
            # Azure's default credential chain logs every credential it tried, as a WARNING of many
            # lines, when none works; the failure reaches the user as DCR's one-line error instead.
            _IDENTITY_LOG.setLevel(logging.ERROR)
        fs, path = fsspec.url_to_fs(url, **storage_options)  # no request yet: adlfs only builds its client
        client = fs.service_client
        where = client.url.rstrip("/")
        # the cloud's own endpoint (https://ACCOUNT.blob.core.windows.net) is looked up, not connected to
        endpoint = Endpoint(where, setting, default=(urlsplit(where).hostname or "").startswith(f"{client.account_name}.blob."))
        access.probe(url, endpoint, cls.default_endpoint_hint if endpoint.default else cls.endpoint_hint)
        return cls(fsspec.utils.get_protocol(url), fs, path, endpoint=endpoint)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        return self.create_by_condition(path, data)

    def bucket_exists(self, bucket: str, prefix: str) -> bool | None:
        try:
            return bool(sync(self.fs.loop, self.fs.service_client.get_container_client(bucket).exists))
        except Exception:  # noqa: BLE001 - no verdict: the caller's own (empty) result stands
            return None

    @classmethod
    def lacks_credentials(cls, type_names: set[str], statuses: set[int]) -> bool:
        # The credential chain found nothing: an authentication error that no response carried
        # (a request refused for its credentials carries 403: access denied, not absent).
        return "azure.core.exceptions.ClientAuthenticationError" in type_names and not statuses


def account_setting(url: str, storage_options: dict) -> str:
    """Which setting names the account (what an unreachable endpoint's message names); a one-line
    ``StoreConfigError`` when none does (adlfs's own error says less)."""
    for option, variable in ACCOUNT_SETTINGS:
        if storage_options.get(option):
            return f"--storage-option {option}"
        if variable and os.environ.get(variable):
            return variable
    raise StoreConfigError(f"{url}: no Azure storage account set; set AZURE_STORAGE_CONNECTION_STRING, or "
                           "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY")
