"""Read a llama-server log and say why requests failed with "Context size has been exceeded".

The face of ``launcher.reports.diagnose.scanner`` while the module is split.
"""

from launcher.reports.diagnose.scanner import (
    _AFTER,
    _ANCHOR_HITS_PER_BLOCK,
    _BEFORE,
    BLOCK,
    KEEP,
    Config,
    Failure,
    FailureClass,
    Fix,
    MemoryCost,
    Report,
    Step,
    _Scanner,
    diagnose,
    journal,
    shared_pool_fixes,
    too_long_fixes,
)

__all__ = [
    "BLOCK",
    "KEEP",
    "_AFTER",
    "_ANCHOR_HITS_PER_BLOCK",
    "_BEFORE",
    "Config",
    "Failure",
    "FailureClass",
    "Fix",
    "MemoryCost",
    "Report",
    "Step",
    "_Scanner",
    "diagnose",
    "journal",
    "shared_pool_fixes",
    "too_long_fixes",
]
