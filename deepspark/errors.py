"""The errors DeepSpark reports as one line, and the map that points them at FILE:LINE:COL."""


class DeepSparkError(Exception):
    """An error the `deepspark` command reports as one line (exit status 1), and a notebook too: IPython shows an
    exception's _render_traceback_ lines in place of its traceback."""

    def _render_traceback_(self):
        """The error's one line, first and alone: a Spark job's whole report is in the fit's log, and where it was
        raised in the exception's __traceback__."""
        return [f"{type(self).__name__}: {self}"]


class ConfigError(DeepSparkError):
    """A bad input file: one line, `FILE:LINE:COL: what is wrong`."""

    def __init__(self, message, filename=None, line=None, col=None):
        self.message = message
        self.filename = filename
        self.line = line
        self.col = col
        super().__init__(str(self))

    def __str__(self):
        where = [str(x) for x in (self.filename, self.line, self.col) if x is not None]
        return ": ".join([":".join(where), self.message]) if where else self.message


class SourceMap:
    """Where each top-level `layer { }` block of a prototxt starts, and its fields.

    Protobuf's text parser reports positions only for syntax errors; the graph's
    semantic errors (unknown bottom, bad shape) point at the layer through this map.
    """

    def __init__(self, filename, layers=None, notes=None):
        self.filename = filename
        self.layers = layers or []  # per layer: {"layer": (line, col), field: (line, col)}
        self.notes = list(notes or [])  # what reading the file found that Caffe only logs (an old net's upgrade)

    def where(self, layer_index, field=None):
        """(filename, line, col) of a layer, or of one of its top-level fields."""
        if layer_index is None or layer_index >= len(self.layers):
            return self.filename, None, None
        fields = self.layers[layer_index]
        line, col = fields.get(field) or fields["layer"]
        return self.filename, line, col

    def error(self, message, layer_index=None, field=None):
        return ConfigError(message, *self.where(layer_index, field))
