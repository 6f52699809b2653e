"""The documentation: exact diagnostic messages, doctests, and the built site."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import treegrad as tg
from treegrad import nn

DOCS = pathlib.Path(__file__).parent.parent / "docs"
PAGES = [
    "index",
    "gradients",
    "optimiser",
    "compilation",
    "pitfalls",
    "inside",
    "flux",
    "coming-from",
    "benchmarks",
    "api",
]


def quoted(page):
    return [
        line[2:] for line in (DOCS / f"{page}.md").read_text().splitlines() if line.startswith("> ")
    ]


def actual_messages(tmp_path):
    model = nn.Dense(4, 2, key=jax.random.key(0))
    x, y = jnp.ones((3, 4)), jnp.zeros((3, 2))
    ps = tg.params(model)
    q = model(x)
    out = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tg.gradient(lambda: jnp.mean((q - y) ** 2), ps)
    out.append(str(w[0].message))
    grads = tg.gradient(lambda: jnp.mean((model(x) - y) ** 2), ps)
    tg.update_(tg.setup(optax.sgd(0.1), ps), ps, grads)
    with pytest.raises(KeyError) as e:
        grads[model.weight]
    out.append(e.value.args[0])
    with pytest.raises(TypeError) as e:
        tg.gradient(lambda m: m(x), model)
    out.append(str(e.value))
    with pytest.raises(tg.NonFiniteLossError) as e:
        data = [(x, y), (x.at[0, 0].set(jnp.nan), y)]
        tg.train(
            lambda m, x, y: tg.losses.mse(m(x), y), model, data, tg.setup(optax.sgd(0.1), model)
        )
    out.append(str(e.value))
    with pytest.raises(ValueError) as e:
        tg.update(tg.setup(optax.sgd(0.1), model), model, {"weight": 1})
    out.append(str(e.value))
    f = tmp_path / "model.npz"
    tg.save(f, model)
    with pytest.raises(ValueError) as e:
        tg.load(f, nn.Dense(3, 2, key=jax.random.key(0)))
    out.append(str(e.value).replace(str(f), "model.npz"))
    with pytest.raises(ValueError) as e:
        model(jnp.ones((3, 5)))
    out.append(str(e.value))
    return out


def test_pitfalls_page_shows_exact_messages(tmp_path):
    documented = quoted("pitfalls")
    for message in actual_messages(tmp_path):
        assert message in documented, f"docs/pitfalls.md does not show:\n{message}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="docs extras not installed")
def test_site_builds_strict_with_every_page(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        cwd=DOCS.parent,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    home = (site / "index.html").read_text()
    for page in PAGES:
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.exists(), page
        text = html.read_text()
        assert re.search(r'<code|class="highlight"', text), f"{page}: no rendered code block"
        href = "." if page == "index" else f"{page}/"
        assert f'href="{href}"' in home or f'href="./{href}"' in home, (
            f"{page}: not in the navigation"
        )
