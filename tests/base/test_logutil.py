"""Logging set-up shared by ``lmkv`` and ``python -m lmkv.server``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SETUP = ("import logging, sys; from lmkv.base.logutil import configure_logging; "
         "print(configure_logging({flag!r}, 'INFO')); "
         "logging.getLogger('botocore.endpoint').debug('url with Sup3rSecret'); "
         "logging.getLogger('lmkv.tiers').debug('lmkv detail'); "
         "logging.getLogger('urllib3').warning('a warning of theirs')")


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_debug_shows_lmkv_lines_and_other_libraries_warnings_only() -> None:
    done = _run(SETUP.format(flag="DEBUG"))
    assert done.stdout.strip() == "None"
    assert "lmkv detail" in done.stderr and "a warning of theirs" in done.stderr
    assert "Sup3rSecret" not in done.stderr


def test_the_env_variable_is_read_and_checked() -> None:
    done = _run(SETUP.format(flag=None), LMKV_LOG_LEVEL="debug")
    assert "lmkv detail" in done.stderr
    done = _run(SETUP.format(flag=None), LMKV_LOG_LEVEL="loud")
    assert done.stdout.strip() == "LMKV_LOG_LEVEL = 'LOUD': allowed: DEBUG, INFO, WARNING, ERROR"


@pytest.mark.parametrize("command", [["-m", "lmkv", "plugins"], ["-m", "lmkv.server"]])
def test_both_commands_set_logging_up_the_same_way(command: list[str]) -> None:
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True,
                          env={**os.environ, "LMKV_LOG_LEVEL": "loud"}, timeout=60)
    assert done.returncode == 2
    assert "LMKV_LOG_LEVEL = 'LOUD': allowed: DEBUG, INFO, WARNING, ERROR" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


EMBEDDED = ("import logging; from lmkv.base.logutil import log_where_nothing_does; "
            "{before}print(log_where_nothing_does()); "
            "logging.getLogger('lmkv.integrations.vllm.worker').info('lmkv: ready'); "
            "logging.getLogger('lmkv.tiers').debug('lmkv detail')")


def _embedded(before: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "LMKV_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-c", EMBEDDED.format(before=before)],
                          capture_output=True, text=True, env={**base, **env}, timeout=60)


def test_inside_another_program_lmkv_lines_get_a_handler() -> None:
    done = _embedded()
    assert done.stdout.strip() == "None"
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("INFO ") and lines[0].endswith(
        "[lmkv] lmkv: ready")
    done = _embedded(LMKV_LOG_LEVEL="debug")
    assert "lmkv detail" in done.stderr
    done = _embedded(LMKV_LOG_LEVEL="loud")
    want = "LMKV_LOG_LEVEL = 'LOUD': allowed: DEBUG, INFO, WARNING, ERROR; lmkv logs at INFO"
    assert done.stdout.strip() == want and want in done.stderr and "lmkv: ready" in done.stderr


def test_logging_the_program_configured_is_left_alone() -> None:
    done = _embedded("logging.basicConfig(format='mine %(message)s'); ")
    assert done.stdout.strip() == "None"
    assert done.stderr.strip() == ""  # root at WARNING, as the program set it: no INFO line
    done = _embedded("logging.basicConfig(level='INFO', format='mine %(message)s'); ")
    assert done.stderr.strip() == "mine lmkv: ready"


def test_logging_configured_later_takes_lmkv_lines_over() -> None:
    later = ("import logging; from lmkv.base.logutil import log_where_nothing_does; "
             "log_where_nothing_does(); "
             "logging.getLogger('lmkv.a').info('before'); "
             "logging.basicConfig(format='mine %(message)s'); "
             "logging.getLogger('lmkv.a').info('after')")
    base = {k: v for k, v in os.environ.items() if k != "LMKV_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", later], capture_output=True, text=True,
                          env=base, timeout=60)
    lines = done.stderr.splitlines()
    assert lines[0].endswith("[lmkv] before")
    assert lines[1:] == ["mine after"]  # once, through the program's handler
