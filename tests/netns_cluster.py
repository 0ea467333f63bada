"""A real multi-host Ray cluster on one machine: each host is a Linux network namespace with its
own address (veth pairs into a bridge that lives in a namespace of its own), its own Ray node
(`ray start --head` in the first, `ray start --address` in the others, token auth on) and its own
/tmp/ray (a private tmpfs in a mount namespace of its own: session dirs, the working-dir copy
`ray job submit` ships, the runtime-env agent's cache), so nothing one host writes there is seen by
another. Nothing touches the machine's own network namespace: the bridge and every veth live in
the cluster's namespaces and go with them.

Needs root and `ip netns` (`unavailable()` says why not). Used by tests/test_multihost.py and
launch/bench_multihost.py:

    with NetnsCluster(workers=[2, 2]) as c:           # head (0 CPUs) + two hosts of 2 CPUs
        c.ray(["job", "submit", "--address", c.dashboard, "--working-dir", ".", "--", ...])
        c.kill_host(2); c.start_node(2)                # lose host 2, then boot it again
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBNET = "10.213.0"  # hosts are SUBNET.1 (head), .2, .3, ...; private to the cluster's namespaces


def unavailable() -> "str | None":
    """Why a namespace cluster cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (creates network namespaces, veth pairs and tmpfs mounts)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if shutil.which("ray") is None:
        return "the `ray` command is not on PATH"
    probe = f"dsmhprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv, check=True, **kw):
    return subprocess.run([str(a) for a in argv], check=check, capture_output=True, text=True, **kw)


