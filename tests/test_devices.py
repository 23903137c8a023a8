"""The box's sides: the device listing, the offload flags, and where each byte goes.

The real llama-server here is a CPU-only build (its ``--list-devices`` says ``(none)``);
GPU listings and log lines come from ``gpufixtures``, rendered from llama.cpp's printf
formats.
"""

from __future__ import annotations

from pathlib import Path

import gpufixtures as gf
import pytest

from launcher import config
from launcher.config import memory, offload
from launcher.errors import ConfigInvalid
from launcher.server import binary, devices

MiB = 1 << 20


def test_the_real_binary_lists_no_devices(llama_server_bin: str, tmp_path: Path) -> None:
    assert binary.list_devices(llama_server_bin, tmp_path) == ()
    # remembered per binary identity: the cached listing is what a second call reads
    (entry,) = (tmp_path).glob("*.json")
    assert "(none)" in entry.read_text()
    assert binary.list_devices(llama_server_bin, tmp_path) == ()


def test_the_real_fit_params_prints_a_host_line(llama_server_bin: str, tiny_model: Path) -> None:
    tool = binary.fit_params_binary(llama_server_bin)
    assert tool is not None
    server = binary.inspect(llama_server_bin)
    lines, dropped = binary.fit_print(
        tool, ["-m", str(tiny_model), "-c", "1024", "-np", "4", "-kvu"], server
    )
    assert [line.name for line in lines] == ["Host"]
    assert lines[0].model == 1 * MiB and lines[0].compute > 0
    assert dropped == ["-kvu"]  # llama-fit-params refuses it: "invalid argument: -kvu"


def test_listing_parses_each_device() -> None:
    found = devices.parse_list("# saved on box a\n" + gf.list_devices(*gf.TWO_SMALL))
    assert [(d.name, d.description, d.total // MiB, d.free // MiB) for d in found] == [
        ("CUDA0", "NVIDIA GeForce RTX 2060", 5926, 5800),
        ("CUDA1", "NVIDIA GeForce RTX 2060", 5926, 5800),
    ]
    assert all(d.known and not d.unified for d in found)


def test_listing_of_a_cpu_build_is_empty() -> None:
    assert devices.parse_list(gf.list_devices()) == ()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("CUDA0: x (1 MiB, 1 MiB free)\n", "no 'Available devices:' line"),
        ("Available devices:\n  CUDA0: NVIDIA (lots of memory)\n", "is not a device line"),
    ],
)
def test_a_listing_that_is_not_one_is_refused(text: str, says: str) -> None:
    with pytest.raises(ConfigInvalid, match=says):
        devices.parse_list(text)


def test_a_device_as_large_as_the_host_is_unified() -> None:
    found = devices.parse_list(gf.list_devices(gf.GB10, gf.RTX_6000))
    gb10, discrete = devices.mark_unified(found, gf.GB10_MEMTOTAL)
    assert gb10.unified and not discrete.unified
    # the operator's word wins over the guess
    forced = devices.mark_unified(found, gf.GB10_MEMTOTAL, "no")
    assert not any(d.unified for d in forced)


