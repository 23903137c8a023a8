"""llama-launcher: a systemd-supervised launcher and safe config deployer for llama-server."""

__version__ = "0.10.0"
