"""Developer sessions: ``nox -l`` lists them, ``nox -s tests`` runs one.

Every session that installs the project installs the pinned torch first, so that pip never
resolves an unpinned torch (which would pull a multi-GB CUDA build onto CPU machines).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import nox

PYTHON = "3.11"
TORCH = "torch==2.13.0"
OLDEST_TORCH = "torch==2.11.0"  # pyproject.toml: torch>=2.11
LINT_PATHS = ["fsdp", "tests", "examples", "noxfile.py"]
ROOT = Path(__file__).resolve().parent

nox.options.sessions = ["lint", "typecheck", "docs", "tests"]


def _install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole suite, as CI and the README run it."""
    _install(session, "test,hf")
    session.run("pytest", "-q", "tests", *session.posargs)


@nox.session(python=PYTHON)
def tests_oldest_torch(session: nox.Session) -> None:
    """The whole suite on the oldest supported torch (2.11), on the CPU. Not run by default.

    PyPI has no CPU build of torch 2.11, so this installs its CUDA build (about 5 GB with the CUDA
    libraries), which runs on a machine without a GPU as well.
    """
    session.install(OLDEST_TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "tests", *session.posargs, env={"CUDA_VISIBLE_DEVICES": ""})


@nox.session(python=PYTHON)
@nox.parametrize("world_size", ["1", "2", "3", "4"])
def tests_matrix(session: nox.Session, world_size: str) -> None:
    """The distributed tests at one world size (``pool`` parameters of other sizes deselected)."""
    _install(session, "test,hf")
    session.run(
        "pytest", "-q", "tests/distributed", *session.posargs, env={"FSDP_TEST_WORLD_SIZES": world_size}
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check (ruff needs neither torch nor the project installed)."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on fsdp/, configured by [tool.mypy] in pyproject.toml."""
    _install(session, "lint")
    session.run("mypy", *session.posargs)


@nox.session(python=PYTHON)
def example(session: nox.Session) -> None:
    """A short two-rank run of the GPT example, into out/nox_example (replaced at every run)."""
    _install(session, "examples")
    args = ["--max-iters", "20", "--out-dir", "out/nox_example", "--overwrite"]
    session.run("torchrun", "--standalone", "--nproc_per_node=2", "-m", "examples.train_gpt", *args)


@nox.session(python=PYTHON)
def benchmark(session: nox.Session) -> None:
    """benchmarks.peers: this library against torch FSDP2, torch DDP and no communication.

    Two ranks by default; on a GPU machine run ``NPROC_PER_NODE=1 nox -s benchmark`` (world size 1,
    adds fairscale's FSDP). Arguments after ``--`` go to the script (``--sizes``, ``--rounds``, ``--out``).
    """
    _install(session, "examples")
    session.install("fairscale==0.4.13")  # the GPU run compares with it
    nproc = os.environ.get("NPROC_PER_NODE", "2")
    session.run(
        "torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m", "benchmarks.peers", *session.posargs
    )


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")  # [text](target "title")
_REF_LINK = re.compile(r"^[ ]{0,3}\[[^\]]+\]:[ \t]*<?([^\s>]+)>?", re.MULTILINE)  # [id]: target
_FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def broken_relative_links(root: Path = ROOT) -> list[str]:
    """``file: target`` for every relative link in README.md and docs/*.md that names no file."""
    broken = []
    for md in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not md.exists():
            continue
        text = _CODE_SPAN.sub("", _FENCE.sub("", md.read_text(encoding="utf-8")))
        for target in _LINK.findall(text) + _REF_LINK.findall(text):
            if re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*:|#|//)", target):  # URL, mailto:, in-page anchor
                continue
            path = unquote(target.split("#", 1)[0].split("?", 1)[0])
            resolved = root / path.lstrip("/") if path.startswith("/") else md.parent / path
            if not resolved.exists():
                broken.append(f"{md.relative_to(root)}: {target}")
    return broken


@nox.session(python=False)
def docs(session: nox.Session) -> None:
    """Every relative link in README.md and docs/*.md must point to an existing file."""
    broken = broken_relative_links()
    if broken:
        session.error("broken relative links:\n  " + "\n  ".join(broken))
    session.log("all relative links in README.md and docs/*.md resolve")
