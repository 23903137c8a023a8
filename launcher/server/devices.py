"""The memory sides of a box: the host and the devices llama-server can offload to.

``llama-server --list-devices`` is the binary's own view (llama.cpp b11434,
common/arg.cpp ``common_print_available_devices``)::

    Available devices:
      CUDA0: NVIDIA H100 80GB HBM3 (81089 MiB, 80590 MiB free)

printed with ``printf("  %s: %s (%zu MiB, %zu MiB free)\\n", name, description, total / MiB,
free / MiB)`` for every device that is not a CPU, or ``  (none)`` when there is none (a
CPU-only build, as the wheel the tests run). The listing does not say whether a device is an
integrated GPU whose memory is the host's (ggml's ``GGML_BACKEND_DEVICE_TYPE_IGPU`` is not
printed), so ``unified`` is decided here: a Metal device always, any device whose total is
the host's ``MemTotal`` (within ``UNIFIED_TOLERANCE``: an NVIDIA GB10 reports the 128 GB it
shares with the CPU), or what the operator says (``unified_memory`` in the tool settings).

``llama-fit-params --fit-print on`` is the build's own estimate (tools/fit-params,
common/fit.cpp ``common_fit_print``): one line per device then the host, each
``"%s %zu %zu %zu \\n"`` of name, model, context and compute MiB (``Host 1 1 5`` for the tiny
test model on the CPU build).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from launcher.errors import ConfigInvalid

MiB = 1 << 20
LIST_HEADER = "Available devices:"
#: common/arg.cpp common_print_available_devices: "  %s: %s (%zu MiB, %zu MiB free)\n"
_DEVICE_LINE = re.compile(
    r"^  (?P<name>\S+): (?P<description>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)$"
)
_NONE_LINE = "  (none)"
#: common/fit.cpp common_fit_print: "%s %zu %zu %zu \n" (device, model, context, compute MiB)
_FIT_LINE = re.compile(r"^(?P<name>\S+) (?P<model>\d+) (?P<context>\d+) (?P<compute>\d+) ?$")
#: Backends whose buffers the model below knows how to place: ggml's device names are the
#: backend's name and an index (ggml-cuda.cu "CUDA%d", ggml-vulkan "Vulkan%d", ggml-sycl
#: "SYCL%d", the HIP build of ggml-cuda "ROCm%d", ggml-metal "MTL%d").
KNOWN_BACKENDS = ("CUDA", "ROCm", "Vulkan", "SYCL", "MTL", "Metal")
#: A device whose total memory is within this share of the host's MemTotal is taken to be
#: the host's memory (an integrated GPU; CUDA on GB10 reports the shared 128 GB).
UNIFIED_TOLERANCE = 0.05

UnifiedSetting = Literal["auto", "yes", "no"]


@dataclass(frozen=True)
class Device:
    """One device of ``--list-devices``; sizes in bytes (the listing's MiB)."""

    name: str
    description: str
    total: int
    free: int
    unified: bool = False  # its memory is the host's: counted on the host side, once

    @property
    def backend(self) -> str:
        """``CUDA`` of ``CUDA0``: the ggml backend the name comes from."""
        return self.name.rstrip("0123456789")

    @property
    def known(self) -> bool:
        return self.backend in KNOWN_BACKENDS

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "total_mib": self.total // MiB,
            "free_mib": self.free // MiB,
            "unified": self.unified,
            "backend": self.backend,
        }


@dataclass(frozen=True)
class Host:
    """The host side: ``MemAvailable`` and ``MemTotal`` (bytes)."""

    available: int
    total: int


def parse_list(text: str, source: str = "llama-server --list-devices") -> tuple[Device, ...]:
    """The devices of a ``--list-devices`` output; ``()`` for ``(none)``.

    Raises ``ConfigInvalid`` naming the line when the text is not that listing.
    """
    lines = [line.rstrip("\r") for line in text.splitlines() if line.strip()]
    try:
        start = lines.index(LIST_HEADER)
    except ValueError:
        raise ConfigInvalid(
            f"{source} has no '{LIST_HEADER}' line; give the output of "
            "`llama-server --list-devices` (saved to a file)"
        ) from None
    devices: list[Device] = []
    for line in lines[start + 1 :]:
        if line == _NONE_LINE:
            return ()
        m = _DEVICE_LINE.match(line)
        if m is None:
            if not line.startswith("  "):
                break  # the listing ended (a build may print more after it)
            raise ConfigInvalid(
                f"{source}: {line.strip()!r} is not a device line "
                "('  NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)')"
            )
        devices.append(
            Device(m["name"], m["description"], int(m["total"]) * MiB, int(m["free"]) * MiB)
        )
    return tuple(devices)


def mark_unified(
    devices: tuple[Device, ...], host_total: int, setting: UnifiedSetting = "auto"
) -> tuple[Device, ...]:
    """Decide for each device whether its memory is the host's (see the module docstring)."""
    out = []
    for d in devices:
        if setting == "auto":
            same = host_total > 0 and abs(d.total - host_total) <= UNIFIED_TOLERANCE * host_total
            unified = d.backend in ("MTL", "Metal") or same
        else:
            unified = setting == "yes"
        out.append(Device(d.name, d.description, d.total, d.free, unified))
    return tuple(out)


def read_list_file(path: Path) -> tuple[Device, ...]:
    """``plan --devices FILE``: a saved ``--list-devices`` output."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigInvalid(
            f"--devices {path} cannot be read ({e.strerror}); save the output of "
            "`llama-server --list-devices` there"
        ) from e
    return parse_list(text, f"--devices {path}")


@dataclass(frozen=True)
class FitLine:
    """One line of ``llama-fit-params --fit-print on`` (bytes; the tool prints MiB)."""

    name: str  # a device name, or "Host"
    model: int
    context: int
    compute: int

    @property
    def total(self) -> int:
        return self.model + self.context + self.compute

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model_mib": self.model // MiB,
            "context_mib": self.context // MiB,
            "compute_mib": self.compute // MiB,
        }


def parse_fit_print(text: str) -> tuple[FitLine, ...]:
    """The lines of ``llama-fit-params --fit-print on`` (stdout); ends with the Host line."""
    out = []
    for line in text.splitlines():
        if m := _FIT_LINE.match(line.rstrip("\r")):
            out.append(
                FitLine(
                    m["name"],
                    int(m["model"]) * MiB,
                    int(m["context"]) * MiB,
                    int(m["compute"]) * MiB,
                )
            )
    if not out or out[-1].name != "Host":
        raise ConfigInvalid(
            "llama-fit-params printed no 'Host MODEL CONTEXT COMPUTE' line; "
            f"its output was: {text.strip()[-300:]!r}"
        )
    return tuple(out)
