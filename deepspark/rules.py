"""Update rules: asynchronous EASGD (the default), its schedules, and the model-averaging baselines."""

import math

import numpy as np


# ---- asynchronous EASGD -----------------------------------------------------

def elastic_difference(x, center, moving_rate, out=None):
    """d = α·(x − x̃). `out` may be `x` itself (the server computes d in its receive buffer)."""
    out = np.subtract(x, center, out=out)
    out *= np.float32(moving_rate)
    return out


def apply_to_worker(x, d):
    """x ← x − d, in place."""
    np.subtract(x, d, out=x)
    return x


def apply_to_center(center, d, server_factor=1.0, scratch=None):
    """x̃ ← x̃ + server_factor·d, in place; `scratch` (shaped like d) avoids an allocation."""
    if server_factor == 1.0:
        np.add(center, d, out=center)
    else:
        np.add(center, np.multiply(d, np.float32(server_factor), out=scratch), out=center)
    return center


def all_finite(a, scratch=None):
    """True when `a` holds no NaN or ±Inf; `scratch` is a bool array shaped like `a`."""
    # One BLAS read pass: any NaN or ±Inf makes a·a non-finite. Only an overflow of
    # huge finite values can fool it, and that rare case is settled exactly.
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(np.dot(a, a)):
            return True
    return bool(np.isfinite(a, out=scratch).all())


def decayed(moving_rate, moving_rate_gamma, moving_rate_step, moving_rate_limit, exchanges):
    """α · γ^⌊exchanges / step⌋, never below the limit: DeepSpark's moving-rate schedule after `exchanges`
    (DeepSparkParameter's moving_rate, moving_rate_gamma, moving_rate_step, moving_rate_limit).

    step ≤ 0 or γ == 1 leaves α unchanged.
    """
    if moving_rate_step <= 0 or moving_rate_gamma == 1.0:
        return moving_rate
    return max(moving_rate * moving_rate_gamma ** (exchanges // moving_rate_step), moving_rate_limit)


def rate_weighted(moving_rate, share):
    """(the worker's pull, the center's) for a worker training at `share` (0, 1] of the fastest worker's rate
    (DeepSparkParameter.rate_weighted): the worker moves by min(1, α / share)·(x − x̃), toward the center harder the
    slower it trains, and the center by α·share·(x − x̃), less toward a worker that lags. share 1: (α, α)."""
    return min(1.0, moving_rate / share), moving_rate * share


class TrainingRates:
    """Each worker's training rate, as the exchanger sees it: iterations a second between two of its exchanges,
    each new figure averaged half and half with the last; and its share of the fastest rate among the workers still
    exchanging (whose last exchange is at most STALE of their own intervals old)."""

    STALE = 4

    def __init__(self):
        self.seen = {}  # worker: (monotonic seconds, iteration, seconds between its last two exchanges, rate)

    def share(self, worker, iteration, now):
        """Record `worker`'s exchange at `iteration`, `now` (time.monotonic()): its share (0, 1] of the fastest
        live worker's rate; 1 until two of its exchanges give it a rate."""
        last = self.seen.get(worker)
        interval, rate = (None, None) if last is None else last[2:]
        if last is not None and now > last[0] and iteration > last[1]:
            interval = now - last[0]
            measured = (iteration - last[1]) / interval
            rate = measured if rate is None else (rate + measured) / 2
        self.seen[worker] = (now, iteration, interval, rate)
        # list(): one step under the GIL, while other connections' threads add and forget workers.
        live = [r for t, _, i, r in list(self.seen.values()) if r and now - t <= self.STALE * i]
        return 1.0 if not rate or not live else min(1.0, rate / max(live))

    def forget(self, worker):
        """`worker` left (its connection ended): a replacement's rate is its own, not one that counts the time
        between the loss and the rejoin."""
        self.seen.pop(worker, None)


# ---- when to exchange --------------------------------------------------------

def periodic_due(iteration, period):
    """Exchange (or average) after every `period` local iterations; iteration counts from 1."""
    return period > 0 and iteration % period == 0


def adaptive_due(loss_since_exchange, first_period_loss):
    """DeepSpark's variable τ: exchange once the loss summed since the last exchange exceeds the first period's."""
    return first_period_loss is not None and first_period_loss > 0 and loss_since_exchange > first_period_loss


class ExchangeSchedule:
    """Decides after each local iteration whether the worker exchanges now (fixed or adaptive period)."""

    def __init__(self, period, adaptive=False):
        if period < 1:
            raise ValueError("period must be ≥ 1, got %r" % (period,))
        self.period = period
        self.adaptive = adaptive
        self.iteration = 0
        self.first_period_loss = None
        self.loss_since_exchange = 0.0

    def step(self, loss=0.0):
        """Record one local iteration with its loss; True when it is time to exchange."""
        self.iteration += 1
        if math.isfinite(loss):
            self.loss_since_exchange += loss
        if not self.adaptive or self.first_period_loss is None:
            due = periodic_due(self.iteration, self.period)
            if due and self.adaptive:
                self.first_period_loss = self.loss_since_exchange
        else:
            due = adaptive_due(self.loss_since_exchange, self.first_period_loss)
        if due:
            self.loss_since_exchange = 0.0
        return due


# ---- baselines ---------------------------------------------------------------

def average_models(models, out=None):
    """The element-wise mean of equally shaped parameter vectors.

    Synchronous averaging (CaffeOnSpark-style, every iteration) and periodic model
    averaging (SparkNet-style, every τ) are this same step at different periods.
    """
    models = list(models)
    if not models:
        raise ValueError("no models to average")
    if out is None:
        out = np.array(models[0], dtype=np.float32)
    else:
        np.copyto(out, models[0])
    for m in models[1:]:
        out += m
    out *= np.float32(1.0 / len(models))
    return out


def outer_step(center, mean, velocity, learning_rate, momentum):
    """DiLoCo's outer Nesterov step on the averaged update, in place on `center` and `velocity`:

        g = x̃ − mean,   v ← μ·v + g,   x̃ ← x̃ − η·(g + μ·v)

    With η = 1 and μ = 0 it is x̃ ← mean: model averaging. Returns `center`.
    """
    g = center - mean
    velocity *= momentum
    velocity += g
    center -= learning_rate * (g + momentum * velocity)
    return center
