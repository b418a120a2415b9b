"""The SSD fork's detection evaluation: ComputeAP's average precision per class and the mAP its solver's TestDetection reports from DetectionEvaluate's rows (eval_type "detection")."""

import collections

import numpy as np

from deepspark.errors import ConfigError

EVAL_TYPES = ("classification", "detection")  # the fork's SolverParameter.eval_type; Solver::Test aborts on others
AP_VERSIONS = ("11point", "MaxIntegral", "Integral")  # the fork's SolverParameter.ap_version, Integral its default


def average_precision(true_pos, false_pos, scores, positives, ap_version="Integral"):
    """The fork's ComputeAP for one class in its float arithmetic: detections best first (a stable sort),
    cumulative precision and recall over `positives` ground-truth boxes, then VOC2007's 11 recall points,
    VOC2012's MaxIntegral or the natural Integral of precision over recall; 0 without detections or boxes."""
    if ap_version not in AP_VERSIONS:
        raise ConfigError(f"unknown ap_version '{ap_version}'; the fork's: {', '.join(AP_VERSIONS)}")
    if not len(scores) or positives == 0:
        return np.float32(0)
    order = np.argsort(-np.asarray(scores, np.float32), kind="stable")
    tp, fp = (np.cumsum(np.asarray(x, int)[order]) for x in (true_pos, false_pos))
    f32, eps = np.float32, np.float32(1e-6)
    prec = (tp.astype(f32) / (tp + fp).astype(f32)).astype(f32)
    rec = (tp.astype(f32) / f32(positives)).astype(f32)
    ap = f32(0)
    if ap_version == "11point":
        best = np.zeros(11, f32)
        start = len(rec) - 1
        for j in range(10, -1, -1):
            for i in range(start, -1, -1):
                if rec[i] < j / 10.0:
                    start = i
                    if j > 0:
                        best[j - 1] = best[j]
                    break
                best[j] = max(best[j], prec[i])
        for j in range(10, -1, -1):
            ap = f32(ap + best[j] / f32(11))
    elif ap_version == "MaxIntegral":
        cur_rec, cur_prec = rec[-1], prec[-1]
        for i in range(len(rec) - 2, -1, -1):
            cur_prec = max(prec[i], cur_prec)
            if abs(f32(cur_rec - rec[i])) > eps:
                ap = f32(ap + cur_prec * abs(f32(cur_rec - rec[i])))
            cur_rec = rec[i]
        ap = f32(ap + cur_rec * cur_prec)
    else:
        previous = f32(0)
        for i in range(len(rec)):
            if abs(f32(rec[i] - previous)) > eps:
                ap = f32(ap + prec[i] * abs(f32(rec[i] - previous)))
            previous = rec[i]
    return ap


def mean_average_precision(results, ap_version="Integral"):
    """The mAP the fork's solver reports for a detection test net (eval_type "detection"), from its
    DetectionEvaluate tops over the test iterations (each 1 x 1 x R x 5): (mAP, {class: AP}). Rows [-1, class,
    positives, ...] add up each class's ground-truth boxes; a detection row that is neither true nor false
    positive (a difficult box's) is left out; a class with boxes and no detection scores no AP and still
    counts in the mean, as the fork's."""
    positives, found = {}, {}
    for rows in results:
        for item, label, score, tp, fp in np.asarray(rows, np.float32).reshape(-1, 5):
            if int(item) == -1:
                positives[int(label)] = positives.get(int(label), 0) + int(score)
            elif int(tp) or int(fp):
                found.setdefault(int(label), []).append((score, int(tp), int(fp)))
    aps = {label: average_precision([d[1] for d in found[label]], [d[2] for d in found[label]],
                                    [d[0] for d in found[label]], count, ap_version)
           for label, count in sorted(positives.items()) if label in found}
    total = np.float32(0)
    for ap in aps.values():
        total = np.float32(total + ap)
    return (float(total / np.float32(len(positives))) if positives else 0.0), {k: float(v) for k, v in aps.items()}


def ap_version_of(solver_param):
    """The ap_version a solver's tests report mAP with (eval_type "detection"), None for "classification" (each
    output's mean); a ConfigError naming the field for another eval_type or ap_version (the fork aborts on them)."""
    if solver_param is None or solver_param.eval_type == "classification":
        return None
    if solver_param.eval_type not in EVAL_TYPES:
        raise ConfigError(f"solver: unknown eval_type '{solver_param.eval_type}'; the fork's: {', '.join(EVAL_TYPES)}")
    if solver_param.ap_version not in AP_VERSIONS:
        raise ConfigError(f"solver: unknown ap_version '{solver_param.ap_version}'; the fork's: "
                          f"{', '.join(AP_VERSIONS)}")
    return solver_param.ap_version


def pass_map(iterations, ap_version):
    """The fork's TestDetection over a test pass: {output: its mAP} from [{output: DetectionEvaluate rows}], one
    dict per test iteration, outputs by name. Every output must be rows of width 5, as the fork CHECKs. Where an
    output has no detection row at all the fork prints nothing (or aborts); this gives 0 for it."""
    rows = collections.OrderedDict()
    for outputs in iterations:
        for name, value in sorted(outputs.items()):
            value = np.asarray(value, np.float32)
            if value.ndim == 0 or value.shape[-1] != 5:
                shape = "x".join(map(str, value.shape))
                raise ConfigError(f"eval_type detection: test net output '{name}' is {shape}, not DetectionEvaluate's "
                                  "rows of width 5; use eval_type classification")
            rows.setdefault(name, []).append(value)
    return collections.OrderedDict((name, mean_average_precision(found, ap_version)[0])
                                   for name, found in rows.items())
