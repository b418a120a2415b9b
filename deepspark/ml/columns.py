"""A Model's transform on the executors: the mapInArrow function that runs the net over each Arrow batch of rows and
appends its outputs as columns (a prediction as a double, a blob as a Spark ML vector), in classic Spark and
under Spark Connect alike."""

import numpy as np
import pyarrow as pa

from deepspark.ml import images

# A Spark ML DenseVector as Arrow carries it (VectorUDT's sqlType, `type` 1).
VECTOR_TYPE = pa.struct([pa.field("type", pa.int8(), nullable=False), ("size", pa.int32()),
                         ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))])
DENSE = 1


class Held:
    """A value a task carries in its closure, read as a Spark broadcast is (`.value`): the weights under Spark
    Connect, which has no broadcasts."""

    def __init__(self, value):
        self.value = value


def dense_vectors(matrix):
    """An Arrow column of Spark ML DenseVectors, one per row of `matrix`."""
    n, width = matrix.shape
    values = pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)),
                                      pa.array(np.ascontiguousarray(matrix, np.float64).ravel()))
    return pa.StructArray.from_arrays([pa.array(np.full(n, DENSE, np.int8)), pa.nulls(n, pa.int32()),
                                       pa.nulls(n, pa.list_(pa.int32())), values], fields=list(VECTOR_TYPE))


def with_outputs(forward, inputs, columns, skip):
    """The mapInArrow function of a transform: each batch with its new `columns` appended, from the images of
    inputs.column (frames.Inputs); columns: [(kind, output, column name)] with kind "prediction" (the argmax of the
    output, a double) or "vector" (the output's values for the row). A row with no image of the net's shape stops the task
    with one line naming it, or, with `skip`, is left out."""

    def run(batches):
        for number, batch in enumerate(batches):
            values = batch.column(batch.schema.get_field_index(inputs.column))
            what = f"inputCol '{inputs.column}' (Arrow batch {number} of a partition)"
            if inputs.kind == images.DATUM and not skip and not values.null_count:
                found = values.to_pylist()  # the Forward decodes a batch's Datums at once, and names a bad one
            else:
                found, ok = images.column_images(values, inputs.kind, inputs.shape)
                if not ok.all():
                    if not skip:
                        raise images.bad_row(values, inputs.kind, inputs.shape, ok, what)
                    batch = batch.filter(pa.array(ok))
            outputs = run_net(forward, found, what)
            for kind, name, column in columns:
                flat = outputs[name].reshape(len(found), -1)
                batch = batch.append_column(
                    column, pa.array(flat.argmax(axis=1).astype(np.float64)) if kind == "prediction"
                    else dense_vectors(flat))
            yield batch

    return run


def run_net(forward, found, what):
    """{output: its values for each of the images `found` (arrays, or Datum bytes)}, forward.batch_size images at a
    time (the last batch padded)."""
    size = forward.batch_size
    parts = {}
    for start in range(0, len(found), size):
        chunk = found[start:start + size]
        out = forward.forward_batch([(f"{what}, row {start + i}", image) for i, image in enumerate(chunk)], pad=True)
        for name in forward.outputs:
            parts.setdefault(name, []).append(np.asarray(out[name]))
    if not parts:
        return {name: np.zeros((0, 1), np.float32) for name in forward.outputs}
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}
