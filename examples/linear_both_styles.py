"""A linear model `y = W @ x + b` trained in both styles (Flux's first example).

Explicit style differentiates with respect to the arguments and returns a tuple
shaped like them; implicit style differentiates a zero-argument closure with
respect to registered parameters and returns `Grads` looked up by the array:
`grads[W]`. Run: `python examples/linear_both_styles.py`.
"""

import jax
import jax.numpy as jnp
import optax

import treegrad as tg


def main(steps: int = 200, verbose: bool = True) -> dict[str, list[float]]:
    key_w, key_x = jax.random.split(jax.random.key(0))
    true_W = jnp.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    true_b = jnp.array([0.5, -0.5])
    xs = jax.random.normal(key_x, (64, 3))
    ys = xs @ true_W.T + true_b

    def loss(W, b):
        return jnp.mean((xs @ W.T + b - ys) ** 2)

    # The gradient of the seed example: sum(W @ x + b) has gradient outer(ones, x), ones.
    x = jnp.array([3.0, 1, 0])
    gW, gb = tg.gradient(lambda W, b: jnp.sum(W @ x + b), true_W, true_b)
    if verbose:
        print("explicit: gradient(lambda W, b: sum(W @ x + b), W, b) ->\n", gW, gb)

    # Explicit style: the parameters are arguments; the model is a dict.
    model = {"W": jax.random.normal(key_w, (2, 3)), "b": jnp.zeros(2)}
    state = tg.setup(optax.sgd(0.1), model)
    explicit = []
    for _ in range(steps):
        value, (g,) = tg.withgradient(lambda m: loss(m["W"], m["b"]), model)
        state, model = tg.update(state, model, g)
        explicit.append(float(value))

    # Implicit style: the same model in a dict the closure reads; Params registers
    # its arrays and re-reads the dict each call, so it follows update_.
    params = {"W": jax.random.normal(key_w, (2, 3)), "b": jnp.zeros(2)}
    ps = tg.params(params)
    state = tg.setup(optax.sgd(0.1), ps)
    implicit = []
    for _ in range(steps):
        value, grads = tg.withgradient(lambda: loss(params["W"], params["b"]), ps)
        W = params["W"]
        assert grads[W].shape == W.shape  # looked up by the array itself
        tg.update_(state, ps, grads)
        implicit.append(float(value))

    if verbose:
        print(f"final loss: explicit {explicit[-1]:.2e}, implicit {implicit[-1]:.2e}")
        print("learned W:\n", params["W"], "\nlearned b:", params["b"])
    return {"explicit": explicit, "implicit": implicit}


if __name__ == "__main__":
    main()
