"""The RPC vocabulary both sides share: a reasoned refusal with its status code
(``refusals``), the Session stream's framing of many requests on one call
(``multiplex``), the de-duplication of a re-issued request (``unique_requests``), and
what to answer a message that does not decode (``undecodable``)."""
