"""Secrets stay out of everything a run writes: logs, console, tracebacks, config dumps, wandb.

Secret-looking keys lose their values in config dumps. The values of secret environment variables
and config keys, and passwords in URLs, are masked wherever they appear once ``compat.output_masking``
hooks ``MASKER`` into the process (log records of std ``logging`` and loguru, the console with its
progress bars, uncaught tracebacks), and in Hydra's ``.hydra/*.yaml`` and ``multirun.yaml``.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

REDACTED = "<redacted>"
_SECRET_WORDS = set(
    "key keys apikey apikeys token tokens secret secrets password passwords passwd credential"
    " credentials authorization auth pat bearer cookie".split()
)
# "tokens" next to one of these counts or lists token ids (max_tokens, stop_tokens), not secrets.
_TOKEN_COUNT_WORDS = set("max min num n new stop total prompt response special pad".split())
# Credentials inside a URL: scheme://user:password@host
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/:@]*:)(?P<password>[^\s/@]+)(?P<at>@)")


def is_secret_key(name: str) -> bool:
    """True for ``api_key``, ``HF_TOKENS``, ``clientSecret``, ``GITHUB_PAT``, ``authorization``... but
    not ``tokenizer``, ``path`` or ``max_tokens``: a word of the key must be a secret word exactly."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    words = set(re.split(r"[^a-zA-Z0-9]+", spaced.lower()))
    if "tokens" in words and words & _TOKEN_COUNT_WORDS:
        words.discard("tokens")
    return bool(words & _SECRET_WORDS)


def redact(value: Any) -> Any:
    """A copy of a nested dict/list config with the text values of secret-looking keys replaced
    (numbers and flags stay: ``max_tokens: 512`` is no secret)."""
    if isinstance(value, Mapping):
        return {
            k: REDACTED if is_secret_key(str(k)) and isinstance(v, str) and v else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


MIN_SECRET_LENGTH = 6  # shorter values ("true", "1") are not masked wherever they appear


def secret_values(config: Any = None, environ: Mapping[str, str] | None = None) -> set[str]:
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if is_secret_key(k) and len(v) >= MIN_SECRET_LENGTH}

    def walk(value: Any, secret: bool) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, secret or is_secret_key(str(key)))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, secret)
        elif secret and isinstance(value, str) and len(value) >= MIN_SECRET_LENGTH and value != REDACTED:
            found.add(value)

    walk(config, False)
    return found


class SecretMasker(logging.Filter):
    """Replaces known secret values in text; as a logging filter, in every record it passes."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        super().__init__()
        self.values: set[str] = set()
        self.add(values)

    def add(self, values: Iterable[str]) -> None:
        self.values |= {v for v in values if len(v) >= MIN_SECRET_LENGTH}
        self._ordered = sorted(self.values, key=len, reverse=True)  # longest first: no partial leftovers

    def mask(self, text: str) -> str:
        for value in self._ordered:
            text = text.replace(value, REDACTED)
        if "@" in text:
            text = _URL_PASSWORD.sub(rf"\g<head>{REDACTED}\g<at>", text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = self.mask(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self.mask(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = self.mask(record.exc_text)
        return True


# The process's masker: what it holds is masked wherever ``compat.output_masking`` hooked it in.
MASKER = SecretMasker()


def scrub_hydra_outputs(masker: SecretMasker) -> None:
    """Hydra writes the composed config and the overrides to ``.hydra/*.yaml`` (and a sweep's
    ``multirun.yaml``)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    paths = []
    if hydra_cfg.output_subdir:
        paths += (Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir).glob("*.yaml")
    if hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN" and hydra_cfg.sweep.dir:
        paths.append(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    for path in filter(Path.exists, paths):
        text = path.read_text()
        lines = [_redact_yaml_line(line) for line in masker.mask(text).splitlines(keepends=True)]
        if "".join(lines) != text:
            path.write_text("".join(lines))


_YAML_KEY_VALUE = re.compile(r"^(\s*(?:- )?)([\w.+~-]+)(\s*[:=]\s*)(\S.*?)(\s*)$")


def _redact_yaml_line(line: str) -> str:
    """``api_key: x`` and ``- wandb.api_key=x`` (an override) keep their key, lose their value."""
    match = _YAML_KEY_VALUE.match(line.rstrip("\n"))
    if not match or not is_secret_key(match.group(2).lstrip("+~").split(".")[-1]):
        return line
    if match.group(4) in ("null", "''", '""', "???", "{}", "[]"):
        return line
    newline = "\n" if line.endswith("\n") else ""
    return f"{match.group(1)}{match.group(2)}{match.group(3)}{REDACTED}{newline}"


class MaskedStream(io.TextIOBase):
    """A text stream (the console, a log file) that masks secrets in whatever passes through it,
    tqdm's bar included."""

    def __init__(self, stream: TextIO, masker: SecretMasker) -> None:
        self._stream = stream
        self._masker = masker

    def write(self, text: str) -> int:
        self._stream.write(self._masker.mask(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:  # anything else (``buffer``, ``errors``...) is the stream's
        return getattr(self._stream, name)
