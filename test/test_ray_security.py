"""The local Ray a run starts refuses everyone without the run's token; our own servers are loopback-only.

Ray 2.57 binds its gRPC servers and agents to every interface with no setting to change it, so the
promise is: the inference servers listen on loopback only; every other listening socket of the
processes we started is Ray's (its daemons, workers, and the driver's own core-worker server), Ray
refuses a client without the token, and nothing unauthenticated (metrics exporter, dashboard)
listens at all. Runs in a fresh interpreter so this Ray is not the suite's shared one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json, os, subprocess, sys
    import httpx, psutil, ray
    from rllm_skyrl.run_config import make_skyrl_config
    from rllm_skyrl.ray_cluster import start_ray
    from rllm_skyrl.rollout.servers import start_cpu_servers
    from rllm_skyrl.tiny_model import build_tiny_model

    start_ray(make_skyrl_config(), num_cpus=2)

    @ray.remote
    def mode():
        import ray._raylet
        return int(ray._raylet.get_authentication_mode())

    worker_mode = ray.get(mode.remote())
    servers = start_cpu_servers(str(build_tiny_model()), 1, sys.argv[1])
    ours = set()
    for child in psutil.Process().children(recursive=True):
        ours.add(child.pid)
    listeners = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and (c.pid in ours or c.pid == os.getpid()):
            listeners.append({"name": psutil.Process(c.pid).name(), "ip": c.laddr.ip, "port": c.laddr.port,
                              "server": c.pid in {p.pid for p in servers.processes}})
    gcs = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_NUM_REDIS_GET_RETRIES"] = "1"  # one try: Ray retries a refused client 20 times, a second apart
    intruder = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{gcs}')"],
                              env=env, capture_output=True, text=True, timeout=120)
    http = {}
    for item in listeners:
        try:
            url = f"http://127.0.0.1:{item['port']}/api/job_agent/jobs/"
            http[item["port"]] = httpx.get(url, timeout=3).status_code
        except httpx.HTTPError:
            pass
    daemons = {os.path.basename(arg) for child in psutil.Process().children(recursive=True)
               for arg in child.cmdline()[1:2]}
    servers.stop()
    ray.shutdown()
    refused = "InvalidAuthToken" in intruder.stderr or "Authentication" in intruder.stderr
    print(json.dumps({"worker_mode": worker_mode, "listeners": listeners, "intruder_rc": intruder.returncode,
                      "intruder_refused": refused, "http": http,
                      "ray_python_daemons": sorted(daemons)}))
    """
)


# Where Ray 2.57 serves them by default (`ray.dashboard.consts`, `ray.autoscaler._private.constants`).
DASHBOARD_METRIC_PORT = 44227
AUTOSCALER_METRIC_PORT = 44217


@pytest.mark.slow  # probes every listening port of a live run: about 50 s
@pytest.mark.timeout(400)
def test_local_ray_and_servers_refuse_strangers(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "servers")], capture_output=True, text=True, timeout=360
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["worker_mode"] == 1  # Ray's token authentication, inherited by the workers
    assert report["intruder_rc"] != 0 and report["intruder_refused"], "a client without the token connected"
    loopback = ("127.0.0.1", "::1")
    servers = [item for item in report["listeners"] if item["server"]]
    assert servers and all(item["ip"] in loopback for item in servers), servers
    for item in report["listeners"]:
        if not item["server"] and item["ip"] not in loopback:  # Ray's: its processes, or the driver's
            name = item["name"]
            ray_process = name in ("raylet", "gcs_server", "python") or name.startswith("ray::")
            assert ray_process, item
    # Ray's dashboard head and autoscaler monitor are not started (``compat.local_ray``), so nothing serves
    # metrics openly on their ports, free or not; an HTTP listener of Ray's, if any, asks for the token.
    ports = {item["port"] for item in report["listeners"]}
    assert not ports & {DASHBOARD_METRIC_PORT, AUTOSCALER_METRIC_PORT}, report["listeners"]
    assert all(status == 401 for status in report["http"].values()), report["http"]
    assert not set(report["ray_python_daemons"]) & {"dashboard.py", "monitor.py", "log_monitor.py"}
