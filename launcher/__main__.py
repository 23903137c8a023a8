"""``llama-launcher`` / ``python -m launcher``.

``exec`` (the unit's ExecStart) is dispatched before anything heavy is imported: it runs on
every server start and must stay standard-library only. Every other verb goes to the CLI.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Console-script entry point."""
    args = sys.argv[1:]
    if args[:1] == ["exec"]:
        from launcher import launch

        raise SystemExit(launch.main(args[1:]))
    from launcher.cli import main as cli_main

    raise SystemExit(cli_main(args))


if __name__ == "__main__":
    main()
