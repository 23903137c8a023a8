#!/usr/bin/python
"""Ansible module: deploy a llama-server config through llama-launcher's gate.

The module is a thin driver of the ``llama-launcher`` CLI on the target host: it writes the
desired config to a private temporary TOML file, runs ``deploy --config FILE --json`` (or
``rollback --json``) and maps the one JSON object on the last stdout line to Ansible's
``changed``/``failed``. Restart, gate and revert all happen inside that one command, so the
task needs no handler (Ansible ``rescue`` does not catch failures in handlers).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: llama_launcher
short_description: Deploy a llama-server config through llama-launcher's gate, or roll back
description:
  - Drives C(llama-launcher) on the target host through its JSON contract.
  - C(state=deployed) writes the desired config to a private temporary TOML file and runs
    C(llama-launcher deploy --config FILE --json). The launcher validates the config, and when
    the rendered env file differs from the live one it restarts the unit and runs the gate
    (the startup line equals the plan, /health, /props, a real chat completion). A failed gate
    restores the previous generation inside the same task, so the task fails with the host
    serving its old config.
  - A byte-identical config changes nothing and restarts nothing (C(changed=false)).
  - C(state=rolled_back) runs C(llama-launcher rollback --json) (to the last known-good
    generation, or O(rollback_to)); it always restarts, through the same gate.
  - Check mode runs C(deploy --check), which validates and diffs and touches nothing.
    With C(--diff) the task shows the live and the desired argv (one flag per line) and the
    KV pool plan of both; the desired argv is the one the deploy writes (its C(argv)), with
    what the deploy adds (the slot folder, the key file).
version_added: "0.1.0"
author: llama-launcher contributors
options:
  state:
    description:
      - V(deployed) deploys the desired config; V(rolled_back) rolls the unit back.
    type: str
    choices: [deployed, rolled_back]
    default: deployed
  rollback_to:
    description: Generation number for C(state=rolled_back) (C(rollback --to N)).
    type: int
  executable:
    description: The C(llama-launcher) executable (a name is looked up in PATH).
    type: str
    default: llama-launcher
  lane:
    description:
      - The name of the long-prompt lane that O(lane_address) sets (default V(lane)).
    type: str
  lane_address:
    description:
      - C(HOST:PORT) of a llama-server on another host that takes this unit's long prompts.
        After the deploy, the unit's front (C(install --front haproxy)) routes every request
        whose body is over O(lane_threshold) x O(lane_bytes_per_token) bytes there
        (C(llama-launcher install --lane NAME --lane-address HOST:PORT)); changed when the
        routing changed. A threshold alone that changed takes effect without a restart of
        HAProxy. Left out, the task leaves the front's routing as it is.
    type: str
  lane_threshold:
    description: Prompt tokens over which a request goes to the lane (default 4096).
    type: int
  lane_bytes_per_token:
    description: Bytes of the body the front counts for one token (default 4).
    type: int
  lane_slots:
    description: Requests the front sends the lane at once, its C(-np) (default 1).
    type: int
  unit:
    description:
      - The systemd unit, e.g. C(llama-server@chat.service) for C(install --instance chat).
      - Left out, the launcher's default, C(llama-server.service), as for C(install).
    type: str
  scope:
    description:
      - Which systemd manager to use. Left out, the launcher's default, as for C(install),
        which is V(system) for root on a host booted with systemd, else V(user).
    type: str
    choices: [system, user]
  env_file:
    description:
      - The live env file of the unit. Left out, the launcher's default, where C(install) puts
        it (C(/etc/llama-launcher/NAME.env) in system scope, NAME the instance or the unit).
      - Set it only for a unit installed with C(--env-file), to the same path.
    type: path
  state_dir:
    description:
      - Generations and the transaction record of the unit. Left out, the folder that manages
        the unit (recorded beside its env file by the first command, C(install)), else the
        launcher's default (C(/var/lib/llama-launcher/UNIT) in system scope, UNIT the unit's
        name without C(.service), e.g. C(llama-server@chat)).
      - A folder other than the recorded one is refused (exit 2), so a unit never gets a
        second history. Set it only for a unit installed with C(--state-dir), to the same path.
    type: path
  base_url:
    description: Probe URL (default from O(host)/O(port)).
    type: str
  start_timeout:
    description:
      - Seconds from the old process's exit until the startup line.
      - Default 4x the unit's last measured load, at least 120.
    type: float
  health_timeout:
    description: Seconds until /health answers 200 after the startup line.
    type: float
  probe_timeout:
    description: Seconds for the real chat completion.
    type: float
  lock_timeout:
    description:
      - Seconds to wait for another deploy of the same unit (the unit's own lock).
      - Default one deploy's budget.
    type: float
  settings_file:
    description: A llama-launcher settings TOML (C(LLAMA_LAUNCHER_SETTINGS)).
    type: path
  force_memory:
    description:
      - Deploy even when the memory guard says the config does not fit the host or a device
        (C(--force-memory)). The gate still checks the server that starts.
    type: bool
    default: false
  bake:
    description:
      - Watch the deployed config this long (V(30m), V(2h), seconds) against the previous
        one, and put the previous one back when it is worse under load (C(--bake DURATION
        --wait)). The task blocks until the verdict; a revert fails it (exit 6) with the
        verdict in its message and in RV(bake). V(0) or left out, no bake.
    type: str
  unified_memory:
    description:
      - Whether the devices' memory is the host's, so the guard counts it once
        (C(LLAMA_LAUNCHER_UNIFIED_MEMORY)). V(auto) takes a device as large as the host's
        MemTotal, or a Metal device, for unified memory.
    type: str
    choices: [auto, "yes", "no"]
  llama_server:
    description: The llama-server binary (default the launcher's own lookup).
    type: path
  model:
    description: C(-m), the GGUF model file. Required for C(state=deployed).
    type: path
  host:
    description: C(--host).
    type: str
  port:
    description:
      - C(--port), the port clients use. Behind a front (C(install --front haproxy)) the
        front's public port, or none, keeps llama-server on its private port; the diff's
        C(# address) line says which.
    type: int
  ctx_size:
    description: C(-c), total KV cells.
    type: int
  parallel:
    description: C(-np), slots (C(-1) auto).
    type: int
  kv_unified:
    description: C(-kvu) (true) or C(-no-kvu) (false).
    type: bool
  kv_unified_per_slot:
    description: C(--kv-unified-per-slot), the per-slot cap under a unified pool.
    type: int
  cache_type_k:
    description: C(-ctk).
    type: str
    choices: [f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1]
  cache_type_v:
    description: C(-ctv).
    type: str
    choices: [f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1]
  flash_attn:
    description:
      - C(-fa). YAML reads unquoted C(on)/C(off) as booleans; both spellings are accepted.
    type: raw
  n_gpu_layers:
    description: C(-ngl), a number, V(auto) or V(all).
    type: str
  threads:
    description: C(-t).
    type: int
  batch_size:
    description: C(-b).
    type: int
  ubatch_size:
    description: C(-ub).
    type: int
  cache_ram:
    description: C(-cram) MiB (C(-1) unlimited, C(0) off).
    type: int
  alias:
    description: C(-a), the model name clients see.
    type: str
  load_mode:
    description: C(-lm).
    type: str
    choices: [auto, none, mmap, mlock, mmap+mlock, dio]
  jinja:
    description: C(--jinja) (true) or C(--no-jinja) (false).
    type: bool
  chat_template_file:
    description: C(--chat-template-file).
    type: path
  slot_save_path:
    description:
      - C(--slot-save-path), where the deploy saves the slots' KV caches across a restart.
      - Default (unset) C(STATE_DIR/slots), in system scope the unit's
        C(StateDirectory=) (the launcher's setting C(carry_slots), on by default).
    type: path
  metrics:
    description: C(--metrics).
    type: bool
  slots:
    description: C(--slots) (true) or C(--no-slots) (false).
    type: bool
  api_key:
    description:
      - The API key. Written by the launcher to a 0600 file read by llama-server
        (C(--api-key-file)); never on a command line, never in the output.
    type: str
  api_key_file:
    description: A file holding the API key (C(--api-key-file)).
    type: path
  extra_args:
    description: Further llama-server flags, one word per item (typed flags are refused).
    type: list
    elements: str
  allow_overcommit:
    description: Accept a shared KV pool whose slots can exhaust it.
    type: bool
  backend:
    description:
      - The server the unit runs (C(install --backend)). Left out, the unit's recorded one.
      - V(vllm) takes the vLLM options below, O(model) as the model folder, and none of
        llama-server's.
    type: str
    choices: [llama-server, vllm]
  vllm_python:
    description: The python of the venv vLLM is installed in (C(--vllm-python)).
    type: path
  served_model_name:
    description: vLLM's C(--served-model-name), the name clients ask for.
    type: str
  max_model_len:
    description: vLLM's C(--max-model-len), one sequence's window.
    type: int
  max_num_seqs:
    description: vLLM's C(--max-num-seqs), the sequences scheduled at once.
    type: int
  kv_cache_dtype:
    description: vLLM's C(--kv-cache-dtype) (V(auto), V(fp8), ...).
    type: str
  kv_cache_memory_bytes:
    description: vLLM's KV budget, C(--kv-cache-memory-bytes) (V(24G), V(512M) or bytes).
    type: str
  gpu_memory_utilization:
    description: vLLM's C(--gpu-memory-utilization).
    type: float
  tensor_parallel_size:
    description: vLLM's C(--tensor-parallel-size).
    type: int
  dtype:
    description: vLLM's C(--dtype).
    type: str
  enforce_eager:
    description: vLLM's C(--enforce-eager).
    type: bool
  shutdown_timeout:
    description: vLLM's C(--shutdown-timeout), the seconds a stop drains (at most 50).
    type: int
notes:
  - Supports check mode and diff mode.
  - Options left out are not passed; the desired config is the whole config (C(deploy)),
    so a flag set earlier and left out now is removed.
  - The rollback target of C(state=rolled_back) is chosen by the launcher; running it twice
    rolls back twice. Use O(rollback_to) for a fixed generation.
requirements:
  - llama-launcher on the target host
"""

