"""The live record: bounded on disk, folded, time-weighted, never half read; the metrics
file's format. Pure parts: real files in tmp_path, no server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from launcher.watch import record, textfile
from launcher.watch.record import Delta, Now, Record

T0 = 1_800_000_000.0  # a minute boundary


def write(path: Path, data: bytes, mode: int) -> None:
    from launcher.deploy import store

    store.atomic_write(path, data, mode, durable=False)


def busy(t: float, **counts: float) -> Delta:
    base = {"requests": 4, "completions": 4, "decode_tokens": 400, "decode_seconds": 2.0}
    return Delta(
        t, Now(pool=500, slot_fill=300, busy=2, deferred=0, memory=2**30), {**base, **counts}
    )


def test_a_week_of_one_minute_samples_stays_under_a_few_megabytes(tmp_path: Path) -> None:
    rec = Record(1)
    for i in range(8 * 24 * 60):  # eight days, every minute busy, memory growing
        d = busy(T0 + 60 * i)
        d.now.memory = 2**30 + i * 4096 * 256
        rec.add(d)
    record.save(tmp_path, rec, write)
    size = record.path_of(tmp_path).stat().st_size
    print(f"{len(rec.minutes)} minute rows + {len(rec.hours)} hour rows: {size:,} bytes")
    assert size < 3 * 2**20
    assert len(rec.minutes) == 7 * 24 * 60
    assert len(rec.hours) == 24  # the eighth day, folded hourly


def test_folding_minutes_into_hours_keeps_the_totals_and_peaks() -> None:
    rec = Record(1)
    for i in range(8 * 24 * 60):
        rec.add(busy(T0 + 60 * i, requests=1 + (i % 3)))
    s = rec.summary()
    assert s.requests == sum(1 + (i % 3) for i in range(8 * 24 * 60))
    assert s.requests == sum(r[record.COL["requests"]] or 0 for r in rec.rows())
    assert s.pool_peak == 0.5


def test_hours_served_and_the_p95_are_weighted_by_time() -> None:
    rec = Record(1)
    rec.begin(T0)
    rec.add(Delta(T0 + 60, Now(pool=100), {"requests": 1}))  # 60 s at an unknown level
    rec.add(Delta(T0 + 60 + 900, Now(pool=950), {"requests": 1}))  # 900 s at 10 %
    rec.add(Delta(T0 + 60 + 900 + 100, Now(pool=100), {"requests": 1}))  # 100 s at 95 %
    s = rec.summary(tail_until=T0 + 1060 + 500)  # and the open end: 500 s more at 10 %
    assert s.served_hours == pytest.approx((60 + 900 + 100 + 500) / 3600)
    # at 10 % for 1,400 s and at 95 % for 100 s: the pool stayed under 11 % for over 93 %
    # of the time, so the p95 is the 95 % bin
    assert s.pool_p95 == pytest.approx(0.96)
    assert s.pool_peak == 0.95


def test_a_down_server_serves_no_hours() -> None:
    rec = Record(1)
    rec.begin(T0)
    rec.add(Delta(T0 + 60, Now(up=False), {}))
    rec.add(Delta(T0 + 600, Now(up=True), {}))
    assert rec.summary().served_hours == pytest.approx(60 / 3600)


def test_nothing_changed_is_no_change_worth_a_write() -> None:
    rec = Record(1)
    rec.add(busy(T0))
    same = Delta(T0 + 60, Now(pool=500, slot_fill=300, busy=2, deferred=0, memory=2**30 + 1000))
    assert not rec.changed_by(same)
    moved = Delta(T0 + 60, Now(pool=500, slot_fill=300, busy=2, deferred=0, memory=2**30 + 2**20))
    assert rec.changed_by(moved)


def test_decode_speed_is_the_servers_tokens_over_its_own_seconds() -> None:
    rec = Record(1)
    rec.add(busy(T0, decode_tokens=300, decode_seconds=1.0))
    rec.add(busy(T0 + 60, decode_tokens=100, decode_seconds=1.0))
    s = rec.summary()
    assert s.decode_tps == pytest.approx(400 / 2.0)  # not the mean of the rates, 200
    assert s.decode_tps_median == pytest.approx((300 + 100) / 2)


def test_errors_per_thousand_requests() -> None:
    rec = Record(1)
    rec.add(busy(T0, requests=400, failures=2, context_exceeded=2))
    assert rec.summary().errors_per_1k == pytest.approx(5.0)


def test_memory_slope_is_bytes_per_hour() -> None:
    rec = Record(1)
    for i in range(60):
        d = busy(T0 + 60 * i)
        d.now.memory = 2**30 + i * 2**20  # one MiB a minute
        rec.add(d)
    assert rec.summary().memory_slope == pytest.approx(60 * 2**20)


def test_a_record_round_trips_through_its_file(tmp_path: Path) -> None:
    rec = Record(7)
    rec.add(busy(T0))
    rec.add(busy(T0 + 3600, failures=1, context_exceeded=1))
    record.save(tmp_path, rec, write)
    again = record.load(tmp_path, 7)
    assert again.to_json() == rec.to_json()


def test_a_damaged_record_is_moved_aside_by_the_writer_and_left_by_a_reader(
    tmp_path: Path,
) -> None:
    path = record.path_of(tmp_path)
    path.write_text('{"version": 1, "minutes": [[1, 2')  # a torn file no atomic write leaves
    read = record.load(tmp_path, 3)
    assert read.first is None and "could not be read" in read.notes[0]
    assert path.exists()
    repaired = record.load(tmp_path, 3, repair=True)
    assert "moved aside" in repaired.notes[0]
    assert not path.exists() and path.with_name("live.json.bad").exists()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5 * 86400),  # under a year in all: no hour dropped
            st.integers(0, 50),
            st.one_of(st.none(), st.integers(0, 1200)),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_any_samples_fold_without_losing_a_request_or_a_peak(
    samples: list[tuple[int, int, int | None]],
) -> None:
    rec = Record(1)
    t = T0
    for step, requests, pool in samples:
        t += step
        rec.add(Delta(t, Now(pool=pool), {"requests": requests}))
    s = rec.summary()
    assert s.requests == sum(r for _, r, _ in samples)
    pools = [p for _, _, p in samples if p is not None]
    assert s.pool_peak == (max(pools) / 1000 if pools else None)
    starts = [r[0] for r in rec.minutes]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)


# -- the metrics file ------------------------------------------------------------------------


def samples_of(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a text page as (name, labels, value), read by prometheus_client's
    parser (what Prometheus' own clients read with)."""
    return [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def test_the_metrics_file_has_one_help_and_type_per_metric_and_no_timestamps() -> None:
    page = textfile.Page("llama-server.service")
    page.add("llama_launcher_deploys_total", 3, outcome="deployed")
    page.add("llama_launcher_deploys_total", 1, outcome="failed")
    page.add("llama_launcher_slot_tokens", 10, slot="0")
    page.add("llama_launcher_slot_tokens", 10, slot="0")  # a duplicate series: kept once
    page.add("llama_launcher_kv_pool_tokens", None)  # unknown: left out
    text = page.render()
    assert text.count("# TYPE llama_launcher_deploys_total counter") == 1
    assert text.count('llama_launcher_slot_tokens{slot="0",unit="llama-server.service"}') == 1
    assert "kv_pool_tokens" not in text
    for line in text.splitlines():
        if not line.startswith("#"):
            assert len(line.rsplit(" ", 1)[1].split()) == 1  # a value, no timestamp after it


def test_label_values_are_escaped() -> None:
    page = textfile.Page('we"ird\\unit')
    page.add("llama_launcher_serving_generation", 2)
    [(name, labels, value)] = samples_of(page.render())
    assert (name, labels["unit"], value) == ("llama_launcher_serving_generation", 'we"ird\\unit', 2)


@given(st.text())
@example("back\\nslash")  # a backslash, then n: not a newline
@example("back\\\\n")
@example("new\nline")
@example('\\"\\n"')
def test_a_label_value_comes_back_the_same_a_backslash_before_n_too(unit: str) -> None:
    page = textfile.Page(unit)
    page.add("llama_launcher_serving_generation", 2)
    [(_, labels, _)] = samples_of(page.render())
    assert labels["unit"] == unit


def test_an_unchanged_metrics_file_is_not_rewritten_only_touched(tmp_path: Path) -> None:
    writes: list[Path] = []

    def counting(path: Path, data: bytes, mode: int) -> None:
        writes.append(path)
        write(path, data, mode)

    assert textfile.publish(tmp_path, "u.service", "a 1\n", counting)
    path = tmp_path / textfile.file_name("u.service")
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    import os

    os.utime(path, (1, 1))
    assert not textfile.publish(tmp_path, "u.service", "a 1\n", counting)
    assert len(writes) == 1 and path.stat().st_mtime > 1


def test_the_files_name_is_the_units_with_safe_characters() -> None:
    assert (
        textfile.file_name("llama-server@chat.service") == "llama_launcher_llama_server_chat.prom"
    )


def test_every_metric_name_follows_the_guide() -> None:
    for name, (kind, _, _) in textfile.METRICS.items():
        assert name.startswith("llama_launcher_")
        assert (kind == "counter") == name.endswith("_total"), name
    assert json.dumps(sorted(textfile.METRICS))  # names are plain ASCII


# -- the sampler's units ---------------------------------------------------------------------


def _sampler(**kw: object) -> object:
    from launcher.host import timer

    base = dict(
        unit="llama-server.service", scope="system", python="/usr/bin/python3",
        package_dir="/opt/ll", state_dir="/var/lib/llama-launcher/llama-server",
        env_file="/etc/llama-launcher/llama-server.env", interval=60.0,
    )  # fmt: skip
    return timer.Sampler(**{**base, **kw})  # type: ignore[arg-type]


def test_an_instances_sampler_is_a_template_of_its_own() -> None:
    from launcher.host import timer

    assert timer.names("llama-server@chat.service") == (
        "llama-server-sample@chat.service",
        "llama-server-sample@chat.timer",
    )
    assert timer.file_names("llama-server@chat.service") == (
        "llama-server-sample@.service",
        "llama-server-sample@.timer",
    )


def test_a_timer_of_seconds_gets_an_accuracy_finer_than_systemds_minute() -> None:
    from launcher.host import timer

    fast = timer.render_timer(_sampler(interval=1.0))  # type: ignore[arg-type]
    assert "OnUnitActiveSec=1s" in fast and "AccuracySec=100ms" in fast
    assert "AccuracySec=1s" in timer.render_timer(_sampler())  # type: ignore[arg-type]


def test_the_system_sampler_writes_only_its_own_folders() -> None:
    from launcher.host import timer

    text = timer.render_service(_sampler(textfile_dir="/var/lib/prometheus/node-exporter"))  # type: ignore[arg-type]
    assert "ProtectSystem=strict" in text
    assert (
        "ReadWritePaths=/var/lib/llama-launcher/llama-server -/var/lib/prometheus/node-exporter"
        in text
    )
    assert "--textfile-dir /var/lib/prometheus/node-exporter" in text
    user = timer.render_service(_sampler(scope="user"))  # type: ignore[arg-type]
    assert "ProtectSystem" not in user and "--scope user" in user


def test_the_system_sampler_can_write_what_a_bakes_revert_writes(tmp_path: Path) -> None:
    """The revert runs in the sample that carries the bake: the env file's folder, the
    client window's (the state folder's parent) and the lock's are writable, nothing else."""
    from launcher import config
    from launcher.host import timer
    from launcher.install import install

    env_file = tmp_path / "etc" / "llama-server.env"
    state = tmp_path / "ll" / "llama-server"
    settings = config.ToolSettings(scope="system", env_file=env_file, state_dir=state)
    paths = install.revert_paths(settings, env_file)
    assert paths == (str(env_file.parent), str(state.parent), "-/run/lock/llama-launcher")
    text = timer.render_service(_sampler(revert_paths=paths))  # type: ignore[arg-type]
    rw = next(line for line in text.splitlines() if line.startswith("ReadWritePaths="))
    assert rw.split("=", 1)[1].split() == ["/var/lib/llama-launcher/llama-server", *paths]


def test_the_sample_service_is_ready_after_its_first_sample_not_at_its_end() -> None:
    """Type=notify: a sample that carries a bake runs on with its start job done."""
    from launcher.host import timer

    for scope in ("system", "user"):
        text = timer.render_service(_sampler(scope=scope))  # type: ignore[arg-type]
        assert "\nType=notify\n" in text and "Type=oneshot" not in text


def test_ready_tells_the_notify_socket(tmp_path: Path) -> None:
    import socket

    from launcher.host import notify

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        assert notify.ready({"NOTIFY_SOCKET": str(path)}) is True
        assert s.recv(100) == b"READY=1"


def test_ready_outside_a_notify_unit_does_nothing(tmp_path: Path) -> None:
    from launcher.host import notify

    assert notify.ready({}) is False
    assert notify.ready({"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False


def test_every_calls_its_step_again_at_the_interval_until_the_step_raises() -> None:
    from launcher import waits

    calls: list[int] = []
    pauses: list[float] = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # sample --every ends on Ctrl-C or SIGTERM

    with pytest.raises(KeyboardInterrupt):
        waits.every(2.5, sleep=pauses.append)(step)
    assert len(calls) == 3 and pauses == [2.5, 2.5]


def test_the_system_sampler_sees_a_launcher_package_under_its_private_tmp() -> None:
    from launcher.host import timer

    text = timer.render_service(_sampler(package_dir="/var/tmp/checkout"))  # type: ignore[arg-type]
    assert "PrivateTmp=yes" in text and "BindReadOnlyPaths=/var/tmp/checkout\n" in text
    assert "BindReadOnlyPaths" not in timer.render_service(_sampler())  # type: ignore[arg-type]
