"""Staging on S3: CopyObject for small objects, multipart UploadPartCopy for the rest.

An object of at least ``part_size`` bytes is copied in parts of ``part_size`` (the
last one shorter) with ``UploadPartCopy``, one at a time, each part's ETag stored
before the next starts; a copy resumed after a restart asks S3 for the parts of its
upload and copies only those missing. An upload that S3 no longer knows
(``NoSuchUpload``: aborted by a lifecycle rule) starts that object again. The client is
the target region's (S3 copies are requested of the target bucket).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from jobs.staging.copier import ObjectRef, Progress, SaveProgress, StagingError, StoreURI

__all__ = ["MIN_PART", "S3Copier"]

#: S3's smallest part (but the last).
MIN_PART = 5 * 2**20
#: S3's largest part.
MAX_PART = 5 * 2**30


class S3Copier:
    def __init__(
        self, *, region: str, endpoint_url: str | None = None, part_size: int = 64 * 2**20
    ) -> None:
        if not MIN_PART <= part_size <= MAX_PART:
            raise StagingError(
                f"a staging part of {part_size} bytes is outside S3's 5 MiB to 5 GiB"
            )
        self.part_size = part_size
        self._client: Any = boto3.session.Session().client(
            "s3",
            region_name=region,
            endpoint_url=endpoint_url or None,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}),
        )

    def region(self, bucket: str) -> str | None:
        try:
            found = self._client.get_bucket_location(Bucket=bucket).get("LocationConstraint")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                raise StagingError(f"the bucket s3://{bucket} does not exist") from None
            return None
        return "eu-west-1" if found == "EU" else str(found or "us-east-1")

    def list_after(self, src: StoreURI, after: str | None) -> Iterator[ObjectRef]:
        args: dict[str, Any] = {"Bucket": src.bucket, "Prefix": src.prefix}
        if after:
            args["StartAfter"] = after
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(**args):
                for item in page.get("Contents", []):
                    if not item["Key"].endswith("/"):  # a console "folder"
                        yield ObjectRef(item["Key"], int(item["Size"]))
        except (ClientError, BotoCoreError) as exc:
            raise StagingError(f"cannot list {src.uri(src.prefix)}: {exc}") from None

    def copy(
        self,
        obj: ObjectRef,
        *,
        src: StoreURI,
        dst: StoreURI,
        dst_key: str,
        progress: Progress,
        save: SaveProgress,
    ) -> None:
        source = {"Bucket": src.bucket, "Key": obj.key}
        if obj.size < self.part_size:
            self._client.copy_object(Bucket=dst.bucket, Key=dst_key, CopySource=source)
            progress.parts = [{"n": 1, "size": obj.size}]
            save(progress)
            return
        if progress.token is not None:
            progress.parts = self._listed_parts(dst, dst_key, progress)
        if progress.token is None:
            upload = self._client.create_multipart_upload(Bucket=dst.bucket, Key=dst_key)
            progress.token = str(upload["UploadId"])
            progress.parts = []
            progress.copied = False
            save(progress)
            progress.copied = True
        done = {int(p["n"]) for p in progress.parts}
        count = -(-obj.size // self.part_size)
        for n in range(1, count + 1):
            if n in done:
                continue
            first = (n - 1) * self.part_size
            last = min(obj.size, first + self.part_size) - 1
            answer = self._client.upload_part_copy(
                Bucket=dst.bucket,
                Key=dst_key,
                UploadId=progress.token,
                PartNumber=n,
                CopySource=source,
                CopySourceRange=f"bytes={first}-{last}",
            )
            etag = answer["CopyPartResult"]["ETag"]
            progress.parts = [*progress.parts, {"n": n, "etag": etag, "size": last - first + 1}]
            save(progress)
        parts = sorted(progress.parts, key=lambda p: int(p["n"]))
        self._client.complete_multipart_upload(
            Bucket=dst.bucket,
            Key=dst_key,
            UploadId=progress.token,
            MultipartUpload={"Parts": [{"PartNumber": p["n"], "ETag": p["etag"]} for p in parts]},
        )

    def _listed_parts(self, dst: StoreURI, key: str, progress: Progress) -> list[dict[str, Any]]:
        """The parts S3 holds for the stored upload (the stored list may lack the last
        one: copied, then killed before it was saved); none when S3 forgot the upload."""
        try:
            listed: list[dict[str, Any]] = []
            pages = self._client.get_paginator("list_parts").paginate(
                Bucket=dst.bucket, Key=key, UploadId=progress.token
            )
            for page in pages:
                listed += [
                    {"n": int(p["PartNumber"]), "etag": p["ETag"], "size": int(p["Size"])}
                    for p in page.get("Parts", [])
                ]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                raise
            progress.token = None
            return []
        return listed

    def delete_prefix(self, dst: StoreURI) -> int:
        deleted = 0
        keys: list[dict[str, str]] = []
        for obj in self.list_after(dst, None):
            keys.append({"Key": obj.key})
            if len(keys) == 1000:  # DeleteObjects takes 1,000 keys
                self._client.delete_objects(Bucket=dst.bucket, Delete={"Objects": keys})
                deleted, keys = deleted + len(keys), []
        if keys:
            self._client.delete_objects(Bucket=dst.bucket, Delete={"Objects": keys})
            deleted += len(keys)
        return deleted
