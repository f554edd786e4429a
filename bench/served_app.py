"""Our server as a user starts it, for benchmarks: `serve run` of a deploy YAML in its own session,
with the serving environment of deploy/serve.env, plus the /proc bookkeeping of every process
of the app (the serving path's CPU table, docs/serving.md).

    app = start_app(AppLaunch(config=Path("deploy/serve.yaml"), port=8040, model_dir=...))
    before = cpu_by_process(app.pid)
    ... load ...
    rows = cpu_rows(before, cpu_by_process(app.pid))      # per process, CPU seconds
    print_cpu_table(rows)
    stop_app(app)

For a machine with no Ray CLI on the PATH (the GPU machines), or a bench that needs Serve in its
own process, `serve_here(app_args, ...)` runs the app on a local Ray started by this process.

`serve run` starts its own local Ray (GCS, raylet, dashboard, log monitor, Serve's controller
and proxy, our replicas and actors). Started under setsid, every one of those processes keeps
the `serve run` process's session id (Ray's actors leave its process group, not its session),
so the session is exactly "every process of the app", and stop_app ends all of them.
The ingress replica's own HTTP port (Serve's direct ingress, RAY_SERVE_ENABLE_DIRECT_INGRESS)
is read from /proc: the TCP socket the replica listens on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import yaml

from bench.matrix import _alive, _session_members, port_free, stop

REPO = Path(__file__).resolve().parent.parent
SERVE_ENV_FILE = REPO / "deploy" / "serve.env"
WORKER_PROCESS = "ray::WorkerActor"  # the model's processes; everything else is the serving stack


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def direct_ingress_ports(env: dict[str, str]) -> tuple[int, int]:
    """The range Serve allocates a replica's own HTTP port from (its defaults: 30000-31000)."""
    return (int(env.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "30000")),
            int(env.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "31000")))


def read_env_file(path: Path = SERVE_ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines (comments and blank lines skipped), as scripts/serve.sh exports them."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and key.isidentifier(), f"{path}: not KEY=VALUE: {line!r}"
            env[key] = value
    return env


@dataclass(frozen=True, slots=True)
class AppLaunch:
    config: Path  # the deploy YAML (http_options and the app's args)
    port: int  # Serve's HTTP port on 127.0.0.1 (overrides the YAML's)
    model_dir: Path  # overrides the YAML's model
    env: dict[str, str] = field(default_factory=dict)  # on top of os.environ (e.g. read_env_file())
    app_args: dict[str, object] = field(default_factory=dict)  # overrides of the YAML's app args
    log_dir: Path = Path("/tmp")
    timeout_s: float = 600.0  # for /health to answer 200
    code_dir: Path | None = None  # run another checkout's code (cwd and PYTHONPATH); None: this one


@dataclass(frozen=True, slots=True)
class ServedApp:
    pid: int  # the `serve run` process: its session is the app
    port: int  # Serve's HTTP port (the proxy's, or HAProxy's)
    config_path: Path  # the YAML actually run
    log_path: Path
    env: dict[str, str]  # the environment it was started with, over os.environ

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def direct_url(self) -> str | None:
        """The ingress replica's own URL (Serve's direct ingress), or None when it has none."""
        port = direct_ingress_port(self.pid, direct_ingress_ports({**os.environ, **self.env}))
        return None if port is None else f"http://127.0.0.1:{port}"


def write_config(launch: AppLaunch) -> Path:
    config = yaml.safe_load(launch.config.read_text())
    config.setdefault("http_options", {})["port"] = launch.port
    config["http_options"]["host"] = "127.0.0.1"
    args = config["applications"][0]["args"]
    args.update({"model": str(launch.model_dir), **launch.app_args})
    out = launch.log_dir / f"served-app-{launch.port}.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def start_app(launch: AppLaunch) -> ServedApp:
    if not port_free(launch.port):
        raise SystemExit(f"127.0.0.1:{launch.port} is in use; pick another port")
    config_path = write_config(launch)
    log_path = launch.log_dir / f"served-app-{launch.port}.log"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled", **launch.env}
    if launch.code_dir is not None:  # e.g. an earlier commit, `git archive`d: its packages come first
        env["PYTHONPATH"] = str(launch.code_dir)
    with open(log_path, "w") as log:
        # SIGINT back to its default: started from a background job, it would inherit "ignored"
        # and `serve run` could not shut its Ray down on SIGINT (stop_app would wait, then kill).
        proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "serve"), "run", str(config_path)],
                                cwd=launch.code_dir or REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    app = ServedApp(proc.pid, launch.port, config_path, log_path, dict(launch.env))
    deadline = time.monotonic() + launch.timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited ({proc.returncode}); see {log_path}")
        if health_status(app.base_url) == 200:
            return app
        time.sleep(1.0)
    stop_app(app)
    raise RuntimeError(f"not healthy after {launch.timeout_s:g} s; see {log_path}")


