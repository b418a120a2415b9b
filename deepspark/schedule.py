"""Caffe's learning-rate policies and solver update arithmetic, shared by every backend.

The update is written once, over an `ops` namespace (sqrt, sign, sum, where),
so the same lines run on NumPy arrays (the reference the tests use) and on
TensorFlow tensors (the TensorFlow backend's compiled step).
"""

import math
from types import SimpleNamespace

import numpy as np

NUMPY = SimpleNamespace(sqrt=np.sqrt, sign=np.sign, sum=np.sum, where=np.where)

# Caffe's solver types, in the order of the deprecated solver_type enum, each with the
# history blobs per learnable parameter that its SolverState stores (AdaDelta and Adam
# keep a second set, appended after the first).
SOLVER_TYPES = {"SGD": 1, "Nesterov": 1, "AdaGrad": 1, "RMSProp": 1, "AdaDelta": 2, "Adam": 2}

# Caffe's learning-rate policies, each with the SolverParameter fields it needs.
LR_POLICIES = {"fixed": (), "step": ("gamma", "stepsize"), "exp": ("gamma",), "inv": ("gamma", "power"),
               "multistep": ("gamma", "stepvalue"), "poly": ("power", "max_iter"), "sigmoid": ("gamma", "stepsize")}


def solver_type(param):
    """The solver type, honouring the deprecated solver_type enum as Caffe does."""
    if param.HasField("type") or not param.HasField("solver_type"):
        return param.type
    return list(SOLVER_TYPES)[param.solver_type]


# deepspark_param.lr_scaling: the factor on each worker's rate for w workers.
LR_SCALINGS = {0: ("none", lambda w: 1.0), 1: ("linear", float), 2: ("sqrt", math.sqrt)}


def lr_scale(ds):
    """The factor deepspark_param `ds`'s lr_scaling puts on the policy's rate, by its workers: 1 for NONE and for
    a single run (one worker), workers for LINEAR, sqrt(workers) for SQRT."""
    workers = 1 if ds.algorithm == ds.SINGLE else ds.workers
    return LR_SCALINGS[ds.lr_scaling][1](workers)


def warmup_factor(ds, iteration):
    """The factor on the policy's rate at `iteration`: lr_scale, reached from 1 linearly over lr_warmup
    iterations (Goyal et al. 2017's gradual warm-up): 1 + (scale - 1) x iteration / lr_warmup until then."""
    scale = lr_scale(ds)
    if scale == 1.0 or iteration >= ds.lr_warmup:
        return scale
    return 1.0 + (scale - 1.0) * iteration / ds.lr_warmup


def scaling_line(param):
    """The log's line of the rule where it scales the rate, else None:
    'Learning rate: base_lr 0.01 x 2 workers (linear) after 200 warm-up iterations'."""
    ds = param.deepspark_param
    scale = lr_scale(ds)
    if scale == 1.0:
        return None
    name = LR_SCALINGS[ds.lr_scaling][0]
    factor = f"{ds.workers} workers" if name == "linear" else f"sqrt({ds.workers} workers) = {scale:.4g}"
    warmup = f"after {ds.lr_warmup} warm-up iterations from base_lr" if ds.lr_warmup else "from the first iteration"
    return f"Learning rate: base_lr {param.base_lr:g} x {factor} ({name}) {warmup}, as the policy schedules it"


def learning_rate(param, iteration, current_step=0):
    """(rate, current_step) at `iteration`, as Caffe's SGDSolver::GetLearningRate, times warmup_factor (1 unless
    deepspark_param.lr_scaling scales a job's rate by its workers).

    `current_step` is the solver's counter that 'multistep' advances (at most
    one step per call, as Caffe does) and 'step' recomputes.
    """
    policy = param.lr_policy or "fixed"
    base, gamma, power = param.base_lr, param.gamma, param.power
    if policy == "fixed":
        rate = base
    elif policy == "step":
        current_step = iteration // param.stepsize
        rate = base * gamma ** current_step
    elif policy == "exp":
        rate = base * gamma ** iteration
    elif policy == "inv":
        rate = base * (1.0 + gamma * iteration) ** -power
    elif policy == "multistep":
        if current_step < len(param.stepvalue) and iteration >= param.stepvalue[current_step]:
            current_step += 1
        rate = base * gamma ** current_step
    elif policy == "poly":
        rate = base * (1.0 - iteration / param.max_iter) ** power
    elif policy == "sigmoid":
        exponent = -gamma * (iteration - param.stepsize)
        rate = 0.0 if exponent > 700 else base / (1.0 + math.exp(exponent))
    else:
        raise ValueError(f"unknown lr_policy '{policy}'")
    return float(rate) * warmup_factor(param.deepspark_param, iteration), current_step


