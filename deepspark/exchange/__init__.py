"""The ParameterExchanger: authenticated TCP exchange of flat float32 parameters; the algorithms' handlers (deepspark.algorithms) say what a frame does."""

from deepspark.exchange.client import ExchangeClient, NonFiniteError, OverlappedExchange
from deepspark.exchange.handlers import Handler
from deepspark.exchange.options import ExchangeOptions
from deepspark.exchange.protocol import CodecError, ProtocolError, RefusedError
from deepspark.exchange.server import ExchangeServer

__all__ = ["ExchangeServer", "ExchangeClient", "ExchangeOptions", "OverlappedExchange", "Handler", "ProtocolError",
           "RefusedError", "NonFiniteError", "CodecError"]
