"""The documentation: exact diagnostic messages, doctests, copied code, and the built site."""

import importlib.util
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treegrad as tg
from treegrad import nn

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
PAGES = [
    "index",
    "gradients",
    "optimiser",
    "compilation",
    "scaling",
    "pitfalls",
    "inside",
    "flux",
    "coming-from",
    "benchmarks",
    "api",
    *(
        f"api/{name}"
        for name in (
            "gradients",
            "implicit",
            "models",
            "optimiser",
            "training",
            "checkpoints",
            "scaling",
            "losses",
            "nn",
            "datasets",
            "types",
        )
    ),
]
COPY_JS = DOCS / "javascripts" / "copy-runnable.js"


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
    W, b = jnp.ones((2, 3)), jnp.zeros(2)
    alone = tg.Params([W, b])
    grads = tg.gradient(lambda: jnp.sum(W @ jnp.ones(3) + b), alone)
    tg.update_(tg.setup(optax.sgd(0.1), alone), alone, grads)
    with pytest.raises(TypeError) as e:
        tg.gradient(lambda: jnp.sum(W @ jnp.ones(3) + b), alone)
    out.append(str(e.value))
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
    with pytest.raises(TypeError) as e:
        tg.gradient(lambda: jnp.mean((model(x) - y) ** 2), model)
    out.append(str(e.value))
    losses: list = []

    @tg.jit
    def step(model, x, y):
        loss = jnp.mean((model(x) - y) ** 2)
        losses.append(loss)
        return loss

    with pytest.warns(tg.RetraceWarning) as w:
        step(model, x, y)
    out.append(str(w[0].message).replace("actual_messages.<locals>.", ""))  # as at top level

    def loss(m):
        noise = np.random.normal(scale=0.1, size=x.shape)
        return jnp.mean((m(x + noise) - y) ** 2)

    with pytest.warns(tg.RetraceWarning) as w:
        tg.gradient(loss, model)
    out.append(str(w[0].message).replace("actual_messages.<locals>.", ""))

    class Trainer:
        def __init__(self):
            self.step = 0

    trainer = Trainer()

    @tg.jit
    def train_step(x, y):
        trainer.step += 1
        lr = 1e-2 if trainer.step < 1000 else 1e-3
        return jnp.sum((x - y) ** 2) * lr

    with pytest.warns(tg.RetraceWarning) as w:
        for _ in range(2):
            train_step(x, y[:, :1])
    out.append(str(w[0].message).replace("actual_messages.<locals>.", ""))

    counts = np.zeros(2)

    def f(w):
        counts[0] += 1
        return jnp.sum(w) * counts[0]

    with pytest.warns(tg.RetraceWarning) as w:
        tg.gradient(f, jnp.ones(2))
    out.append(str(w[0].message).replace("actual_messages.<locals>.", ""))
    return out


def test_pitfalls_page_shows_exact_messages(tmp_path):
    documented = quoted("pitfalls")
    for message in actual_messages(tmp_path):
        assert message in documented, f"docs/pitfalls.md does not show:\n{message}"


def test_compilation_page_shows_the_deleted_array_message_exactly():
    b = jnp.ones(3)
    tg.gradient(lambda v: jnp.sum(v * b), jnp.ones(3))
    b.delete()  # as donation deletes it
    with pytest.raises(RuntimeError) as e:
        tg.gradient(lambda v: jnp.sum(v * b), jnp.ones(3))
    assert str(e.value) in quoted("compilation"), str(e.value)


def page_blocks():
    """The console blocks of each docs page, as the site shows them: `{page: [text]}`."""
    fence = re.compile(r"^```pycon\n(.*?)^```", re.M | re.S)
    return {
        str(md.relative_to(DOCS)): fence.findall(md.read_text())
        for md in sorted(DOCS.rglob("*.md"))
    }


