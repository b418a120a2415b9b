"""The ParameterExchanger: authenticated TCP exchange of flat float32 parameters for asynchronous EASGD."""

from .client import ExchangeClient, NonFiniteError
from .protocol import ProtocolError, RefusedError
from .server import ExchangeServer

__all__ = ["ExchangeServer", "ExchangeClient", "ProtocolError", "RefusedError", "NonFiniteError"]
