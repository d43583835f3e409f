"""Servers started by ``start_cpu_servers``: locked to the run's token, fed a scrubbed environment,
loading weights only from the run's root, and never outliving the process that started them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from rllm_skyrl.rollout.engine import SkyRLEngine
from rllm_skyrl.rollout.servers import (
    ServerGroup,
    external_servers,
    looks_like_credential,
    start_cpu_servers,
    without_credentials,
)

PLANTED = {
    "RLLM_TEST_API_KEY": "planted-api-key-value",
    "RLLM_TEST_DATABASE_URL": "postgres://user:planted-db-password@db:5432/x",
    "RLLM_TEST_GH": "ghp_plantedGithubToken0123456789abcd",
    "RLLM_TEST_DB_PASS": "planted-pass-value",
}
HARMLESS = {"RLLM_TEST_PLAIN": "a-plain-value", "RLLM_TEST_MAX_TOKENS": "128"}


@pytest.fixture(scope="module")
def group(tiny_model_dir, tmp_path_factory):
    """One server, started with secrets in our environment and the default (private) weights root."""
    saved = {k: os.environ.get(k) for k in {**PLANTED, **HARMLESS}}
    os.environ.update({**PLANTED, **HARMLESS})
    try:
        servers = start_cpu_servers(tiny_model_dir, 1, tmp_path_factory.mktemp("logs"))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield servers
    servers.stop()


def proc_file(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def test_the_token_travels_in_the_environment_and_secrets_do_not(group):
    pid = group.processes[0].pid
    environ = dict(
        item.split("=", 1) for item in proc_file(pid, "environ").decode().split("\0") if "=" in item
    )
    for name, value in PLANTED.items():
        assert name not in environ and value not in proc_file(pid, "environ").decode(), name
    assert all(environ.get(k) == v for k, v in HARMLESS.items())
    assert environ["RLLM_SKYRL_SERVER_TOKEN"] == group.token
    assert group.token.encode() not in proc_file(pid, "cmdline"), "the token is visible in ps"
    assert not any(looks_like_credential(k, v) for k, v in environ.items() if k != "RLLM_SKYRL_SERVER_TOKEN")


def test_credential_detection():
    assert looks_like_credential("HF_TOKEN", "x") and looks_like_credential("SSH_AUTH_SOCK", "/tmp/a")
    assert looks_like_credential("DATABASE_URL", "mysql://root:pw@localhost/db")
    assert looks_like_credential("NOTES", "-----BEGIN OPENSSH PRIVATE KEY-----")
    assert not looks_like_credential("PATH", "/usr/bin:/bin") and not looks_like_credential("PWD", "/work")
    assert not looks_like_credential("MAX_TOKENS", "5") and not looks_like_credential("HOME", "/root")
    assert not looks_like_credential("PIP_INDEX_URL", "https://pypi.org/simple")


def test_only_the_runs_token_opens_the_servers(group):
    url = group.urls[0]
    bare = without_credentials(url)
    assert url.startswith("http://rllm:") and group.token in url and group.token not in bare
    assert httpx.get(f"{bare}/health").status_code == 200
    assert httpx.get(f"{bare}/rllm_skyrl/v1/stats").status_code == 401
    target, headers = group.request_target(url)
    assert httpx.get(f"{target}/rllm_skyrl/v1/stats", headers=headers).status_code == 200
    assert httpx.get(f"{url}/rllm_skyrl/v1/stats").status_code == 200  # httpx: URL credentials = Basic


def test_engine_from_the_groups_urls_samples_pauses_and_resumes(group, tiny_tokenizer):
    engine = SkyRLEngine.from_urls(group.urls, tiny_tokenizer, max_prompt_length=64, max_response_length=4)

    async def drive():
        try:
            out = await engine.get_model_response([{"role": "user", "content": "what is 1 plus 1?"}])
            await engine.client.pause(mode="keep")
            await engine.client.resume()
            return out
        finally:
            await engine.close()

    out = asyncio.run(drive())
    assert 1 <= out.completion_length <= 4 and len(out.logprobs) == out.completion_length


def test_weights_load_from_the_groups_root_only(group, tiny_model_dir, tmp_path):
    import shutil

    root = group.weights_root
    assert root is not None and group.owns_weights_root and root.is_dir()
    assert (root.stat().st_mode & 0o777) == 0o700, "the weights root must be private to the run"
    shutil.copytree(tiny_model_dir, root / "sync")
    group.load_weights(str(root / "sync"), weight_version=3)
    target, headers = group.request_target(group.urls[0])
    version = httpx.get(f"{target}/rllm_skyrl/v1/weight_version", headers=headers).json()
    assert version["weight_version"] == 3
    with pytest.raises(RuntimeError, match="path outside") as refused:
        group.load_weights(tiny_model_dir, weight_version=4)
    assert group.token not in str(refused.value)


def test_external_servers_given_a_credential_url_keep_working(group, tiny_model_dir):
    external = external_servers([group.urls[0]])
    assert external.token is None and not external.owned
    external.load_weights(str(group.weights_root / "sync"), weight_version=5)  # Basic, from the URL


def test_stop_ends_the_servers_and_removes_a_root_it_created(group):
    processes, root = list(group.processes), group.weights_root
    group.stop()
    assert all(p.poll() is not None for p in processes)
    assert not root.exists()


def test_the_cli_refuses_a_public_host_without_a_token(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != "RLLM_SKYRL_SERVER_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "rllm_skyrl.inference", "--model", tiny_model_dir, "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2 and "RLLM_SKYRL_SERVER_TOKEN" in done.stderr, done.stderr


# ------------------------------------------------------------------------------------- orphans
ORPHAN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from rllm_skyrl.rollout.servers import start_cpu_servers

    group = start_cpu_servers(sys.argv[1], 1, sys.argv[2], weights_root=sys.argv[2])
    print(group.processes[0].pid, group.urls[0].rsplit("@", 1)[1], flush=True)
    if sys.argv[3] == "sleep":
        time.sleep(600)
    """
)


def gone(pid: int) -> bool:
    """No such process, or only its zombie (re-parented to an init that has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plain exit", "SIGTERM"])
def test_servers_die_with_the_process_that_started_them(tiny_model_dir, tmp_path, how):
    """A library user who exits without stop(), or whose process is terminated, leaves no server."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ORPHAN_SCRIPT,
            tiny_model_dir,
            str(tmp_path),
            "exit" if how == "plain exit" else "sleep",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid_text, host = parent.stdout.readline().split()
        pid = int(pid_text)
        assert not gone(pid)
        if how == "SIGTERM":
            parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=60)
        # A wait, not a stopwatch: an orphan that outlives its parent stays forever and still fails.
        deadline = time.monotonic() + 60
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), f"server {pid} still alive 60 s after its parent ended ({how})"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{host}/health", timeout=2)
    finally:
        parent.kill()
        parent.wait()
        if "pid" in locals() and not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_group_without_a_token_leaves_urls_alone():
    group = ServerGroup(urls=["http://u:p@h:1"])
    assert group.request_target("http://u:p@h:1") == ("http://u:p@h:1", {})
