"""The parts of the production path that need no booted systemd: the hardened unit's text,
the boot-time revert of ``prestart`` on real files, the launcher reading its credentials,
what the service user can read (checked by the kernel through setpriv, as root), and the
newcomer's refusals that come before anything is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Host

from launcher import config
from launcher.config import validate
from launcher.deploy import defaults
from launcher.errors import ConfigInvalid, ValidationFailed
from launcher.host import launch, service, units
from launcher.host.systemd import Systemd
from launcher.install import install, prestart

# -- the unit --------------------------------------------------------------------------------


def test_system_unit_runs_as_a_dynamic_user_with_the_gpu_classes_only() -> None:
    text = units.render()
    for line in (
        "DynamicUser=yes",
        "DevicePolicy=closed",
        "DeviceAllow=char-nvidia-frontend rw",
        "DeviceAllow=char-kfd rw",
        "SupplementaryGroups=render video",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "CapabilityBoundingSet=",
        "SystemCallFilter=@system-service",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "UMask=0077",
    ):
        assert f"\n{line}\n" in text, line
    assert "\nPrivateDevices=" not in text


def test_user_unit_keeps_the_light_hardening_a_user_manager_can_apply() -> None:
    text = units.render(scope="user")
    assert "DynamicUser" not in text and "LoadCredential" not in text
    assert "ExecStartPre" not in text  # the user-scope unit starts as it always did


def test_site_settings_are_rendered_into_the_unit() -> None:
    site = units.Site(
        groups=("video",),
        read_only_paths=("/tmp/models",),
        memory_deny_write_execute=False,
        nice=True,
    )
    text = units.render(site=site)
    assert "\nSupplementaryGroups=video\n" in text
    assert "\nBindReadOnlyPaths=/tmp/models\n" in text
    assert "\nMemoryDenyWriteExecute=yes\n" not in text
    assert "\nAmbientCapabilities=CAP_SYS_NICE\n" in text and "@resources" not in text


def test_an_instances_own_site_settings_go_to_its_drop_in() -> None:
    shared = units.Site(groups=("video",))
    own = units.Site(
        groups=("video",), read_only_paths=("/tmp/m",), memory_deny_write_execute=False
    )
    text = units.site_dropin(own, shared)
    assert text is not None
    assert "\nBindReadOnlyPaths=/tmp/m\n" in text and "\nMemoryDenyWriteExecute=no\n" in text
    assert units.site_dropin(shared, shared) is None  # the template's own: no drop-in


def test_the_service_view_reads_drop_ins_and_files_about_to_be_written(tmp_path: Path) -> None:
    template = tmp_path / "llama-server@.service"
    template.write_text(units.render(template=True))
    dropin = tmp_path / "llama-server@a.service.d" / units.SITE_DROPIN
    dropin.parent.mkdir()
    dropin.write_text(
        units.site_dropin(units.Site(read_only_paths=("/tmp/m",)), units.Site()) or ""
    )
    a = service.view(template, "llama-server@a.service")
    assert a is not None and a.bound == ("/tmp/m",)
    assert a.state_dirs == ("/var/lib/llama-server@a",)  # %i is the instance
    b = service.view(template, "llama-server@b.service")
    assert b is not None and b.bound == ()
    plain = tmp_path / "llama-server.service"
    assert service.view(plain, plain.name) is None  # not installed
    pending = service.view(plain, plain.name, {plain: units.render()})
    assert pending is not None and pending.state_dirs == ("/var/lib/llama-server",)


def test_shipped_units_name_debian_12s_package_folders() -> None:
    text = units.default_files()["llama-server.service"]
    assert (
        "PYTHONPATH=/usr/local/lib/python3.11/dist-packages:/usr/lib/python3/dist-packages" in text
    )


def test_a_hand_edit_is_told_apart_from_a_rendering() -> None:
    text = units.stamp(units.render())
    assert not units.hand_edited(text)
    assert units.hand_edited(text.replace("RestartSec=2", "RestartSec=7"))
    assert units.hand_edited("[Service]\nExecStart=/bin/true\n")  # not written by install
    assert not units.hand_edited(units.render())  # a rendering from before the stamp


def test_install_writes_the_unit_atomically_and_refuses_a_hand_edit(tmp_path: Path) -> None:
    unit = tmp_path / "llama-server.service"
    assert install.write_unit(unit, units.render())
    unit.write_text(unit.read_text().replace("RestartSec=2", "RestartSec=7"))
    with pytest.raises(ConfigInvalid, match=r"edited by hand.*--force"):
        install.write_unit(unit, units.render())
    assert "RestartSec=7" in unit.read_text()
    assert install.write_unit(unit, units.render(), force=True)
    assert not units.hand_edited(unit.read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["llama-server.service"]  # no temp file left


# -- prestart: the revert before every start -------------------------------------------------


def _pending(tmp_path: Path, phase: str = "gate", old: str | None = "OLD\n") -> tuple[Path, Path]:
    env, state = tmp_path / "x.env", tmp_path / "state"
    state.mkdir()
    env.write_text("NEW\n")
    os.chmod(env, 0o640)
    (state / "txn.json").write_text(
        json.dumps({"phase": phase, "from": 1, "to": 2, "old_text": old})
    )
    return env, state


def test_prestart_restores_the_previous_env_file_of_a_dead_deployer(tmp_path: Path) -> None:
    env, state = _pending(tmp_path)
    done = prestart.revert_pending(env, state)
    assert env.read_text() == "OLD\n"
    assert oct(env.stat().st_mode & 0o777) == "0o640"  # owner and mode kept
    assert done and "restored the env file of generation 1" in done
    assert json.loads((state / "txn.json").read_text())["reverted_at_start"] is True


def test_prestart_leaves_a_live_deployers_transaction_alone(tmp_path: Path) -> None:
    import fcntl

    env, state = _pending(tmp_path)
    with open(state / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert prestart.revert_pending(env, state) is None
    assert env.read_text() == "NEW\n"


def test_prestart_refuses_to_start_a_first_deploy_that_was_interrupted(tmp_path: Path) -> None:
    env, state = _pending(tmp_path, old=None)
    argv = ["prestart", "--env-file", str(env), "--state-dir", str(state)]
    rc = subprocess.run(
        [sys.executable, "-S", "-m", "launcher", *argv],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": units.this_python()[1]},
    )
    assert rc.returncode == 78, rc.stderr
    assert "no earlier config to start" in rc.stderr and env.read_text() == "NEW\n"


def test_prestart_stages_the_key_file_for_the_credential(tmp_path: Path) -> None:
    key = tmp_path / "old.key"
    key.write_text("sk-1\n")
    os.chmod(key, 0o600)
    env = tmp_path / "x.env"
    env.write_text(f'LLAMA_SERVER="/bin/true"\nEXTRA_ARGS="-m /m"\nAPI_KEY_FILE="{key}"\n')
    stage = tmp_path / "api-key"
    prestart.stage_key(env, stage)
    assert stage.read_text() == "sk-1\n" and oct(stage.stat().st_mode & 0o777) == "0o600"
    env.write_text('LLAMA_SERVER="/bin/true"\nEXTRA_ARGS="-m /m"\n')
    prestart.stage_key(env, stage)
    assert stage.read_bytes() == b""


def test_exec_reads_its_credentials_in_place_of_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "env-file").write_text(
        'LLAMA_SERVER="/bin/true"\nEXTRA_ARGS="-m /m"\nAPI_KEY_FILE="/root/k"\n'
    )
    (creds / "api-key").write_text("sk\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    argv = launch.read_argv("/etc/llama-launcher/unreadable.env")
    assert argv[-2:] == ["--api-key-file", str(creds / "api-key")]


# -- what the service user can read ----------------------------------------------------------


def _cfg(tmp: Path, model: Path, **more: object) -> config.ServerConfig:
    return config.build({"llama_server": "/bin/true", "model": model, **more})


def _view(tmp_path: Path) -> service.ServiceView:
    return service.ServiceView(tmp_path / "llama-server.service", ("video",))


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A folder anyone may enter (tmp_path itself is 0700), outside /tmp's PrivateTmp."""
    folder = Path("/dev/shm") / f"llama-launcher-svc-{os.getpid()}-{tmp_path.name}"
    folder.mkdir(mode=0o755)
    yield folder
    import shutil

    shutil.rmtree(folder)


