"""A large message's payload gathered once, into a buffer of its size, as its bytes arrive.

nats-py's parser appends every read from the socket to one growing buffer and, once a message's payload is all
there, slices it out and converts the slice to `bytes`: a payload is copied three times by the parser alone. For
a message (without headers) of `GATHER_BYTES` or more, this parser instead copies each read straight into a
buffer of the payload's size and hands that buffer (a `bytearray`) to the subscription as the message's data;
everything else (control lines, small messages, messages with headers) goes through nats-py's own code.
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, CRLF_SIZE, ProtocolError
from nats.protocol.parser import Parser as NatsParser

GATHER_BYTES = 256 * 1024  # a payload this large is gathered; smaller ones are cheap either way
_CRLF = b"\r\n"


class Parser(NatsParser):
    """nats-py's parser with large payloads gathered in place (install before the client connects)."""

    def reset(self) -> None:
        super().reset()
        self.payload: bytearray | None = None  # the payload being gathered, with room for its CRLF
        self.have = 0

    async def parse(self, data: bytes = b"") -> None:
        view = memoryview(data)
        while True:
            if self.payload is None:
                if not (self.state == AWAITING_MSG_PAYLOAD and self.header_needed == 0 and self.needed >= GATHER_BYTES
                        and len(self.buf) < self.needed + CRLF_SIZE):
                    break
                self.payload = bytearray(self.needed + CRLF_SIZE)  # a large payload starts: what nats-py holds first
                self.have = len(self.buf)
                self.payload[: self.have] = self.buf
                del self.buf[:]
            take = min(len(view), len(self.payload) - self.have)
            self.payload[self.have : self.have + take] = view[:take]
            self.have += take
            view = view[take:]
            if self.have < len(self.payload):
                return
            payload, self.payload = self.payload, None
            if payload[-CRLF_SIZE:] != _CRLF:
                raise ProtocolError("nats: a message's payload is longer than its size")
            del payload[-CRLF_SIZE:]  # at the end: no copy
            args, self.state = self.msg_arg, AWAITING_CONTROL_LINE
            await self.nc._process_msg(args["sid"], args["subject"], args["reply"], payload, None)
        if len(view):
            await super().parse(view)


def client() -> Client:
    """A nats-py client, not yet connected, that parses with `Parser`."""
    nc = Client()
    nc._ps = Parser(nc)
    return nc
