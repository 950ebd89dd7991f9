"""Object stores for checkpoints, and the URI that picks one.

``base`` holds the Store protocol, ``local`` a directory, ``s3`` S3 and any S3-compatible
service, ``gcs`` Cloud Storage. ``runner.store.s3`` is imported only when an ``s3://`` URI
is opened and ``runner.store.gcs`` only for ``gs://``, so an instance that checkpoints to a
directory imports neither boto3 nor google-cloud-storage.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

from runner import env as contract
from runner.errors import BadURIError, StoreError
from runner.store.base import DELETE_BATCH, ObjectInfo, Store, WriteStream, check_key
from runner.store.local import LocalStore

__all__ = [
    "DELETE_BATCH",
    "STORE_KINDS",
    "LocalStore",
    "ObjectInfo",
    "Store",
    "WriteStream",
    "check_key",
    "open_store",
    "run_store",
    "store_kind",
]

_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,200}")

#: URI scheme → the kind of store :func:`open_store` opens for it ("" is a plain path).
#: The control plane prices a store by its kind (``jobs.spend.storage``).
STORE_KINDS: Mapping[str, str] = {"": "local", "file": "local", "s3": "s3", "gs": "gcs"}


def store_kind(uri: str | Path) -> str | None:
    """The kind of store ``uri`` is in (:data:`STORE_KINDS`); None for a scheme no store
    opens."""
    return STORE_KINDS.get(urlparse(str(uri).strip()).scheme.lower())


def open_store(
    uri: str | Path, *, endpoint_url: str | None = None, credentials: str | None = None
) -> Store:
    """The store for a URI: a path, ``file://…``, ``s3://bucket/prefix`` or
    ``gs://bucket/prefix``.

    ``endpoint_url`` (or ``TRAINBOT_S3_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``) points S3
    at any S3-compatible service; ``STORAGE_EMULATOR_HOST`` points gs:// at a GCS emulator.
    ``credentials``: a cloud store's ``"default"`` or ``"broker"`` (unset:
    ``TRAINBOT_STORE_CREDENTIALS``); ``"default"`` reads data as the training script does.
    """
    text = str(uri).strip()
    if not text:
        raise BadURIError(
            "the checkpoint URI is empty: give a directory, file://…, s3://… or gs://…"
        )
    parsed = urlparse(text)
    if parsed.scheme and (parsed.query or parsed.fragment or "?" in text or "#" in text):
        raise BadURIError(f"{text[:120]!r} has a '?' or '#': checkpoint URIs take neither")
    if parsed.scheme in ("", "file"):
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise BadURIError(
                    f"{text!r} names a remote host; file:// URIs must be file:///absolute/path"
                )
            path = unquote(parsed.path)
        else:
            path = text
        return LocalStore(path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise BadURIError(f"{text!r} has no bucket: write s3://BUCKET/PREFIX")
        from runner.store.s3 import S3Store  # boto3 is imported only where S3 is used

        return S3Store(
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            endpoint_url=endpoint_url
            or os.environ.get(contract.S3_ENDPOINT_URL.name)
            or os.environ.get("AWS_ENDPOINT_URL_S3"),
            credentials=credentials,
        )
    if parsed.scheme == "gs":
        if not parsed.netloc:
            raise BadURIError(f"{text!r} has no bucket: write gs://BUCKET/PREFIX")
        try:  # google-cloud-storage is imported only where Cloud Storage is used
            from runner.store.gcs import GCSStore
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("google"):
                raise
            raise StoreError(
                f"{text!r} needs the Cloud Storage client ({exc.name} is not installed): "
                "pip install google-cloud-storage"
            ) from exc

        return GCSStore(
            bucket=parsed.netloc, prefix=parsed.path.strip("/"), credentials=credentials
        )
    raise BadURIError(
        f"unsupported checkpoint URI scheme {parsed.scheme!r} in {text!r}: "
        "use a local path, file:///path, s3://bucket/prefix or gs://bucket/prefix"
    )


def run_store(checkpoint_uri: str, run_id: str) -> Store:
    """The store rooted at one run's checkpoints.

    ``run_id`` is one path segment (letters, digits, ``.``, ``_``, ``-``, not ``.`` or
    ``..``), so a run's store can never be its root, a parent or a sibling run's.
    """
    if not _SEGMENT.fullmatch(run_id) or run_id in (".", ".."):
        raise BadURIError(
            f"{run_id[:80]!r} is not a valid run directory: one segment of letters, digits, "
            "'.', '_' or '-'"
        )
    return open_store(f"{checkpoint_uri.rstrip('/')}/{run_id}")