EXAMPLES = r"""
- name: Deploy the desired llama-server config through the gate
  llama_launcher:
    unit: llama-server.service
    model: /srv/models/qwen2.5-7b-instruct-q4_k_m.gguf
    port: 8080
    ctx_size: 32768
    parallel: 4
    cache_type_k: q8_0
    cache_type_v: q8_0
    flash_attn: "on"
    api_key: "{{ vault_llama_api_key }}"
  register: llama_deploy

- name: Roll an instance back to generation 3
  llama_launcher:
    state: rolled_back
    unit: llama-server@chat.service
    rollback_to: 3
"""

RETURN = r"""
outcome:
  description: deployed, unchanged, checked, rolled_back, rollback_failed, and with a bake
    reverted or revert_failed.
  returned: always
  type: str
  sample: deployed
message:
  description: The launcher's one-sentence summary.
  returned: always
  type: str
generation:
  description: The generation now live (for rolled_back, the one that failed).
  returned: when known
  type: int
  sample: 2
previous_generation:
  description: The generation that was live before.
  returned: when known
  type: int
  sample: 1
startup:
  description: What llama-server's startup line said (n_slots, n_ctx_slot, kv_unified, ...).
  returned: when the unit runs a launcher generation
  type: dict
planned:
  description: The KV pool plan of the desired config.
  returned: when the config validated
  type: dict
guaranteed_window:
  description: Tokens every slot is guaranteed (the per-slot window clients may use).
  returned: when the config validated
  type: int
  sample: 8192
client_window:
  description: The <env file name>.client-window.json published beside the state folders.
  returned: when deployed
  type: dict
probe:
  description: The gate's real chat completion (tokens, milliseconds).
  returned: when deployed
  type: dict
argv_diff:
  description: The launcher's argv diff (one flag per line, unified diff without context).
  returned: always
  type: list
  elements: str
  sample: ["--- live", "+++ new", "-c 4096", "+-c 8192"]
timings:
  description: Seconds per phase (validate, startup_line, healthy, completion, total).
  returned: always
  type: dict
memory:
  description: Memory of the service before and after (bytes).
  returned: when deployed
  type: dict
server_warnings:
  description: Warnings llama-server printed at startup (also shown as task warnings).
  returned: always
  type: list
  elements: str
failure:
  description: Why the gate refused the new config (phase, class, message, log_tail).
  returned: when outcome is rolled_back or rollback_failed
  type: dict
rollback:
  description: The result of restoring the previous generation (ok, startup or message).
  returned: when outcome is rolled_back or rollback_failed
  type: dict
recovered:
  description: An interrupted deploy the launcher finished or reverted first.
  returned: when there was one
  type: dict
rc:
  description: The exit status of llama-launcher (0, 2 invalid, 3 rolled back, 4, 5 lock).
  returned: always
  type: int
"""

