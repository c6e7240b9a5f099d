"""The README and the guides under docs/ as a newcomer meets them.

Two promises are checked on README.md and every docs/*.md page:

- every relative link lands: the file exists and its #anchor is a heading there, with
  the anchor made from the heading as GitHub makes it;
- every `meshfl ...` command in a code block (fenced or indented) runs as written and
  exits 0, except those in SKIPPED, each with the reason it cannot run in a test here.
  The rule is the list: a command added to the docs is run unless it is added there.

What "as written" allows, to keep the test short: a command that trains runs 2 rounds
(`--rounds 2` replaces the rounds it gives, or is added), and the example peers.yaml
that the `meshfl host` commands name is copied with its four ports moved to free ones
(and examples/ beside it, for the task files the pages run),
so that tests running beside this one cannot collide with it. The commands of one code
block run in order in one fresh folder, so that `meshfl report runs/first` reads the run
that the block's `meshfl launch --out runs/first` made. A command ending in `&` runs in
the background until the block's last command has finished; `> FILE` writes its output
to FILE. Other programs in the code blocks (pip, pytest, ray, sudo, python) are never
run: NOT_RUN says why.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshfl.protocol.ports import free_ports

REPOSITORY = Path(__file__).resolve().parents[2]
PAGES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]

# Documented `meshfl` commands that this test does not run, each with why. The key is the
# command as the page writes it, joined onto one line, without its comment.
NEEDS_DATA_ROOT = "needs a data root (the MNIST files)"
NEEDS_LAN = "needs the LAN of the guide (machines at 192.168.1.10 to .13)"
NEEDS_MEMBER_KEY = NEEDS_LAN + " and a member's public key in place of 9a41..."
NEEDS_RAY = "needs a running Ray cluster"
READERS_TASK = "names the task file (or module) the reader writes"
SKIPPED: dict[str, str] = {
    "meshfl launch --dataset mnist --data-root ~/data --partition dirichlet:0.5 "
    "--nodes 8 --rounds 5 --out runs/mnist": NEEDS_DATA_ROOT,
    "meshfl join 9a41...@tcp://192.168.1.10:7700 --config peers.yaml": NEEDS_MEMBER_KEY,
    "meshfl node --config peers.yaml --name alpha": NEEDS_LAN,
    "meshfl node --config peers.yaml --name beta": NEEDS_LAN,
    "meshfl node --config peers.yaml --name gamma": NEEDS_LAN,
    "meshfl join tcp://192.168.1.10:7700 --config peers.yaml --name delta "
    "--listen tcp://192.168.1.13:7700 --key keys/delta.pem": NEEDS_LAN,
    "meshfl status 9a41...@tcp://192.168.1.10:7700": NEEDS_MEMBER_KEY,
    "meshfl launch --nodes 500 --ray auto --rounds 20 --out runs/big": NEEDS_RAY,
    "meshfl bench views --nodes 60 --rounds 12 --repeats 3 --set data.dataset=mnist --set "
    "data.root=DIR --set data.partition=clusters:5 --set data.samples_per_node=300": (
        NEEDS_DATA_ROOT + "; six 60-node runs, minutes"
    ),
    "meshfl bench views --nodes 100 --rounds 8 --repeats 3 --set data.dataset=mnist --set "
    "data.root=DIR --set data.partition=dirichlet:0.1 --set data.samples_per_node=300 --set "
    "algorithm=fedc2i --set local_epochs=2 --set lr=0.05 --set momentum=0.9 --set "
    "round_timeout=120 --set compression=none": NEEDS_DATA_ROOT + "; six 100-node runs, minutes",
    "meshfl bench against --nodes N --rounds 5 --repeats 3 --set "
    "task=examples/flower_digits_task.py --set algorithm.name=fedavg --set "
    "algorithm.screen=false --set local_epochs=1 -- python flower_fedavg_digits.py "
    "--nodes N --rounds 5": "runs Flower's simulation beside meshfl (flwr in its own venv), "
    "minutes at each size",
    "meshfl launch --nodes 500 --ray 192.168.1.10:6379 --dataset mnist --data-root /data": (
        NEEDS_RAY + " and a data root"
    ),
    "meshfl launch --task my_task.py --algorithm fedavg --nodes 4": READERS_TASK,
    "meshfl node --config peers.yaml --name alpha --task my_task.py": NEEDS_LAN,
    "meshfl launch --task mypackage.meshfl_task": READERS_TASK,
}

# Programs other than meshfl that code blocks show, and why the test leaves them alone.
NOT_RUN: dict[str, str] = {
    "pip": "installs meshfl; this test runs inside that install",
    "pytest": "runs the test suite, this test among them",
    "ray": "starts a Ray cluster",
    "sudo": "opens a firewall port",
    "python": "runs a benchmark script or a long experiment (minutes to half an hour)",
}

# Blocks marked slow, named by a command they hold: every block that runs a mesh, except
# the README's first command. Each takes 10 to 20 s on two cores, a minute and a half in
# all, so the fast loop (`pytest -m "not slow"`) keeps the first command, the keys and
# the links.
SLOW = {
    "meshfl launch --nodes 8 --algorithm local --partition dirichlet:0.3 --rounds 20",
    "meshfl launch --out runs/first",
    "meshfl host --config peers.yaml --names node0,node1 --out run --local-nodes 2 &",
    "meshfl launch --set attack.nodes=[node3] --set attack.kind=labelflip",
    "meshfl launch --task examples/breast_cancer_task.py --algorithm fedc2i",
    "meshfl launch --task my-task/task.py",
}

TRAINING_COMMANDS = {"launch", "node", "host", "join", "coordinator"}
SHORT_ROUNDS = "2"
COMMAND_TIMEOUT_S = 300


# -- reading the pages -------------------------------------------------------------------


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    line: int  # 1-based line of the block's first line
    language: str  # the fence's info string; "" for an indented block
    lines: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPOSITORY)}:{self.line}"


def split_page(text: str, page: Path) -> tuple[list[str], list[CodeBlock]]:
    """The page's prose lines (code blocks blanked out) and its code blocks."""
    prose: list[str] = []
    blocks: list[CodeBlock] = []
    lines = text.split("\n")
    index = 0
    while index < len(lines):
        line = lines[index]
        fence = re.match(r"^\s*(```+|~~~+)\s*(\S*)", line)
        indented_start = line.startswith("    ") and (index == 0 or not lines[index - 1].strip())
        if fence:
            end = index + 1
            while end < len(lines) and not lines[end].strip().startswith(fence.group(1)):
                end += 1
            blocks.append(CodeBlock(page, index + 2, fence.group(2), tuple(lines[index + 1 : end])))
            prose.extend([""] * (end + 1 - index))
            index = end + 1
        elif indented_start and not _in_list_item(lines, index):
            end = index
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            body = [each[4:] for each in lines[index:end]]
            blocks.append(CodeBlock(page, index + 1, "", tuple(body)))
            prose.extend([""] * (end - index))
            index = end
        else:
            prose.append(line)
            index += 1
    return prose, blocks


