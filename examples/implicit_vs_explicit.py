"""Implicit and explicit style side by side, compiled and not: identical trajectories, and timing.

Both styles run the same engine, so from the same initial weights and data they
produce bit-identical parameters at every step: uncompiled (each
`tg.withgradient` and `tg.update` call its own XLA program) and compiled
(`tg.jit` around the whole step: one XLA program). The table shows the
per-step time of each next to the hand-written JAX it replaces: two jitted
calls for the uncompiled loops, one fused `jax.jit` step for the compiled ones.
Run: `python examples/implicit_vs_explicit.py`.
"""

import time

import jax
import jax.numpy as jnp
import optax

import treegrad as tg
from treegrad import nn


def make_model(key):
    k1, k2 = jax.random.split(key)
    return nn.Chain(nn.Dense(8, 32, jax.nn.tanh, key=k1), nn.Dense(32, 1, key=k2))


def _max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(p - q)))
        for p, q in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def main(steps: int = 200, verbose: bool = True) -> dict[str, list[float]]:
    x = jax.random.normal(jax.random.key(1), (64, 8))
    y = jnp.sin(jnp.sum(x, axis=1, keepdims=True))
    loss = lambda m: jnp.mean((m(x) - y) ** 2)
    rule = optax.adam(1e-2)

    # Uncompiled loops: a new lambda each step, one XLA call for the gradient, one for the update.
    explicit = make_model(jax.random.key(0))
    s_exp = tg.setup(rule, explicit)
    implicit = make_model(jax.random.key(0))
    ps = tg.params(implicit)
    s_imp = tg.setup(rule, ps)

    # Compiled steps: the whole step in one XLA computation.
    explicit_c = make_model(jax.random.key(0))
    s_exp_c = tg.setup(rule, explicit_c)
    implicit_c = make_model(jax.random.key(0))
    ps_c = tg.params(implicit_c)
    s_imp_c = tg.setup(rule, ps_c)

    @tg.jit
    def explicit_step(state, model):
        value, (g,) = tg.withgradient(loss, model)
        state, model = tg.update(state, model, g)
        return state, model, value

    @tg.jit
    def implicit_step():
        value, grads = tg.withgradient(lambda: loss(implicit_c), ps_c)
        tg.update_(s_imp_c, ps_c, grads)
        return value

    # Hand-written JAX, for scale: the same model as plain arrays.
    params = jax.tree_util.tree_leaves(make_model(jax.random.key(0)))
    hand_loss = lambda p: jnp.mean(((jnp.tanh(x @ p[0].T + p[1]) @ p[2].T + p[3]) - y) ** 2)
    value_and_grad = jax.jit(jax.value_and_grad(hand_loss))

    @jax.jit
    def apply(p, st, g):
        u, st = rule.update(g, st, p)
        return optax.apply_updates(p, u), st

    @jax.jit
    def fused(p, st):
        value, g = jax.value_and_grad(hand_loss)(p)
        u, st = rule.update(g, st, p)
        return optax.apply_updates(p, u), st, value

    hand = {"two-call": [params, rule.init(params)], "fused": [params, rule.init(params)]}

    def run(name):
        nonlocal explicit, s_exp, explicit_c, s_exp_c
        if name == "explicit":
            value, (g,) = tg.withgradient(loss, explicit)
            s_exp, explicit = tg.update(s_exp, explicit, g)
            return value, explicit
        if name == "implicit":
            value, grads = tg.withgradient(lambda: loss(implicit), ps)
            tg.update_(s_imp, ps, grads)
            return value, implicit
        if name == "explicit, tg.jit":
            s_exp_c, explicit_c, value = explicit_step(s_exp_c, explicit_c)
            return value, explicit_c
        if name == "implicit, tg.jit":
            return implicit_step(), implicit_c
        if name == "hand-written two-call":
            p, st = hand["two-call"]
            value, g = value_and_grad(p)
            hand["two-call"] = list(apply(p, st, g))
            return value, hand["two-call"][0]
        p, st = hand["fused"]
        p, st, value = fused(p, st)
        hand["fused"] = [p, st]
        return value, p

    names = [
        "explicit",
        "implicit",
        "hand-written two-call",
        "explicit, tg.jit",
        "implicit, tg.jit",
        "hand-written fused",
    ]
    curves: dict[str, list[float]] = {n: [] for n in names}
    times = dict.fromkeys(names, 0.0)
    max_diff = {"uncompiled": 0.0, "compiled": 0.0}
    for step in range(steps):
        for name in names:
            t = time.perf_counter()
            value, model = run(name)
            jax.block_until_ready(model)
            if step:  # the first step compiles
                times[name] += time.perf_counter() - t
            curves[name].append(float(value))
        max_diff["uncompiled"] = max(max_diff["uncompiled"], _max_diff(explicit, implicit))
        max_diff["compiled"] = max(max_diff["compiled"], _max_diff(explicit_c, implicit_c))
    if verbose:
        print(f"{'style':<24} {'final loss':>11} {'us/step':>9}")
        for name in names:
            per_step = 1e6 * times[name] / (steps - 1)
            print(f"{name:<24} {curves[name][-1]:>11.5f} {per_step:>9.1f}")
        print(f"largest parameter difference between the styles over {steps} steps: {max_diff}")
    assert max_diff == {"uncompiled": 0.0, "compiled": 0.0}, "the two styles diverged"
    return curves


if __name__ == "__main__":
    main()
