"""Who may do what, and over which channel.

- ``identities``: who a caller is: principals, the ``tokens:``/``identities:`` grants,
  the verifiers (static tokens, certificate identities, a pluggable one), the ``auth:``
  settings. Identities are literal (DESIGN.md, invariant 6).
- ``roles``: what a caller may do: the rule of every RPC of both servers, the
  interceptor that enforces them, the caller's principal for the handlers.
- ``tls``: TLS on both sides (server and client credentials, tokens to send).
- ``leader_term`` and ``fencing``: the orchestrator leader's term, and the agent's fence
  that refuses a deposed leader's directives (the term is stored through a
  ``fencing.TermStore`` the agent passes in).
- ``admission``: who may register a workload on an agent's workload channel (the bound
  process, a job credential, in Kubernetes mode the pod); the agent passes in its
  process bindings and pods as Protocols.
- ``certs``: a development CA and certificates (``tslice certs``).

Below the four layers: it imports none of them, nor the server plumbing. The job side
imports ``tls``.
"""
