"""The ParameterExchanger: authenticated TCP exchange of flat float32 parameters for asynchronous EASGD (and synchronous rounds)."""

from .client import ExchangeClient, NonFiniteError, OverlappedExchange
from .handlers import EasgdHandler, RoundsHandler
from .options import ExchangeOptions
from .protocol import ProtocolError, RefusedError
from .server import ExchangeServer

__all__ = ["ExchangeServer", "ExchangeClient", "ExchangeOptions", "OverlappedExchange", "EasgdHandler",
           "RoundsHandler", "ProtocolError", "RefusedError", "NonFiniteError"]
