"""Staging a dataset into the region of a run's accelerators (issue 26, point 3).

``models`` the table that holds each copy's state; ``prices`` its cost and time before it
starts; ``copier`` what a store must do, ``s3`` and ``gcs`` how each does it; ``work`` the
copy itself (deferred work the leader runs, resumable); ``retention`` the cleanup and the
digest's figures.
"""

from jobs.staging.copier import StagingError
from jobs.staging.models import Staging, StagingState

__all__ = ["Staging", "StagingError", "StagingState"]
