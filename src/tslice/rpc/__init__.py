"""The RPC vocabulary both sides share: a reasoned refusal with its status code
(``refusals``), many requests on one long-lived stream, each id unique while in flight
(``multiplex``: the Session and GrantStream framing, client and server side), and what
to answer a message that does not decode (``undecodable``)."""
