"""The project speaks of itself: no file of the repository mentions the work periods it was written
in, an issue by number or the benchmark harness's carry folders, and none cites a path outside the
repository.

Every file git tracks (or would track: untracked files that are not ignored) is read as text.
The word's technical senses stay allowed by pattern (SESSION_ALLOWED): pytest's fixture scope,
HTTP clients, process groups. An upstream bug is cited as owner/repo#N, which these rules allow.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

# The word's technical uses, removed from a line before it is searched.
SESSION_ALLOWED = re.compile(
    r"""scope\s*=\s*["']session["']"""          # pytest fixture scope
    r"|\w*ClientSession\w*|\.Session\b"        # aiohttp/httpx client sessions, requests.Session
    r"|start_new_session|\bsetsid\b|getsid"    # process sessions
    r"|\b(?:process|HTTP|client|SSH|tmux|terminal|login)\s+sessions?\b",
    re.IGNORECASE)
SESSION = re.compile(r"\bsessions?\b", re.IGNORECASE)

FORBIDDEN = {
    "a work item by number (write what the code does; cite upstream bugs as owner/repo#N)":
        re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "a benchmark harness's carry folder": re.compile(r"(?<![\w-])\.anchors\b|\bcarry\s*=\s*\[|(?<![\w-])\.scratch/"),
    "a path outside the repository":
        re.compile(r"(?<![\w$.-])shared/(?:reference|anchors|hooks)\b|/work/shared\b|\bDESIGN\.md\b"),
}
RELATIVE_PATH = re.compile(r"(?<![\w.])((?:\.\./)+[\w.-][\w./-]*)")


def project_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    return [path for path in paths if path.is_file() and path.resolve() != THIS]


# A file with none of these words needs no line-by-line search.
KEYWORDS = ("session", "issue", ".anchors", "carry", ".scratch", "shared", "design.md", "../")


def text_lines(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return                                  # images, wheels, anything not text
    lowered = text.lower()
    if any(word in lowered for word in KEYWORDS):
        yield from enumerate(text.splitlines(), start=1)


def find_mentions(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: what' for every forbidden mention in one file."""
    where = path.relative_to(root) if path.is_relative_to(root) else path
    found = []
    for number, line in text_lines(path):
        if SESSION.search(SESSION_ALLOWED.sub("", line)):
            found.append(f"{where}:{number}: a work session: {line.strip()[:100]}")
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append(f"{where}:{number}: {what}: {line.strip()[:100]}")
        for relative in RELATIVE_PATH.findall(line):
            if not (path.parent / relative).resolve().is_relative_to(root.resolve()):
                found.append(f"{where}:{number}: a path outside the repository ({relative}): {line.strip()[:100]}")
    return found


def test_no_file_mentions_sessions_issues_or_paths_outside_the_repository():
    found = [mention for path in project_files() for mention in find_mentions(path)]
    assert not found, "the project speaks of itself and cites public sources:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "Measured in the twenty-third session on an H200.",
    "Issue 14's 1.10x is not met.",
    "(issues 11 and 14, 2026-12-02)",
    "Command (one device call, `carry=[\".anchors\"]`):",
    # Built from parts, so that this file itself cites nothing outside the repository.
    "the formulas of " + "/".join(["shared", "reference", "moe.md"]) + " 3.2",
    "config A of ../" + "/".join(["shared", "anchors", "NOTES.md"]),
    "see " + "DESIGN" + ".md for the layout",
    "as the notes say (../../outside.md)",
])
def test_each_kind_of_mention_is_caught(tmp_path, line):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(f"A first line.\n{line}\n")
    assert [mention.split(":")[:2] for mention in find_mentions(page, tmp_path)] == [["docs/page.md", "2"]]


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="session")',
    "async with aiohttp.ClientSession() as client:",
    "with requests.Session() as http:",
    "subprocess.Popen(command, start_new_session=True)   # its own process session",
    "os.killpg(os.getpgid(pid), signal.SIGTERM); os.setsid()",
    "torch.compile guards (pytorch/pytorch#119574); see `../simple_train_loop.py`",
    "export TORCH_FR_DUMP_TEMP_FILE=$SHARED/fr/rank_",
    "the instruction issue rate of the erf form",
])
def test_technical_uses_and_paths_inside_the_repository_pass(tmp_path, line):
    (tmp_path / "docs").mkdir()
    (tmp_path / "simple_train_loop.py").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text(line + "\n")
    assert find_mentions(page, tmp_path) == []
