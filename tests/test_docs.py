"""README.md and docs/*.md point at things that exist: every relative link resolves (the file, and a `#anchor`
as a heading of the target, slugged as GitHub does), and every command in their bash blocks names modules,
files and pip extras that exist. Nothing is run: a broken link or command is found in well under a second."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)(.*)$")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans, where links live."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def bash_blocks(text: str) -> list[str]:
    blocks, current = [], None
    for line in text.splitlines():
        m = FENCE.match(line.strip())
        if m and current is None:
            current = [] if m.group(2).strip() in ("bash", "sh", "shell", "console") else False
        elif m:
            if current:
                blocks.append("\n".join(current))
            current = None
        elif current not in (None, False):
            current.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, '_', '-' and spaces
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")  # repeated headings get -1, -2, ... as on GitHub
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(page.read_text()))]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def broken_link(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
        return None
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists():
        return f"{target}: no file {shown(dest)}"
    if anchor:
        if dest.suffix != ".md":
            return f"{target}: an anchor into a file that is not markdown"
        if anchor.lower() not in anchors(dest):
            return f"{target}: no heading with anchor #{anchor} in {shown(dest)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = [why for t in links(page) if (why := broken_link(page, t))]
    assert not bad, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def test_the_link_check_catches_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## Use it\n\nSee [Results](#results) and [use](#use-it).\n")
    assert [broken_link(page, t) for t in links(page)] == [
        "#results: no heading with anchor #results in page.md", None]
    page = ROOT / "README.md"
    assert broken_link(page, "#no-such-heading") is not None
    assert broken_link(page, "docs/no-such-page.md") is not None
    assert broken_link(page, "#use-it-in-a-training-script") is None


def test_slugs_follow_github():
    assert slug("Hide the step under the next forward (`overlap_forward`)") == \
        "hide-the-step-under-the-next-forward-overlap_forward"
    assert slug("Checkpoints (torch.distributed.checkpoint, FSDP2)") == "checkpoints-torchdistributedcheckpoint-fsdp2"
    assert slug("RL: offload / onload around rollout") == "rl-offload--onload-around-rollout"


# -- commands --------------------------------------------------------------------------------------------
def extras() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(meta.get("optional-dependencies", {}))


def scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {}))


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def commands(block: str) -> list[list[str]]:
    """Each simple command of a bash block, as words: comments dropped, lines joined on a trailing
    backslash, split on `&&`, `||`, `;` and `|`, leading VAR=value assignments dropped."""
    out = []
    for line in re.sub(r"\\\n", " ", block).splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            out.append(["<unparsable>", line, str(e)])
            continue
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w in ("&&", "||", ";", "|"):
                while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def problems(cmd: list[str], page: Path) -> list[str]:
    bad = []
    if cmd[0] == "<unparsable>":
        return [f"cannot parse {cmd[1]!r}: {cmd[2]}"]
    words = [w for w in cmd if not w.startswith(">") and not re.match(r"^\d*>", w)]  # drop redirections
    prog = words[0]
    if prog in ("python", "python3", "torchrun") or prog in scripts():
        args = words[1:]
        if "-m" in args:
            i = args.index("-m")
            mod = args[i + 1]
            if mod != "pytest" and not module_exists(mod):
                bad.append(f"`-m {mod}`: no importable module")
            args = args[i + 2:]
        for a in args:
            if a.startswith("-") or "=" in a:
                continue
            if re.search(r"\.(py|yaml|yml|json|toml|txt)$", a) or a.startswith(("configs/", "tests/", "bench/")):
                if not (ROOT / a.split("::")[0]).exists():
                    bad.append(f"{a}: no such file")
    elif prog in ("pip", "pip3") or words[:3] == ["python", "-m", "pip"]:
        for a in words:
            m = re.match(r"^(?:\.|swapopt)\[([^\]]*)\]$", a)
            if m:
                for extra in filter(None, (e.strip() for e in m.group(1).split(","))):
                    if extra not in extras():
                        bad.append(f"{a}: no extra {extra!r} in pyproject.toml")
    elif prog in ("source", "export", "cd", "ls", "cat", "echo"):
        pass
    elif prog.startswith(("./", "configs/", "bench/")) and not (ROOT / prog).exists():
        bad.append(f"{prog}: no such file")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_resolves(page):
    bad = [f"{' '.join(c)}: {why}" for b in bash_blocks(page.read_text()) for c in commands(b)
           for why in problems(c, page)]
    assert not bad, f"{page.relative_to(ROOT)}: commands that do not resolve:\n" + "\n".join(bad)


def test_the_command_check_catches_mistakes():
    page = ROOT / "README.md"
    assert problems(["python", "-m", "swapopt.no_such_module"], page)
    assert problems(["python", "-m", "swapopt.train", "configs/no_such.py"], page)
    assert problems(["pip", "install", "-e", ".[no_such_extra]"], page)
    assert not problems(["pip", "install", "torch==2.13.0", "-e", ".[test,integrations]"], page)
    assert not problems(["python", "-m", "swapopt.train", "configs/tiny.py"], page)


def test_readme_starts_with_the_two_commands():
    block = bash_blocks((ROOT / "README.md").read_text())[0]
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2
    assert "python -m swapopt.train configs/tiny.py" in lines[0] and "python -m pytest" in lines[1]
    assert (ROOT / "README.md").read_text().index("```bash") < 20