def stop_iteration(param):
    """The iteration training stops at: deepspark_param.iterations where set (`train --iterations`), else
    max_iter. learning_rate keeps reading max_iter, so a run cut short follows the start of the solver's own
    schedule (Caffe's Solver::Step(n) against Solve's Step(max_iter - iter))."""
    ds = param.deepspark_param
    return ds.iterations if ds.HasField("iterations") else param.max_iter


def stop_note(param):
    """The log's line for a run that stops elsewhere than max_iter, else None."""
    stop = stop_iteration(param)
    if stop == param.max_iter:
        return None
    return (f"Stopping at iteration {stop} (iterations), not max_iter {param.max_iter}; the learning rate follows "
            f"max_iter's schedule")


def history_sets(param):
    return SOLVER_TYPES[solver_type(param)]


def clip_factor(param, grads, ops=NUMPY):
    """Caffe's ClipGradients: the factor clip/‖g‖ when the global L2 norm exceeds clip_gradients, else 1."""
    clip = param.clip_gradients
    if clip < 0 or not grads:
        return None
    norm = ops.sqrt(sum(ops.sum(g * g) for g in grads))
    return ops.where(norm > clip, clip / ops.where(norm > 0, norm, 1.0), 1.0)


def regularize(param, weight, grad, decay_mult, ops=NUMPY):
    """Caffe's Regularize: g + local_decay * w (L2) or g + local_decay * sign(w) (L1)."""
    local_decay = param.weight_decay * decay_mult
    if not local_decay:
        return grad
    if param.regularization_type == "L1":
        return grad + local_decay * ops.sign(weight)
    return grad + local_decay * weight


def update_value(kind, param, grad, history, local_rate, iteration, ops=NUMPY):
    """Caffe's ComputeUpdateValue for one blob: (the diff to subtract from w, new history tuple).

    `history` holds this blob's one (or two, for AdaDelta and Adam) history
    values; `iteration` is the solver's iter before the update.
    """
    momentum, delta = param.momentum, param.delta
    if kind == "SGD":
        (v,) = history
        v = momentum * v + local_rate * grad
        return v, (v,)
    if kind == "Nesterov":
        (v_prev,) = history
        v = momentum * v_prev + local_rate * grad
        return (1.0 + momentum) * v - momentum * v_prev, (v,)
    if kind == "AdaGrad":
        (h,) = history
        h = h + grad * grad
        return local_rate * (grad / (ops.sqrt(h) + delta)), (h,)
    if kind == "RMSProp":
        (h,) = history
        decay = param.rms_decay
        h = (1.0 - decay) * (grad * grad) + decay * h
        return local_rate * (grad / (ops.sqrt(h) + delta)), (h,)
    if kind == "AdaDelta":
        h, h2 = history
        h = (1.0 - momentum) * (grad * grad) + momentum * h
        step = grad * ops.sqrt((h2 + delta) / (h + delta))
        h2 = (1.0 - momentum) * (step * step) + momentum * h2
        return local_rate * step, (h, h2)
    if kind == "Adam":
        m, v = history
        beta1, beta2 = param.momentum, param.momentum2
        t = iteration + 1
        correction = ops.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
        m = (1.0 - beta1) * grad + beta1 * m
        v = (1.0 - beta2) * (grad * grad) + beta2 * v
        return (local_rate * correction) * (m / (ops.sqrt(v) + delta)), (m, v)
    raise ValueError(f"unknown solver type '{kind}'")


def effective_grads(param, weights, grads, decay_mults, ops=NUMPY):
    """The diffs ComputeUpdateValue sees: clipped, divided by iter_size, regularized (Caffe's order)."""
    factor = clip_factor(param, grads, ops)
    result = []
    for w, g, decay_mult in zip(weights, grads, decay_mults):
        if factor is not None:
            g = g * factor
        if param.iter_size > 1:
            g = g * (1.0 / param.iter_size)
        result.append(regularize(param, w, g, decay_mult, ops))
    return result


def local_rate(rate, lr_mult):
    return rate if lr_mult == 1 else rate * lr_mult


def apply_update(param, weights, grads, history, rate, iteration, lr_mults, decay_mults, ops=NUMPY):
    """Caffe's SGDSolver::ApplyUpdate: clip, normalize by iter_size, regularize, update.

    `grads` are the diffs summed over iter_size passes; `history` is the flat
    list in SolverState order. Returns (new weights, new history list).
    """
    kind = solver_type(param)
    n = len(weights)
    sets = SOLVER_TYPES[kind]
    new_weights, new_history = [], [None] * (n * sets)
    for i, (w, g) in enumerate(zip(weights, effective_grads(param, weights, grads, decay_mults, ops))):
        diff, hist = update_value(kind, param, g, [history[s * n + i] for s in range(sets)],
                                  local_rate(rate, lr_mults[i]), iteration, ops)
        new_weights.append(w - diff)
        for s in range(sets):
            new_history[s * n + i] = hist[s]
    return new_weights, new_history
