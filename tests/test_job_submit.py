"""`ray job submit` of launch/run.py against a Ray head started here with token auth; only that
head is stopped afterwards."""

import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_head(proc, temp_dir):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except Exception:
        pass
    # gcs_server and friends outlive SIGTERM: end exactly the processes of this head's temp dir
    subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)


def test_ray_job_submit_runs_the_main_job_with_token_auth(checkpoint, tmp_path):
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rj")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    # the agents' default ports are taken when the session's Ray (the ray_cluster fixture) is up:
    # without ports of its own this head's job agent never starts ("No available agent")
    agent_ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                   f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"]
    head = subprocess.Popen(
        ["ray", "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}", "--num-cpus=4", "--block",
         "--disable-usage-stats", f"--temp-dir={temp_dir}", "--include-dashboard=true", *agent_ports],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 90
        while time.time() < deadline:  # wait for the job server
            ok = subprocess.run(["ray", "job", "list", "--address", address], env=env, capture_output=True)
            if ok.returncode == 0:
                break
            time.sleep(2)
        path = checkpoint("deepseek_v3")
        out_dir = tmp_path / "runs"
        while True:
            job = subprocess.run(
                ["ray", "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
                 "python", "launch/run.py", "--no-progress", "--set", f"model.path={path}", "--set", "parallel.executor=ray",
                 "--set", "workload.kind=synthetic", "--set", "workload.num_requests=4", "--set", "workload.output_len=[2,8]",
                 "--set", f"report.out_dir={out_dir}", "--set", "report.name=job"],
                env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
            )
            # the job server answers before the node's job agent has registered (Ray says "try again later")
            if "No available agent" not in job.stdout + job.stderr or time.time() > deadline:
                break
            time.sleep(2)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout + job.stderr and "output tokens/s" in job.stdout
        assert (out_dir / "job" / "report.json").is_file()
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-token")
        refused = subprocess.run(
            ["ray", "job", "submit", "--address", address, "--", "echo", "hi"],
            env={**env, "RAY_AUTH_TOKEN_PATH": str(wrong)}, capture_output=True, text=True, timeout=120,
        )
        assert refused.returncode != 0 and "Authentication" in refused.stdout + refused.stderr
    finally:
        kill_head(head, temp_dir)
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout.strip()
    assert not left, f"processes of the test head survived: {left}"
