"""Developer sessions: `nox -s lint typecheck tests` before each commit."""

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


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
