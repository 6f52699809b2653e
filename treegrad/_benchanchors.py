"""The anchor libraries for `treegrad bench`: the same Adam step of the same MLP in
equinox, flax nnx and PyTorch, each run when installed, else skipped with a note
that says how to install it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

LR = 1e-3  # every system's Adam learning rate
Runner = Callable[[int], None]

# The anchor libraries that `pip install -e ".[bench]"` brings (PyTorch is installed apart:
# its default wheel is a CUDA build of several GB).
BENCH_EXTRA = 'pip install -e ".[bench]"'


def _skipped(name: str, error: BaseException, install: str) -> str:
    return f"{name} skipped ({type(error).__name__}: {str(error)[:80]}); to include it: {install}"


def add_anchors(
    systems: dict[str, Runner], notes: list[str], sizes: list[int], x: Any, y: Any, opt: Any
) -> None:
    try:
        import equinox as eqx

        model = eqx.nn.MLP(sizes[0], sizes[-1], sizes[1], len(sizes) - 2, key=jax.random.key(0))

        @eqx.filter_jit
        def eqx_step(m: Any, st: Any, x: Any, y: Any) -> Any:
            loss, g = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(m)
            u, st = opt.update(g, st, eqx.filter(m, eqx.is_array))
            return eqx.apply_updates(m, u), st, loss

        eqx_state = [model, opt.init(eqx.filter(model, eqx.is_array))]

        def run_eqx(n: int, s: list[Any] = eqx_state) -> None:
            m, st = s
            for _ in range(n):
                m, st, _l = eqx_step(m, st, x, y)
            jax.block_until_ready(eqx.filter(m, eqx.is_array))
            s[:] = [m, st]

        systems["equinox filter_jit fused"] = run_eqx
    except ImportError as e:
        notes.append(_skipped("equinox", e, BENCH_EXTRA))
    try:
        from flax import nnx

        class NnxMLP(nnx.Module):
            def __init__(self, sizes: list[int], rngs: Any):
                self.layers = nnx.List(
                    [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)]
                )

            def __call__(self, x: Any) -> Any:
                for layer in self.layers[:-1]:
                    x = jax.nn.relu(layer(x))
                return self.layers[-1](x)

        nnx_model = NnxMLP(sizes, nnx.Rngs(0))
        nnx_opt = nnx.Optimizer(nnx_model, opt, wrt=nnx.Param)

        @nnx.jit
        def nnx_step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
            loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, g)
            return loss

        cached = nnx.cached_partial(nnx_step, nnx_model, nnx_opt)

        def run_nnx(n: int) -> None:
            for _ in range(n):
                loss = nnx_step(nnx_model, nnx_opt, x, y)
            jax.block_until_ready(loss)

        def run_cached(n: int) -> None:
            for _ in range(n):
                loss = cached(x, y)
            jax.block_until_ready(loss)

        systems["flax nnx.jit"] = run_nnx
        systems["flax nnx.cached_partial"] = run_cached
    # Missing, or an API this flax version lacks (nnx.List, nnx.cached_partial): a note.
    except (ImportError, AttributeError, TypeError) as e:
        notes.append(_skipped("flax nnx", e, BENCH_EXTRA))
    try:
        import torch

        torch.set_num_threads(1)
        layers: list[Any] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(torch.nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        net = torch.nn.Sequential(*layers)
        topt = torch.optim.Adam(net.parameters(), lr=LR)
        tx = torch.tensor(jax.device_get(x))
        ty = torch.tensor(jax.device_get(y))

        def run_torch(n: int) -> None:
            for _ in range(n):
                topt.zero_grad()
                loss = ((net(tx) - ty) ** 2).mean()
                loss.backward()
                topt.step()

        systems["PyTorch eager (CPU)"] = run_torch
    except ImportError as e:
        notes.append(_skipped("torch", e, "pip install torch"))