def documented_objects():
    """The objects whose docstrings the API reference renders: `{name: object}`."""
    from treegrad import _typing, datasets

    out = {}
    for label, module in {
        "tg": tg,
        "tg.nn": nn,
        "tg.losses": tg.losses,
        "tg.datasets": datasets,
        "treegrad._typing": _typing,
    }.items():
        out[label] = module
        names = getattr(module, "__all__", None) or [n for n in dir(module) if n[0] != "_"]
        for name in names:
            obj = getattr(module, name)
            if not getattr(obj, "__module__", "").startswith("treegrad"):
                continue
            out[f"{label}.{name}"] = obj
            for member, value in vars(obj).items() if isinstance(obj, type) else ():
                if member[0] != "_" and getattr(value, "__doc__", None):
                    out[f"{label}.{name}.{member}"] = value
    return out


def docstring_blocks():
    """The Examples section of each documented docstring: `{name: [text]}`."""
    out = {}
    for where, obj in documented_objects().items():
        doc = inspect.getdoc(obj) or ""
        match = re.search(r"^Examples?:\n(.*?)(?=^\S|\Z)", doc, re.M | re.S)
        if match:
            out[where] = [textwrap.dedent(match.group(1))]
    return out


def copied(blocks):
    """What the copy button copies from each block: `runnableCode` run by Node.js."""
    script = (
        f"const {{ runnableCode }} = require({json.dumps(str(COPY_JS))});"
        "let input = ''; process.stdin.on('data', (d) => (input += d));"
        "process.stdin.on('end', () => console.log(JSON.stringify("
        "JSON.parse(input).map((b) => b.map(runnableCode)))));"
    )
    keys = list(blocks)
    result = subprocess.run(
        ["node", "-e", script],
        input=json.dumps([blocks[k] for k in keys]),
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(zip(keys, json.loads(result.stdout), strict=True))


def test_copy_button_strips_prompts_output_and_raising_lines():
    if shutil.which("node") is None:
        pytest.skip("Node.js not installed: the copy script cannot be run outside a browser")
    block = textwrap.dedent(
        """\
        >>> for i in range(2):
        ...     print(i)  # doctest: +NORMALIZE_WHITESPACE
        ...
        0
        1
        >>> {}["missing"]
        Traceback (most recent call last):
        ...
        KeyError: 'missing'
        >>> x = 1
        """
    )
    (out,) = copied({"case": [block]})["case"]
    assert out == (
        'for i in range(2):\n    print(i)\n\n# raises KeyError:\n# {}["missing"]\nx = 1\n'
    )
    assert copied({"plain": ["pip install treegrad"]})["plain"] == [None]


# The docstrings' run takes 7 s on a quiet 2-core machine (one compile per example).
@pytest.mark.parametrize(
    "source", [pytest.param(s, marks=pytest.mark.slow) for s in ("pages", "docstrings")]
)
def test_copied_code_runs(source, tmp_path, monkeypatch):
    """Each page's copied blocks, pasted in order into one script, run; so does each
    docstring's example on its own."""
    if shutil.which("node") is None:
        pytest.skip("Node.js not installed: the copy script cannot be run outside a browser")
    blocks = page_blocks() if source == "pages" else docstring_blocks()
    assert sum(map(len, blocks.values())) > 10, blocks
    monkeypatch.chdir(tmp_path)  # examples that save files write here
    for where, codes in copied(blocks).items():
        namespace = {"__name__": "__copied__"}
        for code in codes:
            assert code is not None and ">>>" not in code, where
            # A failure's traceback names `where` as the file.
            exec(compile(code, where, "exec"), namespace)


@pytest.mark.docs
@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason='the docs site needs the docs extra: pip install -e ".[docs]"',
)
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
        assert "javascripts/copy-runnable.js" in text, f"{page}: no runnable-copy script"
    losses = (site / "api/losses/index.html").read_text()
    for name in ("mse", "huber", "logitcrossentropy"):
        heading = re.search(rf'<h2 id="treegrad\.losses\.{name}".*?</h2>', losses, re.S)
        assert heading and f"treegrad.losses.{name}</span>" in heading.group(0), name