def _package(root: Path) -> Path:
    """A copy of where a unit imports the launcher from: ``root/launcher/host/launch.py``."""
    (root / "launcher" / "host").mkdir(parents=True)
    (root / "launcher" / "host" / "launch.py").write_text("")
    os.chmod(root / "launcher" / "host" / "launch.py", 0o644)
    return root


def test_the_package_the_unit_runs_from_is_read_from_its_pythonpath(
    shared: Path, tmp_path: Path
) -> None:
    package = _package(shared / "site")
    unit = tmp_path / "llama-server.service"
    unit.write_text(f"[Service]\nEnvironment=PYTHONPATH=/nonexistent:{package}\nDynamicUser=yes\n")
    settings = config.ToolSettings(scope="system", unit_dir=tmp_path)
    svc = defaults.target(settings, tmp_path / "state", Systemd(settings.unit_name)).view
    assert svc is not None and svc.package == str(package)


def test_a_launcher_package_in_a_folder_the_service_cannot_enter_is_refused(
    shared: Path, tmp_path: Path
) -> None:
    """A checkout in a 0700 folder (what ``mktemp -d`` makes): the unit would exit 1 with
    no log line; validation names the folder and the fix instead."""
    private = shared / "checkout"
    package = _package(private / "repo")
    os.chmod(private, 0o700)
    model = shared / "m.gguf"
    model.write_bytes(b"GGUF")
    os.chmod(model, 0o644)
    svc = service.ServiceView(tmp_path / "llama-server.service", ("video",), (), str(package))
    with pytest.raises(ValidationFailed, match=rf"launcher package .*chmod o\+x {private} "):
        service.check(svc, validate.files_of(_cfg(tmp_path, model)))


