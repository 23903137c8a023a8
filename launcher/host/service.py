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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import CommandError, ValidationFailed
from launcher.host import proc, units

#: A uid the dynamic user range (61184-65519) never hands out, owning nothing: the service's
#: stand-in for the kernel's permission check.
PROBE_UID = 61183
#: Folders the unit's sandbox replaces with the service's own (PrivateTmp=yes).
PRIVATE = units.PRIVATE_TMP


@dataclass(frozen=True)
class ServiceView:
    """What the installed unit gives its service: groups, and folders bound read-only."""

    unit_file: Path
    groups: tuple[str, ...] = ()
    bound: tuple[str, ...] = ()
    #: the folder the unit's ExecStart imports the launcher package from (its PYTHONPATH)
    package: str | None = None
    #: the service's own folders, ``StateDirectory=`` under /var/lib: systemd makes them at
    #: start, owned by the service's user, and they are writable under ProtectSystem=strict
    state_dirs: tuple[str, ...] = ()
    #: ``ReadWritePaths=``: other folders the sandbox leaves writable (if their modes let it)
    writable: tuple[str, ...] = ()


#: Settings whose assignments add to a list (an empty assignment resets it), as systemd reads
#: them (systemd.exec(5)).
_LISTS = ("SupplementaryGroups", "BindReadOnlyPaths", "Environment", "StateDirectory",
          "ReadWritePaths")  # fmt: skip


def dropins(unit_file: Path, unit_name: str | None = None) -> list[Path]:
    """The drop-ins systemd reads beside ``unit_file`` for ``unit_name`` (an instance of a
    template reads the template's ``NAME@.service.d/`` and its own), in systemd's order: by
    file name, an instance's file replacing the template's of the same name."""
    folders = [unit_file.parent / f"{unit_file.name}.d"]
    if unit_name and unit_name != unit_file.name:
        folders.append(unit_file.parent / f"{unit_name}.d")
    found: dict[str, Path] = {}
    for folder in folders:
        try:
            found.update({p.name: p for p in folder.glob("*.conf")})
        except OSError:
            continue
    return [found[name] for name in sorted(found)]


def view(
    unit_file: Path,
    unit_name: str | None = None,
    pending: Mapping[Path, str | None] | None = None,
) -> ServiceView | None:
    """The view of the system unit installed as ``unit_file`` (with its drop-ins, for the
    instance ``unit_name`` of a template), or as it will be: ``pending`` holds files about
    to be written (None: about to be removed). None when it does not run as a dynamic user
    (it reads as root then) or is not installed."""
    pending = dict(pending or {})
    files = [unit_file, *dropins(unit_file, unit_name)]
    files += sorted((p for p in pending if p not in files and p != unit_file), key=lambda p: p.name)
    texts = []
    for path in files:
        if path in pending:
            text = pending[path]
        else:
            try:
                text = path.read_text()
            except OSError:
                text = None
        if text is None and path == unit_file:
            return None
        if text is not None:
            texts.append(text)
    return view_of_text("\n".join(texts), unit_file, _instance(unit_name))


def _instance(unit_name: str | None) -> str | None:
    """``chat`` of ``llama-server@chat.service``: what ``%i`` stands for."""
    if not unit_name or "@" not in unit_name:
        return None
    return unit_name.split("@", 1)[1].rsplit(".", 1)[0] or None


def view_of_text(text: str, unit_file: Path, instance: str | None = None) -> ServiceView | None:
    """The view of a unit's text (its drop-ins appended); ``instance`` replaces ``%i``."""
    values: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if not eq or line.startswith(("#", ";")):
            continue
        key = key.strip()
        if instance is not None:
            value = value.replace("%i", instance)
        if key in _LISTS and not value.strip():
            values[key] = []  # an empty assignment resets the list
            continue
        values.setdefault(key, []).extend(value.split())
    if values.get("DynamicUser", [""])[-1] not in ("yes", "true", "1", "on"):
        return None
    return ServiceView(
        unit_file,
        tuple(values.get("SupplementaryGroups", ())),
        tuple(p.split(":", 1)[0].lstrip("-") for p in values.get("BindReadOnlyPaths", ())),
        _package_dir(values.get("Environment", [])),
        tuple(f"/var/lib/{d.split(':', 1)[0]}" for d in values.get("StateDirectory", ())),
        tuple(p.lstrip("-+") for p in values.get("ReadWritePaths", ())),
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
    unreadable = _probe(svc, [("-x" if w == "llama-server binary" else "-r", p) for w, p in files])
    for what, path in files:
        if str(path) in unreadable:
            raise ValidationFailed("service", _why(what, path, svc))


def _probe(svc: ServiceView, files: list[tuple[str, Path]]) -> set[str]:
    """The paths the probe uid fails a ``test`` on (``-r`` read, ``-x`` execute or enter, ``-w``
    write), by the kernel's own check."""
    script = 'while [ $# -gt 0 ]; do test "$1" "$2" || printf "%s\\0" "$2"; shift 2; done'
    args = [a for op, p in files for a in (op, str(p))]
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


def check_writable(svc: ServiceView, what: str, path: Path) -> None:
    """Refuse (step ``service``) a folder the service must write (``--slot-save-path``) but
    cannot: under ``ProtectSystem=strict`` only its ``StateDirectory=`` (made by systemd at
    start, its user's) and ``ReadWritePaths=`` are writable, and a folder under /tmp is the
    service's own, emptied at every restart (``PrivateTmp=yes``)."""
    p = str(path)
    if any(_under(p, d) or _under(p, _private(d)) for d in svc.state_dirs):
        return
    own = svc.state_dirs[0] if svc.state_dirs else None
    fix = (
        f"use the service's own folder {own} (leave the flag out: the deploy passes it), or "
        if own
        else ""
    ) + (
        f"let the service write {p} with a drop-in (systemctl edit {svc.unit_file.name}: "
        f"ReadWritePaths={p})"
    )
    if not any(_under(p, w) for w in svc.writable):
        hidden = next((f for f in PRIVATE if _under(p, f)), None)
        why = (
            f"is under {hidden}, which is the service's own (PrivateTmp=yes), emptied at "
            "every restart"
            if hidden
            else "is read-only for the service (ProtectSystem=strict)"
        )
        raise ValidationFailed("service", f"the {what} {p} {why}; {fix}")
    if not path.is_dir():
        raise ValidationFailed("service", f"the {what} {p} is not a folder; make it (mkdir -p {p})")
    if _probe(svc, [("-w", path), ("-x", path)]):
        raise ValidationFailed(
            "service",
            f"the {what} {p} is {_owner(path.stat())}: llama-server's user cannot write it "
            f"(a dynamic user that owns no file, see {svc.unit_file}); {fix}",
        )


def _private(state_dir: str) -> str:
    """Where a dynamic user's ``StateDirectory=`` really is (``/var/lib/X`` is a link)."""
    return state_dir.replace("/var/lib/", "/var/lib/private/", 1)


def can_run(path: str, groups: tuple[str, ...] = ()) -> bool:
    """Whether the service's user can execute ``path`` (an interpreter for the unit)."""
    return not _probe(ServiceView(Path(path), groups), [("-x", Path(path))])


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
