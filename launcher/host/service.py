"""What the hardened unit's service user can read: proved before a deploy touches anything.

In system scope llama-server runs as a dynamic user (``DynamicUser=yes``): a uid that owns
no file, in no group but the unit's ``SupplementaryGroups=``, with its own /tmp and /var/tmp
(``PrivateTmp=yes``). A model only root can read, or one under /tmp, loads fine in ``check``
and then fails at start. So every file llama-server opens is checked the way the kernel will
check it: one ``setpriv`` process as such a uid runs ``test -r``/``test -x`` on all of them,
and each refusal names the path, the folder or mode that stops the service, and the fix.
The env file and the API key are not among them: PID 1 reads those as root and hands them
over as credentials (``LoadCredential=``).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import CommandError, ValidationFailed
from launcher.host import proc

#: A uid the dynamic user range (61184-65519) never hands out, owning nothing: the service's
#: stand-in for the kernel's permission check.
PROBE_UID = 61183
#: Folders the unit's sandbox replaces with the service's own (PrivateTmp=yes).
PRIVATE = ("/tmp", "/var/tmp")


@dataclass(frozen=True)
class ServiceView:
    """What the installed unit gives its service: groups, and folders bound read-only."""

    unit_file: Path
    groups: tuple[str, ...] = ()
    bound: tuple[str, ...] = ()
    #: the folder the unit's ExecStart imports the launcher package from (its PYTHONPATH)
    package: str | None = None


def view(unit_file: Path) -> ServiceView | None:
    """The view of the system unit installed as ``unit_file``; None when it does not run as a
    dynamic user (it reads as root then) or is not installed."""
    try:
        text = unit_file.read_text()
    except OSError:
        return None
    values: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq and not line.startswith("#"):
            values.setdefault(key.strip(), []).extend(value.split())
    if values.get("DynamicUser", [""])[-1] not in ("yes", "true", "1", "on"):
        return None
    return ServiceView(
        unit_file,
        tuple(values.get("SupplementaryGroups", ())),
        tuple(p.split(":", 1)[0].lstrip("-") for p in values.get("BindReadOnlyPaths", ())),
        _package_dir(values.get("Environment", [])),
    )


def _package_dir(environment: list[str]) -> str | None:
    """The first folder of the unit's ``PYTHONPATH`` that holds the launcher package."""
    paths = [a.partition("=")[2] for a in environment if a.startswith("PYTHONPATH=")]
    for folder in (f for p in paths for f in p.split(":") if f):
        if (Path(folder) / "launcher" / "host" / "launch.py").exists():
            return folder
    return None


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def check(svc: ServiceView, opened: list[tuple[str, Path]]) -> None:
    """Refuse (step ``service``) a file the service's user will not be able to open: those
    llama-server opens (``opened``: what each is, its path; the binary named
    ``llama-server binary``), and the launcher package the unit's ExecStart runs from."""
    files = list(opened)
    if svc.package is not None:
        # Python lists a PYTHONPATH folder to import from it: read, not only enter
        files.append(("launcher package folder (the unit's PYTHONPATH)", Path(svc.package)))
        package = Path(svc.package) / "launcher" / "host" / "launch.py"
        files.append(("launcher package (the unit's ExecStart)", package))
    for what, path in files:
        p = str(path)
        hidden = next((f for f in PRIVATE if _under(p, f)), None)
        if hidden and not any(_under(p, b) for b in svc.bound):
            raise ValidationFailed(
                "service",
                f"the {what} {p} is under {hidden}, which the unit's PrivateTmp=yes replaces "
                f"with the service's own empty {hidden}: llama-server would not find it. Move "
                f"it (e.g. to /srv/models), or bind its folder into the service: "
                f"llama-launcher install --read-only-path {path.parent} ...",
            )
    unreadable = _probe(svc, [(w == "llama-server binary", p) for w, p in files])
    for what, path in files:
        if str(path) in unreadable:
            raise ValidationFailed("service", _why(what, path, svc))


def _probe(svc: ServiceView, files: list[tuple[bool, Path]]) -> set[str]:
    """The paths the probe uid cannot read (or execute), by the kernel's own check."""
    script = 'while [ $# -gt 0 ]; do test "$1" "$2" || printf "%s\\0" "$2"; shift 2; done'
    args = [a for is_exec, p in files for a in ("-x" if is_exec else "-r", str(p))]
    groups = [g for g in svc.groups if _gid(g) is not None]
    argv = ["setpriv", f"--reuid={PROBE_UID}", f"--regid={PROBE_UID}"]
    argv += [f"--groups={','.join(groups)}"] if groups else ["--clear-groups"]
    try:
        r = proc.run([*argv, "--", "sh", "-c", script, "sh", *args], timeout=10, env={})
    except CommandError as e:
        raise ValidationFailed(
            "service", f"could not check what the service's user can read: {e}"
        ) from e
    return {p for p in r.stdout.split("\0") if p}


def can_run(path: str, groups: tuple[str, ...] = ()) -> bool:
    """Whether the service's user can execute ``path`` (an interpreter for the unit)."""
    return not _probe(ServiceView(Path(path), groups), [(True, Path(path))])


def _gid(group: str) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{stat.filemode(st.st_mode)} {user}:{group}"


def _why(what: str, path: Path, svc: ServiceView) -> str:
    """Which folder or mode stops the service, and the fix."""
    who = (
        "the service runs as a dynamic user that owns no file"
        + (f" (groups: {' '.join(svc.groups)})" if svc.groups else "")
        + f", see {svc.unit_file}"
    )
    for folder in [*reversed(path.parents)][1:]:
        try:
            st = folder.stat()
        except OSError:
            continue
        if not st.st_mode & stat.S_IXOTH:
            return (
                f"the {what} {path} is not readable by llama-server's user: the folder "
                f"{folder} is {_owner(st)} and {who}, so it cannot enter it. Let it in: "
                f"chmod o+x {folder} (or keep the file where the service can reach it)"
            )
    try:
        st = path.stat()
    except OSError as e:
        return f"the {what} {path} cannot be read: {e.strerror}"
    need, flag = ("execute", "o+rx") if what == "llama-server binary" else ("read", "o+r")
    return (
        f"the {what} {path} is {_owner(st)}: llama-server's user cannot {need} it ({who}). "
        f"Fix: chmod {flag} {path}"
        + (f", or chgrp {svc.groups[0]} {path} && chmod g+r {path}" if svc.groups else "")
    )