def test_a_pythonpath_folder_the_service_can_enter_but_not_list_is_refused(
    shared: Path, tmp_path: Path
) -> None:
    """o+x alone lets the service open launch.py by name, but Python lists a PYTHONPATH
    folder to import from it: the unit would exit 1 with no log line."""
    package = _package(shared / "repo")
    os.chmod(package, 0o701)
    model = shared / "m.gguf"
    model.write_bytes(b"GGUF")
    os.chmod(model, 0o644)
    svc = service.ServiceView(tmp_path / "llama-server.service", (), (), str(package))
    with pytest.raises(ValidationFailed, match=rf"launcher package folder .*chmod o\+r {package}"):
        service.check(svc, validate.files_of(_cfg(tmp_path, model)))


def test_a_launcher_package_under_tmp_is_refused_for_private_tmp(tmp_path: Path) -> None:
    package = _package(tmp_path / "repo")
    svc = service.ServiceView(tmp_path / "llama-server.service", (), (), str(package))
    with pytest.raises(ValidationFailed, match=r"launcher package .* PrivateTmp=yes"):
        service.check(svc, validate.files_of(_cfg(tmp_path, Path("/dev/null"))))


def test_a_world_readable_model_passes(shared: Path, tmp_path: Path) -> None:
    model = shared / "m.gguf"
    model.write_bytes(b"GGUF")
    os.chmod(model, 0o644)
    service.check(_view(tmp_path), validate.files_of(_cfg(tmp_path, model)))


def test_a_model_only_root_can_read_is_refused_with_chmod(shared: Path, tmp_path: Path) -> None:
    model = shared / "m.gguf"
    model.write_bytes(b"GGUF")
    os.chmod(model, 0o600)
    with pytest.raises(
        ValidationFailed, match=rf"model {model} is -rw------- root:root.*chmod o\+r {model}"
    ):
        service.check(_view(tmp_path), validate.files_of(_cfg(tmp_path, model)))


def test_a_folder_the_service_cannot_enter_is_named(shared: Path, tmp_path: Path) -> None:
    inner = shared / "private"
    inner.mkdir(mode=0o700)
    lora = inner / "a.gguf"
    lora.write_bytes(b"GGUF")
    os.chmod(lora, 0o644)
    model = shared / "m.gguf"
    model.write_bytes(b"GGUF")
    os.chmod(model, 0o644)
    cfg = _cfg(tmp_path, model, extra_args=("--lora", str(lora)))
    with pytest.raises(
        ValidationFailed, match=rf"LoRA adapter {lora}.*folder {inner}.*chmod o\+x {inner}"
    ):
        service.check(_view(tmp_path), validate.files_of(cfg))


def test_a_model_under_tmp_is_refused_for_private_tmp(tmp_path: Path) -> None:
    with pytest.raises(ValidationFailed, match="PrivateTmp=yes"):
        service.check(_view(tmp_path), validate.files_of(_cfg(tmp_path, tmp_path / "m.gguf")))


def test_a_folder_bound_into_the_service_is_not_hidden(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    svc = service.ServiceView(tmp_path / "u.service", (), (str(tmp_path),))
    with pytest.raises(ValidationFailed) as e:  # visible now, but tmp_path is 0700
        service.check(svc, validate.files_of(_cfg(tmp_path, model)))
    assert "PrivateTmp" not in str(e.value) and "chmod o+x" in str(e.value)


# -- newcomer refusals -----------------------------------------------------------------------


def test_a_relative_model_path_is_refused_with_the_absolute_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match=r"'m\.gguf' is a relative path.*absolute path"):
        config.build({"llama_server": "/bin/true", "model": "m.gguf"})


def test_user_scope_without_linger_is_refused_saying_what_logout_does(host: Host) -> None:
    p = host.cli(
        "install",
        *host.base_flags(),
        "--json",
        env={"XDG_RUNTIME_DIR": f"/run/user/{os.geteuid()}"},
    )
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 2, out
    assert "without linger" in out["message"] and "loginctl enable-linger" in out["message"]
    assert not host.env_file.exists()


def test_set_where_the_unit_is_not_installed_is_refused_before_anything(host: Host) -> None:
    p = host.cli("set", "-c", "4096", "--json")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 2, out
    assert "is not installed in user scope" in out["message"]
    assert not host.state_dir.exists()
