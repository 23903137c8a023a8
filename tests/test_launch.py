"""The unit's ExecStart: ``llama-launcher exec --env-file F`` reads the file and execs llama-server.

Some cases run the real ``python -m launcher exec ... --print-argv`` as a subprocess, the rest
call ``launch.read_argv``; the exec path itself is tested by exec'ing ``/usr/bin/env``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from payloads import REPO, launcher

from launcher.host import envfile, launch

SERVER = "/opt/llama/bin/llama-server"


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    args: tuple[str, ...]  # what follows LLAMA_SERVER
    subprocess: bool = False


ARGV_CASES = [
    Case(
        "minimal",
        f'LLAMA_SERVER={SERVER}\nEXTRA_ARGS="-m /models/m.gguf -c 4096"\n',
        ("-m", "/models/m.gguf", "-c", "4096", "--log-colors", "off"),
        subprocess=True,
    ),
    Case(
        "the seed's line, quoted",
        f"LLAMA_SERVER={SERVER}\n"
        'EXTRA_ARGS="-c 1048576 -np 4 -kvu --kv-unified-per-slot 262144 -ctk q8_0 -ctv q8_0"\n',
        (
            "-c",
            "1048576",
            "-np",
            "4",
            "-kvu",
            "--kv-unified-per-slot",
            "262144",
            "-ctk",
            "q8_0",
            "-ctv",
            "q8_0",
            "--log-colors",
            "off",
        ),
        subprocess=True,
    ),
    Case(
        "an api key file",
        f'LLAMA_SERVER="{SERVER}"\nEXTRA_ARGS="-m /m.gguf"\nAPI_KEY_FILE=/etc/llama/key\n',
        ("-m", "/m.gguf", "--log-colors", "off", "--api-key-file", "/etc/llama/key"),
        subprocess=True,
    ),
    Case(
        "single-quoted alias with a space",
        f"LLAMA_SERVER={SERVER}\nEXTRA_ARGS='--alias \"my model\"'\n",
        ("--alias", "my model", "--log-colors", "off"),
        subprocess=True,
    ),
    Case(
        "json chat template kwargs (anchors 5.3)",
        f"LLAMA_SERVER={SERVER}\n"
        'EXTRA_ARGS="--chat-template-kwargs \'{\\"enable_thinking\\":false}\'"\n',
        ("--chat-template-kwargs", '{"enable_thinking":false}', "--log-colors", "off"),
    ),
    Case(
        "escaped dollar and backtick stay literal",
        f'LLAMA_SERVER={SERVER}\nEXTRA_ARGS="--alias \\$HOME\\`x\\`"\n',
        ("--alias", "$HOME`x`", "--log-colors", "off"),
    ),
    Case(
        "log colors given: not appended",
        f'LLAMA_SERVER={SERVER}\nEXTRA_ARGS="--log-colors on -m /m.gguf"\n',
        ("--log-colors", "on", "-m", "/m.gguf"),
    ),
    Case(
        "comments, blanks and indentation",
        f'# generated\n\n  LLAMA_SERVER={SERVER}\n\t# flags\nEXTRA_ARGS="-c 8192"   \n\n',
        ("-c", "8192", "--log-colors", "off"),
    ),
    Case(
        "an empty word",
        f"LLAMA_SERVER={SERVER}\nEXTRA_ARGS=\"--alias ''\"\n",
        ("--alias", "", "--log-colors", "off"),
    ),
    Case(
        "a quoted path with spaces",
        f"LLAMA_SERVER={SERVER}\nEXTRA_ARGS=\"-m '/models/my model.gguf'\"\n",
        ("-m", "/models/my model.gguf", "--log-colors", "off"),
    ),
    Case(
        "concatenated quoted runs",
        f"LLAMA_SERVER={SERVER}\nEXTRA_ARGS='-c '\"4096\"' -np 2'\n",
        ("-c", "4096", "-np", "2", "--log-colors", "off"),
    ),
    Case(
        "the last assignment wins",
        f'LLAMA_SERVER={SERVER}\nEXTRA_ARGS="-c 1"\nEXTRA_ARGS="-c 2"\n',
        ("-c", "2", "--log-colors", "off"),
    ),
    Case(
        "unicode alias",
        f"LLAMA_SERVER={SERVER}\nEXTRA_ARGS=\"--alias 'modèle 模型 😀'\"\n",
        ("--alias", "modèle 模型 😀", "--log-colors", "off"),
        subprocess=True,
    ),
    Case(
        "a backslash in a word, written the way systemd reads it too",
        f'LLAMA_SERVER={SERVER}\nEXTRA_ARGS="--alias \\"a\\\\\\\\b\\""\n',
        ("--alias", "a\\b", "--log-colors", "off"),
    ),
    Case(
        "api key file empty: no flag",
        f'LLAMA_SERVER={SERVER}\nEXTRA_ARGS="-c 1"\nAPI_KEY_FILE=""\n',
        ("-c", "1", "--log-colors", "off"),
    ),
]


def _write(tmp_path: Path, text: str, name: str = "llama.env") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


@pytest.mark.parametrize("case", ARGV_CASES, ids=[c.id for c in ARGV_CASES])
def test_argv_for_env_file(tmp_path: Path, case: Case) -> None:
    env_file = _write(tmp_path, case.text)
    if case.subprocess:
        r = launcher(env_file, tmp_path)
        assert (r.returncode, r.stderr) == (0, "")
        argv = json.loads(r.stdout)
    else:
        argv = launch.read_argv(str(env_file))
    assert argv == [SERVER, *case.args]


# -- refusals: each names the line and what bash would have done -------------------------

HEAD = f"# llama-launcher\nLLAMA_SERVER={SERVER}\n"  # the bad line is line 3


@dataclass(frozen=True)
class Refusal:
    id: str
    line: str  # becomes line 3
    says: tuple[str, ...]  # fragments of the message
    lineno: int | None = 3


REFUSALS = [
    Refusal("$VAR", "EXTRA_ARGS=$HOME", ("'$'", "bash would expand a variable")),
    Refusal("${VAR}", "EXTRA_ARGS=${HOME}", ("bash would expand a variable",)),
    Refusal("$VAR in double quotes", 'EXTRA_ARGS="-m $HOME/m"', ("bash would expand",)),
    Refusal("$(cmd)", "EXTRA_ARGS=$(id)", ("run a command substitution",)),
    Refusal("$(cmd) in double quotes", 'EXTRA_ARGS="$(id)"', ("run a command here",)),
    Refusal("backticks", "EXTRA_ARGS=`id`", ("backtick", "bash would run a command")),
    Refusal("backticks in quotes", 'EXTRA_ARGS="`id`"', ("backtick", "bash would run a command")),
    Refusal(";", "EXTRA_ARGS=-c;id", ("';'", "command separator")),
    Refusal("&&", "EXTRA_ARGS=x&&id", ("'&'", "shell syntax")),
    Refusal("|", "EXTRA_ARGS=x|id", ("'|'", "pipe")),
    Refusal("> redirection", "EXTRA_ARGS=x>out", ("'>'", "redirection")),
    Refusal("< redirection", "EXTRA_ARGS=x<in", ("'<'", "redirection")),
    Refusal("glob *", "EXTRA_ARGS=/models/*.gguf", ("'*'", "globbing")),
    Refusal("glob ?", "EXTRA_ARGS=m?.gguf", ("'?'", "globbing")),
    Refusal("glob [", "EXTRA_ARGS=m[0].gguf", ("'['", "globbing")),
    Refusal("tilde", "EXTRA_ARGS=~/m.gguf", ("'~'", "tilde")),
    Refusal("a bare command line", "llama-server -m /m.gguf", ("bash would run this line",)),
    Refusal(
        "the seed's unquoted line",
        "EXTRA_ARGS=--kv-unified-per-slot 262144 -ctk q8_0 -ctv q8_0",
        (
            "bash would set the variable only for one command",
            "run '262144' as a command",
            "exit 127",
            'KEY="..."',
        ),
    ),
    Refusal(
        "a command after a quoted assignment",
        'EXTRA_ARGS="-c 1" touch x',
        ("run 'touch' as a command",),
    ),
    Refusal(
        "unknown key LLAMA_ARG_*",
        "LLAMA_ARG_CTX_SIZE=8192",
        (
            "unknown key 'LLAMA_ARG_CTX_SIZE'",
            "bash would set it",
            "llama-server reads LLAMA_ARG_* variables as flags",
        ),
    ),
    Refusal("unknown key", "THREADS=8", ("unknown key 'THREADS'", "bash would set it")),
    Refusal(
        "--api-key in EXTRA_ARGS",
        'EXTRA_ARGS="-m /m.gguf --api-key s3cret"',
        ("--api-key", "ps", "API_KEY_FILE"),
    ),
    Refusal("--api-key=", 'EXTRA_ARGS="--api-key=s3cret"', ("--api-key", "API_KEY_FILE")),
    Refusal("CRLF", 'EXTRA_ARGS="-c 1"\r', ("carriage return", "bash keeps it in the value")),
    Refusal("unterminated double quote", 'EXTRA_ARGS="-c 1', ("unterminated double quote",)),
    Refusal("unterminated single quote", "EXTRA_ARGS='-c 1", ("unterminated single quote",)),
    Refusal("not a variable name", "EXTRA-ARGS=x", ("not a variable name",)),
    Refusal("export", 'export EXTRA_ARGS="-c 1"', ("not a variable name",)),
    Refusal(
        "a comment after the value",
        'EXTRA_ARGS="-c 1"  # small',
        ("comment after the value", "systemd keeps '# small'"),
    ),
    Refusal(
        "a quote after unquoted characters",
        "EXTRA_ARGS=-c' 1'",
        ("quote after unquoted characters", "systemd keeps it"),
    ),
    Refusal(
        "a comment ending in a backslash",
        "# flags follow \\",
        ("comment ending in a backslash", "line 4"),
    ),
    Refusal(
        "a backslash in single quotes, which systemd drops",
        "EXTRA_ARGS=\"--alias 'a\\\\b'\"",
        ("word 2", "'a\\\\b'", "systemd"),
    ),
    Refusal("a NUL byte", 'EXTRA_ARGS="-c\x001"', ("control character '\\x00'",)),
    Refusal("a noncharacter", 'EXTRA_ARGS="\ufffe"', ("U+FFFE", "systemd refuses")),
]


def _refused_text(r: Refusal) -> str:
    tail = "" if r.line.startswith("EXTRA_ARGS") else 'EXTRA_ARGS="-c 1"\n'
    return HEAD + r.line + "\n" + tail


@pytest.mark.parametrize("r", REFUSALS, ids=[r.id for r in REFUSALS])
def test_refusal_names_the_line_and_what_bash_would_do(tmp_path: Path, r: Refusal) -> None:
    env_file = _write(tmp_path, _refused_text(r))
    with pytest.raises(launch.LaunchError) as e:
        launch.read_argv(str(env_file))
    message = str(e.value)
    assert message.startswith(f"{env_file}:{r.lineno}: "), message
    for fragment in r.says:
        assert fragment in message, message


def test_missing_extra_args_is_refused(tmp_path: Path) -> None:
    env_file = _write(tmp_path, HEAD)
    with pytest.raises(launch.LaunchError, match="EXTRA_ARGS is missing") as e:
        launch.read_argv(str(env_file))
    assert "would start llama-server without its flags" in str(e.value)


def test_empty_extra_args_names_its_line(tmp_path: Path) -> None:
    env_file = _write(tmp_path, HEAD + 'EXTRA_ARGS=""\n')
    with pytest.raises(launch.LaunchError, match=rf"^{env_file}:3: EXTRA_ARGS is empty"):
        launch.read_argv(str(env_file))


def test_missing_llama_server_is_refused(tmp_path: Path) -> None:
    env_file = _write(tmp_path, 'EXTRA_ARGS="-c 1"\n')
    with pytest.raises(launch.LaunchError, match="LLAMA_SERVER is missing") as e:
        launch.read_argv(str(env_file))
    assert "would run the first word of EXTRA_ARGS as the program" in str(e.value)


@pytest.mark.parametrize(
    "r", [r for r in REFUSALS if r.id in ("$(cmd)", "the seed's unquoted line", "CRLF",
                                          "unknown key LLAMA_ARG_*", "--api-key in EXTRA_ARGS")],
    ids=lambda r: r.id,
)  # fmt: skip
def test_config_errors_exit_78_from_the_real_launcher(tmp_path: Path, r: Refusal) -> None:
    env_file = _write(tmp_path, _refused_text(r))
    result = launcher(env_file, tmp_path)
    assert result.returncode == envfile.EX_CONFIG == 78
    assert result.stdout == ""
    assert result.stderr.startswith(f"llama-launcher: config error: {env_file}:3: ")
    for fragment in r.says:
        assert fragment in result.stderr


def test_missing_extra_args_exits_78(tmp_path: Path) -> None:
    result = launcher(_write(tmp_path, HEAD), tmp_path)
    assert result.returncode == 78
    assert "EXTRA_ARGS is missing" in result.stderr


def test_an_unreadable_file_exits_78(tmp_path: Path) -> None:
    result = launcher(tmp_path / "nope.env", tmp_path)
    assert result.returncode == 78
    assert "cannot read the env file" in result.stderr and "No such file" in result.stderr


def test_a_non_utf8_file_exits_78(tmp_path: Path) -> None:
    env_file = tmp_path / "latin1.env"
    env_file.write_bytes(b'LLAMA_SERVER=/x\nEXTRA_ARGS="--alias caf\xe9"\n')
    result = launcher(env_file, tmp_path)
    assert result.returncode == 78
    assert "not UTF-8" in result.stderr


def test_a_server_that_cannot_be_executed_exits_78(tmp_path: Path) -> None:
    env_file = _write(tmp_path, f'LLAMA_SERVER={tmp_path}/missing\nEXTRA_ARGS="-c 1"\n')
    result = launcher(env_file, tmp_path, print_argv=False)
    assert result.returncode == 78
    assert "cannot execute LLAMA_SERVER=" in result.stderr


def test_a_binary_busy_being_replaced_is_not_a_config_error(tmp_path: Path) -> None:
    server = tmp_path / "llama-server"
    server.write_bytes(Path("/bin/true").read_bytes())
    server.chmod(0o755)
    env_file = _write(tmp_path, f'LLAMA_SERVER={server}\nEXTRA_ARGS="-c 1"\n')
    with open(server, "ab"):  # an upgrade writing the binary: execve fails with ETXTBSY
        result = launcher(env_file, tmp_path, print_argv=False)
    assert result.returncode == 1  # systemd's Restart= retries; 78 would stop it for good
    assert "Text file busy" in result.stderr


def test_bad_arguments_exit_78(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "launcher", "exec", "--bogus"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 78
    assert "unexpected argument '--bogus'" in r.stderr


def test_crlf_is_refused_when_read_from_disk(tmp_path: Path) -> None:
    """Universal newlines would turn CRLF into LF before the parser sees it; bash keeps the CR."""
    env_file = _write(tmp_path, f'LLAMA_SERVER={SERVER}\r\nEXTRA_ARGS="-c 1"\r\n')
    with pytest.raises(launch.LaunchError, match=r":1: a carriage return"):
        launch.read_argv(str(env_file))


# -- the exec path: a tiny stand-in for llama-server ----------------------------------------

_SHOW = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))"


def test_exec_scrubs_llama_arg_variables_and_passes_the_argv(tmp_path: Path) -> None:
    """LLAMA_SERVER=/usr/bin/env, which runs a Python that prints its argv and environment:
    the real execve, no mock. LLAMA_ARG_* and LLAMA_API_KEY must not reach the server."""
    key_file = tmp_path / "key"
    env_file = _write(
        tmp_path,
        envfile.render_assignments(
            {
                "LLAMA_SERVER": "/usr/bin/env",
                "EXTRA_ARGS": envfile.join_words([sys.executable, "-c", _SHOW]),
                "API_KEY_FILE": str(key_file),
            }
        ),
    )
    r = launcher(
        env_file,
        tmp_path,
        print_argv=False,
        env={"LLAMA_ARG_CTX_SIZE": "1", "LLAMA_ARG_N_PARALLEL": "8", "LLAMA_API_KEY": "s3cret",
             "KEEP_ME": "yes", "LLAMA_ARGX": "kept"},
    )  # fmt: skip
    assert (r.returncode, r.stderr) == (0, "")
    shown = json.loads(r.stdout)
    assert shown["argv"] == ["--log-colors", "off", "--api-key-file", str(key_file)]
    assert not [k for k in shown["env"] if k.startswith("LLAMA_ARG_") or k == "LLAMA_API_KEY"]
    assert shown["env"]["KEEP_ME"] == "yes"
    assert shown["env"]["LLAMA_ARGX"] == "kept"


def test_exec_replaces_the_process_and_passes_the_exit_status(tmp_path: Path) -> None:
    """execve, not a child: the server's exit status is the unit's exit status."""
    env_file = _write(
        tmp_path,
        envfile.render_assignments(
            {
                "LLAMA_SERVER": sys.executable,
                "EXTRA_ARGS": envfile.join_words(
                    ["-c", "import os, sys; sys.exit(os.getpid() % 200 + 3)"]
                ),
            }
        ),
    )
    r = subprocess.Popen(
        [sys.executable, "-m", "launcher", "exec", "--env-file", str(env_file)],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert r.wait(timeout=60) == r.pid % 200 + 3


def test_launch_imports_no_third_party_module() -> None:
    code = (
        "import sys, launcher.host.launch, launcher.__main__; "
        "print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    loaded = set(r.stdout.split())
    assert "launcher" in loaded
    heavy = {"pydantic", "pydantic_settings", "httpx", "sh", "tenacity", "gguf", "numpy"}
    assert not loaded & heavy
    stdlib = set(sys.stdlib_module_names) | {
        "launcher",
        "__main__",
        "sitecustomize",
        "_distutils_hack",
    }
    # an editable install's import hook is site machinery, not a dependency
    loaded = {m for m in loaded if not m.startswith("__editable__")}
    assert loaded <= stdlib, loaded - stdlib


def test_exec_help_does_not_import_the_cli(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "launcher", "exec", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0 and "usage: llama-launcher exec" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "launcher.host.launch" in imported
    assert not {m for m in imported if m.split(".")[0] in {"pydantic", "httpx", "sh", "tenacity"}}
    assert "launcher.cli" not in imported
