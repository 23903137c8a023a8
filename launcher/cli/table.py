"""Every verb of ``llama-launcher`` as data (``launcher.cli.verbs``), in the order ``--help``
lists them: name, group, help, options and the function that runs it. The functions live
in the modules beside this one and import the core they call inside themselves, so
building the parser costs none of it.
"""

from __future__ import annotations

from pathlib import Path

# whole modules, not `from launcher.cli import ...`: that reads as an import of the package's
# face (launcher.cli), which imports this table: a loop in tests/test_layout.py's graph
import launcher.cli.bench as bench
import launcher.cli.deploy as deploy
import launcher.cli.diagnose as diagnose
import launcher.cli.guide as guide
import launcher.cli.plan as plan
import launcher.cli.units as units
import launcher.cli.watch as watch
from launcher.cli.verbs import Group, Verb, arg, options

# -- the option sets ---------------------------------------------------------------------------

#: Where the unit is; ``launcher.cli.GLOBAL_OPTIONS`` names them (they may come before the verb).
WHERE = options(
    arg("--unit", help="systemd unit (default llama-server.service)"),
    arg(
        "--instance",
        metavar="NAME",
        help="the instance llama-server@NAME.service of the template unit (install "
        "--instance NAME makes it)",
    ),
    arg(
        "--lane",
        metavar="NAME",
        help="the long-prompt lane NAME of the unit, a unit of its own (install --lane NAME "
        "makes it, uninstall --lane NAME removes it)",
    ),
    arg("--scope", choices=["system", "user"], help="systemd manager to use"),
    arg("--env-file", type=Path, help="the live env file"),
    arg(
        "--state-dir",
        type=Path,
        help="generations and the transaction record (default: the one recorded beside the "
        "env file; another is refused)",
    ),
    arg("--base-url", help="probe URL (default: from --host/--port)"),
    arg(
        "--start-timeout",
        type=float,
        help="seconds from the old process gone until the startup line (default: 4x the "
        "unit's last measured load, at least 120; a rollback gets its own generation's)",
    ),
    arg(
        "--health-timeout",
        type=float,
        help="seconds from the startup line until /health 200 (default: 4x the last "
        "measured, at least 300)",
    ),
    arg("--probe-timeout", type=float, help="seconds for the real completion"),
    arg(
        "--lock-timeout",
        type=float,
        help="seconds to wait for another deploy (default: one deploy's budget)",
    ),
    title="where (also LLAMA_LAUNCHER_* variables or settings.toml; before the verb as well)",
)
JSON = options(arg("--json", action="store_true", help="print one JSON object"))
VERBOSE = options(
    arg(
        "-v",
        "--verbose",
        action="store_true",
        help="every line of the outcome, not only those that carry news (llama-server's own "
        "-v is --log-verbose)",
    )
)
#: The settings of a verb that names a unit, and its output.
SETTINGS = (WHERE, JSON, VERBOSE)

