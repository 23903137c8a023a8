"""What a GPU build of llama-server prints, rendered from the printf formats in its source.

No GPU is lent to these tests, and the wheel they run is a CPU-only build: its
``--list-devices`` prints ``(none)`` and its log has no device buffers. So the lines a GPU
box produces are built here from the very formats llama.cpp b11434 prints them with (C's
``%zu`` is Python's ``%d``), each named with its place in the source:

- ``--list-devices``: common/arg.cpp:1156-1165 ``common_print_available_devices``:
  ``printf("Available devices:\\n")`` then, per non-CPU device,
  ``printf("  %s: %s (%zu MiB, %zu MiB free)\\n", name, description, total / MiB, free / MiB)``;
- the allocation lines (libllama INFO, printed at ``-lv 4``):
  src/llama-model.cpp:1932 ``"%s: %12s model buffer size = %8.2f MiB\\n"`` (``load_tensors``),
  src/llama-kv-cache.cpp:291 ``"%s: %10s KV buffer size = %8.2f MiB\\n"`` (``llama_kv_cache``),
  src/llama-context.cpp:742 ``"%s: %10s compute buffer size = %8.2f MiB\\n"`` (``sched_reserve``);
- ``llama-fit-params --fit-print on``: common/fit.cpp:1100-1112 ``common_fit_print``: per
  device ``"%s "``, ``"%zu "`` x 3 (model, context, compute MiB), ``"\\n"``, then ``Host``.

The device names and descriptions are the ones those backends report (ggml-cuda.cu names its
devices ``CUDA%d`` and describes them with the CUDA device name); the sizes are picked for
each case.
"""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30

LIST_HEADER = "Available devices:\n"
LIST_LINE = "  %s: %s (%d MiB, %d MiB free)\n"
MODEL_BUFFER = "%s: %12s model buffer size = %8.2f MiB\n"
KV_BUFFER = "%s: %10s KV buffer size = %8.2f MiB\n"
COMPUTE_BUFFER = "%s: %10s compute buffer size = %8.2f MiB\n"
FIT_PRINT_LINE = "%s %d %d %d \n"


def list_devices(*devices: tuple[str, str, int, int]) -> str:
    """``--list-devices`` for (name, description, total MiB, free MiB) devices."""
    if not devices:
        return LIST_HEADER + "  (none)\n"
    return LIST_HEADER + "".join(LIST_LINE % d for d in devices)


#: A discrete 48 GB GPU (ggml-cuda: "CUDA0", the CUDA device name).
RTX_6000 = ("CUDA0", "NVIDIA RTX 6000 Ada Generation", 48_510, 47_900)
#: An 8 GB GPU, too small for an 8B model at Q8_0 with its KV.
RTX_4060 = ("CUDA0", "NVIDIA GeForce RTX 4060", 7_935, 7_600)
#: Two 6 GB GPUs of one box.
TWO_SMALL = (
    ("CUDA0", "NVIDIA GeForce RTX 2060", 5_926, 5_800),
    ("CUDA1", "NVIDIA GeForce RTX 2060", 5_926, 5_800),
)
#: Seed 000's GB10: CUDA reports the 128 GB it shares with the CPU (MemTotal 122,502 MiB).
GB10 = ("CUDA0", "NVIDIA GB10", 122_502, 20_000)
GB10_MEMTOTAL = 122_502 * MiB
#: A backend the memory model does not know (a made-up NPU plugin; the line is the format's).
NPU = ("NPU0", "Example NPU", 16_384, 16_000)


def allocation_log(device: str = "CUDA0") -> list[str]:
    """The allocation lines of a fully offloaded 8B model at -lv 4, with the timestamp and
    level prefix llama-server puts before them (common/log.cpp: ``"%d.%02d.%03d.%03d "``,
    ``"I "``)."""
    lines = [
        MODEL_BUFFER % ("load_tensors", device, 7605.33),
        MODEL_BUFFER % ("load_tensors", "CPU_Mapped", 532.31),
        KV_BUFFER % ("llama_kv_cache", device, 4096.00),
        COMPUTE_BUFFER % ("sched_reserve", device, 304.00),
        COMPUTE_BUFFER % ("sched_reserve", "CUDA_Host", 72.01),
    ]
    return [f"0.00.{120 + i:03d}.000 I {line.rstrip()}" for i, line in enumerate(lines)]


def fit_print(*rows: tuple[str, int, int, int]) -> str:
    """``llama-fit-params --fit-print on`` stdout for (name, model, context, compute MiB)."""
    return "".join(FIT_PRINT_LINE % r for r in rows)
