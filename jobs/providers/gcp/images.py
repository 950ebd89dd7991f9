"""The boot image: a Deep Learning VM family by default, and whether an image exists.

Compute Engine images are global, so "exists in the chosen region" is "exists": a family
resolves to its newest image that is not deprecated (``images.getFromFamily``).
"""

from __future__ import annotations

import re
import threading

from google.cloud import compute_v1

from jobs.providers.base import ProviderError
from jobs.providers.gcp.api import ComputeApi

__all__ = ["DEFAULT_IMAGE", "Images"]

#: A Deep Learning VM family: the NVIDIA driver (installed at first boot, as the
#: ``install-nvidia-driver`` metadata asks) and CUDA on Debian.
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu121-debian-11"
_IMAGE = re.compile(
    r"(?:https://(?:www|compute)\.googleapis\.com/compute/v1/)?"
    r"projects/(?P<project>[^/]+)/global/images/(?P<family>family/)?(?P<name>[^/]+)"
)
_WHAT_TO_SET = (
    "set resources.image_id in the spec, or TRAINBOT_GCP_IMAGE, to an image or image "
    "family that exists (projects/PROJECT/global/images/NAME or …/images/family/FAMILY; "
    f"the default is {DEFAULT_IMAGE})"
)


class Images:
    """Looks boot images up, remembering those found (an image does not come back once
    deleted, but a family may be retired: families are asked again after a miss)."""

    def __init__(self, api: ComputeApi) -> None:
        self._api = api
        self._found: set[str] = set()
        self._lock = threading.Lock()

    def check(self, image: str) -> None:
        """Return when ``image`` exists; else a ProviderError that says what to set."""
        with self._lock:
            if image in self._found:
                return
        parsed = _IMAGE.fullmatch(image.strip())
        if parsed is None:
            raise ProviderError(f"the boot image {image!r} is not an image URL: {_WHAT_TO_SET}")
        project, name = parsed["project"], parsed["name"]
        missing = f"the boot image {image} does not exist: {_WHAT_TO_SET}"
        if parsed["family"]:
            self._api.send(
                f"look up the image family {name} of {project}",
                "images.getFromFamily",
                compute_v1.GetFromFamilyImageRequest(project=project, family=name),
                client="images",
                method="get_from_family",
                not_found=missing,
            )
        else:
            self._api.send(
                f"look up the image {name} of {project}",
                "images.get",
                compute_v1.GetImageRequest(project=project, image=name),
                client="images",
                method="get",
                not_found=missing,
            )
        with self._lock:
            self._found.add(image)
