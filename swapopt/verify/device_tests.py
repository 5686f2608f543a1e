"""The tests marked for a device (`-m cuda`, `-m npu`), run in a subprocess and summarized.

A subprocess, because the tests set up devices and processes of their own and must not see this run's
device state. In a dry run there is no device for them: they are only collected, which still proves that
the marker selects tests and that they import.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel

# pytest's last line: "3 passed, 1 skipped, 2 deselected in 4.12s" or, collecting, "3/120 tests collected (117
# deselected) in 2.01s".
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)")
_COLLECTED = re.compile(r"(\d+)(?:/(\d+))? tests? collected")
TAIL_LINES = 15


class DeviceTests(BaseModel):
    marker: str
    command: list[str]
    ran: bool  # False: collected only (dry run)
    returncode: int | None  # None: timed out
    seconds: float
    counts: dict[str, int]  # passed, failed, skipped, ... as pytest's summary line has them
    summary: str  # pytest's summary line
    failures: list[str]  # "FAILED tests/...::test_x - reason" lines
    tail: list[str]  # the last lines of its output, for a failure or an unexpected end

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def parse_summary(output: str) -> tuple[dict[str, int], str, list[str]]:
    """(counts, summary line, failure lines) of pytest's output."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines)
                    if _COUNT.search(ln) or _COLLECTED.search(ln) or "no tests ran" in ln), "")
    counts: dict[str, int] = {}
    for number, word in _COUNT.findall(summary):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[key] = counts.get(key, 0) + int(number)
    collected = _COLLECTED.search(summary)
    if collected:
        counts["collected"] = int(collected.group(1))
    failures = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    return counts, summary, failures


def marked_files(root: Path, marker: str) -> list[str]:
    """Test files under root/tests that name the marker (`pytest.mark.cuda`): only they can hold its tests, and
    collecting only them spares importing every framework the rest of the suite tests."""
    tests = root / "tests"
    needle = f"mark.{marker}"
    return sorted(str(p.relative_to(root)) for p in tests.rglob("test_*.py") if needle in p.read_text(errors="replace"))


def run_device_tests(marker: str, *, collect_only: bool, timeout_s: int, root: Path | None = None,
                     paths: list[str] | None = None) -> DeviceTests:
    """`python -m pytest -m MARKER` in `root` (the checkout holding tests/ by default) over `paths` (default: the
    files that name the marker)."""
    root = root or Path(__file__).resolve().parents[2]
    if paths is None:
        paths = marked_files(root, marker) if (root / "tests").is_dir() else []
    # One process, file order: the tests share one device, and their output reads in order.
    if not paths:
        return DeviceTests(marker=marker, command=["-m", "pytest", "-m", marker], ran=False, returncode=5, seconds=0.0,
                           counts={}, summary=f"no test file names pytest.mark.{marker}", failures=[], tail=[])
    # -q comes from the project's addopts; a second one would shorten --collect-only to per-file counts.
    command = [sys.executable, "-m", "pytest", "-m", marker, "-n", "0", "-p", "no:randomly", "-rfE",
               *(["--collect-only"] if collect_only else []), *(paths or [])]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout_s)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        code = None
    counts, summary, failures = parse_summary(output)
    if code is None:
        summary = f"timed out after {timeout_s} s" + (f" ({summary})" if summary else "")
    return DeviceTests(marker=marker, command=command[1:], ran=not collect_only, returncode=code,
                       seconds=time.monotonic() - started, counts=counts, summary=summary, failures=failures,
                       tail=output.splitlines()[-TAIL_LINES:])
