"""System sampling: GPU utilisation (NVML, where there is a GPU) and scratch disk use."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.telemetry.sink import EventSink

log = logging.getLogger(__name__)


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Nvml:
    """NVML through ctypes: no pynvml dependency, and nothing at all without a GPU."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: Any = None
        self._handles: list[ctypes.c_void_p] = []
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            count = ctypes.c_uint(0)
            if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return
            lib.nvmlDeviceGetUtilizationRates.argtypes = [
                ctypes.c_void_p,
                ctypes.POINTER(_Utilization),
            ]
            for index in range(count.value):
                handle = ctypes.c_void_p()
                if (
                    lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle))
                    == 0
                ):
                    self._handles.append(handle)
            self._lib = lib
        except (OSError, AttributeError) as exc:
            log.debug("NVML unavailable, reporting no GPU: %s", exc)

    def utilization(self) -> tuple[float | None, int]:
        """(mean GPU utilisation in percent over the devices, device count)."""
        if self._lib is None or not self._handles:
            return None, 0
        values = []
        with self._lock:
            for handle in self._handles:
                rates = _Utilization()
                if self._lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(rates)) == 0:
                    values.append(float(rates.gpu))
        return (sum(values) / len(values) if values else None), len(self._handles)


@functools.cache
def _nvml() -> _Nvml:
    """NVML is initialised once per process; the device handles stay valid."""
    return _Nvml()


def _bytes_under(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # deleted while we walked
    return total


def sample_system(disk_path: str | Path, *, declared_total: int | None = None) -> dict[str, Any]:
    """The "system" payload now; never raises (a failed reading is reported as 0/None).

    Disk total is used + available, not the raw size, so used/total is the fullness
    that ends a run (as ``df`` shows it; root's reserved blocks are not available).
    With ``declared_total`` (a scratch directory of a declared size, as the local
    provider gives), used is the bytes under the directory.
    """
    path = str(disk_path)
    used = total = 0
    try:
        if declared_total is None:
            usage = shutil.disk_usage(path)
            used, total = usage.used, usage.used + usage.free
        else:
            used, total = _bytes_under(Path(path)), max(0, int(declared_total))
    except (OSError, ValueError) as exc:
        log.debug("disk usage of %s unavailable: %s", path, exc)
    try:
        gpu_util, gpu_count = _nvml().utilization()
    except Exception as exc:  # sampling must never take the runner down
        log.debug("GPU sampling failed: %s", exc)
        gpu_util, gpu_count = None, 0
    return {
        "gpu_util": gpu_util,
        "gpu_count": gpu_count,
        "disk_used": used,
        "disk_total": total,
        "disk_path": path,
    }


class SystemSampler:
    """A thread that emits "system" and "heartbeat" to a sink every ``interval_s``."""

    def __init__(
        self,
        sink: EventSink,
        disk_path: str | Path,
        *,
        interval_s: float = 15.0,
        declared_total: int | None = None,
        current_step: Callable[[], int | None] | None = None,
        extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``extra``: more fields of each "system" payload (a gang node's own figures)."""
        self._sink = sink
        self._extra = extra or dict
        self._disk_path = disk_path
        self._interval_s = interval_s
        self._declared_total = declared_total
        self._current_step = current_step or (lambda: None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="system-sampler", daemon=True)

    def start(self) -> SystemSampler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                sample = sample_system(self._disk_path, declared_total=self._declared_total)
                self._sink.emit("system", {**sample, **self._extra()})
                self._sink.emit("heartbeat", {"step": self._current_step()})
            except Exception as exc:  # a sampler must not kill the run
                log.warning("system sampling could not emit: %s", exc)
            if self._stop.wait(self._interval_s):
                return

    def __enter__(self) -> SystemSampler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