CACHE_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]

#: The desired-config options: the keys of ``launcher.config.ServerConfig`` and, for a vLLM
#: unit, of ``launcher.config.vllm.VllmConfig``.
CONFIG_SPEC: dict[str, dict[str, Any]] = {
    "llama_server": {"type": "path"},
    "model": {"type": "path"},
    "host": {"type": "str"},
    "port": {"type": "int"},
    "ctx_size": {"type": "int"},
    "parallel": {"type": "int"},
    "kv_unified": {"type": "bool"},
    "kv_unified_per_slot": {"type": "int"},
    "cache_type_k": {"type": "str", "choices": CACHE_TYPES},
    "cache_type_v": {"type": "str", "choices": CACHE_TYPES},
    "flash_attn": {"type": "raw"},
    "n_gpu_layers": {"type": "str"},
    "threads": {"type": "int"},
    "batch_size": {"type": "int"},
    "ubatch_size": {"type": "int"},
    "cache_ram": {"type": "int"},
    "alias": {"type": "str"},
    "load_mode": {
        "type": "str",
        "choices": ["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"],
    },
    "jinja": {"type": "bool"},
    "chat_template_file": {"type": "path"},
    "slot_save_path": {"type": "path"},
    "metrics": {"type": "bool"},
    "slots": {"type": "bool"},
    "api_key": {"type": "str", "no_log": True},
    "api_key_file": {"type": "path"},
    "extra_args": {"type": "list", "elements": "str"},
    "allow_overcommit": {"type": "bool"},
    # a vLLM unit's (launcher.config.vllm.VllmConfig)
    "backend": {"type": "str", "choices": ["llama-server", "vllm"]},
    "vllm_python": {"type": "path"},
    "served_model_name": {"type": "str"},
    "max_model_len": {"type": "int"},
    "max_num_seqs": {"type": "int"},
    "kv_cache_dtype": {"type": "str"},
    "kv_cache_memory_bytes": {"type": "str"},
    "gpu_memory_utilization": {"type": "float"},
    "tensor_parallel_size": {"type": "int"},
    "dtype": {"type": "str"},
    "enforce_eager": {"type": "bool"},
    "shutdown_timeout": {"type": "int"},
}

