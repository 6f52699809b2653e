"""Developer sessions: `nox -s lint typecheck tests` before each commit.

`nox -s tests_newest` runs every test on the newest jax and jaxlib, on each of
Python 3.12 and 3.13 found (jax 0.11 and later need Python >= 3.12); `.ci/run`
runs it when such an interpreter exists, in parallel (`-- -n auto`, pytest-xdist),
each test once: the default selection of the engine's tests (marked `engine`: they
read the interpreter's bytecode and frames) on both, every other test on the first.
"""

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"

NEWEST_PYTHONS = ["3.12", "3.13"]
JAX_VERSION = "import jax, jaxlib; print(jax.__version__, jaxlib.__version__)"


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=NEWEST_PYTHONS)
def tests_newest(session: nox.Session) -> None:
    """The newest jax first, then treegrad: its floors must keep that jax (no downgrade)."""
    session.install("--upgrade", "jax", "jaxlib")
    newest = session.run("python", "-c", JAX_VERSION, silent=True)
    session.install("-e", ".[test]")
    kept = session.run("python", "-c", JAX_VERSION, silent=True)
    if kept != newest:
        session.error(f"installing treegrad changed jax, jaxlib from {newest} to {kept}")
    session.log(f"jax, jaxlib {str(kept).strip()}: kept by `pip install -e .`")
    # Every test but the docs-site build (whose tools the dev extra brings).
    session.run("python", "-m", "pytest", "-m", "not docs", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".", "mypy==2.4.1")
    session.run("mypy", "treegrad")


@nox.session
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session
def bench(session: nox.Session) -> None:
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/run.py", *session.posargs)
