"""Where a feeder is in its shard, saved and restored: the same batches again from another feeder of the same shard."""

import numpy as np


class Resumable:
    """get_state and set_state of a feeder that reads `size` items of its shard in an order: its `_position`
    and `epoch`, this epoch's `_order` (None: in order), its `order_rng` and its transformer's rng."""

    unit = "records"  # what the shard holds, as an error names it

    def get_state(self):
        """(position, epoch, RNG states) as JSON-able values, and this epoch's order."""
        meta = {"position": self._position, "epoch": self.epoch, "size": self.size,
                "order_rng": self.order_rng.bit_generator.state,
                "transform_rng": self.transformer.rng.bit_generator.state}
        return meta, self._order

    def set_state(self, meta, order):
        if meta["size"] != self.size or (order is not None and len(order) != self.size):
            raise ValueError(f"{self.name}: the state is of a shard of {meta['size']} {self.unit}, not {self.size}")
        self._position, self.epoch = int(meta["position"]), int(meta["epoch"])
        self.order_rng.bit_generator.state = meta["order_rng"]
        self.transformer.rng.bit_generator.state = meta["transform_rng"]
        self._order = None if order is None else np.asarray(order, dtype=np.int64)
