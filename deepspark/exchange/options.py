"""ExchangeOptions: what the exchanger reads of a job's DeepSparkParameter, in one value for its server, clients and rule."""

import dataclasses

from deepspark.proto import deepspark_pb2 as pb

from deepspark.exchange import codec as C

# Each option's field of DeepSparkParameter: proto/deepspark.proto declares it, with its default and its meaning.
FIELDS = {
    "codec": "exchange_codec",          # how model frames travel: the codec itself (codec.CODECS), looked up once
    "integrity": "exchange_integrity",  # tag every frame after the handshake
    "timeout": "exchange_timeout",      # seconds either side waits on the other: the server's idle timeout,
                                        # the worker's wait for a reply, a synchronous round's
    "moving_rate": "moving_rate",       # the EASGD rule's α, its decay and floor, and the center's share of d
    "moving_rate_gamma": "moving_rate_gamma",
    "moving_rate_step": "moving_rate_step",
    "moving_rate_limit": "moving_rate_limit",
    "server_factor": "server_factor",
    "rate_weighted": "rate_weighted",   # the EASGD rule weighs each exchange by the worker's share of the top rate
    "straggler_share": "straggler_share",  # under it a worker exchanges by its progress, the center taking the gain
    "straggler_gain": "straggler_gain",
}


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
    """The exchanger's knobs of one job (FIELDS names each one's field of the schema); made by `of`, never with
    defaults of its own."""

    codec: object  # a codec of codec.CODECS
    integrity: bool
    timeout: float
    moving_rate: float
    moving_rate_gamma: float
    moving_rate_step: int
    moving_rate_limit: float
    server_factor: float
    rate_weighted: bool
    straggler_share: float
    straggler_gain: float

    @classmethod
    def of(cls, ds=None, **changes):
        """The options of DeepSparkParameter `ds` (None: the schema's defaults), with `changes` over them
        (a codec by name, by the schema's number, or itself)."""
        ds = pb.DeepSparkParameter() if ds is None else ds
        values = {name: getattr(ds, field) for name, field in FIELDS.items()}
        values.update(changes)
        values["codec"] = C.get(values["codec"])
        return cls(**values)

    def but(self, **changes):
        """These options with `changes` over them (of's)."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return self if not changes else ExchangeOptions.of(None, **{**values, **changes})