CONFIG = options(
    arg("--config", type=Path, help="a TOML file with the whole desired config"),
    arg("--llama-server", dest="llama_server_bin", type=Path, help="the llama-server binary"),
    arg(
        "--backend",
        choices=("llama-server", "vllm"),
        help="the server the unit runs (install records it; default: the recorded one, else "
        "llama-server); vllm takes vLLM's flags: MODEL_FOLDER --max-num-seqs N ...",
    ),
    arg(
        "--vllm-python",
        type=Path,
        help="the python of the venv vLLM is installed in (default: $LLAMA_LAUNCHER_VLLM_PYTHON)",
    ),
    arg(
        "--allow-overcommit",
        action="store_true",
        help="accept a shared KV pool whose slots can exhaust it",
    ),
)
OVERCOMMIT = options(
    arg(
        "--allow-overcommit",
        action="store_true",
        help="accept a shared KV pool whose slots can exhaust it",
    )
)
MEMORY = options(
    arg(
        "--force-memory",
        action="store_true",
        help="go ahead even if the memory estimate exceeds what the box can give",
    )
)
MODE = options(
    arg(
        "--check",
        action="store_true",
        help="validate and diff only; change nothing (like ansible --check)",
    ),
    arg("--diff", action="store_true", help="show the argv diff (like ansible --diff)"),
)
#: The handover of a restart (launcher/deploy/restart/handover.py).
DRAIN = options(
    arg(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="wait at most this long for requests in flight to finish (default 120)",
    ),
    arg(
        "--no-drain",
        action="store_true",
        help="restart at once, cutting requests in flight (and saving no slot caches)",
    ),
    title="before the restart",
)
#: The bake after the gate (launcher/watch/bake.py).
BAKE = options(
    arg(
        "--bake",
        metavar="DURATION",
        help="watch the new config this long (30m, 2h, seconds; max 24h) against the "
        "previous one and put the previous one back when it is worse under load; the "
        "sampler carries it (default: the setting bake; 0: off)",
    ),
    arg(
        "--wait", action="store_true", help="wait for the bake's verdict (exit 6 when it reverted)"
    ),
    title="after the gate",
)
UNIT_DIR = options(arg("--unit-dir", type=Path, help="where the unit file goes"))
SITE = options(
    arg(
        "--read-only-path",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="bind DIR read-only into the service (models under /tmp or /var/tmp)",
    ),
    arg(
        "--no-memory-deny-write-execute",
        dest="mdwe",
        action="store_false",
        help="for GPU drivers that compile code at run time (ROCm/HIP is reported to)",
    ),
    arg("--allow-nice", action="store_true", help="grant CAP_SYS_NICE, for llama-server --prio"),
    title="site settings of the hardened system unit",
)
INSTALL = options(
    arg("--force", action="store_true", help="replace a unit file that was edited by hand"),
)
FRONT = options(
    arg(
        "--front",
        choices=["none", "haproxy"],
        default="none",
        help="haproxy: HAProxy holds the address and holds requests during deploys; "
        "llama-server moves to a private one (default none)",
    ),
    arg(
        "--second-instance",
        action="store_true",
        help="with --front haproxy: a second instance (NAME-b.service, on a port of its "
        "own) serves the live config while the unit restarts, so nothing is held, and "
        "keeps it warm after (keep_warm): a rollback then is a switch (setting handover)",
    ),
    arg(
        "--admission",
        action="store_true",
        help="with --front haproxy: admit each generation only when its worst case fits "
        "what the shared KV pool has left, others wait at the front; an over-committed "
        "pool is then allowed (guide 05-kv-pools)",
    ),
    arg(
        "--admission-queue",
        type=int,
        metavar="N",
        help="with --admission: requests that may wait at once (default 64); past it, 503",
    ),
    arg(
        "--admission-wait",
        type=float,
        metavar="SECONDS",
        help="with --admission: how long a request may wait (default 120); past it, 503",
    ),
)
#: The long-prompt lane's routing (launcher/deploy/restart/lane.py).
LANE = options(
    arg(
        "--lane-threshold",
        type=int,
        metavar="TOKENS",
        help="with --lane: a request whose prompt may be longer goes to the lane (default "
        "4096); the front sees the body's bytes: over TOKENS x --lane-bytes-per-token",
    ),
    arg(
        "--lane-bytes-per-token",
        type=int,
        metavar="N",
        help="with --lane: the bytes of the body the front counts for one token (default 4, "
        "English and code; lower for text whose tokens are shorter)",
    ),
    arg(
        "--lane-wait",
        type=float,
        metavar="SECONDS",
        help="with --lane: how long a lane request waits at the front for a lane that is "
        "down, beyond a deploy's hold (default 120); past it, 503",
    ),
    arg(
        "--lane-address",
        metavar="HOST:PORT",
        help="with --lane: the lane is this server on another host (no unit here)",
    ),
    arg(
        "--lane-slots",
        type=int,
        metavar="N",
        help="with --lane-address: the requests the front sends it at once, its -np "
        "(default 1; a lane of this host takes its own -np)",
    ),
    title="the long-prompt lane (with --lane NAME)",
)
#: The options of the verbs that have their own only.
PLAN = options(
    arg("--slots", required=True, metavar="N", help="clients served at once (-np)"),
    arg(
        "--window", required=True, metavar="W", help="tokens each client needs, e.g. 262144 or 256k"
    ),
    arg("--cache", default="f16", metavar="TYPE", help="KV cache type (default f16)"),
    arg("--model", metavar="FILE", help="the GGUF model, for the memory estimate"),
    arg(
        "--mem-available",
        metavar="MIB",
        help="memory to plan for in MiB (default: MemAvailable of this machine)",
    ),
    arg(
        "--cache-ram",
        metavar="MIB",
        help="llama-server's host prompt cache (-cram) in MiB, counted as used "
        "(default 8192, llama-server's; 0 turns it off and adds --cache-ram 0 to the lines)",
    ),
    arg(
        "--devices",
        metavar="FILE",
        help="the output of `llama-server --list-devices` saved to a file: plan for those "
        "devices (another box's GPUs)",
    ),
    arg(
        "--llama-server",
        metavar="BIN",
        help="the llama-server to plan for: only its flags are offered, and without --devices "
        "the devices it sees now (its --list-devices); default for the flags: "
        "$LLAMA_SERVER_BIN; without either a build with --kv-unified-per-slot is assumed",
    ),
    arg("--ngl", metavar="N", help="layers offloaded to the devices (-ngl; default all)"),
    arg(
        "--unified-memory",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether the devices' memory is the host's (auto: a device as large as the "
        "host's MemTotal, or Metal)",
    ),
    arg("--json", action="store_true", help="one JSON object"),
)
DIAGNOSE = (
    options(
        arg(
            "--unit",
            help="read this systemd unit's journal (system or --user; default: the configured "
            "unit, LLAMA_LAUNCHER_UNIT or settings.toml, else llama-server.service)",
        ),
        arg("--instance", metavar="NAME", help="read the journal of llama-server@NAME.service"),
        arg("--log", metavar="FILE", help="read a log file ('-' for stdin)"),
        arg("stdin", nargs="?", choices=["-"], help="read stdin"),
        exclusive=True,
    ),
    options(
        arg("--since", metavar="TIME", help="with --unit: journalctl --since TIME"),
        arg(
            "--pool",
            type=int,
            metavar="N",
            help="the KV pool in cells, when the log does not state it (-c)",
        ),
        arg(
            "--model",
            metavar="GGUF",
            help="the model, to price each fix in KV memory (default: the live generation's)",
        ),
        arg(
            "--llama-server",
            metavar="PATH",
            help="the llama-server the fixes are for: only its flags are offered (default: the "
            "live generation's, else $LLAMA_SERVER_BIN)",
        ),
        arg("--json", action="store_true", help="one JSON object"),
    ),
)
BENCH = options(
    arg(
        "--url",
        help="server base URL (default: the --unit's live generation, else http://127.0.0.1:8080)",
    ),
    arg("--unit", help="a unit llama-launcher deployed: measure its live generation and name it"),
    arg("--instance", metavar="NAME", help="the same for llama-server@NAME.service"),
    arg("--api-key-file", metavar="F", help="file holding the server's --api-key"),
    arg(
        "--agents",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        metavar="N",
        help="agent counts to measure (default: 1 2 4)",
    ),
    arg("--max-tokens", type=int, default=64, metavar="N", help="tokens per answer (%(default)s)"),
    arg(
        "--prompt-tokens",
        type=int,
        metavar="N",
        help="size each agent's prompt to about N tokens (default: one chat line)",
    ),
    arg(
        "--long-prompt",
        type=int,
        metavar="TOKENS",
        help="also measure with one extra agent sending a prompt of about TOKENS tokens",
    ),
    arg("--rounds", type=int, default=1, metavar="R", help="rounds per agent count (%(default)s)"),
    arg(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds per request (%(default)s)",
    ),
    arg("--json", action="store_true", help="print one JSON object"),
    arg("--plot", metavar="FILE.png", help="write a PNG of tok/s against agents"),
)
SAMPLE = options(
    arg(
        "--textfile-dir",
        type=Path,
        metavar="DIR",
        help="write llama_launcher_<unit>.prom there (default: the setting "
        "metrics_textfile_dir; unset: no metrics file)",
    ),
    arg(
        "--wedged-samples",
        type=int,
        metavar="N",
        help="restart the unit after N samples in a row in which its server lives but does "
        "not answer (during a bake: revert it); 0: off (default: the setting wedged_samples; "
        "install renders it into the sampler's service)",
    ),
    arg(
        "--every",
        type=float,
        metavar="SECONDS",
        help="sample again every SECONDS until stopped, in this one process (its imports "
        "paid once: for intervals of seconds, where a process per sample costs more)",
    ),
)
#: The units' own two (``launcher.__main__`` runs them before the CLI loads; these are
#: for ``--help`` and ``launcher.cli.main``): their options are their parsers'.
EXEC = options(
    arg("--env-file", required=True),
    arg("--port", help="listen on this port whatever the env file says"),
    arg("--print-argv", action="store_true"),
)
PRESTART = options(
    arg("--env-file", required=True, help="the live env file"),
    arg("--state-dir", required=True, help="the unit's state folder (its txn.json)"),
    arg("--lock", help="the unit's deploy lock (default: STATE_DIR/lock)"),
    arg("--stage-key", help="stage the env file's API key file here, for LoadCredential="),
)
FLAGS_NOTE = (
    " LLAMA-SERVER FLAGS follow, in llama-server's own spellings (-c, -np, -ctk...); a vLLM "
    "unit's are vLLM's, its model folder first (--backend vllm)."
)

# -- the verbs ---------------------------------------------------------------------------------

EVERYDAY = (
    Verb(
        "install",
        Group.EVERYDAY,
        "first deployment on a host: validate first (a refusal changes nothing), then "
        "install the unit, its sampler timer (and the front's units with --front), create "
        "the env and state folders, enable it and deploy through the gate." + FLAGS_NOTE,
        deploy.cmd_install,
        (CONFIG, UNIT_DIR, INSTALL, SITE, FRONT, LANE, DRAIN, *SETTINGS, MEMORY),
        flags=True,
    ),
    Verb(
        "set",
        Group.EVERYDAY,
        "change some flags of the live config and deploy it, e.g. "
        "llama-launcher set -ctk q8_0 -ctv q8_0",
        deploy.cmd_set,
        (OVERCOMMIT, MODE, DRAIN, BAKE, *SETTINGS, MEMORY),
        flags=True,
    ),
    Verb(
        "unset",
        Group.EVERYDAY,
        "remove flags from the live config and deploy it, e.g. llama-launcher unset -ctk -ctv",
        deploy.cmd_unset,
        (MODE, DRAIN, BAKE, *SETTINGS, MEMORY),
        flags=True,
    ),
    Verb(
        "deploy",
        Group.EVERYDAY,
        "deploy a whole desired config through the gate (the Ansible path)." + FLAGS_NOTE,
        deploy.cmd_deploy,
        (CONFIG, MODE, DRAIN, BAKE, *SETTINGS, MEMORY),
        flags=True,
    ),
    Verb(
        "rollback",
        Group.EVERYDAY,
        "go back to the last known-good generation (or --to N): put back its stored env "
        "file bytes (strict parse and bash -n; no memory guard: it served) and gate them",
        deploy.cmd_rollback,
        (
            options(arg("--to", type=int, metavar="N", help="generation number (see history)")),
            DRAIN,
            *SETTINGS,
        ),
    ),
    Verb(
        "status",
        Group.EVERYDAY,
        "unit state, live generation, startup values, the guaranteed "
        "per-slot window, process memory, the front's hold and the live pool (the slots "
        "now, the last hour's peaks, the sampler's last run)",
        deploy.cmd_status,
        SETTINGS,
    ),
    Verb(
        "history",
        Group.EVERYDAY,
        "generations with time, outcome and argv diff",
        deploy.cmd_history,
        SETTINGS,
    ),
    Verb(
        "top",
        Group.EVERYDAY,
        "the KV pool and every slot, refreshed every second (q to quit); the peak of the "
        "last hour from the live record",
        watch.cmd_top,
        (
            options(
                arg("--interval", type=float, default=1.0, help="seconds between two frames"),
                arg("--once", action="store_true", help="print one frame and exit"),
            ),
            *SETTINGS,
        ),
    ),
    Verb(
        "compare",
        Group.EVERYDAY,
        "two generations side by side from their live records: decode tok/s, errors per "
        "1,000 requests, peak pool, memory; says when either has too little data",
        watch.cmd_compare,
        (
            options(
                arg("a", type=int, metavar="A", help="a generation (see history)"),
                arg("b", type=int, metavar="B", help="the other one"),
            ),
            *SETTINGS,
        ),
    ),
    Verb(
        "guide",
        Group.EVERYDAY,
        "the guides that ship with the tool: without a TOPIC their list, with one (a "
        "prefix is enough) its text",
        guide.cmd_guide,
        (
            options(
                arg("topic", nargs="?", metavar="TOPIC", help="a guide's topic (see the list)")
            ),
            JSON,
            VERBOSE,
        ),
    ),
)

PLANNING = (
    Verb(
        "plan",
        Group.PLANNING,
        "compare shared, split and per-slot KV pools for N slots x W tokens",
        plan.handle,
        (PLAN, VERBOSE),
        description="Lay out the options for N clients that each need a W-token window: the "
        "shared over-committed pool, split pools, the per-slot cap at f16/q8_0/q4_0, fewer "
        "slots and a smaller window; with --model, the KV memory of each and what is left "
        "of MemAvailable; with --devices (or --llama-server) also on each device, the "
        "weights and KV placed as -ngl places them, and which side limits. Changes nothing.",
    ),
    Verb(
        "check",
        Group.PLANNING,
        "validate a config and show the argv diff against the live env "
        "file; change nothing live (an api_key: the salt of key-file names, as render)."
        + FLAGS_NOTE,
        deploy.cmd_check,
        (CONFIG, *SETTINGS, MEMORY),
        flags=True,
    ),
    Verb(
        "render",
        Group.PLANNING,
        "print the env file a deploy of a config writes (with the deploy's defaults: the "
        "slot folder, the key file); change nothing live (a config with an api_key makes "
        "the state folder's salt of key-file names once, if the folder exists, so the "
        "name shown is the one the deploy writes)." + FLAGS_NOTE,
        deploy.cmd_render,
        (CONFIG, *SETTINGS),
        flags=True,
    ),
    Verb(
        "diagnose",
        Group.PLANNING,
        "read llama-server's log: count context errors, add up the slots, name the fix",
        diagnose.run,
        (*DIAGNOSE, VERBOSE),
        description="Read a llama-server log (a unit's journal, a file, or stdin) and explain "
        "every 'Context size has been exceeded' failure: the startup promise, the "
        "batch-halving cascade, the slot release lines that add up to the pool, the class, "
        "and the fix.",
    ),
    Verb(
        "bench",
        Group.PLANNING,
        "measure total and per-agent tok/s, latency and time to first token with N agents",
        bench.run,
        (BENCH, VERBOSE),
        description="Send concurrent streamed chat completions to any OpenAI-compatible "
        "llama-server and report, per number of agents: total tok/s, mean per-agent tok/s, "
        "wall time, p50/p95 latency and time to first token. Tokens are the server's own "
        "usage counts. With --long-prompt, one extra agent sends a long prompt while the "
        "others chat, and the others' latency and time to first token are shown with and "
        "without it: llama-server reads a long prompt in the same batches as the other "
        "slots' decode steps, so every agent waits while it is read.",
    ),
)

MAINTENANCE = (
    Verb(
        "recover",
        Group.MAINTENANCE,
        "revert a deploy that was killed half-way (deploy, set, unset, rollback and install "
        "do this first, too; check and --check change nothing), then settle a bake whose "
        "revert was cut with its "
        "sampler (reverted or revert_failed); exit 4 if the restored config fails its gate",
        deploy.cmd_recover,
        SETTINGS,
    ),
    Verb(
        "uninstall",
        Group.MAINTENANCE,
        "stop, disable and remove the unit, its sampler and front units and the env file "
        "(generations are kept unless --purge)",
        deploy.cmd_uninstall,
        (
            options(
                arg("--unit-dir", type=Path, help="where the unit file is"),
                arg(
                    "--purge",
                    action="store_true",
                    help="also delete the generations and all else install made (the "
                    "service's StateDirectory, the record, the lock, empty folders)",
                ),
            ),
            *SETTINGS,
        ),
    ),
)

UNITS = (
    Verb(
        "exec",
        Group.UNITS,
        "the unit's ExecStart: read the env file strictly and exec llama-server",
        units.cmd_exec,
        (EXEC,),
    ),
    Verb(
        "prestart",
        Group.UNITS,
        "the unit's ExecStartPre: put the env file back on a whole generation if a "
        "deployer died half-way, and stage the API key",
        units.cmd_prestart,
        (PRESTART,),
    ),
    Verb(
        "sample",
        Group.UNITS,
        "take one live sample of the unit: read /slots, /metrics, /proc and the journal, "
        "add it to the live generation's record, write the metrics file, warn when the KV "
        "pool or a slot passes 90 percent; while the live generation bakes, sample every "
        "bake_interval until its verdict and revert it when it is worse (what "
        "NAME-sample.timer runs; takes no deploy lock, but a revert does; "
        "with --unit, --scope and --state-dir all given, as the timer gives them, it reads no "
        "settings)",
        watch.cmd_sample,
        (SAMPLE, *SETTINGS),
    ),
    Verb(
        "front-release",
        Group.UNITS,
        "the front's release watcher (NAME-front-release.service runs it while a hold is "
        "recorded): recover the transaction of a holder that died and release the front, "
        "or release it at the hold's deadline (one deploy's budget)",
        deploy.cmd_front_release,
        SETTINGS,
    ),
    Verb(
        "stop-warm",
        Group.UNITS,
        "stop the second instance when its warm period after a switch is over and it does "
        "not serve (a timer the deploy starts runs it; under the unit's lock)",
        deploy.cmd_stop_warm,
        SETTINGS,
    ),
)

#: Every verb, in the order ``--help`` lists them.
VERBS = (*EVERYDAY, *PLANNING, *MAINTENANCE, *UNITS)
