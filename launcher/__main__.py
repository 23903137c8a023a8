"""``llama-launcher`` / ``python -m launcher``.

``exec`` (the unit's ExecStart) and ``prestart`` (its ExecStartPre) are dispatched before
anything heavy is imported: they run on every server start and must stay standard-library
only. Every other verb goes to the CLI, which ends without the interpreter's teardown:
freeing pydantic-settings', httpx's and sh's objects is a noticeable part of a short verb
(``scripts/bench-imports`` measures it), time every command would add for nothing.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Console-script entry point."""
    args = sys.argv[1:]
    if args[:1] == ["exec"]:
        from launcher.host import launch

        raise SystemExit(launch.main(args[1:]))
    if args[:1] == ["prestart"]:
        from launcher.install import prestart

        raise SystemExit(prestart.main(args[1:]))
    from launcher.cli import main as cli_main

    try:
        code = cli_main(args)
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # `llama-launcher ... | head`: the reader has what it wanted
        code = 128 + 13  # as if killed by SIGPIPE, like the tools it is piped with
    # the readers proc.end killed, if a command ran any (a verb that ran none, such as
    # `diagnose --log`, never imports the subprocess chokepoint)
    proc = sys.modules.get("launcher.host.proc")
    if proc is not None:
        proc.reap()
    os._exit(code)


if __name__ == "__main__":
    main()