def test_fit_print_lines_are_read() -> None:
    lines = devices.parse_fit_print(gf.fit_print(("CUDA0", 7605, 4096, 304), ("Host", 532, 0, 72)))
    assert [(x.name, x.total // MiB) for x in lines] == [("CUDA0", 12005), ("Host", 604)]
    with pytest.raises(ConfigInvalid, match="no 'Host"):
        devices.parse_fit_print("error: invalid argument: -kvu\n")


def _cfg(*extra: str, ngl: str | None = None) -> config.ServerConfig:
    data: dict[str, object] = {"llama_server": "/bin/true", "model": "/m.gguf"}
    if ngl is not None:
        data["n_gpu_layers"] = ngl
    data["extra_args"] = extra
    return config.build(data)


@pytest.mark.parametrize(
    ("cfg", "want"),
    [
        (_cfg(), offload.Offload()),
        (_cfg(ngl="all"), offload.Offload(all_layers=True)),
        (_cfg(ngl="-2"), offload.Offload(all_layers=True)),
        (_cfg(ngl="20"), offload.Offload(n_gpu_layers=20)),
        (_cfg("--fit", "off"), offload.Offload(fit=False)),
        (_cfg("-dev", "CUDA1"), offload.Offload(devices=("CUDA1",))),
        (_cfg("-dev", "none"), offload.Offload(devices=())),
        (
            _cfg("-ts", "3,1", "-sm", "row"),
            offload.Offload(tensor_split=(3.0, 1.0), split_mode="row"),
        ),
        (
            _cfg("-nkvo", "-fitt", "2048"),
            offload.Offload(no_kv_offload=True, fit_target_mib=(2048,)),
        ),
        (_cfg("--cpu-moe"), offload.Offload(overrides=((offload.FFN_EXPS_REGEX, "CPU"),))),
        (
            _cfg("-ncmoe", "2"),
            offload.Offload(
                overrides=(
                    (r"blk\.0" + offload.FFN_EXPS_REGEX, "CPU"),
                    (r"blk\.1" + offload.FFN_EXPS_REGEX, "CPU"),
                )
            ),
        ),
        (
            _cfg("-ot", "exps=CPU,attn=CUDA1"),
            offload.Offload(overrides=(("exps", "CPU"), ("attn", "CUDA1"))),
        ),
    ],
)
def test_offload_flags_are_read(cfg: config.ServerConfig, want: offload.Offload) -> None:
    assert offload.parse(cfg) == want


def test_layers_split_by_free_memory_as_llama_cpp_does() -> None:
    two = devices.parse_list(gf.list_devices(*gf.TWO_SMALL))
    sides = offload.layer_devices(offload.Offload(all_layers=True), two, 32)
    # upper_bound(splits [0.5, 1.0], il / 33): layers 0..16 on CUDA0, 17..31 and output on CUDA1
    assert sides.count("CUDA0") == 17 and sides.count("CUDA1") == 16
    assert sides[16] == "CUDA0" and sides[17] == "CUDA1"


def test_ngl_offloads_the_last_layers_and_the_output() -> None:
    one = devices.parse_list(gf.list_devices(gf.RTX_6000))
    sides = offload.layer_devices(offload.Offload(n_gpu_layers=10), one, 32)
    assert sides[:23] == [offload.HOST] * 23 and sides[23:] == ["CUDA0"] * 10


def test_an_unknown_device_name_is_refused_with_the_ones_there_are() -> None:
    one = devices.parse_list(gf.list_devices(gf.RTX_6000))
    with pytest.raises(ConfigInvalid, match=r"CUDA1 is not a device .*\(it has: CUDA0\)"):
        offload.active_devices(offload.parse(_cfg("-dev", "CUDA1")), one)


def test_experts_moved_to_the_host_land_there() -> None:
    one = devices.parse_list(gf.list_devices(gf.RTX_6000))
    tensors = {
        "token_embd.weight": 100,
        "blk.0.attn_q.weight": 10,
        "blk.0.ffn_up_exps.weight": 1000,
        "output.weight": 50,
    }
    placed = offload.place(offload.parse(_cfg("--cpu-moe", ngl="all")), one, tensors, 1, [7])
    assert placed.weights == {offload.HOST: 1100, "CUDA0": 60}
    assert placed.kv == {offload.HOST: 0, "CUDA0": 7}
    # -nkvo keeps the layer's KV on the host
    placed = offload.place(offload.parse(_cfg("-nkvo", ngl="all")), one, tensors, 1, [7])
    assert placed.kv == {offload.HOST: 7, "CUDA0": 0}


def test_a_model_without_output_weight_gets_token_embd_again_on_the_device() -> None:
    one = devices.parse_list(gf.list_devices(gf.RTX_6000))
    tensors = {"token_embd.weight": 100, "blk.0.attn_q.weight": 10}
    placed = offload.place(offload.parse(_cfg(ngl="all")), one, tensors, 1, None)
    assert placed.weights == {offload.HOST: 100, "CUDA0": 110}


def test_the_log_gives_the_buffers_per_device() -> None:
    buffers = memory.log_buffers(gf.allocation_log())
    assert buffers["model"] == {"CUDA0": round(7605.33 * MiB), "CPU_Mapped": round(532.31 * MiB)}
    assert buffers["kv"] == {"CUDA0": 4096 * MiB}
    assert buffers["compute"]["CUDA0"] == 304 * MiB
    sides = memory.by_side(buffers, ["CUDA0"])
    assert sides["CUDA0"] == round(7605.33 * MiB) + 4096 * MiB + 304 * MiB
    assert sides[offload.HOST] == round(532.31 * MiB) + round(72.01 * MiB)


def test_a_log_at_default_verbosity_records_why_it_has_no_buffers() -> None:
    rec = memory.measured(["0.00.035.060 I srv  llama_server: model loaded"])
    assert rec["buffers"] == {} and "-lv 4" in rec["note"]