def _in_list_item(lines: list[str], index: int) -> bool:
    """Whether an indented line continues a list item rather than starting a code block."""
    for previous in reversed(lines[:index]):
        if previous.strip():
            return bool(re.match(r"^\s*([-*+]|\d+\.)\s", previous))
    return False


def read_pages() -> dict[Path, tuple[list[str], list[CodeBlock]]]:
    return {page: split_page(page.read_text(encoding="utf-8"), page) for page in PAGES}


# -- (a) links and anchors ---------------------------------------------------------------

KEPT_IN_ANCHORS = ("L", "M", "N", "Pc")  # letters, marks, numbers, underscore


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text, lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = text.replace("`", "").replace("*", "").lower()
    kept = (
        char
        for char in text
        if char in "- " or unicodedata.category(char).startswith(KEPT_IN_ANCHORS)
    )
    return "".join(kept).replace(" ", "-")


def anchors_of(prose: list[str]) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        anchor = github_anchor(heading.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def links_of(prose: list[str]) -> list[str]:
    """The targets of the page's inline links, outside code."""
    text = re.sub(r"`[^`]*`", "", "\n".join(prose))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_and_anchor_resolves() -> None:
    pages = read_pages()
    anchors = {page: anchors_of(prose) for page, (prose, _) in pages.items()}
    broken: list[str] = []
    for page, (prose, _) in pages.items():
        for target in links_of(prose):
            if re.match(r"^[a-z][a-z+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no file {path_part})")
            elif anchor and linked.suffix == ".md":
                known = anchors.get(linked) or anchors_of(split_page(linked.read_text(), linked)[0])
                if anchor not in known:
                    broken.append(f"{page.name}: {target} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_guide() -> None:
    prose, _ = read_pages()[REPOSITORY / "README.md"]
    linked = {target.partition("#")[0] for target in links_of(prose)}
    guides = {f"docs/{page.name}" for page in PAGES if page.parent.name == "docs"}
    assert guides, "no docs/*.md pages"
    assert guides <= linked, f"guides the README does not link: {sorted(guides - linked)}"


# -- (b) the commands --------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # as the shell splits it; `&` and `>` are words of their own

    @property
    def text(self) -> str:
        """The command on one line, as SKIPPED and SLOW name it."""
        return " ".join(self.words)

    @property
    def runs(self) -> bool:
        return self.words[0] == "meshfl" and self.text not in SKIPPED


def commands_of(block: CodeBlock) -> list[Command]:
    """The shell commands of a code block, each on one line without its comment.

    A block that shows a prompt (`$ `) holds commands only on those lines, the rest is
    their output; elsewhere a line is a command when it starts with a program, and the
    other lines (a folder listing, a log line such as `meshfl: alpha finished ...`) are
    not. `a && b` is two commands.
    """
    if block.language not in ("", "sh", "bash", "shell", "console"):
        return []
    joined: list[str] = []
    pending = ""
    for line in block.lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    prompted = [line.strip()[2:] for line in joined if line.strip().startswith("$ ")]
    candidates = prompted or joined
    commands: list[Command] = []
    for line in candidates:
        if not line.split() or line.split()[0] not in ("meshfl", *NOT_RUN):
            continue  # output or a listing, which need not parse as shell words
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(Command(tuple(words[:cut])))
            words = words[cut + 1 :]
    return commands


def documented_commands() -> list[tuple[CodeBlock, list[Command]]]:
    found = []
    for _, blocks in read_pages().values():
        for block in blocks:
            commands = commands_of(block)
            if commands:
                found.append((block, commands))
    return found


def test_skip_and_slow_lists_name_documented_commands() -> None:
    documented = {command.text for _, commands in documented_commands() for command in commands}
    stale = sorted((set(SKIPPED) | SLOW) - documented)
    assert not stale, f"SKIPPED or SLOW names commands the pages no longer show: {stale}"


def shortened(words: list[str]) -> list[str]:
    """The command with 2 rounds, if it trains."""
    if len(words) < 2 or words[1] not in TRAINING_COMMANDS:
        return words
    if "--rounds" in words:
        at = words.index("--rounds") + 1
        return [*words[:at], SHORT_ROUNDS, *words[at + 1 :]]
    return [*words, "--rounds", SHORT_ROUNDS]


def example_files(folder: Path) -> None:
    """What the pages' commands name, in folder: the repository's examples/, and its
    peers.yaml with its loopback ports moved to free ones."""
    shutil.copytree(REPOSITORY / "examples", folder / "examples")
    text = (REPOSITORY / "peers.yaml").read_text()
    text = re.sub(r"tcp://127\.0\.0\.1:\d+", lambda _: f"tcp://127.0.0.1:{free_ports(1)[0]}", text)
    (folder / "peers.yaml").write_text(text)


def start(command: Command, folder: Path) -> tuple[subprocess.Popen[str], bool]:
    """Start one documented meshfl command in folder; whether it runs in the background."""
    words = list(command.words)
    background = words[-1] == "&"
    words = words[:-1] if background else words
    output_file = None
    if ">" in words:
        at = words.index(">")
        output_file = folder / words[at + 1]
        words = words[:at] + words[at + 2 :]
    argv = [sys.executable, "-m", "meshfl.launch.cli", *shortened(words)[1:]]
    if output_file is None:
        process = subprocess.Popen(
            argv, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    else:
        with output_file.open("w") as output:  # the child holds its own copy
            process = subprocess.Popen(argv, cwd=folder, stdout=output, text=True)
    return process, background


def finish(process: subprocess.Popen[str], command: Command) -> None:
    try:
        output, _ = process.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"`{command.text}` ran past {COMMAND_TIMEOUT_S} s:\n{output or ''}")
    assert process.returncode == 0, (
        f"`{command.text}` exited {process.returncode}:\n{(output or '')[-3000:]}"
    )


def block_cases() -> list[object]:
    cases = []
    for block, commands in documented_commands():
        runnable = [command for command in commands if command.runs]
        if not runnable:
            continue
        marks = [pytest.mark.slow] if SLOW & {command.text for command in runnable} else []
        cases.append(pytest.param(runnable, id=block.where, marks=marks))
    return cases


@pytest.mark.parametrize("commands", block_cases())
def test_documented_commands_run(commands: list[Command], tmp_path: Path) -> None:
    example_files(tmp_path)
    in_background: list[tuple[subprocess.Popen[str], Command]] = []
    try:
        for command in commands:
            process, background = start(command, tmp_path)
            if background:
                in_background.append((process, command))
            else:
                finish(process, command)
        for process, command in in_background:
            finish(process, command)
    finally:
        for process, _ in in_background:
            if process.poll() is None:
                process.kill()
                process.wait()
