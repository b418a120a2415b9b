"""Caffe's phase filter: which layers a NetState includes."""

from deepspark.proto import deepspark_pb2 as pb


def state_meets_rule(state, rule):
    """Caffe's Net::StateMeetsRule."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    return all(s in stages for s in rule.stage) and not any(s in stages for s in rule.not_stage)


def layer_included(layer, state):
    if layer.include:
        return any(state_meets_rule(state, rule) for rule in layer.include)
    return not any(state_meets_rule(state, rule) for rule in layer.exclude)


def make_state(net_param, phase=None, stages=None, level=None):
    state = pb.NetState()
    state.CopyFrom(net_param.state)
    if phase is not None:
        state.phase = phase
    if stages is not None:
        del state.stage[:]
        state.stage.extend(stages)
    if level is not None:
        state.level = level
    return state