#: The tool settings, passed as llama-launcher's own options.
SETTINGS_SPEC: dict[str, dict[str, Any]] = {
    "unit": {"type": "str"},
    "scope": {"type": "str", "choices": ["system", "user"]},
    "env_file": {"type": "path"},
    "state_dir": {"type": "path"},
    "base_url": {"type": "str"},
    "start_timeout": {"type": "float"},
    "health_timeout": {"type": "float"},
    "probe_timeout": {"type": "float"},
    "lock_timeout": {"type": "float"},
}

#: The long-prompt lane on another host: ``install --lane NAME --lane-address ...`` after
#: the deploy (the unit's front routes long prompts there).
LANE_SPEC: dict[str, dict[str, Any]] = {
    "lane": {"type": "str"},
    "lane_address": {"type": "str"},
    "lane_threshold": {"type": "int"},
    "lane_bytes_per_token": {"type": "int"},
    "lane_slots": {"type": "int"},
}

#: Exit status of llama-launcher -> what failed (launcher/cli/__init__.py).
EXIT_MEANING = {
    1: "llama-launcher failed",
    2: "invalid input; nothing was changed",
    3: "the deploy failed its gate; the previous config was restored and serves again",
    4: "the deploy failed and restoring the previous config failed too; nothing was deleted",
    5: "another deploy holds the lock of this unit",
    6: "the new config passed its gate but its bake found it worse under load; the "
    "previous config was put back and serves again",
    7: "the new config's bake found it worse under load, but its revert did not put the "
    "previous config back; the new config serves still",
}

