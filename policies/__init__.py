"""Pure decision logic: the layer map, checkpoint policies and the recovery plan.

Nothing here imports Ray, torch.distributed, DeepSpeed or pyarrow, or touches storage: every
function is a value in, value out, so the decisions can be unit-tested and replayed.
"""
