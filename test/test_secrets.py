"""Secrets never reach what a run prints or writes, from the first line of output on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rllm_skyrl.secret_masking import REDACTED, SecretMasker, is_secret_key, redact

REPO = Path(__file__).resolve().parent.parent
SECRET = "ghp_" + "0123456789abcdefXYZ"


@pytest.mark.parametrize(
    "name", ["api_keys", "HF_TOKENS", "authorization", "GITHUB_PAT", "clientSecret", "WANDB_API_KEY", "auth"]
)
def test_secret_names(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["max_tokens", "stop_tokens", "num_tokens", "tokenizer", "path", "patience"])
def test_names_that_are_not_secrets(name):
    assert not is_secret_key(name)


def test_passwords_in_urls_and_text_values_are_masked():
    masker = SecretMasker()
    assert masker.mask("GET https://bob:hunter22@host/x ok") == f"GET https://bob:{REDACTED}@host/x ok"
    assert masker.mask("http://127.0.0.1:8000/health") == "http://127.0.0.1:8000/health"
    assert redact({"max_tokens": 512, "api_key": "abcdefgh", "auth": {"token": "s3cr3t-v"}}) == {
        "max_tokens": 512,
        "api_key": REDACTED,
        "auth": {"token": REDACTED},
    }


PROCESS = textwrap.dedent(
    """
    import logging, sys
    from tqdm import tqdm
    from rllm_skyrl.compat.output_masking import mask_process_output
    mask_process_output()
    secret = sys.argv[1]
    print(f"printed {secret}")
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("x").info("logged %s", secret)
    for _ in tqdm(range(2), desc=f"bar {secret}"):
        pass
    raise RuntimeError(f"failed with {secret} and https://u:{secret}@h")
    """
)


def test_everything_a_process_prints_is_masked_from_the_start():
    env = {**os.environ, "GITHUB_PAT": SECRET}
    result = subprocess.run(
        [sys.executable, "-c", PROCESS, SECRET],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "RuntimeError: failed with" in output  # the traceback is there
    for what in ("printed", "logged", "bar"):
        assert f"{what} {REDACTED}" in output, output
    assert SECRET not in output


APP = textwrap.dedent(
    """
    import hydra
    from rllm_skyrl.compat.output_masking import mask_process_output
    from rllm_skyrl.secret_masking import scrub_hydra_outputs
    from omegaconf import OmegaConf

    @hydra.main(config_path=None, config_name=None, version_base=None)
    def main(cfg):
        scrub_hydra_outputs(mask_process_output(OmegaConf.to_container(cfg)))

    main()
    """
)


def test_hydra_sweep_files_are_scrubbed(tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            APP,
            "--multirun",
            f"+service.api_key={SECRET}",
            "+lr=1,2",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    written = [path for path in sweep.rglob("*.yaml")]
    assert (sweep / "multirun.yaml") in written and len(written) > 1
    assert all(SECRET not in path.read_text() for path in written)
