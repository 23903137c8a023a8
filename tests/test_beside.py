"""A second instance beside the running one: does the new config fit while the old one serves?

The need comes from the real validation chain (the real llama-server checks the flags and the
GGUF); the devices and the host's free memory are passed in, so each case is the box it names
(``gpufixtures``, as in ``test_memory_gpu``).
"""

from __future__ import annotations

from pathlib import Path

import gpufixtures as gf
from conftest import Host, one_slot_config

from launcher import config
from launcher.config import beside, memory, validate
from launcher.server import devices

MiB, GiB = 1 << 20, 1 << 30


def _need(cfg: config.ServerConfig, box: tuple[devices.Device, ...] = ()) -> memory.Need:
    # the guard (the running server stopped first) is not the question here
    return validate.validate(cfg, box=box, available=1 << 50, force_memory=True).memory


def _running(model: Path, mapped_mib: int = 7000) -> beside.Running:
    return beside.Running(model, mapped_mib * MiB)


def test_the_same_model_mapped_twice_counts_its_weights_once(
    llama_server_bin: str, model_8b: Path
) -> None:
    cfg = one_slot_config(llama_server_bin, model_8b)
    need = _need(cfg)
    assert need.total is not None
    # exactly the new need plus the 1024 MiB headroom: fits, the weights not counted again
    fits = beside.fit(need, cfg, _running(model_8b), need.total + 1024 * MiB)
    assert fits.fits is True
    assert "the host's weights counted once" in fits.why
    assert fits.sides[0].to_dict()["weights_shared"] is True
    short = beside.fit(need, cfg, _running(model_8b), need.total + 1023 * MiB)
    assert short.fits is False
    assert short.why.startswith("the host would need")


def test_another_model_keeps_the_running_ones_pages_in_use(
    llama_server_bin: str, model_8b: Path, tiny_model: Path
) -> None:
    """The running server maps another file: its 7000 MiB of mapped pages stay beside."""
    cfg = one_slot_config(llama_server_bin, model_8b)
    need = _need(cfg)
    assert need.total is not None
    free = need.total + 1024 * MiB + 6999 * MiB
    assert beside.fit(need, cfg, _running(tiny_model), free).fits is False
    assert beside.fit(need, cfg, _running(tiny_model), free + MiB).fits is True
    assert "counted twice" in beside.fit(need, cfg, _running(tiny_model), free + MiB).why


def test_weights_read_into_memory_are_a_second_copy(llama_server_bin: str, model_8b: Path) -> None:
    cfg = one_slot_config(llama_server_bin, model_8b, load_mode="none")
    need = _need(cfg)
    assert need.total is not None
    free = need.total + 1024 * MiB
    assert beside.fit(need, cfg, _running(model_8b), free).fits is False
    assert beside.fit(need, cfg, _running(model_8b), free + 7000 * MiB).fits is True


def test_a_discrete_gpu_must_hold_a_second_copy_of_its_layers(
    llama_server_bin: str, model_8b: Path
) -> None:
    """On a device each process holds its own weights: the device's free memory (what the
    running server left) must take the whole new side, whatever the host has."""
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="999")
    big = devices.mark_unified(devices.parse_list(gf.list_devices(gf.RTX_6000)), 0)
    need = _need(cfg, big)
    device = next(s for s in need.sides if s.name == "CUDA0")
    assert device.need is not None
    roomy = beside.fit(need, cfg, _running(model_8b), 64 * GiB)
    assert roomy.fits is True
    assert "a second copy of the offloaded layers on CUDA0" in roomy.why
    # the running server already holds most of the card: what is left is one side short
    left = ("CUDA0", gf.RTX_6000[1], gf.RTX_6000[2], device.need // MiB - 1)
    small = devices.mark_unified(devices.parse_list(gf.list_devices(left)), 0)
    verdict = beside.fit(_need(cfg, small), cfg, _running(model_8b), 64 * GiB)
    assert verdict.fits is False
    assert verdict.why.startswith("device CUDA0 would need")
    assert "-fitt margin" in verdict.why


def test_unified_memory_shares_the_weights_with_the_host(
    llama_server_bin: str, model_8b: Path
) -> None:
    """GB10: one side with the host, the mapped weights counted once there."""
    cfg = one_slot_config(llama_server_bin, model_8b, n_gpu_layers="all")
    box = devices.mark_unified(devices.parse_list(gf.list_devices(gf.GB10)), gf.GB10_MEMTOTAL)
    need = _need(cfg, box)
    (host,) = need.sides
    assert host.need is not None
    verdict = beside.fit(need, cfg, _running(model_8b), host.need + 1024 * MiB)
    assert verdict.fits is True
    assert verdict.sides[0].to_dict()["weights_shared"] is True


def test_a_deploy_says_whether_a_second_instance_would_fit(host: Host) -> None:
    rc, out = host.install("-c", "4096", "-np", "2")
    assert rc == 0, out
    assert "beside" not in out["memory"]  # nothing ran before the install
    rc, out = host.cli_json("set", "--check", "-c", "8192")
    assert (rc, out["outcome"]) == (0, "checked"), out
    seen = out["memory"]["beside"]
    assert seen["fits"] is True, seen
    assert seen["sides"][0]["weights_shared"] is True
    text = host.cli("set", "--check", "-c", "8192", "-v").stdout
    assert "a second instance beside the running one: fits: both KV pools fit, the host's" in text