class NetnsCluster:
    """`workers`: CPUs of each worker host (host 1, 2, ...); host 0 is the head with `head_cpus`.
    `head_env`: extra environment of the head's Ray processes (e.g. GCS health-check settings)."""

    def __init__(self, workers=(2, 2), head_cpus: int = 0, object_store_mb: int = 150, head_env=None,
                 log=None):
        self.tag = f"dsmh{os.getpid() % 100000}"
        self.cpus = [head_cpus, *workers]
        self.object_store_mb = object_store_mb
        self.head_env = dict(head_env or {})
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.token = self.dir / "token"
        self.token.write_text(secrets.token_hex(32))
        self.token.chmod(0o600)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token), RAY_USAGE_STATS_ENABLED="0",
                        TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self._log = log or (lambda msg: None)
        self._made: list[str] = []  # namespaces created, deleted at teardown
        self.started_at: dict = {}

    # ---- names -------------------------------------------------------------------------------------
    def ns(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    def ip(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    @property
    def hosts(self) -> range:
        return range(len(self.cpus))

    @property
    def gcs(self) -> str:
        return f"{self.ip(0)}:6379"

    @property
    def dashboard(self) -> str:
        return f"http://{self.ip(0)}:8265"

    # ---- life cycle -------------------------------------------------------------------------------
    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc):
        self.down()

    def up(self, timeout_s: float = 180.0) -> None:
        switch = f"{self.tag}-sw"
        self._netns_add(switch)
        _sh("ip", "netns", "exec", switch, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", switch, "ip", "link", "set", "br0", "up")
        for h in self.hosts:
            ns = self.ns(h)
            self._netns_add(ns)
            # both ends created inside the namespaces: no interface ever appears in the machine's own
            _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{h}", "netns", switch)
            _sh("ip", "netns", "exec", switch, "ip", "link", "set", f"p{h}", "master", "br0", "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(h)}/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point of each host's private tmpfs
        t0 = time.monotonic()
        self.start_node(0)
        for h in self.hosts[1:]:
            self.start_node(h, wait=False)
        self.wait_nodes(len(self.cpus), timeout_s)
        self._log(f"namespace cluster up: {len(self.cpus)} hosts in {time.monotonic() - t0:.1f} s")

    def _netns_add(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)

    def exec_argv(self, host: int, argv, private_tmp: bool = False) -> list[str]:
        """argv run on `host`; with private_tmp, in a mount namespace whose /tmp/ray is its own tmpfs
        (what Ray's node processes get: the host's local disk)."""
        argv = [str(a) for a in argv]
        if not private_tmp:
            return ["ip", "netns", "exec", self.ns(host), *argv]
        script = 'mount -t tmpfs -o size=2g,mode=1777 dsmh /tmp/ray && exec "$@"'
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", *argv]

    def run(self, host: int, argv, timeout=None, env=None, check=False, **kw):
        return subprocess.run(self.exec_argv(host, argv), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, check=check, **kw)

    def popen(self, host: int, argv, env=None, **kw):
        return subprocess.Popen(self.exec_argv(host, argv), env={**self.env, **(env or {})}, **kw)

    def ray(self, args, timeout=300, host: int = 0, **kw):
        """The `ray` CLI on `host` (the head by default), holding the cluster's token."""
        return self.run(host, ["ray", *args], timeout=timeout, **kw)

    def start_node(self, host: int, wait: bool = True, timeout_s: float = 120.0) -> None:
        """`ray start` on `host` (the head for host 0), in its own fresh /tmp/ray."""
        common = [f"--node-ip-address={self.ip(host)}", f"--num-cpus={self.cpus[host]}", "--num-gpus=0",
                  f"--object-store-memory={self.object_store_mb * 2**20}", "--disable-usage-stats"]
        if host == 0:
            argv = ["ray", "start", "--head", "--port=6379", "--dashboard-host=0.0.0.0", "--dashboard-port=8265",
                    "--include-dashboard=true", *common]
            env = {**self.env, **self.head_env}
        else:
            argv = ["ray", "start", f"--address={self.gcs}", *common]
            env = self.env
        log = open(self.dir / f"ray-start-h{host}.log", "ab")
        t0 = time.monotonic()
        proc = subprocess.run(self.exec_argv(host, argv, private_tmp=True), env=env, stdout=log, stderr=log,
                              timeout=timeout_s)
        log.close()
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on host {host} failed (rc {proc.returncode}): "
                               f"{(self.dir / f'ray-start-h{host}.log').read_text()[-2000:]}")
        self.started_at[host] = time.monotonic() - t0
        if wait and host:
            self.wait_nodes(None, timeout_s, host=host)

    def nodes(self) -> list[dict]:
        """Ray's node table (state API, from the head): node_id, node_ip, state, resources_total."""
        out = self.ray(["list", "nodes", "--address", self.dashboard, "--format", "json", "--limit", "1000"],
                       timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"ray list nodes failed: {out.stderr[-1000:]}")
        return json.loads(out.stdout)

    def actors(self, class_name: str) -> list[dict]:
        """Every actor of `class_name` the GCS knows (alive and dead), with node_id, pid and state."""
        out = self.ray(["list", "actors", "--address", self.dashboard, "--format", "json", "--detail",
                        "--limit", "10000", "--filter", f"class_name={class_name}"], timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"ray list actors failed: {out.stderr[-1000:]}")
        return json.loads(out.stdout)

    def wait_nodes(self, count, timeout_s: float, host=None) -> list[dict]:
        """Until `count` nodes are alive (or, with `host`, a live node at that host's address)."""
        deadline = time.monotonic() + timeout_s
        last = None
        while True:
            try:
                alive = [n for n in self.nodes() if n.get("state") == "ALIVE"]
                ok = (any(n.get("node_ip") == self.ip(host) for n in alive) if host is not None
                      else len(alive) >= count)
                if ok:
                    return alive
                last = [n.get("node_ip") for n in alive]
            except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray nodes not up within {timeout_s:g} s (alive: {last})")
            time.sleep(1.0)

    def shell(self, host: int, script: str, timeout=60) -> str:
        """A shell script run on `host` as its Ray processes see it (their private /tmp/ray), e.g. to
        read a node's logs: `c.shell(0, "tail /tmp/ray/session_latest/logs/raylet.out")`."""
        for pid in self.pids(host):
            out = subprocess.run(["nsenter", "-t", str(pid), "-m", "-n", "sh", "-c", script], capture_output=True,
                                 text=True, timeout=timeout)
            if out.returncode == 0 or out.stdout:
                return out.stdout + out.stderr
        return ""

    def pids(self, host: int) -> list[int]:
        out = _sh("ip", "netns", "pids", self.ns(host), check=False)
        return [int(p) for p in out.stdout.split()]

    def kill_host(self, host: int, timeout_s: float = 30.0) -> int:
        """SIGKILL every process of `host` (a host lost: its Ray node, workers, everything), until
        none is left. Returns how many were killed."""
        killed: set = set()
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids(host)
            if not pids:
                return len(killed)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of host {host} survive SIGKILL: {pids}")
            time.sleep(0.1)

    def down(self) -> None:
        """Kill every process of every host, delete the namespaces (their veths and the bridge go
        with them), remove the token and logs."""
        for name in reversed(self._made):
            if name.endswith("-sw"):
                continue
            try:
                self.kill_host(int(name.rsplit("-h", 1)[1]))
            except Exception as e:  # noqa: BLE001 -- go on: the namespace is deleted anyway
                self._log(f"teardown of {name}: {e}")
        for name in reversed(self._made):
            _sh("ip", "netns", "del", name, check=False)
        self._made = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """This cluster's namespaces still present (after down(): none)."""
        names = _sh("ip", "netns", "list", check=False).stdout.split()
        return [n for n in names if n.startswith(f"{self.tag}-")]

    # ---- jobs ------------------------------------------------------------------------------------
    def submit(self, entrypoint, timeout_s: float = 300.0, on_output=None, working_dir=REPO):
        """`ray job submit --address <head> --working-dir <repo> -- <entrypoint>` from the head host,
        tailing the job's log to its end. on_output(text so far) is called as the log grows (e.g. to
        act mid-run). Returns (return code, the whole output, round-trip seconds)."""
        argv = ["ray", "job", "submit", "--address", self.dashboard, "--working-dir", ".", "--", *entrypoint]
        t0 = time.monotonic()
        proc = self.popen(0, argv, cwd=working_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        chunks = []
        try:
            while True:
                left = timeout_s - (time.monotonic() - t0)
                if left <= 0:
                    raise TimeoutError(f"job not done within {timeout_s:g} s: {''.join(chunks)[-3000:]}")
                ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.2))
                if ready:
                    data = os.read(proc.stdout.fileno(), 65536)
                    if not data:
                        break
                    chunks.append(data.decode(errors="replace"))
                    if on_output is not None:
                        on_output("".join(chunks))
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return rc, "".join(chunks), time.monotonic() - t0


def finished_requests(log: str) -> "tuple[int, int] | None":
    """The last `requests: k/n` the run's progress bar printed, as (k, n)."""
    found = re.findall(r"requests:[^\r\n]*?(\d+)/(\d+)", log)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def token_times(request: dict) -> list[float]:
    """A report request's token times (time.monotonic of the Router's host, which is this machine's)."""
    if request.get("ttft_s") is None:
        return []
    t = request["arrival_time"] + request["ttft_s"]
    out = [t]
    for gap in request.get("itl_s") or ():
        t += gap
        out.append(t)
    return out


def outputs(report: dict) -> list:
    """A run's greedy outputs in an order that does not depend on the run (request ids are random):
    (prompt length, output tokens), sorted."""
    return sorted((r["num_prompt_tokens"], tuple(r["output_token_ids"])) for r in report["requests"])


def run_entrypoint(config: str, out_dir, name: str, *overrides) -> list[str]:
    """`python launch/run.py CONFIG --set ...` writing its report to out_dir/name (a folder every host
    can write: the driver runs on the head host)."""
    argv = ["python", "launch/run.py", config, "--set", f"report.out_dir={out_dir}", "--set", f"report.name={name}"]
    for o in overrides:
        argv += ["--set", o]
    return argv


def placement(cluster: NetnsCluster, class_name: str = "ShardWorker") -> list[dict]:
    """Every actor of `class_name` (alive and dead) with its host: [{rank, host, ip, state, pid}];
    the rank from ShardWorker's repr ("ShardWorker(rank=r/world)"), None for other classes."""
    ip_of = {n["node_id"]: n["node_ip"] for n in cluster.nodes()}
    host_of = {cluster.ip(h): h for h in cluster.hosts}
    rows = []
    for a in cluster.actors(class_name):
        m = re.search(r"rank=(\d+)", a.get("repr_name") or "")
        ip = ip_of.get(a.get("node_id"))
        rows.append({"rank": int(m.group(1)) if m else None, "host": host_of.get(ip), "ip": ip,
                     "state": a.get("state"), "pid": a.get("pid"), "node_id": a.get("node_id")})
    return rows


def host_loss_job(cluster: NetnsCluster, host: int, entrypoint, timeout_s: float = 300.0, restart: bool = True,
                  after_finished: int = 1) -> dict:
    """Submit `entrypoint` (a launch/run.py run with a progress bar) and, once `after_finished` of its
    requests have finished, SIGKILL every process of `host`; with `restart`, `ray start` it again at
    once (the host back from a reboot: empty /tmp/ray, a new node id). Returns rc, output,
    round_trip_s, and the kill's moment (time.monotonic), the progress then, processes killed, the
    node's restart seconds."""
    import threading

    state: dict = {}
    restarter = []

    def on_output(log: str) -> None:
        done = finished_requests(log)
        if "kill_at" in state or not done or done[0] < after_finished:
            return
        state["kill_at"] = time.monotonic()
        state["progress_at_kill"] = done
        state["killed"] = cluster.kill_host(host)
        state["kill_s"] = time.monotonic() - state["kill_at"]
        if restart:
            def boot():
                t = time.monotonic()
                try:
                    cluster.start_node(host, wait=False)
                    state["restart_s"] = time.monotonic() - t
                except Exception as e:  # noqa: BLE001 -- reported with the result
                    state["restart_error"] = repr(e)
            restarter.append(threading.Thread(target=boot, daemon=True))
            restarter[0].start()

    try:
        rc, out, round_trip = cluster.submit(entrypoint, timeout_s=timeout_s, on_output=on_output)
    finally:
        for t in restarter:
            t.join(timeout=150)
    return {"rc": rc, "output": out, "round_trip_s": round_trip, **state}


def restart_log(cluster: NetnsCluster) -> list[str]:
    """The engine's restart lines ("target worker lost ...", "workers restarted: teardown .. s, new
    workers ready .. s") from the Router's log on the head host."""
    text = cluster.shell(0, "cat /tmp/ray/session_latest/logs/worker-*.err 2>/dev/null")
    return [line for line in text.splitlines() if "workers restarted" in line or "target worker lost" in line
            or "restart " in line and "failed" in line]


def pause_after(report: dict, t: float) -> dict:
    """How long streams stopped after moment `t` (time.monotonic, e.g. a kill). `pause_s`: the longest
    silence of the run's merged token stream from `t` on (tokens of a step that was finishing at `t`
    still arrive just after it; the pause follows); `first_token_s`: from `t` to the next token;
    `longest_gap_s`: the whole run's longest silence; `tokens_after`: tokens made after `t`."""
    times = sorted(x for r in report["requests"] for x in token_times(r))
    after = [x for x in times if x > t]
    since = [t, *after]
    return {"pause_s": max((b - a for a, b in zip(since, since[1:])), default=None),
            "first_token_s": after[0] - t if after else None,
            "longest_gap_s": max((b - a for a, b in zip(times, times[1:])), default=None),
            "tokens_after": len(after)}
