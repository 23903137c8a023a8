"""The verbs a unit runs at every start: ``exec`` (its ExecStart) and ``prestart`` (its
ExecStartPre). ``launcher.__main__`` hands them their arguments before the CLI is loaded
(they stay standard-library only); these are their entries in ``--help`` and in
``launcher.cli.main``, which hand the same arguments on."""

from __future__ import annotations

import argparse


def cmd_exec(ns: argparse.Namespace) -> int:
    from launcher.host import launch

    return launch.main(
        [
            "--env-file",
            ns.env_file,
            *(["--port", ns.port] if ns.port else []),
            *(["--print-argv"] if ns.print_argv else []),
        ]
    )


def cmd_prestart(ns: argparse.Namespace) -> int:
    from launcher.install import prestart

    given = {"--lock": ns.lock, "--stage-key": ns.stage_key}
    return prestart.main(
        [
            "--env-file",
            ns.env_file,
            "--state-dir",
            ns.state_dir,
            *(word for name, value in given.items() if value for word in (name, value)),
        ]
    )
