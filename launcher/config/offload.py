"""Where each byte goes: the offload flags, layer by layer and tensor by tensor.

llama-server b11434 places a model this way (src/llama-model.cpp ``load_tensors``,
src/llama.cpp ``llama_model_load_from_file_impl``, src/llama-kv-cache.cpp:212-221):

- the devices are ``-dev A,B`` (``none``: no offload), else every non-CPU device of the build;
  ``-sm none`` keeps only the ``-mg`` device;
- ``-ngl N`` offloads the last N of the ``n_layer + 1`` layers (the extra one is the output
  layer); ``all`` and, with ``--fit off``, ``auto`` mean all of them. ``auto`` with fit on
  (the default) lets llama-server's fit choose N for the free device memory: this module
  cannot know N and says so;
- the offloaded layers are split over the devices by ``-ts`` proportions, else by the
  devices' free memory, as ``upper_bound(splits, (il - i_gpu_start) / n_gpu)``;
- the input layer (``token_embd``) always stays on the host; a model without ``output.weight``
  gets a copy of ``token_embd`` on the output layer's device;
- ``-ot PATTERN=BUFT`` (first match wins, ``std::regex_search`` on the tensor name),
  ``--cpu-moe`` and ``--n-cpu-moe N`` (``-ot`` patterns of common/common.h) move tensors to
  a buffer type: ``CPU`` (or a ``..._Host`` type) is the host, a device name is that device;
- each layer's KV cache sits on that layer's device, or on the host with ``-nkvo``.

Pure: the flags come from the typed config, the tensors' sizes from the GGUF, the devices
from ``launcher.server.devices``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from launcher import config
from launcher.errors import ConfigInvalid
from launcher.server.devices import Device

HOST = "host"
#: -fitt default: 1024 MiB kept free per device (common/common.h fit_params_target), here
#: the room for compute buffers the estimate leaves out, as llama-server's fit keeps it.
DEFAULT_FIT_TARGET_MIB = 1024
#: common/common.h LLM_FFN_EXPS_REGEX (--cpu-moe, and per layer --n-cpu-moe)
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
#: common/common.h LLM_FFN_DENSE_REGEX (--n-cpu-ffn)
FFN_DENSE_REGEX = r"\.ffn_(up|down|gate)\."
#: tensors of the input layer (src/llama-arch.cpp LLM_TENSOR_LAYER_INPUT), kept on the CPU
INPUT_TENSORS = re.compile(r"^(token_embd|token_types|position_embd|per_layer_token_embd)\b")
_BLOCK = re.compile(r"^blk\.(\d+)\.")

_VALUE_FLAGS = {
    "-ot": "override",
    "--override-tensor": "override",
    "-ncmoe": "n_cpu_moe",
    "--n-cpu-moe": "n_cpu_moe",
    "-ncffn": "n_cpu_ffn",
    "--n-cpu-ffn": "n_cpu_ffn",
    "-ts": "tensor_split",
    "--tensor-split": "tensor_split",
    "-sm": "split_mode",
    "--split-mode": "split_mode",
    "-mg": "main_gpu",
    "--main-gpu": "main_gpu",
    "-dev": "device",
    "--device": "device",
    "-fit": "fit",
    "--fit": "fit",
    "-fitt": "fit_target",
    "--fit-target": "fit_target",
}
_SWITCHES = {
    "-cmoe": "cpu_moe",
    "--cpu-moe": "cpu_moe",
    "-nkvo": "no_kv_offload",
    "--no-kv-offload": "no_kv_offload",
    "-kvo": "kv_offload",
    "--kv-offload": "kv_offload",
}


@dataclass(frozen=True)
class Offload:
    """The offload flags of a config, read the way common/arg.cpp reads them."""

    n_gpu_layers: int | None = None  # -ngl N; None: auto, or all with ``all_layers``
    all_layers: bool = False  # -ngl all (or <= -2)
    fit: bool = True
    devices: tuple[str, ...] | None = None  # -dev; () is -dev none
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    overrides: tuple[tuple[str, str], ...] = ()  # (pattern, buffer type), in order
    no_kv_offload: bool = False
    fit_target_mib: tuple[int, ...] = (DEFAULT_FIT_TARGET_MIB,)

    @property
    def layers_by_fit(self) -> bool:
        """-ngl auto with fit on: llama-server chooses the layers for the free memory."""
        return self.n_gpu_layers is None and not self.all_layers and self.fit

    def margin(self, index: int) -> int:
        """-fitt for device ``index`` in bytes: one value is for every device; in a list,
        the devices it does not reach keep the default (common/arg.cpp ``--fit-target``)."""
        t = self.fit_target_mib
        if len(t) == 1:
            return t[0] * (1 << 20)
        return (t[index] if index < len(t) else DEFAULT_FIT_TARGET_MIB) * (1 << 20)


def _words(args: Sequence[str]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, inline = word.partition("=")
        if name in _SWITCHES:
            out.append((name, None))
        elif name in _VALUE_FLAGS:
            if eq:
                out.append((name, inline))
            elif name in ("-fit", "--fit") and (i + 1 >= len(args) or args[i + 1].startswith("-")):
                out.append((name, "on"))
            elif i + 1 < len(args):
                out.append((name, args[i + 1]))
                i += 1
        i += 1
    return out


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigInvalid(f"{flag} {value!r} is not a whole number; e.g. {flag} 0") from None


def parse(cfg: config.ServerConfig) -> Offload:
    """The offload flags of ``cfg`` (``-ngl`` is typed; the rest come from extra_args)."""
    ngl, all_layers = None, False
    if cfg.n_gpu_layers == "all":
        all_layers = True
    elif cfg.n_gpu_layers not in (None, "auto"):
        n = int(cfg.n_gpu_layers)
        ngl, all_layers = (None, True) if n <= -2 else (None if n == -1 else n, False)
    values: dict[str, object] = {}
    overrides: list[tuple[str, str]] = []
    for name, value in _words(cfg.extra_args):
        key = _VALUE_FLAGS.get(name) or _SWITCHES[name]
        if key == "override":
            for item in (value or "").split(","):
                pattern, eq, buft = item.partition("=")
                if not eq:
                    raise ConfigInvalid(
                        f"-ot {item!r} is not PATTERN=BUFFER_TYPE; e.g. -ot 'exps=CPU'"
                    )
                overrides.append((pattern, buft))
        elif key == "cpu_moe":
            overrides.append((FFN_EXPS_REGEX, "CPU"))
        elif key in ("n_cpu_moe", "n_cpu_ffn"):
            regex = FFN_EXPS_REGEX if key == "n_cpu_moe" else FFN_DENSE_REGEX
            overrides += [(rf"blk\.{i}{regex}", "CPU") for i in range(_int(name, value or ""))]
        elif key == "kv_offload":
            values["no_kv_offload"] = False
        else:
            values[key] = True if value is None else value
    fit = str(values.get("fit", "on")).lower() not in ("off", "false", "0", "disabled")
    dev = values.get("device")
    devices: tuple[str, ...] | None = None
    if isinstance(dev, str):
        devices = () if dev == "none" else tuple(d for d in dev.split(",") if d)
    split = str(values.get("split_mode", "layer"))
    if split not in ("none", "layer", "row", "tensor"):
        raise ConfigInvalid(f"-sm {split!r} is not one of none, layer, row, tensor")
    ts = tuple(
        float(x) for x in re.split(r"[,/]+", str(values.get("tensor_split", ""))) if x.strip()
    )
    fitt = tuple(
        _int("-fitt", x) for x in re.split(r"[,/]+", str(values.get("fit_target", ""))) if x
    )
    return Offload(
        n_gpu_layers=ngl,
        all_layers=all_layers,
        fit=fit,
        devices=devices,
        split_mode=split,
        main_gpu=_int("-mg", str(values.get("main_gpu", 0))),
        tensor_split=ts,
        overrides=tuple(overrides),
        no_kv_offload=bool(values.get("no_kv_offload", False)),
        fit_target_mib=fitt or (DEFAULT_FIT_TARGET_MIB,),
    )


@dataclass(frozen=True)
class Layout:
    """Where the layers and bytes go: bytes per side (``HOST`` or a device name)."""

    weights: dict[str, int]
    kv: dict[str, int]
    layers: dict[str, int]  # offloaded layers per device (the output layer counts)
    devices: tuple[Device, ...]  # the devices llama-server will use
    unknown: tuple[str, ...] = field(default_factory=tuple)  # what the code cannot place


def active_devices(off: Offload, devices: Sequence[Device]) -> tuple[Device, ...]:
    """The devices llama-server uses under ``-dev``, ``-sm none`` and ``-mg``."""
    by_name = {d.name: d for d in devices}
    if off.devices is not None:
        missing = [n for n in off.devices if n not in by_name]
        if missing:
            have = ", ".join(by_name) or "none (a CPU-only build)"
            raise ConfigInvalid(
                f"-dev {','.join(off.devices)}: {missing[0]} is not a device of this "
                f"llama-server (it has: {have}); see llama-server --list-devices"
            )
        chosen = tuple(by_name[n] for n in off.devices)
    else:
        chosen = tuple(devices)
    if off.split_mode == "none" and chosen:
        if off.main_gpu < 0:
            return ()
        if off.main_gpu >= len(chosen):
            raise ConfigInvalid(
                f"-mg {off.main_gpu} is not a device index: there are {len(chosen)} "
                f"device(s); use -mg 0..{len(chosen) - 1}"
            )
        return (chosen[off.main_gpu],)
    return chosen


def layer_devices(off: Offload, devices: Sequence[Device], n_layer_all: int) -> list[str]:
    """The side of each of the ``n_layer_all + 1`` layers (the last is the output layer)."""
    n_gpu = n_layer_all + 1 if off.n_gpu_layers is None else max(0, off.n_gpu_layers)
    start = max(n_layer_all + 1 - n_gpu, 0)
    act = min(n_gpu, n_layer_all + 1) if devices else 0
    if any(off.tensor_split[: len(devices)]):
        raw = [
            off.tensor_split[i] if i < len(off.tensor_split) else 0.0 for i in range(len(devices))
        ]
    else:
        raw = [float(d.free) for d in devices]
    total = sum(raw) or 1.0
    splits, acc = [], 0.0
    for r in raw:
        acc += r
        splits.append(acc / total)
    out = []
    for il in range(n_layer_all + 1):
        if il < start or il - start >= act:
            out.append(HOST)
        else:
            i = bisect.bisect_right(splits, (il - start) / act)
            out.append(devices[min(i, len(devices) - 1)].name)
    return out


def _side_of_buffer(buft: str, devices: Sequence[Device]) -> str | None:
    if buft == "CPU" or buft.startswith("CPU_") or buft.endswith("_Host"):
        return HOST
    for d in devices:
        if buft == d.name:
            return d.name
    return None


def place(
    off: Offload,
    devices: Sequence[Device],
    tensors: Mapping[str, int],
    n_layer_all: int,
    kv_per_layer: Sequence[int] | None,
) -> Layout:
    """Bytes of weights and KV per side for ``off`` (``off.layers_by_fit`` must be False)."""
    used = active_devices(off, devices)
    sides = layer_devices(off, used, n_layer_all)
    weights: dict[str, int] = {HOST: 0, **{d.name: 0 for d in used}}
    kv: dict[str, int] = dict.fromkeys(weights, 0)
    unknown: set[str] = set()
    compiled = [(re.compile(p), b) for p, b in off.overrides]
    for name, size in tensors.items():
        side = _tensor_side(name, sides, n_layer_all)
        for pattern, buft in compiled:
            if pattern.search(name):
                moved = _side_of_buffer(buft, used)
                if moved is None:
                    unknown.add(f"-ot ...={buft}: a buffer type the code does not place")
                else:
                    side = moved
                break
        weights[side] += size
    if "output.weight" not in tensors and sides[n_layer_all] != HOST:
        # no output tensor: llama.cpp loads token_embd again for the output layer
        # (TENSOR_DUPLICATED, src/llama-model.cpp), on the output layer's device
        weights[sides[n_layer_all]] += tensors.get("token_embd.weight", 0)
    for il, size in enumerate(kv_per_layer or ()):
        kv[HOST if off.no_kv_offload else sides[il]] += size
    if off.split_mode in ("row", "tensor") and len(used) > 1:
        unknown.add(
            f"-sm {off.split_mode} splits each layer over the devices; the code places whole "
            "layers, so the per-device figures are approximate"
        )
    layers = {d.name: sum(1 for s in sides if s == d.name) for d in used}
    return Layout(weights, kv, layers, used, tuple(sorted(unknown)))


def _tensor_side(name: str, sides: Sequence[str], n_layer_all: int) -> str:
    if INPUT_TENSORS.match(name):
        return HOST
    m = _BLOCK.match(name)
    if m and int(m[1]) < n_layer_all:
        return sides[int(m[1])]
    return sides[n_layer_all]  # output_norm, output, and the rest of the output layer
