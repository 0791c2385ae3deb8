"""Who may do what, and over which channel: identities and roles (``auth``: verifiers,
principals, the rule of every RPC), TLS on both sides (``tls``), and the term that fences
a deposed orchestrator leader (``leader_term``).

Identities are literal (DESIGN.md, invariant 6). The job side imports ``tls``; nothing
here imports the servers.
"""
