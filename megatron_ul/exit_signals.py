"""SIGTERM and SIGUSR1 remembered from the first line of pretrain_gpt.py on.

Slurm may signal the ranks at any moment: the time-limit warning (#SBATCH --signal=USR1@T),
preemption, scancel. A signal that arrives while torch is imported or the flags are parsed
would kill a rank with status 143 (SIGTERM's default), and the batch script would not requeue.
So pretrain_gpt.py installs this handler before it imports anything heavy (this module imports
only the standard library); with --exit-signal-handler training acts on the signal at the end
of the current iteration (training/exit.py: save, exit 0, the script requeues), without it the
signal takes its default effect once the flags say so (``release_unless``).
"""

from __future__ import annotations

import signal
import sys

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_signal_received: str | None = None  # the name of the first exit signal received


def _remember_signal(signum, frame) -> None:
    global _signal_received
    _signal_received = _signal_received or signal.Signals(signum).name


def catch_exit_signals() -> dict:
    """Remember SIGTERM/SIGUSR1 instead of dying. Returns the handlers it replaced."""
    previous = {sig: signal.signal(sig, _remember_signal) for sig in EXIT_SIGNALS}
    return {sig: h for sig, h in previous.items() if h is not _remember_signal}


def signal_received() -> str | None:
    """The name of the first exit signal received (None: none yet)."""
    return _signal_received


def forget_signal() -> None:
    global _signal_received
    _signal_received = None


def release_unless(exit_signal_handler: bool) -> None:
    """After the flags are parsed: without --exit-signal-handler the signals regain their
    default effect, and one that arrived during start-up takes it now (Megatron-LM's behaviour
    without the flag); with it, they stay remembered for the training loop."""
    if exit_signal_handler:
        return
    for sig in EXIT_SIGNALS:
        if signal.getsignal(sig) is _remember_signal:
            signal.signal(sig, signal.SIG_DFL)
    if _signal_received is not None:
        print(
            f"{_signal_received} received during start-up (no --exit-signal-handler): exiting",
            file=sys.stderr,
            flush=True,
        )
        signal.raise_signal(signal.Signals[_signal_received])