@contextlib.contextmanager
def serve_here(app_args: dict, *, name: str, port: int | None = None, num_cpus: int = 4,
               num_gpus: int = 0) -> Iterator[str]:
    """The app of serve_app.app on a local Ray started in this process, Serve's proxy on
    127.0.0.1:`port` (a free one when None); yields its base URL, and shuts Serve and Ray down."""
    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)
    port = free_port() if port is None else port
    if not port_free(port):
        raise SystemExit(f"127.0.0.1:{port} is in use; pick another port")
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def health_status(base_url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def stop_app(app: ServedApp) -> float:
    """Stops every process of the app (SIGINT to `serve run`, then its session); returns the
    seconds it took."""
    started = time.monotonic()
    stop(app.pid, app.port)
    return time.monotonic() - started


# --- the processes of the app (/proc) ---------------------------------------------------------------
def process_name(pid: int) -> str:
    """Ray's process title (ray::WorkerActor, ray::ServeReplica:app:deployment,
    ray-dashboard-NodeHead-0, ...), or the executable, or for a Python process the script or
    module it runs."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith(("ray::", "ray-dashboard-")):  # a process title (a dashboard module: its head's)
        return argv[0].split(" ")[0]
    exe = Path(argv[0]).name
    if exe.startswith("python"):
        rest = [a for a in argv[1:] if not a.startswith("-")]
        if "-m" in argv[1:]:
            return argv[argv.index("-m") + 1]
        return Path(rest[0]).name if rest else exe
    return exe


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (OSError once it is gone). The
    fields are counted after the command name's last ')': a name may hold spaces and parentheses."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_wait_s(pid: int) -> float:
    """Seconds the threads of process `pid` have spent ready to run but waiting for a core, so
    far: the second field of each /proc/PID/task/TID/schedstat, summed over the threads alive
    now (0.0 where the kernel keeps no such count). On a machine whose cores the app fills, this
    is the time its processes lose to one another."""
    total_ns = 0
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total_ns += int(schedstat.read_text().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile, or no schedstats
            continue
    return total_ns / 1e9


class ProcessTimes(NamedTuple):
    name: str  # process_name
    cpu_s: float  # user + system CPU seconds so far
    wait_s: float = 0.0  # seconds its threads waited for a core so far (process_wait_s)


def process_times(pid: int) -> ProcessTimes:
    return ProcessTimes(process_name(pid), process_cpu_s(pid), process_wait_s(pid))


def cpu_by_process(session_id: int) -> dict[int, ProcessTimes]:
    """pid -> its ProcessTimes for every process of the session."""
    found = {}
    for pid in _session_members(session_id):
        try:
            found[pid] = process_times(pid)
        except OSError:
            continue
    return found


CLIENT = "client (this process)"


def cpu_with_client(session_id: int) -> dict[int, ProcessTimes]:
    """cpu_by_process of a server's session, plus this process (the client driving it) as CLIENT."""
    return {**cpu_by_process(session_id), os.getpid(): process_times(os.getpid())._replace(name=CLIENT)}


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent not idle (user, nice, system, irq...) so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class CpuRow:
    name: str  # process name (process_name)
    pid: int
    cpu_s: float  # CPU seconds during the measured interval
    share: float  # of the app's CPU seconds in that interval
    wait_s: float = 0.0  # seconds its threads waited for a core in that interval


def cpu_rows(before: dict[int, ProcessTimes], after: dict[int, ProcessTimes]) -> list[CpuRow]:
    """Per process, the CPU it used and the time it waited for a core between the two readings
    (processes started in between count from 0; ones that exited in between are missing), most
    CPU first."""
    used = {}
    for pid, now in after.items():
        was = before.get(pid, ProcessTimes(now.name, 0.0, 0.0))
        # a thread that ended in between takes its wait with it: never below 0
        used[pid] = (now.name, now.cpu_s - was.cpu_s, max(0.0, now.wait_s - was.wait_s))
    total = sum(cpu for _, cpu, _ in used.values()) or 1.0
    rows = [CpuRow(name, pid, cpu, cpu / total, wait) for pid, (name, cpu, wait) in used.items()]
    return sorted(rows, key=lambda row: -row.cpu_s)


def serving_share(rows: list[CpuRow]) -> float:
    """The share of the app's CPU taken by everything but the worker (model) processes."""
    return sum(row.share for row in rows if row.name != WORKER_PROCESS)


def format_cpu_table(rows: list[CpuRow], min_cpu_s: float = 0.05, output_tokens: int | None = None) -> str:
    """Markdown, most CPU first; with output_tokens, a column of CPU ms per output token."""
    def per_token(cpu_s: float, bold: bool = False) -> str:
        if output_tokens is None:
            return ""
        cell = f"{1e3 * cpu_s / max(output_tokens, 1):.2f}"
        return f" {f'**{cell}**' if bold else cell} |"

    total = sum(row.cpu_s for row in rows)
    serving = [r for r in rows if r.name != WORKER_PROCESS]
    serving_s = sum(r.cpu_s for r in serving)
    extra = ("", "") if output_tokens is None else (" CPU ms per output token |", "---|")
    lines = [f"| process | pid | CPU s | share of the app | waited for a core, s |{extra[0]}",
             f"|---|---|---|---|---|{extra[1]}"]
    shown = [row for row in rows if row.cpu_s >= min_cpu_s]
    lines += [f"| {row.name} | {row.pid} | {row.cpu_s:.1f} | {row.share:.1%} | {row.wait_s:.1f} |"
              f"{per_token(row.cpu_s)}" for row in shown]
    hidden = [row for row in rows if row.cpu_s < min_cpu_s]
    if hidden:
        hidden_s = sum(r.cpu_s for r in hidden)
        lines.append(f"| {len(hidden)} others (< {min_cpu_s} s each) | | {hidden_s:.2f} | "
                     f"{sum(r.share for r in hidden):.1%} | {sum(r.wait_s for r in hidden):.1f} |{per_token(hidden_s)}")
    lines.append(f"| **all {len(rows)} processes** | | **{total:.1f}** | 100% | **{sum(r.wait_s for r in rows):.1f}** |"
                 f"{per_token(total, bold=True)}")
    lines.append(f"| **all but {WORKER_PROCESS}** | | **{serving_s:.1f}** | **{serving_share(rows):.1%}** "
                 f"| **{sum(r.wait_s for r in serving):.1f}** |{per_token(serving_s, bold=True)}")
    return "\n".join(lines)


# --- Serve's direct ingress ----------------------------------------------------------------------------
def direct_ingress_port(session_id: int, ports: tuple[int, int] = (30000, 31000),
                        deployment_suffix: str = "-ingress") -> int | None:
    """The HTTP port the ingress replica itself listens on (direct ingress) in the range
    `ports` (direct_ingress_ports), or None."""
    replicas = [pid for pid in _session_members(session_id)
                if process_name(pid).startswith("ray::ServeReplica:") and process_name(pid).endswith(deployment_suffix)]
    for pid in replicas:
        for port in listening_ports(pid):
            if ports[0] <= port < ports[1]:
                return port
    return None


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (from /proc), lowest first."""
    inodes = _socket_inodes(pid)
    return sorted({port for port, inode in _listening_tcp() if inode in inodes})


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listening_tcp() -> list[tuple[int, str]]:
    """(port, socket inode) of every listening TCP socket (IPv4 and IPv6)."""
    return [(port, inode) for _, port, inode in _listening_tcp_addresses()]


def _listening_tcp_addresses() -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket (IPv4 and IPv6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].rsplit(":", 1)
                found.append((_address(address), int(port, 16), fields[9]))
    return found


def _address(hex_address: str) -> str:
    """/proc/net/tcp's little-endian hex address as text (IPv4, or IPv6 words)."""
    raw = bytes.fromhex(hex_address)
    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
    if len(raw) == 4:
        return ".".join(str(b) for b in words[0])
    import ipaddress

    return str(ipaddress.IPv6Address(b"".join(words)))


def bind_audit(session_id: int) -> list[tuple[str, int, str, int]]:
    """(process, pid, address, port) of every TCP socket the app's processes listen on."""
    sockets = _listening_tcp_addresses()
    found = []
    for pid in _session_members(session_id):
        inodes = _socket_inodes(pid)
        found += [(process_name(pid), pid, address, port) for address, port, inode in sockets if inode in inodes]
    return sorted(found, key=lambda row: (row[2] in ("127.0.0.1", "::1"), row[0], row[3]))


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    return not _alive(pid)
