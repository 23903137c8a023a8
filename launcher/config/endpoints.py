"""The introspection endpoint a managed config gets by default: llama-server's ``/metrics``.

The sampler (``launcher.watch``) reads decode and prefill tok/s from ``/metrics``' counters,
which exist only with ``--metrics`` (501 otherwise). It is safe to turn on wherever
``/slots`` is on (llama-server's default): both are served on the API's own address
(``--host``/``--port``, and through the front, which forwards every path), both need the
API key when one is set (b9093, b10405, b11434: neither is a public path), and ``/metrics``
shows less than ``/slots`` does (token counts and the queue, no sampling parameters). A
config that turns ``/slots`` off (``--no-slots``) says the operator wants the server's
inside closed, so it is left without ``/metrics`` too; the setting ``metrics_endpoint =
false`` turns the default off everywhere.
"""

from __future__ import annotations

from launcher import config


def with_metrics(cfg: config.AnyConfig, enabled: bool = True) -> config.AnyConfig:
    """``cfg`` with ``--metrics`` where it is safe (see the module docstring); a deploy and
    its previews (``render``, ``check``) apply it the same way."""
    if isinstance(cfg, config.VllmConfig):
        return cfg  # vLLM serves /metrics always
    if not enabled or cfg.metrics or cfg.slots is False:
        return cfg
    return cfg.model_copy(update={"metrics": True})