#: Result keys handed back to Ansible as they are.
PASSTHROUGH = (
    "outcome",
    "message",
    "generation",
    "previous_generation",
    "startup",
    "planned",
    "client_window",
    "probe",
    "timings",
    "memory",
    "failure",
    "rollback",
    "recovered",
    "error",
    "step",
    "bake",
)


def argument_spec() -> dict[str, dict[str, Any]]:
    spec: dict[str, dict[str, Any]] = {
        "state": {"type": "str", "choices": ["deployed", "rolled_back"], "default": "deployed"},
        "rollback_to": {"type": "int"},
        "executable": {"type": "str", "default": "llama-launcher"},
        "settings_file": {"type": "path"},
        "force_memory": {"type": "bool", "default": False},
        "bake": {"type": "str"},
        "unified_memory": {"type": "str", "choices": ["auto", "yes", "no"]},
    }
    spec.update(LANE_SPEC)
    spec.update(SETTINGS_SPEC)
    spec.update(CONFIG_SPEC)
    return spec


# -- the desired config as TOML ----------------------------------------------------------------


def toml_value(value: Any) -> str:
    """One TOML value. JSON's string escapes are a subset of TOML basic strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    # TOML basic strings take any character but the controls (JSON escapes those, DEL aside);
    # ensure_ascii would write characters beyond the BMP as surrogate pairs, which TOML refuses
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def desired_config(params: dict[str, Any]) -> dict[str, Any]:
    """The config keys the task sets (None = not passed), with flash_attn spelled on/off."""
    data = {k: params[k] for k in CONFIG_SPEC if params.get(k) is not None}
    fa = data.get("flash_attn")
    if isinstance(fa, bool):
        data["flash_attn"] = "on" if fa else "off"
    elif fa is not None:
        data["flash_attn"] = str(fa)
    return data


def render_toml(data: dict[str, Any]) -> str:
    return "".join(f"{key} = {toml_value(value)}\n" for key, value in data.items())


# -- running llama-launcher --------------------------------------------------------------------


class Launcher:
    """Runs llama-launcher verbs on this host and reads their one JSON object."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        exe = module.params["executable"]
        self.exe = exe if "/" in exe else module.get_bin_path(exe, required=True)
        self.environ: dict[str, str] = {}
        if module.params["settings_file"]:
            self.environ["LLAMA_LAUNCHER_SETTINGS"] = module.params["settings_file"]
        if module.params["unified_memory"]:
            self.environ["LLAMA_LAUNCHER_UNIFIED_MEMORY"] = module.params["unified_memory"]

    def settings_args(self) -> list[str]:
        args: list[str] = []
        for key in SETTINGS_SPEC:
            value = self.module.params.get(key)
            if value is not None:
                args += ["--" + key.replace("_", "-"), str(value)]
        return args

    def run(self, *args: str) -> tuple[int, dict[str, Any], str, str]:
        """``llama-launcher ARGS`` -> (exit status, the JSON object or {}, stdout, stderr)."""
        argv = [self.exe, *args]
        rc, out, err = self.module.run_command(argv, environ_update=self.environ)
        lines = out.strip().splitlines()
        try:
            data = json.loads(lines[-1]) if lines else {}
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        return rc, data, out, err

    def json_verb(self, *args: str) -> tuple[int, dict[str, Any]]:
        """A ``--json`` verb; fail the task when it printed no JSON object."""
        rc, data, out, err = self.run(*args, "--json")
        if not data:
            self.module.fail_json(
                msg=f"llama-launcher {args[0]} printed no JSON (exit status {rc})",
                rc=rc,
                stdout=out[-4000:],
                stderr=err[-4000:],
                cmd=[self.exe, *args, "--json"],
            )
        return rc, data

    def status(self) -> dict[str, Any]:
        rc, data, _, _ = self.run("status", *self.settings_args(), "--json")
        return data if rc == 0 else {}

    def live_argv(self, env_file: str | None) -> list[str]:
        """The argv the unit's ExecStart builds from the live env file ([] if none)."""
        if not env_file or not os.path.exists(env_file):
            return []
        rc, _, out, _ = self.run("exec", "--env-file", env_file, "--print-argv")
        try:
            argv = json.loads(out.strip().splitlines()[-1]) if rc == 0 else None
        except (ValueError, IndexError):
            argv = None
        return [str(w) for w in argv] if isinstance(argv, list) else ["(unreadable env file)"]


