"""The typed config: flags -> config -> argv -> env text -> argv, refusals, and the chain."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import config
from launcher.config import validate
from launcher.errors import ConfigInvalid, OvercommitError, ValidationFailed
from launcher.host import launch
from launcher.server import binary

BASE = {"llama_server": "/usr/bin/llama-server", "model": "/m/model.gguf"}
HEAD = ["-m", "/m/model.gguf", "--host", "127.0.0.1", "--port", "8080"]
#: seed 000's fix: 4 slots, each guaranteed 262144, an 8-bit cache
SEED_FIX = (  # noqa: SIM905 - it reads like the seed's command line
    "-c 1048576 -np 4 -kvu --kv-unified-per-slot 262144 -ctk q8_0 -ctv q8_0"
).split()

# (flags given, args rendered after the fixed head)
CASES = [
    (["-c", "4096"], ["-c", "4096"]),
    (["--ctx-size", "4096"], ["-c", "4096"]),
    (["--ctx-size=4096"], ["-c", "4096"]),
    (["-np", "4"], ["-np", "4"]),
    (["--parallel", "-1"], ["-np", "-1"]),
    (["-kvu"], ["-kvu"]),
    (["--kv-unified"], ["-kvu"]),
    (["-no-kvu"], ["-no-kvu"]),
    (["--no-kv-unified"], ["-no-kvu"]),
    (
        ["-np", "4", "--kv-unified-per-slot", "1024"],
        ["-c", "4096", "-np", "4", "--kv-unified-per-slot", "1024"],
    ),
    (["-ctk", "q8_0"], ["-ctk", "q8_0"]),
    (["--cache-type-k", "q4_0"], ["-ctk", "q4_0"]),
    (["-ctv", "q8_0"], ["-ctv", "q8_0"]),
    (["--cache-type-v", "iq4_nl"], ["-ctv", "iq4_nl"]),
    (["-fa", "on"], ["-fa", "on"]),
    (["--flash-attn", "off"], ["-fa", "off"]),
    (["-ngl", "all"], ["-ngl", "all"]),
    (["--gpu-layers", "99"], ["-ngl", "99"]),
    (["--n-gpu-layers", "auto"], ["-ngl", "auto"]),
    (["-t", "8"], ["-t", "8"]),
    (["--threads", "-1"], ["-t", "-1"]),
    (["-b", "1024"], ["-b", "1024"]),
    (["--batch-size", "1024"], ["-b", "1024"]),
    (["-ub", "256"], ["-ub", "256"]),
    (["--ubatch-size", "256"], ["-ub", "256"]),
    (["-cram", "0"], ["-cram", "0"]),
    (["--cache-ram", "-1"], ["-cram", "-1"]),
    (["-a", "my model"], ["-a", "my model"]),
    (["--alias", "coder,chat"], ["-a", "coder,chat"]),
    (["-lm", "mmap+mlock"], ["-lm", "mmap+mlock"]),
    (["--load-mode", "none"], ["-lm", "none"]),
    (["--jinja"], ["--jinja"]),
    (["--no-jinja"], ["--no-jinja"]),
    (["--chat-template-file", "/t/x y.jinja"], ["--chat-template-file", "/t/x y.jinja"]),
    (["--metrics"], ["--metrics"]),
    (["--slots"], ["--slots"]),
    (["--no-slots"], ["--no-slots"]),
    (["--host", "0.0.0.0"], None),
    (["--port", "9000"], None),
    (["--swa-full", "--top-k", "1"], ["--swa-full", "--top-k", "1"]),
]


@pytest.mark.parametrize(("flags", "rendered"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_flags_to_argv_to_env_text_to_argv(
    flags: list[str], rendered: list[str] | None, tmp_path: Path
) -> None:
    cfg = config.from_flags(flags, BASE)
    argv = cfg.argv()
    if rendered is not None:
        assert argv == ["/usr/bin/llama-server", *HEAD, *rendered, "--log-colors", "off"]
    env = tmp_path / "x.env"
    env.write_text(config.render_env(cfg))
    assert launch.read_argv(str(env)) == argv


def test_render_is_deterministic() -> None:
    cfg = config.from_flags(["-c", "4096", "-a", "x"], BASE)
    assert config.render_env(cfg) == config.render_env(
        config.from_flags(["-a", "x", "-c", "4096"], BASE)
    )


def test_bad_cache_type_names_the_value_and_the_choices() -> None:
    with pytest.raises(ConfigInvalid) as e:
        config.from_flags(["-ctk", "q9_0"], BASE)
    assert "'q9_0' is not a KV cache type; use one of f32, f16, bf16, q8_0" in str(e.value)
    assert "(-ctk)" in str(e.value)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["-np", "0"], "-np 0 is out of range"),
        (["-np", "auto"], "-np 'auto' is not a whole number"),
        (["-c", "big"], "-c 'big' is not a whole number"),
        (["-ngl", "many"], "-ngl 'many' is not a number"),
        (["-lm", "fast"], "'fast' is not one of auto, none, mmap"),
        (["--port", "70000"], "port"),
        (["-c"], "-c needs a value"),
    ],
)
def test_bad_values_are_refused_with_the_value(flags: list[str], needle: str) -> None:
    with pytest.raises(ConfigInvalid) as e:
        config.from_flags(flags, BASE)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("word", "needle"),
    [
        ("-c", "is a typed flag; set ctx_size"),
        ("--port", "is a typed flag; set port"),
        ("-m", "is a typed flag; set model"),
        ("--api-key", "set api_key"),
        ("--api-key-file", "set api_key_file"),
    ],
)
def test_owned_flags_cannot_hide_in_extra_args(word: str, needle: str) -> None:
    with pytest.raises(ConfigInvalid) as e:
        config.build({**BASE, "extra_args": [word, "1"]})
    assert needle in str(e.value)


@pytest.mark.parametrize("flags", [["--api-key", "hunter2"], ["--api-key=hunter2"]])
def test_a_key_on_the_command_line_is_refused_without_echoing_it(flags: list[str]) -> None:
    with pytest.raises(ConfigInvalid) as e:
        config.from_flags(flags, BASE)
    assert "'--api-key' cannot go through extra_args" in str(e.value)
    assert "hunter2" not in str(e.value)


def test_control_characters_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigInvalid) as e:
        config.build({**BASE, "alias": "a\nb"})
    assert "alias" in str(e.value) and "control character" in str(e.value)


def test_api_key_is_masked_and_never_in_argv() -> None:
    cfg = config.build({**BASE, "api_key": "hunter2"})
    assert "hunter2" not in " ".join(cfg.argv())
    assert cfg.masked()["api_key"] == "***"
    assert "hunter2" not in repr(cfg)


def test_seed_fix_gives_four_guaranteed_262144_windows() -> None:
    cfg = config.from_flags(
        SEED_FIX,
        BASE,
    )
    plan = cfg.check_overcommit(n_ctx_train=262144)
    assert (plan.n_slots, plan.n_ctx_slot, plan.kv_unified) == (4, 262144, True)
    assert plan.n_ctx == 1048576
    assert plan.guaranteed_window == 262144
    assert not plan.overcommitted


def test_seed_original_is_refused_as_overcommitted_with_its_numbers() -> None:
    cfg = config.from_flags(["-c", "262144", "-np", "4", "-kvu"], BASE)
    with pytest.raises(OvercommitError) as e:
        cfg.check_overcommit(n_ctx_train=262144)
    msg = str(e.value)
    assert "4 slots x n_ctx_slot 262144 = 1048576 cells promised" in msg
    assert "unified pool holds 262144" in msg
    assert "only 65536 per slot is guaranteed" in msg
    assert "--kv-unified-per-slot 262144 -c 1048576 -ctk q8_0 -ctv q8_0" in msg
    assert "-np 4 -no-kvu" in msg


def test_allow_overcommit_accepts_the_risk() -> None:
    cfg = config.from_flags(["-c", "262144", "-np", "4", "-kvu", "--allow-overcommit"], BASE)
    assert cfg.check_overcommit(262144).overcommitted


def test_a_deploy_with_allow_overcommit_warns_with_the_pool_the_promise_and_what_comes() -> None:
    cfg = config.from_flags(["-c", "12288", "-np", "4", "-kvu", "--allow-overcommit"], BASE)
    text = config.overcommit_warning(cfg.check_overcommit(262144))
    assert "pool holds 12288 cells but promises 49152 (4 slots x 12288)" in text
    assert "only 3072 per slot is guaranteed" in text
    assert "every request in flight fails at once with 'Context size has been exceeded'" in text
    assert "set --kv-unified-per-slot 12288 -c 49152" in text


def test_set_replaces_and_unset_removes() -> None:
    cfg = config.from_flags(["-c", "4096", "--top-k", "5"], BASE)
    data = cfg.model_dump()
    again = config.from_flags(["-c", "8192", "--top-k", "7"], data)
    assert again.ctx_size == 8192 and again.extra_args == ("--top-k", "7")
    removed = config.build(config.remove_flags(again.model_dump(), ["-c", "--top-k"]))
    assert removed.ctx_size is None and removed.extra_args == ()
    with pytest.raises(ConfigInvalid, match="--top-p is not set"):
        config.remove_flags(again.model_dump(), ["--top-p"])


# -- against the installed llama-server ----------------------------------------------------


def real(llama_server_bin: str, model: Path, *flags: str) -> config.ServerConfig:
    return config.from_flags(list(flags), {"llama_server": llama_server_bin, "model": model})


def test_seed_fix_validates_through_every_step(llama_server_bin: str, make_model) -> None:  # type: ignore[no-untyped-def]
    model = make_model(ctx_train=262144)
    cfg = real(llama_server_bin, model, *SEED_FIX)
    checked = validate.validate(cfg)
    assert checked.steps == validate.STEPS
    assert checked.plan.guaranteed_window == 262144
    assert checked.values["EXTRA_ARGS"].endswith("-ctk q8_0 -ctv q8_0")


def test_unknown_flag_gets_a_did_you_mean(llama_server_bin: str, tiny_model: Path) -> None:
    cfg = real(llama_server_bin, tiny_model, "-c", "4096", "-np", "1", "--flash-atn", "on")
    with pytest.raises(ValidationFailed) as e:
        validate.validate(cfg)
    assert e.value.step == "flags"
    assert "--flash-atn is not a flag" in str(e.value)
    assert "did you mean --flash-attn" in str(e.value)


def test_missing_model_fails_the_model_step(llama_server_bin: str, tmp_path: Path) -> None:
    cfg = real(llama_server_bin, tmp_path / "gone.gguf", "-c", "4096", "-np", "1")
    with pytest.raises(ValidationFailed) as e:
        validate.validate(cfg)
    assert e.value.step == "model" and "gone.gguf does not exist" in str(e.value)


def test_a_file_that_is_not_gguf_fails_the_model_step(
    llama_server_bin: str, tmp_path: Path
) -> None:
    fake = tmp_path / "notes.gguf"
    fake.write_text("not a model")
    with pytest.raises(ValidationFailed) as e:
        validate.validate(real(llama_server_bin, fake, "-c", "4096", "-np", "1"))
    assert e.value.step == "model" and "not a GGUF" in str(e.value)


def test_binary_that_is_not_executable_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(ValidationFailed) as e:
        validate.validate(real(str(tmp_path / "llama-server"), tiny_model, "-c", "4096"))
    assert e.value.step == "llama-server"


def test_help_is_parsed_and_cached_per_binary(llama_server_bin: str, tmp_path: Path) -> None:
    info = binary.inspect(llama_server_bin, cache_dir=tmp_path)
    assert info.takes_value("--kv-unified-per-slot")
    assert info.knows("-no-kvu") and not info.knows("--no-mmap")
    assert list(tmp_path.glob("*.json"))
    again = binary.inspect(llama_server_bin, cache_dir=tmp_path)
    assert again.flags == info.flags


def test_every_typed_spelling_is_known_to_the_real_binary(llama_server_bin: str) -> None:
    info = binary.inspect(llama_server_bin)
    for flag in config.FLAGS:
        for spelling in (*flag.spellings, *flag.negative):
            assert info.knows(spelling), spelling


# -- tool settings -------------------------------------------------------------------------


def test_settings_precedence_cli_over_env_over_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "settings.toml"
    toml.write_text('unit = "from-toml"\nstart_timeout = 11\nlock_timeout = 3\n')
    monkeypatch.setenv("LLAMA_LAUNCHER_SETTINGS", str(toml))
    monkeypatch.delenv("LLAMA_LAUNCHER_UNIT", raising=False)
    monkeypatch.delenv("LLAMA_LAUNCHER_START_TIMEOUT", raising=False)
    monkeypatch.delenv("LLAMA_LAUNCHER_LOCK_TIMEOUT", raising=False)
    assert config.load_settings().unit == "from-toml"
    monkeypatch.setenv("LLAMA_LAUNCHER_UNIT", "from-env")
    monkeypatch.setenv("LLAMA_LAUNCHER_START_TIMEOUT", "22")
    s = config.load_settings(start_timeout=33.0)
    assert (s.unit, s.start_timeout, s.lock_timeout) == ("from-env", 33.0, 3.0)


def test_bad_setting_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_LAUNCHER_SCOPE", "galaxy")
    with pytest.raises(ConfigInvalid, match="scope"):
        config.load_settings()


def test_template_instance_reads_its_own_env_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_LAUNCHER_ENV_FILE", raising=False)
    s = config.load_settings(unit="llama-server@big", scope="user")
    assert s.unit_name == "llama-server@big.service"
    assert s.resolved_env_file().name == "big.env"  # the template's %i.env


@pytest.mark.parametrize("fit", [["--fit", "off"], ["-fit", "off"], ["--fit=off"]])
def test_fit_off_without_c_takes_the_training_context_for_all_streams(fit: list[str]) -> None:
    cfg = config.build({**BASE, "parallel": 4, "kv_unified": False, "extra_args": fit})
    plan = cfg.pool_plan(32768)
    assert (plan.n_ctx, plan.n_ctx_slot) == (32768, 8192)  # fit on: 4 x 32768, 32768 each
    assert config.build({**BASE, "parallel": 4, "kv_unified": False}).pool_plan(32768).n_ctx == (
        131072
    )
