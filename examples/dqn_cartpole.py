"""A small DQN on CartPole (written in JAX below), and the classic mistake.

The mistake (a Flux/Zygote question): computing the Q-values *outside* the
function passed to `withgradient`. Only what runs inside is differentiated, so
the gradients are all `None` and the model never changes. treegrad says so with
`tg.NoGradientWarning` instead of training nothing silently. The fix, in either
style, is to run the model inside.

Run: `python examples/dqn_cartpole.py` (a short run: 4 iterations of 100 steps per style,
about 20 s on a 2-core CPU) or `python examples/dqn_cartpole.py --full` (12 iterations of
300 steps, about 4 minutes, long enough for the greedy policy to balance far longer).
"""

import argparse
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import optax

import treegrad as tg
from treegrad import nn

GAMMA = 0.95


# --- CartPole (the classic control equations, as in Gym), in JAX -------------
def cartpole_step(s, action):
    x, x_dot, theta, theta_dot = s
    force = jnp.where(action == 1, 10.0, -10.0)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    tau = 0.02
    s2 = jnp.stack(
        [x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot, theta_dot + tau * theta_acc]
    )
    done = (jnp.abs(s2[0]) > 2.4) | (jnp.abs(s2[2]) > 0.2095)
    return s2, jnp.float32(1.0), done


def rollout(model, key, n, epsilon):
    """`n` transitions with an epsilon-greedy policy; episodes reset when done."""

    def step(carry, key):
        s, length = carry
        k1, k2, k3 = jax.random.split(key, 3)
        greedy = jnp.argmax(model(s))
        a = jnp.where(jax.random.uniform(k1) < epsilon, jax.random.randint(k2, (), 0, 2), greedy)
        s2, r, done = cartpole_step(s, a)
        reset = jax.random.uniform(k3, (4,), minval=-0.05, maxval=0.05)
        nxt = jnp.where(done, reset, s2)
        return (nxt, jnp.where(done, 0, length + 1)), (
            s,
            a,
            r,
            s2,
            done.astype(jnp.float32),
            length + 1,
            done,
        )

    s0 = jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)
    _, (s, a, r, s2, d, lengths, done) = jax.lax.scan(step, (s0, 0), jax.random.split(key, n))
    # Mean length of the episodes that ended; n when none did (it balanced throughout).
    mean = jnp.sum(jnp.where(done, lengths, 0)) / jnp.maximum(jnp.sum(done), 1)
    finished = jnp.where(jnp.any(done), mean, n)
    return (s, a, r, s2, d), float(finished)


def td_targets(target_model, r, s2, d):
    return r + GAMMA * (1.0 - d) * jnp.max(jax.vmap(target_model)(s2), axis=-1)


def q_taken(model, s, a):
    return jnp.take_along_axis(jax.vmap(model)(s), a[:, None], axis=1)[:, 0]


def make_model(key):
    k1, k2 = jax.random.split(key)
    return nn.Chain(nn.Dense(4, 32, jax.nn.relu, key=k1), nn.Dense(32, 2, key=k2))


def mistake(model, batch):
    """Q-values computed outside the closure: a warning, and no change."""
    s, a, r, s2, d = batch
    ps = tg.params(model)
    state = tg.setup(optax.adam(1e-3), ps)
    before = model[0].weight
    target = td_targets(model, r, s2, d)
    q = q_taken(model, s, a)  # <- outside: an unrelated array by the time gradient runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = tg.gradient(lambda: jnp.mean((q - target) ** 2), ps)
    tg.update_(state, ps, grads)  # every gradient is None: nothing to update
    return [str(w.message) for w in caught if issubclass(w.category, tg.NoGradientWarning)], model[
        0
    ].weight is before


def train_implicit(model, batch, steps, lr=3e-3):
    s, a, r, s2, d = batch
    target = td_targets(model, r, s2, d)  # fixed target network: outside is right here
    ps = tg.params(model)
    state = tg.setup(optax.adam(lr), ps)
    losses = []
    for _ in range(steps):
        loss, grads = tg.withgradient(lambda: jnp.mean((q_taken(model, s, a) - target) ** 2), ps)
        tg.update_(state, ps, grads)
        losses.append(float(loss))
    return losses


def train_explicit(model, batch, steps, lr=3e-3):
    s, a, r, s2, d = batch
    target = td_targets(model, r, s2, d)
    state = tg.setup(optax.adam(lr), model)
    losses = []
    for _ in range(steps):
        loss, (g,) = tg.withgradient(lambda m: jnp.mean((q_taken(m, s, a) - target) ** 2), model)
        state, model = tg.update(state, model, g)
        losses.append(float(loss))
    return model, losses


QUICK = {"iterations": 4, "steps": 100}
FULL = {"iterations": 12, "steps": 300}


def main(iterations: int = 4, steps: int = 100, verbose: bool = True) -> dict[str, list[float]]:
    start = time.perf_counter()
    key = jax.random.key(0)
    model = make_model(key)
    batch, _ = rollout(model, jax.random.fold_in(key, 1), 512, 1.0)
    messages, unchanged = mistake(model, batch)
    if verbose:
        print("Q computed outside the closure -> model", "unchanged" if unchanged else "changed")
        print("warning (tg.NoGradientWarning):")
        print(textwrap.indent(textwrap.fill(messages[0], 88), "  "))
        print(f"training one agent per style: {iterations} iterations of {steps} steps each")

    # One agent per style, each with its own replay buffer (the last 8192 transitions).
    agents = {"implicit": make_model(key), "explicit": make_model(key)}
    buffers: dict[str, tuple] = {}
    history: dict[str, list[float]] = {
        "implicit": [],
        "explicit": [],
        "greedy_implicit": [],
        "greedy_explicit": [],
    }
    for it in range(iterations):
        epsilon = max(0.05, 1.0 - it / (0.5 * iterations))
        for style, agent in agents.items():
            batch, _ = rollout(agent, jax.random.fold_in(key, 100 + it), 1024, epsilon)
            old = buffers.get(style)
            buffers[style] = (
                batch
                if old is None
                else tuple(jnp.concatenate([o, b])[-8192:] for o, b in zip(old, batch, strict=True))
            )
            if style == "implicit":
                losses = train_implicit(agent, buffers[style], steps)
            else:
                agents[style], losses = train_explicit(agent, buffers[style], steps)
            history[style] += losses
            _, greedy = rollout(agents[style], jax.random.fold_in(key, 999 + it), 1024, 0.0)
            history[f"greedy_{style}"].append(greedy)
        if verbose:
            print(
                f"iteration {it + 1:2d}/{iterations} (epsilon {epsilon:.2f}): greedy episode "
                f"length implicit {history['greedy_implicit'][-1]:6.1f}, "
                f"explicit {history['greedy_explicit'][-1]:6.1f}  "
                f"[{time.perf_counter() - start:4.0f} s]",
                flush=True,
            )
    if verbose:
        same = history["implicit"] == history["explicit"]
        print(
            f"done in {time.perf_counter() - start:.0f} s; the two styles' losses are "
            f"{'identical' if same else 'DIFFERENT'} step for step"
        )
    return history


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument(
        "--full",
        action="store_true",
        help="the long run: 12 iterations of 300 steps (about 4 minutes)",
    )
    cli.add_argument("--iterations", type=int, help="default 4, or 12 with --full")
    cli.add_argument("--steps", type=int, help="steps per iteration: 100, or 300 with --full")
    args = cli.parse_args()
    run = dict(FULL if args.full else QUICK)
    run.update(
        {k: v for k, v in (("iterations", args.iterations), ("steps", args.steps)) if v is not None}
    )
    main(**run)