# -- diff mode ---------------------------------------------------------------------------------


def is_flag(word: str) -> bool:
    """``launcher.host.envfile.is_flag``, which this module (run by Ansible's interpreter on the
    target, where the launcher's package need not import) cannot import; a test holds the
    two equal."""
    return word.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", word)


def argv_lines(argv: list[str]) -> list[str]:
    """One flag and its values per line (the grouping of the launcher's argv diff)."""
    lines: list[str] = []
    for word in argv:
        if is_flag(word) or not lines:
            lines.append(shlex.quote(word))
        else:
            lines[-1] += " " + shlex.quote(word)
    return lines


def plan_lines(planned: dict[str, Any] | None) -> list[str]:
    if not planned:
        return []
    unified = str(planned.get("kv_unified")).lower()
    lines = [
        f"# KV pool: {planned.get('n_slots')} slots x n_ctx_slot {planned.get('n_ctx_slot')}, "
        f"kv_unified {unified}, pool {planned.get('pool_cells')} cells"
        + (", over-committed" if planned.get("overcommitted") else ""),
        f"# guaranteed per-slot window: {planned.get('guaranteed_window')} tokens",
    ]
    front = planned.get("front")
    if isinstance(front, dict):
        # behind a front the task's port is the public one; the argv has the private one
        lines.append(
            f"# address: clients use {front.get('public')} (the front); llama-server "
            f"listens on {front.get('server')}"
        )
    return lines


def text(planned: dict[str, Any] | None, argv: list[str]) -> str:
    lines = plan_lines(planned) + argv_lines(argv)
    return "\n".join(lines) + "\n" if lines else ""


# -- the verbs ---------------------------------------------------------------------------------


def result_for_ansible(rc: int, data: dict[str, Any]) -> dict[str, Any]:
    ret: dict[str, Any] = {k: data.get(k) for k in PASSTHROUGH if k in data}
    ret["rc"] = rc
    recovered = data.get("recovered") or {}
    # reverting a killed deploy first restarted the unit: a change even when the desired
    # config then turned out to be the live one
    ret["changed"] = bool(data.get("changed", False)) or str(
        recovered.get("action", "")
    ).startswith("restored")
    ret["argv_diff"] = list(data.get("diff") or [])
    ret["server_warnings"] = list(data.get("warnings") or [])
    planned = data.get("planned") or {}
    if planned:
        ret["guaranteed_window"] = planned.get("guaranteed_window")
    return ret


def finish(module: AnsibleModule, rc: int, ret: dict[str, Any]) -> None:
    for warning in ret["server_warnings"]:
        module.warn(
            warning if warning.startswith("llama-launcher:") else f"llama-server: {warning}"
        )
    if rc == 0:
        module.exit_json(**ret)
    meaning = EXIT_MEANING.get(rc, f"llama-launcher exited with status {rc}")
    detail = ret.get("message") or ""
    module.fail_json(msg=f"{meaning}: {detail}" if detail else meaning, **ret)


