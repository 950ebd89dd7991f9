"""Batch deletes for the Cloud Storage store: JSON API batches of 100 DELETE calls.

The client's ``Batch`` allows 1,000 calls (the service takes 100) and fails the whole call
on one missing key; here a missing object is not an error, and calls that fail
transiently are sent again.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from email.parser import BytesParser
from typing import TYPE_CHECKING
from urllib.parse import quote

import requests

from runner.errors import StoreError
from runner.store.gcs_http import RETRY_STATUS, StatusError, backoff_s, check

if TYPE_CHECKING:
    from runner.store.gcs import GCSStore

#: The JSON API takes at most this many calls in one batch request.
BATCH_LIMIT = 100


def delete_batch(store: GCSStore, fulls: list[str], before: int) -> int:
    """Delete up to BATCH_LIMIT objects in one request; a missing one is not an error.

    Calls that fail transiently are sent again; returns how many objects were deleted.
    """
    deleted = 0
    pending = fulls
    for attempt in range(1, store.max_attempts + 1):
        answers = store._retrying("delete", None, functools.partial(post_batch, store, pending))
        again: list[str] = []
        failed: list[tuple[str, int, str]] = []
        for full, (status, message) in zip(pending, answers, strict=True):
            if status in (200, 204):
                deleted += 1
            elif status == 404:
                continue  # already gone
            elif status in RETRY_STATUS and attempt < store.max_attempts:
                again.append(full)
            else:
                failed.append((full, status, message))
        if failed:
            full, status, message = failed[0]
            hint = (
                "Grant storage.objects.delete to "
                + ("the runner-storage" if store.brokered else "this instance's")
                + " service account"
                if status == 403
                else "Check the bucket's retention policy and any object holds"
            )
            raise StoreError(
                f"could not delete gs://{store.bucket}/{full} ({status}: {message}) and "
                f"{len(failed) - 1} more; {before + deleted} deleted. {hint}"
            )
        if not again:
            return deleted
        pending = again
        time.sleep(backoff_s(attempt))
    return deleted


def post_batch(store: GCSStore, fulls: list[str]) -> list[tuple[int, str]]:
    """One ``multipart/mixed`` batch of DELETE calls; each call's status and message."""
    boundary = f"trainbot-{uuid.uuid4().hex}"
    parts = [
        f"--{boundary}\r\nContent-Type: application/http\r\n"
        f"Content-Transfer-Encoding: binary\r\nContent-ID: <{i}>\r\n\r\n"
        f"DELETE /storage/v1/b/{store.bucket}/o/{quote(full, safe='')} HTTP/1.1\r\n\r\n"
        for i, full in enumerate(fulls)
    ]
    body = ("".join(parts) + f"--{boundary}--\r\n").encode()
    response = check(
        store.http.post(
            f"{store.endpoint}/batch/storage/v1",
            data=body,
            headers={"Content-Type": f"multipart/mixed; boundary={boundary}"},
            timeout=store.timeout,
        )
    )
    return batch_answers(response, len(fulls))


def batch_answers(response: requests.Response, count: int) -> list[tuple[int, str]]:
    """Each call's (status, message) from a batch answer, in the order of the calls.

    Google names each answer ``Content-ID: <response-N>``; without names (some emulators),
    answers are taken in order.
    """
    head = f"Content-Type: {response.headers.get('Content-Type', '')}\r\n\r\n".encode()
    message = BytesParser().parsebytes(head + response.content)
    parts = message.get_payload()
    if not isinstance(parts, list) or len(parts) != count:
        raise StatusError(502, f"a batch of {count} deletes got {len(parts or [])} answers")
    answers: list[tuple[int, str] | None] = [None] * count
    for position, part in enumerate(parts):
        content_id = str(part.get("Content-ID") or "")
        found = re.search(r"response-(\d+)", content_id)
        index = int(found.group(1)) if found else position
        raw = part.get_payload(decode=False)
        text = raw if isinstance(raw, str) else ""
        status_line, _, rest = text.lstrip().partition("\n")
        fields = status_line.split(" ", 2)
        status = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 502
        found_body = re.search(r"\r?\n\r?\n(.*)", rest, re.S)
        body = found_body.group(1).strip() if found_body else ""
        try:
            detail = str(json.loads(body).get("error", {}).get("message", "")) if body else ""
        except (ValueError, AttributeError):
            detail = body[:200]
        if 0 <= index < count:
            answers[index] = (status, detail)
    if any(a is None for a in answers):
        raise StatusError(502, "a batch answer did not name every call")
    return [a for a in answers if a is not None]
