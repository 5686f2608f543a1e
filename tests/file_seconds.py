"""Seconds per test file from a `--durations=0` run, as JSON for tests/data/file-seconds.json (Note [heaviest files
first] in tests/conftest.py):

    python -m pytest --durations=0 | python tests/file_seconds.py > tests/data/file-seconds.json
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

_LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+([^:\s]+)::")


def main() -> None:
    seconds: Counter[str] = Counter()
    for line in sys.stdin:
        match = _LINE.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    json.dump({name: round(s, 1) for name, s in seconds.most_common()}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