def deploy(module: AnsibleModule, launcher: Launcher) -> None:
    data = desired_config(module.params)
    want_diff = bool(module._diff)
    before_status = launcher.status() if want_diff else {}
    env_file = module.params["env_file"] or before_status.get("env_file")
    before_argv = launcher.live_argv(env_file) if want_diff else []

    fd, path = tempfile.mkstemp(prefix="llama-launcher-", suffix=".toml", dir=module.tmpdir)
    try:
        os.fchmod(fd, 0o600)  # the TOML may hold the API key
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(render_toml(data))
        args = ["deploy", "--config", path, *launcher.settings_args()]
        if module.check_mode:
            args.append("--check")
        if module.params["force_memory"]:
            args.append("--force-memory")
        if module.params["bake"] not in (None, "", "0") and not module.check_mode:
            # a canary bakes before the play moves on: the task waits for the verdict
            args += ["--bake", module.params["bake"], "--wait"]
        rc, result = launcher.json_verb(*args)
        ret = result_for_ansible(rc, result)
        after_argv = before_argv
        if want_diff and ret["changed"] and module.check_mode:
            # the argv the deploy would write, its defaults included (launcher's --check)
            after_argv = [str(w) for w in result.get("argv") or []]
        elif want_diff and ret["changed"]:
            after_argv = launcher.live_argv(env_file)
    finally:
        if os.path.exists(path):
            os.unlink(path)

    if rc == 0 and module.params["lane_address"]:
        route_lane(module, launcher, ret)
    if ret.get("outcome") == "unchanged" and not ret.get("startup"):
        # an unchanged deploy reports only the plan; the live generation has the rest
        live = before_status or launcher.status()
        ret["startup"] = live.get("startup")
        ret.setdefault("generation", live.get("live_generation"))
    if want_diff:
        after_plan = ret.get("planned") if ret["changed"] else before_status.get("planned")
        unit = before_status.get("unit") or module.params.get("unit") or "llama-server"
        ret["diff"] = {
            "before_header": f"{unit} (live)",
            "after_header": f"{unit} (desired)",
            "before": text(before_status.get("planned"), before_argv),
            "after": text(after_plan, after_argv),
        }
    finish(module, rc, ret)


def route_lane(module: AnsibleModule, launcher: Launcher, ret: dict[str, Any]) -> None:
    """The unit's front routes long prompts to ``lane_address`` (``install --lane NAME
    --lane-address``): changed when the front's routing changed. Check mode says what it
    would route and changes nothing."""
    p = module.params
    name = p["lane"] or "lane"
    if module.check_mode:
        ret["lane"] = {"lane": name, "address": p["lane_address"], "checked": True}
        return
    args = ["install", "--lane", name, "--lane-address", p["lane_address"]]
    for key in ("lane_threshold", "lane_bytes_per_token", "lane_slots"):
        if p[key] is not None:
            args += ["--" + key.replace("_", "-"), str(p[key])]
    rc, data = launcher.json_verb(*args, *launcher.settings_args())
    if rc != 0:
        meaning = EXIT_MEANING.get(rc, f"llama-launcher exited with status {rc}")
        module.fail_json(msg=f"the lane: {meaning}: {data.get('message', '')}", rc=rc, **ret)
    front = data.get("front") or {}
    ret["lane"] = {"lane": name, "address": p["lane_address"], **front}
    ret["changed"] = ret["changed"] or bool(front.get("changed"))


def rollback(module: AnsibleModule, launcher: Launcher) -> None:
    if module.check_mode:
        # rollback has no --check; it always restarts through the gate
        module.exit_json(
            changed=True,
            outcome="checked",
            message="check mode: would roll back (a rollback always restarts the unit)",
            rc=0,
        )
    args = ["rollback", *launcher.settings_args()]
    if module.params["rollback_to"] is not None:
        args += ["--to", str(module.params["rollback_to"])]
    rc, result = launcher.json_verb(*args)
    finish(module, rc, result_for_ansible(rc, result))


def main() -> None:
    module = AnsibleModule(
        argument_spec=argument_spec(),
        supports_check_mode=True,
        required_if=[("state", "deployed", ["model"])],
        mutually_exclusive=[("api_key", "api_key_file")],
    )
    launcher = Launcher(module)
    if module.params["state"] == "rolled_back":
        rollback(module, launcher)
    else:
        deploy(module, launcher)


if __name__ == "__main__":
    main()
