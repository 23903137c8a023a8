"""Read a llama-server log and say why requests failed with "Context size has been exceeded".

The troubleshooting checklist as code: count the error, read the last startup line as a
promise (n_slots x n_ctx_slot against the pool, via ``launcher.server.kvlayout``), group each
batch-halving cascade with the failure it ends in, add up the ``slot release`` lines that
follow it, classify the failure and name the exact ``llama-launcher set`` line that fixes it.

The face of the package: ``diagnose`` (a log stream to a ``Report``), ``journal`` (a unit's
journal as that stream) and what a report holds. Its modules, in the order a log goes
through them:

- ``blocks``: the log as blocks of whole lines, and where in a block the lines that matter lie;
- ``reader``: the windows of each block fed to the scanner; ``diagnose`` and ``journal``;
- ``scanner``: the state machine that groups the lines into failures, rejections, startups;
- ``startup``: the startup read as a promise (``Config``), from the boot facts;
- ``verdicts``: the class of each failure, the fixes sized from the promise, the verdicts;
- ``report``: what a diagnosis finds and returns.
"""

from launcher.reports.diagnose.blocks import BLOCK
from launcher.reports.diagnose.reader import diagnose, journal
from launcher.reports.diagnose.report import (
    KEEP,
    Config,
    Failure,
    FailureClass,
    Fix,
    MemoryCost,
    Rejection,
    Report,
    SlotShare,
    Step,
    Verdict,
)
from launcher.reports.diagnose.verdicts import shared_pool_fixes, too_long_fixes

__all__ = [
    "BLOCK",
    "KEEP",
    "Config",
    "Failure",
    "FailureClass",
    "Fix",
    "MemoryCost",
    "Rejection",
    "Report",
    "SlotShare",
    "Step",
    "Verdict",
    "diagnose",
    "journal",
    "shared_pool_fixes",
    "too_long_fixes",
]
