"""``trainbot-runner``: the command on every instance.

    trainbot-runner exec [--sync-dir DIR] -- CMD…        run and supervise a training command
    trainbot-runner dry-run [--steps N] [--mtbp S] -- CMD…  checkpoint, kill, restore, verify
    trainbot-runner checkpoints list|verify|prune URI    inspect or prune one run's checkpoints
    trainbot-runner credentials                          this run's checkpoint credentials,
                                                         as AWS credential_process output
    trainbot-runner pack DIR STORE_URI                   pack a code directory into the store
                                                         and print the spec's code.archive line

URI is one run's checkpoint root: ``{checkpoint_uri}/{run_id}`` (a path, file://… or s3://…).
Exit codes: 0 success, 75 preempted (resume from the newest checkpoint, or from step 0
if none; ``exec`` exits 75 on any notice, whatever the command then does, unless it
finished with its last step committed), anything else failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from runner import EXIT_FAILED, env
from runner.duration import parse_duration
from runner.errors import CheckpointError, RunnerError

if TYPE_CHECKING:
    from runner.logship import LogShipper
    from runner.preemption import PreemptionFlag
    from runner.setup import Workspace
    from runner.telemetry import EventSink

# ``exec`` must start the training process fast: torch is imported only by the commands
# that read tensors (``dry-run`` starts processes that do; ``checkpoints verify`` does).
# And a SIGTERM during its own start is a preemption notice (exit 75), not a death (143):
# this module imports the standard library only (and runner.env, which does too), and
# ``main`` catches SIGTERM (:class:`EarlyNotice`) before the heavy imports (the store, the
# supervisor, telemetry).


class EarlyNotice:
    """A SIGTERM that arrives while ``exec`` is still importing, kept for the flag.

    Installed first thing in :func:`main`, before anything but the standard library is
    imported; :meth:`hand_over` passes what it caught to the preemption flag once the
    real handlers (:class:`runner.preemption.SignalHandlers`) have replaced it. Only the
    interpreter's own start (tens of milliseconds) comes before it; an instance that is
    preempted then dies of the signal, and the control plane, which sees the provider
    report the preemption, resubmits the attempt all the same.
    """

    def __init__(self) -> None:
        #: time.monotonic() of the first SIGTERM caught, if any.
        self.received_at: float | None = None
        self._original: Any = None

    def install(self) -> EarlyNotice | None:
        """None where no handler can be installed (``main`` called off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        self._original = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

    def uninstall(self, *, redeliver: bool) -> None:
        """SIGTERM does what it did before; ``redeliver``: one caught meanwhile (that no
        flag was handed) is delivered again."""
        signal.signal(signal.SIGTERM, self._original or signal.SIG_DFL)
        if redeliver and self.received_at is not None:
            os.kill(os.getpid(), signal.SIGTERM)

    def hand_over(self, flag: PreemptionFlag, *, window_s: float) -> None:
        """Set ``flag`` from the SIGTERM caught before its handlers were installed."""
        from runner.preemption import Notice

        if self.received_at is not None:
            flag.set(
                Notice(
                    source="signal",
                    reason="SIGTERM (during start-up)",
                    received_at=self.received_at,
                    deadline=self.received_at + window_s,
                )
            )


def _duration_arg(text: str) -> float:
    """An option's duration ('90s', '10m', '1h30m', plain seconds), above zero."""
    try:
        value = parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration like 90s, 10m, 2h or 7d"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _best(text: str) -> tuple[str, str, int]:
    parts = text.split(":")
    if not parts[0] or len(parts) > 3 or (len(parts) > 1 and parts[1] not in ("min", "max")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write METRIC[:min|max[:COUNT]], e.g. loss:min:2"
        )
    mode = parts[1] if len(parts) > 1 else "min"
    count = _positive_int(parts[2]) if len(parts) > 2 else 1
    return parts[0], mode, count


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainbot-runner",
        description="Run, checkpoint and supervise training on spot capacity.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    ex = sub.add_parser("exec", help="run and supervise a training command")
    ex.add_argument(
        "--sync-dir",
        type=Path,
        help="directory the script writes checkpoints into (synced to the store): folders "
        "or files whose names hold the step (checkpoint-500/, ckpt-500.pt, "
        "epoch=0-step=500.ckpt); a relative one is on the scratch volume "
        "($TRAINBOT_SCRATCH_DIR) when that is set",
    )
    ex.add_argument("--settle", type=_duration_arg, default=2.0, help="quiet time before sync")
    ex.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD…")

    dr = sub.add_parser("dry-run", help="checkpoint, kill, restart, restore and verify a command")
    dr.add_argument("--steps", type=_positive_int, default=5, help="steps before the checkpoint")
    dr.add_argument(
        "--mtbp", type=_duration_arg, default=3600.0, help="mean time between preemptions"
    )
    dr.add_argument("--checkpoint-uri", help="store root (default $TRAINBOT_CHECKPOINT_URI)")
    dr.add_argument("--run-id", help="namespace for the dry run's checkpoints")
    dr.add_argument("--report", type=Path, help="write the report as JSON here")
    dr.add_argument("--timeout", type=_duration_arg, default=600.0)
    dr.add_argument(
        "--sync-dir",
        type=Path,
        help="the script writes its own checkpoints into $TRAINBOT_CHECKPOINT_DIR, as under "
        "exec --sync-dir: it runs until they are synced, is killed, and must continue from "
        "the newest one restored into a fresh folder (the dry run's own folders take DIR's "
        "place)",
    )
    dr.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD…")

    ck = sub.add_parser("checkpoints", help="list, verify or prune one run's checkpoints")
    cks = ck.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = cks.add_parser("list", help="committed checkpoints, oldest first")
    ls.add_argument("uri")
    ls.add_argument("--json", action="store_true")
    vf = cks.add_parser("verify", help="check sizes and sha256 of checkpoints")
    vf.add_argument("uri")
    vf.add_argument("--step", type=int, help="one step (default: all)")
    pr = cks.add_parser("prune", help="delete checkpoints by a retention policy")
    pr.add_argument("uri")
    pr.add_argument("--keep-last", type=_positive_int, default=3)
    pr.add_argument("--keep-every", type=_positive_int, help="also keep multiples of K steps")
    pr.add_argument("--keep-best", type=_best, help="METRIC[:min|max[:COUNT]]")
    pr.add_argument("--max-age", type=_duration_arg, help="e.g. 7d")
    pr.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")

    pk = sub.add_parser(
        "pack",
        help="pack a code directory into a content-addressed archive in the store",
        description="Pack DIR (without .git, .venv, __pycache__ and the patterns of its "
        ".trainbotignore) into code-<sha256>.tar.gz under STORE_URI (s3://…, gs://…, a "
        "path or file://…) and print the spec line that runs it: code.archive: URI. The "
        "same files always make the same archive.",
    )
    pk.add_argument("dir", type=Path)
    pk.add_argument("store_uri")

    sub.add_parser(
        "credentials",
        help="print this run's checkpoint credentials (AWS credential_process output)",
        description="Ask the control plane ($TRAINBOT_INGEST_URL, $TRAINBOT_TOKEN) for "
        "short-lived S3 credentials that reach this run's checkpoint prefix only, and print "
        "them as AWS credential_process JSON: credential_process = trainbot-runner credentials",
    )
    return p


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise RunnerError(
            f"no command given: write `trainbot-runner {args.cmd} -- python train.py`"
        )
    return cmd


def _sink_from_env(node: int = 0) -> EventSink:
    from runner.telemetry import NullSink, Reporter

    url = env.INGEST_URL.get()
    token = env.TOKEN.get()
    if not url:
        return NullSink()
    if not token:
        raise RunnerError("TRAINBOT_INGEST_URL is set but TRAINBOT_TOKEN is not")
    attempt = env.ATTEMPT_ID.get()
    scratch = env.SCRATCH_DIR.get()
    default_root = scratch / ".spool" if scratch else Path.cwd() / ".trainbot-spool"
    spool = env.SPOOL_DIR.get() or default_root / attempt
    return Reporter(url, token, attempt=attempt, run=env.RUN_ID.get(), spool_dir=spool, node=node)


def _exec(args: argparse.Namespace, early: EarlyNotice | None = None) -> int:
    from runner.nodes import Node
    from runner.preemption import PreemptionFlag, SignalHandlers
    from runner.store import run_store
    from runner.supervisor import Supervisor
    from runner.sync import CheckpointSync

    cmd = _command(args)
    node = Node.from_env()
    if node is not None:
        cmd = node.command(cmd)
    window = env.termination_window_s()
    # From here on a SIGTERM is a preemption notice, even while the store (boto3) loads:
    # the attempt then ends resumable (75), never killed by the signal (143, a failure).
    flag = PreemptionFlag()
    with SignalHandlers(flag, window_s=window):
        if early is not None:
            early.hand_over(flag, window_s=window)
        scratch_bytes = env.SCRATCH_BYTES.get()
        sync = None
        if args.sync_dir is not None:
            scratch = env.SCRATCH_DIR.get()
            if scratch and not args.sync_dir.is_absolute():
                args.sync_dir = scratch / args.sync_dir
            store = run_store(
                env.CHECKPOINT_URI.get(), env.CHECKPOINT_PREFIX.get() or env.RUN_ID.get()
            )
            sync = CheckpointSync(store=store, root=args.sync_dir, settle_s=args.settle)
        sink = _sink_from_env(node.rank if node is not None else 0)
        try:
            sup = Supervisor(
                cmd,
                sink=sink,
                flag=flag,
                install_signals=False,
                window_s=window,
                preemption_sources=env.PREEMPTION_SOURCES.get(),
                sync=sync,
                scratch_bytes=scratch_bytes,
                sample_s=env.SYSTEM_SAMPLE_S.get(),
                under_torchrun=node is not None,
                node=node.rank if node is not None else 0,
                logs=_log_shipper(node.rank if node is not None else 0),
                workspace=_workspace(),
            )
            return sup.run()
        finally:
            sink.close(timeout=30.0)


def _log_shipper(node: int) -> LogShipper | None:
    """Where the command's output goes besides this process's stdout: the run's store,
    under its attempt and node (:mod:`runner.logship`), for an attempt the control plane
    started (its id and store given). The store is opened in the shipper's thread, so
    boto3's import never delays the command's start."""
    from runner.logship import LogShipper
    from runner.store import run_store

    uri = os.environ.get(env.CHECKPOINT_URI.name)
    attempt = os.environ.get(env.ATTEMPT_ID.name)
    if not uri or not attempt:
        return None
    prefix = env.CHECKPOINT_PREFIX.get() or env.RUN_ID.get()
    try:
        return LogShipper(lambda: run_store(uri, prefix), attempt=attempt, node=node)
    except ValueError as exc:
        logging.getLogger(__name__).warning("the command's output is not shipped: %s", exc)
        return None


def _workspace() -> Workspace | None:
    """The run's code and setup, when the control plane named any; its environment
    archives go to the run's store."""
    from runner.setup import Workspace
    from runner.store import run_store

    uri = os.environ.get(env.CHECKPOINT_URI.name)
    prefix = env.CHECKPOINT_PREFIX.get() or env.RUN_ID.get()
    opener = (lambda: run_store(uri, prefix)) if uri else None
    return Workspace.from_env(os.environ, store=opener)


def _pack(args: argparse.Namespace) -> int:
    from runner.code import pack

    uri = pack(args.dir, args.store_uri)
    print(f"code.archive: {uri}")
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    from runner.dryrun import DryRunReport, run_dry_run
    from runner.dryrun_report import DryRunReports

    # No default store here: a dry run deletes what it finds under its own namespace.
    uri = args.checkpoint_uri or os.environ.get(env.CHECKPOINT_URI.name)
    if not uri:
        raise RunnerError("say where checkpoints go: --checkpoint-uri or TRAINBOT_CHECKPOINT_URI")
    run_id = args.run_id or f"{env.RUN_ID.get()}-dry-run"
    # On a cloud dry run's instance: where it stands, and its report, go to the control plane.
    reports = DryRunReports.from_env(os.environ)
    if reports is not None:
        reports.progress("started")
    try:
        report = run_dry_run(
            _command(args),
            checkpoint_uri=uri,
            run_id=run_id,
            steps=args.steps,
            mtbp_s=args.mtbp,
            timeout_s=args.timeout,
            on_saved=(lambda: reports.progress("saved")) if reports is not None else None,
            read_sample=reports is not None,
            sync=args.sync_dir is not None,
        )
    except RunnerError as exc:
        if reports is None:
            raise
        # The control plane is waiting: it gets the reason rather than a silent instance.
        report = DryRunReport(mtbp_s=args.mtbp, problems=[f"it could not start: {exc}"])
    for line in report.lines():
        print(line)
    if args.report is not None:
        args.report.write_text(report.to_json())
    print(json.dumps(json.loads(report.to_json())))
    if reports is not None:
        reports.finish(report)
    return 0 if report.ok else EXIT_FAILED


def _credentials() -> int:
    """The credential_process contract: the JSON on stdout, or a message on stderr and a
    non-zero exit (main prints the StoreError)."""
    from runner.store.broker import fetch_broker_credentials

    print(json.dumps(fetch_broker_credentials()))
    return 0


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _checkpoints(args: argparse.Namespace) -> int:
    from runner.layout import list_committed, read_manifest
    from runner.retention import RetentionPolicy, prune
    from runner.store import open_store

    store = open_store(args.uri)
    entries = list_committed(store)
    if args.action == "list":
        rows: list[dict[str, Any]] = []
        for e in entries:
            try:
                m = read_manifest(store, e.step)
                rows.append(
                    {"step": e.step, "bytes": m.bytes, "time": m.time, "metrics": m.metrics}
                )
            except CheckpointError as exc:
                rows.append({"step": e.step, "error": str(exc)})
        if args.json:
            print(json.dumps(rows))
        elif not rows:
            print(f"no committed checkpoints in {store.uri}")
        else:
            print(f"{'STEP':>10}  {'BYTES':>14}  {'WRITTEN':20}  METRICS")
            for r in rows:
                if "error" in r:
                    print(f"{r['step']:>10}  {'corrupt':>14}  {r['error']}")
                    continue
                metrics = " ".join(f"{k}={v:.4g}" for k, v in r["metrics"].items() if v is not None)
                print(f"{r['step']:>10}  {r['bytes']:>14,}  {_when(r['time']):20}  {metrics}")
        return 0
    if args.action == "verify":
        from runner.checkpoint import verify

        steps = [args.step] if args.step is not None else [e.step for e in entries]
        if not steps:
            print(f"no committed checkpoints in {store.uri}")
            return EXIT_FAILED
        bad = 0
        for step in steps:
            problems = verify(store, step)
            bad += bool(problems)
            print(f"step {step}: " + ("ok" if not problems else "; ".join(problems)))
        return EXIT_FAILED if bad else 0
    best = args.keep_best or (None, "min", 1)
    policy = RetentionPolicy(
        keep_last=args.keep_last,
        keep_every_steps=args.keep_every,
        keep_best_metric=best[0],
        keep_best_mode=best[1],
        keep_best_count=best[2],
        max_age_s=args.max_age,
    )
    result = prune(store, policy, now=time.time(), dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} {len(result.deleted)} checkpoint(s) {list(result.deleted)} and "
        f"{len(result.torn)} torn save(s) {list(result.torn)}, {result.bytes_freed:,} bytes; "
        f"kept {list(result.kept)}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    # Before anything else: from here on a SIGTERM to ``exec`` is a preemption notice.
    early = EarlyNotice().install() if args_in[:1] == ["exec"] else None
    logging.basicConfig(
        level=env.LOG_LEVEL.get().upper(),
        format="trainbot-runner: %(levelname)s %(message)s",
    )
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        if early is not None:
            early.uninstall(redeliver=True)
        raise
    try:
        if args.cmd == "exec":
            try:
                return _exec(args, early)
            finally:
                if early is not None:
                    early.uninstall(redeliver=False)
        if args.cmd == "dry-run":
            return _dry_run(args)
        if args.cmd == "credentials":
            return _credentials()
        if args.cmd == "pack":
            return _pack(args)
        return _checkpoints(args)
    except RunnerError as exc:
        print(f"trainbot-runner: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug, not bad input: say so without a traceback
        logging.getLogger(__name__).debug("unexpected error", exc_info=True)
        print(
            f"trainbot-runner: unexpected error: {type(exc).__name__}: {exc} "
            "(run with TRAINBOT_LOG_LEVEL=DEBUG for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
